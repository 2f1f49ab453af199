"""The reference library's single-launch grouped BF16 x INT4 Triton entry, at its import path (spec G-56); the
kernel is int4_gemm.py's."""

from __future__ import annotations

import torch

from mslk.gemm.triton.int4_gemm import bf16i4bf16_rowwise_grouped


def matmul_bf16i4_rowwise_grouped_fused(X, WQ, w_scale_group, w_zero_group, M_sizes) -> torch.Tensor:
    """bf16i4bf16_rowwise_grouped: X [ΣM, K] bf16, plain WQ [G, N, K/2], scales and zeros [G, ⌈K/gs⌉, N], M_sizes
    [G] int32/int64 on the device -> bf16 [ΣM, N], rows past ΣM_sizes zero."""
    return bf16i4bf16_rowwise_grouped(X, WQ, w_scale_group, w_zero_group, M_sizes)
