"""FP4 (E2M1) formats in plain PyTorch (spec Q-16, Q-17, §7.5): constants, the E2M1 code, the blocked
(swizzled) scale layout, and the MXFP4 / NVFP4 quantization references and dequantizers.

These are the CPU kernels of the FP4 quantizers and the oracles of their Triton kernels (fp4_quantize.py).
Element rounding is round-to-nearest-even with saturation at ±6 (the OCP MX and NVFP4 conversion).

The reference library's helpers keep their contracts (spec Q-16): `fp4_to_float` unpacks packed bytes,
`scale_nvfp4` applies block scales (over the global scale) to dequantized E2M1 values, `global_scale_nvfp4` is
one 0-dim value, and `dequantize_nvfp4` / `dequantize_mx4` take what the quantizers return (packed data, blocked
scales) and give bf16.
"""

from __future__ import annotations

import math
from enum import IntEnum

import torch

from mslk.core.formats import E8M0_DTYPES, swizzled_scale_shape
from mslk.quantize.reference import abs_max

FP4_E2M1_MAX = 6.0
FP8_E4M3_MAX = 448.0
FP4_EBITS, FP4_MBITS = 2, 1
E8M0_EXPONENT_BIAS = 127
E8M0_NAN = 255
# The eight E2M1 magnitudes by code (bit 3 is the sign).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Round-to-nearest-even boundaries between consecutive codes: a magnitude above a "strict" boundary (or at
# or above a "loose" one) moves up a code; at a tie the even code wins (0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0).
_RNE_STRICT = (0.25, 1.25, 2.5, 5.0)
_RNE_LOOSE = (0.75, 1.75, 3.5)
# The fp32 mantissa of sqrt(2), rounded up: 1.m >= sqrt(2) exactly when the mantissa bits reach it.
_SQRT2_MANTISSA = 0x3504F4


class RoundingMode(IntEnum):
    """How the MX shared exponent is rounded from log2(amax) (spec Q-17)."""

    nearest = 0
    floor = 1
    even = 2
    stochastic = 3
    ceil = 4


def get_mx4_exp_bias(ebits: int) -> int:
    """The exponent bias of an `ebits`-bit exponent, 2^(ebits - 1) - 1 (1 for E2M1)."""
    if ebits < 1:
        raise ValueError(f"get_mx4_exp_bias: ebits must be >= 1, got {ebits}")
    return 2 ** (ebits - 1) - 1


def e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """4-bit E2M1 codes (uint8) of fp32 values, round-to-nearest-even, saturating at ±6; bit 3 is the sign bit
    of v (so -0.0 gives the E2M1 -0); NaN gives +6 (code 7), as the GPU's NaN is positive."""
    a = v.abs().nan_to_num(nan=math.inf)
    code = sum((a > t).to(torch.uint8) for t in _RNE_STRICT) + sum((a >= t).to(torch.uint8) for t in _RNE_LOOSE)
    return code | ((v.signbit() & ~v.isnan()).to(torch.uint8) << 3)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of E2M1 codes (the low 4 bits of each element)."""
    table = torch.tensor(E2M1_VALUES, device=codes.device)
    magnitude = table[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -magnitude, magnitude)


def fp4_to_float(x: torch.Tensor) -> torch.Tensor:
    """fp32 [..., 2·K] of packed E2M1 [..., K] (uint8 or float4_e2m1fn_x2; the even element in the low nibble)."""
    return e2m1_values(unpack_fp4(x))


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes -> [..., K/2] uint8, the even element in the low nibble (contiguous, whatever codes' layout)."""
    return (codes[..., ::2] | (codes[..., 1::2] << 4)).contiguous()


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] uint8 -> [..., K] codes (inverse of pack_fp4)."""
    packed = packed.view(torch.uint8)
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def to_blocked(scale: torch.Tensor) -> torch.Tensor:
    """[rows, cols] scales -> the flat CUDA blocked layout: the matrix zero-padded to [⌈rows/128⌉·128,
    ⌈cols/4⌉·4], cut into 128x4 tiles stored tile by tile (row-block major), element (r, c) of a tile at
    (r % 32)·16 + (r // 32)·4 + c."""
    rows, cols = scale.shape
    rb, cb = math.ceil(rows / 128), math.ceil(cols / 4)
    padded = scale.new_zeros(rb * 128, cb * 4)
    padded[:rows, :cols] = scale
    tiles = padded.view(rb, 4, 32, cb, 4).permute(0, 3, 2, 1, 4)  # [rb, cb, r%32, r//32, c]
    return tiles.reshape(-1)


def from_blocked(blocked: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """Inverse of to_blocked: the [rows, cols] = shape scales (contiguous) of the blocked layout, flat or as its
    2-D padded matrix (NVFP4's)."""
    rows, cols = shape
    rb, cb = math.ceil(rows / 128), math.ceil(cols / 4)
    tiles = blocked.reshape(rb, cb, 32, 4, 4).permute(0, 3, 2, 1, 4)  # [rb, r//32, r%32, cb, c]
    return tiles.reshape(rb * 128, cb * 4)[:rows, :cols].contiguous()


def row_segments(m_sizes: torch.Tensor, rows: int) -> torch.Tensor:
    """Segment (int64) of each of `rows` stacked rows, segment g holding m_sizes[g] rows in order; rows past
    sum(m_sizes) get G. No host synchronization."""
    ends = torch.cumsum(m_sizes.to(torch.int64), 0)
    return torch.searchsorted(ends, torch.arange(rows, device=m_sizes.device), right=True)


def to_blocked_stacked(scale: torch.Tensor, m_sizes: torch.Tensor) -> torch.Tensor:
    """[M, cols] scales of a stacked input -> the flat buffer of `mslk.core.formats.stacked_swizzled_scale_shape`:
    each segment's rows in the blocked layout (to_blocked) from a 128-row boundary; zeros elsewhere (and for
    rows past sum(m_sizes)). Index arithmetic on the device: no host sync, CUDA-graph safe."""
    rows, cols = scale.shape
    col_blocks = math.ceil(cols / 4)
    sizes = m_sizes.to(device=scale.device, dtype=torch.int64)
    padded = (sizes + 127) // 128 * 128
    zero = sizes.new_zeros(1)  # start of the "segment" G of rows past the end
    starts = torch.cat([torch.cumsum(sizes, 0) - sizes, zero])
    padded_starts = torch.cat([torch.cumsum(padded, 0) - padded, zero])
    segment = row_segments(sizes, rows)
    r = (padded_starts[segment] + torch.arange(rows, device=scale.device) - starts[segment])[:, None]
    c = torch.arange(cols, device=scale.device)[None, :]
    offset = ((r // 128) * col_blocks + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
    numel = (rows + 127 * sizes.numel()) * col_blocks * 4
    offset = torch.where((segment < sizes.numel())[:, None], offset, numel)  # rows past the end: a dropped slot
    out = scale.new_zeros(numel + 1)
    return out.scatter_(0, offset.reshape(-1), scale.reshape(-1))[:numel]


def from_blocked_stacked(flat: torch.Tensor, m_sizes: torch.Tensor, cols: int) -> torch.Tensor:
    """Inverse of to_blocked_stacked: the [sum(m_sizes), cols] scales."""
    padded_cols = math.ceil(cols / 4) * 4
    parts, padded_start = [], 0
    for size in m_sizes.tolist():
        padded = math.ceil(size / 128) * 128
        parts.append(
            from_blocked(flat[padded_start * padded_cols : (padded_start + padded) * padded_cols], (size, cols))
        )
        padded_start += padded
    return torch.cat(parts) if parts else flat.new_zeros(0, cols)


def _fp32_fields(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    bits = x.float().view(torch.int32)
    return ((bits >> 23) & 0xFF) - 127, bits & 0x7FFFFF


def mx_shared_exponent(amax: torch.Tensor, rounding_mode: int, random_bits: torch.Tensor | None = None) -> torch.Tensor:
    """Unbiased E8M0 exponent of each group: `clamp(round_mode(log2 amax) − 2, −127, 125)` (spec §7.5), with
    log2 rounded exactly on the fp32 bits; a zero group counts as the smallest normal (2^-126). Stochastic
    mode adds `random_bits` (int32, low 22 bits used) to the mantissa before flooring."""
    amax = torch.where(amax == 0, torch.full_like(amax, 2.0**-126), amax.float())
    exponent, mantissa = _fp32_fields(amax)
    if rounding_mode == RoundingMode.floor:
        e = exponent
    elif rounding_mode == RoundingMode.ceil:
        e = exponent + (mantissa != 0).to(torch.int32)
    elif rounding_mode == RoundingMode.nearest:
        e = exponent + (mantissa >= _SQRT2_MANTISSA).to(torch.int32)
    elif rounding_mode == RoundingMode.even:  # round amax to 2 significant bits (ties up), then floor
        e = exponent + (mantissa + (1 << 21) - 1 >= 1 << 23).to(torch.int32)
    elif rounding_mode == RoundingMode.stochastic:
        if random_bits is None:
            random_bits = torch.randint(0, 2**31 - 1, amax.shape, dtype=torch.int32, device=amax.device)
        e = exponent + (mantissa + (random_bits & ((1 << 22) - 1)) >= 1 << 23).to(torch.int32)
    else:
        raise ValueError(f"unknown rounding mode {rounding_mode} (expected one of {list(RoundingMode)})")
    return (e - FP4_EBITS).clamp(-127, 125)


def quantize_mx4(
    x: torch.Tensor,
    group_size: int = 32,
    rounding_mode: int = RoundingMode.ceil,
    layout: str = "swizzled",
    seed: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 reference: x [..., K] (K % group_size == 0) -> (packed E2M1 uint8 [..., K/2], E8M0 scales uint8:
    flat blocked over [M, K/gs] when layout="swizzled", [..., K/gs] when "plain"). A group holding NaN gets
    the E8M0 NaN scale (255), which dequantizes the whole group to NaN (its elements are packed as computed).
    Stochastic rounding draws from torch's generator, seeded with `seed` when given (the same seed, the same
    result; not the Triton kernel's draws)."""
    k = x.shape[-1]
    groups = x.float().reshape(-1, k // group_size, group_size)
    amax = groups.abs().amax(dim=-1) if groups.numel() else groups.new_zeros(groups.shape[:2])
    random_bits = None
    if rounding_mode == RoundingMode.stochastic and seed is not None:
        generator = torch.Generator(x.device).manual_seed(seed)
        random_bits = torch.randint(0, 2**31 - 1, amax.shape, generator=generator, dtype=torch.int32, device=x.device)
    exponent = mx_shared_exponent(amax, rounding_mode, random_bits)
    codes = e2m1_codes(groups * torch.exp2(-exponent.float())[..., None]).reshape(*x.shape)
    biased = (exponent + E8M0_EXPONENT_BIAS).to(torch.uint8)
    biased = torch.where(amax.isnan(), torch.full_like(biased, E8M0_NAN), biased)
    scale = to_blocked(biased) if layout == "swizzled" else biased.reshape(*x.shape[:-1], k // group_size)
    return pack_fp4(codes), scale


def _check_packed(where: str, xq: torch.Tensor, scale: torch.Tensor, group_size: int, scale_dtypes, plain: bool):
    """Raise a ValueError naming `where` unless xq is packed FP4 (uint8 [..., K/2]) and scale its blocked scales
    (flat or 2-D) or, where `plain`, plain ones [..., K/gs], of one of scale_dtypes."""
    if xq.dtype != torch.uint8 or xq.dim() < 1 or (2 * xq.shape[-1]) % group_size:
        raise ValueError(
            f"{where}: expected packed FP4 uint8 [..., K/2] with K a multiple of {group_size}, got "
            f"{tuple(xq.shape)} {xq.dtype}"
        )
    rows, groups = math.prod(xq.shape[:-1]), 2 * xq.shape[-1] // group_size
    blocked = swizzled_scale_shape(rows, groups)
    shapes = [blocked, (math.prod(blocked),), *([(*xq.shape[:-1], groups)] if plain else [])]
    if tuple(scale.shape) not in shapes or scale.dtype not in scale_dtypes:
        raise ValueError(
            f"{where}: expected scales of shape {' or '.join(map(str, shapes))} in "
            f"{' or '.join(map(str, scale_dtypes))} for packed data {tuple(xq.shape)} (groups of {group_size}), "
            f"got {tuple(scale.shape)} {scale.dtype}"
        )


def _plain_scales(xq: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """The [M, K/gs] scales of packed data [..., K/2] (M its rows) from the plain layout [..., K/gs] (MXFP4 on
    ROCm), or else from the blocked one (flat, as the quantizers return it; a 2-D padded matrix whose shape happens
    to be the plain one would read as plain)."""
    rows, groups = math.prod(xq.shape[:-1]), 2 * xq.shape[-1] // group_size
    if tuple(scale.shape) == (*xq.shape[:-1], groups):
        return scale.reshape(rows, groups)
    return from_blocked(scale, (rows, groups))


def dequantize_mx4(xq: torch.Tensor, scale: torch.Tensor, group_size: int = 32) -> torch.Tensor:
    """bf16 [..., K] of packed MXFP4 [..., K/2] and its E8M0 scales as the quantizers return them: flat blocked
    (CUDA) or plain [..., K/gs] (ROCm); uint8, int8 or float8_e8m0fnu. Exact (E2M1 · 2^e fits bf16); the E8M0 NaN
    scale gives NaN."""
    _check_packed("dequantize_mx4", xq, scale, group_size, E8M0_DTYPES, plain=True)
    biased = _plain_scales(xq, scale, group_size).view(torch.uint8).float()
    factor = torch.where(biased == E8M0_NAN, float("nan"), torch.exp2(biased - E8M0_EXPONENT_BIAS))
    values = fp4_to_float(xq).reshape(biased.shape[0], -1, group_size) * factor[..., None]
    return values.reshape(*xq.shape[:-1], -1).to(torch.bfloat16)


def global_scale_nvfp4(x: torch.Tensor) -> torch.Tensor:
    """NVFP4 global scale `448 · 6 / amax(x)` (fp32, 0-dim); torchao's is its inverse."""
    return FP8_E4M3_MAX * FP4_E2M1_MAX / abs_max(x)


def scale_nvfp4(
    x: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor | None = None, group_size: int = 16
) -> torch.Tensor:
    """Dequantized E2M1 values x [..., K] (fp32) times their block scales over the global scale (None: 1): each
    group of `group_size` along K by `scale / global_scale`, scale [M, ≥ K/gs] e4m3 (or its bytes), M the rows of
    x (extra columns, a padded matrix's, are ignored)."""
    groups = x.shape[-1] // group_size
    true_scale = scale.view(torch.float8_e4m3fn).float().reshape(math.prod(x.shape[:-1]), -1)[:, :groups]
    true_scale = true_scale / _global(global_scale, x.device)
    return (x.reshape(-1, groups, group_size) * true_scale[..., None]).reshape(x.shape)


def _block_scales(x: torch.Tensor, gs: torch.Tensor, e8m0: bool = False, group_size: int = 16) -> torch.Tensor:
    """e4m3 block scales [..., K/gs] of x [..., K]: `min(amax_b / 6 · gs, 448)`, or with e8m0 (MXFP4 mimicked by
    NVFP4) the power of two `min(e8m0_even(amax_b / 4 · gs), 448)`, 1 where that exponent is 0 or 255."""
    amax = x.float().unflatten(-1, (-1, group_size)).abs().amax(dim=-1)
    # Tensor divisors: torch divides by a Python number through its reciprocal (a second rounding).
    if not e8m0:
        return (amax / amax.new_full((), FP4_E2M1_MAX) * gs).clamp(max=FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    exponent = (((amax / amax.new_full((), 4.0) * gs).view(torch.int32) + (1 << 21) - 1) >> 23) & 0xFF
    power = torch.where((exponent == 0) | (exponent == 255), 127 << 23, exponent << 23).view(torch.float32)
    return power.clamp(max=FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def _global(global_scale: torch.Tensor | None, device) -> torch.Tensor:
    return torch.ones((), device=device) if global_scale is None else global_scale.float().reshape(()).to(device)


def nvfp4_elements(x2: torch.Tensor, block_scale: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """E2M1 codes [M, K] of x2 [M, K] under e4m3 block scales [M, K/16] and global scale(s) gs (0-dim, or [M, 1]
    for one per row): E2M1(x · (gs / s_b)), one IEEE division per block as the reference library's kernel; zero
    scale -> zeros."""
    denom = block_scale.float()
    factor = torch.where(denom == 0, 0.0, gs / denom.where(denom != 0, 1.0))
    return e2m1_codes(x2.float().unflatten(-1, (-1, 16)) * factor[..., None]).flatten(-2)


def _nvfp4_codes(x2: torch.Tensor, gs: torch.Tensor, e8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """E2M1 codes [M, K] and e4m3 block scales [M, K/16] of x2 [M, K] with global scale(s) gs."""
    block_scale = _block_scales(x2, gs, e8m0)
    return nvfp4_elements(x2, block_scale, gs), block_scale


def quantize_nvfp4(
    x: torch.Tensor, global_scale: torch.Tensor | None = None, use_e8m0_scale: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 reference: x [..., K] (K % 16 == 0) -> (packed E2M1 uint8 [..., K/2], e4m3 scales in the blocked
    layout as its padded matrix [⌈M/128⌉·128, ⌈K/64⌉·4], M the rows of x). Block scale `s_b = e4m3(amax_b / 6 ·
    gs)` (use_e8m0_scale: see _block_scales), elements `E2M1(x · (gs / s_b))` (0 where s_b = 0);
    `global_scale=None` means 1."""
    x2 = x.reshape(-1, x.shape[-1])
    codes, block_scale = _nvfp4_codes(x2, _global(global_scale, x.device), use_e8m0_scale)
    blocked = to_blocked(block_scale.view(torch.uint8)).view(torch.float8_e4m3fn)
    return pack_fp4(codes.reshape(x.shape)), blocked.reshape(swizzled_scale_shape(*block_scale.shape))


def token_scale_inv_nvfp4(x: torch.Tensor, row_amax: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token inverse global scales [M] of x [..., K]: `max(amax_row, 1e-8) / (448 · 6)` (spec §7.5), from
    the rows' max |x| when given."""
    amax = abs_max(x.reshape(-1, x.shape[-1]), -1) if row_amax is None else row_amax
    return amax.clamp(min=1e-8) / amax.new_full((), FP8_E4M3_MAX * FP4_E2M1_MAX)


def calculate_group_max(
    x: torch.Tensor, m_sizes: torch.Tensor, row_amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-segment NVFP4 global scales of stacked x [..., K] (reference of fp4_quantize.calculate_group_max),
    from the rows' max |x| when given: (448 · 6 / max(segment amax, 1e-8) (as token_scale_inv_nvfp4: an amax
    below 2.4e-35 would make it inf), the largest fp32 for an empty segment; segment of each row, int64).
    Device-side ops, no host sync."""
    x2 = x.reshape(-1, x.shape[-1])
    row_amax = abs_max(x2, -1) if row_amax is None else row_amax
    segment = row_segments(m_sizes, x2.shape[0])
    amax = row_amax.new_zeros(m_sizes.numel() + 1).scatter_reduce_(0, segment, row_amax, "amax")[:-1]
    amax = amax.clamp(min=1e-8)
    global_scale = amax.new_full((), FP8_E4M3_MAX * FP4_E2M1_MAX) / amax
    return torch.where(m_sizes == 0, torch.finfo(torch.float32).max, global_scale), segment


def quantize_nvfp4_stacked(
    m_sizes: torch.Tensor,
    x: torch.Tensor,
    global_scale: torch.Tensor | None = None,
    token_scale_inv: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked NVFP4 reference: the rows of x [M, K] in segments of m_sizes rows, each quantized as NVFP4 with
    its segment's global scale (global_scale [G]) or its own (1 / token_scale_inv [M]), or 1; scales in the
    stacked blocked layout (to_blocked_stacked). Rows past sum(m_sizes) are quantized with scale 1 but
    get no scales."""
    x2 = x.reshape(-1, x.shape[-1])
    gs = torch.ones(x2.shape[0], device=x.device)
    if global_scale is not None:
        segment = row_segments(m_sizes, x2.shape[0])
        gs = torch.cat([global_scale.float(), gs.new_ones(1)])[segment]
    if token_scale_inv is not None:
        gs = torch.ones_like(token_scale_inv) / token_scale_inv
    codes, block_scale = _nvfp4_codes(x2, gs[:, None])
    scale = to_blocked_stacked(block_scale.view(torch.uint8), m_sizes)
    return pack_fp4(codes.reshape(x.shape)), scale.view(torch.float8_e4m3fn)


def dequantize_nvfp4(
    xq: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor | None = None, group_size: int = 16
) -> torch.Tensor:
    """bf16 [..., K] of packed NVFP4 [..., K/2] and its e4m3 scales as triton_quantize_nvfp4 returns them
    (blocked, flat or 2-D): `e2m1 · s_b / gs` (global_scale None: 1)."""
    _check_packed("dequantize_nvfp4", xq, scale, group_size, (torch.float8_e4m3fn,), plain=False)
    plain = from_blocked(scale, (math.prod(xq.shape[:-1]), 2 * xq.shape[-1] // group_size))
    return scale_nvfp4(fp4_to_float(xq), plain, global_scale, group_size).to(torch.bfloat16)


def unsigned_fp32_to_e8m0(tensor: torch.Tensor, mbits: int, scale_round_mode: str) -> torch.Tensor:
    """E8M0 values `2^(e − 127)` (fp32, not the byte) of non-negative fp32 values, the biased exponent e
    rounded on the fp32 bits (spec Q-17): "even" rounds to mbits + 1 significant bits (ties up) and floors,
    "ceil" and "floor" round log2, "nv_round" goes up when any mantissa bit is set below the top exponent 254
    (and for subnormals above half of 2^-126). The sign bit is ignored; inf gives inf."""
    if scale_round_mode == "even":
        to_add = (1 << (23 - mbits - 1)) - 1
    elif scale_round_mode == "ceil":
        to_add = (1 << 23) - 1
    elif scale_round_mode in ("floor", "nv_round"):
        to_add = 0
    else:
        raise ValueError(
            f"unsigned_fp32_to_e8m0: scale_round_mode must be 'even', 'ceil', 'floor' or 'nv_round', "
            f"got {scale_round_mode!r}"
        )
    bits = tensor.float().view(torch.int32)
    e = ((bits + to_add) >> 23) & 0xFF
    if scale_round_mode == "nv_round":
        mantissa = bits & 0x7FFFFF
        subnormal = (e == 0) & (mantissa != 0)
        up = (~subnormal & (e < 254) & (mantissa > 0)) | (subnormal & (mantissa > 1 << 22))
        e = e + up.to(torch.int32)
    # 2^(e-127) built from its bits (exact on every device): e << 23, except 2^-127, a subnormal; 255 is inf.
    return torch.where(e == 0, 1 << 22, e << 23).to(torch.int32).view(torch.float32)
