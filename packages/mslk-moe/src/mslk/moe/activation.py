"""SwiGLU of the experts (spec M-07): `silu_mul(x0, x1) = x0 · sigmoid(x0) · x1`.

This release runs the plain-PyTorch implementation on every device; a Triton kernel will be a backend of the
same op.
"""

from __future__ import annotations

import torch

from mslk.core import registry, testing


def _validate(x0, x1, valid_token_count=None):
    if x0.shape != x1.shape or x0.dim() != 2 or x0.dtype != x1.dtype or not x0.dtype.is_floating_point:
        raise ValueError(
            f"silu_mul: x0 and x1 must be floating-point [T, D] of one shape and dtype, got {tuple(x0.shape)} "
            f"{x0.dtype} and {tuple(x1.shape)} {x1.dtype}"
        )
    if valid_token_count is not None and (valid_token_count.numel() != 1 or valid_token_count.dtype.is_floating_point):
        raise ValueError(f"silu_mul: valid_token_count must be one integer, got {tuple(valid_token_count.shape)}")


def _silu_mul(x0, x1, valid_token_count=None):
    a = x0.float()
    out = a * torch.sigmoid(a) * x1.float()
    if valid_token_count is not None:  # rows at or past the count are zero
        out = out * (torch.arange(x0.shape[0], device=x0.device) < valid_token_count.reshape(()).to(x0.device))[:, None]
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
