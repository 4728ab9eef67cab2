"""How close does a one-run audit come to the claimed epsilon? lower bound / claimed at 1, 4, 8.

Both bounds the audit reports, from the same scores: the (epsilon, delta) bound of Steinke, Nasr
and Jagielski ("snj") and the f-DP Gaussian bound of Mahloujifar, Melis and Chaudhuri ("fdp").

Two settings, both with m canaries, delta = 1e-5, 95% confidence and the default guessing rules
(Bonferroni over them):

* `gaussian`: the idealized setting of Steinke, Nasr and Jagielski (2023, Section 7): one
  Gaussian mechanism release per canary, score = its coordinate of y = S / sigma + N(0, 1), sigma
  calibrated so that the release is (epsilon, delta)-DP. No training; the ceiling of the method.
* `dpsgd`: white-box all-iterates audits of DP-SGD on a linear model (random data, the noise
  multiplier calibrated by the PRV accountant for the epsilon): full batch (q = 1, 10 steps) and
  Poisson batches (q = 0.1, 100 steps).

    python scripts/audit_tightness.py                   # m = 2000, 3 repetitions
    python scripts/audit_tightness.py --canaries 10000 --repeats 1 --settings gaussian
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dptrain.accounting import get_noise_multiplier
from dptrain.audit import AuditResult, audit_scores, one_run
from dptrain.privacy.engine import PrivacyEngine

DELTA = 1e-5
EPSILONS = (1.0, 4.0, 8.0)


def ratios(result: AuditResult) -> tuple[float, float]:
    """(snj, fdp): each lower bound / the claimed epsilon."""
    return (result.lower_bound / result.claimed_epsilon,
            result.fdp_lower_bound / result.claimed_epsilon)


def gaussian_ratio(epsilon: float, canaries: int, seed: int) -> tuple[float, float]:
    """lower / claimed for the idealized Gaussian mechanism (one release per canary)."""
    sigma = get_noise_multiplier(target_epsilon=epsilon, target_delta=DELTA, sample_rate=1.0,
                                 steps=1, accountant="prv")
    rng = np.random.default_rng(seed)
    included = rng.random(canaries) < 0.5
    scores = included / sigma + rng.standard_normal(canaries)
    result = audit_scores(scores, included, kind="white_box", score="gaussian",
                          claimed_epsilon=epsilon, delta=DELTA)
    return ratios(result)


def dpsgd_ratio(epsilon: float, canaries: int, seed: int, sample_rate: float,
                steps: int, features: int = 2000, size: int = 500) -> tuple[float, float]:
    """lower / claimed for a white-box all-iterates audit of DP-SGD on Linear(features, 10)."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    data = TensorDataset(torch.randn(size, features, generator=gen),
                         torch.randint(0, 10, (size,), generator=gen))
    model = nn.Linear(features, 10)
    engine = PrivacyEngine(accountant="prv", seed=seed, reproducible_mechanism=True)  # repeatable
    module, optimizer, loader = engine.make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(data, batch_size=round(sample_rate * size)),
        target_epsilon=epsilon, target_delta=DELTA, epochs=steps * sample_rate,
        max_grad_norm=1.0)

    def train() -> None:
        done = 0
        while done < steps:
            for x, y in loader:
                optimizer.zero_grad()
                nn.functional.cross_entropy(module(x), y).backward()
                optimizer.step()
                done += 1
                if done == steps:
                    return

    result = one_run(train, engine=engine, delta=DELTA, canaries=canaries, seed=seed)
    return ratios(result)


def measure(settings: Sequence[str], canaries: int, repeats: int) -> list[dict]:
    rows = []
    runs = {"gaussian": lambda eps, seed: gaussian_ratio(eps, canaries, seed),
            "dpsgd q=1, 10 steps": lambda eps, seed: dpsgd_ratio(eps, canaries, seed, 1.0, 10),
            "dpsgd q=0.1, 100 steps": lambda eps, seed: dpsgd_ratio(eps, canaries, seed, 0.1, 100)}
    for name, run in runs.items():
        if name.split()[0] not in settings:
            continue
        for epsilon in EPSILONS:
            start = time.perf_counter()
            snj, fdp = zip(*[run(epsilon, seed) for seed in range(repeats)])
            rows.append({"setting": name, "epsilon": epsilon, "canaries": canaries,
                         "ratios": [round(r, 3) for r in snj],
                         "mean_ratio": round(float(np.mean(snj)), 3),
                         "fdp_ratios": [round(r, 3) for r in fdp],
                         "fdp_mean_ratio": round(float(np.mean(fdp)), 3),
                         "seconds": round(time.perf_counter() - start, 1)})
            print(f"{name:<24s} eps={epsilon:<4g} m={canaries:<6d} lower/claimed: snj "
                  f"{np.mean(snj):.2f} ({', '.join(f'{r:.2f}' for r in snj)}), fdp "
                  f"{np.mean(fdp):.2f} ({', '.join(f'{r:.2f}' for r in fdp)})  "
                  f"{rows[-1]['seconds']:.1f} s", flush=True)
    return rows


def main(argv: Sequence[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--canaries", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--settings", nargs="+", default=["gaussian", "dpsgd"],
                        choices=["gaussian", "dpsgd"])
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", "The noise is reproducible", UserWarning)  # seeded on purpose
    rows = measure(args.settings, args.canaries, args.repeats)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(rows, handle, indent=2)
    return rows


if __name__ == "__main__":
    main()
