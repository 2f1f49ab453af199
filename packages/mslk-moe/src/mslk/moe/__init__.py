"""mslk.moe: MoE (spec §8): routing (index_shuffling), gather/scatter, SwiGLU, shuffling and the MoE layers.

Importing this module registers the domain's `torch.ops` (`import mslk` does it for every installed domain).
"""

from mslk.moe import bench as _bench  # noqa: F401  (registers the bench specs)
from mslk.moe.activation import silu_mul, silu_mul_quant
from mslk.moe.gather_scatter import (
    gather_scale_dense_tokens,
    gather_scale_quant_dense_tokens,
    scatter_add_along_first_dim,
    scatter_add_dense_tokens,
    scatter_add_padded_tokens,
)
from mslk.moe.shuffling import combine_shuffling, index_shuffling, split_shuffling

__all__ = [
    "combine_shuffling",
    "gather_scale_dense_tokens",
    "gather_scale_quant_dense_tokens",
    "index_shuffling",
    "scatter_add_along_first_dim",
    "scatter_add_dense_tokens",
    "scatter_add_padded_tokens",
    "silu_mul",
    "silu_mul_quant",
    "split_shuffling",
]
