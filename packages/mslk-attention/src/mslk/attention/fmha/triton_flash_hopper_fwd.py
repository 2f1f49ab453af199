"""The attention forward of triton_flash.FwOp on Hopper (sm_90), written in Gluon, where it is measured faster
than the Triton kernel: 16-bit Q, K, V of head dim 128 that TMA can read as [B·M, G·H·K] matrices, a positive
scale, no mask or a causal one (top-left or bottom-right), with or without a tensor bias that TMA reads, no dropout,
varlen or left window, enough keys (triton_flash._gluon_forward decides).

Persistent programs (one an SM) take tiles of 128 queries of one head in turn, as in FlashAttention-3's forward,
in pairs of query blocks that a causal mask gives as many keys together, head by head (_tile):

- one warp loads K and V blocks of 128 keys through a ring of STAGES slots (a block's K and V in one slot, freed
  once both warpgroups' P·V is done; a tensor bias takes more rings, below), and a tile's queries, each warpgroup's
  half once that warpgroup's output of the last tile has left; the tile's first PRELOAD key blocks go before its
  queries, as their slots free under the last tile's last products (forty-sixth session, RESULTS.md: 0.6-2.5%
  faster than the queries first; the halves on barriers of their own 0-2% faster than both under one);
- two warpgroups (64 queries each) walk the same key blocks with their own online softmax and take turns, through
  two mbarriers, to start their products (block j's scores with block j-1's P·V), so that one's softmax runs while
  the other's products use the tensor cores ("ping-pong"), and, away from the mask's edge and without a bias, while
  its own P·V does too (_attend);
- a warpgroup's output tile leaves through its query tile, which its products no longer read, by a TMA store; the
  tile's queries are released to the loading warp once that store has read them. Forty-fifth session (RESULTS.md):
  0-6% faster than stores from the products' layout (4-byte pieces, a warp's store across 8 rows), which held the
  warpgroups up more than the next queries' load now does; outputs of another dtype than the queries' (fp32 for
  merging partial attention) keep those stores.

H200, bf16, forward alone (RESULTS.md, forty-ninth session; TFLOP/s, `mslk bench`): B=4 M=4096 H=16 causal 561
and no mask 654 against cuDNN's 530 and 609 in the same run, B=1 M=16384 causal 622 against 567; short of cuDNN with
256 (batch x head) pairs or more and on short rows (B=16 M=1024: 0.95x). Not taken: sliding windows (0.96x the
Triton kernel, whose masked left edge spilled here).

With a tensor bias, K, V and the key block's bias tile for the tile's 128 queries each have a ring of their own (a K
slot frees once both warpgroups' scores are done, a V slot once their P·V is, a bias slot once both have read
their rows of it), so that the next K and bias tiles come in while the last P·V still reads V; a warpgroup reads
its rows before its scores and starts them from bias / scale (so the scores' product adds Q·Kᵀ to it and the
softmax is the one without a bias). Each ring has BIAS_STAGES slots then (224 KiB in all).
B=2 M=4096 H=16, bias [B, H, M, M]: 645-675 us against FlexAttention's 750-782 in the same runs (1.15-1.20x; 1.21-1.25x
since, below), causal 355-382 against 490-507 (1.28-1.40x; RESULTS.md, thirtieth session). Measured slower: one ring
of 64-key slots for K, V and bias together (the twenty-ninth session's kernel: 729-741 us), the bias added in the
softmax (718), a warp of its own loading the bias tiles (673), with L2 prefetches of the tiles 2 or 4 blocks ahead
(692-705); and in the twenty-ninth session the bias read straight from global memory by each warpgroup in the
scores' layout (873 us: ptxas sinks the loads past the products' wait, whose latency then shows) and 128-key slots
of one ring, two of them (779 us). Thirty-second session (RESULTS.md): other slot counts for the K, V and bias rings
(3-2-1, 2-1-3, 1-2-3; 2-3-1 and V a block late within noise), the next block's bias tile read under this block's
products (spills: 739-783 us against 674), and the bias through the tensor cores as diag(1 / scale) · bias tile
(within noise, and NaN wherever the bias holds −inf: 0 · −inf).

With a bias the softmax warps, not the tensor cores, set the pace, so their instructions count (SASS, sm_90a, a warp's
128-key block): the weights are packed to 16 bits two a conversion (`to_16bit`; Gluon's conversion left a PRMT a
pair), the bias tile is widened to fp32 two instructions a pair (`to_fp32`; Gluon's took three) and a row's maximum
is a tree (`row_max`; Gluon chains 32 dependent maxima): 689 -> 635 instructions with a bias, 491 -> 459 without.
Forty-first session (RESULTS.md): bias 662-671 -> 633-652 us, 1.21-1.25x FlexAttention; without a bias unchanged.
Lazy rescaling of the output (FlashAttention-4: a row's maximum moves only past a factor 2^8) measured no faster
(its warpgroup-wide vote costs what the skipped multiplies save).
"""

from __future__ import annotations

import math

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from mslk.attention.fmha.triton_flash import (
    _bias_head,
    _key_range,
    _unmasked_key_range,
    _visible,
)
from mslk.attention.fmha.triton_flash_hopper import (
    _LOG2E,
    _bias_descriptor,
    _box,
    _box_descriptor,
    _descriptor,
    _tma_operands,
)
from mslk.core import arch, launch
from mslk.core.gluon import ring_barriers, row_max, to_16bit, to_fp32

HEAD_DIMS = (128,)  # at 64 measured 0.80-1.00x the Triton kernel (RESULTS.md, twenty-third session)
BLOCK_M = 128  # queries a program: 64 per warpgroup
BLOCK_N = 128  # keys a step
STAGES = 3  # slots of the K ring and of the V ring (block j-1's V is still read by its P·V while block j+1 loads)
MMA_REGISTERS = 240  # per thread of the second warpgroup (setmaxnreg); the first gets as many from what is left
LOAD_REGISTERS = 24
# Key blocks of a tile loaded before its queries: at most a ring's slots (BIAS_STAGES too), as more would wait for
# slots that this tile's own blocks hold, whose products wait for the queries.
PRELOAD = gl.constexpr(2)
BIAS_STAGES = 2  # with a tensor bias: slots of each ring (K, V and [BLOCK_M, BLOCK_N] bias tiles)


@gluon.jit
def _tile(k, blocks, units, all_heads, Mq, Mk, window_right, BOTTOM_RIGHT: gl.constexpr, BM: gl.constexpr,
          BN: gl.constexpr):  # fmt: skip
    """This program's k-th tile: (batch·group·head, first query row, its keys [0, hi) of which [0, full_hi) unmasked
    from the second block on; no left window). Program p takes units p, p + programs, ... of the `units` of each head
    in head order, a unit the query blocks blocks - 1 - j and j of one head, the heavier first, so that a causal mask
    gives every unit as many keys; an odd middle block is paired with one past the rows, which has no keys and writes
    nothing. In head order a head's units run on neighbouring programs at once: at B=4 M=4096 H=16 without a mask
    half the DRAM reads and 28% less L2 traffic than triton_flash's sections of interleaved heads (_tile_block), and
    2-7% faster at most shapes (RESULTS.md, forty-ninth session). `units` comes from the host: computed here from
    `blocks`, the fp32-output kernel spilled."""
    unit = gl.program_id(0) + k // 2 * gl.num_programs(0)
    j = unit % units
    bgh = unit // units
    query_block = blocks - 1 - j if k % 2 == 0 else gl.where(2 * j + 1 == blocks, blocks, j)
    first_row = query_block * BM
    shift = Mk - Mq if BOTTOM_RIGHT else 0
    _, hi = _key_range(first_row, Mq, Mk, shift, -1, window_right, BM, BN)
    hi = gl.where(first_row < Mq, hi, 0)
    _, full_hi = _unmasked_key_range(0, hi, first_row, Mq, Mk, shift, -1, window_right, BM, BN)
    return bgh, first_row, full_hi, hi


@gluon.jit
def _program_tiles(units, all_heads):
    """How many tiles this program takes: two a unit (_tile)."""
    return 2 * gl.cdiv(units * all_heads - gl.program_id(0), gl.num_programs(0))


@gluon.jit
def _ring_slot(ready, empty, i, nbytes: gl.constexpr):
    """(slot, its `ready` barrier, expecting nbytes) of ring block i, once both warpgroups have released the block
    before it there."""
    STAGES: gl.constexpr = ready.shape[0]
    slot = i % STAGES
    mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)
    mbarrier.expect(ready.index(slot), nbytes)
    return slot, ready.index(slot)


@gluon.jit
def _load_key_block(k_desc, v_desc, bias_desc, k_bufs, v_bufs, bias_bufs, k_ready, k_empty, v_ready, v_empty, b_ready,
                    b_empty, i, key_row, head_col, bias_b, bias_g, bias_h, first_row, start,
                    HAS_BIAS: gl.constexpr):  # fmt: skip
    """Ring block i: K and V of keys key_row on in one slot, or, HAS_BIAS, K, bias tile and V each through its own
    ring (K's slot frees when the scores are done, the bias tile's when the warpgroups have read it, V's when P·V
    is done)."""
    if HAS_BIAS:
        slot, bar = _ring_slot(k_ready, k_empty, i, k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [key_row, head_col], bar, k_bufs.index(slot))
        slot, bar = _ring_slot(b_ready, b_empty, i, bias_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(bias_desc, [bias_b, bias_g, bias_h, first_row, start], bar,
                                        _box(bias_desc, bias_bufs.index(slot)))  # fmt: skip
        slot, bar = _ring_slot(v_ready, v_empty, i, v_desc.block_type.nbytes)
    else:  # K and V in one slot of one ring
        slot, bar = _ring_slot(k_ready, k_empty, i, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [key_row, head_col], bar, k_bufs.index(slot))
    tma.async_copy_global_to_shared(v_desc, [key_row, head_col], bar, v_bufs.index(slot))


@gluon.jit
def _load_partition(q_desc, k_desc, v_desc, bias_desc, q_smem, k_bufs, v_bufs, bias_bufs, q_ready, q_empty, k_ready,
                    k_empty, v_ready, v_empty, b_ready, b_empty, G, H, Mq, Mk, window_right, blocks, units, all_heads,
                    stride_bb, stride_bg, stride_bh, BOTTOM_RIGHT: gl.constexpr,
                    HAS_BIAS: gl.constexpr):  # fmt: skip
    """The loading warp, tile after tile: the tile's key blocks in order through the ring (_load_key_block), the
    first PRELOAD of them before the tile's queries, whose halves load once their warpgroup's last output has left
    (q_empty)."""
    HALF: gl.constexpr = q_desc.block_type.shape[0]
    BN: gl.constexpr = k_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = k_desc.block_type.shape[1]
    i = 0
    j = 0
    for k in range(0, _program_tiles(units, all_heads)):
        bgh, first_row, _, hi = _tile(k, blocks, units, all_heads, Mq, Mk, window_right, BOTTOM_RIGHT, 2 * HALF, BN)
        b = bgh // (G * H)
        head_col = (bgh % (G * H)) * HEAD_DIM
        q_row = (b * Mq + first_row).to(gl.int32)
        k_row0 = (b * Mk).to(gl.int32)
        bias_b, bias_g, bias_h = _bias_head(b, (bgh // H) % G, bgh % H, stride_bb, stride_bg, stride_bh)
        ahead = gl.minimum(hi, PRELOAD * BN)
        for start in range(0, ahead, BN):
            _load_key_block(k_desc, v_desc, bias_desc, k_bufs, v_bufs, bias_bufs, k_ready, k_empty, v_ready, v_empty,
                            b_ready, b_empty, i, k_row0 + start, head_col, bias_b, bias_g, bias_h, first_row, start,
                            HAS_BIAS)  # fmt: skip
            i += 1
        for half in gl.static_range(2):  # each warpgroup's queries once it is done with the last tile's
            mbarrier.wait(q_empty.index(half), (j & 1) ^ 1)
            mbarrier.expect(q_ready.index(half), q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [q_row + half * HALF, head_col], q_ready.index(half),
                                            q_smem.index(half))  # fmt: skip
        for start in range(ahead, hi, BN):
            _load_key_block(k_desc, v_desc, bias_desc, k_bufs, v_bufs, bias_bufs, k_ready, k_empty, v_ready, v_empty,
                            b_ready, b_empty, i, k_row0 + start, head_col, bias_b, bias_g, bias_h, first_row, start,
                            HAS_BIAS)  # fmt: skip
            i += 1
        j += 1


@gluon.jit
def _landed(ready, i):
    """Waits for ring block i to land in its slot; returns the slot."""
    STAGES: gl.constexpr = ready.shape[0]
    slot = i % STAGES
    mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
    return slot


@gluon.jit
def _scores(q, k_bufs, bias_bufs, k_ready, b_ready, b_empty, turn, i, n, bias_scale, WG: gl.constexpr,
            HAS_BIAS: gl.constexpr):  # fmt: skip
    """Waits for ring block i's K (and bias tile: its rows of this warpgroup, over the scale, are the scores'
    starting value, and its slot is released), then, in this warpgroup's turn, starts its scores Q·Kᵀ (the n-th turn
    of the warpgroup). Returns the pending product."""
    BN: gl.constexpr = k_bufs.shape[1]
    HALF: gl.constexpr = q.shape[0]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    slot = _landed(k_ready, i)
    if HAS_BIAS:
        bias_slot = _landed(b_ready, i)
        init = to_fp32(bias_bufs.index(bias_slot).slice(WG * HALF, HALF).load(s_layout)) * bias_scale
        mbarrier.arrive(b_empty.index(bias_slot))
    else:
        init = gl.zeros([HALF, BN], gl.float32, s_layout)
    # Warpgroup 0 goes first: its first wait passes on the fresh barrier (the phase before the first counts done).
    mbarrier.wait(turn.index(WG), (n & 1) ^ (1 - WG))
    return warpgroup_mma(q, k_bufs.index(slot).permute((1, 0)), init, use_acc=HAS_BIAS, is_async=True)


@gluon.jit
def _softmax(s, m_i, l_i, rows, start, q_len, k_len, shift, window_right, qk_scale, MASKED: gl.constexpr):
    """The online softmax step of one key block's raw scores: the new row maximum, the old accumulator's factor, the
    weights and the new row sums."""
    BN: gl.constexpr = s.shape[1]
    s_layout: gl.constexpr = s.type.layout
    if MASKED:
        cols = start + gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
        s = gl.where(_visible(rows, cols, q_len, k_len, shift, -1, window_right), s, float("-inf"))
    m_new = gl.maximum(m_i, gl.convert_layout(row_max(s), m_i.type.layout) * qk_scale)
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row without keys so far stays at zero
    alpha = gl.exp2(m_i - m_safe)
    p = gl.exp2(s * qk_scale - m_safe[:, None])
    return m_new, alpha, p, l_i * alpha + gl.sum(p, 1)


@gluon.jit
def _attend(acc, p_a, m_i, l_i, i, n, q, k_bufs, v_bufs, bias_bufs, k_ready, k_empty, v_ready, v_empty, b_ready,
            b_empty, turn, rows, start_col, end_col, q_len, k_len, shift, window_right, qk_scale, WG: gl.constexpr,
            MASKED: gl.constexpr, HAS_BIAS: gl.constexpr):  # fmt: skip
    """Key blocks [start_col, end_col) (ring blocks i on, turns n on): block j's scores and block j-1's P·V start
    together in this warpgroup's turn, then the other warpgroup's turn comes, whose products run under this one's
    softmax. In the unmasked loop without a bias the softmax runs under this warpgroup's own P·V too, as in
    FlashAttention-3 (it waits for the scores alone; block j's weights and factor wait in registers for P·V): 3-5%
    faster (RESULTS.md, forty-fourth session). Not in the masked loop (slower: registers) nor with a bias (spills)."""
    STAGES: gl.constexpr = k_bufs.shape[0]
    o_layout: gl.constexpr = acc.type.layout
    for start in range(start_col, end_col, k_bufs.shape[1]):
        if HAS_BIAS:  # V has a ring of its own (else it came with K)
            _landed(v_ready, i - 1)
        s = _scores(q, k_bufs, bias_bufs, k_ready, b_ready, b_empty, turn, i, n, _LOG2E / qk_scale, WG, HAS_BIAS)
        prev = (i - 1) % STAGES
        acc = warpgroup_mma(p_a, v_bufs.index(prev), acc, is_async=True)
        mbarrier.arrive(turn.index(1 - WG))
        OVERLAP: gl.constexpr = not (MASKED or HAS_BIAS)  # the softmax under this warpgroup's P·V
        if OVERLAP:
            s = warpgroup_mma_wait(1, deps=(s,))
        else:
            s, acc, p_a = warpgroup_mma_wait(0, deps=(s, acc, p_a))
        if HAS_BIAS:  # and K too
            mbarrier.arrive(k_empty.index(i % STAGES))
        m_i, alpha, p, l_i = _softmax(s, m_i, l_i, rows, start, q_len, k_len, shift, window_right, qk_scale, MASKED)
        p = to_16bit(p, q.dtype)
        if OVERLAP:
            acc, p_a = warpgroup_mma_wait(0, deps=(acc, p_a))
        mbarrier.arrive(v_empty.index(prev))
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        p_a = gl.convert_layout(p, p_a.type.layout)
        i += 1
        n += 1
    return acc, p_a, m_i, l_i, i, n


@gluon.jit
def _softmax_partition(q_smem, k_bufs, v_bufs, bias_bufs, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty,
                       b_ready, b_empty, turn, out_ptr, out_desc, lse_ptr, G, H, Mq, Mk, qk_scale, window_right,
                       stride_ob, stride_om, stride_og, stride_oh, stride_lb, stride_lg, stride_lh, blocks, units,
                       all_heads, BOTTOM_RIGHT: gl.constexpr, HAS_BIAS: gl.constexpr, STAGED: gl.constexpr,
                       WG: gl.constexpr):  # fmt: skip
    """One warpgroup, tile after tile: queries first_row + WG · 64 on, over the tile's key blocks, then their output
    and LSE (natural log; −inf and zeros for a query that sees no key). The first block is taken alone (masked: it
    may be the diagonal or the last), so that the loop always has the previous block's weights to multiply; the last
    block's P·V follows the loop. STAGED: the output leaves by TMA through the query tile, which is then released to
    the loading warp; else by the warpgroup's stores, the query tile released before the last P·V."""
    HALF: gl.constexpr = q_smem.shape[1]
    HEAD_DIM: gl.constexpr = q_smem.shape[2]
    BN: gl.constexpr = k_bufs.shape[1]
    STAGES: gl.constexpr = k_bufs.shape[0]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])  # fmt: skip
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    q = q_smem.index(WG)
    shift = Mk - Mq if BOTTOM_RIGHT else 0
    i = 0
    n = 0
    j = 0
    for k in range(0, _program_tiles(units, all_heads)):
        bgh, first_row, full_hi, hi = _tile(k, blocks, units, all_heads, Mq, Mk, window_right, BOTTOM_RIGHT, 2 * HALF,
                                            BN)  # fmt: skip
        b = (bgh // (G * H)).to(gl.int64)
        g = (bgh // H) % G
        h = bgh % H
        rows = first_row + WG * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, s_layout))
        m_i = gl.full([HALF], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([HALF], gl.float32, gl.SliceLayout(1, s_layout))
        acc = gl.zeros([HALF, HEAD_DIM], gl.float32, o_layout)
        mbarrier.wait(q_ready.index(WG), j & 1)
        if hi > 0:
            s = _scores(q, k_bufs, bias_bufs, k_ready, b_ready, b_empty, turn, i, n, _LOG2E / qk_scale, WG, HAS_BIAS)
            mbarrier.arrive(turn.index(1 - WG))
            s = warpgroup_mma_wait(0, deps=(s,))
            if HAS_BIAS:
                mbarrier.arrive(k_empty.index(i % STAGES))
            m_i, _, p, l_i = _softmax(s, m_i, l_i, rows, 0, Mq, Mk, shift, window_right, qk_scale, True)
            p_a = gl.convert_layout(to_16bit(p, q.dtype), p_layout)
            i += 1
            n += 1
            rest = gl.minimum(BN, hi)
            bounds = (rest, gl.maximum(full_hi, rest), hi)
            for part in gl.static_range(2):  # unmasked interior, masked right edge (the diagonal, the last keys)
                acc, p_a, m_i, l_i, i, n = _attend(acc, p_a, m_i, l_i, i, n, q, k_bufs, v_bufs, bias_bufs, k_ready,
                                                   k_empty, v_ready, v_empty, b_ready, b_empty, turn, rows,
                                                   bounds[part], bounds[part + 1], Mq, Mk, shift, window_right,
                                                   qk_scale, WG, part == 1, HAS_BIAS)  # fmt: skip
            if not STAGED:  # the next tile's queries load under the last P·V and the output's stores
                mbarrier.arrive(q_empty.index(WG))
            last = (i - 1) % STAGES
            if HAS_BIAS:
                _landed(v_ready, i - 1)
            acc = warpgroup_mma(p_a, v_bufs.index(last), acc, is_async=True)
            acc, p_a = warpgroup_mma_wait(0, deps=(acc, p_a))
            mbarrier.arrive(v_empty.index(last))
        elif not STAGED:
            mbarrier.arrive(q_empty.index(WG))
        has_keys = l_i > 0.0
        lse = gl.where(has_keys, (m_i + gl.log2(gl.where(has_keys, l_i, 1.0))) / _LOG2E, float("-inf"))
        gl.store(lse_ptr + b * stride_lb + g * stride_lg + h * stride_lh + rows, lse, mask=rows < Mq)
        scale = gl.convert_layout(1.0 / gl.where(has_keys, l_i, 1.0), gl.SliceLayout(1, o_layout))
        out = (acc * scale[:, None]).to(out_ptr.dtype.element_ty)
        if STAGED:  # through this warpgroup's query tile, which its products no longer read, by a TMA store
            q.store(out)
            fence_async_shared()
            at = [b.to(gl.int32), first_row + WG * HALF, (bgh % (G * H)) * HEAD_DIM]
            tma.async_copy_shared_to_global(out_desc, at, _box(out_desc, q))
            tma.store_wait(0)
            mbarrier.arrive(q_empty.index(WG))
        else:
            out_rows = first_row + WG * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, o_layout))
            dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
            out_base = out_ptr + b * stride_ob + g * stride_og + h * stride_oh
            gl.store(out_base + out_rows[:, None] * stride_om + dims[None, :], out, mask=(out_rows < Mq)[:, None])
        j += 1


@gluon.jit
def _flash_forward_hopper_kernel(
    q_desc, k_desc, v_desc, bias_desc, out_ptr, out_desc, lse_ptr, G, H, Mq, Mk, qk_scale, window_right,
    stride_ob, stride_om, stride_og, stride_oh, stride_lb, stride_lg, stride_lh, stride_bb, stride_bg, stride_bh,
    blocks, units, all_heads, BOTTOM_RIGHT: gl.constexpr, STAGES: gl.constexpr, MMA_REGISTERS: gl.constexpr,
    LOAD_REGISTERS: gl.constexpr,
):  # fmt: skip
    """out [B, Mq, G, H, K] and LSE [B, G, H, Mq] of [B, M, G, H, K] Q, K, V read through [B·M, G·H·K] descriptors
    (Q tiles [64, K], K and V tiles [BLOCK_N, K]), plus a tensor bias's [1, 1, 1, 128, BLOCK_N] tiles (bias_desc; None
    without one; its dimensions of stride 0 read at index 0, _bias_head); out written through out_desc's [1, 64, K]
    boxes of [B, Mq, G·H·K] where it has the queries' dtype (else None: through out_ptr). Persistent: each program
    takes its units' tiles (_tile): the `units` pairs of the `blocks` query blocks of each of the `all_heads`
    batch·group·heads."""
    HALF: gl.constexpr = q_desc.block_type.shape[0]
    BN: gl.constexpr = k_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = k_desc.block_type.shape[1]
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2, HALF, HEAD_DIM], q_desc.layout)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BN, HEAD_DIM], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BN, HEAD_DIM], v_desc.layout)
    HAS_BIAS: gl.constexpr = bias_desc is not None
    k_ready, k_empty = ring_barriers(STAGES, 2)
    # Without a bias K and V share their slots' barriers (a V ring of its own measured 2-4% slower); the warpgroups
    # then release a slot once its P·V is done.
    v_ready = k_ready
    v_empty = k_empty
    # warp_specialize's partitions take no None: without a bias, K's descriptor, ring and barriers stand in (never
    # used).
    bias_tiles = k_desc
    bias_bufs = k_bufs
    b_ready = k_ready
    b_empty = k_empty
    if HAS_BIAS:
        bias_tiles = bias_desc
        bias_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([2 * HALF, BN], bias_desc.dtype)
        bias_bufs = gl.allocate_shared_memory(bias_desc.dtype, [STAGES, 2 * HALF, BN], bias_layout)
        b_ready, b_empty = ring_barriers(STAGES, 2)
        v_ready, v_empty = ring_barriers(STAGES, 2)
    # Outputs of the queries' dtype leave by TMA stores (out_desc; None: by the warpgroups' own stores), whose
    # descriptor q's stands in for otherwise.
    STAGED: gl.constexpr = out_desc is not None
    out_tiles = q_desc
    if STAGED:
        out_tiles = out_desc
    q_ready, q_empty = ring_barriers(2, 1)  # a warpgroup's query tile landed / free
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # a warpgroup may start products
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
    gl.warp_specialize(
        [
            (_softmax_partition, (
                q_smem, k_bufs, v_bufs, bias_bufs, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, b_ready,
                b_empty, turn, out_ptr, out_tiles, lse_ptr, G, H, Mq, Mk, qk_scale, window_right, stride_ob,
                stride_om, stride_og, stride_oh, stride_lb, stride_lg, stride_lh, blocks, units, all_heads,
                BOTTOM_RIGHT, HAS_BIAS, STAGED, 0,
            )),
            (_softmax_partition, (
                q_smem, k_bufs, v_bufs, bias_bufs, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, b_ready,
                b_empty, turn, out_ptr, out_tiles, lse_ptr, G, H, Mq, Mk, qk_scale, window_right, stride_ob,
                stride_om, stride_og, stride_oh, stride_lb, stride_lg, stride_lh, blocks, units, all_heads,
                BOTTOM_RIGHT, HAS_BIAS, STAGED, 1,
            )),
            (_load_partition, (
                q_desc, k_desc, v_desc, bias_tiles, q_smem, k_bufs, v_bufs, bias_bufs, q_ready, q_empty, k_ready,
                k_empty, v_ready, v_empty, b_ready, b_empty, G, H, Mq, Mk, window_right, blocks, units, all_heads,
                stride_bb, stride_bg, stride_bh, BOTTOM_RIGHT, HAS_BIAS,
            )),
        ],
        [4, 1],
        [MMA_REGISTERS, LOAD_REGISTERS],
    )  # fmt: skip


def supports(q, k, v, scale: float, pointers: bool = True) -> bool:
    """Whether the kernel serves these [B, M, G, H, K] operands (triton_flash checks the rest: mask, bias, dropout,
    varlen): triton_flash_hopper._tma_operands (pointers: whether it reads the data pointers), a head dim of
    HEAD_DIMS and a positive scale (scores stay raw, scaled inside the exponent)."""
    return (
        _tma_operands(q, k, v, pointers=pointers)
        and q.shape[-1] == v.shape[-1] in HEAD_DIMS
        and scale > 0.0
        # offsets within a batch element in int32 (the output is contiguous like q)
        and math.prod(q.shape[1:]) < 2**31
    )


def run(q, k, v, out, lse, scale, window_right, bottom_right, bias=None):
    """out [B, Mq, G, H, K] and lse [B, G, H, Mq] (fp32, natural log) of [B, M, G, H, K] tensors, with a
    [B, G, H, Mq, Mk] tensor bias that TMA reads (triton_flash._bias_view) or None."""
    batch, mq, groups, heads, _ = q.shape
    stages, bias_desc = STAGES, None
    if bias is not None:  # a third ring, of bias tiles: fewer slots in each
        stages, bias_desc = BIAS_STAGES, _bias_descriptor(bias, q, BLOCK_M, BLOCK_N)
    mk = k.shape[1]
    blocks = launch.cdiv(mq, BLOCK_M)
    units = (blocks + 1) // 2  # pairs of query blocks (_tile)
    all_heads = batch * groups * heads
    launch.fast(_flash_forward_hopper_kernel)[(min(units * all_heads, arch.sm_count(q.device)),)](
        _descriptor(q, BLOCK_M // 2), _descriptor(k, BLOCK_N), _descriptor(v, BLOCK_N), bias_desc, out,
        _box_descriptor(out, BLOCK_M // 2) if out.dtype == q.dtype else None, lse, groups,
        heads, mq, mk, scale * _LOG2E.value, window_right, *out.stride()[:4], *lse.stride()[:3],
        *(bias.stride()[:3] if bias is not None else (0, 0, 0)), blocks, units, all_heads,
        BOTTOM_RIGHT=bottom_right, STAGES=stages,
        MMA_REGISTERS=MMA_REGISTERS, LOAD_REGISTERS=LOAD_REGISTERS, num_warps=4,
    )  # fmt: skip
