"""The reference library's Triton entry for the grouped groupwise FP8 GEMM, at its import path (spec G-58); the
kernel is grouped_gemm.py's."""

from __future__ import annotations

import torch

from mslk.gemm.triton.fp8_gemm import into_output
from mslk.gemm.triton.grouped_gemm import f8f8bf16_groupwise_grouped_op


def matmul_f8f8bf16_groupwise_grouped(XQ, WQ, x_scale, w_scale, M_sizes, output=None) -> torch.Tensor:
    """f8f8bf16_groupwise_grouped (spec G-17), into `output` when given."""
    return into_output(
        "matmul_f8f8bf16_groupwise_grouped", output, f8f8bf16_groupwise_grouped_op, XQ, WQ, x_scale, w_scale, M_sizes
    )
