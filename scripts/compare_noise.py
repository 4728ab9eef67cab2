#!/usr/bin/env python
"""Privacy-utility comparison of independent (DP-SGD), banded and BLT noise on the embedded digits.

Every mechanism trains the digits MLP (64 -> 64 -> 10, dptrain/conf/model/digits_mlp.yaml) on the
1,442 training digits we ship (dptrain/data/datasets/digits.py) for the SAME number of steps
(`--epochs` epochs of ceil(1 / q) steps, q = batch size / N) with sigma calibrated so that the run
spends the SAME epsilon at delta = 1e-5 (dptrain's default 1 / (10 N) rounded down) with the PRV
accountant, each by its own accounting (dptrain.accounting.events):

    dpsgd        independent noise, Poisson sampling (amplified DP-SGD)
    banded-b     b-banded noise optimised for the run (Banded.optimised), cyclic Poisson sampling
                 in b groups (amplified banded MF)
    blt          BLT noise with 3 buffers (Blt.optimised for min separation floor(1 / q)),
                 cyclic Poisson sampling in floor(1 / q) groups (unamplified, add/remove, by its
                 min-separation sensitivity)

and reports the test accuracy (355 digits) after the last step, mean +- std over the seeds. The
strategy and sigma are computed once per (mechanism, epsilon) and shared by the seeds; the seed
drives the model's initialisation, the batches and the noise.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python scripts/compare_noise.py --epsilons 1 2 4 8 \\
        --seeds 5 --json docs/img/compare_noise.json --figure docs/img/compare_noise.png

Writes the table to stdout (markdown), the raw accuracies to --json and the figure to --figure.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
import warnings
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

import dptrain
from dptrain.accounting import get_noise_multiplier
from dptrain.checks import default_delta
from dptrain.data.datasets import load_dataset
from dptrain.models.registry import get_model
from dptrain.privacy.noise import strategy_for
from dptrain.privacy.plan import Clipping, Noise, PrivacyPlan, default_selection

ACCOUNTANT = "prv"


def mechanisms(bands: list[int], blt: bool) -> list[str]:
    """The mechanism names compared: dpsgd, banded-b for each b, blt."""
    return ["dpsgd"] + [f"banded-{b}" for b in bands] + (["blt"] if blt else [])


def setup(name: str, sample_rate: float, steps: int) -> tuple[Any, Any]:
    """(noise strategy, batch selection) of mechanism `name` for `steps` steps at q."""
    kind, _, bands = name.partition("-")
    kind = {"dpsgd": "independent"}.get(kind, kind)
    selection = default_selection(kind, sample_rate, bands=int(bands) if bands else None)
    strategy = strategy_for(kind, steps, bands=int(bands) if bands else None,
                            steps_per_epoch=selection.min_separation)
    return strategy, selection


def calibrate(strategy: Any, selection: Any, epsilon: float, delta: float, steps: int) -> float:
    """The smallest sigma whose `steps` steps spend at most `epsilon` at `delta` (the plan's
    own accounting event)."""
    plan = PrivacyPlan(selection=selection, clipping=Clipping(1.0),
                       noise=Noise(target_epsilon=epsilon, strategy=strategy),
                       accountant=ACCOUNTANT, delta=delta)
    return get_noise_multiplier(target_epsilon=epsilon, target_delta=delta,
                                sample_rate=selection.sample_rate, steps=steps,
                                accountant=ACCOUNTANT, sampling=plan.accounting)


def train_once(splits: Any, strategy: Any, selection: Any, sigma: float, seed: int,
               args: argparse.Namespace, steps: int) -> tuple[float, float]:
    """(test accuracy, epsilon the engine reports) of one private run of `steps` steps."""
    torch.manual_seed(seed)
    model = get_model("digits_mlp", in_features=64, hidden_sizes=[64], num_classes=10)
    private = dptrain.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=args.lr),
        data_loader=DataLoader(splits.train, batch_size=args.batch_size),
        noise_multiplier=sigma, max_grad_norm=args.clip, seed=seed, reproducible_mechanism=True,
        noise_strategy=strategy, sampling=selection.kind,
        sampling_groups=selection.groups if selection.kind == "cyclic_poisson" else None)
    taken = 0
    while taken < steps:
        for x, y in private.data_loader:
            if taken == steps:
                break
            private.optimizer.zero_grad()
            nn.functional.cross_entropy(private.module(x), y).backward()
            private.optimizer.step()
            taken += 1
    model.eval()
    with torch.no_grad():
        x, y = zip(*[splits.test[i] for i in range(len(splits.test))])
        logits = private.module(torch.stack(x))
        accuracy = float((logits.argmax(1) == torch.stack(y)).float().mean())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the seeded mechanism's warning: a study, not a release
        spent = private.engine.get_epsilon(args.delta)
    return accuracy, spent


def table(results: dict[str, Any], names: list[str], epsilons: list[float]) -> str:
    """Markdown: one row per epsilon, mean +- std test accuracy (%) of each mechanism."""
    head = "| epsilon | " + " | ".join(names) + " |\n|---|" + "---|" * len(names) + "\n"
    rows = []
    for eps in epsilons:
        cells = []
        for name in names:
            if f"{name}@{eps:g}" not in results:  # an interrupted study
                cells.append("not run")
                continue
            acc = [100 * a for a in results[f"{name}@{eps:g}"]["accuracy"]]
            sd = statistics.stdev(acc) if len(acc) > 1 else 0.0
            cells.append(f"{statistics.mean(acc):.1f} +- {sd:.1f}")
        rows.append(f"| {eps:g} | " + " | ".join(cells) + " |")
    return head + "\n".join(rows) + "\n"


def dodge(index: int, count: int, spread: float = 0.05) -> float:
    """The factor that shifts the `index`-th of `count` lines along a log2 epsilon axis, centred
    on the true epsilon, so that their error bars at one epsilon sit side by side (they were
    drawn on top of one another). The tick stays at the true epsilon."""
    return 2 ** (spread * (index - (count - 1) / 2))


def figure(results: dict[str, Any], names: list[str], epsilons: list[float], path: str,
           title: str, delta: float) -> None:
    """Test accuracy against epsilon (log scale), one line per mechanism, error bars = std."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for index, name in enumerate(names):
        done = [e for e in epsilons if f"{name}@{e:g}" in results]
        acc = [[100 * a for a in results[f"{name}@{e:g}"]["accuracy"]] for e in done]
        ax.errorbar([e * dodge(index, len(names)) for e in done], [statistics.mean(a) for a in acc],
                    yerr=[statistics.stdev(a) if len(a) > 1 else 0 for a in acc],
                    marker="o", capsize=3, label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(epsilons, [f"{e:g}" for e in epsilons])
    ax.set_xlabel(f"epsilon (delta = {delta:g})")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def replot(args: argparse.Namespace) -> None:
    """The table and figure of a --json file written by an earlier run."""
    with open(args.replot) as handle:
        results = json.load(handle)
    setup_ = results["setup"]
    keys = [k for k in results if "@" in k]
    names = list(dict.fromkeys(k.split("@")[0] for k in keys))
    epsilons = sorted({float(k.split("@")[1]) for k in keys})
    print(table(results, names, epsilons))
    if args.figure:
        seeds = len(results[keys[0]]["accuracy"])
        figure(results, names, epsilons, args.figure,
               f"digits MLP, {setup_['steps']} steps ({setup_['epochs']} epochs, batch "
               f"{setup_['batch_size']}), {seeds} seeds", setup_["delta"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 2.0, 4.0, 8.0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--bands", type=int, nargs="*", default=[2, 4, 8])
    parser.add_argument("--no-blt", action="store_true")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--json", default=None)
    parser.add_argument("--figure", default=None)
    parser.add_argument("--replot", default=None,
                        help="a --json file written before: print its table and draw --figure "
                        "from it without training")
    args = parser.parse_args(argv)
    if args.replot:
        replot(args)
        return
    torch.set_num_threads(1)
    splits = load_dataset("digits")
    n = len(splits.train)
    q = args.batch_size / n
    steps = args.epochs * math.ceil(1 / q)
    args.delta = default_delta(n)
    names = mechanisms(args.bands, not args.no_blt)
    results: dict[str, Any] = {"setup": {"n": n, "q": q, "steps": steps, "delta": args.delta,
                                         "epochs": args.epochs, "batch_size": args.batch_size,
                                         "lr": args.lr, "clip": args.clip,
                                         "accountant": ACCOUNTANT}}
    for name in names:
        start = time.perf_counter()
        strategy, selection = setup(name, q, steps)
        for eps in args.epsilons:
            sigma = calibrate(strategy, selection, eps, args.delta, steps)
            runs = [train_once(splits, strategy, selection, sigma, seed, args, steps)
                    for seed in range(args.seeds)]
            results[f"{name}@{eps:g}"] = {
                "sigma": sigma, "groups": selection.groups, "selection": selection.kind,
                "accuracy": [a for a, _ in runs], "epsilon_spent": [e for _, e in runs]}
            print(f"{name:>9} eps={eps:g} sigma={sigma:.3f} groups={selection.groups} "
                  f"acc={statistics.mean(a for a, _ in runs):.3f} "
                  f"spent={max(e for _, e in runs):.3f}", flush=True)
            if args.json:  # after every point, so that an interrupted study keeps its numbers
                with open(args.json, "w") as handle:
                    json.dump(results, handle, indent=1)
        print(f"  ({name}: {time.perf_counter() - start:.0f} s)", flush=True)
    print(table(results, names, args.epsilons))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)
    if args.figure:
        figure(results, names, args.epsilons, args.figure,
               f"digits MLP, {steps} steps ({args.epochs} epochs, batch {args.batch_size}), "
               f"{args.seeds} seeds", args.delta)


if __name__ == "__main__":
    main()
