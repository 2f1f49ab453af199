"""MXFP4 at the reference library's module path (spec Q-12); see fp4_quantize.triton_quantize_mx4_unpack."""

from __future__ import annotations

import torch

from mslk.quantize.triton.fp4_quantize import RoundingMode, triton_quantize_mx4_unpack


def quantize_mx4(
    x: torch.Tensor,
    group_size: int = 32,
    rounding_mode: RoundingMode | int = RoundingMode.ceil,
    *,
    seed: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 of x [..., K] with groups of 32 (or 16): (packed E2M1 uint8, E8M0 scales in this platform's layout)."""
    return triton_quantize_mx4_unpack(x, group_size, rounding_mode=rounding_mode, seed=seed)
