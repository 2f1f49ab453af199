"""Plain-PyTorch references of the quantizers (spec §6-§7): the CPU kernels and the test oracles.

Scales are dequantization scales (`x ≈ xq · scale`, spec §7.2).
"""

from __future__ import annotations

import math

import torch

# amax floor of quantize_fp8_row: the reference library's Triton path floors at 1/512 ("CUDA
# min_scaling_factor") and its PyTorch path at 1e-12, so the two disagreed on tiny rows; ours use one floor.
FP8_ROW_EPS = 1.0 / 512


def abs_max(a: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """max |a| in fp32 over the last dim (dim=-1) or all elements (None), NaN-propagating, 0 where there is
    nothing to reduce. One read of `a` (torch.aminmax): no |a| or fp32 copy of it."""
    if a.numel() == 0:
        return torch.zeros(() if dim is None else a.shape[:-1], dtype=torch.float32, device=a.device)
    lo, hi = torch.aminmax(a) if dim is None else torch.aminmax(a, dim=dim)
    return torch.maximum(-lo, hi).float() + 0.0  # (+0.0: of all zeros, -lo is -0.0, and 448 · 6 / -0.0 is -inf)


def jagged_rows_zeroed(a: torch.Tensor, zero_start_index_M: torch.Tensor) -> torch.Tensor:
    """`a` [..., M, K] with rows m >= zero_start_index_M[matrix] of each [M, K] matrix set to zero."""
    counts = zero_start_index_M.reshape(*a.shape[:-2], 1).to(a.device)
    rows = torch.arange(a.shape[-2], device=a.device)
    return torch.where((rows < counts)[..., None], a, torch.zeros((), dtype=a.dtype, device=a.device))


def quantize_fp8_row(
    a: torch.Tensor,
    scale_ub: torch.Tensor | None,
    zero_start_index_M: torch.Tensor | None,
    align_rows_to: int | None,
    eps: float,
    fp8_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rowwise FP8: per row `amax = clamp(max|a|, eps, scale_ub)`, `scale = amax / FP8_MAX`,
    `xq = clamp(a · (FP8_MAX / amax), ±FP8_MAX)`; xq's last dim zero-padded up to a multiple of
    `align_rows_to`. Returns (xq [..., K'], scale fp32 [...])."""
    if zero_start_index_M is not None:
        a = jagged_rows_zeroed(a, zero_start_index_M)
    xq, scale = _quantize_with_amax(a, _bounded(abs_max(a, -1), eps, scale_ub)[..., None], fp8_dtype)
    k = a.shape[-1]
    padded_k = -(-k // align_rows_to) * align_rows_to if align_rows_to else k
    if padded_k != k:
        xq = torch.nn.functional.pad(xq.view(torch.uint8), (0, padded_k - k)).view(fp8_dtype)
    return xq, scale[..., 0]


def dequantize_fp8_row(xq: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """bf16 `xq · scale[..., None]` (the inverse of quantize_fp8_row); scale [..., M] or flat (one per row)."""
    return (xq.float() * scale.float().reshape(*xq.shape[:-1], 1)).to(torch.bfloat16)


def _quantize_with_amax(x: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`clamp(x · QMAX / amax, ±QMAX)` as `dtype` (an FP8 type, QMAX its max; or int8, QMAX 127, rounded half
    to even, NaN to 0) and the dequantization scale `amax / QMAX`; `amax` broadcasts against `x`. QMAX is a
    tensor so that both divisions are IEEE-rounded: torch computes `number / tensor` as reciprocal times
    number, and CUDA divides by a CPU scalar through its reciprocal."""
    integer = dtype == torch.int8
    qmax = amax.new_full((), torch.iinfo(dtype).max if integer else torch.finfo(dtype).max)
    q = (x.float() * (qmax / amax)).clamp(-qmax, qmax)
    if integer:
        q = q.round().nan_to_num(nan=0.0)
    # Contiguous, as the kernels write it (elementwise ops would keep x's layout, a transposed one included).
    return q.to(dtype).contiguous(), amax / qmax


def quantize_int8_row(a: torch.Tensor, scale_ub: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rowwise symmetric INT8: per row `amax = clamp(max|a|, eps, scale_ub)`, `scale = amax / 127`,
    `xq = round_half_even(clamp(a · (127 / amax), ±127))` (a NaN element gives 0, its row a NaN scale)."""
    xq, scale = _quantize_with_amax(a, _bounded(abs_max(a, -1), eps, scale_ub)[..., None], torch.int8)
    return xq, scale[..., 0]


def _bounded(amax: torch.Tensor, eps: float, scale_ub: torch.Tensor | None) -> torch.Tensor:
    amax = amax.clamp(min=eps)
    if scale_ub is not None:
        amax = torch.minimum(amax, scale_ub.float().reshape(()).to(amax.device))
    return amax


def quantize_fp8_block(
    x: torch.Tensor,
    block_m: int,
    block_k: int,
    scale_ub: torch.Tensor | None,
    k_major: bool,
    eps: float,
    fp8_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise FP8 of x viewed as 2-D [M, K] (leading dims flattened): one scale per block_m x block_k
    tile, `amax = clamp(max|tile|, eps, scale_ub)`, scale [⌈M/bm⌉, ⌈K/bk⌉] (transposed when not k_major)."""
    k = x.shape[-1]
    m = math.prod(x.shape[:-1])
    x2 = x.reshape(m, k)
    mb, kb = -(-m // block_m), -(-k // block_k)
    bm, bk = max(min(block_m, m), 1), max(min(block_k, k), 1)  # a block past the data's end: one tile of it all
    # Zero-pad to whole tiles (zeros do not change a tile's amax), then view as [mb, bm, kb, bk].
    padded = torch.zeros(mb * bm, kb * bk, dtype=torch.float32, device=x.device)
    padded[:m, :k] = x2.float()
    tiles = padded.view(mb, bm, kb, bk)
    amax = _bounded(tiles.abs().amax(dim=(1, 3)), eps, scale_ub)
    xq, scale = _quantize_with_amax(tiles, amax[:, None, :, None], fp8_dtype)
    xq = xq.view(mb * bm, kb * bk)[:m, :k].contiguous().view(x.shape)
    scale = scale.reshape(mb, kb)
    return xq, scale if k_major else scale.t().contiguous()


def quantize_fp8_tensor(a: torch.Tensor, eps: float, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Tensorwise FP8: `amax = max(max|a|, eps)`, one 0-dim fp32 scale `amax / FP8_MAX`."""
    amax = abs_max(a)
    return _quantize_with_amax(a, _bounded(amax, eps, None), fp8_dtype)


def m_major_group_scales(scale: torch.Tensor, m_sizes: torch.Tensor) -> torch.Tensor:
    """Rearrange k-major group scales [M, G] into the per-expert M-major layout of quantize_fp8_group with
    m_sizes: expert e's block [G, M_e] lies flat at offset (Σ_{e'<e} M_e')·G of an [M, G] buffer. Sizes that do
    not fit the rows are cut (negative ones count as 0, experts past row M end there); the rows past ΣM_e form one
    more block after them, so that no scale lands on another's place. Index arithmetic on the device, without
    reading m_sizes on the host (CUDA-graph safe)."""
    m, g = scale.shape
    sizes = m_sizes.to(device=scale.device, dtype=torch.int64).clamp(min=0)
    ends = torch.cat([torch.cumsum(sizes, 0).clamp(max=m), sizes.new_full((1,), m)])
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    rows = torch.arange(m, device=scale.device)
    block = torch.searchsorted(ends, rows, right=True)  # (< len(ends): the last end is m)
    start, rows_in_block = starts[block], (ends - starts)[block]
    cols = torch.arange(g, device=scale.device)
    flat = start[:, None] * g + cols[None, :] * rows_in_block[:, None] + (rows - start)[:, None]
    out = torch.empty(m * g, dtype=scale.dtype, device=scale.device)
    out[flat.reshape(-1)] = scale.reshape(-1)
    return out.view(m, g)


def dequantize_fp8_block(xq: torch.Tensor, scale: torch.Tensor, block_m: int, block_k: int) -> torch.Tensor:
    """bf16 `xq · scale` with each scale repeated over its block_m x block_k tile (k-major scale)."""
    m, k = xq.shape
    full = scale.repeat_interleave(min(block_m, m), 0)[:m].repeat_interleave(min(block_k, k), 1)[:, :k]
    return (xq.float() * full).to(torch.bfloat16)
