"""Time the per-sample conv weight-gradient kernels (grouped convolution, unfold + einsum, and, for
single-channel inputs, the direct convolution) on the convolutions of the CIFAR-10 and MNIST CNNs,
and show which one the rule ``dptrain.grad_sample.conv.weight_grad_kernel_for`` picks. This is the
measurement behind that rule.

    python scripts/benchmark_conv_kernels.py [--batch-sizes 64 256] [--repeats 5] [--threads 2]

Prints one row per (batch size, layer): median milliseconds of each kernel (direct: nan for more
than one input channel), the ratio unfold / grouped (above 1 the grouped kernel is faster), the
rule's choice, and the largest difference between the grouped and unfold results (rounding only).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_timing import median_seconds  # noqa: E402
from dptrain.grad_sample.conv import conv_weight_grad_samples, weight_grad_kernel_for  # noqa: E402

#: (in_channels, out_channels, input height = width[, kernel, stride, padding]): the 3x3,
#: padding-1 convolutions of the cifar10_cnn model, then mnist_cnn's two (8x8 stride 2 padding 3,
#: 4x4 stride 2 on the 13x13 pooled map).
LAYERS = [
    (3, 32, 32), (32, 32, 32), (32, 64, 16), (64, 64, 16), (64, 128, 8), (128, 128, 8),
    (128, 256, 4), (256, 10, 4), (1, 16, 28, 8, 2, 3), (16, 32, 13, 4, 2, 0),
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--layers", type=int, nargs=3, action="append", metavar=("C_IN", "C_OUT", "SIZE"),
                        help="a Conv2d(C_IN, C_OUT, 3, padding=1) on SIZE x SIZE inputs (repeatable)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    print(f"{'B':>5} {'conv':>14} {'size':>5} {'grouped ms':>11} {'unfold ms':>10} {'direct ms':>10} "
          f"{'unfold/grouped':>15} {'rule':>8} {'max diff':>9}")
    for batch in args.batch_sizes:
        for c_in, c_out, size, *shape in args.layers or LAYERS:
            kernel_size, stride, padding = shape or (3, 1, 1)
            layer = nn.Conv2d(c_in, c_out, kernel_size, stride=stride, padding=padding)
            x = torch.randn(batch, c_in, size, size)
            g = torch.randn_like(layer(x))
            grouped, unfold = (
                1e3 * median_seconds(lambda k=k: conv_weight_grad_samples(layer, x, g, kernel=k), args.repeats)
                for k in ("grouped", "unfold")
            )
            direct = (  # the direct kernel needs one input channel (per group)
                1e3 * median_seconds(lambda: conv_weight_grad_samples(layer, x, g, kernel="direct"), args.repeats)
                if c_in == 1 else float("nan")
            )
            diff = (conv_weight_grad_samples(layer, x, g, kernel="grouped")
                    - conv_weight_grad_samples(layer, x, g, kernel="unfold")).abs().max().item()
            rule = weight_grad_kernel_for(layer, g)
            row = dict(batch_size=batch, c_in=c_in, c_out=c_out, size=size, grouped_ms=grouped,
                       unfold_ms=unfold, direct_ms=direct, rule=rule, max_diff=diff)
            rows.append(row)
            print(f"{batch:>5} {f'{c_in}->{c_out} k{kernel_size}s{stride}':>14} {size:>5} {grouped:>11.1f} {unfold:>10.1f} "
                  f"{direct:>10.1f} {unfold / grouped:>15.2f} {rule:>8} {diff:>9.1e}")
    return rows


if __name__ == "__main__":
    main()
