"""Pieces shared by the quantizer families of this folder."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FLOAT_INPUTS = (torch.float32, torch.float16, torch.bfloat16)


def check_float_input(where: str, name: str, x: torch.Tensor) -> None:
    if x.dtype not in FLOAT_INPUTS:
        raise ValueError(f"{where}: {name} must be float32, float16 or bfloat16, got {x.dtype}")


def check_scale_ub(where: str, scale_ub: torch.Tensor | None, x: torch.Tensor) -> None:
    if scale_ub is None:
        return
    if scale_ub.numel() != 1 or scale_ub.dtype != torch.float32:
        raise ValueError(
            f"{where}: scale_ub must be one float32 value (an upper bound on amax), "
            f"got shape {tuple(scale_ub.shape)} {scale_ub.dtype}"
        )
    if scale_ub.device != x.device:
        raise ValueError(f"{where}: scale_ub is on {scale_ub.device}, the input is on {x.device}")


@triton.jit
def max_nan(a, b):
    # NaN-propagating max: a block holding NaN gets a NaN scale instead of silently dropping the NaN.
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


def to_output_device(output_device: torch.device | None, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The quantizers' `output_device` argument: move the results there (no copy when already there)."""
    if output_device is None:
        return tensors
    return tuple(t.to(output_device) for t in tensors)
