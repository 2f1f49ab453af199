"""`triton_splitk`: MSLK's Triton split-K attention forward for decoding (spec §2.3 row `triton_splitKF`, §7.7): a
few queries a sequence over a long KV cache, the keys split into parts attended in parallel, then merged.

A program takes one sequence's queries of one (group, KV head) as the rows of its products: with K/V expanded over
the heads (MQA / GQA, stride 0) the query heads of a KV head share each K and V tile it loads, so the cache is read
once a KV head, not once a query head. It walks its part of the keys the queries' mask lets them see, BLOCK_N at
a time, with the online softmax in fp32; keys come from their rows (dense, padded or gappy caches) or through the
page table (paged masks: key j of lane b is row block_tables[b, j // page_size] · page_size + j % page_size of the
pool). The part count fills the GPU in the fewest waves (launch.fewest_waves) of as many programs an SM as the
compiled kernel's registers and shared memory let run at once (launch.programs_per_sm); the parts' outputs and
log-sum-exps are combined by the merge kernel (merge.merge_stacked_into). Masks: none, padded keys
(B11-B14), gappy keys (B18, B19) and their paged forms (B15-B17, B21, B22), causal from the bottom right and local
windows included; fp16 / bf16, head dims up to 256, any number of queries a sequence (rows beyond 64 in more
programs); output in any dtype and the LSE for partial attention (varlen: packed; fp32 for every output dtype,
where the reference's is fp64 for fp32 outputs: its sums are fp32 either way, and merge_attentions takes both).

K/V may come quantized in kv_cache's formats (spec §7.7): int4-packed (a quarter of the bytes of bf16, plus 4 a
group; NUM_GROUPS scale groups a row, set in a subclass as upstream's tests do) or FP8 rows (InputsFp8: half the
bytes, plus 4 a row for its scale; e4m3 conversions need SM89 or newer). On NVIDIA GPUs, int4 rows of one scale
group and FP8 rows at head dims 64 and 128 go to Gluon kernels (triton_splitk_int4, triton_splitk_fp8: one warp a
program, K/V loaded straight into the MMA's operands, never dequantized; H100, PERF.md's decode shape: int4 0.075 ms
against this kernel's 0.334, in pages of 64 0.086; FP8 rows 0.102 against 0.128, in pages of 64 0.112 against
0.175; SDPA on the bf16 cache 0.170-0.173; RESULTS.md, sixty-fifth to sixty-seventh sessions). Here FP8 rows are
dequantized in fp32 as their tiles load, and int4 rows never are: their codes go to fp16 MMAs as they unpack, against
the queries in fp16 (each row scaled by a power of two) and the probabilities times V's scales, and a row's scale and
shift apply to the products (scale · (q · codes) + shift · Σ q), exact where dequantized K/V had been rounded to 16
bits. (16-bit K/V in the Gluon kernels' scheme took 1.02-1.13x this kernel's time.)

Not taken: FP8 queries or products (quantize_*_to_fp8), a tensor bias, head dims past 256; the not-supported
reasons say so, and the dispatcher goes on to the next backend.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from mslk.attention.fmha import attn_bias as ab
from mslk.attention.fmha import merge
from mslk.attention.fmha.common import (
    AttentionFwOpBase,
    Context,
    Inputs,
    InputsFp8,
    InputsMXFp8,
    bias_types,
    varlen_args,
)
from mslk.attention.fmha.triton_flash import (
    _alignment,
    _bmghk,
    _key_range,
    _launches,
    _sequence,
    _switch_reasons,
    _unmasked_key_range,
    _visible,
)
from mslk.core import arch, launch, registry

_LOG2E = 1.4426950408889634
_MAX_ROWS = 64  # query rows (queries x heads) a program: its accumulator 64 x 256 fp32 at most


@triton.jit
def _pow2(e):
    """2^e in fp32 (int32 e in [-126, 127]), exactly: its exponent bits."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _exponent(x, lo: tl.constexpr, hi: tl.constexpr):
    """floor(log2(x)) of positive normal fp32 x from its exponent bits, kept within [lo, hi] (0 and subnormals land
    at lo, inf and NaN at hi)."""
    return tl.minimum(tl.maximum(((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, lo), hi)


@triton.jit
def _fp16_rows(q):
    """q's rows in fp16 scaled each by a power of two to a largest |value| in [2^14, 2^15), and those powers' inverses
    in fp32: products with int4 codes in fp16 whatever q's dtype and range (16-bit q values fit fp16's
    mantissa; a row loses only what falls 2^29 below its largest value)."""
    e = _exponent(tl.max(tl.abs(q.to(tl.float32)), 1), -112, 127)  # (2^(14 - e) and 2^(e - 14) stay normal)
    return (q.to(tl.float32) * _pow2(14 - e)[:, None]).to(tl.float16), _pow2(e - 14)


@triton.jit
def _int4_order(dims):
    """The element of int4-packed rows at each of the dims' places in _int4_codes' tiles: place 8w + 2j + h holds
    element 8w + j + 4h (nibble j + 4h of word w), as a word's nibbles unpack two at a time."""
    return dims // 8 * 8 + dims % 8 // 2 + dims % 2 * 4


@triton.jit
def _half_pair(packed):
    """The fp16 (scale, shift) packed in int32 (kv_cache's layout: the scale in the low half), in fp32."""
    scale = (packed & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    shift = ((packed >> 16) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return scale, shift


@triton.jit
def _kv_tile(rows, scale_rows, key_ok, dims, dim_ok, stride_d, FP8_SCALES: tl.constexpr):
    """The [BLOCK_N, BLOCK_D] tile of 16-bit or FP8 K or V rows (`rows`: their starts), FP8 ones dequantized in fp32
    by the row's scale at `scale_rows` (the tensors viewed as FP8 by the caller): fp16 scale and shift in an int32
    (FP8_SCALES 1) or an fp32 scale (2)."""
    tile = tl.load(rows[:, None] + dims[None, :] * stride_d, mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
    if FP8_SCALES == 1:
        scale, shift = _half_pair(tl.load(scale_rows, mask=key_ok, other=0))
        tile = tile.to(tl.float32) * scale[:, None] + shift[:, None]
    elif FP8_SCALES == 2:
        tile = tile.to(tl.float32) * tl.load(scale_rows, mask=key_ok, other=0.0)[:, None]
    return tile


@triton.jit
def _int4_codes(rows, key_ok, GROUPS: tl.constexpr, D: tl.constexpr, stride_d):
    """The [BLOCK_N, D] codes c of int4-packed rows (`rows`: their starts) as the fp16 bits of c (c · 2^-24, exact;
    the callers undo the 2^-24), in _int4_order (q and the output take the same order, so the products need no
    other). Element 8w + j is nibble j of int32 GROUPS + w (kv_cache's order). The words load once each; one shift
    and one mask take nibbles j and j + 4 to the halves of a 32-bit lane, so a word's eight codes stay in its thread
    and cost about an instruction each (a 3-D shift and reshape had spread them over eight)."""
    words = tl.load(rows[:, None] + (GROUPS + tl.arange(0, D // 8))[None, :] * stride_d, mask=key_ok[:, None], other=0)
    pairs = tl.interleave(
        tl.interleave(words & 0x000F000F, (words >> 8) & 0x000F000F),
        tl.interleave((words >> 4) & 0x000F000F, (words >> 12) & 0x000F000F),
    )  # place 4w + j: nibbles j and j + 4 of word w, in the low and high halves
    return tl.interleave(pairs.to(tl.int16), (pairs >> 16).to(tl.int16)).to(tl.float16, bitcast=True)


@triton.jit
def _in_group(grp: tl.constexpr, GROUPS: tl.constexpr, D: tl.constexpr):
    """Whether each of the D dims is in scale group grp."""
    return tl.arange(0, D) // (D // GROUPS) == grp


@triton.jit
def _int4_scores(q, q16, q_unit, rows, key_ok, stride_d, GROUPS: tl.constexpr, D: tl.constexpr):
    """q · K^T [BLOCK_M, BLOCK_N] over int4-packed K rows, K never dequantized: a row's scale and shift (a group's)
    apply to the products, scale · (q · codes) + shift · Σ q, the codes going to the MMA as they load (q16, q_unit:
    _fp16_rows of q)."""
    codes = _int4_codes(rows, key_ok, GROUPS, D, stride_d)
    s = tl.zeros([q.shape[0], codes.shape[0]], tl.float32)
    for grp in tl.static_range(GROUPS):
        q_grp, q16_grp = q, q16
        if GROUPS > 1:
            in_group = _in_group(grp, GROUPS, D)[None, :]
            q_grp, q16_grp = tl.where(in_group, q, 0.0), tl.where(in_group, q16, 0.0)
        scale, shift = _half_pair(tl.load(rows + grp * stride_d, mask=key_ok, other=0))
        s += tl.dot(q16_grp, tl.trans(codes)) * (q_unit * 16777216.0)[:, None] * scale[None, :]
        s += tl.sum(q_grp.to(tl.float32), 1)[:, None] * shift[None, :]
    return s


@triton.jit
def _int4_values(p, rows, key_ok, stride_d, GROUPS: tl.constexpr, D: tl.constexpr):
    """p · V [BLOCK_M, D] over int4-packed V rows (p: fp32 [BLOCK_M, BLOCK_N] in [0, 1]), V never dequantized: a
    row's scale (a group's) scales p, its shift adds p · shift, and the codes go to the MMA as they load, against
    p · scale in fp16, each query row's weights brought below 1 by a power of two of their own (one power for the
    tile would tie a key's precision to the other keys' scales, masked ones included)."""
    codes = _int4_codes(rows, key_ok, GROUPS, D, stride_d)
    pv = tl.zeros([p.shape[0], D], tl.float32)
    for grp in tl.static_range(GROUPS):
        scale, shift = _half_pair(tl.load(rows + grp * stride_d, mask=key_ok, other=0))
        weights = p * scale[None, :]  # to fp16 after each row's power of two takes its largest |weight| below 1
        e = _exponent(tl.max(tl.abs(weights), 1), -126, 125) + 1
        part = tl.dot((weights * _pow2(-e)[:, None]).to(tl.float16), codes) * (_pow2(e) * 16777216.0)[:, None]
        part += tl.sum(p * shift[None, :], 1)[:, None]
        if GROUPS > 1:
            part = tl.where(_in_group(grp, GROUPS, D)[None, :], part, 0.0)
        pv += part
    return pv


@triton.jit
def _part(groups, heads, row_blocks, seqstart_q_ptr, seqstart_k_ptr, seqlen_k_ptr, Mq, Mk, splits, window_left,
          window_right, VARLEN: tl.constexpr, HAS_SEQLEN_K: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
          HEADS: tl.constexpr, QUERIES: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """What program (sequence, group, head block, row block) (id 0) takes of part `split` (id 1) of the keys:
    (sequence b, group g, first head, first query, q_start, q_len, k_start, k_len, batch (int64), the causal shift,
    [start, end) of its keys). The first head is the rows' shared KV head too (HEADS > 1: K/V's head stride is 0)."""
    head_blocks = tl.cdiv(heads, HEADS)
    pid = tl.program_id(0)
    row_block, head_block = pid % row_blocks, (pid // row_blocks) % head_blocks
    g, b = (pid // (row_blocks * head_blocks)) % groups, pid // (row_blocks * head_blocks * groups)
    q_start, q_len, k_start, k_len, _ = _sequence(
        b, seqstart_q_ptr, seqstart_k_ptr, seqlen_k_ptr, Mq, Mk, VARLEN, HAS_SEQLEN_K
    )
    batch = (b * (0 if VARLEN else 1)).to(tl.int64)  # (varlen: batch 0 holds every sequence) in 64 bits
    shift = k_len - q_len if BOTTOM_RIGHT else 0
    first_query = row_block * QUERIES
    lo, hi = _key_range(first_query, q_len, k_len, shift, window_left, window_right, QUERIES, BLOCK_N)
    per_split = tl.cdiv(tl.cdiv(hi - lo, splits), BLOCK_N) * BLOCK_N
    start = lo + tl.program_id(1) * per_split
    end = tl.minimum(hi, start + per_split)
    return b, g, head_block * HEADS, first_query, q_start, q_len, k_start, k_len, batch, shift, start, end


@triton.jit
def _whole_tiles(start, end, first_query, q_len, k_len, shift, window_left, window_right, QUERIES: tl.constexpr,
                 BLOCK_N: tl.constexpr):  # fmt: skip
    """[lo, hi): the tiles of a part's keys [start, end) (BLOCK_N keys from start on) that every query of the program
    sees whole and that end by `end`, whose scores need no mask: every tile but the last in decoding."""
    lo, hi = _unmasked_key_range(start, end, first_query, q_len, k_len, shift, window_left, window_right, QUERIES,
                                 BLOCK_N)  # fmt: skip
    return lo, tl.minimum(hi, start + (end - start) // BLOCK_N * BLOCK_N)


@triton.jit
def _masked(s, first_key, whole, query, keys, q_len, k_len, shift, window_left, window_right, end):
    """The scores s of keys [first_key, ...) (log2 units), -inf where a query does not see a key, unless the tile is
    one of the `whole` ones (_whole_tiles), which skip the mask (H100, PERF.md's decode shape, the Gluon kernels:
    int4 in pages of 64 110 -> 100.6 us, FP8 rows 151.4 -> 147.2, dense 127.1 -> 123.6; RESULTS.md, sixty-fifth
    session)."""
    if (first_key < whole[0]) | (first_key >= whole[1]):
        seen = _visible(query, keys, q_len, k_len, shift, window_left, window_right) & (keys < end)[None, :]
        s = tl.where(seen, s, float("-inf"))
    return s


@triton.jit
def _splitk_kernel(
    q_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, out_ptr, lse_ptr, seqstart_q_ptr, seqstart_k_ptr, seqlen_k_ptr,
    tables_ptr, groups, heads, row_blocks, Mq, Mk, lane, page_size, splits, scale_log2, window_left, window_right,
    stride_qb, stride_qm, stride_qg, stride_qh, stride_qd, stride_kb, stride_km, stride_kg, stride_kh, stride_kd,
    stride_vb, stride_vm, stride_vg, stride_vh, stride_vd, stride_ksb, stride_ksm, stride_ksg, stride_ksh, stride_vsb,
    stride_vsm, stride_vsg, stride_vsh, stride_os, stride_ob, stride_om, stride_og, stride_oh,
    stride_od, stride_ls, stride_lb, stride_lg, stride_lh, stride_lm, stride_tb, stride_tp,
    VARLEN: tl.constexpr, HAS_SEQLEN_K: tl.constexpr, PAGED: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
    UPCAST: tl.constexpr, INT4: tl.constexpr, GROUPS: tl.constexpr, FP8_SCALES: tl.constexpr, HEADS: tl.constexpr,
    QUERIES: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Program (sequence, group, head block, row block) (id 0) over part `split` (id 1) of the keys its queries
    see: rows r = (query q0 + r // HEADS, head h0 + r % HEADS), HEADS query heads that share one KV head (1 when K/V
    are not expanded over the heads). Writes the rows' output normalized over the part and their log-sum-exp
    (natural log; −inf over no key, output zeros)."""
    BLOCK_M: tl.constexpr = HEADS * QUERIES
    b, g, kv_head, first_query, q_start, q_len, k_start, k_len, batch, shift, start, end = _part(
        groups, heads, row_blocks, seqstart_q_ptr, seqstart_k_ptr, seqlen_k_ptr, Mq, Mk, splits, window_left,
        window_right, VARLEN, HAS_SEQLEN_K, BOTTOM_RIGHT, HEADS, QUERIES, BLOCK_N,
    )  # fmt: skip
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    query = first_query + rows // HEADS
    head = kv_head + rows % HEADS
    row_ok = (query < q_len) & (head < heads)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < D  # (constant where D is a power of two: loads stay whole vectors)
    q_rows = q_ptr + batch * stride_qb + (q_start + query).to(tl.int64) * stride_qm + g * stride_qg
    q_dims = _int4_order(dims) if INT4 else dims  # (int4 codes come in that order)
    q = tl.load(q_rows[:, None] + head[:, None] * stride_qh + q_dims[None, :] * stride_qd,
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # fmt: skip
    k_base = k_ptr + batch * stride_kb + g * stride_kg + kv_head * stride_kh
    v_base = v_ptr + batch * stride_vb + g * stride_vg + kv_head * stride_vh
    k_scales = k_scale_ptr + batch * stride_ksb + g * stride_ksg + kv_head * stride_ksh  # (FP8 rows: a scale a row)
    v_scales = v_scale_ptr + batch * stride_vsb + g * stride_vsg + kv_head * stride_vsh
    if INT4:
        q16, q_unit = _fp16_rows(q)
    if UPCAST:  # the interpreter multiplies bf16 dot operands as raw integers
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of the scores, log2 units
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    whole = _whole_tiles(start, end, first_query, q_len, k_len, shift, window_left, window_right, QUERIES, BLOCK_N)
    for first_key in range(start, end, BLOCK_N):
        keys = first_key + tl.arange(0, BLOCK_N)
        key_ok = keys < end
        if PAGED:  # the key's place in lane b, then its page
            place = k_start - b * lane + keys
            page = tl.load(tables_ptr + b.to(tl.int64) * stride_tb + (place // page_size) * stride_tp, mask=key_ok,
                           other=0)  # fmt: skip
            key_rows = page.to(tl.int64) * page_size + place % page_size
        else:
            key_rows = (k_start + keys).to(tl.int64)
        k_rows, v_rows = k_base + key_rows * stride_km, v_base + key_rows * stride_vm
        if INT4:
            s = _int4_scores(q, q16, q_unit, k_rows, key_ok, stride_kd, GROUPS, D)
        else:
            k = _kv_tile(k_rows, k_scales + key_rows * stride_ksm, key_ok, dims, dim_ok, stride_kd, FP8_SCALES)
            s = tl.dot(q, tl.trans(k.to(q.dtype)))
        s = _masked(s * scale_log2, first_key, whole, query, keys, q_len, k_len, shift, window_left, window_right, end)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_base = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet: exp2(-inf) = 0, no NaN
        alpha = tl.exp2(m_i - m_base)
        p = tl.exp2(s - m_base[:, None])
        if INT4:
            acc = acc * alpha[:, None] + _int4_values(p, v_rows, key_ok, stride_vd, GROUPS, D)
        else:
            v = _kv_tile(v_rows, v_scales + key_rows * stride_vsm, key_ok, dims, dim_ok, stride_vd, FP8_SCALES)
            acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc * alpha[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

    out = tl.where(l_i > 0, 1.0 / l_i, 0.0)[:, None] * acc
    out_rows = (out_ptr + split * stride_os + batch * stride_ob
                + (q_start + query).to(tl.int64) * stride_om + g * stride_og + head * stride_oh)  # fmt: skip
    tl.store(out_rows[:, None] + q_dims[None, :] * stride_od, out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & dim_ok[None, :])  # fmt: skip
    lse = tl.where(l_i > 0, (m_i + tl.log2(l_i)) / 1.4426950408889634, float("-inf"))
    lse_rows = (lse_ptr + split * stride_ls + batch * stride_lb + g * stride_lg + head * stride_lh
                + (q_start + query).to(tl.int64) * stride_lm)  # fmt: skip
    tl.store(lse_rows, lse, mask=row_ok)


def _paging(attn_bias) -> tuple[object, torch.Tensor | None, int, int]:
    """(the mask over keys laid out lane after lane, block_tables, lane, page_size) of a paged mask; the mask itself
    and (None, 0, 1) otherwise."""
    if isinstance(attn_bias, ab._Paged):
        tables = attn_bias.block_tables
        return attn_bias._unpaged(), tables, tables.shape[1] * attn_bias.page_size, attn_bias.page_size
    return attn_bias, None, 0, 1


def _wide_tiles(int4: bool, dim: int, paged: bool, page_size: int) -> bool:
    """Whether the Gluon kernels take 32 keys a tile, where measured faster than 16 (H100, PERF.md's decode shape,
    RESULTS.md, sixty-fifth and sixty-sixth sessions): int4 in pages of 32 keys or more, whose two pages a tile
    (triton_splitk_int4._tile_pages) then serve twice the keys (91.6 us against 100.5 in pages of 64), and dense at
    head dim 64 (56.7 against 68.4; 89.5 against 86.9 at 128, and in pages of 16 80.2 against 77.0); FP8 rows at head
    dim 64 (dense 72.4 against 77.7, pages of 16 / 64 77.8 / 70.7 against 83.7 / 83.3) and dense at 128 (110.2
    against 110.7), not in pages at 128 (spills: 141.7 against 117.1)."""
    if int4:
        return page_size >= 32 if paged else dim == 64
    return dim == 64 or not paged


def _config(q: torch.Tensor, kv: list[torch.Tensor], max_q: int, fixed: list[int], gluon: bool, wide: bool) -> dict:
    """Rows of a program: the query heads that share a KV head (kv: K, V and the FP8 rows' scales, all expanded over
    the heads with stride 0; up to 64), times as many queries as fit in 64 rows (at least 16 rows: the products'
    least M). Keys 128 a block (32 at head dims past 128), 2 stages, 8 warps for 16-bit K/V and 4 for quantized
    ones, which pass through registers (H100 sweeps at head dim 128: 64 keys a block and 4 warps took 1.02-1.03x
    the time on paged bf16 caches, 1.37x on FP8); fixed: (BLOCK_N, num_warps, num_stages) of an op's fixed
    configuration (FwOp.get_operator), 0 for these. gluon (triton_splitk_int4's and triton_splitk_fp8's kernels):
    16 rows and one warp a program, 16 keys a block, 32 when `wide` (_wide_tiles)."""
    block_n, warps, stages = fixed
    heads = q.shape[3]
    rows = 16 if gluon else _MAX_ROWS  # (gluon: mma.sync's M)
    shared = heads > 1 and all(t.stride(3) == 0 for t in kv)
    per_program = min(launch.next_power_of_2(heads), rows) if shared else 1
    queries = max(16 // per_program, min(launch.next_power_of_2(max(max_q, 1)), rows // per_program))
    if gluon:
        return {
            "HEADS": per_program,
            "QUERIES": queries,
            "BLOCK_N": block_n or (32 if wide else 16),
            "num_warps": 1,
        }
    block_d = launch.next_power_of_2(max(q.shape[-1], 16))
    return {
        "HEADS": per_program,
        "QUERIES": queries,
        "BLOCK_N": block_n or (128 if block_d <= 128 else 32),
        "BLOCK_D": block_d,
        "num_warps": warps or (4 if kv[0].dtype != q.dtype else 8),
        "num_stages": stages or 2,
    }


# Programs an SM of each kernel variant compiled here (_parts): keyed by what its compile depends on but the arguments'
# alignment and integer ranges (which barely move its registers), so that a launch computes no specialization for it.
_PROGRAMS_PER_SM: dict[tuple, int] = {}
# Where the compiled kernel's cannot be read (the interpreter, ROCm): 8 one-warp Gluon programs (255 registers), 2 else
_GLUON_PROGRAMS_PER_SM, _TRITON_PROGRAMS_PER_SM = 8, 2


def _parts(kernel, q: torch.Tensor, output_dtype, programs: int, keys: int, least: int, arguments, kwargs) -> int:
    """The key parts of each of `programs` (`keys` keys, parts of `least` at least) that run in the fewest waves of
    as many programs an SM as the compiled kernel lets run at once: the Gluon kernels take 128-255 registers of one
    warp, 8-16 programs an SM (triton_splitk_int4 at head dim 128 dense: 168, 12 an SM; with a varlen mask 255, 8).
    The kernel is compiled for a provisional count on the first call with its constexprs."""
    fallback = _TRITON_PROGRAMS_PER_SM if kernel is _splitk_kernel else _GLUON_PROGRAMS_PER_SM
    if not q.is_cuda:
        return launch.fewest_waves(programs, keys, 4 * fallback, least)  # 4 SMs: a few parts under the interpreter
    device = q.device
    sms = arch.sm_count(device)
    split_k = launch.fewest_waves(programs, keys, sms * fallback, least)
    key = (kernel, device, q.dtype, output_dtype, split_k == 1, *kwargs.items())
    per_sm = _PROGRAMS_PER_SM.get(key)
    if per_sm is None:
        compiled = launch.compiled(kernel, *arguments(split_k)[2], **kwargs)
        per_sm = _PROGRAMS_PER_SM[key] = launch.programs_per_sm(compiled, device) or fallback
    return launch.fewest_waves(programs, keys, sms * per_sm, least)


def _splitk_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_scales: torch.Tensor | None,
    value_scales: torch.Tensor | None,
    seqstart_q: torch.Tensor | None,
    seqstart_k: torch.Tensor | None,
    seqlen_k: torch.Tensor | None,
    block_tables: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    lane: int,
    page_size: int,
    scale: float,
    window_left: int,
    window_right: int,
    bottom_right: bool,
    output_dtype: torch.dtype,
    split_k: int,
    int4_groups: int,
    config: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """out [B, Mq, G, H, K] and LSE [B, G, H, Mq] (fp32) of [B, M, (G,) H, K] inputs. key_scales / value_scales
    [B, M, (G,) H]: the scales of FP8 rows (K/V int32 of four FP8 values each), else None; split_k: the key parts
    (0: the fewest waves); int4_groups: K/V's scale groups a row when they are int4-packed (int32), else 0; config:
    (BLOCK_N, num_warps, num_stages), 0 for the default."""
    q, k, v = (_bmghk(t) for t in (query, key, value))
    scales = [t if t is None or t.dim() == 4 else t.unsqueeze(2) for t in (key_scales, value_scales)]
    batch, mq, groups, heads, dim = q.shape
    varlen = seqstart_q is not None
    sequences = seqstart_q.numel() - 1 if varlen else batch
    max_q, max_k = (max_seqlen_q, max_seqlen_k) if varlen else (mq, k.shape[1])
    out = torch.empty((batch, mq, groups, heads, dim), dtype=output_dtype, device=q.device)
    lse = torch.empty((batch, groups, heads, mq), dtype=torch.float32, device=q.device)
    if out.numel() == 0 or max_q == 0:
        out.zero_()
        lse.fill_(-math.inf)
        return out, lse
    from mslk.attention.fmha import triton_splitk_fp8, triton_splitk_int4  # (they import this module)

    gluon_int4 = int4_groups == 1 and triton_splitk_int4.supports(q)
    # (FP8: pools of fewer than 2^31 rows, whose row numbers the Gluon kernel takes in int32)
    gluon_fp8 = scales[0] is not None and k.shape[1] < 2**31 and triton_splitk_fp8.supports(q)
    gluon = gluon_int4 or gluon_fp8
    if scales[0] is not None and not gluon_fp8:  # FP8 rows: the Triton kernel reads the values through fp8 views
        k, v = (t.view(arch.fp8_dtype(q.device)) for t in (k, v))
    kv = [k, v, *(t for t in scales if t is not None)]
    cfg = _config(q, kv, max_q, config, gluon, _wide_tiles(gluon_int4, dim, block_tables is not None, page_size))
    programs = sequences * groups * launch.cdiv(heads, cfg["HEADS"]) * launch.cdiv(max_q, cfg["QUERIES"])
    tables = block_tables if block_tables is not None else seqstart_q
    table_strides = block_tables.stride() if block_tables is not None else (0, 0)
    if scales[0] is None:  # K in the scales' places, never read
        fp8_scales, scales, scale_strides = 0, [k, k], (0,) * 8
    else:
        fp8_scales = 2 if scales[0].dtype == torch.float32 else 1
        scale_strides = (*scales[0].stride(), *scales[1].stride())
    kwargs = {"VARLEN": varlen, "HAS_SEQLEN_K": seqlen_k is not None, "PAGED": block_tables is not None,
              "BOTTOM_RIGHT": bottom_right, **cfg}  # fmt: skip
    # The Gluon kernels read a tile's two pages at most where pages hold a tile (_tile_pages), a key's page otherwise.
    big_pages = block_tables is not None and page_size >= cfg["BLOCK_N"]
    if gluon_int4:
        kernel = triton_splitk_int4.int4_kernel
        kwargs.update(D=dim, BIG_PAGES=big_pages)
    elif gluon_fp8:
        kernel = triton_splitk_fp8.fp8_kernel
        kwargs.update(D=dim, V_LAYOUT=triton_splitk_fp8.value_layout(cfg["BLOCK_N"], dim), BIG_PAGES=big_pages)
    else:
        kernel = _splitk_kernel
        kwargs.update(UPCAST=q.dtype == torch.bfloat16 and not q.is_cuda, INT4=int4_groups > 0,
                      GROUPS=max(int4_groups, 1), D=dim, FP8_SCALES=fp8_scales)  # fmt: skip

    def arguments(split_k: int) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        """The parts' outputs and log-sum-exps (out and lse themselves for one part) and the kernel's arguments."""
        if split_k == 1:
            partial, partial_lse = out[None], lse[None]
        else:
            partial = q.new_empty((split_k, batch, mq, groups, heads, dim), dtype=torch.float32)
            partial_lse = q.new_empty((split_k, batch, groups, heads, mq), dtype=torch.float32)
        sizes = (seqstart_q, seqstart_k, seqlen_k, tables, groups, heads, launch.cdiv(max_q, cfg["QUERIES"]), mq,
                 k.shape[1], lane, page_size, split_k, scale * _LOG2E, window_left, window_right)  # fmt: skip
        strides = (*partial.stride(), *partial_lse.stride(), *table_strides)  # the outputs' and the page table's
        inputs = (q, k, v) if gluon_int4 else (q, k, v, *scales)
        kv_strides = (*k.stride(), *v.stride()) if gluon_int4 else (*k.stride(), *v.stride(), *scale_strides)
        return partial, partial_lse, (*inputs, partial, partial_lse, *sizes, *q.stride(), *kv_strides, *strides)

    if not split_k:
        split_k = _parts(kernel, q, output_dtype, programs, max_k, 4 * cfg["BLOCK_N"], arguments, kwargs)
    partial, partial_lse, args = arguments(split_k)
    launch.fast(kernel)[(programs, split_k)](*args, **kwargs)
    if split_k > 1:
        merge.merge_stacked_into(partial, partial_lse, out, lse)
    return out, lse


_splitk_forward_op = torch.library.custom_op("mslk_triton::splitk_attention_forward", _splitk_forward,
                                             mutates_args=())  # fmt: skip


@_splitk_forward_op.register_fake
def _splitk_forward_fake(query, key, value, *args):
    output_dtype = args[-4]  # (output_dtype, split_k, int4_groups, config) end the arguments
    q = _bmghk(query)
    batch, mq, groups, heads, dim = q.shape
    return q.new_empty((batch, mq, groups, heads, dim), dtype=output_dtype), q.new_empty(
        (batch, groups, heads, mq), dtype=torch.float32
    )


def _fp8_rows_reasons(d: InputsFp8) -> list[str]:
    """Why K/V in FP8 rows (kv_cache.quantize_kv_fp8) cannot be read here: their packing, their scales, the GPU."""
    dim = d.query.shape[-1]
    scale_dtype = torch.float32 if d.use_fp32_scales else torch.int32
    reasons = []
    for name, packed, scales in (("key", d.key, d.k_fp8_scale_shift), ("value", d.value, d.v_fp8_scale_shift)):
        if packed.dtype != torch.int32 or packed.shape[-1] * 4 != dim:
            reasons.append(
                f"InputsFp8: {name} must be int32 of four FP8 values each, [..., {dim} / 4] (kv_cache."
                f"quantize_kv_fp8), got {packed.dtype} {tuple(packed.shape)}"
            )
        if scales is None or scales.dtype != scale_dtype or scales.shape != packed.shape[:-1]:
            got = "None" if scales is None else f"{scales.dtype} {tuple(scales.shape)}"
            reasons.append(
                f"InputsFp8: {name}'s scales must be {scale_dtype} {tuple(packed.shape[:-1])} (a scale a row; "
                f"use_fp32_scales={d.use_fp32_scales}), got {got}"
            )
    missing = arch.fp8_e4m3_missing(d.query)
    return reasons if missing is None else [*reasons, missing]


class FwOp(AttentionFwOpBase):
    """MSLK's Triton split-K decoding forward (see the module docstring)."""

    OPERATOR = _splitk_forward_op if registry.triton_missing() is None else None
    NOT_BUILT_REASON = registry.triton_missing() or ""
    NAME = "triton_splitKF"
    SUPPORTED_DEVICES = frozenset({"cuda"})  # the interpreter's CPU path is for tests, which call apply directly
    CUDA_MINIMUM_COMPUTE_CAPABILITY = (8, 0)
    SUPPORTED_DTYPES = frozenset({torch.float16, torch.bfloat16})
    SUPPORTED_MIN_K = 1  # head dims pad to a power of two of at least 16 in the kernel
    SUPPORTED_MAX_K = 256
    SUPPORTED_ATTN_BIAS_TYPES = bias_types("None B11-B19 B21 B22")
    SUPPORTS_CUSTOM_SCALE = True
    SUPPORTS_BMGHK = True
    SUPPORTS_PARTIAL = True
    SUPPORTS_OUTPUT_DTYPE = True
    SUPPORTS_QUANTIZED_INPUTS = True  # K/V int4-packed or in FP8 rows (InputsFp8): kv_cache's formats
    VARLEN_LSE_PACKED = True
    # Kernel configuration: None lets the heuristics choose (AUTOTUNE, upstream's autotuning, takes them too).
    SPLIT_K: int | None = None
    BLOCK_M: int | None = None  # rows come from the heads and queries (_config): kept for code that sets it
    BLOCK_N: int | None = None
    NUM_WARPS: int | None = None
    NUM_STAGES: int | None = None
    SPLIT_K_EARLY_EXIT: bool | None = None  # parts past a sequence's keys stop at once anyway
    AUTOTUNE: bool = False
    NUM_GROUPS: int = 1  # scale groups a row of int4-packed K/V (1, 2, 4 or 8; set it in a subclass)

    @classmethod
    def not_supported_reasons(cls, d: Inputs) -> list[str]:
        reasons = super().not_supported_reasons(d)
        fp8_queries = isinstance(d, InputsFp8) and d.q_fp8_scale_shift is not None
        if isinstance(d, InputsMXFp8) or d.quantize_qk_to_fp8 or d.quantize_pv_to_fp8 or fp8_queries:
            reasons.append(
                "FP8 queries or products and MX FP8 K/V (quantize_*_to_fp8, q_fp8_scale_shift, InputsMXFp8) not "
                "supported: K/V in FP8 rows (InputsFp8) or int4-packed"
            )
        elif isinstance(d, InputsFp8):
            reasons += _fp8_rows_reasons(d)
        elif d.key.dtype == torch.int32:
            dim, packed = d.query.shape[-1], d.key.shape[-1]
            least = max(16, 8 * cls.NUM_GROUPS)  # (16: the kernel's narrowest tile)
            if dim & (dim - 1) or dim < least or packed != dim // 8 + cls.NUM_GROUPS:
                reasons.append(
                    f"int4-packed K/V of head dim {dim} in {cls.NUM_GROUPS} scale group(s) need a power of two of at "
                    f"least {least} and {dim // 8 + cls.NUM_GROUPS} int32 a row (quantize_kv_int4), got {packed}"
                )
        return _switch_reasons(reasons, d)

    @classmethod
    def apply(cls, inp: Inputs, needs_gradient: bool) -> tuple[torch.Tensor, Context | None]:
        mask, block_tables, lane, page_size = _paging(inp.attn_bias)
        varlen = varlen_args(mask)
        alignment, window_left, window_right = _alignment(inp)
        sequences = (None, None, None, 0, 0) if varlen is None else (
            varlen.seqstart_q, varlen.seqstart_k, varlen.seqlen_k, varlen.max_seqlen_q, varlen.max_seqlen_k
        )  # fmt: skip
        fp8_rows = isinstance(inp, InputsFp8)
        scales = (inp.k_fp8_scale_shift, inp.v_fp8_scale_shift) if fp8_rows else (None, None)
        int4_groups = cls.NUM_GROUPS if inp.key.dtype == torch.int32 and not fp8_rows else 0
        out, lse = _launches(_splitk_forward_op, _splitk_forward)(
            inp.query, inp.key, inp.value, *scales, *sequences[:3], block_tables, *sequences[3:], lane, page_size,
            inp.scale_float, window_left, window_right, alignment == "bottom-right", inp.get_output_dtype(),
            cls.SPLIT_K or 0, int4_groups, [cls.BLOCK_N or 0, cls.NUM_WARPS or 0, cls.NUM_STAGES or 0],
        )  # fmt: skip
        if inp.query.dim() == 4:
            out, lse = out[:, :, 0], lse[:, 0]
        return out, Context(lse=lse, out=out) if needs_gradient else None

    @classmethod
    @functools.cache
    def get_operator(
        cls,
        splitk: int,
        *,
        block_m: int | None = None,
        block_n: int | None = None,
        num_warps: int | None = None,
        num_stages: int | None = None,
        split_k_early_exit: bool | None = None,
    ) -> type[FwOp]:
        """This operator with a fixed configuration (one class per configuration)."""
        config = {
            "NAME": f"{cls.NAME}_S{splitk}",
            "SPLIT_K": splitk,
            "BLOCK_M": block_m,
            "BLOCK_N": block_n,
            "NUM_WARPS": num_warps,
            "NUM_STAGES": num_stages,
            "SPLIT_K_EARLY_EXIT": split_k_early_exit,
        }
        return type(f"FwOp_S{splitk}", (cls,), {**config, "__module__": __name__})


FwOp_S1 = FwOp.get_operator(1)
FwOp_S2 = FwOp.get_operator(2)
FwOp_S4 = FwOp.get_operator(4)
FwOp_S8 = FwOp.get_operator(8)
FwOp_S16 = FwOp.get_operator(16)
FwOp_S32 = FwOp.get_operator(32)
FwOp_S48 = FwOp.get_operator(48)
FwOp_S64 = FwOp.get_operator(64)
FwOp_S72 = FwOp.get_operator(72)
FwOp_S80 = FwOp.get_operator(80)
FwOp_S96 = FwOp.get_operator(96)
FwOp_S112 = FwOp.get_operator(112)
FwOp_S128 = FwOp.get_operator(128)
