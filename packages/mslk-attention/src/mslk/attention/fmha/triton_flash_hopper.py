"""The attention backward of triton_flash.BwOp on Hopper (sm_90), written in Gluon, for the common case: 16-bit
Q, K, V of head dim 64 or 128 that TMA can read as [B·M, G·H·K] matrices, no dropout, no padded keys, dQ summed in
fp32 by TMA reduce-adds (not the deterministic mode); a tensor bias that TMA reads and that needs no gradient, not
with varlen (its tiles come through the ring with Q and dO: 1.57x the Triton kernel at B=2 M=4096 H=16 K=128,
RESULTS.md, twenty-eighth session). Varlen sequences packed in one batch element: tiles that reach past a sequence
read the next one's rows (or past the last one, rows that may hold anything), which are zeroed in shared memory,
and such a key block's dK and dV rows leave by plain stores.

A program takes a block of BLOCK_N keys of one head and walks the query blocks that see them (the mirrored mask of
triton_flash: causal and windowed ranges, their interior unmasked), as in FlashAttention-3's backward:

- one warp loads K and V once, then each query block's Q, dO, LSE and delta through TMA into a ring of STAGES slots;
- two warpgroups (64 keys each) start Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ together, take Pᵀ = exp2(Sᵀ − LSE) while dPᵀ
  is still running and start dV += Pᵀ·dO from registers, then dSᵀ = Pᵀ ∘ (dPᵀ − delta) and dK += dSᵀ·Q; dSᵀ goes to
  shared memory, from which both warpgroups take dQ = dS·K (half the head columns each) once it is whole; dQ's
  share goes to shared memory too, and one TMA reduce-add puts it into the fp32 dQ while the next block runs;
- dK and dV leave through the Q and dO slots by TMA stores.

H200, bf16, backward alone (RESULTS.md, twenty-fifth session): B=4 M=4096 H=16 K=128 no mask 2.73 ms against 3.02
with dQ's shares added by 16-byte vector atomics from registers (503 against 455 TFLOP/s), causal 481 against 436,
B=1 M=16384 causal 524 against 467, B=8 K=64 causal 378 against 384 (no gain at head dim 64). Varlen (twenty-sixth
session, against the Triton kernel that served it): 1.41-1.47x, 32 x 512 to 4 x 4096 causal. Earlier (twenty-first
session): LSE and delta through the ring rather than loaded by the multiplying warps gave 8-14%; measured slower:
the atomics straight from the products' layout (two words a thread), an adding warp taking dQ's shares from shared
memory with atomics, a third ring slot (no change; no room for one now). Fiftieth session: delta read from its slot
once dV's product has started (spills 80 -> 20 bytes at head dim 128, ptxas 12.8) made the backward 2.5-3.5% faster
at head dim 128 (B=4 M=4096 no mask 2.73 -> 2.64 ms); measured slower: the next block's Sᵀ started under this one's
dQ product (left in flight across the loop's back edge, ptxas serialized every warpgroup MMA: 13-18%), dK started
after dQ to run under the dQ share's store (no gain but with the bias; that order crashes ptxas on the varlen kernel).
"""

from __future__ import annotations

import functools
import math

import torch
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from mslk.attention.fmha.triton_flash import (
    _bias_head,
    _bias_view,
    _flat_rows,
    _heads_per_section,
    _key_range,
    _lse2,
    _program_block,
    _sequence,
    _tma_readable,
    _unmasked_key_range,
    _visible,
)
from mslk.core import arch, launch
from mslk.core.gluon import partition_barrier, ring_barriers

HEAD_DIMS = (64, 128)  # the same tiles at both
BLOCK_M = 64  # queries a step
BLOCK_N = 128  # keys a program: 64 per multiplying warpgroup
STAGES = 2  # Q and dO slots of the ring
NUM_WARPS = 8  # the multiplying warpgroups; the loading warp comes on top
LOAD_REGISTERS = 24  # per thread of the loading warp (setmaxnreg), which leaves 240 to the multiplying ones
_LOG2E = gl.constexpr(1.4426950408889634)


@builtin
def _tma_add(tensor_desc, coord, src, _semantic=None):
    """Adds the shared-memory tile src to tensor_desc's box at coord (cp.reduce.async.bulk.tensor, waited for like
    a TMA store): Gluon wraps no TMA reduction on Hopper, its builder has one in Triton 3.6 and 3.7."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def _box(desc, tile):
    """The [rows, K] shared-memory tile as the [1, rows, K] box of a _box_descriptor."""
    return tile._reinterpret(tile.dtype, desc.block_type.shape, desc.layout)


@gluon.jit
def _add_dq(dq_desc, dq_bufs, i, row, box_at):
    """Adds ring block i's dQ share, in its dq_bufs slot, to the query block from row `row` of the batch element
    and column box_at (TMA leaves out the rows past the batch element's queries; varlen: the rows past the
    sequence's get zeros, added to the next sequence's)."""
    _tma_add(dq_desc, [box_at[0], row, box_at[1]], _box(dq_desc, dq_bufs.index(i % dq_bufs.shape[0])))


@gluon.constexpr_function
def _rows_layout(num_warps):
    """Loads and stores of [rows, K] 16-bit shared-memory tiles through registers: 16 bytes a thread, 8 threads
    along a row."""
    return gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])


@gluon.jit
def _zero_rows_from(tile, first):
    """Zeros the rows of the [rows, K] shared-memory tile from row `first` on (varlen: a tile that reaches past its
    sequence holds the next one's rows, or whatever lies after the last one, NaN included), for the partition's
    warps and the tensor cores to read after it. 16 rows at a time: few registers, in the loop over query blocks."""
    CHUNK: gl.constexpr = 16
    ROWS: gl.constexpr = tile.shape[0]
    layout: gl.constexpr = _rows_layout(gl.num_warps())
    rows = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, layout))
    for chunk in gl.static_range(0, ROWS, CHUNK):
        part = tile.slice(chunk, CHUNK)
        part.store(gl.where((chunk + rows < first)[:, None], part.load(layout), 0.0))
    fence_async_shared()
    partition_barrier()


@gluon.jit
def _stat_block(row, skip, BM: gl.constexpr, layout: gl.constexpr):
    """A query block's BM statistics from a ring slot's row, `skip` elements in: varlen rows are 2·BM wide (a power
    of two), as TMA starts a box at a 16-byte boundary, up to 3 elements before the sequence's row (skip = its
    start % 4)."""
    WIDTH: gl.constexpr = row.shape[0]
    if WIDTH == BM:
        block = row.load(layout)
    else:
        whole = row.load(gl.BlockedLayout([1], [32], [gl.num_warps()], [0]))
        block = gl.gather(whole, skip + gl.arange(0, BM, layout=layout), 0)
    return block


@gluon.jit
def _store_rows(ptr, tile, first_row, n, row_width, col):
    """Rows [0, n) of the [rows, K] shared-memory tile to rows first_row on of the contiguous matrix at ptr (rows of
    row_width elements), from column col."""
    layout: gl.constexpr = _rows_layout(gl.num_warps())
    rows = gl.arange(0, tile.shape[0], layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, tile.shape[1], layout=gl.SliceLayout(0, layout))
    offsets = (first_row + rows)[:, None] * row_width + col + cols[None, :]
    gl.store(ptr + offsets, tile.load(layout), mask=(rows < n)[:, None])


@gluon.jit
def _dkdv_tiles(q_bufs, do_bufs):
    """The [BN, K] tiles of dK and dV in the Q and dO slots, once their blocks have all been read: [STAGES, BM, K]
    holds [BN, K]."""
    BN: gl.constexpr = q_bufs.shape[0] * q_bufs.shape[1]
    HEAD_DIM: gl.constexpr = q_bufs.shape[2]
    dk_tile = q_bufs._reinterpret(q_bufs.dtype, [BN, HEAD_DIM], q_bufs.layout)
    dv_tile = do_bufs._reinterpret(do_bufs.dtype, [BN, HEAD_DIM], do_bufs.layout)
    return dk_tile, dv_tile


@gluon.jit
def _store_tiles(dk_desc, dv_desc, at, dk_tile, dv_tile):
    """dK and dV from shared memory to their descriptors' box at `at` (TMA leaves out the rows past the batch
    element's keys)."""
    tma.async_copy_shared_to_global(dk_desc, at, _box(dk_desc, dk_tile))
    tma.async_copy_shared_to_global(dv_desc, at, _box(dv_desc, dv_tile))


@gluon.jit
def _load_partition(q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, bias_desc, k_smem, v_smem, q_bufs, do_bufs,
                    lse_bufs, delta_bufs, bias_bufs, kv_ready, ready, empty, k_row, q_row0, head_col, kv_col, stat_row,
                    bias_at, parts, heads, HAS_BIAS: gl.constexpr):  # fmt: skip
    """The loading warp: K and V once, then the query blocks' Q, dO, their LSE and delta (and bias tile) in order
    (range by range, in each head by head, `heads` of them), query block i into slot i % STAGES once the multiplying
    warps have released the block before it there. The sequence's tiles start at row q_row0 and column head_col of
    Q's and dO's descriptors (the next head's a head dim further; K's and V's at k_row and kv_col), its statistics
    at stat_row (row, column; the next head's a row further), the bias tiles of the program's keys at bias_at (batch
    element, group, head, key; one head)."""
    BM: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    STAGES: gl.constexpr = q_bufs.shape[0]
    NBYTES: gl.constexpr = q_desc.block_type.nbytes + do_desc.block_type.nbytes + 2 * lse_desc.block_type.nbytes
    mbarrier.expect(kv_ready, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [k_row, kv_col], kv_ready, k_smem)
    tma.async_copy_global_to_shared(v_desc, [k_row, kv_col], kv_ready, v_smem)
    i = 0
    for part in gl.static_range(3):
        for head in range(heads):
            col = head_col + head * HEAD_DIM
            stat_at = [stat_row[0] + head, stat_row[1]]
            for start in range(parts[part], parts[part + 1], BM):
                slot = i % STAGES
                # The first turn through the ring finds the slots free: a fresh barrier counts its phase before the
                # first as complete.
                mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)
                bar = ready.index(slot)
                if HAS_BIAS:
                    mbarrier.expect(bar, NBYTES + bias_desc.block_type.nbytes)
                    at = [bias_at[0], bias_at[1], bias_at[2], start, bias_at[3]]
                    tma.async_copy_global_to_shared(bias_desc, at, bar, _box(bias_desc, bias_bufs.index(slot)))
                else:
                    mbarrier.expect(bar, NBYTES)
                stat_col = stat_at[1] + start
                tma.async_copy_global_to_shared(lse_desc, [stat_at[0], stat_col], bar, lse_bufs.index(slot))
                tma.async_copy_global_to_shared(delta_desc, [stat_at[0], stat_col], bar, delta_bufs.index(slot))
                tma.async_copy_global_to_shared(q_desc, [q_row0 + start, col], bar, q_bufs.index(slot))
                tma.async_copy_global_to_shared(do_desc, [q_row0 + start, col], bar, do_bufs.index(slot))
                i += 1


@gluon.jit
def _query_blocks(dk, dv, i, last_at, k_smem, v_smem, q_bufs, do_bufs, ds_bufs, dq_bufs, bias_bufs, ready, empty,
                  lse_rows, delta_rows, dq_desc, box_at, start_row, end_row, cols, q_start, q_len, k_len, shift,
                  window_left, window_right, qk_scale, sm_scale, MASKED: gl.constexpr, VARLEN: gl.constexpr,
                  HAS_BIAS: gl.constexpr):  # fmt: skip
    """dK and dV of the program's keys `cols` over the query blocks [start_row, end_row) of the sequence from row
    q_start (ring blocks i on, the block before them at last_at: its first row and column); each block's dQ share
    goes to dq_bufs and is added to dq_desc's rows (batch element and column box_at) by TMA while the next block runs
    (with one dq_bufs slot, before the next share is stored there). Only MASKED blocks evaluate the mask. HAS_BIAS:
    the ring's bias tiles [BM, BN] add to the scores."""
    BN: gl.constexpr = k_smem.shape[0]
    HEAD_DIM: gl.constexpr = k_smem.shape[1]
    BM: gl.constexpr = q_bufs.shape[1]
    STAGES: gl.constexpr = q_bufs.shape[0]
    # Sᵀ, dPᵀ [BN, BM] and dK, dV [BN, HEAD_DIM]: each warpgroup 64 keys. dQ [BM, HEAD_DIM]: each half the head dim.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                       instr_shape=[16, BM, 16])  # fmt: skip
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                        instr_shape=[16, HEAD_DIM, 16])  # fmt: skip
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                        instr_shape=[16, HEAD_DIM // 2, 16])  # fmt: skip
    for start in range(start_row, end_row, BM):
        slot = i % STAGES
        rows = start + gl.arange(0, BM, layout=gl.SliceLayout(0, s_layout))
        mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
        lse2 = _lse2(_stat_block(lse_rows.index(slot), q_start % 4, BM, gl.SliceLayout(0, s_layout)))
        q = q_bufs.index(slot)
        do = do_bufs.index(slot)
        if VARLEN:  # rows past the sequence: zeros, so that no product sees what lies there (NaN included)
            # (delta here: its rows' gather takes long; up to 4% slower loaded after dV's product starts)
            delta = _stat_block(delta_rows.index(slot), q_start % 4, BM, gl.SliceLayout(0, s_layout))
            if start + BM > q_len:
                _zero_rows_from(q, q_len - start)
                _zero_rows_from(do, q_len - start)
                delta = gl.where(rows < q_len, delta, 0.0)
        s = warpgroup_mma(k_smem, q.permute((1, 0)), gl.zeros([BN, BM], gl.float32, s_layout), use_acc=False,
                          is_async=True)  # fmt: skip
        dp = warpgroup_mma(v_smem, do.permute((1, 0)), gl.zeros([BN, BM], gl.float32, s_layout), use_acc=False,
                           is_async=True)  # fmt: skip
        s = warpgroup_mma_wait(1, deps=(s,))
        s = s * qk_scale
        if HAS_BIAS:
            s += bias_bufs.index(slot).permute((1, 0)).load(s_layout).to(gl.float32) * _LOG2E
        p = gl.exp2(s - lse2[None, :])
        if MASKED:
            p = gl.where(_visible(cols, rows, k_len, q_len, -shift, window_right, window_left), p, 0.0)
        p_a = gl.convert_layout(p.to(q.dtype), a_layout)
        dv = warpgroup_mma(p_a, do, dv, is_async=True)  # runs while dS is taken
        if not VARLEN:  # delta loaded only now: not held across the products (spills 80 -> 20 bytes at head dim
            # 128, 2.5-3.5% faster)
            delta = _stat_block(delta_rows.index(slot), q_start % 4, BM, gl.SliceLayout(0, s_layout))
        dp = warpgroup_mma_wait(1, deps=(dp,))
        ds = (p * (dp - delta[None, :])).to(q.dtype)
        ds_a = gl.convert_layout(ds, a_layout)
        dk = warpgroup_mma(ds_a, q, dk, is_async=True)
        # dSᵀ whole in shared memory (two slots: the other warpgroup may still read the last block's)
        ds_smem = ds_bufs.index(i % 2)
        ds_smem.store(ds)
        fence_async_shared()
        # The add of block i - 2's dQ share has read its slot (i - 1's was issued after the last barrier).
        tma.store_wait(0)
        partition_barrier()
        if i > 0:  # block i - 1's share is whole in shared memory
            _add_dq(dq_desc, dq_bufs, i - 1, last_at[0], (box_at[0], last_at[1]))
        dq = warpgroup_mma(ds_smem.permute((1, 0)), k_smem, gl.zeros([BM, HEAD_DIM], gl.float32, dq_layout),
                           use_acc=False, is_async=True)  # fmt: skip
        dv, dk, dq, p_a, ds_a = warpgroup_mma_wait(0, deps=(dv, dk, dq, p_a, ds_a))
        mbarrier.arrive(empty.index(slot))
        if dq_bufs.shape[0] == 1:  # the add of block i - 1's share, issued above, has read the one slot
            tma.store_wait(0)
            partition_barrier()
        dq_bufs.index(i % dq_bufs.shape[0]).store(dq * sm_scale)
        fence_async_shared()
        last_at = (q_start + start, box_at[1])
        i += 1
    return dk, dv, i, last_at


@gluon.jit
def _mma_partition(k_smem, v_smem, q_bufs, do_bufs, ds_bufs, dq_bufs, bias_bufs, kv_ready, ready, empty, lse_rows,
                   delta_rows, dq_desc, dk_desc, dv_desc, box_at, dkdv_col, first_col, parts, heads, q_start, q_len,
                   k_start, k_len, shift, window_left, window_right, qk_scale, sm_scale, VARLEN: gl.constexpr,
                   HAS_BIAS: gl.constexpr):  # fmt: skip
    """The multiplying warpgroups: the query blocks of the three ranges (masked, unmasked, masked), in each head by
    head (`heads` query heads from dQ's column box_at[1], one head dim apart, that share the program's K and V: dK
    and dV summed over them; the heads' loop inside the ranges': ptxas 12.8 spills 400 bytes of the varlen kernel at
    head dim 128, 1088 with the heads' loop outside, 328 without one); the last block's dQ share, then dK and dV
    through shared memory (the batch element box_at[0], column dkdv_col) by TMA, except for a varlen key block that
    reaches past its sequence: it leaves them in shared memory for the kernel to store its rows (a TMA store would
    overwrite the next sequence's)."""
    BN: gl.constexpr = k_smem.shape[0]
    HEAD_DIM: gl.constexpr = k_smem.shape[1]
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                        instr_shape=[16, HEAD_DIM, 16])  # fmt: skip
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                       instr_shape=[16, q_bufs.shape[1], 16])  # fmt: skip
    cols = first_col + gl.arange(0, BN, layout=gl.SliceLayout(1, s_layout))
    dk = gl.zeros([BN, HEAD_DIM], gl.float32, kv_layout)
    dv = gl.zeros([BN, HEAD_DIM], gl.float32, kv_layout)
    mbarrier.wait(kv_ready, 0)
    if VARLEN:  # a key block that reaches past its sequence
        if first_col + BN > k_len:
            _zero_rows_from(k_smem, k_len - first_col)
            _zero_rows_from(v_smem, k_len - first_col)
    i = 0
    last_at = (0, 0)
    for part in gl.static_range(3):
        for head in range(heads):
            at = (box_at[0], box_at[1] + head * HEAD_DIM)
            dk, dv, i, last_at = _query_blocks(
                dk, dv, i, last_at, k_smem, v_smem, q_bufs, do_bufs, ds_bufs, dq_bufs, bias_bufs, ready, empty,
                lse_rows, delta_rows, dq_desc, at, parts[part], parts[part + 1], cols, q_start, q_len, k_len, shift,
                window_left, window_right, qk_scale, sm_scale, part != 1, VARLEN, HAS_BIAS,
            )  # fmt: skip
    partition_barrier()
    if i > 0:
        _add_dq(dq_desc, dq_bufs, i - 1, last_at[0], (box_at[0], last_at[1]))
    # dK and dV leave from the Q and dO slots
    gl.static_assert(q_bufs.shape[0] * q_bufs.shape[1] == BN)
    dk_tile, dv_tile = _dkdv_tiles(q_bufs, do_bufs)
    dk_tile.store((dk * sm_scale).to(dk_tile.dtype))
    dv_tile.store(dv.to(dv_tile.dtype))
    fence_async_shared()
    partition_barrier()
    if VARLEN:  # a key block that reaches past its sequence: the kernel stores its rows
        if first_col + BN <= k_len:
            _store_tiles(dk_desc, dv_desc, [box_at[0], k_start + first_col, dkdv_col], dk_tile, dv_tile)
    else:
        _store_tiles(dk_desc, dv_desc, [box_at[0], first_col, dkdv_col], dk_tile, dv_tile)
    tma.store_wait(0)  # before the kernel ends: the copies (and the last dQ add) read shared memory


@gluon.jit
def _flash_backward_hopper_kernel(
    q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, dq_desc, dk_desc, dv_desc, bias_desc, dk_ptr, dv_ptr,
    seqstart_q_ptr, seqstart_k_ptr, G, H, KV_HEADS, Mq, Mk, qk_scale, sm_scale, window_left, window_right, stride_bb,
    stride_bg, stride_bh, blocks, section, VARLEN: gl.constexpr, BOTTOM_RIGHT: gl.constexpr, STAGES: gl.constexpr,
    DQ_SLOTS: gl.constexpr, LOAD_REGISTERS: gl.constexpr, HEAD_LOOP: gl.constexpr,
):  # fmt: skip
    """dK and dV (written through dk_desc and dv_desc, [B, Mk, G·H·K] with [1, BLOCK_N, K] boxes, or dk_ptr and
    dv_ptr) and dQ's shares (added through dq_desc, [B, Mq, G·H·K] fp32 with [1, BLOCK_M, K] boxes) of [B, M, G, H, K]
    tensors read through [B·M, G·H·K] descriptors (Q and dO tiles [BLOCK_M, K], K and V tiles [BLOCK_N, K]; K and V
    of KV_HEADS heads a group, H or 1: GQA's one K/V head for the group's H query heads), from the forward's LSE and
    delta = rowsum(dO ∘ O) ([B, G, H, Mq] fp32). dK and dV are a query head's ([B, Mk, G, H, K]), or with HEAD_LOOP
    (KV_HEADS = 1) the K/V head's, [B, Mk, G, 1, K]: a program then takes the group's H query heads one after the
    other, their dK and dV summed in its registers. VARLEN: B = 1 holds the sequences that seqstart_q and seqstart_k
    bound. bias_desc (or None): a tensor bias's [1, 1, 1, BLOCK_M, BLOCK_N] tiles (triton_flash._bias_view; its
    dimensions of stride 0 read at index 0; not with HEAD_LOOP). Programs: (key block, sequence·group·head, or
    sequence·group with HEAD_LOOP) in triton_flash's order."""
    BM: gl.constexpr = q_desc.block_type.shape[0]
    BN: gl.constexpr = k_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = k_desc.block_type.shape[1]
    heads = H if HEAD_LOOP else 1  # query heads a program
    DKDV_HEADS = 1 if HEAD_LOOP else H
    rank, pid_bgh = _program_block(blocks, section)
    b, g, h = pid_bgh // (G * DKDV_HEADS), (pid_bgh // DKDV_HEADS) % G, pid_bgh % DKDV_HEADS  # h: the first head
    dkdv_col = (g * DKDV_HEADS + h) * HEAD_DIM
    q_start, q_len, k_start, k_len, batch = _sequence(b, seqstart_q_ptr, seqstart_k_ptr, None, Mq, Mk, VARLEN, False)
    batch = batch.to(gl.int64)
    shift = k_len - q_len if BOTTOM_RIGHT else 0
    first_col = rank * BN
    # Query j sees key i as key i sees query j under the mirrored mask (shift and windows swapped).
    lo, hi = _key_range(first_col, k_len, q_len, -shift, window_right, window_left, BN, BM)
    if VARLEN:
        if first_col >= k_len:  # a key block past the sequence's keys: no query block, no row written
            lo, hi = 0, 0
    full_lo, full_hi = _unmasked_key_range(lo, hi, first_col, k_len, q_len, -shift, window_right, window_left, BN, BM)
    if first_col + BN > k_len:  # keys past the sequence's (the next one's rows under TMA): all masked
        full_lo, full_hi = hi, hi

    q_bufs = gl.allocate_shared_memory(q_desc.dtype, [STAGES, BM, HEAD_DIM], q_desc.layout)
    do_bufs = gl.allocate_shared_memory(do_desc.dtype, [STAGES, BM, HEAD_DIM], do_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [BN, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [BN, HEAD_DIM], v_desc.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, BM], q_desc.dtype)
    ds_bufs = gl.allocate_shared_memory(q_desc.dtype, [2, BN, BM], ds_layout)
    # dQ's shares: one being added by TMA while the next is made (one slot: the bias ring takes the other's room)
    dq_tile_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, HEAD_DIM], gl.float32)
    dq_bufs = gl.allocate_shared_memory(gl.float32, [DQ_SLOTS, BM, HEAD_DIM], dq_tile_layout)
    HAS_BIAS: gl.constexpr = bias_desc is not None
    gl.static_assert(not (HEAD_LOOP and HAS_BIAS))
    # warp_specialize's partitions take no None: without a bias, Q's descriptor and ring stand in (never read).
    bias_tiles = q_desc
    bias_bufs = q_bufs
    bias_at = (0, 0, 0, 0)
    if HAS_BIAS:
        bias_tiles = bias_desc
        bias_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BN], bias_desc.dtype)
        bias_bufs = gl.allocate_shared_memory(bias_desc.dtype, [STAGES, BM, BN], bias_layout)
        bias_b, bias_g, bias_h = _bias_head(batch, g, h, stride_bb, stride_bg, stride_bh)
        bias_at = (bias_b.to(gl.int32), bias_g, bias_h, first_col)
    STAT_W: gl.constexpr = lse_desc.block_type.shape[1]  # BM, varlen 2·BM (_stat_block)
    lse_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, 1, STAT_W], lse_desc.layout)
    delta_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, 1, STAT_W], delta_desc.layout)
    # The [1, BM] boxes TMA writes, read back as [BM] rows (same bytes, no swizzle).
    rows_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    lse_rows = lse_bufs._reinterpret(gl.float32, [STAGES, STAT_W], rows_layout)
    delta_rows = delta_bufs._reinterpret(gl.float32, [STAGES, STAT_W], rows_layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    ready, empty = ring_barriers(STAGES)
    gl.warp_specialize(
        [
            (_mma_partition, (
                k_smem, v_smem, q_bufs, do_bufs, ds_bufs, dq_bufs, bias_bufs, kv_ready, ready, empty, lse_rows,
                delta_rows, dq_desc, dk_desc, dv_desc, (batch.to(gl.int32), (g * H + h) * HEAD_DIM), dkdv_col,
                first_col, (lo, full_lo, full_hi, hi), heads, q_start, q_len, k_start, k_len, shift, window_left,
                window_right, qk_scale, sm_scale, VARLEN, HAS_BIAS,
            )),
            (_load_partition, (
                q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, bias_tiles, k_smem, v_smem, q_bufs, do_bufs,
                lse_bufs, delta_bufs, bias_bufs, kv_ready, ready, empty,
                (batch * Mk + k_start + first_col).to(gl.int32), (batch * Mq + q_start).to(gl.int32),
                (g * H + h) * HEAD_DIM, (g * KV_HEADS + h % KV_HEADS) * HEAD_DIM,
                (((batch * G + g) * H + h).to(gl.int32), q_start - q_start % 4), bias_at, (lo, full_lo, full_hi, hi),
                heads, HAS_BIAS,
            )),
        ],
        [1],
        [LOAD_REGISTERS],
    )  # fmt: skip
    if VARLEN:
        if first_col + BN > k_len:  # dK and dV, left in the Q and dO slots (a TMA store would overwrite the next
            # sequence's rows; the partitions do not take pointers)
            rows = k_len - first_col
            dk_tile, dv_tile = _dkdv_tiles(q_bufs, do_bufs)
            _store_rows(dk_ptr, dk_tile, k_start + first_col, rows, G * DKDV_HEADS * HEAD_DIM, dkdv_col)
            _store_rows(dv_ptr, dv_tile, k_start + first_col, rows, G * DKDV_HEADS * HEAD_DIM, dkdv_col)


def _tma_operands(*tensors: torch.Tensor, pointers: bool = True) -> bool:
    """Whether the Gluon attention kernels read these [B, M, G, H, K] operands: what triton_flash's TMA paths read
    (an sm_90 GPU, 16-bit, aligned rows without stride 0, rows of a [B·M, G·H·K] matrix), all of one dtype.
    pointers: as _tma_readable's."""
    return (
        _tma_readable(*tensors, pointers=pointers)
        and all(_flat_rows(t) for t in tensors)
        and len({t.dtype for t in tensors}) == 1
    )


def _kv_read(t: torch.Tensor) -> torch.Tensor:
    """K or V [B, M, G, H, K] as the kernel reads it: one head a group where it is expanded over H with stride 0
    (GQA: the group's query heads read that head), else as it is. The view's dims of one element (its head, a BMHK
    input's group, expanded too) get the packed stride K: never stepped, and TMA's checks refuse stride 0."""
    b, m, g, h, k = t.shape
    strides = t.stride()
    if h == 1 or strides[3] != 0:
        return t
    return t.as_strided((b, m, g, 1, k), (*strides[:2], strides[2] if g > 1 else k, k, strides[4]))


def supports(q, k, v, do, pointers: bool = True) -> bool:
    """Whether the kernel serves these [B, M, G, H, K] operands (triton_flash checks the rest: mask, bias, dropout,
    determinism): _tma_operands (pointers: whether it reads the data pointers; K and V as _kv_read reads them, both
    expanded over H or neither), and one head dim of HEAD_DIMS."""
    k_read, v_read = _kv_read(k), _kv_read(v)
    return (
        k_read.shape[3] == v_read.shape[3]
        and _tma_operands(q, k_read, v_read, do, pointers=pointers)
        and q.shape[-1] == v.shape[-1] in HEAD_DIMS
        # offsets within a batch element in int32 (dQ, dK and dV are contiguous like q and k)
        and max(math.prod(q.shape[1:]), math.prod(k.shape[1:])) < 2**31
    )


# The heads' loop: a program takes a group's h query heads one after the other, their dK and dV summed in its
# registers (h x fewer programs, dK/dV rows written once, no torch sum after the kernel), each program h times
# longer, so that the last wave's tail grows. GQA training on an H100 (RESULTS.md, seventy-fourth session), kernel
# time against a program a head: 1.01-1.12x with at least h waves of the loop's programs (h x SMs); with fewer,
# 0.42-0.89x at h = 8 and 16 causal (1.03x without a mask), 0.79-1.03x at h = 4.
HEAD_LOOP_MIN_WAVES = 1.0  # of the loop's programs, a query head of a group


def sums_heads(k, bias, varlen) -> bool:
    """Whether run() sums the dK and dV of a group's query heads in the kernel for these [B, M, G, H, K] operands (K
    and V expanded over H): no tensor bias, at least HEAD_LOOP_MIN_WAVES x H waves of programs."""
    blocks, sequences = _key_blocks_and_sequences(k, varlen)
    groups, heads = k.shape[2:4]
    return bias is None and blocks * sequences * groups >= HEAD_LOOP_MIN_WAVES * heads * arch.sm_count(k.device)


def _key_blocks_and_sequences(k, varlen) -> tuple[int, int]:
    """The grid's key blocks a sequence and sequences for [B, M, G, H, K] keys (varlen: of common.VarlenArgs)."""
    if varlen is None:
        return launch.cdiv(k.shape[1], BLOCK_N), k.shape[0]
    return launch.cdiv(varlen.max_seqlen_k, BLOCK_N), varlen.num_sequences


@functools.cache
def _tile_layout(shape: tuple[int, ...], element_bits: int = 16):
    """Shared-memory layout of tiles of this shape, 16-bit (fp16 and bf16 alike) or fp32, made once:
    get_default_for costs host time on every launch."""
    return gl.NVMMASharedLayout.get_default_for(list(shape), gl.float32 if element_bits == 32 else gl.float16)


def _descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """[rows, K] tiles of a [B, M, G, H, K] tensor seen as [B·M, G·H·K] (zeros past its last row)."""
    b, m, g, h, k = t.shape
    return TensorDescriptor(t, [b * m, g * h * k], [t.stride(1), 1], [rows, k], _tile_layout((rows, k)))


def _bias_descriptor(bias: torch.Tensor, q: torch.Tensor, rows: int, cols: int) -> TensorDescriptor:
    """[1, 1, 1, rows, cols] tiles of a [B, G, H, Mq, Mk] tensor bias that TMA reads (triton_flash._bias_view: its
    dimensions of stride 0 held as one element; zeros past Mq and Mk)."""
    box = [1, 1, 1, rows, cols]
    return TensorDescriptor(bias, *_bias_view(bias, q), box, _tile_layout(tuple(box)))


_STAT_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


def _box_descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """[1, rows, K] boxes of a contiguous [B, M, G, H, K] tensor (dQ's fp32 sum, dK, dV) as [B, M, G·H·K]: TMA cuts
    a box at the sequence's last row, where a [B·M, G·H·K] tile would reach the next sequence's rows."""
    b, m, g, h, k = t.shape
    flat = t.view(b, m, g * h * k)
    layout = _tile_layout((1, rows, k), t.element_size() * 8)
    return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [1, rows, k], layout)


def _stat_descriptor(t: torch.Tensor, block: int) -> TensorDescriptor:
    """[1, block] boxes of a contiguous [B, G, H, Mq] fp32 statistic (LSE, delta) as [B·G·H, Mq] rows (zeros past
    Mq), copied to 16-byte rows where Mq is not a multiple of 4 (TMA's stride alignment). The stride is the padded
    copy's own: a slice of it flattened where B·G·H = 1 would get the stride Mq back."""
    b, g, h, m = t.shape
    rows = t.reshape(b * g * h, m)
    if m % 4:
        rows = torch.nn.functional.pad(rows, (0, 4 - m % 4))
    return TensorDescriptor(rows, [b * g * h, m], [rows.stride(0), 1], [1, block], _STAT_LAYOUT)


def run(q, k, v, do, lse, delta, dq_sum, dk, dv, scale, window_left, window_right, bottom_right, varlen=None,
        bias=None):  # fmt: skip
    """dK, dV (written) and dQ (added to the zeroed fp32 dq_sum) of [B, M, G, H, K] tensors; varlen: common.VarlenArgs
    of a block-diagonal mask without padded keys (B = 1; the rows outside every sequence are left as they are);
    bias: a [B, G, H, Mq, Mk] tensor bias without gradient that supports() took (not with varlen). dK and dV of one
    head a group where K and V are expanded over H (GQA) and no bias: their sum over the group's query heads."""
    _, mq, groups, heads, dim = q.shape
    head_loop = dk.shape[3] == 1 < heads
    mk = k.shape[1]
    blocks, sequences = _key_blocks_and_sequences(k, varlen)
    bias_desc = None if bias is None else _bias_descriptor(bias, q, BLOCK_M, BLOCK_N)
    k, v = _kv_read(k), _kv_read(v)
    launch.fast(_flash_backward_hopper_kernel)[(blocks * sequences * groups * dk.shape[3],)](
        _descriptor(q, BLOCK_M), _descriptor(do, BLOCK_M), _descriptor(k, BLOCK_N), _descriptor(v, BLOCK_N),
        *(_stat_descriptor(t, BLOCK_M if varlen is None else 2 * BLOCK_M) for t in (lse, delta)),
        _box_descriptor(dq_sum, BLOCK_M),
        _box_descriptor(dk, BLOCK_N), _box_descriptor(dv, BLOCK_N), bias_desc, dk, dv,
        *(None, None) if varlen is None else (varlen.seqstart_q, varlen.seqstart_k), groups, heads, k.shape[3], mq, mk,
        scale * _LOG2E.value, scale, window_left, window_right, *(bias.stride()[:3] if bias is not None else (0,) * 3),
        blocks, _heads_per_section(blocks, q.device), VARLEN=varlen is not None, BOTTOM_RIGHT=bottom_right,
        STAGES=STAGES, DQ_SLOTS=1 if bias is not None and dim > 64 else 2, LOAD_REGISTERS=LOAD_REGISTERS,
        HEAD_LOOP=head_loop, num_warps=NUM_WARPS,
    )  # fmt: skip
