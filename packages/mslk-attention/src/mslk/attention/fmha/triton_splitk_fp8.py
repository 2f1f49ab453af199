"""triton_splitk's kernel for FP8 rows (InputsFp8, kv_cache.quantize_kv_fp8) of head dim 64 or 128 on NVIDIA GPUs
(SM89 on), written in Gluon as triton_splitk_int4's kernel is: one warp a program, K/V loaded straight into
registers of mma.sync's operand layout, the rows never dequantized, no shared memory and no barrier.

H100, PERF.md's decode shape (16 x 8192 keys, 32 query heads over 8 KV heads, head dim 128), us: 105.5 on a dense
cache and 115.9 in pages of 64 against the Triton kernel's 128.3 and 175.0 (SDPA on the bf16 cache 171-173; `mslk
bench --op attention_decode`). The Triton kernel dequantizes each tile in fp32 and moves it through shared memory
behind CTA barriers. The dense kernel reads at 83% of the DRAM's peak (ncu): what is left is the rows' access
pattern (RESULTS.md, sixty-sixth session).

K/V load as their int32 words of four e4m3 values (the cache's own type), and stay words until the MMAs: one
`cvt.rn.f16x2.e4m3x2` turns half a word into an operand's fp16 pair. Loaded as FP8 elements, the next tile (carried
across the loop) took a register a value and was unpacked and repacked byte by byte: 786 instructions a tile
against 511 (1075 against 724 paged, with spills), 123.5 and 147.2 us (RESULTS.md, sixty-sixth session).

- K^T, the B operand [D, BLOCK_N]: lane (n, c) (n = lane // 4, c = lane % 4) holds dims 2c + h + 8a + 16s of key n
  + 8r. It loads 16 bytes at dim 64u + 16c of its keys, and consecutive values are the operand's fp16 pairs (a word's
  halves): the queries are loaded in that order (_key_dim), so q · K^T is unchanged.
- V, the B operand [BLOCK_N, D]: lane (g, c) holds keys 2c + h + 8r at dims g + 8m; a pair is two keys at one dim.
  It loads D / 8 dims (one vector) from dim g · D / 8 of each of its keys, and a PRMT puts a byte of two keys' words
  side by side: the output is stored in triton_splitk_int4._value_dim's order.

Values go to fp16 MMAs as they are (e4m3 is exact in fp16) against the queries in fp16 under a power of two a row,
and a row's scale and shift apply to the products as in the int4 kernel: scale · (q · values) + shift · Σ q for the
scores, p · scale under a power of two per row and p · shift for the output. Paged, each tile's rows are read from
the page table a tile ahead, so that the tile's loads do not wait for them (192.6 us without, sixty-fourth session),
and carried as int32, V's serving as the scales' too. In pages of a tile or more the rows come from the tile's two
pages at most (triton_splitk_int4._tile_pages).
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from mslk.attention.fmha.triton_splitk import _half_pair, _masked, _part, _pow2, _whole_tiles
from mslk.attention.fmha.triton_splitk_int4 import (
    HEAD_DIMS,
    _fp16_queries,
    _fp16_weights,
    _rows,
    _softmax_step,
    _store_rows,
    _tile_pages,
)
from mslk.core import arch

# The fp16 pairs of the word $2's (given twice) low and high halves, two e4m3 values each (exact in fp16).
_WORD_PAIRS_PTX = gl.constexpr(
    "{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, $2;\ncvt.rn.f16x2.e4m3x2 $0, lo;\ncvt.rn.f16x2.e4m3x2 $1, hi;\n}"
)
# The fp16 pairs of byte b of two keys' words ($4 and $6, each given twice; the first key in the low half), b in $b:
# PRMTs put bytes 0 and 1, and 2 and 3, of both in one register each.
_KEY_PAIRS_PTX = gl.constexpr(
    "{\n.reg .b32 x, y;\n.reg .b16 x0, x1, y0, y1;\nprmt.b32 x, $4, $6, 0x5140;\nprmt.b32 y, $4, $6, 0x7362;\n"
    "mov.b32 {x0, x1}, x;\nmov.b32 {y0, y1}, y;\ncvt.rn.f16x2.e4m3x2 $0, x0;\ncvt.rn.f16x2.e4m3x2 $1, x1;\n"
    "cvt.rn.f16x2.e4m3x2 $2, y0;\ncvt.rn.f16x2.e4m3x2 $3, y1;\n}"
)


@triton.jit
def _key_dim(t):
    """The dim of a K row (and of q) at index t of the K^T operand's dims: t = 64u + 16b + 8a + 2c + h holds value
    4b + 2a + h of lane c's 16 bytes at dim 64u + 16c."""
    u, b, a, c, h = t >> 6, (t >> 4) & 3, (t >> 3) & 1, (t >> 1) & 3, t & 1
    return 64 * u + 16 * c + 4 * b + 2 * a + h


@functools.cache
def value_layout(block_n: int, dim: int) -> gl.DistributedLinearLayout:
    """V's load layout of words [BLOCK_N, D / 4]: lane (g, c) words g · D / 32 + m (a vector) of keys 2c + h + 8r
    (kept: building one took 15 us of a launch's host time)."""
    words = [[0, 1 << i] for i in range((dim // 32).bit_length() - 1)]
    keys = [[1, 0]] + [[8 << i, 0] for i in range((block_n // 8).bit_length() - 1)]
    return gl.DistributedLinearLayout(
        reg_bases=words + keys,
        lane_bases=[[2, 0], [4, 0], [0, dim // 32], [0, dim // 16], [0, dim // 8]],
        warp_bases=[],
        block_bases=[],
        shape=[block_n, dim // 4],
    )


@gluon.jit
def _key_values(words, b_layout: gl.constexpr):
    """K^T [D, BLOCK_N], the fp16 B operand of the values, from words [BLOCK_N, D / 4] (lane c holding words 16u + 4c
    + b of its keys)."""
    BN: gl.constexpr = words.shape[0]
    D: gl.constexpr = words.shape[1] * 4
    w = words.reshape([BN, D // 64, 4, 4])  # [key, u, c, b]
    n = gl.inline_asm_elementwise(_WORD_PAIRS_PTX, "=r,=r,r,r", [gl.join(w, w)], dtype=[gl.float16] * 2,
                                  is_pure=True, pack=2)  # fmt: skip
    values = gl.join(n[0], n[1])  # [key, u, c, b, h, a]: value 4b + 2a + h of lane c's 16 bytes
    values = values.permute((0, 1, 3, 5, 2, 4)).reshape([BN, D])  # to the operand's [u, b, a, c, h]
    return gl.convert_layout(values.permute((1, 0)), b_layout)


@gluon.jit
def _value_values(words, b_layout: gl.constexpr):
    """V [BLOCK_N, D], the fp16 B operand of the values (dims in _value_dim's order), from words [BLOCK_N, D / 4]
    (value_layout)."""
    BN: gl.constexpr = words.shape[0]
    D: gl.constexpr = words.shape[1] * 4
    # registers reordered (same lanes: no shuffle) with a key pair's words side by side, as the split and the inline
    # assembly's element pairs below need (in value_layout's order half the words went unread: offline PTX)
    words = gl.convert_layout(words, gl.BlockedLayout([2, D // 32], [4, 8], [1, 1], [0, 1]))
    first, second = gl.split(words.reshape([BN // 2, 2, D // 4]).permute((0, 2, 1)))  # keys 2k and 2k + 1
    n = gl.inline_asm_elementwise(_KEY_PAIRS_PTX, "=r,=r,=r,=r,r,r,r,r", [gl.join(first, first),
                                  gl.join(second, second)], dtype=[gl.float16] * 4, is_pure=True,
                                  pack=2)  # fmt: skip
    values = gl.join(gl.join(n[0], n[1]), gl.join(n[2], n[3]))  # [k, word, h, b0, b1]: byte b0 + 2 b1 of key 2k + h
    values = values.permute((0, 2, 1, 4, 3)).reshape([BN, D])  # [key, dim]
    # D / 8 dims of a key from dim g · D / 8 = [key, g, m] to the operand's dim g + 8m
    values = values.reshape([BN, 8, D // 8]).permute((0, 2, 1)).reshape([BN, D])
    return gl.convert_layout(values, b_layout)


@gluon.jit
def _key_rows(first_key, end, k_start, b, lane, page_size, tables_ptr, stride_tb, stride_tp, pages, PAGED: gl.constexpr,
              BIG_PAGES: gl.constexpr, BLOCK_N: gl.constexpr, layout: gl.constexpr):  # fmt: skip
    """The rows (int32: the host takes pools of fewer than 2^31) of keys [first_key, first_key + BLOCK_N) in
    `layout`; paged in big pages, from `pages` (the tile's _tile_pages). Keys from `end` on take the row of key
    end - 1 (the part's last): no load is masked, and the scores mask those keys."""
    keys = gl.minimum(first_key + gl.arange(0, BLOCK_N, layout=layout), end - 1)
    return _rows(keys, k_start, b, lane, page_size, tables_ptr, stride_tb, stride_tp, pages, PAGED, BIG_PAGES, gl.int32)


@gluon.jit
def _tile_rows(first_key, end, k_start, b, lane, page_size, tables_ptr, stride_tb, stride_tp, PAGED: gl.constexpr,
               BIG_PAGES: gl.constexpr, BLOCK_N: gl.constexpr, k_layout: gl.constexpr,
               V_LAYOUT: gl.constexpr):  # fmt: skip
    """The rows of keys [first_key, first_key + BLOCK_N) in K's and V's layouts."""
    pages = 0
    if BIG_PAGES:
        pages = _tile_pages(first_key, end, k_start, b, lane, page_size, tables_ptr, stride_tb, stride_tp, BLOCK_N,
                            gl.int32)  # fmt: skip
    k_rows = _key_rows(first_key, end, k_start, b, lane, page_size, tables_ptr, stride_tb, stride_tp, pages, PAGED,
                       BIG_PAGES, BLOCK_N, gl.SliceLayout(1, k_layout))  # fmt: skip
    v_rows = _key_rows(first_key, end, k_start, b, lane, page_size, tables_ptr, stride_tb, stride_tp, pages, PAGED,
                       BIG_PAGES, BLOCK_N, gl.SliceLayout(1, V_LAYOUT))  # fmt: skip
    return k_rows, v_rows


@gluon.jit
def _load_tile(rows, k_base, v_base, k_scales, v_scales, stride_km, stride_kd, stride_vm, stride_vd, stride_ksm,
               stride_vsm, D: gl.constexpr, key_layout: gl.constexpr, k_layout: gl.constexpr,
               V_LAYOUT: gl.constexpr):  # fmt: skip
    """The keys' (rows: _tile_rows) K and V scales [BLOCK_N] (key_layout) and words of four FP8 values [BLOCK_N, D / 4]
    (k_layout, V_LAYOUT)."""
    k_rows, v_rows = rows
    scale_rows = gl.convert_layout(v_rows, key_layout).to(gl.int64)  # (a lane holds the same keys in both)
    k_heads, v_heads = gl.load(k_scales + scale_rows * stride_ksm), gl.load(v_scales + scale_rows * stride_vsm)
    k_words = gl.arange(0, D // 4, layout=gl.SliceLayout(0, k_layout))
    k = gl.load(k_base + (k_rows.to(gl.int64) * stride_km)[:, None] + k_words[None, :] * stride_kd)
    v_words = gl.arange(0, D // 4, layout=gl.SliceLayout(0, V_LAYOUT))
    v = gl.load(v_base + (v_rows.to(gl.int64) * stride_vm)[:, None] + v_words[None, :] * stride_vd)
    return k_heads, v_heads, k, v


@gluon.jit
def _scale_shift(heads):
    """A row's (scale, shift) in fp32: fp16 scale and shift in an int32, or an fp32 scale (use_fp32_scales)."""
    if heads.dtype == gl.float32:
        scale, shift = heads, gl.zeros_like(heads)
    else:
        scale, shift = _half_pair(heads)
    return scale, shift


@gluon.jit
def fp8_kernel(
    q_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, out_ptr, lse_ptr, seqstart_q_ptr, seqstart_k_ptr, seqlen_k_ptr,
    tables_ptr, groups, heads, row_blocks, Mq, Mk, lane, page_size, splits, scale_log2, window_left, window_right,
    stride_qb, stride_qm, stride_qg, stride_qh, stride_qd, stride_kb, stride_km, stride_kg, stride_kh, stride_kd,
    stride_vb, stride_vm, stride_vg, stride_vh, stride_vd, stride_ksb, stride_ksm, stride_ksg, stride_ksh, stride_vsb,
    stride_vsm, stride_vsg, stride_vsh, stride_os, stride_ob, stride_om, stride_og, stride_oh,
    stride_od, stride_ls, stride_lb, stride_lg, stride_lh, stride_lm, stride_tb, stride_tp,
    VARLEN: gl.constexpr, HAS_SEQLEN_K: gl.constexpr, PAGED: gl.constexpr, BIG_PAGES: gl.constexpr,
    BOTTOM_RIGHT: gl.constexpr, HEADS: gl.constexpr, QUERIES: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
    V_LAYOUT: gl.constexpr,
):  # fmt: skip
    """triton_splitk._splitk_kernel's program (one warp, 16 rows) for FP8 rows, their scales in k_scale_ptr and
    v_scale_ptr; BIG_PAGES: paged in pages of at least BLOCK_N keys (_tile_pages)."""
    BLOCK_M: gl.constexpr = 16  # rows (query heads x queries): mma.sync's M
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, mma)
    key_layout: gl.constexpr = gl.SliceLayout(0, mma)
    k_layout: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [1, 1], [1, 0])  # lane (n, c): 16 bytes of key n

    b, g, first_head, first_query, q_start, q_len, k_start, k_len, batch, shift, start, end = _part(
        groups, heads, row_blocks, seqstart_q_ptr, seqstart_k_ptr, seqlen_k_ptr, Mq, Mk, splits, window_left,
        window_right, VARLEN, HAS_SEQLEN_K, BOTTOM_RIGHT, HEADS, QUERIES, BLOCK_N,
    )  # fmt: skip
    q_rows = q_ptr + batch * stride_qb + g * stride_qg
    k_base = k_ptr + batch * stride_kb + g * stride_kg + first_head * stride_kh
    v_base = v_ptr + batch * stride_vb + g * stride_vg + first_head * stride_vh
    k_scales = k_scale_ptr + batch * stride_ksb + g * stride_ksg + first_head * stride_ksh
    v_scales = v_scale_ptr + batch * stride_vsb + g * stride_vsg + first_head * stride_vsh

    q16, q_unit, q_sum = _fp16_queries(q_rows, q_start, first_query, first_head, q_len, heads, stride_qm, stride_qh,
                                       stride_qd, scale_log2, 1.0, HEADS, D, _key_dim, a_layout,
                                       row_layout)  # fmt: skip

    rows = gl.arange(0, BLOCK_M, layout=row_layout)
    query, head = first_query + rows // HEADS, first_head + rows % HEADS
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_layout)
    l_i = gl.zeros([BLOCK_M], gl.float32, row_layout)
    shifts = gl.zeros([BLOCK_M], gl.float32, row_layout)  # Σ p · V's shift, added to every dim at the end
    acc = gl.zeros([BLOCK_M, D], gl.float32, mma)
    if start < end:  # (keys past the end read key end - 1's rows: an empty part, of no key at all, reads none)
        whole = _whole_tiles(start, end, first_query, q_len, k_len, shift, window_left, window_right, QUERIES, BLOCK_N)
        first_rows = _tile_rows(start, end, k_start, b, lane, page_size, tables_ptr, stride_tb, stride_tp, PAGED,
                                BIG_PAGES, BLOCK_N, k_layout, V_LAYOUT)  # fmt: skip
        tile = _load_tile(first_rows, k_base, v_base, k_scales, v_scales, stride_km, stride_kd, stride_vm, stride_vd,
                          stride_ksm, stride_vsm, D, key_layout, k_layout, V_LAYOUT)  # fmt: skip
        ahead = _tile_rows(start + BLOCK_N, end, k_start, b, lane, page_size, tables_ptr, stride_tb, stride_tp, PAGED,
                           BIG_PAGES, BLOCK_N, k_layout, V_LAYOUT)  # fmt: skip
        for first_key in range(start, end, BLOCK_N):
            k_heads, v_heads, k, v = tile
            # the next tile's loads in flight while this one is multiplied (past the end: the last key's again);
            # paged, its rows read from the page table a tile before, so that its loads do not wait for them
            tile_rows = ahead
            if PAGED:
                ahead = _tile_rows(first_key + 2 * BLOCK_N, end, k_start, b, lane, page_size, tables_ptr, stride_tb,
                                   stride_tp, PAGED, BIG_PAGES, BLOCK_N, k_layout, V_LAYOUT)  # fmt: skip
            else:
                tile_rows = _tile_rows(first_key + BLOCK_N, end, k_start, b, lane, page_size, tables_ptr, stride_tb,
                                       stride_tp, PAGED, BIG_PAGES, BLOCK_N, k_layout, V_LAYOUT)  # fmt: skip
            tile = _load_tile(tile_rows, k_base, v_base, k_scales, v_scales, stride_km, stride_kd, stride_vm,
                              stride_vd, stride_ksm, stride_vsm, D, key_layout, k_layout, V_LAYOUT)  # fmt: skip
            keys = first_key + gl.arange(0, BLOCK_N, layout=key_layout)
            k_scale, k_shift = _scale_shift(k_heads)
            s = mma_v2(q16, _key_values(k, b_layout), gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma))
            s = s * q_unit[:, None] * k_scale[None, :] + q_sum[:, None] * k_shift[None, :]
            s = _masked(s, first_key, whole, query, keys, q_len, k_len, shift, window_left, window_right, end)
            p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i)
            v_scale, v_shift = _scale_shift(v_heads)
            w16, e = _fp16_weights(p, v_scale, a_layout, True)
            part = mma_v2(w16, _value_values(v, b_layout), gl.zeros([BLOCK_M, D], gl.float32, mma))
            acc = acc * alpha[:, None] + part * _pow2(e)[:, None]
            shifts = shifts * alpha + gl.sum(p * v_shift[None, :], 1)

    _store_rows(acc, shifts, m_i, l_i, out_ptr, lse_ptr, query, head, q_start, q_len, heads, batch, g, stride_os,
                stride_ob, stride_om, stride_og, stride_oh, stride_od, stride_ls, stride_lb, stride_lg, stride_lh,
                stride_lm, D, mma)  # fmt: skip


def supports(q: torch.Tensor) -> bool:
    """Whether the kernel serves these [B, M, G, H, K] queries over FP8 rows: on an NVIDIA GPU of SM89 on (e4m3
    conversions, mma.sync), a head dim of triton_splitk_int4.HEAD_DIMS."""
    return q.is_cuda and arch.is_cuda() and arch.capability(q.device) >= (8, 9) and q.shape[-1] in HEAD_DIMS
