"""triton_splitk's kernel for int4-packed K/V on NVIDIA GPUs (SM80 on), written in Gluon: one warp a program,
the codes unpacked in registers straight into mma.sync's operand layout.

The Triton kernel (triton_splitk._splitk_kernel) unpacks a tile of codes in a blocked layout and moves it through
shared memory into the MMA's operand layout, behind CTA barriers, twice an iteration: with a few programs an SM
that chain sets its time (H100: 0.336 ms on PERF.md's decode shape, half SDPA's speed on a cache 4x the size).
Here each program is one warp, with its own online softmax, so nothing waits on another warp, and many programs
share an SM (0.089 ms there, 2.0x SDPA's); each thread loads the words whose nibbles are its operand elements and
turns them into fp16 pairs with shifts and masks:

- K^T, the B operand [D, BLOCK_N]: lane (n, c) of a warp (n = lane // 4, c = lane % 4) holds dims 2c + h + 8s
  + 16t of key n. It loads words 4u + c of the key's row (u < D / 32) and nibbles j, j + 4 of word w make the pair
  (h = 0, 1) at operand dim T = 32u + 16(j // 2) + 8(j % 2) + 2c, holding row dim R = 8w + j + 4h: the queries are
  loaded in that order (_key_dim), so q · K^T is unchanged.
- V, the B operand [BLOCK_N, D]: lane (g, c) holds keys 2c + h + 8r at dims g + 8m; a pair is two keys' nibbles at
  one dim. It loads words g · D / 64 + v of each key, a PRMT puts byte i // 2 of keys 2c + 8r and 2c + 1 + 8r in
  one register, and a mask (after a shift for odd i) leaves nibble i of both: operand dim T' = g + 8(8v + i) holds
  row dim R = D / 8 · (T' % 8) + T' // 8 (_value_dim), the order the output is stored in.

Codes are used as the fp16 bits of c (c · 2^-24, exact); scales, shifts and the queries' and weights' powers of
two are those of the Triton kernel (see its _int4_scores and _int4_values): scale · (q · codes) + shift · Σ q for
the scores, p · scale under a power of two per row and p · shift for the values. One scale group a row (rows of
kv_cache.quantize_kv_int4 with num_groups 1), head dims 64 and 128; the others stay with the Triton kernel. The
steps that do not depend on the codes (the queries in fp16, the online softmax, the weights in fp16, the rows'
store) are helpers here that triton_splitk_fp8's kernel shares.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from mslk.attention.fmha.triton_splitk import _exponent, _half_pair, _masked, _part, _pow2, _whole_tiles
from mslk.core import arch

HEAD_DIMS = (64, 128)  # (at 256 the accumulator and q's operand alone take 192 registers a thread: spills)

# The fp16 pairs (c · 2^-24 of nibbles j and j + 4, low and high half) of the word $4 (given twice), j in $j.
_WORD_PAIRS_PTX = gl.constexpr(
    "{\n.reg .b32 t;\nand.b32 $0, $4, 0x000F000F;\n"
    + "".join(f"shr.b32 t, $4, {4 * j};\nand.b32 ${j}, t, 0x000F000F;\n" for j in range(1, 4))
    + "}"
)
# The fp16 pairs of nibble i of two keys' words ($8 and $10, each given twice; the first key in the low half), i in
# $i: a PRMT takes byte i // 2 of both, a mask (after a shift for odd i) leaves nibble i.
_KEY_PAIRS_PTX = gl.constexpr(
    "{\n.reg .b32 x, y;\n"
    + "".join(
        f"prmt.b32 x, $8, $10, 0x{4 + b:x}{4 + b:x}{b:x}{b:x};\n"
        f"and.b32 ${2 * b}, x, 0x000F000F;\n"
        f"shr.b32 y, x, 4;\n"
        f"and.b32 ${2 * b + 1}, y, 0x000F000F;\n"
        for b in range(4)
    )
    + "}"
)


@triton.jit
def _key_dim(t):
    """The dim of a K row (and of q) at index t of the K^T operand's dims: t = 32u + 16b + 8a + 2c + h holds nibble
    j + 4h of word 4u + c, j = a + 2b."""
    u, b, a, c, h = t >> 5, (t >> 4) & 1, (t >> 3) & 1, (t >> 1) & 3, t & 1
    return 32 * u + 8 * c + a + 2 * b + 4 * h


@triton.jit
def _value_dim(t, D: tl.constexpr):
    """The dim of a V row (and of the output) at index t of the V operand's dims."""
    return D // 8 * (t % 8) + t // 8


@gluon.jit
def _rows(keys, k_start, b, lane, page_size, tables_ptr, stride_tb, stride_tp, pages, PAGED: gl.constexpr,
          BIG_PAGES: gl.constexpr, ROWS: gl.constexpr = gl.int64):  # fmt: skip
    """The cache rows (of type ROWS) of keys of sequence b: through its page table when PAGED, from their tile's
    `pages` (_tile_pages, rows of type ROWS) when BIG_PAGES."""
    if PAGED:
        if BIG_PAGES:
            return _paged_rows(keys, pages, page_size)
        place = k_start - b * lane + keys
        page = gl.load(tables_ptr + b.to(gl.int64) * stride_tb + (place // page_size) * stride_tp)
        return page.to(ROWS) * page_size + place % page_size
    return (k_start + keys).to(ROWS)


@gluon.jit
def _tile_pages(first_key, end, k_start, b, lane, page_size, tables_ptr, stride_tb, stride_tp, BLOCK_N: gl.constexpr,
                ROWS: gl.constexpr):  # fmt: skip
    """Where the keys [first_key, first_key + BLOCK_N) of sequence b lie (those from `end` on: key end - 1) in pages of
    at least BLOCK_N keys, which a tile spans two of at most: (the place of key 0 less the first page's start, the
    first page's first row, the second page's first row; rows of type ROWS). Two loads and two divisions a tile, the
    same in every lane (scalars), where a lookup a key took one of each per key and layout (H100, int4 in pages of
    64: 116 -> 110 us on PERF.md's decode shape; RESULTS.md, sixty-fifth session)."""
    offset = k_start - b * lane  # key 0's place in lane b
    first_page = (offset + gl.minimum(first_key, end - 1)) // page_size
    last_page = (offset + gl.minimum(first_key + BLOCK_N, end) - 1) // page_size
    table = tables_ptr + b.to(gl.int64) * stride_tb
    first_row = gl.load(table + first_page * stride_tp).to(ROWS) * page_size
    next_row = gl.load(table + last_page * stride_tp).to(ROWS) * page_size
    return offset - first_page * page_size, first_row, next_row


@gluon.jit
def _paged_rows(keys, pages, page_size):
    """The rows of keys of a tile (at most end - 1) from its _tile_pages."""
    shift, first_row, next_row = pages
    within = shift + keys  # the key's place past the first page's start: below 2 · page_size
    return gl.where(within < page_size, first_row + within, next_row + (within - page_size))


@gluon.jit
def _key_codes(words, b_layout: gl.constexpr):
    """K^T [D, BLOCK_N], the fp16 B operand of the codes (c · 2^-24), from words [BLOCK_N, D / 8] (lane c holding
    words 4u + c)."""
    BN: gl.constexpr = words.shape[0]
    D: gl.constexpr = words.shape[1] * 8
    w = words.reshape([BN, D // 32, 4])  # [key, u, c]
    n = gl.inline_asm_elementwise(_WORD_PAIRS_PTX, "=r,=r,=r,=r,r,r", [gl.join(w, w)], dtype=[gl.float16] * 4,
                                  is_pure=True, pack=2)  # fmt: skip
    codes = gl.join(gl.join(n[0], n[1]), gl.join(n[2], n[3]))  # [key, u, c, h, a, b]: nibble j + 4h, j = a + 2b
    codes = codes.permute((0, 1, 5, 4, 2, 3)).reshape([BN, D])
    return gl.convert_layout(codes.permute((1, 0)), b_layout)


@gluon.jit
def _value_codes(words, b_layout: gl.constexpr):
    """V [BLOCK_N, D], the fp16 B operand of the codes (c · 2^-24), from words [BLOCK_N, D / 8] (lane (g, c) holding
    words g · D / 64 + v of keys 2c + h + 8r)."""
    BN: gl.constexpr = words.shape[0]
    D: gl.constexpr = words.shape[1] * 8
    first, second = gl.split(words.reshape([BN // 2, 2, D // 8]).permute((0, 2, 1)))  # keys 2k and 2k + 1
    n = gl.inline_asm_elementwise(_KEY_PAIRS_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r",
                                  [gl.join(first, first), gl.join(second, second)], dtype=[gl.float16] * 8,
                                  is_pure=True, pack=2)  # fmt: skip
    codes = gl.join(
        gl.join(gl.join(n[0], n[1]), gl.join(n[2], n[3])), gl.join(gl.join(n[4], n[5]), gl.join(n[6], n[7]))
    )  # [k, word, h, i0, i1, i2]: nibble i = i0 + 2 i1 + 4 i2 of key 2k + h
    codes = codes.reshape([BN // 2, 8, D // 64, 2, 2, 2, 2]).permute((0, 3, 2, 6, 5, 4, 1))  # [k, h, v, i2, i1, i0, g]
    return gl.convert_layout(codes.reshape([BN, D]), b_layout)


@gluon.jit
def _load_tile(first_key, end, k_base, v_base, stride_km, stride_kd, stride_vm, stride_vd, k_start, b, lane,
               page_size, tables_ptr, stride_tb, stride_tp, pages, PAGED: gl.constexpr, BIG_PAGES: gl.constexpr,
               BLOCK_N: gl.constexpr, D: gl.constexpr, key_layout: gl.constexpr, k_layout: gl.constexpr,
               v_layout: gl.constexpr):  # fmt: skip
    """The int32 words of keys [first_key, first_key + BLOCK_N): K's and V's scale words [BLOCK_N] (key_layout) and
    codes [BLOCK_N, D / 8] (k_layout, v_layout), paged in big pages from `pages` (the tile's _tile_pages). Keys from
    `end` on read the row of key end - 1 (the part's last): no load is masked, and the scores mask those keys."""
    keys = gl.minimum(first_key + gl.arange(0, BLOCK_N, layout=key_layout), end - 1)
    rows = _rows(keys, k_start, b, lane, page_size, tables_ptr, stride_tb, stride_tp, pages, PAGED, BIG_PAGES)
    k_heads, v_heads = gl.load(k_base + rows * stride_km), gl.load(v_base + rows * stride_vm)
    keys = gl.minimum(first_key + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, k_layout)), end - 1)
    rows = _rows(keys, k_start, b, lane, page_size, tables_ptr, stride_tb, stride_tp, pages, PAGED, BIG_PAGES)
    words = 1 + gl.arange(0, D // 8, layout=gl.SliceLayout(0, k_layout))  # (word 0: the scale and shift)
    k_words = gl.load(k_base + (rows * stride_km)[:, None] + words[None, :] * stride_kd)
    keys = gl.minimum(first_key + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, v_layout)), end - 1)
    rows = _rows(keys, k_start, b, lane, page_size, tables_ptr, stride_tb, stride_tp, pages, PAGED, BIG_PAGES)
    words = 1 + gl.arange(0, D // 8, layout=gl.SliceLayout(0, v_layout))
    v_words = gl.load(v_base + (rows * stride_vm)[:, None] + words[None, :] * stride_vd)
    return k_heads, v_heads, k_words, v_words


@gluon.jit
def _fp16_queries(q_rows, q_start, first_query, first_head, q_len, heads, stride_qm, stride_qh, stride_qd, scale_log2,
                  UNIT: gl.constexpr, HEADS: gl.constexpr, D: gl.constexpr, KEY_DIM: gl.constexpr,
                  a_layout: gl.constexpr, row_layout: gl.constexpr):  # fmt: skip
    """The program's 16 query rows, each dim in K's order (KEY_DIM(t): the dim at the operand's index t), in fp16
    under a power of two a row (triton_splitk._fp16_rows): the A operand, with those powers' inverses times the
    codes' UNIT and the rows' sums (fp32, row_layout), both times scale_log2."""
    q_layout: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [1, 1], [1, 0])
    rows = gl.arange(0, 16, layout=gl.SliceLayout(1, q_layout))
    query, head = first_query + rows // HEADS, first_head + rows % HEADS
    dims = gl.arange(0, D, layout=gl.SliceLayout(0, q_layout))
    q = gl.load(q_rows + ((q_start + query).to(gl.int64) * stride_qm + head * stride_qh)[:, None]
                + KEY_DIM(dims)[None, :] * stride_qd, mask=((query < q_len) & (head < heads))[:, None],
                other=0.0).to(gl.float32)  # fmt: skip
    q_exponent = _exponent(gl.max(gl.abs(q), 1), -112, 127)
    q16 = gl.convert_layout((q * _pow2(14 - q_exponent)[:, None]).to(gl.float16), a_layout)
    q_unit = gl.convert_layout(_pow2(q_exponent - 14) * UNIT * scale_log2, row_layout)
    q_sum = gl.convert_layout(gl.sum(q, 1) * scale_log2, row_layout)
    return q16, q_unit, q_sum


@gluon.jit
def _softmax_step(s, m_i, l_i):
    """The online softmax over a tile of scores s (log2 units, -inf where masked): (p, alpha, the running max and
    sum)."""
    m_new = gl.maximum(m_i, gl.max(s, 1))
    m_base = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet: exp2(-inf) = 0
    alpha = gl.exp2(m_i - m_base)
    p = gl.exp2(s - m_base[:, None])
    return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)


@gluon.jit
def _fp16_weights(p, v_scale, a_layout: gl.constexpr, SIGNED: gl.constexpr):
    """p times V's scales in fp16, the A operand, each row under a power of two 2^-e that takes its largest |weight|
    below 1, and e. SIGNED: scales of either sign (else non-negative, as quantize_kv_int4's ranges over 15 are: int4's
    SASS stays that measured in the sixty-third session)."""
    weights = p * v_scale[None, :]
    e = _exponent(gl.max(gl.abs(weights) if SIGNED else weights, 1), -126, 125) + 1
    return gl.convert_layout((weights * _pow2(-e)[:, None]).to(gl.float16), a_layout), e


@gluon.jit
def _store_rows(acc, shifts, m_i, l_i, out_ptr, lse_ptr, query, head, q_start, q_len, heads, batch, g, stride_os,
                stride_ob, stride_om, stride_og, stride_oh, stride_od, stride_ls, stride_lb, stride_lg, stride_lh,
                stride_lm, D: gl.constexpr, mma: gl.constexpr):  # fmt: skip
    """The rows' output (acc plus V's shifts, normalized; dims in _value_dim's order) and log-sum-exp (natural log;
    -inf over no key, output zeros) into part program_id(1)."""
    acc += shifts[:, None]
    out = gl.where(l_i > 0, 1.0 / l_i, 0.0)[:, None] * acc
    row_ok = (query < q_len) & (head < heads)
    out_rows = (out_ptr + gl.program_id(1) * stride_os + batch * stride_ob + (q_start + query).to(gl.int64) * stride_om
                + g * stride_og + head * stride_oh)  # fmt: skip
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, mma))
    gl.store(
        out_rows[:, None] + _value_dim(cols, D)[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None],
    )
    lse = gl.where(l_i > 0, (m_i + gl.log2(l_i)) / 1.4426950408889634, float("-inf"))
    lse_rows = (lse_ptr + gl.program_id(1) * stride_ls + batch * stride_lb + g * stride_lg + head * stride_lh
                + (q_start + query).to(gl.int64) * stride_lm)  # fmt: skip
    gl.store(lse_rows, lse, mask=row_ok)


@gluon.jit
def int4_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, seqstart_q_ptr, seqstart_k_ptr, seqlen_k_ptr, tables_ptr, groups, heads,
    row_blocks, Mq, Mk, lane, page_size, splits, scale_log2, window_left, window_right,
    stride_qb, stride_qm, stride_qg, stride_qh, stride_qd, stride_kb, stride_km, stride_kg, stride_kh, stride_kd,
    stride_vb, stride_vm, stride_vg, stride_vh, stride_vd, stride_os, stride_ob, stride_om, stride_og, stride_oh,
    stride_od, stride_ls, stride_lb, stride_lg, stride_lh, stride_lm, stride_tb, stride_tp,
    VARLEN: gl.constexpr, HAS_SEQLEN_K: gl.constexpr, PAGED: gl.constexpr, BIG_PAGES: gl.constexpr,
    BOTTOM_RIGHT: gl.constexpr, HEADS: gl.constexpr, QUERIES: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
):  # fmt: skip
    """triton_splitk._splitk_kernel's program for int4-packed K/V in one scale group a row (one warp, 16 rows);
    BIG_PAGES: paged in pages of at least BLOCK_N keys (_tile_pages)."""
    BLOCK_M: gl.constexpr = 16  # rows (query heads x queries): mma.sync's M
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, mma)
    key_layout: gl.constexpr = gl.SliceLayout(0, mma)
    k_words_layout: gl.constexpr = gl.BlockedLayout([1, 1], [8, 4], [1, 1], [1, 0])
    v_words_layout: gl.constexpr = gl.BlockedLayout([2, D // 64], [4, 8], [1, 1], [0, 1])

    b, g, first_head, first_query, q_start, q_len, k_start, k_len, batch, shift, start, end = _part(
        groups, heads, row_blocks, seqstart_q_ptr, seqstart_k_ptr, seqlen_k_ptr, Mq, Mk, splits, window_left,
        window_right, VARLEN, HAS_SEQLEN_K, BOTTOM_RIGHT, HEADS, QUERIES, BLOCK_N,
    )  # fmt: skip
    q_rows = q_ptr + batch * stride_qb + g * stride_qg
    k_base = k_ptr + batch * stride_kb + g * stride_kg + first_head * stride_kh
    v_base = v_ptr + batch * stride_vb + g * stride_vg + first_head * stride_vh

    # (2^24: the codes' unit)
    q16, q_unit, q_sum = _fp16_queries(q_rows, q_start, first_query, first_head, q_len, heads, stride_qm, stride_qh,
                                       stride_qd, scale_log2, 16777216.0, HEADS, D, _key_dim, a_layout,
                                       row_layout)  # fmt: skip

    rows = gl.arange(0, BLOCK_M, layout=row_layout)
    query, head = first_query + rows // HEADS, first_head + rows % HEADS
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_layout)
    l_i = gl.zeros([BLOCK_M], gl.float32, row_layout)
    shifts = gl.zeros([BLOCK_M], gl.float32, row_layout)  # Σ p · V's shift, added to every dim at the end
    acc = gl.zeros([BLOCK_M, D], gl.float32, mma)
    if start < end:  # (keys past the end read key end - 1's rows: an empty part, of no key at all, reads none)
        whole = _whole_tiles(start, end, first_query, q_len, k_len, shift, window_left, window_right, QUERIES, BLOCK_N)
        pages = 0  # (dense, or pages smaller than a tile: none read ahead)
        if BIG_PAGES:
            pages = _tile_pages(start, end, k_start, b, lane, page_size, tables_ptr, stride_tb, stride_tp, BLOCK_N,
                                gl.int64)  # fmt: skip
        tile = _load_tile(start, end, k_base, v_base, stride_km, stride_kd, stride_vm, stride_vd, k_start, b, lane,
                          page_size, tables_ptr, stride_tb, stride_tp, pages, PAGED, BIG_PAGES, BLOCK_N, D, key_layout,
                          k_words_layout, v_words_layout)  # fmt: skip
        if BIG_PAGES:  # a tile's pages are read a tile before its rows' loads, which then do not wait for them
            pages = _tile_pages(start + BLOCK_N, end, k_start, b, lane, page_size, tables_ptr, stride_tb, stride_tp,
                                BLOCK_N, gl.int64)  # fmt: skip
        for first_key in range(start, end, BLOCK_N):
            k_heads, v_heads, k_words, v_words = tile
            # the next tile's loads in flight while this one is multiplied (past the end: the last key's again)
            tile = _load_tile(first_key + BLOCK_N, end, k_base, v_base, stride_km, stride_kd, stride_vm, stride_vd,
                              k_start, b, lane, page_size, tables_ptr, stride_tb, stride_tp, pages, PAGED, BIG_PAGES,
                              BLOCK_N, D, key_layout, k_words_layout, v_words_layout)  # fmt: skip
            if BIG_PAGES:
                pages = _tile_pages(first_key + 2 * BLOCK_N, end, k_start, b, lane, page_size, tables_ptr, stride_tb,
                                    stride_tp, BLOCK_N, gl.int64)  # fmt: skip
            keys = first_key + gl.arange(0, BLOCK_N, layout=key_layout)
            k_scale, k_shift = _half_pair(k_heads)
            s = mma_v2(q16, _key_codes(k_words, b_layout), gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma))
            s = s * q_unit[:, None] * k_scale[None, :] + q_sum[:, None] * k_shift[None, :]
            s = _masked(s, first_key, whole, query, keys, q_len, k_len, shift, window_left, window_right, end)
            p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i)
            v_scale, v_shift = _half_pair(v_heads)
            w16, e = _fp16_weights(p, v_scale, a_layout, False)
            part = mma_v2(w16, _value_codes(v_words, b_layout), gl.zeros([BLOCK_M, D], gl.float32, mma))
            acc = acc * alpha[:, None] + part * (_pow2(e) * 16777216.0)[:, None]
            shifts = shifts * alpha + gl.sum(p * v_shift[None, :], 1)

    _store_rows(acc, shifts, m_i, l_i, out_ptr, lse_ptr, query, head, q_start, q_len, heads, batch, g, stride_os,
                stride_ob, stride_om, stride_og, stride_oh, stride_od, stride_ls, stride_lb, stride_lg, stride_lh,
                stride_lm, D, mma)  # fmt: skip


def supports(q: torch.Tensor) -> bool:
    """Whether the kernel serves these [B, M, G, H, K] queries (over int4-packed K/V in one scale group a row): on an
    NVIDIA GPU of SM80 on (mma.sync), a head dim of HEAD_DIMS."""
    return q.is_cuda and arch.is_cuda() and arch.capability(q.device) >= (8, 0) and q.shape[-1] in HEAD_DIMS
