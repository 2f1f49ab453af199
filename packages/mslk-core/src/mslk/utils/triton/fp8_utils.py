"""`mslk.utils.triton.fp8_utils` (spec U-04): FP8 constants of this platform, from mslk.core.arch."""

from __future__ import annotations

import torch

from mslk.core import arch

__all__ = ["get_fp8_constants", "reinterpret_fp8_type"]


def get_fp8_constants() -> tuple[torch.dtype, object, float, float]:
    """(torch FP8 dtype, Triton FP8 dtype, FP8_MAX, eps) of this platform (spec §7.1)."""
    dtype = arch.fp8_dtype()
    return dtype, arch.triton_fp8_type(dtype), torch.finfo(dtype).max, arch.FP8_EPS


def reinterpret_fp8_type(tensor: torch.Tensor, dtype):
    """View `tensor` as the Triton FP8 type `dtype` when passing it to a kernel."""
    from triton import reinterpret

    return reinterpret(tensor, dtype)
