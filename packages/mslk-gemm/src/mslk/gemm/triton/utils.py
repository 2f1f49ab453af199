"""Helpers of the reference library's Triton GEMMs, at their import path (spec G-62)."""

from __future__ import annotations

import torch
import triton.language as tl

_TRITON_DTYPES = {
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.float32: tl.float32,
    torch.float64: tl.float64,
    torch.int8: tl.int8,
    torch.uint8: tl.uint8,
    torch.int16: tl.int16,
    torch.int32: tl.int32,
    torch.int64: tl.int64,
    torch.bool: tl.int1,
    torch.float8_e4m3fn: tl.float8e4nv,
    torch.float8_e5m2: tl.float8e5,
    torch.float8_e4m3fnuz: tl.float8e4b8,
    torch.float8_e5m2fnuz: tl.float8e5b16,
}


def map_dtype_to_triton(dtype: torch.dtype) -> tl.dtype:
    """The Triton element type of a torch dtype (torch.float8_e4m3fn -> tl.float8e4nv, ...)."""
    try:
        return _TRITON_DTYPES[dtype]
    except KeyError:
        raise ValueError(f"map_dtype_to_triton: {dtype} has no Triton element type") from None


def __getattr__(name: str):
    if name == "TmaAutoTuneHelper":
        raise AttributeError(
            "mslk.gemm.triton.utils.TmaAutoTuneHelper is not provided: it fills TMA descriptors on the host through "
            "Triton's `fill_1d_tma_descriptor` / `fill_2d_tma_descriptor`, which Triton 3.4 removed; kernels take "
            "`triton.tools.tensor_descriptor.TensorDescriptor` arguments instead"
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
