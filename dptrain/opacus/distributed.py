"""Opacus's ``opacus.distributed``: DifferentiallyPrivateDistributedDataParallel.

dptrain makes a torch DistributedDataParallel model private itself (each rank clips its own
examples, the noise is added once); this class is that DDP wrapper, so Opacus code that wraps
its model in it before make_private runs unchanged.
"""

from torch import nn

from dptrain.opacus._absent import absent
from torch.nn.parallel import DistributedDataParallel


class DifferentiallyPrivateDistributedDataParallel(DistributedDataParallel):
    """``DPDDP(model)``: the model under torch DDP, which dptrain's engine makes private."""

    def __init__(self, model: nn.Module, **kwargs: object) -> None:
        super().__init__(model, **kwargs)


average_gradients = absent(
    "opacus.distributed.average_gradients",
    "make_private on the DistributedDataParallel model: its DistributedDPOptimizer all-reduces "
    "the ranks' clipped sums and adds the noise once")

__all__ = ["DifferentiallyPrivateDistributedDataParallel", "average_gradients"]
