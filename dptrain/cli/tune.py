"""`dptrain tune`: a sweep with a random number of trials, whose best job costs less to release.

    dptrain tune --poisson 4 optimizer.lr=0.05,0.1,0.2 privacy=sigma privacy.noise_multiplier=1
    dptrain tune --tnb 1 0.25 optimizer.lr=0.05,0.1,0.2 ...      # eta = 1 (geometric), gamma

Papernot and Steinke (ICLR 2022): run K trials, K drawn independently of the data (Poisson with
mean MU, or truncated negative binomial with shape ETA and GAMMA), each trial's hyperparameters
drawn uniformly from the grid, and release only the best trial. The command draws K and the K
grid points (with replacement) from OS entropy, writes them to `tuning.json` in the sweep folder
before anything is trained, with what a trial of every grid point will spend (`grid_costs`: the
per-trial bound must hold for the points that were not drawn too), runs trial i as job i of that folder (`dptrain -m OVERRIDES
hydra.sweep.subdir=i`), and ends like `dptrain -m`: the table, the plot, `sweep_summary.json` and
`sweep_ledger.json`, which state both costs of releasing the best job (dptrain.cli.sweep_ledger).

The overrides are those of `dptrain -m` (comma lists and range() span the grid); the sweep folder
is `hydra.sweep.dir` (default multirun/DATE/TIME, as Hydra's). Draw once: running the command
again until K or the grid points suit you voids the random-stopping bound, and so does stopping
early or releasing anything but the best trial. Bad input prints one line
`dptrain tune: error: ...` and exits with status 2.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import itertools
import secrets
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dptrain.accounting.tuning import Trials, poisson_trials, truncated_negative_binomial_trials
from dptrain.cli.args import OneLineParser, fail
from dptrain.errors import ConfigError, DPTrainError

PROG = "dptrain tune"
SWEEP_DIR_KEY = "hydra.sweep.dir"
# What each trial adds to the user's overrides: the sweep's own summary is written once, at the end.
TRIAL_OVERRIDES = ("~hydra.callbacks.sweep_summary",)


class _OneLineParser(OneLineParser):
    program = PROG


def _parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog=PROG, description="Run a random number of trials of a grid "
                            "(Papernot and Steinke 2022) and state what releasing the best costs.")
    draw = parser.add_mutually_exclusive_group(required=True)
    draw.add_argument("--poisson", type=float, metavar="MEAN",
                      help="K ~ Poisson(MEAN) trials (K = 0 is possible: then nothing is trained)")
    draw.add_argument("--tnb", type=float, nargs=2, metavar=("ETA", "GAMMA"),
                      help="K ~ truncated negative binomial(ETA > -1, GAMMA in (0, 1)): K >= 1; "
                           "ETA = 1 is geometric with mean 1/GAMMA")
    parser.add_argument("-v", "--verbose", action="store_true", help="tracebacks for errors")
    parser.add_argument("overrides", nargs="*", metavar="OVERRIDE",
                        help="dptrain overrides; comma lists and range() span the grid")
    return parser


def expand_grid(overrides: Sequence[str]) -> tuple[list[str], list[list[str]]]:
    """(fixed, grid): the overrides every trial takes, and the grid points the sweep overrides
    span (their cartesian product, as Hydra's basic sweeper forms it). hydra.* keys are fixed."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException as error:
        raise ConfigError(f"The overrides cannot be parsed: {' '.join(str(error).split())}. "
                          "Write them as for `dptrain -m` (key=a,b,c).") from None
    fixed, axes = [], []
    for override in parsed:
        key = override.get_key_element()
        if override.is_sweep_override() and not key.startswith("hydra."):
            axes.append([f"{key}={value}" for value in override.sweep_string_iterator()])
        else:
            fixed.append(override.input_line)
    return fixed, [list(point) for point in itertools.product(*axes)]


def secret_rng() -> np.random.Generator:
    """A generator seeded from OS entropy: nobody can predict or replay the draws."""
    return np.random.default_rng(secrets.randbits(128))


def _sweep_dir(fixed: list[str]) -> Path:
    """The sweep folder: hydra.sweep.dir when given, else Hydra's multirun/DATE/TIME."""
    for override in fixed:
        key, _, value = override.partition("=")
        if key.lstrip("+") == SWEEP_DIR_KEY:
            return Path(value)
    now = _dt.datetime.now()
    return Path("multirun") / now.strftime("%Y-%m-%d") / now.strftime("%H-%M-%S")


def grid_costs(fixed: list[str], grid: list[list[str]]) -> list[dict[str, Any]]:
    """What a trial of each grid point will spend, computed before anything is drawn or
    trained: {"overrides": the point, "history": its planned (sigma, q, steps) runs or None
    without privacy, "sampling"} (dptrain.cli.build.planned_cost, on the config `dptrain`
    composes for the point). The random-stopping bound needs one per-trial bound that holds for
    every point a trial could have drawn, not only for the points that were drawn. ConfigError
    naming the point that cannot be planned (a trial of it would fail before training)."""
    from hydra import compose, initialize_config_module
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from dptrain.cli.build import planned_cost
    from dptrain.cli.overrides import choose_sigma_option, open_mapping_keys
    from dptrain.cli.suggest import explain

    common = [o for o in fixed if not o.lstrip("+~").startswith("hydra.")]
    costs = []
    with initialize_config_module("dptrain.conf", version_base="1.3"):
        for point in grid:
            argv = [PROG, *common, *point]
            try:
                choose_sigma_option(argv)   # as `dptrain` reads its command line
                open_mapping_keys(argv)
                cost = planned_cost(compose("config", overrides=argv[1:]))
            except (HydraException, OmegaConfBaseException) as error:
                raise ConfigError(f"grid point {' '.join(point) or '(no grid)'}: "
                                  f"{explain(error, argv[1:])}") from None
            except DPTrainError as error:
                raise ConfigError(f"grid point {' '.join(point) or '(no grid)'} cannot be "
                                  f"planned: {error}") from None
            costs.append({"overrides": point, **cost})
    return costs


def draw_trials(trials: Trials, grid: list[list[str]], rng: np.random.Generator) -> list[list[str]]:
    """K ~ `trials`, then K grid points drawn uniformly with replacement: one list of overrides
    per trial."""
    count = trials.draw(rng)
    return [grid[int(i)] for i in rng.integers(len(grid), size=count)]


def _refuse_a_used_folder(sweep_dir: Path) -> None:
    """ConfigError when the sweep folder already holds a sweep (checked before any planning)."""
    from dptrain.cli.sweep_ledger import SWEEP_LEDGER_FILENAME, TUNING_FILENAME

    if sweep_dir.is_dir() and any((sweep_dir / name).exists()
                                  for name in (TUNING_FILENAME, SWEEP_LEDGER_FILENAME, "0")):
        raise ConfigError(f"The sweep folder {str(sweep_dir)!r} ({SWEEP_DIR_KEY}) already holds a "
                          "sweep: choose a new folder. A tuning run cannot be continued or "
                          "redrawn (its bound assumes one draw).")


def _start(sweep_dir: Path, trials: Trials, fixed: list[str], grid: list[list[str]],
           costs: list[dict[str, Any]], drawn: list[list[str]]) -> None:
    """Write tuning.json in a new sweep folder (ConfigError when the folder holds a sweep)."""
    from dptrain.cli.sweep_ledger import TUNING_FILENAME
    from dptrain.io import atomic_write_json, ensure_writable_dir

    _refuse_a_used_folder(sweep_dir)
    ensure_writable_dir(sweep_dir, SWEEP_DIR_KEY)
    atomic_write_json(sweep_dir / TUNING_FILENAME, {
        "trials": trials.to_json(), "fixed_overrides": fixed, "grid": grid,
        "grid_costs": costs,
        "hyperparameters": "each trial: one grid point drawn uniformly, with replacement",
        "jobs": [{"job": str(i), "overrides": point} for i, point in enumerate(drawn)],
        "note": "release only the best trial's model: not the others, not this file, not the "
                "sweep table (they depend on every trial)"})


def run_trials(sweep_dir: Path, fixed: list[str], drawn: list[list[str]], verbose: bool) -> int:
    """Run trial i as job i of `sweep_dir`, one `dptrain -m` each; the number that failed."""
    failed = 0
    for i, point in enumerate(drawn):
        command = [sys.executable, "-m", "dptrain", "-m", *(["-v"] if verbose else []),
                   *[o for o in fixed if o.partition("=")[0].lstrip("+") != SWEEP_DIR_KEY],
                   *point, f"{SWEEP_DIR_KEY}={sweep_dir}", f"hydra.sweep.subdir={i}",
                   *TRIAL_OVERRIDES]
        print(f"{PROG}: trial {i + 1} of {len(drawn)}: {' '.join(point) or '(no grid)'}",
              flush=True)
        failed += subprocess.run(command).returncode != 0
    return failed


def _trials(args: argparse.Namespace) -> Trials:
    if args.poisson is not None:
        return poisson_trials(args.poisson)
    return truncated_negative_binomial_trials(*args.tnb)


def main(argv: Sequence[str] | None = None) -> int:
    """`dptrain tune (--poisson MEAN | --tnb ETA GAMMA) OVERRIDE...`; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        trials = _trials(args)
        fixed, grid = expand_grid(args.overrides)
        sweep_dir = _sweep_dir(fixed)
        _refuse_a_used_folder(sweep_dir)
        costs = grid_costs(fixed, grid)   # every point's cost, fixed before the draw
        drawn = draw_trials(trials, grid, secret_rng())
        _start(sweep_dir, trials, fixed, grid, costs, drawn)
    except DPTrainError as error:
        if args.verbose:
            raise
        fail(PROG, str(error))
    print(f"{PROG}: {len(drawn)} trial(s) drawn (mean {trials.mean():.3g}) from a grid of "
          f"{len(grid)} point(s); the draw is in {sweep_dir}/tuning.json", flush=True)
    if not drawn:
        print(f"{PROG}: K = 0: no trial was drawn, nothing is trained and nothing is released.",
              flush=True)
    failed = run_trials(sweep_dir, fixed, drawn, args.verbose)
    from dptrain.cli.sweep import finish_sweep

    finish_sweep(sweep_dir.resolve())
    if failed:
        sys.stderr.write(f"{PROG}: {failed} trial(s) failed; they still count as trials.\n")
    return 2 if failed else 0
