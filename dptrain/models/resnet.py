"""torchvision's ResNet-18 made trainable with DP: GroupNorm instead of BatchNorm.

BatchNorm mixes the samples of a batch (a sample's output depends on the others), so per-sample
gradients are undefined; GroupNorm normalises each sample alone. Each BatchNorm with ``c``
channels becomes ``GroupNorm(gcd(32, c), c)`` (32 groups for ResNet-18's 64..512 channels).
"""

from math import gcd

from torch import nn

from dptrain.models._checks import require_positive

#: Number of GroupNorm groups when the channel count allows it (Wu & He 2018's default).
MAX_GROUPS = 32


def group_norm(num_channels: int) -> nn.GroupNorm:
    """``GroupNorm(gcd(32, num_channels), num_channels)``: the DP replacement of BatchNorm2d."""
    return nn.GroupNorm(gcd(MAX_GROUPS, num_channels), num_channels)


def resnet18(num_classes: int = 10, in_channels: int = 3) -> nn.Module:
    """ResNet-18 (torchvision layout and weights names) with GroupNorm, randomly initialised.

    Args:
        num_classes: size of the final linear layer.
        in_channels: channels of the input images (the stem conv is replaced when != 3).

    Input: ``[B, in_channels, H, W]`` with H, W >= 32 recommended. Output: ``[B, num_classes]``.
    """
    from torchvision.models import resnet18 as torchvision_resnet18  # slow import: only when used

    require_positive("resnet18", num_classes=num_classes, in_channels=in_channels)
    model = torchvision_resnet18(weights=None, num_classes=num_classes, norm_layer=group_norm)
    if in_channels != 3:
        model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    return model
