"""The two image CNNs of the Opacus paper's end-to-end benchmarks (Fast-DPSGD suite).

Both are exactly the architectures of Subramani et al.'s Fast-DPSGD benchmark suite, which the
Opacus paper (Yousefpour et al. 2021, Figure 2) reuses: same layers, kernel sizes, strides and
padding, hence the same parameter counts (26,010 and 605,226 with 10 classes).
"""

import torch
import torch.nn.functional as F
from torch import nn

from dptrain.models._checks import require_positive


class MnistCNN(nn.Module):
    """Two conv + two linear layers for ``[B, 1, 28, 28]`` MNIST images (26,010 parameters).

    Shapes: conv 8x8/2 pad 3 -> ``[B, 16, 14, 14]``, max-pool 2/1 -> 13x13, conv 4x4/2 ->
    ``[B, 32, 5, 5]``, max-pool 2/1 -> ``[B, 32, 4, 4]``, linear 512 -> 32 -> ``num_classes``.
    Output: ``[B, num_classes]`` logits.
    """

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        require_positive("mnist_cnn", num_classes=num_classes)
        self.conv1 = nn.Conv2d(1, 16, kernel_size=8, stride=2, padding=3)
        self.conv2 = nn.Conv2d(16, 32, kernel_size=4, stride=2)
        self.fc1 = nn.Linear(32 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, 1, 28, 28]`` -> ``[B, num_classes]``."""
        x = F.max_pool2d(F.relu(self.conv1(x)), kernel_size=2, stride=1)
        x = F.max_pool2d(F.relu(self.conv2(x)), kernel_size=2, stride=1)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


def _conv_relu(in_channels: int, out_channels: int) -> nn.Sequential:
    """3x3 convolution (stride 1, padding 1: spatial size kept) followed by ReLU."""
    return nn.Sequential(nn.Conv2d(in_channels, out_channels, 3, padding=1), nn.ReLU())


class Cifar10CNN(nn.Module):
    """Seven 3x3 conv+ReLU layers in stages of 32/64/128/256 channels with 2x2 average pooling,
    a final 3x3 conv to ``num_classes`` channels and a global spatial mean (605,226 parameters).

    Input: ``[B, 3, 32, 32]`` images. Output: ``[B, num_classes]`` logits.
    """

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        require_positive("cifar10_cnn", num_classes=num_classes)
        self.layers = nn.Sequential(
            _conv_relu(3, 32), _conv_relu(32, 32), nn.AvgPool2d(2, stride=2),
            _conv_relu(32, 64), _conv_relu(64, 64), nn.AvgPool2d(2, stride=2),
            _conv_relu(64, 128), _conv_relu(128, 128), nn.AvgPool2d(2, stride=2),
            _conv_relu(128, 256),
            nn.Conv2d(256, num_classes, 3, padding=1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, 3, 32, 32]`` -> ``[B, num_classes]`` (mean of the last feature map over H, W)."""
        return self.layers(x).mean(dim=(2, 3))
