"""Pieces shared by the quantizer families of this folder."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FLOAT_INPUTS = (torch.float32, torch.float16, torch.bfloat16)


def check_float_input(where: str, name: str, x: torch.Tensor) -> None:
    if x.dtype not in FLOAT_INPUTS:
        raise ValueError(f"{where}: {name} must be float32, float16 or bfloat16, got {x.dtype}")


@triton.jit
def max_nan(a, b):
    # NaN-propagating max: a block holding NaN gets a NaN scale instead of silently dropping the NaN.
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


def to_output_device(output_device: torch.device | None, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The quantizers' `output_device` argument: move the results there (no copy when already there)."""
    if output_device is None:
        return tensors
    return tuple(t.to(output_device) for t in tensors)
