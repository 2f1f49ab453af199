"""SwiGLU of the experts (spec M-07, M-08): `silu_mul(x0, x1) = x0 · sigmoid(x0) · x1`, and `silu_mul_quant`,
the same followed by rowwise FP8 quantization (quantize_fp8_row).

This release composes the plain-PyTorch SwiGLU with mslk.quantize's rowwise quantizer (its Triton kernel on a
GPU); a fused Triton kernel will be a backend of the same ops.
"""

from __future__ import annotations

import torch

from mslk.core import arch, registry, testing
from mslk.moe.common import check_valid_token_count, valid_rows
from mslk.quantize.triton.common import check_scale_ub
from mslk.quantize.triton.fp8_quantize import quantize_fp8_row


def _validate(x0, x1, valid_token_count=None):
    if x0.shape != x1.shape or x0.dim() != 2 or x0.dtype != x1.dtype or not x0.dtype.is_floating_point:
        raise ValueError(
            f"silu_mul: x0 and x1 must be floating-point [T, D] of one shape and dtype, got {tuple(x0.shape)} "
            f"{x0.dtype} and {tuple(x1.shape)} {x1.dtype}"
        )
    check_valid_token_count("silu_mul", valid_token_count)


def _silu_mul(x0, x1, valid_token_count=None):
    a = x0.float()
    out = a * torch.sigmoid(a) * x1.float()
    valid = valid_rows(x0.shape[0], valid_token_count, x0.device)
    if valid is not None:  # rows at or past the count are zero
        out = out * valid[:, None]
    return out.to(x0.dtype)


def _samples(device):
    x0, x1 = (testing.randn(33, 80, dtype=torch.bfloat16, device=device) for _ in range(2))
    yield registry.Sample((x0, x1))
    yield registry.Sample((x0.float(), x1.float(), torch.tensor([17], device=device)))


silu_mul_op = registry.Op(
    "mslk::silu_mul(Tensor x0, Tensor x1, Tensor? valid_token_count=None) -> Tensor",
    domain="moe",
    reference=_silu_mul,
    fake=lambda x0, x1, valid_token_count=None: torch.empty_like(x0),
    samples=_samples,
    validate=_validate,
    reference_devices=("cpu", "cuda"),
)


def silu_mul(x0: torch.Tensor, x1: torch.Tensor, valid_token_count: torch.Tensor | None = None) -> torch.Tensor:
    """`x0 · sigmoid(x0) · x1` in fp32, in x0's dtype (spec M-07); rows at or past valid_token_count are zero."""
    return torch.ops.mslk.silu_mul(x0, x1, valid_token_count)


def _validate_quant(x0, x1, scale_ub=None, valid_token_count=None):
    _validate(x0, x1, valid_token_count)
    check_scale_ub("silu_mul_quant", scale_ub, x0)


def _silu_mul_quant(x0, x1, scale_ub=None, valid_token_count=None):
    return quantize_fp8_row(_silu_mul(x0, x1, valid_token_count), scale_ub)


silu_mul_quant_op = registry.Op(
    "mslk::silu_mul_quant(Tensor x0, Tensor x1, Tensor? scale_ub=None, Tensor? valid_token_count=None) "
    "-> (Tensor, Tensor)",
    domain="moe",
    reference=_silu_mul_quant,
    fake=lambda x0, *args: (
        torch.empty_like(x0, dtype=arch.fp8_dtype(x0.device)),
        x0.new_empty(x0.shape[:-1], dtype=torch.float32),
    ),
    samples=lambda device: [registry.Sample((*sample.args[:2], None, *sample.args[2:])) for sample in _samples(device)],
    validate=_validate_quant,
    reference_devices=("cpu", "cuda"),
)


def silu_mul_quant(
    x0: torch.Tensor,
    x1: torch.Tensor,
    scale_ub: torch.Tensor | None = None,
    valid_token_count: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """silu_mul then rowwise FP8 (spec M-08): (xq [T, D] in this platform's FP8, dequantization scale fp32 [T]
    = amax / FP8_MAX as quantize_fp8_row, amax bounded by scale_ub); rows past valid_token_count are zero."""
    return torch.ops.mslk.silu_mul_quant(x0, x1, scale_ub, valid_token_count)
