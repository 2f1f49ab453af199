"""Helpers of the attention package that are not attention: `bench` (timing with CUDA graphs)."""

from mslk.attention.fmha.utils import bench  # noqa: F401  (reached as fmha.utils.bench)
