"""Record the `random-allocation` package's epsilons on a grid, as a test fixture.

The package (Feldman and Shenfeld 2025, "Privacy amplification by random allocation") pins
numpy < 2.2, so it is not a dependency of dptrain: run this script in its own environment,

    python -m venv /tmp/ra && /tmp/ra/bin/pip install random-allocation pandas
    /tmp/ra/bin/python scripts/random_allocation_reference.py

It writes tests/accounting/data/random_allocation_reference.json, read by
tests/accounting/test_random_allocation.py. For each (sigma, steps per epoch, epochs, delta)
point it records, for one example allocated to one of the epoch's steps (num_selected = 1),
add/remove ("both" directions: the max of the two):

- `rdp_dco`: the RDP analysis of Dong, Chen and Ozgur 2025 (the issue's "RDP" figure);
- `direct`: Feldman-Shenfeld's RDP analysis (orders 2..60, as the package's experiments), and
  `direct_remove` its remove direction alone (their exact remove-direction RDP);
- `combined`: the package's tightest upper bound (min over its local, analytic, direct,
  recursive and, for one epoch, decomposition analyses, per direction, then the max);
- `combined_remove`, `combined_add`: the same per direction;
- `lower`: its lower bound on epsilon (one epoch only; null otherwise).
No Monte Carlo figure is recorded: it is not a bound.
"""

from __future__ import annotations

import json
import sys
import time
from importlib.metadata import version
from pathlib import Path

from random_allocation.comparisons.definitions import Direction, PrivacyParams, SchemeConfig, Verbosity
from random_allocation.random_allocation_scheme import (
    allocation_epsilon_combined,
    allocation_epsilon_direct,
    allocation_epsilon_lower_bound,
    allocation_epsilon_RDP_DCO,
)

# (sigma, steps per epoch, epochs, delta): the scale point first.
GRID = [
    (1.0, 10, 3, 1e-4), (1.0, 10, 1, 1e-4), (1.0, 10, 10, 1e-5), (0.8, 10, 1, 1e-5),
    (0.8, 20, 3, 1e-5), (1.5, 10, 1, 1e-6), (1.5, 50, 5, 1e-5), (2.0, 20, 1, 1e-5),
    (2.0, 50, 10, 1e-6), (3.0, 10, 3, 1e-5), (3.0, 100, 1, 1e-5), (5.0, 50, 20, 1e-5),
    (1.2, 100, 3, 1e-4), (0.7, 5, 2, 1e-4),
]
OUT = Path(__file__).resolve().parents[1] / "tests/accounting/data/random_allocation_reference.json"


def point(sigma: float, steps: int, epochs: int, delta: float) -> dict:
    params = PrivacyParams(sigma=sigma, num_steps=steps, num_epochs=epochs, delta=delta)
    config = SchemeConfig(verbosity=Verbosity.NONE, allocation_direct_alpha_orders=list(range(2, 61)))
    row = {"sigma": sigma, "steps_per_epoch": steps, "epochs": epochs, "delta": delta}
    row["rdp_dco"] = allocation_epsilon_RDP_DCO(params, config, Direction.BOTH)
    row["direct"] = allocation_epsilon_direct(params, config, Direction.BOTH)
    row["direct_remove"] = allocation_epsilon_direct(params, config, Direction.REMOVE)
    row["combined_remove"] = allocation_epsilon_combined(params, config, Direction.REMOVE)
    row["combined_add"] = allocation_epsilon_combined(params, config, Direction.ADD)
    row["combined"] = max(row["combined_remove"], row["combined_add"])
    row["lower"] = allocation_epsilon_lower_bound(params, config, Direction.BOTH) if epochs == 1 else None
    return {k: (float(v) if isinstance(v, float) else v) for k, v in row.items()}


def main() -> None:
    rows = []
    for p in GRID:
        t = time.time()
        rows.append(point(*p))
        print(rows[-1], f"{time.time() - t:.1f}s", file=sys.stderr, flush=True)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"package": "random-allocation", "version": version("random-allocation"),
                               "num_selected": 1, "points": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
