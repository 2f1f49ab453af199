"""The reference library's grouped BF16 x INT4 Triton entry, at its import path (spec G-56); the kernel is
int4_gemm.py's."""

from __future__ import annotations

import torch

from mslk.gemm.triton.int4_grouped_gemm_fused import matmul_bf16i4_rowwise_grouped_fused


def matmul_bf16i4_rowwise_grouped(X, WQ, w_scale_group, w_zero_group, M_sizes) -> torch.Tensor:
    """bf16i4bf16_rowwise_grouped: X [ΣM, K] bf16, plain WQ [G, N, K/2], scales and zeros [G, ⌈K/gs⌉, N], M_sizes
    [G] -> bf16 [ΣM, N]. The reference routes large groups through a loop of per-group launches, which reads
    M_sizes on the host; here every size takes the one persistent kernel (no host sync, CUDA-graph safe)."""
    return matmul_bf16i4_rowwise_grouped_fused(X, WQ, w_scale_group, w_zero_group, M_sizes)
