"""The cuBLASLt backend of the INT8 GEMMs `i8i8bf16` and `i8i8bf16_dynamic` (spec G-22, G-23; the ops, their
reference and the Triton backend are in mslk.gemm.triton.int8_gemm).

cuBLASLt's INT8 tensor-core kernels write the exact int32 product XQ · WQᵀ (they have no bf16 output); torch then
scales it and rounds to bf16, one more pass over an int32 [M, N]. Unmeasured against the Triton kernel, which
fuses the scale, it comes after it: the dispatcher takes it where Triton is missing, or when it is pinned
(`backend="cublas"`, MSLK_BACKEND). K and N are zero-padded to multiples of 16 where they are not; `split_k` is the
Triton kernel's knob (cuBLASLt picks its own split of K).
"""

from __future__ import annotations

import ctypes

import torch

from mslk.gemm.native import library
from mslk.gemm.triton.int8_gemm import i8i8bf16_dynamic_op, i8i8bf16_op

_gemm = library.Function("mslk_i8i8i32_cublas", *(ctypes.c_void_p,) * 3, *(ctypes.c_int64,) * 3)  # xq, wq, out; m, n, k


def int32_product(XQ: torch.Tensor, WQ: torch.Tensor) -> torch.Tensor:
    """XQ [M, K] · WQ [N, K]ᵀ in int32 on cuBLASLt (a view of an [M, N'] tensor, N' = N rounded up to 16)."""
    out = torch.empty((XQ.shape[0], library.pad16(WQ.shape[0])), dtype=torch.int32, device=XQ.device)
    return library.tn_gemm(_gemm, XQ, WQ, out)[:, : WQ.shape[0]]


@i8i8bf16_op.backend("cublas", available=_gemm.available)
def _static_cublas(XQ, WQ, scale, split_k=1):
    return (int32_product(XQ, WQ) * scale).to(torch.bfloat16)


@i8i8bf16_dynamic_op.backend("cublas", available=_gemm.available)
def _dynamic_cublas(XQ, WQ, scale, split_k=1):
    return (int32_product(XQ, WQ) * scale.reshape(())).to(torch.bfloat16)
