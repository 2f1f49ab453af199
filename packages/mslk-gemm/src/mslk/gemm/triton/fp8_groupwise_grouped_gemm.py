"""The reference library's Triton entry for the grouped groupwise FP8 GEMM, at its import path (spec G-58); the
kernel is grouped_gemm.py's."""

from __future__ import annotations

import torch

from mslk.gemm.triton.grouped_gemm import f8f8bf16_groupwise_grouped


def matmul_f8f8bf16_groupwise_grouped(XQ, WQ, x_scale, w_scale, M_sizes, output=None) -> torch.Tensor:
    """f8f8bf16_groupwise_grouped (spec G-17), into `output` when given."""
    out = f8f8bf16_groupwise_grouped(XQ, WQ, x_scale, w_scale, M_sizes)
    return out if output is None else output.copy_(out)
