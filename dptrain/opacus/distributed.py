"""Opacus's ``opacus.distributed``: DifferentiallyPrivateDistributedDataParallel.

dptrain makes a torch DistributedDataParallel model private itself (each rank clips its own
examples, the noise is added once); this class is that DDP wrapper, so Opacus code that wraps
its model in it before make_private runs unchanged.
"""

from torch import nn
from torch.nn.parallel import DistributedDataParallel


class DifferentiallyPrivateDistributedDataParallel(DistributedDataParallel):
    """``DPDDP(model)``: the model under torch DDP, which dptrain's engine makes private."""

    def __init__(self, model: nn.Module, **kwargs: object) -> None:
        super().__init__(model, **kwargs)


__all__ = ["DifferentiallyPrivateDistributedDataParallel"]
