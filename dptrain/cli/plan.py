"""`dptrain-privacy`: plan a DP-SGD run from the command line, under every accountant.

    dptrain-privacy epsilon --sigma 1.1 --sample-rate 0.004 --steps 10000 --delta 1e-5
    dptrain-privacy epsilon --sigma 1.1 --batch-size 256 --dataset-size 60000 --epochs 60 --delta 1e-5
    dptrain-privacy sigma --target-epsilon 3 --delta 1e-5 --sample-rate 0.004 --epochs 10
    dptrain-privacy epsilon --sigma 1.1 --batch-size 128 --dataset-size 1442 --epochs 30  # delta 1e-5, as dptrain
    ... --accountant prv rdp   # a subset;  --json  for machine-readable output
    ... --sampling shuffle     # fixed-size shuffled batches, accounted without amplification
    ... --noise banded --noise-bands 4   # banded noise (cyclic Poisson in 4 groups); --noise blt

Bad input prints one line `dptrain-privacy: error: ...` and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import warnings
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, NoReturn, Sequence

from dptrain.accounting import ACCOUNTANTS, get_accountant, get_noise_multiplier
from dptrain.accounting.calibration import steps_for
from dptrain.checks import (
    POSITIVE_INT,
    POSITIVE_NUMBER,
    check_delta,
    check_epsilon,
    check_noise_multiplier,
    check_sample_rate,
    default_delta,
)
from dptrain.cli.args import OneLineParser, fail
from dptrain.cli.privacy_config import PrivacyGroup
from dptrain.errors import ConfigError, DPTrainError, PrivacyError
from dptrain.formatting import format_epsilon
from dptrain.privacy.noise import NOISE_KINDS, NoiseStrategy
from dptrain.privacy.plan import COMMAND_SELECTIONS, Clipping, Noise, PrivacyPlan, Selection
from dptrain.privacy.selection import correlated, selection_class

PROG = "dptrain-privacy"
ORDER = ("prv", "rdp", "gdp")  # table order: the default (tight) accountant first


class _OneLineParser(OneLineParser):
    program = PROG


def _fail(message: str) -> NoReturn:
    fail(PROG, message)


@dataclass(frozen=True)
class Horizon:
    """The resolved inputs besides sigma: the batch selection (q, poisson | shuffle |
    cyclic_poisson and its groups; None: the noise's default), the number of steps T, delta and
    the noise strategy (privacy.noise, its bands or buffers)."""

    sample_rate: float
    steps: int
    delta: float
    sampling: str | None = "poisson"
    groups: int | None = None
    noise: str = "independent"
    bands: int | None = None
    buffers: int | None = None

    @cached_property
    def group(self) -> PrivacyGroup:
        """The flags as the command's privacy group (dptrain.cli.privacy_config): `dptrain` and
        this planner read the selection and the noise through the same translation."""
        return PrivacyGroup.parse({
            "name": "sigma", "budget": {"sigma": 1.0},
            "sampling": {"kind": self.sampling, "groups": self.groups},
            "noise": {"kind": self.noise, "bands": self.bands, "buffers": self.buffers}})

    @cached_property
    def selection(self) -> Selection:
        """The batch selection, as `dptrain privacy.sampling=...` picks it."""
        return self.group.selection(self.sample_rate)

    @cached_property
    def strategy(self) -> NoiseStrategy:
        """The noise strategy optimised for the T steps, as `dptrain privacy.noise=...` builds
        it."""
        return self.group.noise_strategy(self.selection, self.steps)

    def plan(self, accountant: str, sigma: float) -> PrivacyPlan:
        """The privacy plan of a run with this horizon, `accountant` and noise multiplier."""
        return PrivacyPlan(selection=self.selection, clipping=Clipping(),
                           noise=Noise(multiplier=sigma, strategy=self.strategy),
                           accountant=accountant, delta=self.delta)


def _count(name: str) -> Callable[[str], int]:
    """argparse type: the flag's value as an int, checked by dptrain.checks.POSITIVE_INT."""
    def parse(text: str) -> int:
        try:
            value: Any = int(text)
        except ValueError:
            value = text
        try:
            return POSITIVE_INT.check(value, name)
        except ConfigError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return parse


def _add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    rate = parser.add_argument_group("sampling (give --sample-rate, or --batch-size and --dataset-size)")
    rate.add_argument("--sample-rate", "-q", type=float, help="Poisson sampling probability q")
    rate.add_argument("--batch-size", type=_count("--batch-size"), help="expected batch size B")
    rate.add_argument("--dataset-size", type=_count("--dataset-size"), help="dataset size N")
    length = parser.add_mutually_exclusive_group(required=True)
    length.add_argument("--steps", type=_count("--steps"), help="number of optimizer steps T")
    length.add_argument("--epochs", type=float,
                        help="passes over the data: T = ceil(epochs * ceil(1 / q)), the steps "
                        "`dptrain train.epochs=EPOCHS` runs")
    parser.add_argument("--delta", type=float,
                        help="target delta, e.g. 1e-5 (default with --dataset-size: 1/(10 N) "
                        "rounded down to a power of ten, as dptrain chooses it)")
    parser.add_argument("--sampling", choices=list(COMMAND_SELECTIONS),
                        default=None,
                        help="batch selection (privacy.sampling): poisson (the default with "
                        "independent noise), shuffle (fixed-size batches of a shuffle each "
                        "epoch, no amplification) or cyclic_poisson (--sampling-groups groups, "
                        "group t mod b sampled at step t at rate b q: the default of banded "
                        "noise of b bands, and of BLT noise with floor(1 / q) groups)")
    parser.add_argument("--sampling-groups", type=_count("--sampling-groups"), default=None,
                        help="cyclic_poisson: the number of groups b (privacy.sampling_groups)")
    parser.add_argument("--noise", choices=list(NOISE_KINDS), default="independent",
                        help="noise strategy (privacy.noise): independent (DP-SGD, default), "
                        "banded (--noise-bands) or blt, optimised for the run's steps as "
                        "dptrain does and charged by its own accounting")
    parser.add_argument("--noise-bands", type=_count("--noise-bands"), default=None,
                        help="banded: the number of bands b (privacy.noise_bands)")
    parser.add_argument("--noise-buffers", type=_count("--noise-buffers"), default=None,
                        help="blt: the number of buffers (privacy.noise_buffers; default 3)")
    parser.add_argument("--accountant", nargs="+", choices=sorted(ACCOUNTANTS), default=list(ORDER),
                        help="accountants to report (default: all)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of `dptrain-privacy` with its `epsilon` and `sigma` subcommands."""
    parser = _OneLineParser(prog=PROG, description="Privacy planning for DP-SGD (Poisson-sampled Gaussian).")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_OneLineParser)
    eps = sub.add_parser("epsilon", help="epsilon for a noise multiplier, sample rate and length")
    eps.add_argument("--sigma", "--noise-multiplier", dest="sigma", type=float, required=True,
                     help="noise multiplier (noise std / clipping norm)")
    _add_plan_arguments(eps)
    sig = sub.add_parser("sigma", help="smallest noise multiplier meeting a target epsilon")
    sig.add_argument("--target-epsilon", type=float, required=True, help="target epsilon")
    sig.add_argument("--tolerance", type=float, default=0.01,
                     help="calibrated epsilon lies in [target - tolerance, target] (default 0.01)")
    _add_plan_arguments(sig)
    return parser


def resolve_horizon(args: argparse.Namespace) -> Horizon:
    """Sample rate, steps and delta from the arguments; PrivacyError naming the bad flag."""
    if args.sample_rate is not None:
        if args.batch_size is not None or args.dataset_size is not None:
            raise PrivacyError("give either --sample-rate or --batch-size with --dataset-size, not both")
        q = check_sample_rate(args.sample_rate, "--sample-rate")
    else:
        if args.batch_size is None or args.dataset_size is None:
            raise PrivacyError("give --sample-rate, or both --batch-size and --dataset-size")
        if args.batch_size > args.dataset_size:
            raise PrivacyError(f"--batch-size={args.batch_size} exceeds --dataset-size={args.dataset_size}")
        q = args.batch_size / args.dataset_size
    delta = _delta(args.delta, args.dataset_size)
    if args.epochs is not None:
        POSITIVE_NUMBER.check(args.epochs, "--epochs")
    if args.sampling_groups is not None and args.sampling is not None \
            and not selection_class(args.sampling).takes_groups:
        raise PrivacyError("--sampling-groups needs --sampling cyclic_poisson")
    if args.sampling_groups is not None and args.sampling_groups * q > 1 + 1e-12:
        raise PrivacyError(f"--sampling-groups={args.sampling_groups} with q={q:g}: each group "
                           f"would be sampled at {args.sampling_groups * q:g} > 1; use at most "
                           f"{int(1 / q)} groups")
    return Horizon(q, steps_for(q, args.steps, args.epochs), delta, args.sampling,
                   args.sampling_groups, args.noise, args.noise_bands, args.noise_buffers)


def _delta(given: float | None, dataset_size: int | None) -> float:
    """--delta, else dptrain's default for --dataset-size N (1/(10 N) rounded down)."""
    if given is not None:
        return check_delta(given, "--delta")
    if dataset_size is None:
        raise PrivacyError("give --delta (e.g. 1e-5), or --dataset-size for the delta dptrain "
                           "chooses by default: 1/(10 N) rounded down to a power of ten")
    return default_delta(dataset_size)


def _ordered(names: Sequence[str]) -> list[str]:
    return [n for n in ORDER if n in names] + sorted(set(names) - set(ORDER))


def _epsilon_row(name: str, sigma: float, horizon: Horizon) -> dict[str, Any]:
    """The answer of the plan of `horizon` with this accountant and sigma."""
    plan = horizon.plan(name, sigma)
    acc = get_accountant(plan.accountant, plan.accounting)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc.step(noise_multiplier=sigma, sample_rate=plan.selection.sample_rate,
                 steps=horizon.steps)
        row: dict[str, Any] = {"accountant": name, "epsilon": acc.get_epsilon(horizon.delta),
                               "approximate": acc.approximate, "guarantee": acc.guarantee}
        finite = math.isfinite(row["epsilon"])
        if hasattr(acc, "get_epsilon_bounds") and finite and row["epsilon"] > 0:
            lower, _, upper = acc.get_epsilon_bounds(horizon.delta)
            row["bounds"] = [lower, upper]
        if hasattr(acc, "get_epsilon_and_order") and finite:
            row["optimal_order"] = acc.get_epsilon_and_order(horizon.delta)[1]
    row["warnings"] = sorted({str(w.message) for w in caught})
    return row


def _sigma_row(name: str, target: float, tolerance: float, horizon: Horizon) -> dict[str, Any]:
    sigma = get_noise_multiplier(target_epsilon=target, target_delta=horizon.delta,
                                 sample_rate=horizon.sample_rate, steps=horizon.steps,
                                 accountant=name, epsilon_tolerance=tolerance,
                                 sampling=horizon.plan(name, 1.0).accounting)
    return {"accountant": name, "noise_multiplier": sigma, **_epsilon_row(name, sigma, horizon)}


def _note(row: dict[str, Any], sigma: float | None) -> str:
    if math.isinf(row["epsilon"]):
        return "infinite: no noise (sigma = 0)" if sigma == 0 else "infinite: no finite guarantee"
    guarantee = row["guarantee"]
    if "bounds" in row:
        low, high = row["bounds"]   # the true epsilon's bounds, each rounded outward
        return (f"{guarantee}; true epsilon in [{format_epsilon(low, rounding='down')}, "
                f"{format_epsilon(high)}]")
    if "optimal_order" in row:
        return f"{guarantee} (RDP order {row['optimal_order']:g})"
    return guarantee


def _print_table(command: str, inputs: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    subtitle = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in inputs.items())
    table = Table(title=f"dptrain-privacy {command}", caption=subtitle)
    table.add_column("accountant")
    if command == "sigma":
        table.add_column("noise multiplier", justify="right")
    table.add_column("epsilon", justify="right")
    table.add_column("note")
    for row in rows:
        cells = [row["accountant"]]
        if command == "sigma":
            cells.append(f"{row['noise_multiplier']:.4f}")
        sigma = row.get("noise_multiplier", inputs.get("noise_multiplier"))
        cells += [format_epsilon(row["epsilon"]), _note(row, sigma)]
        table.add_row(*cells)
    Console().print(table)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return value


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Compute the answer of a parsed command: {"command", "inputs", "results"}."""
    plan = resolve_horizon(args)
    inputs: dict[str, Any] = {"sample_rate": plan.sample_rate, "steps": plan.steps,
                              "delta": plan.delta, **plan.selection.parameters()}
    if correlated(plan.strategy):
        inputs["noise"] = plan.strategy.to_dict()
    names = _ordered(args.accountant)
    if args.command == "epsilon":
        check_noise_multiplier(args.sigma, "--sigma")
        inputs = {"noise_multiplier": args.sigma, **inputs}
        rows = [_epsilon_row(n, args.sigma, plan) for n in names]
    else:
        check_epsilon(args.target_epsilon, "--target-epsilon", target=True)
        POSITIVE_NUMBER.check(args.tolerance, "--tolerance")
        inputs = {"target_epsilon": args.target_epsilon, **inputs}
        rows = [_sigma_row(n, args.target_epsilon, args.tolerance, plan) for n in names]
    return {"command": args.command, "inputs": inputs, "results": rows}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `dptrain-privacy` console script."""
    args = build_parser().parse_args(argv)
    try:
        answer = run(args)
    except DPTrainError as e:
        _fail(str(e))
    if args.json:
        print(json.dumps(_jsonable(answer), indent=2))
    else:
        _print_table(answer["command"], answer["inputs"], answer["results"])
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
