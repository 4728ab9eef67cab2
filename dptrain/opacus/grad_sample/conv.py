"""Opacus's ``opacus.grad_sample.conv``: dptrain's per-sample gradient rule of convolutions."""

from dptrain.grad_sample.conv import conv_grad_sample as compute_conv_grad_sample
from dptrain.opacus._absent import absent

convolution2d_backward_as_a_convolution = absent(
    "opacus.grad_sample.conv.convolution2d_backward_as_a_convolution",
    "compute_conv_grad_sample (dptrain picks its convolution kernel itself)")

__all__ = ["compute_conv_grad_sample", "convolution2d_backward_as_a_convolution"]
