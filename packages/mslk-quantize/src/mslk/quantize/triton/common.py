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


@triton.jit
def e2m1_codes(v, STOCHASTIC: tl.constexpr, seed, offsets):
    """E2M1 codes of fp32 values, the sign bit of v in bit 3: round to nearest even, saturating at 6 (NaN as
    6), or stochastic rounding (unbiased: up with probability of the distance to the lower code over the
    step)."""
    a = tl.abs(v)
    if STOCHASTIC:
        step = tl.where(a < 2.0, 0.5, tl.where(a < 4.0, 1.0, 2.0))
        a = a + tl.rand(seed, offsets) * step
        code = (a >= 0.5).to(tl.int32) + (a >= 1.0).to(tl.int32) + (a >= 1.5).to(tl.int32) + (a >= 2.0).to(tl.int32)
        code += (a >= 3.0).to(tl.int32) + (a >= 4.0).to(tl.int32) + (a >= 6.0).to(tl.int32)
        code = tl.where(a == a, code, 7)
    else:
        # The code is round(2a) below 2, round(a) + 2 below 4 and round(a / 2) + 4 above, and each of the three
        # is the smallest of them in its own range: so take the minimum (and 7). Adding 1.5 · 2^23 rounds to an
        # integer, ties to even (the even code), and leaves it in the fp32's low bits: 6 instructions.
        magic = 12582912.0
        c = tl.minimum(tl.minimum(a * 2.0 + magic, a + (magic + 2.0)), a * 0.5 + (magic + 4.0))
        c = tl.where(c < magic + 7.0, c, magic + 7.0)  # saturate; NaN too (the same in the interpreter)
        code = c.to(tl.int32, bitcast=True) & 7
    return code | ((v.to(tl.int32, bitcast=True) >> 28) & 8)


def to_output_device(output_device: torch.device | None, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The quantizers' `output_device` argument: move the results there (no copy when already there)."""
    if output_device is None:
        return tensors
    return tuple(t.to(output_device) for t in tensors)
