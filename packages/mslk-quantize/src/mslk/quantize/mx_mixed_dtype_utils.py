"""MXFP6 (E2M3) helpers (spec Q-23, §7.5), in plain PyTorch: quantize to 6-bit codes with E8M0 block
scales, and pack four codes into three bytes.

E2M3: sign, 2 exponent bits (bias 1), 3 mantissa bits; magnitudes 0 .. 7.5. Block scale per `block_size`
elements along the last dim: E8M0 `ceil(log2(amax / 7.5)) + 127` (zero blocks: 2^-127; a block holding NaN or
±Inf: the NaN scale 0xFF, codes 0, NaN when dequantized); elements round to nearest even, saturating at ±7.5.
"""

from __future__ import annotations

import torch

from mslk.core import formats

E2M3_MAX = 7.5
# The 32 codes' magnitudes: subnormals m/8 for exponent 0, then (1 + m/8) · 2^(e-1).
E2M3_DECODE = tuple([m / 8 for m in range(8)] + [(1 + m / 8) * 2.0 ** (e - 1) for e in range(1, 4) for m in range(8)])


def _e2m3_codes(v: torch.Tensor) -> torch.Tensor:
    """6-bit codes (sign in bit 5) of fp32 values, nearest representable magnitude, ties to the even code."""
    grid = torch.tensor(E2M3_DECODE, device=v.device)
    a = v.abs().clamp(max=E2M3_MAX)
    upper = torch.searchsorted(grid, a).clamp(max=len(E2M3_DECODE) - 1)  # first grid value >= a
    lower = (upper - 1).clamp(min=0)
    below, above = a - grid[lower], grid[upper] - a
    take_upper = (above < below) | ((above == below) & (upper % 2 == 0))
    code = torch.where(take_upper, upper, lower).to(torch.uint8)
    return code | ((v < 0).to(torch.uint8) << 5)


def quantize_bf16_to_mx6_e2m3(x: torch.Tensor, block_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (K % block_size == 0) -> (E2M3 codes uint8 [..., K], E8M0 scales uint8 [..., K/block_size])."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"quantize_bf16_to_mx6_e2m3: block_size must be a positive int, got {block_size!r}")
    if not x.dtype.is_floating_point or x.dim() < 1 or x.shape[-1] % block_size:
        raise ValueError(
            f"quantize_bf16_to_mx6_e2m3: expected a float tensor whose last dim is a multiple of {block_size}, "
            f"got {tuple(x.shape)} {x.dtype}"
        )
    blocks = x.float().unflatten(-1, (x.shape[-1] // block_size, block_size))
    scale_bytes, inverse = formats.e8m0_rceil(blocks.abs().amax(dim=-1), E2M3_MAX)
    scaled = blocks * inverse[..., None]
    codes = _e2m3_codes(torch.where(scaled.isnan(), 0.0, scaled)).flatten(-2)  # (NaN blocks: their scale says so)
    return codes, scale_bytes.to(torch.uint8)


def dequantize_mx6_e2m3(codes: torch.Tensor, scales: torch.Tensor, block_size: int = 32) -> torch.Tensor:
    """fp32 values of unpacked E2M3 codes [..., K] with E8M0 scales [..., K/block_size]."""
    magnitude = torch.tensor(E2M3_DECODE, device=codes.device)[(codes & 0x1F).long()]
    values = torch.where((codes & 0x20) != 0, -magnitude, magnitude).unflatten(-1, (-1, block_size))
    scale = torch.where(scales == formats.E8M0_NAN, torch.nan, torch.exp2(scales.float() - 127))
    return (values * scale[..., None]).flatten(-2)


def pack_fp6_e2m3(unpacked: torch.Tensor) -> torch.Tensor:
    """uint8 6-bit codes [..., K] (K % 4 == 0) -> uint8 [..., K·6/8]: each 4 codes make 24 bits, least
    significant first (code 0 in bits 0-5 of byte 0), stored as 3 bytes."""
    if unpacked.dtype != torch.uint8 or unpacked.shape[-1] % 4:
        raise ValueError(
            f"pack_fp6_e2m3: expected uint8 [..., K] with K % 4 == 0, got {tuple(unpacked.shape)} {unpacked.dtype}"
        )
    c = unpacked.unflatten(-1, (-1, 4)).to(torch.int32) & 0x3F
    word = c[..., 0] | (c[..., 1] << 6) | (c[..., 2] << 12) | (c[..., 3] << 18)  # 24 bits
    return torch.stack([(word >> s) & 0xFF for s in (0, 8, 16)], dim=-1).to(torch.uint8).flatten(-2)


def unpack_fp6_e2m3(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_fp6_e2m3."""
    if packed.dtype != torch.uint8 or packed.dim() < 1 or packed.shape[-1] % 3:
        raise ValueError(
            f"unpack_fp6_e2m3: expected uint8 [..., K·6/8] with a multiple of 3 bytes, got {tuple(packed.shape)} "
            f"{packed.dtype}"
        )
    b = packed.unflatten(-1, (-1, 3)).to(torch.int32)
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
    return torch.stack([(word >> s) & 0x3F for s in (0, 6, 12, 18)], dim=-1).to(torch.uint8).flatten(-2)
