"""INT4 weight-only GEMMs (spec G-24..G-31, G-56; weight formats §7.4).

    bf16i4bf16_*:      out[m, n] = Σ_k X[m, k] · Wdq[n, k]
    f8i4bf16_rowwise:  out[m, n] = (Σ_k XQ[m, k] · Wdq[n, k]) · x_scale[m]
    f8i4bf16_shuffled: out[m, n] = (Σ_k XQ[m, k] · Wdq[n, k]) · x_scale[m] · w_scale[n]

with fp32 sums and bf16 output. The weights are signed int4 q in [-8, 7] in groups of gs along K, dequantized
as Wdq[n, k] = q[n, k] · scale[k // gs, n] + zero[k // gs, n], or for the FP8 table format as the group's table
entry for |q| with q's sign (entry m - 1 is e4m3(m · scale)).

Layouts (mslk.quantize.shuffle makes them; this module only reads them): int8 [..., N, K/2], two two's-complement
nibbles per byte, either plain (pack_int4: byte j holds k = 2j low, 2j + 1 high; the *_rowwise ops) or
preshuffled (preshuffle_i4: per run of 128 k, byte j holds k = j low, j + 64 high; the *_shuffled ops, K % 128 ==
0). Scales and zeros are [..., ⌈K/gs⌉, N] (N-major) fp32/bf16/fp16, the FP8 tables [..., ⌈K/gs⌉, 8, N]
float8_e4m3fn. The group size is not an argument (`formats.int4_group_size`): K / groups where that divides, the
spec's rule (96 and 192 too), else the power of two gs with ⌈K/gs⌉ = groups, the last group shorter (MSLK's
quantizers make that layout only where the groups do not divide K, so that it reads back).

Kernels: one K loop, 128 k per step, serves every op. Each step dequantizes the [BLOCK_N, 128] weight tile in
registers (never to global memory) and multiplies it by the activations' [BLOCK_M, 128] tile on the tensor cores,
computing the output transposed (weights as the first operand, which stays in registers on Hopper): in bf16,
scale and zero applied before the dot by FMAs on bf16 pairs, or, for the FP8 table, in FP8: q · scale is exact in
fp32, so rounding it to e4m3 gives the table's entry. On NVIDIA GPUs a nibble pair becomes its bf16 pair in three
PTX instructions (0x4300 | u is the bf16 128 + u; two bf16x2 FMAs), plus a PRMT per pair where four plain bytes
go through one asm block; elsewhere (ROCm, the interpreter) the same arithmetic runs as Triton ops. Decode tiles
(16 activation rows) skip both FMAs: they multiply the bf16 128 + u themselves and apply scale and zero to the
fp32 products, once per output element a step. The tiles come through TMA descriptors where TMA can read X and
W (zeros past their edges), else through pointers. Small M (decode) splits K over more programs: each writes fp32
partial sums to a workspace and a second kernel (split_k.py), a dependent of the first where the GPU can (Hopper),
adds them in split order (deterministic) into bf16. On Hopper, the bf16 formats have Gluon kernels: decode (M <=
int4_decode_hopper.MAX_M, plain and preshuffled; grouped, at most that many rows a group on average) runs
int4_decode_hopper.py's, over K relabelled so that a nibble pair takes one LOP3 (and part of a shift), and prefill
of the plain format (M >= int4_hopper.MIN_M, whole 64-k steps; grouped, larger groups) int4_hopper.py's, which
dequantizes a step's weights while the step before it multiplies.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from mslk.core import arch, formats, launch, registry, testing
from mslk.gemm.triton import int4_decode_hopper, int4_hopper
from mslk.gemm.triton.fp8_gemm import k_contiguous, quantize_rows, row_tiles, tile_coordinates, tma_ready
from mslk.gemm.triton.int4_ptx import BIASED_BYTES_PTX, DEQUANT_BYTES_PTX, DEQUANT_PTX
from mslk.gemm.triton.split_k import begin_as_dependent, splitk_reduce

K_STEP = 128  # k per K-loop step: one run of the preshuffled layout, 64 bytes of each weight row
_K_STEP = tl.constexpr(K_STEP)  # the same, for the kernels


# ------------------------------------------------------------------------------------------ group scales


def _check_weights(where: str, W, k: int, lead: tuple, shuffled: bool) -> None:
    """W int8 [*lead, N, K/2] holding K = k values per row (and K % 128 == 0 when preshuffled)."""
    if W.dtype != torch.int8 or W.dim() != len(lead) + 2 or tuple(W.shape[:-2]) != lead:
        shape = ", ".join([*map(str, lead), "N", "K/2"])
        raise ValueError(
            f"{where}: W must be int8 packed int4 [{shape}] (two values per byte), got {tuple(W.shape)} {W.dtype}"
        )
    if 2 * W.shape[-1] != k:
        raise ValueError(f"{where}: W {tuple(W.shape)} holds K = {2 * W.shape[-1]} values per row, X has K = {k}")
    if shuffled and k % K_STEP:
        raise ValueError(f"{where}: preshuffled weights (preshuffle_i4) need K % {K_STEP} == 0, got K = {k}")


def _check_group_scales(where: str, W, k: int, scale, zero=None, table: bool = False) -> None:
    """The group size the scales imply (ScaleFormatError when none fits), then their format, zeros alike."""
    rows_dim = -3 if table else -2
    expected = f"[..., ⌈K/group_size⌉, {'8, ' if table else ''}N]"
    if scale.dim() < W.dim() + (1 if table else 0):
        producer = "preshuffle_i4's FP8 table " if table else ""
        raise formats.ScaleFormatError(
            f"{where}: expected {producer}scales {expected} for W {tuple(W.shape)}, got shape {tuple(scale.shape)}"
        )
    groups = scale.shape[rows_dim]
    size = formats.int4_group_size(k, groups)
    if size is None:
        raise formats.ScaleFormatError(
            f"{where}: scales of shape {tuple(scale.shape)} give {groups} groups for K = {k}, which no group size "
            f"does (expected {expected})"
        )
    fmt = formats.Int4Groupwise(size, table)
    fmt.check(W, scale, role=f"{where}: {'w_scale_group' if table else 'scale'}")
    if zero is not None:
        fmt.check(W, zero, role=f"{where}: zero")
        if zero.dtype != scale.dtype:
            raise formats.ScaleFormatError(f"{where}: zero {zero.dtype} and scale {scale.dtype} must have one dtype")


def _check_bf16_x(where: str, X, dims: int | None) -> None:
    if X.dtype != torch.bfloat16 or (X.dim() != dims if dims else X.dim() < 2):
        shape = "[B, M, K]" if dims == 3 else "[..., M, K]" if dims is None else "[ΣM, K]"
        raise ValueError(f"{where}: X must be bfloat16 {shape}, got {tuple(X.shape)} {X.dtype}")


def _check_m_sizes(where: str, M_sizes, groups: int) -> None:
    if M_sizes.dim() != 1 or M_sizes.dtype not in (torch.int32, torch.int64) or M_sizes.shape[0] != groups:
        raise ValueError(
            f"{where}: M_sizes must be int32/int64 [G] = [{groups}], got {tuple(M_sizes.shape)} {M_sizes.dtype}"
        )


# ------------------------------------------------------------------------------------------------ reference


def unpack_int4(W: torch.Tensor, shuffled: bool) -> torch.Tensor:
    """The int4 values int8 [..., N, K] in [-8, 7] of weights packed [..., N, K/2], plain or preshuffled."""
    low, high = (W << 4) >> 4, W >> 4  # arithmetic shifts sign-extend each nibble
    if shuffled:
        half = K_STEP // 2
        return torch.stack((low.unflatten(-1, (-1, half)), high.unflatten(-1, (-1, half))), -2).flatten(-3)
    return torch.stack((low, high), -1).flatten(-2)


def _per_k(rows: torch.Tensor, k: int, size: int) -> torch.Tensor:
    """Group rows [..., G, N] as one row per k, transposed: [..., N, K] fp32."""
    return rows.float().repeat_interleave(size, -2)[..., :k, :].transpose(-1, -2)


def dequantize_int4(W, scale, zero=None, *, shuffled: bool) -> torch.Tensor:
    """fp32 [..., N, K]: q · scale + zero per group (zero=None: q · scale)."""
    q = unpack_int4(W, shuffled).float()
    k = q.shape[-1]
    size = formats.int4_group_size(k, scale.shape[-2])
    w = q * _per_k(scale, k, size)
    return w if zero is None else w + _per_k(zero, k, size)


def dequantize_int4_table(W, table) -> torch.Tensor:
    """fp32 [..., N, K] of preshuffled weights with FP8 tables [..., G, 8, N]: e4m3(|q| · entry 0) with q's sign,
    as the kernels compute it. That is the table's entry for |q| in the tables preshuffle_i4 builds (e4m3(m · s));
    the entries past the first are not read, so a table whose entries differ reads as that one (both backends)."""
    q = unpack_int4(W, shuffled=True)
    k = q.shape[-1]
    first = _per_k(table[..., 0, :], k, formats.int4_group_size(k, table.shape[-3]))
    return q.sign() * (q.abs() * first).to(torch.float8_e4m3fn).float()


def _matmul_reference(X, w, x_scale=None, w_scale=None) -> torch.Tensor:
    """bf16 of fp32 X · wᵀ (w [..., N, K] dequantized), times the rowwise scales when given."""
    out = torch.matmul(X.float(), w.transpose(-1, -2))
    if x_scale is not None:
        out = out * x_scale.float().reshape(*X.shape[:-1], 1)
    if w_scale is not None:
        out = out * w_scale.float()
    return out.to(torch.bfloat16)


def _grouped_reference(X, w, M_sizes, x_scale=None, w_scale=None) -> torch.Tensor:
    """Per-group _matmul_reference (reads M_sizes on the host); a negative size counts as 0, as the kernel reads it;
    rows past ΣM_sizes are zero."""
    out = torch.zeros(X.shape[0], w.shape[-2], dtype=torch.bfloat16, device=X.device)
    if w_scale is not None:
        w_scale = w_scale.reshape(w.shape[:-1])  # rowwise scales may come flat [G·N]
    start = 0
    for g, m in enumerate(M_sizes.clamp(min=0).tolist()):
        rows = slice(start, start + m)
        out[rows] = _matmul_reference(
            X[rows], w[g], None if x_scale is None else x_scale[rows], None if w_scale is None else w_scale[g]
        )
        start += m
    return out


# ------------------------------------------------------------------------------------------------ kernels


@triton.jit
def _bf16x2(v):
    """bf16 values as int32 bf16x2 registers holding the value in both halves."""
    bits = v.to(tl.int16, bitcast=True).to(tl.uint16, bitcast=True).to(tl.int32)
    return bits | (bits << 16)


@triton.jit
def _biased(t):
    """The bf16 pairs 136 + q (int32) of the nibbles at bits 0-3 and 16-19 of t: DEQUANT_PTX's magic numbers."""
    return (t & 0x000F000F) ^ 0x43084308


@triton.jit
def _dequant_pairs(t, s, z, ASM: tl.constexpr, UPCAST: tl.constexpr, BYTES: tl.constexpr = False):
    """q · s + z rounded to bf16 for the signed nibbles at bits 0-3 (k = 2j) and 16-19 (k = 2j + 1) of each int32
    of t [BN, S, W] (other bits ignored), or BYTES: t holds the plain layout's bytes (int8, low nibble k = 2j);
    s and z bf16 [BN, S, 1] -> [BN, 2·S·W] in k order; fp32 when UPCAST (the interpreter multiplies bf16 dot
    operands as raw integers). s = z = None: the biased values 136 + q, exact in bf16, for `_post_scaled`."""
    rows: tl.constexpr = t.shape[0]
    width: tl.constexpr = 2 * t.shape[1] * t.shape[2]
    if ASM:
        if BYTES:  # four bytes per asm block: 4.25 instructions a pair instead of about 6
            if s is None:
                pairs = tl.inline_asm_elementwise(
                    BIASED_BYTES_PTX, "=r,=r,=r,=r,r", [t], dtype=tl.int32, is_pure=True, pack=4
                )
            else:
                pairs = tl.inline_asm_elementwise(
                    DEQUANT_BYTES_PTX, "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r", [t, _bf16x2(s), _bf16x2(z)],
                    dtype=tl.int32, is_pure=True, pack=4,
                )  # fmt: skip
        elif s is None:
            pairs = _biased(t)
        else:
            pairs = tl.inline_asm_elementwise(
                DEQUANT_PTX, "=r,r,r,r", [t, _bf16x2(s), _bf16x2(z)], dtype=tl.int32, is_pure=True, pack=1
            )
        halves = tl.join(pairs.to(tl.int16), (pairs >> 16).to(tl.int16))
        w = halves.reshape(rows, width).to(tl.bfloat16, bitcast=True)
    else:
        if BYTES:
            t = t.to(tl.uint8, bitcast=True).to(tl.int32) * 0x1001  # low nibble to bits 0-3, high to 16-19
        biased = _biased(t)
        halves = tl.join(biased.to(tl.int16), (biased >> 16).to(tl.int16)).to(tl.bfloat16, bitcast=True)
        if s is None:
            w = halves.reshape(rows, width)
        else:
            q = halves.to(tl.float32) - 136.0
            w = (q * s.to(tl.float32)[:, :, :, None] + z.to(tl.float32)[:, :, :, None]).to(tl.bfloat16)
            w = w.reshape(rows, width)
        if UPCAST:
            w = w.to(tl.float32)
    return w


@triton.jit
def _post_scaled(acc, products, sums, s, z):
    """acc + Σ_k (q · s + z) · x over one group's k, from the products of the biased weights (136 + q) with the
    activations and of ones with them (their sums): s · products + (z − 136 s) · sums, in fp32 (s, z [BN, 1, 1])."""
    s = s.reshape(s.shape[0], 1).to(tl.float32)
    z = z.reshape(z.shape[0], 1).to(tl.float32)
    return acc + products * s + sums * (z - 136.0 * s)


@triton.jit
def _dequant_fp8(t, scale):
    """e4m3(q · scale) [BN, S·W] for the signed nibble at bits 0-3 of t [BN, S, W], scale fp32 [BN, S, 1]: the
    table entry for |q| with q's sign, since q · scale is exact in fp32 and both round to nearest even."""
    q = ((t & 0xF) ^ 0x4B000008).to(tl.float32, bitcast=True) - 8388616.0  # (2^23 + q + 8) - (2^23 + 8)
    return (q * scale).to(tl.float8e4nv).reshape(t.shape[0], t.shape[1] * t.shape[2])


@triton.jit
def _group_rows(ptr, k, stride_g, cols, N, groups, SPAN: tl.constexpr, GROUP_SIZE: tl.constexpr, KSUB: tl.constexpr):
    """Group rows of the KSUB-wide sub-blocks of the SPAN k from k, for the tile's columns: [BN, SPAN / KSUB, 1],
    zero past N and past the last group. The columns stay unclamped (masked) so that the loads vectorize along N."""
    g = (k + tl.arange(0, SPAN // KSUB) * KSUB) // GROUP_SIZE
    mask = (cols < N)[:, None] & (g < groups)[None, :]
    return tl.load(ptr + g[None, :] * stride_g + cols[:, None], mask=mask, other=0.0)[:, :, None]


@triton.jit
def _wait_for_wgmmas():
    """Wait until every warpgroup MMA issued so far is done (PTX; Hopper's wgmma only). The K loop's products read
    the dequantized weights from registers while they run. Triton (3.6 and 3.7) splits a step's product into pieces
    and lets the last run on into the next step, whose dequantization rewrites the registers it reads: a race, wrong
    outputs on the H200. Waiting at the end of each step still lets a step's pieces run back to back."""
    tl.inline_asm_elementwise(
        "mov.u32 $0, 0;\nwgmma.wait_group.sync.aligned 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _step_group_rows(s_ptr, z_ptr, k, stride_g, cols, N, groups, SHUFFLED: tl.constexpr, TABLE: tl.constexpr,
                     SPAN: tl.constexpr, GROUP_SIZE: tl.constexpr, KSUB: tl.constexpr):  # fmt: skip
    """The group rows of the K step from k: scales and zeros of its first dot (lo) and, preshuffled, of its second
    (hi, k + SPAN). Rows the format lacks are the first dot's scales, never read (a loop cannot carry None)."""
    s_lo = _group_rows(s_ptr, k, stride_g, cols, N, groups, SPAN, GROUP_SIZE, KSUB)
    z_lo = s_lo
    if not TABLE:
        z_lo = _group_rows(z_ptr, k, stride_g, cols, N, groups, SPAN, GROUP_SIZE, KSUB)
    s_hi = s_lo
    z_hi = s_lo
    if SHUFFLED:
        s_hi = _group_rows(s_ptr, k + SPAN, stride_g, cols, N, groups, SPAN, GROUP_SIZE, KSUB)
        if not TABLE:
            z_hi = _group_rows(z_ptr, k + SPAN, stride_g, cols, N, groups, SPAN, GROUP_SIZE, KSUB)
    return s_lo, z_lo, s_hi, z_hi


@triton.jit
def _load_masked(ptrs, row_mask, col_mask):
    """ptrs [R, C] loaded where row_mask [R, 1] and col_mask [1, C] allow (None: everywhere), zeros elsewhere."""
    if row_mask is None:
        if col_mask is None:
            v = tl.load(ptrs)
        else:
            v = tl.load(ptrs, mask=col_mask, other=0.0)
    elif col_mask is None:
        v = tl.load(ptrs, mask=row_mask, other=0.0)
    else:
        v = tl.load(ptrs, mask=row_mask & col_mask, other=0.0)
    return v


@triton.jit
def _activations(x, TABLE: tl.constexpr, UPCAST: tl.constexpr):
    """The dot operand of an activation tile: FP8 as it is for the table format's FP8 dot, else bf16 (FP8 widened
    exactly), fp32 under the interpreter."""
    if TABLE:
        operand = x
    elif UPCAST:
        operand = x.to(tl.float32)
    else:
        operand = x.to(tl.bfloat16)
    return operand


@triton.jit
def _int4_k_loop(
    acc, x_ptr, w_ptr, x_desc, w_desc, s_ptr, z_ptr, stride_xm, stride_wn, stride_sg, x_rows, x_mask, first_row,
    cols, first_col, N, K, groups, first_step, steps, SHUFFLED: tl.constexpr, TABLE: tl.constexpr, ASM: tl.constexpr,
    UPCAST: tl.constexpr, EVEN_K: tl.constexpr, GROUP_SIZE: tl.constexpr, KSUB: tl.constexpr,
    SCALES_AHEAD: tl.constexpr, WGMMA_WAIT: tl.constexpr, POST_SCALE: tl.constexpr,
):  # fmt: skip
    """acc [BN, BM] += Wdq[cols, k] · X[x_rows, k]ᵀ over the K steps [first_step, first_step + steps): the
    dequantized weights are the dot's first operand, which wgmma takes from registers (no shared-memory round trip),
    and the activations its second, so a decode tile is as narrow as M (wgmma's N, down to 16). Rows where
    x_mask [BM, 1] is false are not read (None: all are); columns past N read row 0 and are never stored.
    x_desc / w_desc (or None): TMA descriptors of X and W, the tile's rows from first_row / first_col on (past the
    tensors' edges, K's included, they read zeros; past a batch's M or N, the next batch's rows, never stored).

    Plain weights: one dot per step, a byte per pair (k, k + 1). Preshuffled: one dot per half step of 64 k, both
    halves from the low and high nibbles of the same 64 bytes (w_ptr addresses int16 words for bf16, whose two
    bytes give the bf16 pairs (k, k + 1) and (k + 64, k + 65); bytes for the FP8 table). A dot's k are cut into
    sub-blocks of KSUB that lie in one group each (KSUB divides the group size).

    SCALES_AHEAD: each step's group rows are loaded one step ahead into registers; else in their step, which the
    compiler pipelines through shared memory (`_scales_ahead` says which is faster where). WGMMA_WAIT: each step
    ends waiting for its warpgroup MMAs (`_wait_for_wgmmas`). POST_SCALE (bf16 formats, steps within one group):
    the dots multiply the biased values 136 + q, and the group's scale and zero apply to their fp32 products
    (`_post_scaled`): fewer instructions a weight where the tile is narrow (decode), exact dequantization.

    The loop counts from 0 up to `steps`, which the dense kernel assumes positive: where the loop might run zero
    times, ptxas serialized every wgmma (its warning C7515: a path defining the accumulator by moves up to the
    last wait)."""
    HALF: tl.constexpr = _K_STEP // 2
    SPAN: tl.constexpr = HALF if SHUFFLED else _K_STEP  # k per dot
    sub = tl.arange(0, SPAN // KSUB)[None, :, None]
    x_row_ptrs = x_ptr + x_rows.to(tl.int64)[:, None] * stride_xm  # [BM, 1]
    w_row_ptrs = w_ptr + tl.where(cols < N, cols, 0).to(tl.int64)[:, None, None] * stride_wn  # [BN, 1, 1]
    if POST_SCALE:  # the operand whose products are the activations' sums
        ones = tl.full((cols.shape[0], SPAN), 1.0, tl.float32 if UPCAST else tl.bfloat16)
    if SCALES_AHEAD:
        s_lo, z_lo, s_hi, z_hi = _step_group_rows(s_ptr, z_ptr, first_step * _K_STEP, stride_sg, cols, N, groups,
                                                  SHUFFLED, TABLE, SPAN, GROUP_SIZE, KSUB)  # fmt: skip
    for step in range(0, steps):  # software-pipelined with the launch's num_stages
        k0 = (first_step + step) * _K_STEP
        if not SCALES_AHEAD:
            s_lo, z_lo, s_hi, z_hi = _step_group_rows(s_ptr, z_ptr, k0, stride_sg, cols, N, groups, SHUFFLED, TABLE,
                                                      SPAN, GROUP_SIZE, KSUB)  # fmt: skip
        if SHUFFLED:  # K % 128 == 0: no masks
            if x_desc is not None:
                x_lo, x_hi = x_desc.load([first_row, k0]), x_desc.load([first_row, k0 + HALF])
            else:
                ks = k0 + tl.arange(0, HALF)[None, :]
                x_lo = _load_masked(x_row_ptrs + ks, x_mask, None)
                x_hi = _load_masked(x_row_ptrs + HALF + ks, x_mask, None)
            x_lo, x_hi = _activations(x_lo, TABLE, UPCAST), _activations(x_hi, TABLE, UPCAST)
            if TABLE:  # bytes [BN, sub-blocks, KSUB]
                if w_desc is not None:
                    t = w_desc.load([first_col, k0 // 2]).reshape(cols.shape[0], SPAN // KSUB, KSUB)
                else:
                    t = tl.load(w_row_ptrs + k0 // 2 + sub * KSUB + tl.arange(0, KSUB)[None, None, :])
                t = t.to(tl.uint8, bitcast=True).to(tl.int32)
                w_lo, w_hi = _dequant_fp8(t, s_lo.to(tl.float32)), _dequant_fp8(t >> 4, s_hi.to(tl.float32))
            else:  # words [BN, sub-blocks, KSUB/2]; bytes 0 and 1 to bits 0 and 16 align both nibble pairs
                if w_desc is not None:
                    t = w_desc.load([first_col, k0 // 4]).reshape(cols.shape[0], SPAN // KSUB, KSUB // 2)
                else:
                    t = tl.load(w_row_ptrs + k0 // 4 + sub * (KSUB // 2) + tl.arange(0, KSUB // 2)[None, None, :])
                t = t.to(tl.uint16, bitcast=True).to(tl.int32)
                t = (t | (t << 8)) & 0x00FF00FF
                if POST_SCALE:
                    w_lo = _dequant_pairs(t, None, None, ASM, UPCAST)
                    w_hi = _dequant_pairs(t >> 4, None, None, ASM, UPCAST)
                else:
                    w_lo = _dequant_pairs(t, s_lo.to(tl.bfloat16), z_lo.to(tl.bfloat16), ASM, UPCAST)
                    w_hi = _dequant_pairs(t >> 4, s_hi.to(tl.bfloat16), z_hi.to(tl.bfloat16), ASM, UPCAST)
            if POST_SCALE:  # both halves lie in one group
                products = tl.dot(w_hi, x_hi.T, tl.dot(w_lo, x_lo.T))
                acc = _post_scaled(acc, products, tl.dot(ones, x_hi.T, tl.dot(ones, x_lo.T)), s_lo, z_lo)
            else:
                acc = tl.dot(w_lo, x_lo.T, acc)
                acc = tl.dot(w_hi, x_hi.T, acc)
        else:  # plain bytes [BN, sub-blocks, KSUB/2]
            if w_desc is not None:
                b = w_desc.load([first_col, k0 // 2]).reshape(cols.shape[0], SPAN // KSUB, KSUB // 2)
                x = x_desc.load([first_row, k0])
            else:
                byte = k0 // 2 + sub * (KSUB // 2) + tl.arange(0, KSUB // 2)[None, None, :]
                ks = k0 + tl.arange(0, _K_STEP)[None, :]
                if EVEN_K:
                    b = tl.load(w_row_ptrs + byte)
                    x = _load_masked(x_row_ptrs + ks, x_mask, None)
                else:  # past K: zero activations (and finite weights)
                    b = tl.load(w_row_ptrs + byte, mask=byte < K // 2, other=0)
                    x = _load_masked(x_row_ptrs + ks, x_mask, ks < K)
            x_t = _activations(x, False, UPCAST).T
            if POST_SCALE:
                products = tl.dot(_dequant_pairs(b, None, None, ASM, UPCAST, True), x_t)
                acc = _post_scaled(acc, products, tl.dot(ones, x_t), s_lo, z_lo)
            else:
                acc = tl.dot(_dequant_pairs(b, s_lo.to(tl.bfloat16), z_lo.to(tl.bfloat16), ASM, UPCAST, True), x_t, acc)
        if SCALES_AHEAD:
            s_lo, z_lo, s_hi, z_hi = _step_group_rows(s_ptr, z_ptr, k0 + _K_STEP, stride_sg, cols, N, groups,
                                                      SHUFFLED, TABLE, SPAN, GROUP_SIZE, KSUB)  # fmt: skip
        if WGMMA_WAIT:
            _wait_for_wgmmas()
    return acc


@triton.jit
def _int4_gemm_kernel(
    x_ptr, w_ptr, x_desc, w_desc, s_ptr, z_ptr, c_ptr, x_scale_ptr, w_scale_ptr,
    M, N, K, groups, steps_per_split,
    stride_xb, stride_xm, stride_wb, stride_wn, stride_sb, stride_sg, stride_cs, stride_cb, stride_cm,
    SHUFFLED: tl.constexpr, TABLE: tl.constexpr, X_SCALE: tl.constexpr, W_SCALE: tl.constexpr, SPLIT: tl.constexpr,
    MASK_ROWS: tl.constexpr, ASM: tl.constexpr, UPCAST: tl.constexpr, EVEN_K: tl.constexpr, GROUP_SIZE: tl.constexpr,
    KSUB: tl.constexpr, SCALES_AHEAD: tl.constexpr, WGMMA_WAIT: tl.constexpr, POST_SCALE: tl.constexpr,
    DEPENDENT_LAUNCH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """C[batch, m, n] of one [BLOCK_M, BLOCK_N] tile over one split of K (program ids: tile, split, batch).
    SPLIT: C is the fp32 workspace [splits, B, M, N] and the rowwise scales wait for the reduction. MASK_ROWS: rows
    past M are not read (decode tiles are mostly such rows), else they read row 0 (no masks in the loop). x_desc /
    w_desc (or None): TMA descriptors of X [B·M, K] and W [B·N, K/2] (int16 words [B·N, K/4] for preshuffled bf16).
    DEPENDENT_LAUNCH: launched as a dependent of the kernel before it, which it waits for before any memory access;
    the kernel after it (the split-K reduction, `splitk_reduce`) may take its places once every program has begun."""
    if DEPENDENT_LAUNCH:
        begin_as_dependent()
    tile, split, batch = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    pid_m, pid_n = tile_coordinates(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if MASK_ROWS:
        x_rows, x_mask = rows, (rows < M)[:, None]
    else:
        x_rows, x_mask = tl.where(rows < M, rows, 0), None
    first = split * steps_per_split
    steps = tl.minimum(steps_per_split, tl.cdiv(K, _K_STEP) - first)
    tl.assume(steps > 0)  # K > 0 and splits = ⌈steps / steps_per_split⌉ (_int4_k_loop: C7515)
    b64 = batch.to(tl.int64)
    acc = _int4_k_loop(
        tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), x_ptr + b64 * stride_xb, w_ptr + b64 * stride_wb, x_desc,
        w_desc, s_ptr + b64 * stride_sb, z_ptr + b64 * stride_sb, stride_xm, stride_wn, stride_sg, x_rows, x_mask,
        batch * M + pid_m * BLOCK_M, cols, batch * N + pid_n * BLOCK_N, N, K, groups, first, steps, SHUFFLED, TABLE,
        ASM, UPCAST, EVEN_K, GROUP_SIZE, KSUB, SCALES_AHEAD, WGMMA_WAIT, POST_SCALE,
    )  # fmt: skip
    if not SPLIT:
        if X_SCALE:
            acc *= tl.load(x_scale_ptr + rows, mask=rows < M, other=0.0)[None, :]
        if W_SCALE:
            acc *= tl.load(w_scale_ptr + cols, mask=cols < N, other=0.0)[:, None]
    c_ptrs = c_ptr + split.to(tl.int64) * stride_cs + b64 * stride_cb + rows.to(tl.int64)[:, None] * stride_cm
    tl.store(c_ptrs + cols[None, :], acc.T.to(c_ptr.dtype.element_ty), mask=(rows < M)[:, None] & (cols < N)[None, :])


@triton.jit
def _int4_grouped_kernel(
    x_ptr, w_ptr, x_desc, w_desc, s_ptr, z_ptr, out_ptr, m_sizes_ptr, x_scale_ptr, w_scale_ptr, G, TOTAL_M, N, K,
    groups, stride_xm, stride_wg, stride_wn, stride_sgrp, stride_sg, stride_om, stride_wsg,
    SHUFFLED: tl.constexpr, TABLE: tl.constexpr, ASM: tl.constexpr, UPCAST: tl.constexpr, EVEN_K: tl.constexpr,
    GROUP_SIZE: tl.constexpr, KSUB: tl.constexpr, WGMMA_WAIT: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """The weights of G groups (plain or preshuffled), X [ΣM, K] stacked (M_sizes rows each), as grouped_gemm.py
    walks them: persistent programs take every P-th tile of the concatenated tile list, reading M_sizes on the
    device; the rows past ΣM_sizes come out zero. x_desc / w_desc (or None): TMA descriptors of X [ΣM, K] and
    W [G·N, ·].

    With preshuffled weights its K loop runs without `_wait_for_wgmmas` (WGMMA_WAIT), which cost it 14-32% on the
    H200: a step's two products are two dots, the first waited for (its result feeds the second), none split, and
    in the code compiled for sm_90a no register of the second, which runs on into the next step, is rewritten
    before that wait (the SASS read under Triton 3.7, docs/offline-compile.md; the GPU tests pass under 3.6).
    Plain weights' one dot a step does race without it (tools/tests/test_hopper_sass.py, grouped_plain)."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    first_row = 0  # of the current group in X and out
    first_tile = 0  # of the current group in the concatenated tile list
    for g in range(G + 1):  # the groups, then the rows past their sum (zeros)
        if g < G:  # clamped, so that sizes summing past X's rows never read outside it
            m = tl.minimum(tl.maximum(tl.load(m_sizes_ptr + g), 0), TOTAL_M - first_row).to(tl.int32)
        else:
            m = TOTAL_M - first_row
        tiles = tl.cdiv(m, BLOCK_M) * tiles_n
        tile = (pid - first_tile % programs + programs) % programs
        # The rows past the sum multiply no weights, but the K loop's prologue reads a group's scales: group G - 1's,
        # not past the scales' end (an illegal address on the H200 in a graph replay with fewer rows).
        g64 = tl.cast(tl.minimum(g, G - 1), tl.int64)
        while tile < tiles:
            pid_m, pid_n = tile // tiles_n, tile % tiles_n
            rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            acc = _int4_k_loop(
                tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), x_ptr, w_ptr + g64 * stride_wg, x_desc, w_desc,
                s_ptr + g64 * stride_sgrp, z_ptr + g64 * stride_sgrp, stride_xm, stride_wn, stride_sg, first_row + rows,
                (rows < m)[:, None], first_row + pid_m * BLOCK_M, cols, g * N + pid_n * BLOCK_N, N, K, groups, 0,
                tl.cdiv(K, _K_STEP) * (g < G), SHUFFLED, TABLE, ASM, UPCAST, EVEN_K, GROUP_SIZE, KSUB,
                True, WGMMA_WAIT, False,  # group rows ahead; scales before the dots
            )  # fmt: skip
            if TABLE:
                if g < G:
                    acc *= tl.load(x_scale_ptr + first_row + rows, mask=rows < m, other=0.0)[None, :]
                    acc *= tl.load(w_scale_ptr + g64 * stride_wsg + cols, mask=cols < N, other=0.0)[:, None]
            out_ptrs = out_ptr + (first_row + rows).to(tl.int64)[:, None] * stride_om + cols[None, :]
            tl.store(out_ptrs, acc.T.to(out_ptr.dtype.element_ty), mask=(rows < m)[:, None] & (cols < N)[None, :])
            tile += programs
        first_row += m
        first_tile += tiles


# ------------------------------------------------------------------------------------------------ launch


def _sub_block(size: int, shuffled: bool) -> int | None:
    """k per scale sub-block of a dot: the largest power of two dividing the group size, at most the k of a dot
    (64 preshuffled, 128 plain); None below 16."""
    ksub = min(size & -size, K_STEP // 2 if shuffled else K_STEP)
    return ksub if ksub >= 16 else None


@functools.cache
def _config(
    m: int, n: int, k: int, batches: int, sms: int, upcast_x: bool, shuffled: bool, table: bool, scales_after: bool
) -> dict:
    """Tiles by shape class for Hopper, measured on the H200 at N = K = 8192 (RESULTS.md, fifth and eighth sessions).

    The tile is [BLOCK_N weight rows, BLOCK_M activation rows] (the output transposed). Decode streams the weights
    and is bound by latency, so it wants many programs in flight: with plain weights and M <= 32, 64 weight rows
    by 16 or 32 activation rows (rows past M are not loaded) on 2 warps (mma.sync; a wgmma warpgroup measured 15%
    slower at M = 16, 25% at M = 32), K split to about 8 programs per SM of at least 8 steps (M <= 16; 6 where the
    scales apply after the products, `_post_scale`), else 4 of at least 16 steps. Preshuffled weights and M up to
    64: 64 weight rows by 16 activation rows or 128 by 64, about 4 programs per SM, on one warpgroup, but on 2 warps
    for bf16 and M <= 16 (with TMA loads 23.9 / 25.3 us against 26.1 / 26.6 at M = 1 / 16; FP8 tables not measured
    there). Larger M: the dequantization per flop falls as 1 / BLOCK_M, so 128 weight rows by 256 activation rows
    on 3 stages, K split only when there are fewer tiles than SMs; 128 x 128 where FP8 activations are widened to
    bf16 (256 rows would spill), and for preshuffled bf16 weights on 3 stages (thirteenth session's sweep, us at
    M = 1024 / 8192: 244 / 2020 against 327 / 2624 for the 256-row tiles on 2 stages, 376 / 2746 on 4 stages;
    256 rows on 3 stages 267 / 2096)."""

    def tiles(bm, bn, warps, stages, group_m=8):
        return {"BLOCK_M": bm, "BLOCK_N": bn, "GROUP_M": group_m, "num_warps": warps, "num_stages": stages}

    steps = launch.cdiv(k, K_STEP)
    per_sm, min_steps = 1, 16  # programs per SM that K splits aim for, and the fewest steps in a split
    if m <= 32 and not shuffled:
        cfg = tiles(16 if m <= 16 else 32, 64, 2, 3, 1)
        per_sm, min_steps = ((6 if scales_after else 8), 8) if m <= 16 else (4, 16)
    elif m <= 64:
        cfg, per_sm = tiles(16, 64, 4 if table else 2, 3, 1) if m <= 16 else tiles(64, 128, 4, 3, 1), 4
    elif shuffled and not table:
        cfg = tiles(128, 128, 8, 3)
    elif m <= 256 or upcast_x:
        cfg = tiles(128, 128, 8, 4)
    else:
        cfg = tiles(256, 128, 8, 3)
    count = launch.cdiv(m, cfg["BLOCK_M"]) * launch.cdiv(n, cfg["BLOCK_N"]) * batches
    splits = max(1, min(per_sm * sms // count, steps // min_steps))
    per_split = launch.cdiv(steps, splits)
    return {**cfg, "splits": launch.cdiv(steps, per_split), "steps_per_split": per_split}


def _scales_ahead(shuffled: bool, num_warps: int) -> bool:
    """_int4_k_loop's SCALES_AHEAD: yes, but for preshuffled weights on two warpgroups, whose four group-row
    tensors would stay in registers (H200, us, N = K = 8192, ahead / in step: plain M = 64 / 1024 / 8192 29.4 / 258
    / 2125 against 39.0 / 286 / 2200; preshuffled 28.2 / 357 / 2785 against 38.9 / 330 / 2610, on 256-row tiles
    then; FP8 tables at M = 64 34.5 against 38.2, at 1024 / 8192 233 / 1702 against 221 / 1668; RESULTS.md,
    thirteenth session)."""
    return not (shuffled and num_warps >= 8)


def _wgmma_wait(device: torch.device, num_warps: int) -> bool:
    """_int4_gemm_kernel's WGMMA_WAIT: where Triton multiplies with warpgroup MMAs (NVIDIA Hopper, whole warpgroups)."""
    return device.type == "cuda" and torch.version.hip is None and arch.capability(device)[0] == 9 and num_warps >= 4


def _scales_after(table: bool, size: int) -> bool:
    """Whether _int4_k_loop's POST_SCALE can serve the format: bf16 scales and zeros, groups of whole K steps."""
    return not table and size % K_STEP == 0


def _post_scale(scales_after: bool, cfg: dict) -> bool:
    """POST_SCALE on the tiles of 16 activation rows on mma.sync warps (decode), where the products' scaling (two
    FMAs per output element a step) costs less than scaling the weights. H200, N = K = 8192, graphs, us (RESULTS.md,
    fourteenth session): plain M = 1 / 16 20.3 / 20.8 -> 19.5 / 20.2 with K split for 6 programs per SM (8 before;
    8 with POST_SCALE 22.4 / 23.4); preshuffled 24.9 / 25.5 -> 23.0 / 23.7; plain M = 32 29.1 -> 31.5: not there."""
    return scales_after and cfg["BLOCK_M"] == 16 and cfg["num_warps"] < 4


def _device_flags(t: torch.Tensor) -> dict:
    """ASM: NVIDIA PTX for the dequantization; UPCAST: fp32 dot operands under the interpreter."""
    return {"ASM": t.is_cuda and torch.version.hip is None, "UPCAST": not t.is_cuda}


def _programs(device: torch.device) -> int:
    return arch.sm_count(device) if device.type == "cuda" else 4  # 4: a few programs under the interpreter


def _weights_view(W: torch.Tensor, shuffled: bool, table: bool) -> torch.Tensor:
    """Packed weights as the kernel addresses them: bytes, or int16 words for the preshuffled bf16 format."""
    W = W.contiguous()
    return W.view(torch.int16) if shuffled and not table else W


def _descriptors(X, w, block_m: int, block_n: int, shuffled: bool) -> tuple:
    """TMA descriptors of X [B, M, K] and the weights' view w [B, N, ·] as 2-D stacks of their batches, in the
    K loop's tiles (a step of X, or the half step a preshuffled dot takes; the step's 64 bytes of W), where TMA
    can read both (else (None, None): pointer loads). On the H200 they took INT4 decode from 22.9 to 20.5 us and
    8192^3 from 2.27 to 2.15 ms (RESULTS.md, eighth session)."""
    if X.shape[0] > 1 and X.stride(0) != X.shape[1] * X.stride(1):  # batches not stacked
        return None, None
    x2d, w2d = X.view(-1, X.shape[-1]), w.view(-1, w.shape[-1])
    if not (tma_ready(x2d) and tma_ready(w2d)):
        return None, None
    x_width = K_STEP // 2 if shuffled else K_STEP
    w_width = K_STEP // 2 // w.element_size()
    return row_tiles(x2d, block_m, x_width), row_tiles(w2d, block_n, w_width)


def _run_int4_rows(X, W, scale, zero, **kwargs) -> torch.Tensor:
    """bf16 [..., M, N] of X [..., M, K] (every leading dim flattened into rows) and one weight matrix W [N, K/2]
    with its scales and zeros (or None): `_run_int4` on a batch of one."""
    out = torch.empty((*X.shape[:-1], W.shape[-2]), dtype=torch.bfloat16, device=X.device)
    x = k_contiguous(X.reshape(1, math.prod(X.shape[:-1]), X.shape[-1]))  # (not -1, ambiguous when K = 0)
    zero = None if zero is None else zero.contiguous()[None]
    _run_int4(x, W[None], scale.contiguous()[None], zero, out.view(1, x.shape[1], W.shape[-2]), **kwargs)
    return out


def _run_int4(X, W, scale, zero, out, *, shuffled, table=False, x_scale=None, w_scale=None):
    """out [B, M, N] bf16 of X [B, M, K] (bf16 or FP8, K-contiguous rows) and packed weights W [B, N, K/2] with
    group scales [B, G, N] (tables [B, G, 8, N]) and zeros; x_scale [M] and w_scale [N] for the FP8 forms (B = 1)."""
    batches, m, k = X.shape
    n = W.shape[-2]
    if launch.no_products(out, k):
        return out
    groups = scale.shape[-3] if table else scale.shape[-2]
    size = formats.int4_group_size(k, groups)
    if batches == 1 and not table and zero is not None:  # the Gluon kernels of the bf16 formats
        if m <= int4_decode_hopper.MAX_M and int4_decode_hopper.supports(X[0], W[0], scale[0], zero[0], size, shuffled):
            int4_decode_hopper.run(X[0], W[0], scale[0], zero[0], out[0], size, shuffled)
            return out
        if m >= int4_hopper.MIN_M and not shuffled and int4_hopper.supports(X[0], W[0], size):
            int4_hopper.run(X[0], W[0], scale[0], zero[0], out[0], size)
            return out
    if batches > 1 and not table and zero is not None and m <= int4_decode_hopper.MAX_M:
        # A batch of decode GEMMs is a grouped one of m rows a group: the decode kernel's grouped form.
        rows = X.reshape(batches * m, k)
        if int4_decode_hopper.supports(rows, W, scale, zero, size, shuffled):
            sizes = torch.full((batches,), m, dtype=torch.int32, device=X.device)
            int4_decode_hopper.run(rows, W, scale, zero, out.view(batches * m, n), size, shuffled, sizes=sizes)
            return out
    upcast_x = X.element_size() == 1 and not table
    scales_after = _scales_after(table, size)
    cfg = dict(_config(m, n, k, batches, _programs(X.device), upcast_x, shuffled, table, scales_after))
    splits, per_split = cfg.pop("splits"), cfg.pop("steps_per_split")
    w = _weights_view(W, shuffled, table)
    x_desc, w_desc = _descriptors(X, w, cfg["BLOCK_M"], cfg["BLOCK_N"], shuffled)
    zero = scale if zero is None else zero  # the table format has none: any pointer, never read
    split = splits > 1
    c = torch.empty((splits, batches, m, n), dtype=torch.float32, device=X.device) if split else out
    c_strides = (c.stride(0), c.stride(1), c.stride(2)) if split else (0, out.stride(0), out.stride(1))
    grid = (launch.cdiv(m, cfg["BLOCK_M"]) * launch.cdiv(n, cfg["BLOCK_N"]), splits, batches)
    dependent = launch.dependent_launch(X.device)
    launch.fast(_int4_gemm_kernel)[grid](
        X, w, x_desc, w_desc, scale, zero, c, x_scale, w_scale, m, n, k, groups, per_split,
        X.stride(0), X.stride(1), w.stride(0), w.stride(1), scale.stride(0), scale.stride(-3 if table else -2),
        *c_strides, SHUFFLED=shuffled, TABLE=table, X_SCALE=x_scale is not None, W_SCALE=w_scale is not None,
        SPLIT=split, MASK_ROWS=m < cfg["BLOCK_M"], EVEN_K=k % K_STEP == 0, GROUP_SIZE=size,
        KSUB=_sub_block(size, shuffled), SCALES_AHEAD=_scales_ahead(shuffled, cfg["num_warps"]),
        WGMMA_WAIT=_wgmma_wait(X.device, cfg["num_warps"]), POST_SCALE=_post_scale(scales_after, cfg),
        DEPENDENT_LAUNCH=dependent, **launch.dependent_launch_options(dependent),
        **_device_flags(X), **cfg,
    )  # fmt: skip
    if split:
        splitk_reduce(c.view(splits, batches * m, n), out.view(batches * m, n), x_scale, w_scale)
    return out


def _run_grouped(X, W, scale, zero, M_sizes, out, *, shuffled=True, table=False, x_scale=None, w_scale=None):
    """out [ΣM, N] bf16 of X [ΣM, K] and W [G, N, K/2] (preshuffled, or plain for bf16) with scales [G, Gk, N]
    (tables [G, Gk, 8, N]) and zeros; x_scale [ΣM] and w_scale [G, N] for the FP8 table format."""
    total, k = X.shape
    n = W.shape[1]
    if launch.no_products(out, k):
        return out
    if W.shape[0] == 0:  # no group: every row is past their (empty) sum
        return out.zero_()
    groups = scale.shape[-3] if table else scale.shape[-2]
    size = formats.int4_group_size(k, groups)
    # Groups of decode rows (at most MAX_M on average) take the Gluon decode kernel, which streams each nonempty
    # group's weights once (and an empty group's not at all) where the prefill kernels below dequantize each weight
    # for a 64- or 128-row tile: about 0.9 TB/s of weights at G = 128 x 4 rows (RESULTS.md, fifty-third session).
    decode = total <= int4_decode_hopper.MAX_M * W.shape[0]
    if decode and not table and int4_decode_hopper.supports(X, W, scale, zero, size, shuffled):
        return int4_decode_hopper.run(X, W, scale, zero, out, size, shuffled, sizes=M_sizes)
    # Plain bf16 weights take the Gluon kernel where it can: 1.2-1.6x the Triton kernel's speed from 8 to 2048 rows
    # a group, 1.04-1.4x at 4, on par at 1 (H200, N = 2048-4096, K = 5120-7168; RESULTS.md, fifty-third session).
    if not (shuffled or table) and int4_hopper.supports(X, W, size):
        return int4_hopper.run(X, W, scale, zero, out, size, sizes=M_sizes)
    # Tiles as _config's by the mean rows per group: 64 x 64 for decode-like groups, else 128 x 128.
    block_m = block_n = 64 if total <= 64 * W.shape[0] else 128
    tiles_upper_bound = (launch.cdiv(total, block_m) + W.shape[0] + 1) * launch.cdiv(n, block_n)
    programs = max(1, min(_programs(X.device), tiles_upper_bound))
    w = _weights_view(W, shuffled, table)
    x_desc, w_desc = _descriptors(X[None], w, block_m, block_n, shuffled)
    zero = scale if zero is None else zero  # the table format has none: any pointer, never read
    num_warps = 4 if block_m <= 64 else 8
    launch.fast(_int4_grouped_kernel)[(programs,)](
        X, w, x_desc, w_desc, scale, zero, out, M_sizes, x_scale, w_scale, W.shape[0], total, n, k, groups, X.stride(0),
        w.stride(0), w.stride(1), scale.stride(0), scale.stride(-3 if table else -2), out.stride(0),
        0 if w_scale is None else w_scale.stride(0), SHUFFLED=shuffled, TABLE=table, EVEN_K=k % K_STEP == 0,
        GROUP_SIZE=size, KSUB=_sub_block(size, shuffled), WGMMA_WAIT=not shuffled and _wgmma_wait(X.device, num_warps),
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, num_stages=4, **_device_flags(X),
    )  # fmt: skip
    return out


def _supports(k: int, groups: int) -> list[str]:
    size = formats.int4_group_size(k, groups)
    if k and size is not None and _sub_block(size, True) is None:  # (K = 0: no products, zeros without a kernel)
        return [f"group size {size}: the Triton kernel needs group sizes that are multiples of 16"]
    return []


# ------------------------------------------------------------------------------------------- test inputs


def random_int4(*shape: int, device="cpu") -> torch.Tensor:
    """Random packed int4 weights int8 [..., N, K/2] for shape [..., N, K]: every byte is two valid int4 values, in
    either layout (samples, tests and benches; mslk-gemm works without mslk.quantize)."""
    *lead, k = shape
    return torch.randint(-128, 128, (*lead, k // 2), dtype=torch.int8, device=device)


def random_group_scales(*shape: int, group_size: int, dtype=torch.bfloat16, device="cpu"):
    """Positive scales and random zeros [..., ⌈K/gs⌉, N] for weights of shape [..., N, K], such that the
    dequantized weights are about unit-sized."""
    *lead, n, k = shape
    rows = (*lead, launch.cdiv(k, group_size), n)
    scale = (torch.rand(rows, device=device) * 0.2 + 0.1).to(dtype)
    return scale, testing.randn(*rows, device=device, std=0.5).to(dtype)


def fp8_table(group_scale: torch.Tensor) -> torch.Tensor:
    """preshuffle_i4's table [..., G, 8, N] for float8_e4m3fn group scales [..., G, N]: e4m3(m · scale), m = 1..8."""
    magnitudes = torch.arange(1, formats.INT4_TABLE_ENTRIES + 1, dtype=torch.float32, device=group_scale.device)
    return (group_scale.float().unsqueeze(-2) * magnitudes[:, None]).to(torch.float8_e4m3fn)


def random_fp8_table(*shape: int, group_size: int, device="cpu") -> torch.Tensor:
    """A table [..., ⌈K/gs⌉, 8, N] of random e4m3 group scales for weights [..., N, K] (8 · scale <= 448)."""
    *lead, n, k = shape
    scale = (torch.rand(*lead, launch.cdiv(k, group_size), n, device=device) * 0.04 + 0.01).to(torch.float8_e4m3fn)
    return fp8_table(scale)


# -------------------------------------------------------------------------- bf16 activations (plain, preshuffled)


def _bf16_op(name: str, *, shuffled: bool, batched: bool, samples) -> registry.Op:
    """bf16i4bf16_{rowwise,shuffled}{,_batched}: one schema, validation and Triton backend per layout and form."""
    where = name
    dims = 3 if batched else None

    def validate(X, W, w_scale_group, w_zero_group):
        _check_bf16_x(where, X, dims)
        _check_weights(where, W, X.shape[-1], (X.shape[0],) if batched else (), shuffled)
        _check_group_scales(where, W, X.shape[-1], w_scale_group, w_zero_group)
        registry.check_devices(where, X=X, W=W, w_scale_group=w_scale_group, w_zero_group=w_zero_group)

    def reference(X, W, w_scale_group, w_zero_group):
        return _matmul_reference(X, dequantize_int4(W, w_scale_group, w_zero_group, shuffled=shuffled))

    def fake(X, W, w_scale_group, w_zero_group):
        return X.new_empty((*X.shape[:-1], W.shape[-2]))

    args = "Tensor X, Tensor WQ, Tensor w_scale, Tensor w_zp" if batched else (
        "Tensor X, Tensor W, Tensor w_scale_group, Tensor w_zero_group"
    )  # fmt: skip
    op = registry.Op(
        f"mslk::{name}({args}) -> Tensor",
        domain="gemm",
        reference=reference,
        fake=fake,
        samples=samples,
        validate=validate,
        tolerance=1e-2,
    )

    @op.backend(
        "triton",
        available=registry.triton_missing,
        supports=lambda X, W, scale, zero: _supports(X.shape[-1], scale.shape[-2]),
    )
    def _triton(X, W, w_scale_group, w_zero_group):
        if not batched:
            return _run_int4_rows(X, W, w_scale_group, w_zero_group, shuffled=shuffled)
        out = torch.empty((*X.shape[:-1], W.shape[-2]), dtype=torch.bfloat16, device=X.device)
        _run_int4(k_contiguous(X), W, w_scale_group.contiguous(), w_zero_group.contiguous(), out, shuffled=shuffled)
        return out

    return op


def _bf16_samples(shuffled: bool, batched: bool):
    def samples(device):
        cases = ((37, 40, 256, 64), (5, 24, 384, 128)) if shuffled else ((37, 40, 200, 32), (5, 24, 96, 32))
        for m, n, k, gs in cases:
            lead = (2,) if batched else ()
            x = testing.randn(*lead, m, k, dtype=torch.bfloat16, device=device)
            scale, zero = random_group_scales(*lead, n, k, group_size=gs, device=device)
            yield registry.Sample((x, random_int4(*lead, n, k, device=device), scale, zero))

    return samples


bf16i4bf16_rowwise_op = _bf16_op(
    "bf16i4bf16_rowwise", shuffled=False, batched=False, samples=_bf16_samples(False, False)
)
bf16i4bf16_rowwise_batched_op = _bf16_op(
    "bf16i4bf16_rowwise_batched", shuffled=False, batched=True, samples=_bf16_samples(False, True)
)
bf16i4bf16_shuffled_op = _bf16_op(
    "bf16i4bf16_shuffled", shuffled=True, batched=False, samples=_bf16_samples(True, False)
)
bf16i4bf16_shuffled_batched_op = _bf16_op(
    "bf16i4bf16_shuffled_batched", shuffled=True, batched=True, samples=_bf16_samples(True, True)
)


def bf16i4bf16_rowwise(X, W, w_scale_group, w_zero_group) -> torch.Tensor:
    """bf16 [..., M, N] = X · Wdqᵀ (spec G-24): X bf16 [..., M, K]; W int4 packed plain int8 [N, K/2]
    (pack_int4); scale and zero [⌈K/gs⌉, N] fp32/bf16/fp16 (int4_row_quantize_zp): Wdq = q · scale + zero."""
    return torch.ops.mslk.bf16i4bf16_rowwise(X, W, w_scale_group, w_zero_group)


def bf16i4bf16_rowwise_batched(X, WQ, w_scale, w_zp) -> torch.Tensor:
    """Batched bf16i4bf16_rowwise (spec G-25): X [B, M, K], WQ [B, N, K/2], scales and zeros [B, ⌈K/gs⌉, N]."""
    return torch.ops.mslk.bf16i4bf16_rowwise_batched(X, WQ, w_scale, w_zp)


def bf16i4bf16_shuffled(X, W, w_scale_group, w_zero_group) -> torch.Tensor:
    """bf16i4bf16_rowwise with preshuffled weights (spec G-26): quantize_int4_preshuffle(w, gs, "bf16") gives
    (W, (scale, zero)); K % 128 == 0."""
    return torch.ops.mslk.bf16i4bf16_shuffled(X, W, w_scale_group, w_zero_group)


def bf16i4bf16_shuffled_batched(X, WQ, w_scale, w_zp) -> torch.Tensor:
    """Batched bf16i4bf16_shuffled (spec G-27): X [B, M, K], WQ [B, N, K/2], scales and zeros [B, K/gs, N]."""
    return torch.ops.mslk.bf16i4bf16_shuffled_batched(X, WQ, w_scale, w_zp)


def matmul_bf16i4_rowwise(X, W, w_scale_group, w_zero_group) -> torch.Tensor:
    """The reference library's Triton entry (spec G-56): bf16i4bf16_rowwise."""
    return bf16i4bf16_rowwise(X, W, w_scale_group, w_zero_group)


def matmul_bf16i4_rowwise_batched(X, W, w_scale, w_zp) -> torch.Tensor:
    """The reference library's Triton entry (spec G-56): bf16i4bf16_rowwise_batched."""
    return bf16i4bf16_rowwise_batched(X, W, w_scale, w_zp)


# ------------------------------------------------------------------------------------------------ grouped bf16


def _bf16_grouped_op(name: str, *, shuffled: bool) -> registry.Op:
    """bf16i4bf16_{rowwise,shuffled}_grouped: one schema, validation and Triton backend per layout."""

    def validate(X, WQ, w_scale_group, w_zero_group, M_sizes):
        _check_bf16_x(name, X, 2)
        if WQ.dim() != 3:
            raise ValueError(f"{name}: WQ must be int8 packed int4 [G, N, K/2], got {tuple(WQ.shape)} {WQ.dtype}")
        _check_weights(name, WQ, X.shape[-1], (WQ.shape[0],), shuffled)
        _check_group_scales(name, WQ, X.shape[-1], w_scale_group, w_zero_group)
        _check_m_sizes(name, M_sizes, WQ.shape[0])
        registry.check_devices(
            name, X=X, WQ=WQ, w_scale_group=w_scale_group, w_zero_group=w_zero_group, M_sizes=M_sizes
        )

    def samples(device):
        cases = [(37, [10, 0, 27], 40, 256, 128), (5, [1, 1, 3, 0], 24, 128, 32)]
        if not shuffled:  # K past whole steps of 128
            cases.append((9, [4, 5], 24, 200, 32))
        for total, sizes, n, k, gs in cases:
            x = testing.randn(total, k, dtype=torch.bfloat16, device=device)
            scale, zero = random_group_scales(len(sizes), n, k, group_size=gs, device=device)
            m_sizes = torch.tensor(sizes, dtype=torch.int64, device=device)
            yield registry.Sample((x, random_int4(len(sizes), n, k, device=device), scale, zero, m_sizes))

    op = registry.Op(
        f"mslk::{name}(Tensor X, Tensor WQ, Tensor w_scale_group, Tensor w_zero_group, Tensor M_sizes) -> Tensor",
        domain="gemm",
        reference=lambda X, WQ, scale, zero, M_sizes: _grouped_reference(
            X, dequantize_int4(WQ, scale, zero, shuffled=shuffled), M_sizes
        ),
        fake=lambda X, WQ, *args: X.new_empty((X.shape[0], WQ.shape[1])),
        samples=samples,
        validate=validate,
        tolerance=1e-2,
    )

    @op.backend(
        "triton",
        available=registry.triton_missing,
        supports=lambda X, WQ, scale, zero, M_sizes: _supports(X.shape[-1], scale.shape[-2]),
    )
    def _triton(X, WQ, w_scale_group, w_zero_group, M_sizes):
        out = torch.empty((X.shape[0], WQ.shape[1]), dtype=torch.bfloat16, device=X.device)
        scale, zero = w_scale_group.contiguous(), w_zero_group.contiguous()
        return _run_grouped(k_contiguous(X), WQ, scale, zero, M_sizes.contiguous(), out, shuffled=shuffled)

    return op


bf16i4bf16_shuffled_grouped_op = _bf16_grouped_op("bf16i4bf16_shuffled_grouped", shuffled=True)
bf16i4bf16_rowwise_grouped_op = _bf16_grouped_op("bf16i4bf16_rowwise_grouped", shuffled=False)


def bf16i4bf16_shuffled_grouped(X, WQ, w_scale_group, w_zero_group, M_sizes) -> torch.Tensor:
    """Grouped bf16i4bf16_shuffled (spec G-28): X [ΣM, K] bf16 stacked by group (M_sizes [G] int32/int64 rows
    each), WQ [G, N, K/2] preshuffled, scales and zeros [G, K/gs, N] -> bf16 [ΣM, N]; rows past ΣM_sizes are
    zero. The zeros are applied (the reference library's CUDA kernel ignores them; they are 0 with use_zp=False)."""
    return torch.ops.mslk.bf16i4bf16_shuffled_grouped(X, WQ, w_scale_group, w_zero_group, M_sizes)


def bf16i4bf16_rowwise_grouped(X, WQ, w_scale_group, w_zero_group, M_sizes) -> torch.Tensor:
    """bf16i4bf16_shuffled_grouped over plain weights (pack_int4, any even K): the grouped form of
    bf16i4bf16_rowwise, MSLK's op under the reference library's grouped Triton entries (spec G-56,
    int4_grouped_gemm.py and int4_grouped_gemm_fused.py), whose layout is the plain one."""
    return torch.ops.mslk.bf16i4bf16_rowwise_grouped(X, WQ, w_scale_group, w_zero_group, M_sizes)


# ------------------------------------------------------------------------------------------- FP8 activations


def _check_fp8_x(where: str, XQ, x_scale) -> None:
    formats.check_fp8_data(XQ, role=f"{where}: XQ", producer="quantize_fp8_row")
    if XQ.dim() < 2:
        raise ValueError(f"{where}: XQ must be [..., M, K], got {tuple(XQ.shape)}")
    if x_scale.dtype != torch.float32:
        raise formats.ScaleFormatError(f"{where}: x_scale must be float32 (quantize_fp8_row's), got {x_scale.dtype}")
    formats.Rowwise().check(XQ, x_scale, role=f"{where}: x_scale")


def _validate_f8_rowwise(XQ, WQ, x_scale, w_scale, w_zp):
    where = "f8i4bf16_rowwise"
    _check_fp8_x(where, XQ, x_scale)
    _check_weights(where, WQ, XQ.shape[-1], (), False)
    _check_group_scales(where, WQ, XQ.shape[-1], w_scale, w_zp)
    registry.check_devices(where, XQ=XQ, WQ=WQ, x_scale=x_scale, w_scale=w_scale, w_zp=w_zp)


def _f8_rowwise_samples(device):
    for m, n, k, gs in ((37, 40, 200, 32), (5, 24, 256, 128)):
        xq, x_scale = quantize_rows(testing.randn(m, k, device=device))
        scale, zero = random_group_scales(n, k, group_size=gs, dtype=torch.float32, device=device)
        yield registry.Sample((xq, random_int4(n, k, device=device), x_scale, scale, zero))


f8i4bf16_rowwise_op = registry.Op(
    "mslk::f8i4bf16_rowwise(Tensor XQ, Tensor WQ, Tensor x_scale, Tensor w_scale, Tensor w_zp) -> Tensor",
    domain="gemm",
    reference=lambda XQ, WQ, x_scale, w_scale, w_zp: _matmul_reference(
        XQ, dequantize_int4(WQ, w_scale, w_zp, shuffled=False), x_scale
    ),
    fake=lambda XQ, WQ, *args: XQ.new_empty((*XQ.shape[:-1], WQ.shape[0]), dtype=torch.bfloat16),
    samples=_f8_rowwise_samples,
    validate=_validate_f8_rowwise,
    tolerance=1e-2,
)


@f8i4bf16_rowwise_op.backend(
    "triton",
    available=registry.triton_missing,
    supports=lambda XQ, WQ, x_scale, w_scale, w_zp: _supports(XQ.shape[-1], w_scale.shape[-2]),
    requires=arch.fp8_e4m3_missing,
)
def _f8_rowwise_triton(XQ, WQ, x_scale, w_scale, w_zp):
    return _run_int4_rows(XQ, WQ, w_scale, w_zp, shuffled=False, x_scale=x_scale.reshape(-1).contiguous())


def f8i4bf16_rowwise(XQ, WQ, x_scale, w_scale, w_zp) -> torch.Tensor:
    """bf16 (XQ · Wdqᵀ) · x_scale[m] (spec G-29): XQ FP8 [..., M, K] with rowwise fp32 x_scale (quantize_fp8_row),
    WQ plain packed int4 [N, K/2], w_scale and w_zp [⌈K/gs⌉, N] (one dtype of fp32/bf16/fp16)."""
    return torch.ops.mslk.f8i4bf16_rowwise(XQ, WQ, x_scale, w_scale, w_zp)


def _validate_f8_shuffled(XQ, WQ, x_scale, w_scale, w_scale_group):
    where = "f8i4bf16_shuffled"
    _check_fp8_x(where, XQ, x_scale)
    _check_weights(where, WQ, XQ.shape[-1], (), True)
    _check_group_scales(where, WQ, XQ.shape[-1], w_scale_group, table=True)
    if w_scale.dtype != torch.float32:
        raise formats.ScaleFormatError(
            f"{where}: w_scale (the weights' row scales) must be float32, got {w_scale.dtype}"
        )
    formats.Rowwise().check(WQ, w_scale, role=f"{where}: w_scale")
    registry.check_devices(where, XQ=XQ, WQ=WQ, x_scale=x_scale, w_scale=w_scale, w_scale_group=w_scale_group)


def _f8_shuffled_samples(device):
    for m, n, k, gs in ((37, 40, 256, 64), (5, 24, 384, 128)):
        xq, x_scale = quantize_rows(testing.randn(m, k, device=device))
        w_scale = torch.rand(n, device=device) + 0.5
        table = random_fp8_table(n, k, group_size=gs, device=device)
        yield registry.Sample((xq, random_int4(n, k, device=device), x_scale, w_scale, table))


f8i4bf16_shuffled_op = registry.Op(
    "mslk::f8i4bf16_shuffled(Tensor XQ, Tensor WQ, Tensor x_scale, Tensor w_scale, Tensor w_scale_group) -> Tensor",
    domain="gemm",
    reference=lambda XQ, WQ, x_scale, w_scale, table: _matmul_reference(
        XQ, dequantize_int4_table(WQ, table), x_scale, w_scale
    ),
    fake=lambda XQ, WQ, *args: XQ.new_empty((*XQ.shape[:-1], WQ.shape[0]), dtype=torch.bfloat16),
    samples=_f8_shuffled_samples,
    validate=_validate_f8_shuffled,
    tolerance=1e-2,
)


@f8i4bf16_shuffled_op.backend(
    "triton",
    available=registry.triton_missing,
    supports=lambda XQ, WQ, x_scale, w_scale, table: _supports(XQ.shape[-1], table.shape[-3]),
    requires=arch.fp8_e4m3_missing,
)
def _f8_shuffled_triton(XQ, WQ, x_scale, w_scale, w_scale_group):
    return _run_int4_rows(
        XQ, WQ, w_scale_group, None, shuffled=True, table=True, x_scale=x_scale.reshape(-1).contiguous(),
        w_scale=w_scale.reshape(-1).contiguous(),
    )  # fmt: skip


def f8i4bf16_shuffled(XQ, WQ, x_scale, w_scale, w_scale_group) -> torch.Tensor:
    """bf16 (XQ · (q · group_scale)ᵀ) · x_scale[m] · w_scale[n] (spec G-30): XQ FP8 [..., M, K] with rowwise fp32
    x_scale; quantize_int4_preshuffle(w, gs, "fp8") gives WQ [N, K/2] preshuffled and (w_scale_group, the FP8
    tables [K/gs, 8, N], w_scale, the fp32 row scales [N]); q · group_scale is the table's entry for |q|."""
    return torch.ops.mslk.f8i4bf16_shuffled(XQ, WQ, x_scale, w_scale, w_scale_group)


def _validate_f8_grouped(XQ, WQ, x_scale, w_scale, w_scale_group, M_sizes):
    where = "f8i4bf16_shuffled_grouped"
    _check_fp8_x(where, XQ, x_scale)
    if XQ.dim() != 2 or WQ.dim() != 3:
        raise ValueError(f"{where}: expected XQ [ΣM, K] and WQ [G, N, K/2], got {tuple(XQ.shape)}, {tuple(WQ.shape)}")
    _check_weights(where, WQ, XQ.shape[-1], (WQ.shape[0],), True)
    _check_group_scales(where, WQ, XQ.shape[-1], w_scale_group, table=True)
    if w_scale.dtype != torch.float32:
        raise formats.ScaleFormatError(
            f"{where}: w_scale (the weights' row scales) must be float32, got {w_scale.dtype}"
        )
    formats.Rowwise().check(WQ, w_scale, role=f"{where}: w_scale")
    _check_m_sizes(where, M_sizes, WQ.shape[0])
    registry.check_devices(
        where, XQ=XQ, WQ=WQ, x_scale=x_scale, w_scale=w_scale, w_scale_group=w_scale_group, M_sizes=M_sizes
    )


def _f8_grouped_samples(device):
    for total, sizes, n, k, gs in ((37, [10, 0, 27], 40, 256, 128), (5, [1, 1, 3, 0], 24, 128, 32)):
        xq, x_scale = quantize_rows(testing.randn(total, k, device=device))
        w_scale = torch.rand(len(sizes), n, device=device) + 0.5
        table = random_fp8_table(len(sizes), n, k, group_size=gs, device=device)
        m_sizes = torch.tensor(sizes, dtype=torch.int64, device=device)
        yield registry.Sample((xq, random_int4(len(sizes), n, k, device=device), x_scale, w_scale, table, m_sizes))


f8i4bf16_shuffled_grouped_op = registry.Op(
    "mslk::f8i4bf16_shuffled_grouped(Tensor XQ, Tensor WQ, Tensor x_scale, Tensor w_scale, Tensor w_scale_group, "
    "Tensor M_sizes) -> Tensor",
    domain="gemm",
    reference=lambda XQ, WQ, x_scale, w_scale, table, M_sizes: _grouped_reference(
        XQ, dequantize_int4_table(WQ, table), M_sizes, x_scale, w_scale
    ),
    fake=lambda XQ, WQ, *args: XQ.new_empty((XQ.shape[0], WQ.shape[1]), dtype=torch.bfloat16),
    samples=_f8_grouped_samples,
    validate=_validate_f8_grouped,
    tolerance=1e-2,
)


@f8i4bf16_shuffled_grouped_op.backend(
    "triton",
    available=registry.triton_missing,
    supports=lambda XQ, WQ, x_scale, w_scale, table, M_sizes: _supports(XQ.shape[-1], table.shape[-3]),
    requires=arch.fp8_e4m3_missing,
)
def _f8_grouped_triton(XQ, WQ, x_scale, w_scale, w_scale_group, M_sizes):
    out = torch.empty((XQ.shape[0], WQ.shape[1]), dtype=torch.bfloat16, device=XQ.device)
    return _run_grouped(
        k_contiguous(XQ), WQ, w_scale_group.contiguous(), None, M_sizes.contiguous(), out, table=True,
        x_scale=x_scale.reshape(-1).contiguous(), w_scale=w_scale.reshape(WQ.shape[:2]).contiguous(),
    )  # fmt: skip


def f8i4bf16_shuffled_grouped(XQ, WQ, x_scale, w_scale, w_scale_group, M_sizes) -> torch.Tensor:
    """Grouped f8i4bf16_shuffled (spec G-31): XQ [ΣM, K] FP8 stacked by group (M_sizes [G] rows each), x_scale
    [ΣM], WQ [G, N, K/2] preshuffled, w_scale [G, N] fp32, w_scale_group [G, K/gs, 8, N] -> bf16 [ΣM, N]; rows past
    ΣM_sizes are zero."""
    return torch.ops.mslk.f8i4bf16_shuffled_grouped(XQ, WQ, x_scale, w_scale, w_scale_group, M_sizes)
