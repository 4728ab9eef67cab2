"""A small multilayer perceptron for the embedded 8x8 digits dataset."""

from collections.abc import Sequence

import torch
from torch import nn

from dptrain.models._checks import require_positive


class DigitsMLP(nn.Module):
    """``64 -> 64 -> ReLU -> 10`` MLP (4,810 parameters with the defaults).

    Input: ``[B, 64]`` float pixels (or ``[B, 1, 8, 8]`` / ``[B, 8, 8]``, flattened from dim 1).
    Output: ``[B, num_classes]`` logits.
    """

    def __init__(
        self,
        in_features: int = 64,
        hidden_sizes: Sequence[int] = (64,),
        num_classes: int = 10,
    ) -> None:
        super().__init__()
        sizes = [in_features, *hidden_sizes]
        require_positive("digits_mlp", in_features=in_features, num_classes=num_classes)
        require_positive("digits_mlp", **{f"hidden_sizes[{i}]": h for i, h in enumerate(hidden_sizes)})
        layers: list[nn.Module] = [nn.Flatten()]
        for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
            layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
        layers.append(nn.Linear(sizes[-1], num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, 64]`` (or ``[B, ..., 8, 8]``) -> ``[B, num_classes]`` logits."""
        return self.net(x)
