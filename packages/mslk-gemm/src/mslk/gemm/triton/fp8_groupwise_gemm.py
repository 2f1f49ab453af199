"""The reference library's Triton entry for the groupwise FP8 GEMM, at its import path (spec G-58); the kernel
is fp8_blockwise_gemm.py's."""

from __future__ import annotations

import torch

from mslk.gemm.triton.fp8_blockwise_gemm import f8f8bf16_groupwise_op
from mslk.gemm.triton.fp8_gemm import into_output


def matmul_f8f8bf16_groupwise(XQ, WQ, x_scale, w_scale, output=None) -> torch.Tensor:
    """f8f8bf16_groupwise (spec G-16), into `output` when given."""
    return into_output("matmul_f8f8bf16_groupwise", output, f8f8bf16_groupwise_op, XQ, WQ, x_scale, w_scale)
