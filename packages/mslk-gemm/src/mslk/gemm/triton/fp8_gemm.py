"""FP8 GEMMs (spec G-01, G-02, G-03, G-19, G-50; scale contract §7.2-7.3) and the MXFP8 quantizer `to_mxfp8`
(Q-26 / G-52, here because the reference library puts it here).

Rowwise: `out = (XQ · WQᵀ) · x_scale[m] · w_scale[n] (+ bias[n])` with XQ [..., M, K] and WQ [N, K] in this
platform's FP8 (`quantize_fp8_row` makes them, with its dequantization scales), fp32 accumulation, bf16 (or
fp16) output. One Triton kernel serves every shape (`_rowwise_config` picks the tiles by shape class): large
M loops persistent programs over 128 x 256 tiles in grouped order; small M (decode) swaps the operands, so that
the weight rows fill the MMA's 64-row side and the few tokens the narrow one. The module imports nothing from
mslk.quantize, so mslk-gemm works alone.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from mslk.core import arch, formats, launch, registry, testing

E4M3_MAX = 448.0
_INPUT_DTYPES = (torch.bfloat16, torch.float32, torch.float16)


def to_mxfp8(data_hp: torch.Tensor, block_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize to MXFP8: OCP e4m3fn elements with one E8M0 scale per `block_size` elements along the last dim.

    Args:
        data_hp: bf16 or fp32 (fp16 also works) tensor [..., K], K divisible by `block_size`; any strides.
        block_size: elements per scale block (positive; MX uses 32).

    Returns:
        `(scale, data)`, in that order (unlike the other quantizers): `scale` float8_e8m0fnu [..., K/block_size]
        (the plain layout, `mslk.core.formats.MX(block_size, "plain", "fp8")` for 2-D+ data and blocks 16/32)
        and `data` float8_e4m3fn of data_hp's shape (OCP e4m3fn on every platform, ROCm gfx942 included),
        with `data_hp ≈ data · scale` blockwise.

    Per block: amax = max |x|; scale = 2^ceil(log2(amax / 448)) ("RCEIL"), derived exactly from the fp32 bits of
    amax (no division or log2 to round), clamped below to 2^-127, the smallest E8M0 value; data =
    clamp(x / scale, -448, 448) rounded to nearest even. The largest |data| of a block is thus in [224, 448]
    unless the scale is clamped. An all-zero block gets scale 2^-127 and zero data. A block holding NaN or
    ±Inf gets the NaN scale (0xFF) and NaN data throughout; other blocks are unaffected.
    """
    if not isinstance(data_hp, torch.Tensor):
        raise ValueError(f"to_mxfp8: data_hp must be a torch.Tensor, got {type(data_hp).__name__}")
    if data_hp.dtype not in _INPUT_DTYPES:
        raise ValueError(f"to_mxfp8: data_hp must be bfloat16, float32 or float16, got {data_hp.dtype}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"to_mxfp8: block_size must be a positive int, got {block_size!r}")
    if data_hp.dim() < 1 or data_hp.shape[-1] % block_size:
        raise ValueError(
            f"to_mxfp8: data_hp must be [..., K] with K divisible by block_size={block_size}, "
            f"got shape {tuple(data_hp.shape)}"
        )

    # Contiguous first so that both outputs come out contiguous; widening to fp32 is exact. Detached since
    # the dtype views below refuse tensors that require grad.
    x = data_hp.detach().contiguous().float()
    blocks = x.unflatten(-1, (x.shape[-1] // block_size, block_size))
    amax = blocks.abs().amax(dim=-1)  # NaN propagates

    # Zero and fp32-subnormal amax get 2^-127; multiplying by the exact inverse scale divides by a power of two.
    scale_byte, inv_scale = formats.e8m0_rceil(amax, E4M3_MAX)
    data = (blocks * inv_scale.unsqueeze(-1)).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)

    scale = scale_byte.to(torch.uint8).view(torch.float8_e8m0fnu)
    return scale, data.flatten(-2)


# ------------------------------------------------------------------------------------------ rowwise FP8


# The dense GEMMs' rowwise scales: any contiguous shape of M (N) elements, read as the flat vector.
ROWWISE_SCALES = formats.Rowwise(any_shape=True)


def _validate_rowwise(where, XQ, WQ, x_scale, w_scale, bias, batched):
    formats.check_fp8_data(XQ, role=f"{where}: XQ", producer="quantize_fp8_row")
    formats.check_fp8_data(WQ, role=f"{where}: WQ", producer="quantize_fp8_row")
    if batched:
        if XQ.dim() != 3 or WQ.dim() != 3 or XQ.shape[0] != WQ.shape[0]:
            raise ValueError(
                f"{where}: expected XQ [B, M, K] and WQ [B, N, K] with the same B, got {tuple(XQ.shape)} and "
                f"{tuple(WQ.shape)}"
            )
    elif XQ.dim() < 2 or WQ.dim() != 2:
        raise ValueError(f"{where}: expected XQ [..., M, K] and WQ [N, K], got {tuple(XQ.shape)} and {tuple(WQ.shape)}")
    if XQ.shape[-1] != WQ.shape[-1]:
        raise ValueError(f"{where}: XQ and WQ disagree on K: {tuple(XQ.shape)} and {tuple(WQ.shape)}")
    for role, data, scale in (("x_scale", XQ, x_scale), ("w_scale", WQ, w_scale)):
        if scale.dtype != torch.float32:
            raise formats.ScaleFormatError(
                f"{where}: {role} must be float32 (quantize_fp8_row's scales), got {scale.dtype}"
            )
        ROWWISE_SCALES.check(data, scale, role=f"{where}: {role}")
    n = WQ.shape[-2]
    if bias is not None and (bias.shape != (n,) or bias.dtype not in (torch.float32, torch.bfloat16)):
        raise ValueError(f"{where}: bias must be float32 or bfloat16 [N] = [{n}], got {tuple(bias.shape)} {bias.dtype}")
    registry.check_devices(where, XQ=XQ, WQ=WQ, x_scale=x_scale, w_scale=w_scale, bias=bias)


def _rowwise_reference(XQ, WQ, x_scale, w_scale, bias, out_dtype):
    """fp32: dequantized XQ · WQᵀ with both scales, plus bias, cast to out_dtype."""
    out = torch.matmul(XQ.float(), WQ.float().transpose(-1, -2))
    out = out * x_scale.float().reshape(*XQ.shape[:-1], 1) * w_scale.float().reshape(*WQ.shape[:-2], 1, WQ.shape[-2])
    return (out if bias is None else out + bias.float()).to(out_dtype)


@triton.jit
def tile_coordinates(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row, column) of output tile `tile`: tiles go in groups of GROUP_M rows of tiles, so that neighbouring
    programs share B tiles in L2."""
    tiles_n = tl.cdiv(N, BLOCK_N)
    first_m = (tile // (GROUP_M * tiles_n)) * GROUP_M
    group_rows = min(tl.cdiv(M, BLOCK_M) - first_m, GROUP_M)
    return first_m + (tile % group_rows), (tile % (GROUP_M * tiles_n)) // group_rows


@triton.jit
def load_k_step(a_ptrs, b_ptrs, ks, k_left, EVEN_K: tl.constexpr):
    """One K step's A and B tiles (K-contiguous rows); past the last of K (k_left columns left) zeros, unless
    EVEN_K says every step is whole."""
    if EVEN_K:
        return tl.load(a_ptrs), tl.load(b_ptrs)
    return tl.load(a_ptrs, mask=ks[None, :] < k_left, other=0.0), tl.load(b_ptrs, mask=ks[None, :] < k_left, other=0.0)


@triton.jit
def _rowwise_tile(
    pid_m, pid_n, batch, a_ptr, b_ptr, a_desc, b_desc, c_ptr, c_desc, a_scale_ptr, b_scale_ptr, bias_ptr,
    M, N, K, stride_ab, stride_am, stride_bb, stride_bn, stride_cb, stride_cm, stride_cn, stride_sab, stride_sbb,
    HAS_BIAS: tl.constexpr, BIAS_ON_M: tl.constexpr, FAST_ACCUM: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Output tile (pid_m, pid_n) of BLOCK_M x BLOCK_N. a_desc / b_desc (or None): TMA descriptors of A and B (in
    [BLOCK_M | BLOCK_N, BLOCK_K] tiles) with their batches' rows back to back (a batch stride of 0: one matrix for
    every batch); c_desc (or None): the output's (one batch) in [BLOCK_M, BLOCK_N / 2] tiles: the tile goes out
    by TMA from shared memory, in two halves (half the shared memory to stage it), while the next tile's products
    run."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    # Out-of-range rows/cols read row 0 (in bounds); their results are never stored.
    a_ptrs = a_ptr + batch.to(tl.int64) * stride_ab + tl.where(rows < M, rows, 0).to(tl.int64)[:, None] * stride_am
    b_ptrs = b_ptr + batch.to(tl.int64) * stride_bb + tl.where(cols < N, cols, 0).to(tl.int64)[:, None] * stride_bn
    a_ptrs += ks[None, :]
    b_ptrs += ks[None, :]
    if a_desc is not None:
        # The tile's first rows in the descriptors' stacked views; TMA coordinates are int32 (a batch of 2**31
        # elements or more makes its stride, and the product, int64).
        a_row = (batch * (stride_ab // stride_am)).to(tl.int32) + pid_m * BLOCK_M
        b_row = (batch * (stride_bb // stride_bn)).to(tl.int32) + pid_n * BLOCK_N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(tl.cdiv(K, BLOCK_K)):  # software-pipelined with the launch's num_stages
        if a_desc is not None:  # rows/cols past M/N read the next batch's (never stored) or zeros
            a = a_desc.load([a_row, k * BLOCK_K])
            b = b_desc.load([b_row, k * BLOCK_K])
        else:
            a, b = load_k_step(a_ptrs, b_ptrs, ks, K - k * BLOCK_K, EVEN_K)
        if FAST_ACCUM:
            acc = tl.dot(a, b.T, acc)
        else:  # each block's product is added in fp32 (the tensor cores' FP8 accumulation is narrower)
            acc += tl.dot(a, b.T)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    a_scale = tl.load(a_scale_ptr + batch * stride_sab + rows, mask=rows < M, other=0.0)
    b_scale = tl.load(b_scale_ptr + batch * stride_sbb + cols, mask=cols < N, other=0.0)
    acc = acc * a_scale[:, None] * b_scale[None, :]
    if HAS_BIAS:
        if BIAS_ON_M:
            acc += tl.load(bias_ptr + rows, mask=rows < M, other=0.0).to(tl.float32)[:, None]
        else:
            acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if c_desc is not None:  # TMA clips rows and columns past the output's edges
        left, right = acc.reshape(BLOCK_M, 2, BLOCK_N // 2).permute(0, 2, 1).split()
        c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], left.to(c_desc.dtype))
        c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N + BLOCK_N // 2], right.to(c_desc.dtype))
    else:
        c_ptrs = c_ptr + batch.to(tl.int64) * stride_cb + rows.to(tl.int64)[:, None] * stride_cm
        c_ptrs += cols[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rows < M)[:, None] & (cols < N)[None, :])


@triton.jit
def _fp8_rowwise_kernel(
    a_ptr, b_ptr, a_desc, b_desc, b_half_desc, c_ptr, c_desc, a_scale_ptr, b_scale_ptr, bias_ptr,
    M, N, K, stride_ab, stride_am, stride_bb, stride_bn, stride_cb, stride_cm, stride_cn, stride_sab, stride_sbb,
    tail_tiles,
    HAS_BIAS: tl.constexpr, BIAS_ON_M: tl.constexpr, FAST_ACCUM: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PERSISTENT: tl.constexpr, HALF_TAIL: tl.constexpr,
):  # fmt: skip
    """C[b] = (A[b] · B[b]ᵀ) · a_scale[b, m] · b_scale[b, n] (+ bias), A [M, K] and B [N, K] K-contiguous.
    Program (pid, batch) computes tile pid, or, PERSISTENT, every tile pid + i · programs (the tile loops
    flattened, so that the next tile's loads overlap this one's epilogue); HALF_TAIL: but the last tail_tiles, which
    then go as twice as many tiles half as wide (b_half_desc: B's descriptor for them), one per program: a last
    round of few tiles would leave most SMs idle for a whole tile's time."""
    pid, batch = tl.program_id(0), tl.program_id(1)
    if PERSISTENT:
        tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
        for tile in tl.range(pid, tiles - tail_tiles, tl.num_programs(0), flatten=True):
            pid_m, pid_n = tile_coordinates(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            _rowwise_tile(
                pid_m, pid_n, batch, a_ptr, b_ptr, a_desc, b_desc, c_ptr, c_desc, a_scale_ptr, b_scale_ptr, bias_ptr,
                M, N, K, stride_ab, stride_am, stride_bb, stride_bn, stride_cb, stride_cm, stride_cn, stride_sab,
                stride_sbb, HAS_BIAS, BIAS_ON_M, FAST_ACCUM, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K,
            )  # fmt: skip
        if HALF_TAIL and pid < 2 * tail_tiles:  # pointer stores: TMA ones here took 7-10 us more (RESULTS.md)
            pid_m, pid_n = tile_coordinates(tiles - tail_tiles + pid // 2, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            _rowwise_tile(
                pid_m, 2 * pid_n + pid % 2, batch, a_ptr, b_ptr, a_desc, b_half_desc, c_ptr, None, a_scale_ptr,
                b_scale_ptr, bias_ptr, M, N, K, stride_ab, stride_am, stride_bb, stride_bn, stride_cb, stride_cm,
                stride_cn, stride_sab, stride_sbb, HAS_BIAS, BIAS_ON_M, FAST_ACCUM, EVEN_K, BLOCK_M, BLOCK_N // 2,
                BLOCK_K,
            )  # fmt: skip
    else:
        pid_m, pid_n = tile_coordinates(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        _rowwise_tile(
            pid_m, pid_n, batch, a_ptr, b_ptr, a_desc, b_desc, c_ptr, c_desc, a_scale_ptr, b_scale_ptr, bias_ptr,
            M, N, K, stride_ab, stride_am, stride_bb, stride_bn, stride_cb, stride_cm, stride_cn, stride_sab,
            stride_sbb, HAS_BIAS, BIAS_ON_M, FAST_ACCUM, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip


# Rounds of tiles up to which the persistent kernel runs its last round as half-wide tiles. On the H200 a half-wide
# tile took about 0.8 of a whole one's time, so that round gains about a fifth of a round: 2048 x 7168 x 2048 (448
# tiles, 52 in the last round of 132) 53.5 against 56 us; at 4096 x 28672 x 8192 (28 rounds) the change was noise,
# and with fewer tiles than SMs (all of them halved) none (RESULTS.md, sixteenth session).
_HALF_TAIL_MAX_ROUNDS = 4

# Rows of X up to which the operands are swapped: the weight rows go on the MMA's 64-row side, so that even
# one token keeps N/64 programs streaming the weights, and the tokens on the narrow side (16 wide at least).
_SWAP_MAX_M = 128


@functools.cache
def _rowwise_config(m: int, n: int, k: int) -> dict:
    """Tiles by shape class, measured on the H200 (RESULTS.md): decode swaps the operands; M >= 2048 loops
    persistent programs over 128 x 256 x 128 tiles in groups of 16 tile rows (0.97-1.00x of torch._scaled_mm
    at 8192^3 and Llama shapes, against 0.94-0.97x for one program per tile) on 4 stages of shared memory,
    4 · (128 + 256) · 128 B = 192 KiB, and 32 KiB to stage the half-tiles the TMA stores: 2048 x 7168 x 2048 in
    51.6 us against 55.2 on 3 stages with pointer stores, 8192^3 835 against 845 (session 24); else 3 stages.
    cuBLAS runs 128 x 128 tiles there (6 stages, 2-CTA clusters); a warp-specialized ping-pong Gluon kernel on them
    measured at best equal to this one (2048 x 7168 x 2048) and 2-4% slower at 8192^3 (session 33)."""
    if m <= _SWAP_MAX_M:  # 256-deep K steps: 16 x 8192 x 8192 in 19.2 us against 20.7 with 128 on 6 stages
        block_n = max(16, launch.next_power_of_2(m))
        return {"BLOCK_M": 64, "BLOCK_N": block_n, "BLOCK_K": 256, "GROUP_M": 1, "PERSISTENT": False,
                "num_stages": 5 if block_n <= 64 else 4, "num_warps": 4}  # fmt: skip
    if m <= 256 or n <= 1024:
        return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "PERSISTENT": False, "num_stages": 4,
                "num_warps": 8}  # fmt: skip
    persistent = m >= 2048
    return {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 128, "GROUP_M": 16 if persistent else 8,
            "PERSISTENT": persistent, "num_stages": 4 if persistent else 3, "num_warps": 8}  # fmt: skip


def _run_rowwise(XQ, WQ, x_scale, w_scale, bias, use_fast_accum, out):
    """out [M, N] = rowwise FP8 GEMM of XQ [M, K] and WQ [N, K] (scales [M] and [N]), or batched: out [B, M, N]
    of XQ [B, M, K] and WQ [B, N, K] (scales [B, M] and [B, N]). Operands K-contiguous, scales and bias
    contiguous. A 2-D call makes no views: each costs microseconds of host time, which a GEMM of tens of
    microseconds on the GPU cannot spare."""
    m, k = XQ.shape[-2:]
    n = WQ.shape[-2]
    if out.numel() == 0:
        return out
    if k == 0:
        return out.copy_(torch.zeros_like(out, dtype=torch.float32) + (0 if bias is None else bias.float()))
    cfg = _rowwise_config(m, n, k)
    swap = m <= _SWAP_MAX_M
    a, b, sa, sb = (WQ, XQ, w_scale, x_scale) if swap else (XQ, WQ, x_scale, w_scale)
    c_batch, c_rows, c_cols = out.stride(0) if out.dim() == 3 else 0, out.stride(-2), out.stride(-1)
    c_strides = (c_batch, c_cols, c_rows) if swap else (c_batch, c_rows, c_cols)
    rows, cols = (n, m) if swap else (m, n)
    tiles = launch.cdiv(rows, cfg["BLOCK_M"]) * launch.cdiv(cols, cfg["BLOCK_N"])
    programs = arch.sm_count(out.device) if out.is_cuda else 3  # 3: a few tiles each under the interpreter
    batches = XQ.shape[0] if XQ.dim() == 3 else 1
    # Persistent: the last round's tiles go half as wide when twice as many fit in one round of the programs and
    # the rounds are few (_HALF_TAIL_MAX_ROUNDS).
    tail = tiles % programs
    few_rounds = programs < tiles <= _HALF_TAIL_MAX_ROUNDS * programs
    tail = tail if cfg["PERSISTENT"] and few_rounds and 2 * tail <= programs else 0
    grid = (min(tiles, programs) if cfg["PERSISTENT"] else tiles, batches)
    a_batch, b_batch = _batch_stride(a), _batch_stride(b)
    a_rows, b_rows = _stacked_rows(a, a_batch), _stacked_rows(b, b_batch)
    a_desc, b_desc, b_half_desc, c_desc = None, None, None, None
    if a_rows is not None and b_rows is not None:
        a_desc, b_desc = tma_descriptors(a_rows, b_rows, cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"])
        if tail and a_desc is not None:  # (tma_descriptors gives both or neither)
            b_half_desc = row_tiles(b_rows, cfg["BLOCK_N"] // 2, cfg["BLOCK_K"])
    if cfg["PERSISTENT"] and a_desc is not None and out.dim() == 2 and tma_ready(out):
        c_desc = row_tiles(out, cfg["BLOCK_M"], cfg["BLOCK_N"] // 2)  # (a 2-D descriptor: one batch)
    launch.fast(_fp8_rowwise_kernel)[grid](
        a, b, a_desc, b_desc, b_half_desc, out, c_desc, sa, sb, bias,
        rows, cols, k, a_batch, a.stride(-2), b_batch, b.stride(-2), *c_strides,
        sa.stride(0) if sa.dim() == 2 else 0, sb.stride(0) if sb.dim() == 2 else 0, tail,
        HAS_BIAS=bias is not None, BIAS_ON_M=swap, FAST_ACCUM=use_fast_accum, EVEN_K=k % cfg["BLOCK_K"] == 0,
        HALF_TAIL=tail > 0, **cfg,
    )  # fmt: skip
    return out


def _batch_stride(t: torch.Tensor) -> int:
    """Elements between the batches of operand t [B, rows, K]; 0 for a 2-D t or one batch."""
    return t.stride(0) if t.dim() == 3 and t.shape[0] > 1 else 0


def _stacked_rows(t: torch.Tensor, batch_stride: int) -> torch.Tensor | None:
    """Operand t's rows as one 2-D matrix, batch after batch, for a TMA descriptor; None if there is a gap
    between its batches."""
    if t.dim() == 2:
        return t
    if batch_stride == 0:
        return t[0]
    return t.view(-1, t.shape[-1]) if batch_stride == t.shape[1] * t.stride(1) else None


def k_contiguous(t: torch.Tensor) -> torch.Tensor:
    """t with unit stride along its last dim (K), as the GEMM kernels load it: t itself when it has it, else a copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def tma_ready(t: torch.Tensor) -> bool:
    """Whether TMA can read the 2-D t by rows: non-empty, K-contiguous, 16-byte aligned rows that don't overlap."""
    rows_apart = t.stride(0) >= t.shape[1] and t.stride(0) * t.element_size() % 16 == 0
    return t.numel() > 0 and t.stride(1) == 1 and t.data_ptr() % 16 == 0 and rows_apart


def tma_descriptors(a: torch.Tensor, b: torch.Tensor, block_m: int, block_n: int, block_k: int) -> tuple:
    """TMA descriptors of a [M, K] and b [N, K] in [block_m | block_n, block_k] tiles where both are tma_ready
    (loads past their edges give zeros; Triton lowers them to plain loads on GPUs without TMA); else (None, None),
    and the kernels load through pointers."""
    if not (tma_ready(a) and tma_ready(b)):
        return None, None
    return row_tiles(a, block_m, block_k), row_tiles(b, block_n, block_k)


def row_tiles(t: torch.Tensor, rows: int, width: int) -> TensorDescriptor:
    """TMA descriptor of a `tma_ready` 2-D t, one [rows, width] tile per load (zeros past its edges)."""
    return TensorDescriptor(t, list(t.shape), [t.stride(0), 1], [rows, width])


def _rowwise_into(XQ, WQ, x_scale, w_scale, bias, use_fast_accum, out):
    """2-D WQ, XQ [..., M, K]: all rows of XQ as one [M', K] problem."""
    x = _as_rows(XQ)
    _run_rowwise(
        k_contiguous(x), k_contiguous(WQ), _flat(x_scale), _flat(w_scale), None if bias is None else bias.contiguous(),
        use_fast_accum, out if out.dim() == 2 else out.view(x.shape[0], WQ.shape[0]),
    )  # fmt: skip
    return out


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """t [..., K] as one [rows, K] matrix (t itself when 2-D: no view to pay for)."""
    return t if t.dim() == 2 else t.flatten(0, -2)  # (reshape(-1, K) is ambiguous when K = 0)


def _flat(scale: torch.Tensor) -> torch.Tensor:
    """A rowwise scale as the contiguous vector the kernel reads (itself when it is one: no view to pay for)."""
    return scale if scale.dim() == 1 and scale.is_contiguous() else scale.reshape(-1).contiguous()


def _rowwise_op(name: str, out_dtype: torch.dtype, samples) -> registry.Op:
    where = name

    def validate(XQ, WQ, x_scale, w_scale, bias=None, use_fast_accum=True):
        _validate_rowwise(where, XQ, WQ, x_scale, w_scale, bias, batched=False)

    def reference(XQ, WQ, x_scale, w_scale, bias=None, use_fast_accum=True):
        return _rowwise_reference(XQ, WQ, x_scale, w_scale, bias, out_dtype)

    def fake(XQ, WQ, x_scale, w_scale, bias=None, use_fast_accum=True):
        return XQ.new_empty((*XQ.shape[:-1], WQ.shape[0]), dtype=out_dtype)

    op = registry.Op(
        f"mslk::{name}(Tensor XQ, Tensor WQ, Tensor x_scale, Tensor w_scale, Tensor? bias=None, "
        "bool use_fast_accum=True) -> Tensor",
        domain="gemm",
        reference=reference,
        fake=fake,
        samples=samples,
        validate=validate,
        tolerance=1e-2,
    )

    def scaled_mm_supports(XQ, WQ, x_scale, w_scale, bias=None, use_fast_accum=True):
        return _scaled_mm_reasons(XQ, WQ, bias, out_dtype)

    @op.backend("torch._scaled_mm", supports=scaled_mm_supports)
    def _scaled_mm(XQ, WQ, x_scale, w_scale, bias=None, use_fast_accum=True):
        # Validated scales are contiguous, so these reshapes are views; 2-D XQ (the common case) skips two.
        out = torch._scaled_mm(
            _as_rows(XQ), WQ.t(), scale_a=x_scale.reshape(-1, 1), scale_b=w_scale.reshape(1, -1), bias=bias,
            out_dtype=out_dtype, use_fast_accum=use_fast_accum,
        )  # fmt: skip
        return out if XQ.dim() == 2 else out.reshape(*XQ.shape[:-1], WQ.shape[0])

    @op.backend("triton", available=registry.triton_missing, requires=arch.fp8_e4m3_missing)
    def _triton(XQ, WQ, x_scale, w_scale, bias=None, use_fast_accum=True):
        out = torch.empty((*XQ.shape[:-1], WQ.shape[0]), dtype=out_dtype, device=XQ.device)
        return _rowwise_into(XQ, WQ, x_scale, w_scale, bias, use_fast_accum, out)

    return op


# Rows of X above which cuBLAS (torch._scaled_mm) serves the rowwise GEMMs on SM90: measured there at 0.97x
# (8192^3) to 1.00x of it for M >= 2048 and 0.90-0.96x at 2048 x 7168 x 2048, while the Triton kernel leads at
# M <= 1024 (1.02x at 1024 x 8192 x 28672, 1.07-1.20x when decoding; RESULTS.md).
_SCALED_MM_MIN_M = 1025


def _scaled_mm_reasons(XQ, WQ, bias, out_dtype) -> list[str]:
    """Why torch._scaled_mm does not serve these inputs: outside the measured shape class, or its layouts."""
    reasons = []
    m, k, n = XQ.numel() // max(XQ.shape[-1], 1), XQ.shape[-1], WQ.shape[0]
    if m < _SCALED_MM_MIN_M:
        reasons.append(f"M={m} < {_SCALED_MM_MIN_M}: the Triton kernel is faster there")
    if not arch.on_hopper(XQ):
        reasons.append("measured on SM90 only (the Triton kernel serves other GPUs)")
    if XQ.dtype != torch.float8_e4m3fn or k % 16 or n % 16:
        reasons.append(f"cuBLAS FP8 needs float8_e4m3fn with K and N multiples of 16, got {XQ.dtype}, K={k}, N={n}")
    if not (XQ.is_contiguous() and WQ.is_contiguous()):
        reasons.append("XQ and WQ must be contiguous")
    if bias is not None and bias.dtype != out_dtype:
        reasons.append(f"bias {bias.dtype}: cuBLAS adds a bias of the output dtype {out_dtype} only")
    return reasons


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] in this platform's FP8 with rowwise fp32 dequantization scales (amax / FP8_MAX): the inputs of
    the samples, tests and benches (mslk-gemm works without mslk.quantize's quantize_fp8_row)."""
    fp8 = arch.fp8_dtype(x.device)
    amax = x.float().abs().amax(-1) if x.shape[-1] else torch.zeros(x.shape[:-1], device=x.device)  # K = 0 too
    scale = amax.clamp(min=1e-12) / torch.finfo(fp8).max
    return (x.float() / scale[..., None]).to(fp8), scale


def _quantized(*shape, device, std=1.0) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_rows(testing.randn(*shape, device=device, std=std))


def _rowwise_samples(device):
    x, xs = _quantized(37, 64, device=device)
    w, ws = _quantized(24, 64, device=device)
    yield registry.Sample((x, w, xs, ws))
    x3, xs3 = _quantized(2, 5, 48, device=device)
    w3, ws3 = _quantized(40, 48, device=device)
    bias = testing.randn(40, device=device)
    yield registry.Sample((x3, w3, xs3, ws3, bias, False))
    yield registry.Sample((x, w, xs, ws, testing.randn(24, device=device).to(torch.bfloat16)))


f8f8bf16_rowwise_op = _rowwise_op("f8f8bf16_rowwise", torch.bfloat16, _rowwise_samples)
f8f8f16_rowwise_op = _rowwise_op("f8f8f16_rowwise", torch.float16, _rowwise_samples)


def into_output(where: str, output: torch.Tensor | None, op: registry.Op, *args) -> torch.Tensor:
    """op(*args), a bf16 [rows of args[0], rows of args[1]] (N of a [G, N, K] weight), written into `output` when
    given (the reference library's Triton entries' `output=`): checked, with the inputs, before any kernel runs."""
    if output is not None:
        op.validate(*args)  # (first: the output's expected shape reads the inputs')
        registry.check_output(
            where, "output", output, (args[0].shape[0], args[1].shape[-2]), (torch.bfloat16,), args[0].device
        )
        registry.check_writable(where, "output", output)
    out = op(*args)
    return out if output is None else output.copy_(out)


def _validate_out(XQ, WQ, x_scale, w_scale, output, bias=None, use_fast_accum=True):
    _validate_rowwise("f8f8bf16_rowwise_out", XQ, WQ, x_scale, w_scale, bias, batched=False)
    registry.check_output(
        "f8f8bf16_rowwise_out", "output", output, (*XQ.shape[:-1], WQ.shape[0]), (torch.bfloat16,), XQ.device
    )


def _out_reference(XQ, WQ, x_scale, w_scale, output, bias=None, use_fast_accum=True):
    output.copy_(_rowwise_reference(XQ, WQ, x_scale, w_scale, bias, torch.bfloat16))


def _out_samples(device):
    for sample in _rowwise_samples(device):
        xq, wq = sample.args[:2]
        output = testing.empty_poisoned(*xq.shape[:-1], wq.shape[0], dtype=torch.bfloat16, device=device)
        yield registry.Sample((*sample.args[:4], output, *sample.args[4:]))


f8f8bf16_rowwise_out_op = registry.Op(
    "mslk::f8f8bf16_rowwise_out(Tensor XQ, Tensor WQ, Tensor x_scale, Tensor w_scale, Tensor(a!) output, "
    "Tensor? bias=None, bool use_fast_accum=True) -> ()",
    domain="gemm",
    reference=_out_reference,
    fake=lambda *args, **kwargs: None,
    samples=_out_samples,
    validate=_validate_out,
    tolerance=1e-2,
)


@f8f8bf16_rowwise_out_op.backend("triton", available=registry.triton_missing, requires=arch.fp8_e4m3_missing)
def _out_triton(XQ, WQ, x_scale, w_scale, output, bias=None, use_fast_accum=True):
    if output.is_contiguous():
        _rowwise_into(XQ, WQ, x_scale, w_scale, bias, use_fast_accum, output)
    else:  # the kernel writes [M', N] rows; a strided output gets a copy
        out = torch.empty(output.shape, dtype=output.dtype, device=output.device)
        output.copy_(_rowwise_into(XQ, WQ, x_scale, w_scale, bias, use_fast_accum, out))


def _validate_batched(XQ, WQ, x_scale, w_scale, bias=None, use_fast_accum=True, output=None):
    _validate_rowwise("f8f8bf16_rowwise_batched", XQ, WQ, x_scale, w_scale, bias, batched=True)
    registry.check_output(
        "f8f8bf16_rowwise_batched", "output", output, (*XQ.shape[:-1], WQ.shape[1]), (torch.bfloat16,), XQ.device
    )


def _batched_reference(XQ, WQ, x_scale, w_scale, bias=None, use_fast_accum=True, output=None):
    out = _rowwise_reference(XQ, WQ, x_scale, w_scale, bias, torch.bfloat16)
    return out if output is None else output.copy_(out)


def _batched_samples(device):
    x, xs = _quantized(3, 20, 32, device=device)
    w, ws = _quantized(3, 24, 32, device=device)
    yield registry.Sample((x, w, xs, ws))
    yield registry.Sample((x, w, xs, ws, testing.randn(24, device=device), False))


f8f8bf16_rowwise_batched_op = registry.Op(
    "mslk::f8f8bf16_rowwise_batched(Tensor XQ, Tensor WQ, Tensor x_scale, Tensor w_scale, Tensor? bias=None, "
    "bool use_fast_accum=True, Tensor(a!)? output=None) -> Tensor",
    out_arg="output",
    domain="gemm",
    reference=_batched_reference,
    fake=lambda XQ, WQ, *args, **kwargs: XQ.new_empty((*XQ.shape[:-1], WQ.shape[1]), dtype=torch.bfloat16),
    samples=_batched_samples,
    validate=_validate_batched,
    tolerance=1e-2,
)


@f8f8bf16_rowwise_batched_op.backend("triton", available=registry.triton_missing, requires=arch.fp8_e4m3_missing)
def _batched_triton(XQ, WQ, x_scale, w_scale, bias=None, use_fast_accum=True, output=None):
    out = torch.empty((*XQ.shape[:-1], WQ.shape[1]), dtype=torch.bfloat16, device=XQ.device)
    x_scale = x_scale.reshape(XQ.shape[:-1]).contiguous()
    w_scale = w_scale.reshape(WQ.shape[:-1]).contiguous()
    bias = None if bias is None else bias.contiguous()
    _run_rowwise(k_contiguous(XQ), k_contiguous(WQ), x_scale, w_scale, bias, use_fast_accum, out)
    return out if output is None else output.copy_(out)


def f8f8bf16_rowwise(XQ, WQ, x_scale, w_scale, bias=None, use_fast_accum=True) -> torch.Tensor:
    """`bf16((XQ · WQᵀ) · x_scale[m] · w_scale[n] + bias)` (spec G-01): XQ [..., M, K], WQ [N, K] FP8,
    rowwise fp32 scales (quantize_fp8_row), bias [N] fp32/bf16; `use_fast_accum=False` sums each K block's
    product in fp32."""
    return torch.ops.mslk.f8f8bf16_rowwise(XQ, WQ, x_scale, w_scale, bias, use_fast_accum)


def _matmul_fp8_row(a, b, a_scale, b_scale, bias=None, dot_out_dtype=None, allow_tf32=True, fp8_fast_accum=True, *_):
    ones = [torch.ones(t.shape[:-1], dtype=torch.float32, device=t.device) for t in (a, b)]
    a_scale, b_scale = (ones[0] if a_scale is None else a_scale), (ones[1] if b_scale is None else b_scale)
    return torch.ops.mslk.f8f8bf16_rowwise(a, b, a_scale, b_scale, bias, fp8_fast_accum)


registry.alias(
    "triton::matmul_fp8_row(Tensor a, Tensor b, Tensor? a_scale, Tensor? b_scale, Tensor? bias=None, "
    "ScalarType? dot_out_dtype=None, bool allow_tf32=True, bool fp8_fast_accum=True, bool imprecise_acc=False, "
    "bool tma_persistent=True, bool? no_use_persistent=None, bool use_warp_specialization=False) -> Tensor",
    _matmul_fp8_row,
)


def matmul_fp8_row(
    a, b, a_scale, b_scale, bias=None, dot_out_dtype=None, allow_tf32=True, fp8_fast_accum=True, imprecise_acc=False,
    tma_persistent=True, no_use_persistent=None, use_warp_specialization=False,
) -> torch.Tensor:  # fmt: skip
    """The reference library's Triton entry (spec G-50), `torch.ops.triton.matmul_fp8_row`: f8f8bf16_rowwise,
    `(a · bᵀ) · a_scale[m] · b_scale[n] (+ bias)` in bf16, a scale of None being ones; its tuning keywords
    (tma_persistent, dot_out_dtype, ...) are accepted and have no effect here."""
    return torch.ops.triton.matmul_fp8_row(
        a, b, a_scale, b_scale, bias, dot_out_dtype, allow_tf32, fp8_fast_accum, imprecise_acc, tma_persistent,
        no_use_persistent, use_warp_specialization,
    )  # fmt: skip


def _matmul_fp8_block(a, b, a_scale, b_scale, scale_block_m=256, scale_block_n=256, scale_block_k=256, *_unused):
    return torch.ops.mslk.f8f8bf16_blockwise(a, b, a_scale, b_scale, scale_block_m, scale_block_n, scale_block_k)


registry.alias(
    "triton::matmul_fp8_block(Tensor a, Tensor b, Tensor a_scale, Tensor b_scale, int scale_block_m=256, "
    "int scale_block_n=256, int scale_block_k=256, ScalarType? dot_out_dtype=None, bool allow_tf32=True, "
    "bool fp8_fast_accum=True) -> Tensor",
    _matmul_fp8_block,
)


def matmul_fp8_block(
    a, b, a_scale, b_scale, scale_block_m=256, scale_block_n=256, scale_block_k=256, dot_out_dtype=None,
    allow_tf32=True, fp8_fast_accum=True,
) -> torch.Tensor:  # fmt: skip
    """The reference library's Triton entry (spec G-51), `torch.ops.triton.matmul_fp8_block`: f8f8bf16_blockwise
    (fp8_blockwise_gemm.py) with its default 256 blocks; the accumulation is always fp32 (dot_out_dtype,
    allow_tf32 and fp8_fast_accum are accepted for compatibility)."""
    return torch.ops.triton.matmul_fp8_block(
        a, b, a_scale, b_scale, scale_block_m, scale_block_n, scale_block_k, dot_out_dtype, allow_tf32, fp8_fast_accum
    )
