"""FP4 quantizers (spec Q-10..Q-14; formats §7.5): MXFP4 (E8M0 scales per 32 or 16 elements) and NVFP4 (e4m3
scales per 16 elements and fp32 global scales), dense and stacked (MoE segments), as Triton kernels.

Registered as `torch.ops.mslk.quantize_mx4`, `quantize_nvfp4`, `quantize_mx4_stacked`, `quantize_nvfp4_stacked`,
`quantize_nvfp4_stacked_token_scale` and `calculate_group_max` (with fake kernels; the references of fp4_utils
are the CPU kernels); the reference library's entry points (`triton_quantize_mx4`, `triton_quantize_mx4_unpack`,
`triton_quantize_nvfp4`, `quantize_mx4_stacked`, `nvfp4_quantize_stacked(_with_token_scale)`,
`calculate_group_max`) call them. Dense MXFP4 scales come in this platform's layout
(`mslk.core.formats.platform_mx_layout`), as the reference library's: flat blocked (swizzled) int8 on CUDA, plain
[..., K/gs] uint8 on ROCm. NVFP4 scales are blocked, as their padded matrix [⌈M/128⌉·128, ⌈K/64⌉·4]; stacked
scales are blocked per segment in a flat buffer.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from mslk.core import arch, formats, launch, registry, testing
from mslk.quantize.triton import fp4_utils
from mslk.quantize.triton.common import check_float_input, e2m1_codes, max_nan
from mslk.quantize.triton.fp4_utils import (  # noqa: F401  (the reference module's public names)
    E8M0_EXPONENT_BIAS,
    FP4_E2M1_MAX,
    FP4_EBITS,
    FP4_MBITS,
    FP8_E4M3_MAX,
    RoundingMode,
    get_mx4_exp_bias,
    unsigned_fp32_to_e8m0,
)
from mslk.quantize.triton.fp4_utils import from_blocked as _from_blocked  # noqa: F401  (spec Q-17's names)
from mslk.quantize.triton.fp4_utils import to_blocked as _to_blocked  # noqa: F401
from mslk.quantize.triton.nvfp4_fake_quantize import (  # noqa: F401  (the reference module's public names, Q-15)
    cal_global_scale_mx4_as_nvfp4,
    triton_fake_quantize_nvfp4_per_tensor,
)


def _check(where: str, x: torch.Tensor, group_size: int) -> None:
    check_float_input(where, "input", x)
    if x.dim() < 1 or x.shape[-1] == 0 or x.shape[-1] % group_size:
        raise ValueError(
            f"{where}: the last dimension must be a positive multiple of the group size {group_size}, got shape "
            f"{tuple(x.shape)}"
        )


def _scale_numel(rows: int, groups: int, layout: str) -> int:
    return math.prod(formats.swizzled_scale_shape(rows, groups)) if layout == "swizzled" else rows * groups


def _scale_shape(x: torch.Tensor, groups: int, layout: str) -> tuple[int, ...]:
    rows = math.prod(x.shape[:-1])
    return (_scale_numel(rows, groups, layout),) if layout == "swizzled" else (*x.shape[:-1], groups)


def _mx_scale_dtype(layout: str) -> torch.dtype:
    """The E8M0 bytes' dtype of dense MXFP4 scales, as the reference library's (spec Q-10): int8 in the CUDA
    blocked layout, uint8 plain (ROCm)."""
    return torch.int8 if layout == "swizzled" else torch.uint8


# ------------------------------------------------------------------------------------------------- MXFP4


def _check_mx4_options(where: str, group_size: int, rounding_mode: int) -> None:
    """Before the shapes: those divide by the group size."""
    if group_size not in (16, 32):
        raise ValueError(f"{where}: group_size must be 32 (MXFP4) or 16 (MXFP4-16), got {group_size}")
    if rounding_mode not in set(RoundingMode):
        raise ValueError(f"{where}: rounding_mode must be one of {[int(m) for m in RoundingMode]}, got {rounding_mode}")


def _validate_mx4(x, group_size=32, rounding_mode=RoundingMode.ceil, stochastic_casting=False, seed=None):
    _check_mx4_options("quantize_mx4", group_size, rounding_mode)
    _check("quantize_mx4", x, group_size)


def _mx4_reference(x, group_size=32, rounding_mode=RoundingMode.ceil, stochastic_casting=False, seed=None):
    if stochastic_casting:
        raise ValueError("quantize_mx4: stochastic_casting needs the Triton kernel (a GPU)")
    layout = formats.platform_mx_layout()
    xq, scale = fp4_utils.quantize_mx4(x, group_size, rounding_mode, layout, seed)
    return xq, scale.view(_mx_scale_dtype(layout))


def _mx4_fake(x, group_size=32, rounding_mode=RoundingMode.ceil, stochastic_casting=False, seed=None):
    xq = x.new_empty((*x.shape[:-1], x.shape[-1] // 2), dtype=torch.uint8)
    layout = formats.platform_mx_layout()
    return xq, x.new_empty(_scale_shape(x, x.shape[-1] // group_size, layout), dtype=_mx_scale_dtype(layout))


def _mx4_samples(device):
    bf16 = torch.bfloat16
    yield registry.Sample((testing.randn(5, 64, dtype=bf16, device=device, std=3.0),))
    yield registry.Sample((testing.randn(2, 3, 96, device=device),), {"group_size": 16, "rounding_mode": 1})
    yield registry.Sample((testing.randn(130, 32, dtype=bf16, device=device),), {"rounding_mode": 0})


quantize_mx4_op = registry.Op(
    "mslk::quantize_mx4(Tensor x, int group_size=32, int rounding_mode=4, bool stochastic_casting=False, "
    "int? seed=None) -> (Tensor, Tensor)",
    domain="quantize",
    reference=_mx4_reference,
    fake=_mx4_fake,
    samples=_mx4_samples,
    validate=_validate_mx4,
    reference_devices=("cpu", "cuda"),
)


@triton.jit
def _store_packed(q_ptr, codes, rows, M, half_k, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, pid_k):
    """Pack [BLOCK_M, BLOCK_K] codes two per byte (even element in the low nibble) and store them."""
    low, high = tl.split(tl.reshape(codes, [BLOCK_M, BLOCK_K // 2, 2]))
    pcols = pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)[None, :]
    tl.store(q_ptr + rows.to(tl.int64) * half_k + pcols, low | (high << 4), mask=(rows < M) & (pcols < half_k))


@triton.jit
def _scale_offsets(rows, groups, n_groups, SWIZZLED: tl.constexpr):
    """Where scale (row, group) lives: the CUDA blocked layout (see fp4_utils.to_blocked) or plain rows."""
    if SWIZZLED:
        col_blocks = (n_groups + 3) // 4
        return (
            ((rows // 128) * col_blocks + groups // 4) * 512 + (rows % 32) * 16 + ((rows % 128) // 32) * 4 + groups % 4
        )
    return rows * n_groups + groups


@triton.jit
def _scale_rows(rows, M, m_sizes_ptr, G, SEGMENTS: tl.constexpr):
    """(row of the scale matrix, whether the row has a scale, segment) of input rows [BLOCK_M, 1]. A stacked
    input (SEGMENTS > 0, a power of two >= G) starts each of its G segments of m_sizes rows on a 128-row
    boundary of the scale matrix; rows past sum(m_sizes) are in segment G and get no scale."""
    if SEGMENTS == 0:
        scale_rows, has_scale, segment = rows, rows < M, rows * 0
    else:
        seg = tl.arange(0, SEGMENTS)
        sizes = tl.load(m_sizes_ptr + seg, mask=seg < G, other=0)  # in m_sizes' type, as the reference's sums
        padded = (sizes + 127) // 128 * 128
        ends = tl.cumsum(sizes, 0)
        segment = tl.sum((ends[None, :] <= rows).to(tl.int32), 1)[:, None]
        shift = tl.cumsum(padded, 0) - padded - (ends - sizes)  # padded start - start, per segment
        scale_rows = rows + tl.sum(tl.where(seg[None, :] == segment, shift[None, :], 0), 1)[:, None]
        has_scale = (rows < M) & (segment < G)
    return scale_rows, has_scale, segment


@triton.jit
def _quantize_mx4_kernel(
    x_ptr, q_ptr, scale_ptr, M, K, stride_xm, stride_xk, m_sizes_ptr, G, seed,
    GROUP: tl.constexpr, ROUNDING: tl.constexpr, STOCHASTIC_CAST: tl.constexpr, SWIZZLED: tl.constexpr,
    SEGMENTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]  # [BLOCK_M, 1]
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]  # [1, BLOCK_K]
    x = tl.load(
        x_ptr + rows.to(tl.int64) * stride_xm + cols.to(tl.int64) * stride_xk, mask=(rows < M) & (cols < K), other=0.0
    )
    g = tl.reshape(x.to(tl.float32), [BLOCK_M, BLOCK_K // GROUP, GROUP])
    amax = tl.reduce(tl.abs(g), 2, max_nan)  # [BLOCK_M, BLOCK_K // GROUP]
    amax = tl.where(amax == 0.0, 1.1754943508222875e-38, amax)  # zero groups count as 2^-126
    bits = amax.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    mantissa = bits & 0x7FFFFF
    if ROUNDING == 1:  # floor
        e = exponent
    elif ROUNDING == 0:  # nearest: 1.m >= sqrt(2)
        e = exponent + (mantissa >= 0x3504F4).to(tl.int32)
    elif ROUNDING == 2:  # even: round amax to two significant bits, then floor
        e = exponent + (mantissa + (1 << 21) - 1 >= (1 << 23)).to(tl.int32)
    elif ROUNDING == 3:  # stochastic
        groups_flat = rows * (K // GROUP) + pid_k * (BLOCK_K // GROUP) + tl.arange(0, BLOCK_K // GROUP)[None, :]
        noise = (tl.randint(seed, groups_flat) & ((1 << 22) - 1)).to(tl.int32)
        e = exponent + (mantissa + noise >= (1 << 23)).to(tl.int32)
    else:  # ceil
        e = exponent + (mantissa != 0).to(tl.int32)
    e = tl.minimum(tl.maximum(e - 2, -127), 125)
    inverse = ((127 - e) << 23).to(tl.float32, bitcast=True)  # 2^-e, exact
    scaled = tl.reshape(g * inverse[:, :, None], [BLOCK_M, BLOCK_K])
    codes = e2m1_codes(scaled, STOCHASTIC_CAST, seed, rows * K + cols)
    _store_packed(q_ptr, codes, rows, M, K // 2, BLOCK_M, BLOCK_K, pid_k)

    groups = pid_k * (BLOCK_K // GROUP) + tl.arange(0, BLOCK_K // GROUP)[None, :]
    biased = tl.where(amax != amax, 255, e + 127).to(tl.uint8)  # E8M0 NaN for a group holding NaN
    scale_rows, has_scale, _ = _scale_rows(rows, M, m_sizes_ptr, G, SEGMENTS)
    offsets = _scale_offsets(scale_rows, groups, K // GROUP, SWIZZLED)
    tl.store(scale_ptr + offsets, biased, mask=has_scale & (groups < K // GROUP))


@functools.cache
def _fp4_tiles(k: int, elements: int, max_width: int, warps: int) -> dict:
    """Tiles of `elements` elements, at most `max_width` wide (the whole row when shorter)."""
    block_k = min(launch.next_power_of_2(max(k, 32)), max_width)
    return {"BLOCK_M": max(1, elements // block_k), "BLOCK_K": block_k, "num_warps": warps}


# (elements, max width, warps) per kernel, the best of the tiles measured on the H200 under CUDA graphs
# (RESULTS.md): MXFP4 8 x 1024, 4 warps (0.72x of a copy); NVFP4 4 x 512, 2 warps (0.74x; 4 warps: 0.64x).
_MX4_TILE, _NVFP4_TILE = (8192, 1024, 4), (2048, 512, 2)


def _launch_fp4(kernel, tile, x, q, scale, m_sizes=None, **args):
    """Run an FP4 kernel over x [..., K] as [M, K]; `m_sizes` makes it stacked (see _scale_rows)."""
    k = x.shape[-1]
    x2 = x.reshape(math.prod(x.shape[:-1]), k)
    m = x2.shape[0]
    if m and k:
        tiles = _fp4_tiles(k, *tile)
        grid = (launch.cdiv(m, tiles["BLOCK_M"]), launch.cdiv(k, tiles["BLOCK_K"]))
        g = 0 if m_sizes is None else m_sizes.numel()
        segments = 0 if m_sizes is None else max(16, launch.next_power_of_2(g))
        launch.fast(kernel)[grid](
            x2, q, scale, m, k, x2.stride(0), x2.stride(1), x2 if m_sizes is None else m_sizes.contiguous(), g,
            SEGMENTS=segments, **tiles, **args,
        )  # fmt: skip


def _run_mx4(x, scale_shape, layout, group_size, rounding_mode, stochastic_casting, seed, m_sizes=None):
    q = torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=torch.uint8, device=x.device)
    scale = torch.zeros(scale_shape, dtype=torch.uint8, device=x.device)  # zero padding
    if seed is None and (stochastic_casting or rounding_mode == RoundingMode.stochastic):
        seed = int(torch.randint(0, 2**31 - 1, ()).item())
    _launch_fp4(
        _quantize_mx4_kernel, _MX4_TILE, x, q, scale, m_sizes, seed=seed or 0, GROUP=group_size,
        ROUNDING=int(rounding_mode), STOCHASTIC_CAST=stochastic_casting, SWIZZLED=layout == "swizzled",
    )  # fmt: skip
    return q, scale


@quantize_mx4_op.backend("triton", available=registry.triton_missing)
def _mx4_triton(x, group_size=32, rounding_mode=RoundingMode.ceil, stochastic_casting=False, seed=None):
    layout = formats.platform_mx_layout()
    shape = _scale_shape(x, x.shape[-1] // group_size, layout)
    q, scale = _run_mx4(x, shape, layout, group_size, rounding_mode, stochastic_casting, seed)
    return q, scale.view(_mx_scale_dtype(layout))


def triton_quantize_mx4_unpack(
    input: torch.Tensor,
    group_size: int = 32,
    ebits: int = FP4_EBITS,
    mbits: int = FP4_MBITS,
    rounding_mode: RoundingMode | int = RoundingMode.ceil,
    stochastic_casting: bool = False,
    *,
    seed: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 (spec Q-11): input [..., K] (K % group_size == 0) -> (E2M1 packed uint8 [..., K/2], E8M0 scales in
    this platform's layout: flat blocked int8 on CUDA, plain uint8 [..., K/gs] on ROCm). Shared exponent
    `clamp(round_mode(log2 amax) − 2, −127, 125)`; elements round to nearest even (or stochastically with
    `stochastic_casting`, on a GPU)."""
    if (ebits, mbits) != (FP4_EBITS, FP4_MBITS):
        raise ValueError(f"triton_quantize_mx4_unpack: only E2M1 (ebits=2, mbits=1) is supported, got {ebits}, {mbits}")
    return torch.ops.mslk.quantize_mx4(input, group_size, int(rounding_mode), stochastic_casting, seed)


def triton_quantize_mx4(
    input: torch.Tensor, *, rounding_mode: RoundingMode | int = RoundingMode.ceil, seed: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 with groups of 32 (spec Q-10); see triton_quantize_mx4_unpack."""
    return torch.ops.mslk.quantize_mx4(input, 32, int(rounding_mode), False, seed)


# ------------------------------------------------------------------------------------------------- NVFP4


def _validate_nvfp4(x, global_scale=None, use_e8m0_scale=False):
    _check("quantize_nvfp4", x, 16)
    if global_scale is not None and (global_scale.numel() != 1 or global_scale.dtype != torch.float32):
        raise ValueError(
            "quantize_nvfp4: global_scale must be one float32 value (448 · 6 / amax, see global_scale_nvfp4), "
            f"got shape {tuple(global_scale.shape)} {global_scale.dtype}"
        )
    registry.check_devices("quantize_nvfp4", x=x, global_scale=global_scale)


def _nvfp4_scale_shape(x: torch.Tensor) -> tuple[int, int]:
    """The padded [⌈M/128⌉·128, ⌈K/64⌉·4] matrix of NVFP4's blocked scales (spec Q-13), M the rows of x [..., K]."""
    return formats.swizzled_scale_shape(math.prod(x.shape[:-1]), x.shape[-1] // 16)


def _nvfp4_fake(x, global_scale=None, use_e8m0_scale=False):
    xq = x.new_empty((*x.shape[:-1], x.shape[-1] // 2), dtype=torch.uint8)
    return xq, x.new_empty(_nvfp4_scale_shape(x), dtype=torch.float8_e4m3fn)


def _nvfp4_samples(device):
    x = testing.randn(130, 64, dtype=torch.bfloat16, device=device, std=2.0)
    yield registry.Sample((x, fp4_utils.global_scale_nvfp4(x)))
    yield registry.Sample((testing.randn(2, 3, 48, device=device),))
    yield registry.Sample((x, cal_global_scale_mx4_as_nvfp4(x), True), name="E8M0 block scales")


quantize_nvfp4_op = registry.Op(
    "mslk::quantize_nvfp4(Tensor x, Tensor? global_scale=None, bool use_e8m0_scale=False) -> (Tensor, Tensor)",
    domain="quantize",
    reference=fp4_utils.quantize_nvfp4,
    fake=_nvfp4_fake,
    samples=_nvfp4_samples,
    validate=_validate_nvfp4,
    reference_devices=("cpu", "cuda"),
)


# Where the NVFP4 kernel takes each row's global scale from.
_NO_GLOBAL: tl.constexpr = tl.constexpr(0)
_ONE_GLOBAL: tl.constexpr = tl.constexpr(1)
_GLOBAL_PER_SEGMENT: tl.constexpr = tl.constexpr(2)
_GLOBAL_PER_ROW_INVERSE: tl.constexpr = tl.constexpr(3)


@triton.jit
def _pack_half_blocks(codes, BLOCK_M: tl.constexpr, BLOCKS: tl.constexpr):
    """Codes [BLOCK_M, BLOCKS, 8] two per byte, the even element in the low nibble -> [BLOCK_M, BLOCKS, 4]."""
    low, high = tl.split(tl.reshape(codes, [BLOCK_M, BLOCKS, 4, 2]))
    return low | (high << 4)


@triton.jit
def _quantize_nvfp4_kernel(
    x_ptr, q_ptr, scale_ptr, M, K, stride_xm, stride_xk, m_sizes_ptr, G, global_scale_ptr,
    GLOBAL: tl.constexpr, SEGMENTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, E8M0: tl.constexpr,
):  # fmt: skip
    # Each 16-element block is loaded as two 8-element halves of the same [BLOCK_M, BLOCK_K // 16, 8] shape, so
    # one thread holds a whole block: its amax, e4m3 scale and division are computed once, not on two threads.
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]  # [BLOCK_M, 1]
    blocks = pid_k * (BLOCK_K // 16) + tl.arange(0, BLOCK_K // 16)[None, :]  # [1, BLOCK_K // 16]
    cols = blocks[:, :, None] * 16 + tl.arange(0, 8)[None, None, :]  # the low half of each block
    in_range = (rows < M) & (blocks < K // 16)
    x_ptrs = x_ptr + rows[:, :, None].to(tl.int64) * stride_xm + cols.to(tl.int64) * stride_xk
    low = tl.load(x_ptrs, mask=in_range[:, :, None], other=0.0).to(tl.float32)
    high = tl.load(x_ptrs + 8 * stride_xk, mask=in_range[:, :, None], other=0.0).to(tl.float32)
    scale_rows, has_scale, segment = _scale_rows(rows, M, m_sizes_ptr, G, SEGMENTS)
    if GLOBAL == _ONE_GLOBAL:
        gs = tl.load(global_scale_ptr)
    elif GLOBAL == _GLOBAL_PER_SEGMENT:
        gs = tl.load(global_scale_ptr + segment, mask=segment < G, other=1.0)
    elif GLOBAL == _GLOBAL_PER_ROW_INVERSE:  # gs = 1 / the per-token inverse scale
        inverse = tl.load(global_scale_ptr + rows, mask=rows < M, other=1.0)
        gs = tl.div_rn(tl.full(inverse.shape, 1.0, tl.float32), inverse)
    else:
        gs = 1.0
    amax = max_nan(tl.reduce(tl.abs(low), 2, max_nan), tl.reduce(tl.abs(high), 2, max_nan))  # [BLOCK_M, BLOCKS]
    if E8M0:  # MXFP4 mimicked: amax / 4 · gs as a power of two ("even" rounding; 1 for exponents 0 and 255)
        exponent = (((tl.div_rn(amax, 4.0) * gs).to(tl.int32, bitcast=True) + (1 << 21) - 1) >> 23) & 0xFF
        power = tl.where((exponent == 0) | (exponent == 255), 127 << 23, exponent << 23).to(tl.float32, bitcast=True)
        block_scale = tl.minimum(power, 448.0).to(tl.float8e4nv)
    else:  # e4m3 block scale, saturated at 448 (IEEE division so the CPU reference gives the same bits)
        block_scale = tl.minimum(tl.div_rn(amax, 6.0) * gs, 448.0, propagate_nan=tl.PropagateNan.ALL)
        block_scale = block_scale.to(tl.float8e4nv)
    # One IEEE division per block, as the reference library does (x · (gs / s_b)); a zero block scale
    # encodes zeros (there x · gs / s_b would be 0/0 or saturate).
    denom = block_scale.to(tl.float32)
    factor = tl.where(denom == 0.0, 0.0, tl.div_rn(gs + tl.zeros_like(denom), tl.where(denom == 0.0, 1.0, denom)))
    packed_low = _pack_half_blocks(e2m1_codes(low * factor[:, :, None], False, 0, 0), BLOCK_M, BLOCK_K // 16)
    packed_high = _pack_half_blocks(e2m1_codes(high * factor[:, :, None], False, 0, 0), BLOCK_M, BLOCK_K // 16)
    q_ptrs = q_ptr + rows[:, :, None].to(tl.int64) * (K // 2) + blocks[:, :, None] * 8 + tl.arange(0, 4)[None, None, :]
    tl.store(q_ptrs, packed_low, mask=in_range[:, :, None])
    tl.store(q_ptrs + 4, packed_high, mask=in_range[:, :, None])
    offsets = _scale_offsets(scale_rows, blocks, K // 16, True)
    tl.store(scale_ptr + offsets, block_scale.to(tl.uint8, bitcast=True), mask=has_scale & (blocks < K // 16))


def _run_nvfp4(x, scale_shape, global_scale, mode, m_sizes=None, e8m0=False):
    q = torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=torch.uint8, device=x.device)
    scale = torch.zeros(scale_shape, dtype=torch.uint8, device=x.device)  # zero padding
    _launch_fp4(
        _quantize_nvfp4_kernel, _NVFP4_TILE, x, q, scale, m_sizes, global_scale_ptr=global_scale, GLOBAL=mode, E8M0=e8m0
    )
    return q, scale.view(torch.float8_e4m3fn)


@quantize_nvfp4_op.backend("triton", available=registry.triton_missing, requires=arch.fp8_e4m3_missing)
def _nvfp4_triton(x, global_scale=None, use_e8m0_scale=False):
    mode = _NO_GLOBAL if global_scale is None else _ONE_GLOBAL
    return _run_nvfp4(x, _nvfp4_scale_shape(x), global_scale, mode, e8m0=use_e8m0_scale)


def triton_quantize_nvfp4(
    x: torch.Tensor,
    global_scale: torch.Tensor | None = None,
    use_e8m0_scale: bool = False,
    use_precise_math: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 (spec Q-13): x [..., K] (K % 16 == 0) -> (E2M1 packed uint8 [..., K/2], e4m3 block scales in the
    blocked layout as its padded matrix [⌈M/128⌉·128, ⌈K/64⌉·4], M the rows of x). `s_b = e4m3(min(amax_b / 6 ·
    gs, 448))`, elements `E2M1(x · (gs / s_b))` (zeros where s_b = 0); `global_scale=None` means 1 (torchao relies
    on it). `use_e8m0_scale` mimics MXFP4 within NVFP4: `s_b` is the power of two `e8m0_even(amax_b / 4 · gs)`
    (1 for exponents 0 and 255, at most 448), with the global scale of `cal_global_scale_mx4_as_nvfp4(x)`.
    Divisions are always IEEE-rounded, so `use_precise_math` changes nothing."""
    return torch.ops.mslk.quantize_nvfp4(x, global_scale, use_e8m0_scale)


# ------------------------------------------------------------------------------ stacked (MoE) MXFP4 / NVFP4
# The rows of x [M, K] come in G segments of m_sizes rows (one per expert); each segment's scales start on a
# 128-row boundary of the blocked layout, as the grouped FP4 GEMMs read them, in a flat buffer of
# `formats.stacked_swizzled_scale_shape(M, G, K / block)` (no host sync on m_sizes).


def _validate_stacked(where: str, m_sizes: torch.Tensor, x: torch.Tensor, group_size: int) -> None:
    _check(where, x, group_size)
    if m_sizes.dim() != 1 or m_sizes.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"{where}: m_sizes must be a 1-D int64 (or int32) tensor of rows per segment, got shape "
            f"{tuple(m_sizes.shape)} {m_sizes.dtype}"
        )
    registry.check_devices(where, m_sizes=m_sizes, x=x)


def _stacked_scale_numel(m_sizes: torch.Tensor, x: torch.Tensor, group_size: int) -> int:
    rows = math.prod(x.shape[:-1])
    return math.prod(formats.stacked_swizzled_scale_shape(rows, m_sizes.numel(), x.shape[-1] // group_size))


def _validate_mx4_stacked(m_sizes, x, group_size=32, rounding_mode=RoundingMode.ceil, seed=None):
    _check_mx4_options("quantize_mx4_stacked", group_size, rounding_mode)
    _validate_stacked("quantize_mx4_stacked", m_sizes, x, group_size)


def _mx4_stacked_reference(m_sizes, x, group_size=32, rounding_mode=RoundingMode.ceil, seed=None):
    xq, plain = fp4_utils.quantize_mx4(x, group_size, rounding_mode, "plain", seed)
    plain = plain.reshape(-1, x.shape[-1] // group_size)
    return xq, fp4_utils.to_blocked_stacked(plain, m_sizes)


def _mx4_stacked_fake(m_sizes, x, group_size=32, rounding_mode=RoundingMode.ceil, seed=None):
    xq = x.new_empty((*x.shape[:-1], x.shape[-1] // 2), dtype=torch.uint8)
    return xq, x.new_empty(_stacked_scale_numel(m_sizes, x, group_size), dtype=torch.uint8)


def _stacked_samples(device):
    """(m_sizes, x) pairs: ragged segments with an empty one, a segment over 128 rows, one segment."""
    yield torch.tensor([5, 0, 130, 1], device=device), testing.randn(136, 64, dtype=torch.bfloat16, device=device)
    yield torch.tensor([3], device=device, dtype=torch.int32), testing.randn(3, 32, device=device, std=3.0)


quantize_mx4_stacked_op = registry.Op(
    "mslk::quantize_mx4_stacked(Tensor m_sizes, Tensor x, int group_size=32, int rounding_mode=4, int? seed=None) "
    "-> (Tensor, Tensor)",
    domain="quantize",
    reference=_mx4_stacked_reference,
    fake=_mx4_stacked_fake,
    samples=lambda device: [registry.Sample(args) for args in _stacked_samples(device)],
    validate=_validate_mx4_stacked,
    reference_devices=("cpu", "cuda"),
)


@quantize_mx4_stacked_op.backend("triton", available=registry.triton_missing)
def _mx4_stacked_triton(m_sizes, x, group_size=32, rounding_mode=RoundingMode.ceil, seed=None):
    numel = _stacked_scale_numel(m_sizes, x, group_size)
    return _run_mx4(x, (numel,), "swizzled", group_size, rounding_mode, False, seed, m_sizes)


def quantize_mx4_stacked(
    m_sizes: torch.Tensor,
    x: torch.Tensor,
    group_size: int = 32,
    rounding_mode: RoundingMode | int = RoundingMode.ceil,
    *,
    seed: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked MXFP4 (spec Q-12) for grouped FP4 GEMMs: x [M, K] in segments of m_sizes [G] rows ->
    (E2M1 packed uint8 [M, K/2], E8M0 uint8 scales, each segment blocked from a 128-row boundary, flat).
    Elements and exponents as triton_quantize_mx4_unpack; rows past sum(m_sizes) get no scales."""
    return torch.ops.mslk.quantize_mx4_stacked(m_sizes, x, group_size, int(rounding_mode), seed)


def _validate_nvfp4_stacked(m_sizes, x, global_scale=None):
    _validate_stacked("quantize_nvfp4_stacked", m_sizes, x, 16)
    if global_scale is not None and (global_scale.dtype != torch.float32 or global_scale.shape != m_sizes.shape):
        raise ValueError(
            f"quantize_nvfp4_stacked: global_scale must be float32 [G], one value per segment ({m_sizes.numel()}, "
            f"see calculate_group_max), got shape {tuple(global_scale.shape)} {global_scale.dtype}"
        )
    registry.check_devices("quantize_nvfp4_stacked", m_sizes=m_sizes, x=x, global_scale=global_scale)


def _nvfp4_stacked_fake(m_sizes, x, global_scale=None):
    xq = x.new_empty((*x.shape[:-1], x.shape[-1] // 2), dtype=torch.uint8)
    return xq, x.new_empty(_stacked_scale_numel(m_sizes, x, 16), dtype=torch.float8_e4m3fn)


def _nvfp4_stacked_samples(device):
    for m_sizes, x in _stacked_samples(device):
        if x.shape[-1] % 16 == 0:
            yield registry.Sample((m_sizes, x))
            yield registry.Sample((m_sizes, x, fp4_utils.calculate_group_max(x, m_sizes)[0]))


quantize_nvfp4_stacked_op = registry.Op(
    "mslk::quantize_nvfp4_stacked(Tensor m_sizes, Tensor x, Tensor? global_scale=None) -> (Tensor, Tensor)",
    domain="quantize",
    reference=fp4_utils.quantize_nvfp4_stacked,
    fake=_nvfp4_stacked_fake,
    samples=_nvfp4_stacked_samples,
    validate=_validate_nvfp4_stacked,
    reference_devices=("cpu", "cuda"),
)


@quantize_nvfp4_stacked_op.backend("triton", available=registry.triton_missing, requires=arch.fp8_e4m3_missing)
def _nvfp4_stacked_triton(m_sizes, x, global_scale=None):
    if global_scale is None:
        return _run_nvfp4(x, (_stacked_scale_numel(m_sizes, x, 16),), None, _NO_GLOBAL, m_sizes)
    shape = (_stacked_scale_numel(m_sizes, x, 16),)
    return _run_nvfp4(x, shape, global_scale.contiguous(), _GLOBAL_PER_SEGMENT, m_sizes)  # read with unit stride


def _token_reference(m_sizes, x):
    token_scale_inv = fp4_utils.token_scale_inv_nvfp4(x)
    return *fp4_utils.quantize_nvfp4_stacked(m_sizes, x, None, token_scale_inv), token_scale_inv


quantize_nvfp4_stacked_token_scale_op = registry.Op(
    "mslk::quantize_nvfp4_stacked_token_scale(Tensor m_sizes, Tensor x) -> (Tensor, Tensor, Tensor)",
    domain="quantize",
    reference=_token_reference,
    fake=lambda m_sizes, x: (*_nvfp4_stacked_fake(m_sizes, x), x.new_empty(x.shape[:-1].numel(), dtype=torch.float32)),
    samples=lambda device: [registry.Sample(args) for args in _stacked_samples(device) if args[1].shape[-1] % 16 == 0],
    validate=lambda m_sizes, x: _validate_stacked("quantize_nvfp4_stacked_token_scale", m_sizes, x, 16),
    reference_devices=("cpu", "cuda"),
)


@triton.jit
def _row_abs_max_kernel(x_ptr, out_ptr, M, K, stride_m, stride_k, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
    cols = tl.arange(0, BLOCK_K)[None, :]
    amax = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask = (rows < M) & (k0 + cols < K)
        x = tl.load(x_ptr + rows.to(tl.int64) * stride_m + (k0 + cols).to(tl.int64) * stride_k, mask=mask, other=0.0)
        amax = max_nan(amax, tl.reduce(tl.abs(x.to(tl.float32)), 1, max_nan))
    tl.store(out_ptr + tl.reshape(rows, [BLOCK_M]), amax, mask=tl.reshape(rows < M, [BLOCK_M]))


def _row_abs_max(x: torch.Tensor) -> torch.Tensor:
    """max |x| of each row of x [..., K] in fp32 [M], NaN-propagating, reading x once (torch's aminmax
    reaches a third of the memory speed there)."""
    x2 = x.reshape(-1, x.shape[-1])
    out = torch.zeros(x2.shape[0], dtype=torch.float32, device=x.device)
    if x2.numel():
        block_k = min(launch.next_power_of_2(x2.shape[1]), 1024)
        block_m = max(1, 4096 // block_k)
        launch.fast(_row_abs_max_kernel)[(launch.cdiv(x2.shape[0], block_m),)](
            x2, out, x2.shape[0], x2.shape[1], x2.stride(0), x2.stride(1), BLOCK_M=block_m, BLOCK_K=block_k
        )
    return out


@quantize_nvfp4_stacked_token_scale_op.backend(
    "triton", available=registry.triton_missing, requires=arch.fp8_e4m3_missing
)
def _token_triton(m_sizes, x):
    token_scale_inv = fp4_utils.token_scale_inv_nvfp4(x, _row_abs_max(x))
    shape = (_stacked_scale_numel(m_sizes, x, 16),)
    return *_run_nvfp4(x, shape, token_scale_inv, _GLOBAL_PER_ROW_INVERSE, m_sizes), token_scale_inv


calculate_group_max_op = registry.Op(
    "mslk::calculate_group_max(Tensor input, Tensor m_sizes) -> (Tensor, Tensor)",
    domain="quantize",
    reference=fp4_utils.calculate_group_max,
    fake=lambda x, m_sizes: (
        m_sizes.new_empty(m_sizes.shape, dtype=torch.float32),
        m_sizes.new_empty(x.shape[:-1].numel(), dtype=torch.int64),
    ),
    samples=lambda device: [registry.Sample((x, m_sizes)) for m_sizes, x in _stacked_samples(device)],
    validate=lambda x, m_sizes: _validate_stacked("calculate_group_max", m_sizes, x, 1),
    reference_devices=("cpu", "cuda"),
)


@calculate_group_max_op.backend("triton", available=registry.triton_missing)
def _group_max_triton(x, m_sizes):
    return fp4_utils.calculate_group_max(x, m_sizes, _row_abs_max(x))


def calculate_group_max(input: torch.Tensor, m_sizes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-segment NVFP4 global scales of a stacked input (spec Q-14): (global_scale [G] fp32 = 448 · 6 /
    max(amax of the segment, 1e-8) (an empty segment gets the largest fp32), the
    segment of each row [M] int64 (G past sum(m_sizes))). No host sync."""
    return torch.ops.mslk.calculate_group_max(input, m_sizes)


def nvfp4_quantize_stacked(
    m_sizes: torch.Tensor, input: torch.Tensor, global_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked NVFP4 (spec Q-14): input [M, K] in segments of m_sizes [G] rows, segment g quantized with
    global_scale[g] (from calculate_group_max) -> (E2M1 packed uint8 [M, K/2], e4m3 scales, each segment
    blocked from a 128-row boundary, flat). Rows past sum(m_sizes) get no scales."""
    return torch.ops.mslk.quantize_nvfp4_stacked(m_sizes, input, global_scale)


def nvfp4_quantize_stacked_with_token_scale(
    m_sizes: torch.Tensor, input: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stacked NVFP4 with one global scale per row (spec Q-14, the per-token "ultra" format): returns
    (xq, scales as nvfp4_quantize_stacked, token_scale_inv [M] fp32 = max(amax_row, 1e-8) / (448 · 6)); row r
    is quantized with gs = 1 / token_scale_inv[r], and the GEMM multiplies its output row by token_scale_inv."""
    return torch.ops.mslk.quantize_nvfp4_stacked_token_scale(m_sizes, input)
