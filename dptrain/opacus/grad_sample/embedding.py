"""Opacus's ``opacus.grad_sample.embedding``: dptrain's per-sample gradient and norm rules of
nn.Embedding and nn.EmbeddingBag."""

from dptrain.grad_sample.embedding import embedding_bag_grad_sample as compute_embeddingbag_gradsampler
from dptrain.grad_sample.embedding import embedding_grad_sample as compute_embedding_grad_sample
from dptrain.grad_sample.ghost_embedding import embedding_norms as compute_embedding_norm_sample

__all__ = ["compute_embedding_grad_sample", "compute_embedding_norm_sample",
           "compute_embeddingbag_gradsampler"]
