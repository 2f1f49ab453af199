"""Grouped GEMMs for MoE (spec §5: G-06, G-12, G-13, G-14, G-17, G-53..G-55, G-58; metadata §7.6): one
persistent Triton kernel for every grouped form (on sm_90, large rowwise FP8 stacked products run
grouped_gemm_hopper's warp-specialized Gluon kernel instead).

    out[rows of group g] = X[rows of group g] · W[g]ᵀ                                   (bf16 / fp16)
    out[rows of group g] = (XQ · WQ[g]ᵀ) · x_scale[row] · w_scale[g, col]               (FP8 rowwise)
    out[rows of group g] = Σ_kb (XQ · WQ[g]ᵀ)_kb · x_scale(row, kb) · w_scale(g, kb, col)  (FP8 groupwise, 128 of K)
    dW[g] = dY[rows of g]ᵀ · X[rows of g]                                               (wgrad: K grouped)

Stacked inputs hold the groups' rows back to back: X [ΣM, K] with M_sizes [G] rows each (or int32 cumulative
ends, torch._grouped_mm's offsets), W [G, N, K] with any strides (K-contiguous for the forward, N-contiguous
for dgrad). The programs (one per SM) walk the groups in order and take every P-th output tile of the
concatenated tile list, reading the sizes on the device: no host sync (CUDA graphs record it), no launch per
group, and empty groups or groups smaller than a tile cost nothing but their scalar load. Constexpr modes of
the same kernel cover the other layouts: padded groups ([G, M, K] with a valid row count per group), and
K-grouped products whose reduction runs over each group's rows (wgrad, 2D x 2D grouped_mm), where empty
groups give zero. The epilogue applies rowwise scales, a per-group bias and per-token weights, and either
stores the tile or atomically adds its rows into `output[indices[row]]` (the MoE scatter-add).

Sizes are never read on the host, so they are not checked there; the kernel clamps them instead: negative
sizes count as 0, a group ends at the last row of X at the latest, and with offsets each group ends at
max(offsets[g], its start), so non-monotone offsets give empty groups. Rows past the groups' sum come out zero.

This module holds the kernel and the MoE path (stacked forward, dgrad, wgrad, groupwise, the Triton entry
points with the fused scatter-add); grouped_gemm_forms.py the other layouts of the family (the deprecated list
and padded forms, torch._grouped_mm's offsets forms).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from mslk.core import arch, formats, launch, registry, testing
from mslk.gemm.triton import grouped_gemm_hopper
from mslk.gemm.triton.fp8_blockwise_gemm import GROUP_K, _block_scaled_reference, quantize_blocks
from mslk.gemm.triton.fp8_gemm import k_contiguous, load_k_step, quantize_rows, tile_coordinates, tma_descriptors

# Modes of the kernel (constexpr objects: Triton kernels read no other globals).
# How the groups lie (GROUPING):
STACKED = tl.constexpr(0)  # rows of A back to back, group g's rows times B[g]
PADDED = tl.constexpr(1)  # group g owns rows [g·ROWS, (g+1)·ROWS) of A, the first sizes[g] of them valid
K_GROUPED = tl.constexpr(2)  # the reduction runs over group g's slice of A's and B's columns; out[g]
# Scales (SCALES):
NO_SCALES = tl.constexpr(0)
ROWWISE = tl.constexpr(1)  # a_scale per row of A, b_scale per (group, row of B), applied in the epilogue
GROUPWISE = tl.constexpr(2)  # per (row, 128 of K) for A, per (group, 128 of K, 128 of N) for B, in the K loop
_GROUP_K = tl.constexpr(GROUP_K)  # the groupwise recipe's K granularity


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, b_ptr, a_desc, b_desc, out_ptr, sizes_ptr, a_scale_ptr, b_scale_ptr, bias_ptr, token_weights_ptr,
    scatter_ptr,
    G, ROWS, RED, N, OUT_ROWS,
    stride_am, stride_ak, stride_bg, stride_bn, stride_bk, stride_og, stride_om, stride_on,
    stride_asg, stride_bsg, stride_bsk,
    GROUPING: tl.constexpr, SIZES_ARE_ENDS: tl.constexpr, SCALES: tl.constexpr, ZERO_FILL: tl.constexpr,
    ACCUMULATE: tl.constexpr, FAST_ACCUM: tl.constexpr, MN_MAJOR: tl.constexpr, EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """out[g][i, j] = Σ_r A[i, r] · B[g][j, r] over the rows i and reduction r of group g (see GROUPING):
    A [·, RED] and B [G or 1, N, RED] with any strides, sizes [G] counts (or cumulative ends, or None: every
    padded group full). ROWS: A's rows (STACKED), rows per group (PADDED) or out[g]'s rows (K_GROUPED); RED:
    K, or the total of the grouped reduction (K_GROUPED). Optional (None) epilogue inputs: bias [G, N],
    token_weights and scatter indices per row of A (scatter: rows i add into out[indices[i]], skipped unless
    0 <= indices[i] < OUT_ROWS). ZERO_FILL: write zeros for the rows past the groups (STACKED) or past each
    group's valid rows (PADDED); ACCUMULATE: add into out (atomically) instead of storing; MN_MAJOR: an operand
    is contiguous along rows/cols rather than K. a_desc / b_desc (or None): TMA descriptors of A [·, RED] and of
    B as [G·N, RED], which then replace the pointer loads (K-major STACKED and PADDED only)."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    first = 0  # STACKED: the group's first row of A and out; K_GROUPED: its first reduction index
    first_tile = 0  # of the current group in the concatenated tile list
    groups = G
    if GROUPING == STACKED and ZERO_FILL:
        groups = G + 1  # the groups, then the rows past their sum (zeros)
    for g in range(groups):
        gw = tl.minimum(g, G - 1)  # the group whose weights and scales are read (any, in bounds, for the tail)
        if GROUPING == STACKED:
            limit = ROWS - first
        elif GROUPING == PADDED:
            limit = ROWS
        else:
            limit = RED - first
        if sizes_ptr is None:
            size = limit
        else:
            size = tl.load(sizes_ptr + gw)  # int64 sizes stay int64 until clamped: one past 2^31 holds the rest
            if SIZES_ARE_ENDS:
                size -= first
        # Clamped, so that sizes summing past the rows never read outside them; the tail has no valid rows.
        size = tl.where(g < G, tl.minimum(tl.maximum(size, 0), limit), 0).to(tl.int32)
        if GROUPING == STACKED:
            row0, m_valid, m_out, red0, red_len = first, size, tl.where(g < G, size, limit), 0, RED
            first += m_out
        elif GROUPING == PADDED:
            row0, m_valid, m_out, red0, red_len = g * ROWS, size, size, 0, RED
            if ZERO_FILL:
                m_out = ROWS
        else:
            row0, m_valid, m_out, red0, red_len = 0, ROWS, ROWS, first, size
            first += size
        tiles = tl.cdiv(m_out, BLOCK_M) * tiles_n
        # This program's first tile of the group: the next index >= first_tile that is pid modulo P.
        tile = (pid - first_tile % programs + programs) % programs
        while tile < tiles:
            pid_m, pid_n = tile_coordinates(tile, m_out, N, BLOCK_M, BLOCK_N, GROUP_M)
            rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # of the group
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            # Rows/cols out of range read rows in range; their results are never stored. For operands contiguous
            # along rows/cols (MN_MAJOR: dgrad's W, wgrad's dY and X) modulo rather than a select, which keeps the
            # indices provably contiguous (when N or ROWS % 16 == 0), so that they still load in vectors.
            if GROUPING == K_GROUPED and MN_MAJOR:
                a_rows = rows % ROWS  # [BLOCK_M] rows of A
            else:
                a_rows = row0 + tl.where(rows < m_valid, rows, 0)
            if MN_MAJOR:
                safe_cols = cols % N
            else:
                safe_cols = tl.where(cols < N, cols, 0)
            if GROUPING == K_GROUPED:  # a slice of rows of memory: offsets past int32
                reds = (red0 + ks).to(tl.int64)
            else:
                reds = ks
            a_ptrs = a_ptr + a_rows.to(tl.int64)[:, None] * stride_am + reds[None, :] * stride_ak
            b_ptrs = b_ptr + tl.cast(gw, tl.int64) * stride_bg + safe_cols.to(tl.int64)[:, None] * stride_bn
            b_ptrs += reds[None, :] * stride_bk
            if SCALES == GROUPWISE:  # x_scale: group g's [K/128, m] block (M-major) at row0 · K/128 of [ΣM, K/128]
                a_scale_ptrs = a_scale_ptr + row0 * tl.cdiv(RED, _GROUP_K) + (a_rows - row0)  # [BLOCK_M]
                b_scale_ptrs = b_scale_ptr + gw * stride_bsg + safe_cols // _GROUP_K  # [BLOCK_N]
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            k_steps = tl.cdiv(red_len, BLOCK_K) * (pid_m * BLOCK_M < m_valid)
            for k in range(k_steps):
                if a_desc is not None:  # rows/cols past the group read the next group's (never stored) or zeros
                    a = a_desc.load([row0 + pid_m * BLOCK_M, k * BLOCK_K])
                    b = b_desc.load([gw * N + pid_n * BLOCK_N, k * BLOCK_K])
                else:
                    a, b = load_k_step(a_ptrs, b_ptrs, ks, red_len - k * BLOCK_K, EVEN_K)
                if UPCAST:  # the Triton interpreter multiplies bf16 operands as raw integers
                    a, b = a.to(tl.float32), b.to(tl.float32)
                if SCALES == GROUPWISE:  # the scales change along K: each step's product is scaled
                    kb = (k * BLOCK_K) // _GROUP_K
                    a_scale = tl.load(a_scale_ptrs + kb * m_valid)
                    b_scale = tl.load(b_scale_ptrs + kb * stride_bsk)
                    acc += tl.dot(a, b.T) * a_scale[:, None] * b_scale[None, :]
                elif FAST_ACCUM:
                    acc = tl.dot(a, b.T, acc)
                else:  # each block's product is added in fp32 (the tensor cores' FP8 accumulation is narrower)
                    acc += tl.dot(a, b.T)
                a_ptrs += BLOCK_K * stride_ak
                b_ptrs += BLOCK_K * stride_bk
            if SCALES == ROWWISE:
                acc *= tl.load(a_scale_ptr + gw * stride_asg + a_rows)[:, None]
                acc *= tl.load(b_scale_ptr + gw * stride_bsg + safe_cols)[None, :]
            if bias_ptr is not None:
                acc += tl.load(bias_ptr + gw * N + safe_cols).to(tl.float32)[None, :]
            if token_weights_ptr is not None:
                acc *= tl.load(token_weights_ptr + a_rows).to(tl.float32)[:, None]
            acc = tl.where((rows < m_valid)[:, None], acc, 0.0)  # padding and tail rows: zeros, never NaN
            mask = (rows < m_out)[:, None] & (cols < N)[None, :]
            if scatter_ptr is not None:  # row i adds into out[indices[i]]; indices outside out are skipped
                out_rows = tl.load(scatter_ptr + a_rows).to(tl.int64)
                mask &= ((out_rows >= 0) & (out_rows < OUT_ROWS))[:, None]
                out_ptrs = out_ptr + out_rows[:, None] * stride_om + cols.to(tl.int64)[None, :] * stride_on
            else:
                row_offsets = tl.cast(gw, tl.int64) * stride_og + (row0 + rows).to(tl.int64) * stride_om
                out_ptrs = out_ptr + row_offsets[:, None] + cols.to(tl.int64)[None, :] * stride_on
            if ACCUMULATE:  # atomics: the scatter's rows may repeat; a plain tile's add needs no load into registers
                tl.atomic_add(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask, sem="relaxed")
            else:
                tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
            tile += programs
        first_tile += tiles


@functools.cache
def _grouped_config(fp8: bool, small_groups: bool = False) -> dict:
    # 128-byte-deep K steps, TMA loads. H200, bf16: 128 x 256 tiles on 3 stages for G=8 x 2048 rows, N=4096,
    # K=7168 (665 TFLOP/s; 128 x 128 on 4 stages: 556; 128 x 256 on 4 stages: 1.3% slower); groups of 256 rows
    # or fewer on average, each weight read once: 128 x 256 on 4 stages (G=64 x 128 rows, N=2048: 459 /
    # 439 TFLOP/s on two machines against 452 / 436 for 128 x 128 on 5 stages; G=128 x 64: 240 / 221 against 219 /
    # 218; RESULTS.md, thirty-second session). There the weights' stream is the bound: W read alone in this kernel's
    # tile order into a light product takes 445-461 us against the kernel's 522-552 at G=64 x 128 (ncu: 2.06 GB from
    # DRAM, 2.03 the least; L2 92% busy, as for a plain reduction over W), X's re-reads from L2 add 34 us, 128-row
    # products 23, the output tiles 19 (forty-second session). Only TMA multicast across a cluster would share X's
    # re-reads (not in Triton 3.6's Gluon; thirty-third session). No faster: L2 prefetches of W ahead of the ring,
    # 32-deep K steps on 7-8 stages, grouped_gemm_hopper's warp-specialized kernel on bf16 (4 stages, stores from the
    # wgmma layout). FP8: 128 x 128 tiles on 4 stages. A group's tiles go in bands of 16 rows of tiles, column by
    # column, so that the programs running at once share both operands' tiles in L2 (G=8 x 2048: 700.5 TFLOP/s
    # against 671.9 row by row; bands of 4 / 8: 698.1 / 695.4).
    tiles = {"GROUP_M": 16, "num_warps": 8, "BLOCK_M": 128}
    if fp8:
        return {"BLOCK_N": 128, "BLOCK_K": 128, "num_stages": 4, **tiles}
    return {"BLOCK_N": 256, "BLOCK_K": 64, "num_stages": 4 if small_groups else 3, **tiles}


def _run_grouped(
    a, b, out, sizes, *, grouping=STACKED, ends=False, rows=None, a_scale=None, b_scale=None, scales=NO_SCALES,
    bias=None, token_weights=None, scatter=None, zero_fill=True, accumulate=False, fast_accum=True, num_sms=None,
):  # fmt: skip
    """Launch the grouped kernel (modes and math: see `_grouped_gemm_kernel`; grouped_gemm_hopper's for the stacked
    rowwise FP8 products it serves from MIN_MACS multiply-adds) and return `out`.

    a [R, RED] and b [G, N, RED] (or [N, RED], shared by the groups: K_GROUPED) with any strides; out [R, N]
    (STACKED, PADDED; a scatter target [T, N]) or [G, R, N] (K_GROUPED), any strides; sizes [G] int32/int64
    counts, cumulative ends (`ends`), or None (every PADDED group full), any stride; `rows`: rows per PADDED
    group. Scales, contiguous fp32: rowwise a_scale per row of a ([G, R] when K_GROUPED), b_scale [G, N];
    groupwise a_scale [R, RED/128] in per-group M-major blocks, b_scale [G, RED/128, ⌈N/128⌉]. bias [G, N],
    token_weights [R], scatter [R] indices into out's rows, all contiguous."""
    groups = sizes.shape[0] if sizes is not None else b.shape[0]
    sizes = None if sizes is None else sizes.contiguous()  # the kernel reads them one after the other
    n = b.shape[-2]
    if out.numel() == 0:
        return out
    if groups == 0:  # no group: only the zeros of the rows past their (empty) sum
        return out.zero_() if zero_fill else out
    cfg = _grouped_config(a.element_size() == 1, grouping == STACKED and a.shape[0] <= 256 * groups)
    if scales == GROUPWISE:  # no K step may straddle two scales
        cfg = {**cfg, "BLOCK_K": min(cfg["BLOCK_K"], GROUP_K)}
    if scatter is not None and torch.version.hip is not None:
        # The scatter's atomic adds take the fp32 tile through shared memory on ROCm: 128 x 256 asked 128 KiB of
        # MI300X's 64 (tools/other_gpus.py gfx942).
        cfg = {**cfg, "BLOCK_N": 64}
    if grouping == STACKED:
        rows, row_tiles = a.shape[0], launch.cdiv(a.shape[0], cfg["BLOCK_M"]) + groups + 1  # the tail included
    else:
        rows = a.shape[0] if grouping == K_GROUPED else rows
        row_tiles = groups * launch.cdiv(rows, cfg["BLOCK_M"])
    programs = num_sms or (arch.sm_count(a.device) if a.is_cuda else 4)
    programs = max(1, min(programs, row_tiles * launch.cdiv(n, cfg["BLOCK_N"])))
    if (
        grouping == STACKED and sizes is not None and scales == ROWWISE and fast_accum and bias is None
        and token_weights is None and scatter is None and not accumulate and grouped_gemm_hopper.supports(a, b, out)
        and a.shape[0] * n * a.shape[1] >= grouped_gemm_hopper.MIN_MACS
    ):  # fmt: skip
        return grouped_gemm_hopper.run(a, b, out, sizes, a_scale, b_scale, ends=ends, zero_fill=zero_fill,
                                       programs=num_sms)  # fmt: skip
    b_strides = b.stride() if b.dim() == 3 else (0, *b.stride())
    out_strides = out.stride() if out.dim() == 3 else (0, *out.stride())
    b_scale_strides = b_scale.stride()[:2] if scales == GROUPWISE else (n, 0)
    even_k = grouping != K_GROUPED and a.shape[1] % cfg["BLOCK_K"] == 0
    a_desc, b_desc = _descriptors(a, b, grouping, cfg)
    launch.fast(_grouped_gemm_kernel)[(programs,)](
        a, b, a_desc, b_desc, out, sizes, a_scale, b_scale, bias, token_weights, scatter, groups, rows, a.shape[1], n,
        out.shape[-2], *a.stride(), *b_strides, *out_strides, a.shape[0] if grouping == K_GROUPED else 0,
        *b_scale_strides, GROUPING=grouping.value, SIZES_ARE_ENDS=ends, SCALES=scales.value, ZERO_FILL=zero_fill,
        ACCUMULATE=accumulate, FAST_ACCUM=fast_accum, MN_MAJOR=a.stride(1) != 1 or b.stride(-1) != 1,
        EVEN_K=even_k, UPCAST=a.dtype == torch.bfloat16 and not a.is_cuda, **cfg,
    )  # fmt: skip
    return out


def _descriptors(a: torch.Tensor, b: torch.Tensor, grouping, cfg: dict) -> tuple:
    """TMA descriptors of a [R, K] and of b [G, N, K] as [G·N, K] (K-major STACKED and PADDED operands), else Nones.
    H200, bf16 G=8 x 2048 rows, N=4096, K=7168: 665 TFLOP/s against 572 with pointer loads."""
    if grouping == K_GROUPED or b.dim() != 3 or b.stride(0) != b.shape[1] * b.stride(1) or a.shape[1] == 0:
        return None, None
    return tma_descriptors(a, b.view(-1, b.shape[2]), cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"])


def _per_group(scale: torch.Tensor, groups: int) -> torch.Tensor:
    """A scale of G equal parts ([G, N], flat or not) as [G, N]; also for G = 0, where reshape(0, -1) fails."""
    return scale.reshape(groups, scale.numel() // max(groups, 1))


def _weights(w: torch.Tensor) -> torch.Tensor:
    """w [.., N, K] as the kernel takes it: 16-bit weights contiguous along K or along N (dgrad's permuted
    weights; the kernel loads both in vectors), FP8 ones along K (FP8 MMAs take K-major operands only); else a
    K-contiguous copy."""
    unit_strides = (w.stride(-1),) if w.element_size() == 1 else (w.stride(-1), w.stride(-2))
    return w if 1 in unit_strides else w.contiguous()


# ------------------------------------------------------------------------------------------- validation

_INDEX_DTYPES = (torch.int32, torch.int64)


def _check_sizes(where: str, sizes, groups: int, name: str = "M_sizes") -> None:
    if sizes.dim() != 1 or sizes.dtype not in _INDEX_DTYPES or sizes.shape[0] != groups:
        raise ValueError(
            f"{where}: {name} must be int32/int64 [G] = [{groups}], got {tuple(sizes.shape)} {sizes.dtype}"
        )


def _check_16bit(where: str, X, W) -> None:
    if X.dtype not in (torch.bfloat16, torch.float16) or W.dtype != X.dtype:
        raise ValueError(f"{where}: X and W must both be bfloat16 or float16, got {X.dtype} and {W.dtype}")


def _check_fp8(where: str, XQ, WQ, producer: str = "quantize_fp8_row") -> None:
    formats.check_fp8_data(XQ, role=f"{where}: XQ", producer=producer)
    formats.check_fp8_data(WQ, role=f"{where}: WQ", producer=producer)


def _check_num_sms(where: str, num_sms) -> None:
    if num_sms is not None and num_sms < 1:
        raise ValueError(f"{where}: num_sms must be positive, got {num_sms}")


def _check_stacked(where: str, x, w, m_sizes) -> None:
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[2]:
        raise ValueError(
            f"{where}: expected X [ΣM, K] and W [G, N, K] with the same K, got {tuple(x.shape)} and {tuple(w.shape)}"
        )
    _check_sizes(where, m_sizes, w.shape[0])
    registry.check_devices(where, X=x, W=w, M_sizes=m_sizes)


def _check_rowwise(where: str, role: str, scale, data, numel: int) -> None:
    """A rowwise scale given flat or shaped: numel values, fp32, contiguous, on data's device."""
    if (
        scale.numel() != numel
        or scale.dtype != torch.float32
        or not scale.is_contiguous()
        or scale.device != data.device
    ):
        raise formats.ScaleFormatError(
            f"{where}: {role} must be a contiguous float32 rowwise scale of {numel} values on {data.device} (from "
            f"quantize_fp8_row), got shape {tuple(scale.shape)} {scale.dtype} on {scale.device}"
        )


# ---------------------------------------------------------------------------------------- references


def _group_bounds(sizes, total: int, ends: bool = False) -> list[tuple[int, int]]:
    """(first, count) of each group as the kernel reads `sizes` (counts, or cumulative ends), clamped the same
    way: no group below 0 or past `total`. Reads the sizes on the host."""
    bounds, first = [], 0
    for value in sizes.tolist():
        count = min(max(value - first if ends else value, 0), total - first)
        bounds.append((first, count))
        first += count
    return bounds


def _stacked_reference(x, w, bounds, x_scale=None, w_scale=None, bias=None, token_weights=None):
    """fp32 [rows of x, N]: rows [first, first + count) of group g times w[g]ᵀ (then scaled, biased, weighted);
    the other rows zero."""
    out = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float32, device=x.device)
    for g, (first, count) in enumerate(bounds):
        rows = slice(first, first + count)
        part = x[rows].float() @ w[g].float().T
        if x_scale is not None:
            part = part * x_scale.reshape(-1)[rows, None].float() * w_scale.reshape(len(bounds), -1)[g].float()
        if bias is not None:
            part = part + bias[g].float()
        if token_weights is not None:
            part = part * token_weights[rows, None].float()
        out[rows] = part
    return out


def _k_grouped_reference(a, b, bounds, a_scale=None, b_scale=None):
    """fp32 [G, M, N]: a[:, group g's columns] · b[:, the same]ᵀ for a [M, ΣK] and b [N, ΣK], scaled by
    a_scale [G, M] and b_scale [G, N] (rowwise per group); empty groups give zeros."""
    out = torch.zeros(len(bounds), a.shape[0], b.shape[0], dtype=torch.float32, device=a.device)
    for g, (first, count) in enumerate(bounds):
        part = a[:, first : first + count].float() @ b[:, first : first + count].float().T
        if a_scale is not None:
            part = part * a_scale.reshape(len(bounds), -1)[g, :, None] * b_scale.reshape(len(bounds), -1)[g]
        out[g] = part
    return out


def _ragged_sizes(total: int, groups: int, device, dtype=torch.int64) -> torch.Tensor:
    """Random group sizes summing to total, with empty groups among them."""
    cuts = torch.sort(torch.randint(0, total + 1, (groups - 1,))).values
    sizes = torch.diff(torch.cat([torch.zeros(1, dtype=torch.int64), cuts, torch.tensor([total])]))
    return sizes.to(device=device, dtype=dtype)


def _bf16(*shape, device) -> torch.Tensor:
    return testing.randn(*shape, dtype=torch.bfloat16, device=device)


# ----------------------------------------------------------------------------- bf16 stacked, dgrad


def _stacked_16bit_op(name: str, samples) -> registry.Op:
    """bf16bf16bf16_grouped_stacked and _grouped_grad: the same product, which the kernel serves for W
    contiguous along K (forward) or N (dgrad) alike."""
    where = name

    def validate(X, W, M_sizes, out=None, num_sms=None):
        _check_stacked(where, X, W, M_sizes)
        _check_16bit(where, X, W)
        registry.check_output(where, "out", out, (X.shape[0], W.shape[1]), (torch.bfloat16, X.dtype), X.device)
        _check_num_sms(where, num_sms)

    def reference(X, W, M_sizes, out=None, num_sms=None):
        result = _stacked_reference(X, W, _group_bounds(M_sizes, X.shape[0])).to(torch.bfloat16)
        return result if out is None else out.copy_(result)

    op = registry.Op(
        f"mslk::{name}(Tensor X, Tensor W, Tensor M_sizes, Tensor(a!)? out=None, int? num_sms=None) -> Tensor",
        out_arg="out",
        domain="gemm",
        reference=reference,
        fake=lambda X, W, M_sizes, out=None, num_sms=None: (
            X.new_empty((X.shape[0], W.shape[1]), dtype=torch.bfloat16) if out is None else out
        ),
        samples=samples,
        validate=validate,
        tolerance=1e-2,
    )

    @op.backend("triton", available=registry.triton_missing)
    def _triton(X, W, M_sizes, out=None, num_sms=None):
        result = torch.empty((X.shape[0], W.shape[1]), dtype=torch.bfloat16, device=X.device) if out is None else out
        return _run_grouped(k_contiguous(X), _weights(W), result, M_sizes, num_sms=num_sms)

    return op


def _stacked_samples(device, n_major=False):
    for total, groups, n, k in ((37, 4, 24, 64), (5, 3, 130, 48)):
        w = _bf16(groups, k, n, device=device).transpose(1, 2) if n_major else _bf16(groups, n, k, device=device)
        yield registry.Sample((_bf16(total, k, device=device), w, _ragged_sizes(total, groups, device)))


bf16bf16bf16_grouped_stacked_op = _stacked_16bit_op("bf16bf16bf16_grouped_stacked", _stacked_samples)
bf16bf16bf16_grouped_grad_op = _stacked_16bit_op(
    "bf16bf16bf16_grouped_grad", functools.partial(_stacked_samples, n_major=True)
)


def bf16bf16bf16_grouped_stacked(X, W, M_sizes, out=None, num_sms=None) -> torch.Tensor:
    """Grouped GEMM of stacked groups (spec G-12): X [ΣM, K] bf16/fp16, W [G, N, K], M_sizes [G] int64 (or
    int32) rows per group -> bf16 [ΣM, N] (as the name says, fp16 inputs too) with out[rows of g] = X[rows of g] ·
    W[g]ᵀ (fp32 sums), into `out` when given (bf16, or X's dtype); `num_sms` caps the persistent programs."""
    return torch.ops.mslk.bf16bf16bf16_grouped_stacked(X, W, M_sizes, out, num_sms)


def bf16bf16bf16_grouped_grad(X, W, M_sizes, out=None, num_sms=None) -> torch.Tensor:
    """MoE dgrad (spec G-13): bf16bf16bf16_grouped_stacked's product out[rows of g] = X[rows of g] · W[g]ᵀ for
    X [ΣM, K] (dY) and W [G, N, K] with W.stride(-2) == 1: `w.permute(0, 2, 1)` of the forward's contiguous
    [G, K, N] weights, read in place -> [ΣM, N] (dX)."""
    return torch.ops.mslk.bf16bf16bf16_grouped_grad(X, W, M_sizes, out, num_sms)


def grouped_gemm_dgrad(x, w, m_sizes, out=None, num_sms=None) -> torch.Tensor:
    """The reference library's Triton entry (spec G-55): bf16bf16bf16_grouped_grad."""
    return bf16bf16bf16_grouped_grad(x, w, m_sizes, out, num_sms)


# ------------------------------------------------------------------------------------------- wgrad


def _validate_wgrad(X, W, M_sizes, output=None, output_accum=False, num_sms=None):
    where = "bf16bf16bf16_grouped_wgrad"
    if X.dim() != 2 or W.dim() != 2 or X.shape[0] != W.shape[0]:
        raise ValueError(
            f"{where}: expected X [ΣM, N] (dY) and W [ΣM, K] (the layer's input) with the same rows, got "
            f"{tuple(X.shape)} and {tuple(W.shape)}"
        )
    _check_16bit(where, X, W)
    _check_sizes(where, M_sizes, M_sizes.shape[0] if M_sizes.dim() == 1 else -1)
    registry.check_devices(where, X=X, W=W, M_sizes=M_sizes)
    shape = (M_sizes.shape[0], X.shape[1], W.shape[1])
    if output_accum and output is None:
        raise ValueError(f"{where}: output_accum=True adds into `output`, which must be given (float32 {shape})")
    dtypes = (torch.float32,) if output_accum else (torch.bfloat16, X.dtype, torch.float32)
    registry.check_output(where, "output", output, shape, dtypes, X.device)
    _check_num_sms(where, num_sms)


def _wgrad_reference(X, W, M_sizes, output=None, output_accum=False, num_sms=None):
    dw = _k_grouped_reference(X.T, W.T, _group_bounds(M_sizes, X.shape[0]))
    if output is None:
        return dw.to(torch.bfloat16)
    return output.add_(dw) if output_accum else output.copy_(dw)


def _wgrad_samples(device):
    for total, groups, n, k in ((37, 4, 24, 40), (130, 3, 20, 136)):
        x, w = _bf16(total, n, device=device), _bf16(total, k, device=device)
        yield registry.Sample((x, w, _ragged_sizes(total, groups, device)))


bf16bf16bf16_grouped_wgrad_op = registry.Op(
    "mslk::bf16bf16bf16_grouped_wgrad(Tensor X, Tensor W, Tensor M_sizes, Tensor(a!)? output=None, "
    "bool output_accum=False, int? num_sms=None) -> Tensor",
    out_arg="output",
    domain="gemm",
    reference=_wgrad_reference,
    fake=lambda X, W, M_sizes, output=None, *args, **kwargs: (
        X.new_empty((M_sizes.shape[0], X.shape[1], W.shape[1]), dtype=torch.bfloat16) if output is None else output
    ),
    samples=_wgrad_samples,
    validate=_validate_wgrad,
    tolerance=1e-2,
)


@bf16bf16bf16_grouped_wgrad_op.backend("triton", available=registry.triton_missing)
def _wgrad_triton(X, W, M_sizes, output=None, output_accum=False, num_sms=None):
    # K-grouped: out[g] = Σ over g's rows r of dY[r, :]ᵀ X[r, :], with A = dYᵀ [N, ΣM] and B = Xᵀ [K, ΣM].
    out = torch.empty((M_sizes.shape[0], X.shape[1], W.shape[1]), dtype=torch.bfloat16, device=X.device)
    out = out if output is None else output
    _run_grouped(
        k_contiguous(X).T, k_contiguous(W).T, out, M_sizes, grouping=K_GROUPED, zero_fill=False,
        accumulate=output_accum, num_sms=num_sms,
    )  # fmt: skip
    return out


def bf16bf16bf16_grouped_wgrad(X, W, M_sizes, output=None, output_accum=False, num_sms=None) -> torch.Tensor:
    """MoE wgrad (spec G-14): X [ΣM, N] (dY), W [ΣM, K] (the layer's input), bf16/fp16, M_sizes [G] ->
    [G, N, K] with out[g] = X[rows of g]ᵀ · W[rows of g] (fp32 sums; empty groups give zeros). Into `output`
    when given (X's dtype or fp32); `output_accum` adds into a given fp32 `output` instead."""
    return torch.ops.mslk.bf16bf16bf16_grouped_wgrad(X, W, M_sizes, output, output_accum, num_sms)


def grouped_gemm_wgrad(x, w, m_sizes, output=None, output_accum=False, num_sms=None) -> torch.Tensor:
    """The reference library's Triton entry (spec G-55): bf16bf16bf16_grouped_wgrad."""
    return bf16bf16bf16_grouped_wgrad(x, w, m_sizes, output, output_accum, num_sms)


# ------------------------------------------------------------------------------------------ FP8 rowwise


def _validate_fp8(XQ, WQ, x_scale, w_scale, M_sizes):
    where = "f8f8bf16_rowwise_grouped_stacked"
    _check_fp8(where, XQ, WQ)
    _check_stacked(where, XQ, WQ, M_sizes)
    formats.Rowwise().check(XQ, x_scale, role=f"{where}: x_scale")
    formats.Rowwise().check(WQ, w_scale, role=f"{where}: w_scale")


def _fp8_samples(device):
    for total, groups, n, k in ((37, 4, 24, 64), (5, 3, 130, 96)):
        xq, xs = quantize_rows(testing.randn(total, k, device=device))
        wq, ws = quantize_rows(testing.randn(groups, n, k, device=device))
        yield registry.Sample((xq, wq, xs, ws, _ragged_sizes(total, groups, device)))


f8f8bf16_rowwise_grouped_stacked_op = registry.Op(
    "mslk::f8f8bf16_rowwise_grouped_stacked(Tensor XQ, Tensor WQ, Tensor x_scale, Tensor w_scale, Tensor M_sizes) "
    "-> Tensor",
    domain="gemm",
    reference=lambda XQ, WQ, x_scale, w_scale, M_sizes: _stacked_reference(
        XQ, WQ, _group_bounds(M_sizes, XQ.shape[0]), x_scale, w_scale
    ).to(torch.bfloat16),
    fake=lambda XQ, WQ, *args, **kwargs: XQ.new_empty((XQ.shape[0], WQ.shape[1]), dtype=torch.bfloat16),
    samples=_fp8_samples,
    validate=_validate_fp8,
    tolerance=1e-2,
)


@f8f8bf16_rowwise_grouped_stacked_op.backend(
    "triton", available=registry.triton_missing, requires=arch.fp8_e4m3_missing
)
def _fp8_triton(XQ, WQ, x_scale, w_scale, M_sizes):
    out = torch.empty((XQ.shape[0], WQ.shape[1]), dtype=torch.bfloat16, device=XQ.device)
    return _run_grouped(
        k_contiguous(XQ), _weights(WQ), out, M_sizes, a_scale=x_scale.reshape(-1).contiguous(),
        b_scale=_per_group(w_scale, WQ.shape[0]).contiguous(), scales=ROWWISE,
    )  # fmt: skip


def f8f8bf16_rowwise_grouped_stacked(XQ, WQ, x_scale, w_scale, M_sizes) -> torch.Tensor:
    """Grouped rowwise FP8 GEMM (spec G-06): XQ [ΣM, K], WQ [G, N, K] FP8, x_scale [ΣM] and w_scale [G, N] fp32
    (quantize_fp8_row), M_sizes [G] -> bf16 [ΣM, N] = (XQ[rows of g] · WQ[g]ᵀ) · x_scale · w_scale[g]."""
    return torch.ops.mslk.f8f8bf16_rowwise_grouped_stacked(XQ, WQ, x_scale, w_scale, M_sizes)


# --------------------------------------------------------------------------- FP8 groupwise (G-17, G-58)


def per_group_m_major(scale: torch.Tensor, m_sizes: torch.Tensor) -> torch.Tensor:
    """Group scales [ΣM, K/128] (one row per row of X, k-major) rearranged into the per-group M-major layout that
    f8f8bf16_groupwise_grouped reads and quantize_fp8_group(x, 128, m_sizes=M_sizes) makes: group g's
    [K/128, M_g] block lies flat at row first_g of the [ΣM, K/128] buffer. Reads m_sizes on the host."""
    if scale.dim() != 2 or m_sizes.dim() != 1 or m_sizes.is_floating_point():
        raise ValueError(
            f"per_group_m_major: expected scale [ΣM, K/128] and integer M_sizes [G], got scale "
            f"{tuple(scale.shape)} and M_sizes {tuple(m_sizes.shape)} {m_sizes.dtype}"
        )
    out = scale.clone()  # rows past the groups keep their values (never read)
    blocks = scale.shape[1]
    for first, count in _group_bounds(m_sizes, scale.shape[0]):
        out.view(-1)[first * blocks : (first + count) * blocks] = scale[first : first + count].T.reshape(-1)
    return out


def _validate_groupwise(XQ, WQ, x_scale, w_scale, M_sizes):
    where = "f8f8bf16_groupwise_grouped"
    _check_fp8(
        where, XQ, WQ, f"quantize_fp8_group(x, {GROUP_K}, m_sizes=M_sizes) and quantize_fp8_block(w[g], {GROUP_K}, "
        f"{GROUP_K}, k_major=False)",
    )  # fmt: skip
    _check_stacked(where, XQ, WQ, M_sizes)
    role = f"{where}: x_scale (in per-group M-major blocks: quantize_fp8_group(x, {GROUP_K}, m_sizes=M_sizes))"
    formats.Groupwise(GROUP_K, k_major=True).check(XQ, x_scale, role=role)
    groups, n, k = WQ.shape
    expected = (groups, k // GROUP_K, launch.cdiv(n, GROUP_K))
    if (
        tuple(w_scale.shape) != expected or w_scale.dtype != torch.float32 or not w_scale.is_contiguous()
        or w_scale.device != WQ.device
    ):  # fmt: skip
        raise formats.ScaleFormatError(
            f"{where}: w_scale must be contiguous float32 {expected} on {WQ.device} (quantize_fp8_block(w[g], "
            f"{GROUP_K}, {GROUP_K}, k_major=False) of each group, stacked), got shape {tuple(w_scale.shape)} "
            f"{w_scale.dtype} on {w_scale.device}"
        )


def _groupwise_reference(XQ, WQ, x_scale, w_scale, M_sizes):
    out = torch.zeros(XQ.shape[0], WQ.shape[1], dtype=torch.bfloat16, device=XQ.device)
    blocks = XQ.shape[1] // GROUP_K
    for g, (first, count) in enumerate(_group_bounds(M_sizes, XQ.shape[0])):
        xs = x_scale.reshape(-1)[first * blocks : (first + count) * blocks].view(blocks, count).T
        rows = slice(first, first + count)
        out[rows] = _block_scaled_reference(XQ[rows], WQ[g], xs, w_scale[g].T, 1, GROUP_K, GROUP_K)
    return out


def groupwise_grouped_inputs(x, w, m_sizes) -> tuple[torch.Tensor, ...]:
    """(XQ, WQ, x_scale, w_scale) of f8f8bf16_groupwise_grouped for x [ΣM, K] and w [G, N, K] (samples, tests
    and benches; mslk-gemm works without mslk.quantize, whose quantizers make the same layouts)."""
    xq, x_scale = quantize_blocks(x, 1, GROUP_K)
    wq, w_scale = zip(*(quantize_blocks(wg, GROUP_K, GROUP_K) for wg in w), strict=True)
    return xq, torch.stack(wq), per_group_m_major(x_scale, m_sizes), torch.stack([s.T for s in w_scale]).contiguous()


def _groupwise_samples(device):
    for total, groups, n, k in ((37, 4, 130, 256), (5, 2, 24, 128)):
        sizes = _ragged_sizes(total, groups, device)
        x, w = testing.randn(total, k, device=device), testing.randn(groups, n, k, device=device)
        yield registry.Sample((*groupwise_grouped_inputs(x, w, sizes), sizes))


f8f8bf16_groupwise_grouped_op = registry.Op(
    "mslk::f8f8bf16_groupwise_grouped(Tensor XQ, Tensor WQ, Tensor x_scale, Tensor w_scale, Tensor M_sizes) -> Tensor",
    domain="gemm",
    reference=_groupwise_reference,
    fake=lambda XQ, WQ, *args, **kwargs: XQ.new_empty((XQ.shape[0], WQ.shape[1]), dtype=torch.bfloat16),
    samples=_groupwise_samples,
    validate=_validate_groupwise,
    tolerance=1e-2,
)


@f8f8bf16_groupwise_grouped_op.backend("triton", available=registry.triton_missing, requires=arch.fp8_e4m3_missing)
def _groupwise_triton(XQ, WQ, x_scale, w_scale, M_sizes):
    out = torch.empty((XQ.shape[0], WQ.shape[1]), dtype=torch.bfloat16, device=XQ.device)
    return _run_grouped(
        k_contiguous(XQ), k_contiguous(WQ), out, M_sizes, a_scale=x_scale, b_scale=w_scale,
        scales=GROUPWISE,
    )  # fmt: skip


def f8f8bf16_groupwise_grouped(XQ, WQ, x_scale, w_scale, M_sizes) -> torch.Tensor:
    """Grouped groupwise FP8 GEMM, the DeepSeek-V3 recipe (spec G-17): XQ [ΣM, K], WQ [G, N, K] FP8 with
    K % 128 == 0; x_scale [ΣM, K/128], one per row and 128 of K in per-group M-major blocks (group g's
    [K/128, M_g] flat at row first_g: quantize_fp8_group(x, 128, m_sizes=M_sizes)); w_scale [G, K/128, ⌈N/128⌉],
    one per 128 x 128 tile (quantize_fp8_block(w[g], 128, 128, k_major=False), stacked); M_sizes [G] ->
    bf16 [ΣM, N]."""
    return torch.ops.mslk.f8f8bf16_groupwise_grouped(XQ, WQ, x_scale, w_scale, M_sizes)


# ------------------------------------------------- Triton entry points with scatter-add (G-53, G-54)


def _entry_weights(w, m_sizes):
    """w [G·N, K] (the reference library's layout) or [G, N, K], as [G, N, K]."""
    return w if w.dim() == 3 else w.unflatten(0, (m_sizes.shape[0], -1))


def _validate_entry(where, x, w, m_sizes, x_scale, w_scale, bias, token_weights) -> int:
    """Checks the inputs of grouped_gemm(_fp8_rowwise); returns N."""
    if x.dim() != 2 or w.dim() not in (2, 3) or w.shape[-1] != x.shape[-1]:
        raise ValueError(
            f"{where}: expected x [ΣM, K] and w [G·N, K] (or [G, N, K]) with the same K, got {tuple(x.shape)} and "
            f"{tuple(w.shape)}"
        )
    groups = w.shape[0] if w.dim() == 3 else m_sizes.shape[0] if m_sizes.dim() == 1 else -1
    _check_sizes(where, m_sizes, groups, "m_sizes")
    if w.dim() == 2 and (groups == 0 or w.shape[0] % groups):
        raise ValueError(f"{where}: w [G·N, K] needs G = len(m_sizes) = {groups} to divide its {w.shape[0]} rows")
    n = _entry_weights(w, m_sizes).shape[1]
    registry.check_devices(where, x=x, w=w, m_sizes=m_sizes, bias=bias, token_weights=token_weights)
    if (x_scale is None) != (w_scale is None):
        raise ValueError(f"{where}: rowwise FP8 needs both x_scale and w_scale")
    if x_scale is None:
        _check_16bit(where, x, w)
    else:
        _check_fp8(where, x, w)
        _check_rowwise(where, "x_scale", x_scale, x, x.shape[0])
        _check_rowwise(where, "w_scale", w_scale, w, groups * n)
    if bias is not None and (tuple(bias.shape) != (groups, n) or not bias.dtype.is_floating_point):
        raise ValueError(
            f"{where}: bias must be floating [G, N] = [{groups}, {n}], got {tuple(bias.shape)} {bias.dtype}"
        )
    if token_weights is not None and (
        tuple(token_weights.shape) != (x.shape[0],) or not token_weights.dtype.is_floating_point
    ):
        raise ValueError(
            f"{where}: token_weights must be floating [ΣM] = [{x.shape[0]}], got {tuple(token_weights.shape)} "
            f"{token_weights.dtype}"
        )
    return n


def _entry_reference(x, w, m_sizes, x_scale=None, w_scale=None, bias=None, token_weights=None, use_fast_accum=True):
    bounds = _group_bounds(m_sizes, x.shape[0])
    return _stacked_reference(x, _entry_weights(w, m_sizes), bounds, x_scale, w_scale, bias, token_weights)


def _run_entry(out, x, w, m_sizes, x_scale, w_scale, bias, token_weights, use_fast_accum, indices=None):
    w = _weights(_entry_weights(w, m_sizes))
    return _run_grouped(
        k_contiguous(x), w, out, m_sizes, a_scale=None if x_scale is None else x_scale.reshape(-1),
        b_scale=None if w_scale is None else _per_group(w_scale, w.shape[0]),
        scales=NO_SCALES if x_scale is None else ROWWISE, bias=None if bias is None else bias.contiguous(),
        token_weights=None if token_weights is None else token_weights.contiguous(),
        scatter=None if indices is None else indices.contiguous(), zero_fill=indices is None,
        accumulate=indices is not None, fast_accum=use_fast_accum,
    )  # fmt: skip


def _fp8_inputs_missing(x: torch.Tensor) -> str | None:
    """The GPU's FP8 requirement where the entry's inputs are FP8 (they may be bf16)."""
    return arch.fp8_e4m3_missing(x) if x.dtype == torch.float8_e4m3fn else None


def _entry_samples(device, scatter: bool):
    total, groups, n, k = 37, 4, 24, 64
    sizes = _ragged_sizes(total, groups, device, torch.int32)
    x, w = testing.randn(total, k, device=device), testing.randn(groups * n, k, device=device)
    (xq, xs), (wq, ws) = quantize_rows(x), quantize_rows(w)
    bias, token_weights = testing.randn(groups, n, device=device), testing.randn(total, device=device)
    for args in ((x.bfloat16(), w.bfloat16(), sizes, None, None, bias, token_weights), (xq, wq, sizes, xs, ws)):
        if scatter:  # the schema's order: output first, the indices after m_sizes
            indices = torch.randint(0, 30, (total,), device=device)
            args = (testing.randn(30, n, device=device), *args[:3], indices, *args[3:])
        yield registry.Sample(args)


def _validate_grouped_gemm(
    x, w, m_sizes, x_scale=None, w_scale=None, bias=None, token_weights=None, use_fast_accum=True
):
    _validate_entry("grouped_gemm", x, w, m_sizes, x_scale, w_scale, bias, token_weights)


grouped_gemm_op = registry.Op(
    "mslk::grouped_gemm(Tensor x, Tensor w, Tensor m_sizes, Tensor? x_scale=None, Tensor? w_scale=None, "
    "Tensor? bias=None, Tensor? token_weights=None, bool use_fast_accum=True) -> Tensor",
    domain="gemm",
    reference=lambda *args, **kwargs: _entry_reference(*args, **kwargs).to(torch.bfloat16),
    fake=lambda x, w, m_sizes, *args, **kwargs: x.new_empty(
        (x.shape[0], _entry_weights(w, m_sizes).shape[1]), dtype=torch.bfloat16
    ),
    samples=functools.partial(_entry_samples, scatter=False),
    validate=_validate_grouped_gemm,
    tolerance=1e-2,
)


@grouped_gemm_op.backend("triton", available=registry.triton_missing, requires=_fp8_inputs_missing)
def _grouped_gemm_triton(x, w, m_sizes, x_scale=None, w_scale=None, bias=None, token_weights=None, use_fast_accum=True):
    out = torch.empty((x.shape[0], _entry_weights(w, m_sizes).shape[1]), dtype=torch.bfloat16, device=x.device)
    return _run_entry(out, x, w, m_sizes, x_scale, w_scale, bias, token_weights, use_fast_accum)


def _validate_scatter(
    output, x, w, m_sizes, scatter_add_indices, x_scale=None, w_scale=None, bias=None, token_weights=None,
    use_fast_accum=True,
):  # fmt: skip
    where = "grouped_gemm_scatter_add"
    n = _validate_entry(where, x, w, m_sizes, x_scale, w_scale, bias, token_weights)
    indices = scatter_add_indices
    if indices.dim() != 1 or indices.dtype not in _INDEX_DTYPES or indices.shape[0] != x.shape[0]:
        raise ValueError(
            f"{where}: scatter_add_indices must be int32/int64 [ΣM] = [{x.shape[0]}], got {tuple(indices.shape)} "
            f"{indices.dtype}"
        )
    if output.dim() != 2 or output.shape[1] != n or output.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(
            f"{where}: output must be float32, bfloat16 or float16 [T, N] with N = {n}, got {tuple(output.shape)} "
            f"{output.dtype}"
        )
    registry.check_devices(where, x=x, output=output, scatter_add_indices=indices)


def _scatter_reference(output, x, w, m_sizes, scatter_add_indices, *args, **kwargs):
    result = _entry_reference(x, w, m_sizes, *args, **kwargs)
    rows = sum(count for _, count in _group_bounds(m_sizes, x.shape[0]))
    index = scatter_add_indices[:rows].long()
    keep = (index >= 0) & (index < output.shape[0])
    output.copy_(output.float().index_add_(0, index[keep], result[:rows][keep]))


grouped_gemm_scatter_add_op = registry.Op(
    "mslk::grouped_gemm_scatter_add(Tensor(a!) output, Tensor x, Tensor w, Tensor m_sizes, "
    "Tensor scatter_add_indices, Tensor? x_scale=None, Tensor? w_scale=None, Tensor? bias=None, "
    "Tensor? token_weights=None, bool use_fast_accum=True) -> ()",
    domain="gemm",
    reference=_scatter_reference,
    fake=lambda *args, **kwargs: None,
    samples=functools.partial(_entry_samples, scatter=True),
    validate=_validate_scatter,
    tolerance=1e-2,
)


def _scatter_supports(output, x, *args, **kwargs) -> list[str]:
    missing = _fp8_inputs_missing(x)  # (the first tensor, which `requires` would ask, is the bf16 output)
    return [] if missing is None else [missing]


@grouped_gemm_scatter_add_op.backend("triton", available=registry.triton_missing, supports=_scatter_supports)
def _scatter_triton(
    output, x, w, m_sizes, scatter_add_indices, x_scale=None, w_scale=None, bias=None, token_weights=None,
    use_fast_accum=True,
):  # fmt: skip
    _run_entry(output, x, w, m_sizes, x_scale, w_scale, bias, token_weights, use_fast_accum, scatter_add_indices)


def _grouped_gemm(x, w, m_sizes, x_scale, w_scale, bias, token_weights, use_fast_accum, output, indices):
    if (output is None) != (indices is None):
        raise ValueError("grouped_gemm: the fused scatter-add takes both _output_tensor and _scatter_add_indices")
    if output is None:
        return torch.ops.mslk.grouped_gemm(x, w, m_sizes, x_scale, w_scale, bias, token_weights, use_fast_accum)
    torch.ops.mslk.grouped_gemm_scatter_add(
        output, x, w, m_sizes, indices, x_scale, w_scale, bias, token_weights, use_fast_accum
    )
    return output


def grouped_gemm(
    x, w, m_sizes, bias=None, token_weights=None, use_fast_accum=True, *, _use_warp_specialization=True,
    _output_tensor=None, _scatter_add_indices=None,
) -> torch.Tensor:  # fmt: skip
    """The reference library's Triton grouped GEMM (spec G-53): x [ΣM, K] bf16/fp16, w [G·N, K] (or [G, N, K]),
    m_sizes [G] int32/int64 rows per group, bias [G, N], token_weights [ΣM] ->
    out[rows of g] = (x[rows of g] · w[g]ᵀ + bias[g]) · token_weights[rows], bf16 [ΣM, N] (rows past the sizes'
    sum zero).

    With `_output_tensor` [T, N] (fp32, bf16 or fp16) and `_scatter_add_indices` [ΣM] (int32/int64), the result
    is not materialized: each row i of the groups is atomically added into `_output_tensor[indices[i]]`, which
    is returned (rows past the sizes' sum and indices outside [0, T) add nothing; the order of the additions
    is not fixed). bf16/fp16 targets need GPU atomics: under the Triton interpreter use fp32.
    `_use_warp_specialization` is accepted for compatibility and has no effect."""
    return _grouped_gemm(
        x, w, m_sizes, None, None, bias, token_weights, use_fast_accum, _output_tensor, _scatter_add_indices
    )


def grouped_gemm_fp8_rowwise(
    x, w, m_sizes, x_scale, w_scale, use_fast_accum=True, *, _use_warp_specialization=True, _output_tensor=None,
    _scatter_add_indices=None,
) -> torch.Tensor:  # fmt: skip
    """grouped_gemm with rowwise FP8 operands (spec G-54): x [ΣM, K], w [G·N, K] FP8, x_scale [ΣM] and
    w_scale [G·N] fp32 (quantize_fp8_row) -> bf16 (x · w[g]ᵀ) · x_scale · w_scale[g], or scatter-added into
    `_output_tensor` as grouped_gemm does. use_fast_accum=False sums each K block's product in fp32."""
    return _grouped_gemm(
        x, w, m_sizes, x_scale, w_scale, None, None, use_fast_accum, _output_tensor, _scatter_add_indices
    )
