"""Rowwise INT8 quantization (the quantize issue's INT8 helper; scale contract §7.2).

`quantize_int8_row(a)` -> (xq int8, scale fp32 [...]): symmetric, one dequantization scale per row,
`a ≈ xq · scale[..., None]`, `scale = amax / 127`, values rounded half to even into [-127, 127]. Registered as
`torch.ops.mslk.quantize_int8_row` with a fake kernel; the GPU runs the rowwise Triton kernel of
fp8_quantize (one read of the input, one write of xq and the scales), the CPU the reference.
"""

from __future__ import annotations

import torch

from mslk.core import arch, registry, testing
from mslk.quantize import reference
from mslk.quantize.triton.common import check_float_input, check_scale_ub
from mslk.quantize.triton.fp8_quantize import run_row_kernel


def _validate(a, scale_ub=None):
    check_float_input("quantize_int8_row", "a", a)
    if a.dim() < 1:
        raise ValueError(f"quantize_int8_row: a must have at least one dimension, got shape {tuple(a.shape)}")
    check_scale_ub("quantize_int8_row", scale_ub, a)


def _reference(a, scale_ub=None):
    return reference.quantize_int8_row(a, scale_ub, arch.FP8_EPS)


def _fake(a, scale_ub=None):
    return a.new_empty(a.shape, dtype=torch.int8), a.new_empty(a.shape[:-1], dtype=torch.float32)


def _samples(device):
    yield registry.Sample((testing.randn(3, 5, dtype=torch.bfloat16, device=device),))
    yield registry.Sample((testing.randn(2, 3, 130, device=device, std=50.0), torch.tensor([20.0], device=device)))


quantize_int8_row_op = registry.Op(
    "mslk::quantize_int8_row(Tensor a, Tensor? scale_ub=None) -> (Tensor, Tensor)",
    domain="quantize",
    reference=_reference,
    fake=_fake,
    samples=_samples,
    validate=_validate,
    reference_devices=("cpu", "cuda"),
)


@quantize_int8_row_op.backend("triton", available=registry.triton_missing)
def _triton(a, scale_ub=None):
    return run_row_kernel(a, torch.int8, scale_ub, None, a.shape[-1], arch.FP8_EPS)


def quantize_int8_row(a: torch.Tensor, scale_ub: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rowwise symmetric INT8: a [..., K] (fp32/fp16/bf16) -> (xq int8 [..., K], scale fp32 a.shape[:-1]).

    Per row `amax = clamp(max|a|, 1e-12, scale_ub)`, `scale = amax / 127`, `xq = round_half_even(a · 127 /
    amax)` clamped to ±127 (-128 unused, so the range is symmetric). A row holding NaN gets a NaN scale (its
    NaN elements give 0). Dequantize with `mslk.quantize.triton.fp8_quantize.dequantize_fp8_row(xq, scale)`.
    """
    return torch.ops.mslk.quantize_int8_row(a, scale_ub)
