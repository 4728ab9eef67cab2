"""Data for private training: Poisson sampling, virtual batches, datasets.

Datasets live in `dptrain.data.datasets` (imported on demand, not here).
"""

from dptrain.data.distributed import DistributedDPDataLoader, DistributedPoissonBatchSampler
from dptrain.data.row_order import RowOrderedBatch, SortingCollate, keeps_row_order
from dptrain.data.sampling import DPDataLoader, PoissonBatchSampler
from dptrain.data.virtual import BatchMemoryManager

__all__ = ["BatchMemoryManager", "DPDataLoader", "DistributedDPDataLoader",
           "DistributedPoissonBatchSampler", "PoissonBatchSampler", "RowOrderedBatch",
           "SortingCollate", "keeps_row_order"]
