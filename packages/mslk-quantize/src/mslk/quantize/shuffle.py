"""INT4 weight quantization and packing (spec Q-18, Q-19, Q-20; formats §7.4), in plain PyTorch.

Weights w [N, K] are quantized per group of `group_size` elements along K (the last group may be shorter
when K is not a multiple) into signed 4-bit values in [-8, 7]; the scales (and zero points) come
transposed, [⌈K/gs⌉, N] contiguous, as the INT4 GEMMs read them.
"""

from __future__ import annotations

import torch

# Smallest scale: a group of equal values (or zeros) must not divide by zero.
MIN_INT4_SCALE = 1e-6


def _check(where: str, x: torch.Tensor, group_size: int) -> None:
    if not x.dtype.is_floating_point:
        raise ValueError(f"{where}: x must be a floating-point tensor, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"{where}: x must be 2-D [N, K], got shape {tuple(x.shape)}")
    if group_size < 1:
        raise ValueError(f"{where}: group_size must be positive, got {group_size}")


def _groups(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """x [N, K] as [N, ⌈K/gs⌉, gs] in fp32; the missing tail of the last group repeats its first element,
    which changes neither its max nor its min."""
    n, k = x.shape
    g = -(-k // group_size)
    padded = x.float()
    if g * group_size != k:
        tail = x[:, (g - 1) * group_size : (g - 1) * group_size + 1].float().expand(n, g * group_size - k)
        padded = torch.cat([padded, tail], dim=1)
    return padded.view(n, g, group_size)


def int4_row_quantize_zp(x: torch.Tensor, group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric INT4: per group `scale = max((max − min) / 15, 1e-6)`, `q = clamp(round((x − min) / scale),
    0, 15) − 8`, `zero = min + 8 · scale`, so `x ≈ q · scale + zero`. Returns (q int8 [N, K], scales fp32
    [⌈K/gs⌉, N], zeros fp32 [⌈K/gs⌉, N])."""
    _check("int4_row_quantize_zp", x, group_size)
    n, k = x.shape
    groups = _groups(x, group_size)
    lo, hi = groups.amin(dim=-1, keepdim=True), groups.amax(dim=-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp(min=MIN_INT4_SCALE)
    q = (torch.round((groups - lo) / scale).clamp(0, 15) - 8).to(torch.int8).view(n, -1)[:, :k]
    zero = lo + 8 * scale
    return q.contiguous(), scale[..., 0].t().contiguous(), zero[..., 0].t().contiguous()


def int4_row_quantize(x: torch.Tensor, group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT4: per group `scale = max(amax / 8, 1e-6)`, `q = clamp(round(x / scale), −8, 7)`, so
    `x ≈ q · scale`. Returns (q int8 [N, K], scales fp32 [⌈K/gs⌉, N])."""
    _check("int4_row_quantize", x, group_size)
    n, k = x.shape
    groups = _groups(x, group_size)
    scale = (groups.abs().amax(dim=-1, keepdim=True) / 8).clamp(min=MIN_INT4_SCALE)
    q = torch.round(groups / scale).clamp(-8, 7).to(torch.int8).view(n, -1)[:, :k]
    return q.contiguous(), scale[..., 0].t().contiguous()


def pack_int4(x: torch.Tensor) -> torch.Tensor:
    """int8 values in [-8, 7], [..., K] (K even) -> int8 [..., K/2]: byte = (x[2k] & 0xF) | (x[2k+1] << 4),
    the even element in the low nibble, each nibble two's complement."""
    if x.dtype != torch.int8 or x.shape[-1] % 2:
        raise ValueError(f"pack_int4: expected int8 [..., K] with K even, got {tuple(x.shape)} {x.dtype}")
    return (x[..., ::2] & 0xF) | (x[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int4: int8 [..., K/2] -> int8 [..., K] in [-8, 7] (`signed = (nibble ^ 8) − 8`)."""
    nibbles = torch.stack((packed & 0xF, (packed >> 4) & 0xF), dim=-1).flatten(-2)
    return (nibbles ^ 8) - 8
