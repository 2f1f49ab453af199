"""The GEMM of bf16i4bf16_rowwise and bf16i4bf16_shuffled for decode shapes (M <= 16 activation rows), and of their
grouped forms for groups of decode rows, on Hopper (sm_90), written in Gluon:

    out[m, n] = Σ_k X[m, k] · (q[n, k] · scale[k // gs, n] + zero[k // gs, n])      (bf16 out, fp32 sums)

Decode streams the weights once; what limits a kernel there is the work per weight between the loads (the Triton
kernel, int4_gemm._int4_k_loop: about 390 instructions a warp for 64 nibble pairs a thread, and seven CTA barriers a
step moving the group scales between layouts through shared memory). Here:

- K is relabelled within each run of 64 k, so that a thread's mma.sync operand pairs are the nibbles (j, j + 4) of
  the 32-bit words it reads (ldmatrix, as int8 operands): one LOP3 on the word shifted by 4j makes the bf16 pair
  128 + u of both (1.75 instructions a pair, no byte shuffles). `_activations_kernel` (Triton) first writes X in the
  same order, X' [runs, BM, 64] (runs filling whole stages; rows past M and k past K zero), and the sums of X
  over each run (S).
- The products multiply the biased weights 136 + q (exact in bf16); each scale block's scale and zero apply to
  them in fp32 (acc += s · P + (z − 136 s) · S), so the dequantization is exact.
- Warp-specialized: one warp loads each stage (256 k: W's 128 contiguous bytes of 64 weight rows in one box, X',
  scales, zeros and sums) through TMA into a ring; two groups of four warps take the stages in turn (16 weight rows
  a warp; the second group's sums meet the first's in shared memory at the end), with no CTA-wide barrier in the
  loop (a group's four warps sync before releasing a stage).
- Both kernels are launched as dependents (griddepcontrol): the first takes its places while the kernel before it
  ends, waits for that kernel's writes, and only then lets the multiplying kernel launch, whose first turn of
  weights loads before it waits for X' (so still after all earlier work). The multiplying kernel lets nothing launch
  early: the next call's first kernel taking its places at its start measured slower (RESULTS.md).
- Programs: 64-row tiles of the weights times splits of K, about one program per SM; with more than one split each
  writes fp32 partial sums that split_k.splitk_reduce adds.

Grouped (X stacks the groups' rows, M_sizes read on the device): the first kernel also writes a work list, items
of (group, first row, rows) of at most 8 or 16 rows of one group, then the rows past the sizes' sum (zeros to write),
and the multiplying programs take an item each (times the tiles of N and the splits of K). So each group's weights
stream once per item, an empty group's not at all, and no program's rows cross a group.

Only the first kernel knows the weights' layout: in the preshuffled one a run's 32 bytes hold 32 k and the 32 k
64 further (byte j of a 128-k block holds k = j and j + 64), so X' takes those.

H200, graphs, 3 rotating weight copies (RESULTS.md, eighteenth and nineteenth sessions): 16 x 8192 x 8192 in
14.5-15.0 us against 19.4 for the Triton kernel (preshuffled: 15.0 against 22.8); 1 x 8192 x 8192 13.1-14.0 against
18.8; 16 x 8192 x 28672 40.3 against 53.0.

The relabelling (`_relabelled`): in a 64-k run, the kernel's k index T = 32i + 8j + 2c + h holds the nibble
R = 32i + 8c + j + 4h of the run's bytes (`_run_nibble`; the real k in the plain layout): thread c of an mma.sync
quad holds bytes j of words c and c + 4 (the int8 operand layout), whose nibbles j and j + 4 are nibbles 8·word + j
and 8·word + j + 4 of the run.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from mslk.core import arch, launch
from mslk.core.gluon import ring_barriers
from mslk.gemm.triton.fp8_gemm import tma_ready
from mslk.gemm.triton.int4_ptx import WORD_PAIRS_PTX
from mslk.gemm.triton.split_k import splitk_reduce

MAX_M = 16  # activation rows served (mma.sync's N: 8 or 16)
BLOCK_N = 64  # weight rows of a program: 16 per multiplying warp
RUN = 64  # k per relabelled run: one mma_v2 call
STAGE_K = 256  # k per ring stage: four runs, 128 bytes of each weight row
STAGES = 6  # 6 · (8 KiB of weights + 8 KiB of activations) + scales; 4 and 8 measured slower (RESULTS.md)
NUM_WARPS = 4  # the multiplying warps of a K group; the loading warp comes on top
KGROUPS = 2  # groups of multiplying warps taking the stages in turn (1 and 3 measured slower); the ring's slots
# are a multiple of it
MMA_REGISTERS = 240  # per thread of the K groups but the first (setmaxnreg)
LOAD_REGISTERS = 24  # per thread of the loading warp (setmaxnreg)
MAX_ITEMS = 65535  # a grid's third dimension: the grouped work list's items
_RUN = gl.constexpr(RUN)  # the same, for the kernels
_STAGE_K = gl.constexpr(STAGE_K)
_KGROUPS = gl.constexpr(KGROUPS)


@triton.jit
def _run_nibble(t):
    """The nibble (2 · byte + 1 if high) of a run's 32 bytes that the kernel's k index t multiplies: in the plain
    layout, the real k within the run (see the module docstring)."""
    h, c, j, i = t & 1, (t >> 1) & 3, (t >> 3) & 3, t >> 5
    return 32 * i + 8 * c + j + 4 * h


@triton.jit
def _work_items(sizes_ptr, items_ptr, G, ROWS, ITEMS, CHUNK: tl.constexpr, G_BLOCK: tl.constexpr,
                I_BLOCK: tl.constexpr):  # fmt: skip
    """The grouped kernel's work list items [ITEMS, 3] int32: (group, first row, rows) of each run of at most CHUNK
    rows of a group, group by group, then (-1, first row, rows) of the rows past the groups' sum (zeros to write),
    then (-1, ROWS, 0) (nothing). Sizes are clamped as gluon_tile_order.group_tiles clamps them (negative ones 0,
    none past ROWS)."""
    g = tl.arange(0, G_BLOCK)
    in_g = g < G
    sizes = tl.minimum(tl.maximum(tl.load(sizes_ptr + g, mask=in_g, other=0), 0), ROWS).to(tl.int32)
    ends = tl.cumsum(sizes, axis=0)
    starts = tl.minimum(ends - sizes, ROWS)
    rows = tl.minimum(ends, ROWS) - starts
    chunks = tl.cdiv(rows, CHUNK)
    item_ends = tl.cumsum(chunks, axis=0)
    group_items = tl.sum(chunks, axis=0)
    used = tl.sum(rows, axis=0)
    for first in range(0, ITEMS, I_BLOCK):
        w = first + tl.arange(0, I_BLOCK)
        group = tl.sum(((item_ends[None, :] <= w[:, None]) & in_g[None, :]).to(tl.int32), axis=1)
        this = g[None, :] == group[:, None]  # one-hot: the item's group (none past the groups' items)
        chunk_row = CHUNK * (w - tl.sum(tl.where(this, item_ends - chunks, 0), axis=1))
        group_first = tl.sum(tl.where(this, starts, 0), axis=1)
        group_rows = tl.sum(tl.where(this, rows, 0), axis=1)
        tail_first = tl.minimum(used + CHUNK * (w - group_items), ROWS)
        past = w >= group_items
        first_row = tl.where(past, tail_first, group_first + chunk_row)
        count = tl.where(past, tl.minimum(ROWS - tail_first, CHUNK), tl.minimum(group_rows - chunk_row, CHUNK))
        mask = w < ITEMS
        tl.store(items_ptr + 3 * w, tl.where(past, -1, group), mask=mask)
        tl.store(items_ptr + 3 * w + 1, first_row, mask=mask)
        tl.store(items_ptr + 3 * w + 2, count, mask=mask)


@triton.jit
def _activations_kernel(x_ptr, xp_ptr, sums_ptr, sizes_ptr, items_ptr, M, K, XROWS, G, ITEMS, stride_xm,
                        stride_xk, BM: tl.constexpr, SHUFFLED: tl.constexpr, DEPENDENT: tl.constexpr,
                        CHUNK: tl.constexpr, G_BLOCK: tl.constexpr):  # fmt: skip
    """One run of 64 k (32 bytes of each weight row) for BM of X' rows: X'[run, m, t] = X[m, k of t] (zero past M
    and K) and sums[run // 4, m, run % 4] = Σ_k X[m, k] over the run's k (fp32), m < XROWS; the grid's runs fill
    whole stages. Nibble R = run_nibble(t) of the run's bytes is k = 64 run + R in the plain layout; in the
    preshuffled one (byte j of a 128-k block holds k = j and j + 64) k = 128 (run // 2) + 32 (run % 2) + R // 2 +
    64 (R % 2). Grouped (sizes_ptr not None), the programs of the grid's last run build the multiplying kernel's
    work list instead (_work_items). DEPENDENT (launched as a dependent of the kernel before it): wait for that
    kernel's writes, then let the multiplying kernel, this one's dependent, take its places (it waits on the GPU
    for this kernel's writes)."""
    if DEPENDENT:
        gdc_wait()
        gdc_launch_dependents()
    run = tl.program_id(0)
    if sizes_ptr is not None and run == tl.num_programs(0) - 1:
        if tl.program_id(1) == 0:
            _work_items(sizes_ptr, items_ptr, G, M, ITEMS, CHUNK, G_BLOCK, 32)
    else:
        rows = tl.program_id(1) * BM + tl.arange(0, BM)[:, None]
        t = tl.arange(0, 64)[None, :]
        nibble = _run_nibble(t)
        if SHUFFLED:
            k = (run // 2) * 128 + (run % 2) * 32 + nibble // 2 + (nibble % 2) * 64
        else:
            k = run * 64 + nibble
        x = tl.load(x_ptr + rows * stride_xm + k * stride_xk, mask=(rows < M) & (k < K), other=0.0)
        tl.store(xp_ptr + (run * XROWS + rows) * 64 + t, x, mask=rows < XROWS)
        sum_rows = tl.program_id(1) * BM + tl.arange(0, BM)
        stage_runs: tl.constexpr = _STAGE_K // _RUN
        sum_ptrs = sums_ptr + ((run // stage_runs) * XROWS + sum_rows) * stage_runs + run % stage_runs
        tl.store(sum_ptrs, tl.sum(x.to(tl.float32), axis=1), mask=sum_rows < XROWS)


@gluon.jit
def _relabelled(packed, a_layout: gl.constexpr):
    """The weight bytes [BN, 32] of a 64-k run (int8 mma.sync operand layout: thread c of a quad holds words c and
    c + 4 of each of its rows) as the bf16 operand [BN, 64] of the biased weights 136 + q in the kernel's k order.
    One LOP3 a pair: word >> 4j masked to bits 0-3 and 16-19, the magic 0x4300 | (u ^ 8)."""
    pairs = gl.inline_asm_elementwise(WORD_PAIRS_PTX, "=r,=r,=r,=r,r", [packed], dtype=gl.int32, is_pure=True, pack=4)
    # byte b = 16i + 4c + j of a row -> pair (nibble j, nibble j + 4) of word 4i + c; k index 32i + 8j + 2c + h.
    halves = gl.join(pairs.to(gl.int16), (pairs >> 16).to(gl.int16))
    rows: gl.constexpr = packed.shape[0]
    ordered = halves.reshape([rows, 2, 4, 4, 2]).permute((0, 1, 3, 2, 4)).reshape([rows, 64])
    return gl.convert_layout(ordered.to(gl.bfloat16, bitcast=True), a_layout)


@gluon.jit
def _load_weights(w_desc, s_desc, z_desc, w_bufs, s_bufs, z_bufs, bar, slot, k, w_row, s_row, off_n,
                  GROUP_SIZE: gl.constexpr):  # fmt: skip
    """A stage's weights (rows from w_row), scales and zeros (rows from s_row; k on), onto its slot's barrier."""
    tma.async_copy_global_to_shared(w_desc, [w_row, k // 2], bar, w_bufs.index(slot))
    tma.async_copy_global_to_shared(s_desc, [s_row + k // GROUP_SIZE, off_n], bar, s_bufs.index(slot))
    tma.async_copy_global_to_shared(z_desc, [s_row + k // GROUP_SIZE, off_n], bar, z_bufs.index(slot))


@gluon.jit
def _load_partition(w_desc, x_desc, s_desc, z_desc, sums_desc, w_bufs, x_bufs, s_bufs, z_bufs, sums_bufs, ready,
                    empty, first_stage, stages, w_row, s_row, x_row, GROUP_SIZE: gl.constexpr,
                    DEPENDENT: gl.constexpr):  # fmt: skip
    """The loading warp: the program's stages in order, each into the next slot of the ring once the multiplying
    warps have released the stage loaded there before (weights from row w_row, scales and zeros from row s_row,
    X' and sums from row x_row). DEPENDENT (launched as a dependent of the activations' kernel, which lets it
    launch only once the kernel before that one has finished): the first turn's weights load at once, X' and the
    sums after the wait for the activations' kernel's writes."""
    SLOTS: gl.constexpr = w_bufs.shape[0]
    NBYTES: gl.constexpr = (w_desc.block_type.nbytes + x_desc.block_type.nbytes + s_desc.block_type.nbytes
                            + z_desc.block_type.nbytes + sums_desc.block_type.nbytes)  # fmt: skip
    off_n = gl.program_id(0) * w_desc.block_type.shape[0]
    first_turn = gl.minimum(stages, SLOTS)
    for i in range(first_turn):  # fresh slots: no wait
        mbarrier.expect(ready.index(i), NBYTES)
        k = (first_stage + i) * _STAGE_K
        _load_weights(
            w_desc, s_desc, z_desc, w_bufs, s_bufs, z_bufs, ready.index(i), i, k, w_row, s_row, off_n, GROUP_SIZE
        )
    if DEPENDENT:
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
    for i in range(stages):
        slot = i % SLOTS
        bar = ready.index(slot)
        k = (first_stage + i) * _STAGE_K
        if i >= SLOTS:
            mbarrier.wait(empty.index(slot), ((i // SLOTS) & 1) ^ 1)
            mbarrier.expect(bar, NBYTES)
            _load_weights(w_desc, s_desc, z_desc, w_bufs, s_bufs, z_bufs, bar, slot, k, w_row, s_row, off_n, GROUP_SIZE)
        tma.async_copy_global_to_shared(x_desc, [k // _RUN, x_row, 0], bar, x_bufs.index(slot))
        sums_column = x_row * (_STAGE_K // _RUN)  # a row's runs of a stage lie together
        tma.async_copy_global_to_shared(sums_desc, [k // _STAGE_K, sums_column], bar, sums_bufs.index(slot))


@gluon.jit
def _mma_partition(w_bufs, x_tiles, s_rows, z_rows, sums_tiles, ready, empty, partial, partial_ready, c_ptr,
                   first_row, M, N, stride_cs, stride_cm, stages, GROUP_SIZE: gl.constexpr, SPLIT: gl.constexpr,
                   KGROUP: gl.constexpr):  # fmt: skip
    """A group of multiplying warps (KGROUP of KGROUPS): every KGROUPS-th stage from KGROUP on, each stage's four runs
    (one mma.sync product each), the scales applied per scale block. Then the groups' sums meet in group 0
    (`partial`), which writes the tile's output, M rows from first_row (bf16, or fp32 partial sums into the split's
    slice of the workspace)."""
    BN: gl.constexpr = w_bufs.shape[1]
    BM: gl.constexpr = x_tiles.shape[1]
    RUNS: gl.constexpr = _STAGE_K // _RUN
    SLOTS: gl.constexpr = w_bufs.shape[0]
    SB: gl.constexpr = _STAGE_K if GROUP_SIZE > _STAGE_K else GROUP_SIZE  # k a scale block: a group, or a stage
    GROUPS: gl.constexpr = s_rows.shape[0] // SLOTS  # rows of scales (and zeros) a stage
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[2, 0], warps_per_cta=[gl.num_warps(), 1], instr_shape=[16, 8]
    )
    byte_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=4)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
    b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    token_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
    # A stage's sums of X [BM, RUNS], a token's runs in one thread and its tokens where the MMA's columns lie (so
    # a scale block's sum over its runs lands in token_layout without moving).
    sums_layout: gl.constexpr = gl.BlockedLayout([2, RUNS], [4, 8], [1, gl.num_warps()], [0, 1])
    run_index = gl.arange(0, RUNS, layout=gl.SliceLayout(0, sums_layout))[None, :]
    acc = gl.zeros([BN, BM], gl.float32, mma_layout)
    for i in range(KGROUP, stages, _KGROUPS):
        slot = i % SLOTS
        mbarrier.wait(ready.index(slot), (i // SLOTS) & 1)
        product = gl.zeros([BN, BM], gl.float32, mma_layout)
        run_sums = sums_tiles.index(slot).load(sums_layout)
        for run in gl.static_range(RUNS):
            a = _relabelled(w_bufs.index(slot).slice(run * (_RUN // 2), _RUN // 2, dim=1).load(byte_layout), a_layout)
            b = x_tiles.index(slot * RUNS + run).permute((1, 0)).load(b_layout)
            product = mma_v2(a, b, product)
            if (run + 1) * _RUN % SB == 0:  # the end of a scale block
                group = ((run + 1) * _RUN - SB) // GROUP_SIZE
                block = (run_index > run - SB // _RUN) & (run_index <= run)
                sums = gl.convert_layout(gl.sum(gl.where(block, run_sums, 0.0), axis=1), token_layout)
                s = s_rows.index(slot * GROUPS + group).load(row_layout).to(gl.float32)[:, None]
                z = z_rows.index(slot * GROUPS + group).load(row_layout).to(gl.float32)[:, None]
                acc = acc + product * s + sums[None, :] * (z - 136.0 * s)
                product = gl.zeros([BN, BM], gl.float32, mma_layout)
        mbarrier.arrive(empty.index(slot))
    if KGROUP != 0:
        partial.index(KGROUP - 1).store(acc)
        mbarrier.arrive(partial_ready.index(KGROUP - 1))
        return
    for other in gl.static_range(_KGROUPS - 1):
        mbarrier.wait(partial_ready.index(other), 0)
        acc += partial.index(other).load(mma_layout)
    rows = gl.program_id(0) * BN + gl.arange(0, BN, layout=row_layout)
    tokens = gl.arange(0, BM, layout=token_layout)
    ptrs = c_ptr + gl.program_id(1) * stride_cs + (first_row + tokens)[None, :] * stride_cm + rows[:, None]
    mask = (rows < N)[:, None] & (tokens < M)[None, :]
    if SPLIT:
        gl.store(ptrs, acc, mask=mask)
    else:
        gl.store(ptrs, acc.to(gl.bfloat16), mask=mask)


@gluon.jit
def _int4_decode_kernel(w_desc, x_desc, s_desc, z_desc, sums_desc, c_ptr, items_ptr, M, N, groups, stride_cs,
                        stride_cm, stages_per_split, total_stages, GROUP_SIZE: gl.constexpr, SLOTS: gl.constexpr,
                        SPLIT: gl.constexpr, NUM_WARPS: gl.constexpr, MMA_REGISTERS: gl.constexpr,
                        LOAD_REGISTERS: gl.constexpr, DEPENDENT: gl.constexpr):  # fmt: skip
    """C [M, N] (bf16; SPLIT: fp32 partials [splits, M, N], split = program_id(1)) of the relabelled activations X'
    (x_desc: [runs, BM, 64] in [4, BM, 64] boxes) and plain packed int4 W [N, K / 2] (w_desc: [BN, 128] boxes,
    128-byte swizzled; a run is a 32-byte column slice of its stage's tile), scales and zeros [groups, N] (boxes of a
    stage's groups and BN rows), and X's sums [runs / 4, BM · 4] (a stage's BM rows of 4 runs a box: [1, BM · 4],
    which starts 16-byte aligned at any row, as TMA needs, and reads 256 contiguous bytes a stage).

    Grouped (items_ptr not None: the work list of _work_items, item program_id(2)): X' and its sums hold all rows
    ([runs, rows, 64], [runs / 4, rows · 4]), W the groups' [G · N, K / 2] and the scales and zeros [G · groups, N]; the
    program multiplies its item's rows by its group's weights (rows of a tile past N read the next group's, never
    stored), writes zeros for an item of rows past the groups (group -1), and nothing for an item of no rows."""
    RUNS: gl.constexpr = _STAGE_K // _RUN
    BN: gl.constexpr = w_desc.block_type.shape[0]
    BM: gl.constexpr = x_desc.block_type.shape[1]
    S_ROWS: gl.constexpr = s_desc.block_type.shape[0]  # groups a stage (of scales and of zeros)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [SLOTS, BN, _STAGE_K // 2], w_desc.layout)
    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [SLOTS, RUNS, BM, _RUN], x_desc.layout)
    # The same bytes as [SLOTS · RUNS, rows, width] tiles: the boxes' leading dim only stacks tiles of one swizzle.
    x_tile_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=x_desc.layout.swizzle_byte_width,
                                                       element_bitwidth=16, rank=2)  # fmt: skip
    x_tiles = x_bufs._reinterpret(x_desc.dtype, [SLOTS * RUNS, BM, _RUN], x_tile_layout)
    s_bufs = gl.allocate_shared_memory(s_desc.dtype, [SLOTS, S_ROWS, BN], s_desc.layout)
    z_bufs = gl.allocate_shared_memory(z_desc.dtype, [SLOTS, S_ROWS, BN], z_desc.layout)
    sums_bufs = gl.allocate_shared_memory(sums_desc.dtype, [SLOTS, 1, BM * RUNS], sums_desc.layout)
    # The same as rows of a stage's scales and zeros after another, and a stage's sums as [BM, RUNS], for the
    # multiplying warps. Each TMA box is at least 128 bytes, so that each slot's box starts 128-byte aligned, as TMA
    # needs.
    rows_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    s_rows = s_bufs._reinterpret(s_desc.dtype, [SLOTS * S_ROWS, BN], rows_layout)
    z_rows = z_bufs._reinterpret(z_desc.dtype, [SLOTS * S_ROWS, BN], rows_layout)
    tiles_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    sums_tiles = sums_bufs._reinterpret(sums_desc.dtype, [SLOTS, BM, RUNS], tiles_layout)
    ready, empty = ring_barriers(SLOTS)
    # The K groups' sums but the first's, for it to add: [KGROUPS - 1, BN, BM] fp32 and their barriers.
    partial_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    partial = gl.allocate_shared_memory(gl.float32, [_KGROUPS - 1, BN, BM], partial_layout)
    partial_ready = gl.allocate_shared_memory(gl.int64, [_KGROUPS - 1, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(_KGROUPS - 1):
        mbarrier.init(partial_ready.index(i), count=1)
    first_stage = gl.program_id(1) * stages_per_split
    stages = gl.minimum(stages_per_split, total_stages - first_stage)
    off_n = gl.program_id(0) * BN
    if items_ptr is None:
        first_row = 0
        w_row = off_n
        s_row = 0
    else:
        if DEPENDENT:  # the work list is the activations' kernel's
            gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        item = items_ptr + 3 * gl.program_id(2)
        group = gl.load(item)
        first_row = gl.load(item + 1)
        M = gl.load(item + 2)
        stages = gl.where(group >= 0, stages, 0)
        w_row = gl.maximum(group, 0) * N + off_n
        s_row = gl.maximum(group, 0) * groups
    gl.static_assert(_KGROUPS == 2 and SLOTS % _KGROUPS == 0, "two K groups below, each with its own slots")
    gl.warp_specialize(
        [
            (_mma_partition, (w_bufs, x_tiles, s_rows, z_rows, sums_tiles, ready, empty, partial, partial_ready, c_ptr,
                              first_row, M, N, stride_cs, stride_cm, stages, GROUP_SIZE, SPLIT, 0)),
            (_mma_partition, (w_bufs, x_tiles, s_rows, z_rows, sums_tiles, ready, empty, partial, partial_ready, c_ptr,
                              first_row, M, N, stride_cs, stride_cm, stages, GROUP_SIZE, SPLIT, 1)),
            (_load_partition, (w_desc, x_desc, s_desc, z_desc, sums_desc, w_bufs, x_bufs, s_bufs, z_bufs, sums_bufs,
                               ready, empty, first_stage, stages, w_row, s_row, first_row, GROUP_SIZE, DEPENDENT)),
        ],
        [NUM_WARPS, 1],
        [MMA_REGISTERS, LOAD_REGISTERS],
    )  # fmt: skip


def _stacked(t: torch.Tensor) -> torch.Tensor | None:
    """A grouped operand [G, rows, cols] as one matrix [G · rows, cols] where that is a view of it (else None); a
    matrix as itself."""
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        return None


def supports(
    X: torch.Tensor, W: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int, shuffled: bool = False
) -> bool:
    """Whether the kernel serves X [M, K] (M <= MAX_M) and packed W [N, K / 2] (plain, or preshuffled) with scales
    and zeros [groups, N], or grouped, X of any rows and the groups' W [G, N, K / 2], scales and zeros [G, groups, N]
    (each a view of one matrix stacking the groups'): an sm_90 GPU, bf16 activations, runs of 64 k whole (K % 64 ==
    0; preshuffled: its blocks of 128 k, K % 128 == 0) and groups of whole runs (blocks) that divide a stage or are
    whole stages, operands TMA can read (W, scales and zeros: unit last stride, 16-byte aligned rows); grouped, no
    more than MAX_ITEMS items."""
    m, k = X.shape
    unit = 2 * RUN if shuffled else RUN  # a run's k lie in one block of 128 k of the preshuffled layout
    operands = [_stacked(t) for t in (W, scale, zero)]
    grouped = W.dim() == 3
    return (
        arch.on_hopper(X)
        and X.dtype == torch.bfloat16
        and 0 < m
        and (items_bound(m, W.shape[0], item_rows(m, W.shape[0])) <= MAX_ITEMS if grouped else m <= MAX_M)
        and k % unit == 0
        and group_size % unit == 0
        and (STAGE_K % group_size == 0 or group_size % STAGE_K == 0)
        and all(t is not None and tma_ready(t) for t in operands)
    )


_SWIZZLED_DTYPES = {torch.int8: gl.int8, torch.bfloat16: gl.bfloat16}  # W and X', the boxes read as MMA operands


@functools.cache
def _smem_layout(block: tuple[int, ...], dtype: torch.dtype, swizzled: bool) -> gl.NVMMASharedLayout:
    """A TMA box's shared-memory layout, made once per kind (get_default_for costs host time on every call)."""
    if swizzled:
        return gl.NVMMASharedLayout.get_default_for(list(block), _SWIZZLED_DTYPES[dtype])
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=dtype.itemsize * 8, rank=len(block))


def _descriptor(t: torch.Tensor, block: list[int], swizzled: bool = False) -> TensorDescriptor:
    """swizzled: X' and W, read as MMA operands (scales, zeros and sums are read row by row)."""
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, _smem_layout(tuple(block), t.dtype, swizzled))


def item_rows(rows: int, groups: int) -> int:
    """Activation rows of a grouped program (mma.sync's N): 8 where the groups average at most 8 rows, else 16."""
    return 8 if rows <= 8 * groups else MAX_M


def items_bound(rows: int, groups: int, chunk: int) -> int:
    """The most items of the grouped work list (_work_items) for `rows` rows in `groups` groups: each group's
    ⌈rows_g / chunk⌉ and the rows past them ⌈tail / chunk⌉, so at most (rows + (chunk − 1)(groups + 1)) / chunk,
    and no more than rows (an item has a row or more)."""
    return max(1, min(rows, (rows + (chunk - 1) * (groups + 1)) // chunk))


def relabelled_activations(
    X: torch.Tensor, shuffled: bool = False, sizes: torch.Tensor | None = None, items: torch.Tensor | None = None,
    chunk: int = MAX_M,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(X' [runs, BM, 64] bf16, sums [runs / 4, BM, 4] fp32) of X [M, K] (any strides) for plain or preshuffled
    weights, runs filling whole stages (those past K zero): the first kernel. Grouped (sizes [G] row counts on the
    device), X' and the sums of all rows (at least `chunk`: rows of TMA boxes), and the work list of `chunk` rows
    an item written into items."""
    m, k = X.shape
    stage_runs = STAGE_K // RUN
    runs = launch.cdiv(k, STAGE_K) * stage_runs
    if sizes is None:
        rows = block = 8 if m <= 8 else 16
        groups, grid = 0, (runs, 1)
    else:
        rows, block, groups = max(chunk, m), 32, sizes.shape[0]
        grid = (runs + 1, launch.cdiv(rows, block))  # (one more run: the work list's program)
    xp = torch.empty((runs, rows, RUN), dtype=torch.bfloat16, device=X.device)
    sums = torch.empty((runs // stage_runs, rows, stage_runs), dtype=torch.float32, device=X.device)
    dependent = launch.dependent_launch(X.device)
    launch.fast(_activations_kernel)[grid](
        X, xp, sums, sizes, items, m, k, rows, groups, 0 if items is None else items.shape[0], *X.stride(), BM=block,
        SHUFFLED=shuffled, DEPENDENT=dependent, CHUNK=chunk, G_BLOCK=triton.next_power_of_2(max(groups, 1)),
        num_warps=4, **launch.dependent_launch_options(dependent),
    )  # fmt: skip
    return xp, sums


def multiply(xp, sums, W, scale, zero, out, group_size: int, items=None, chunk: int = MAX_M):
    """out [M, N] bf16 (unit column stride) from relabelled_activations' X' and sums, W [N, K / 2], scales and zeros
    [groups, N]: the second kernel (and split_k's reduction where K is split). Grouped (items: the work list of
    `chunk` rows an item), W [G, N, K / 2] and scales and zeros [G, groups, N]."""
    (m, n), k = out.shape, 2 * W.shape[-1]
    bm = xp.shape[1] if items is None else chunk
    groups = scale.shape[-2]
    if items is not None:
        W, scale, zero = (_stacked(t) for t in (W, scale, zero))
    groups_per_stage = max(1, STAGE_K // group_size)
    descs = (
        _descriptor(W, [BLOCK_N, STAGE_K // 2], swizzled=True),
        _descriptor(xp, [STAGE_K // RUN, bm, RUN], swizzled=True),
        _descriptor(scale, [groups_per_stage, BLOCK_N]),
        _descriptor(zero, [groups_per_stage, BLOCK_N]),
        _descriptor(sums.view(sums.shape[0], -1), [1, bm * (STAGE_K // RUN)]),
    )
    total_stages = launch.cdiv(k, STAGE_K)
    tiles = launch.cdiv(n, BLOCK_N)
    work = 1 if items is None else items.shape[0]
    # About one program per SM (two, with twice the splits, measured 15-20% slower on the H200 at 16 x 8192 x 8192);
    # a split keeps at least 4 stages.
    splits = max(1, min(arch.sm_count(out.device) // (tiles * work), total_stages // 4))
    per_split = launch.cdiv(total_stages, splits)
    splits = launch.cdiv(total_stages, per_split)
    c = torch.empty((splits, m, n), dtype=torch.float32, device=out.device) if splits > 1 else out
    dependent = launch.dependent_launch(out.device)
    launch.fast(_int4_decode_kernel)[(tiles, splits, work)](
        *descs, c, items, m, n, groups, c.stride(0) if splits > 1 else 0, c.stride(-2), per_split, total_stages,
        GROUP_SIZE=group_size, SLOTS=STAGES, SPLIT=splits > 1, NUM_WARPS=NUM_WARPS, MMA_REGISTERS=MMA_REGISTERS,
        LOAD_REGISTERS=LOAD_REGISTERS, DEPENDENT=dependent, num_warps=NUM_WARPS,
        **launch.dependent_launch_options(dependent),
    )  # fmt: skip
    if splits > 1:
        splitk_reduce(c, out)
    return out


def run(X, W, scale, zero, out, group_size: int, shuffled: bool = False, sizes=None):
    """out [M, N] bf16 (unit column stride) of X [M, K] and W [N, K / 2] (plain, or preshuffled) with scales and
    zeros [groups, N]; grouped, sizes [G] row counts (int32 / int64, on the device), W [G, N, K / 2] and scales and
    zeros [G, groups, N], rows past the sizes' sum zero. See the module docstring and supports()."""
    if sizes is None:
        xp, sums = relabelled_activations(X, shuffled)
        return multiply(xp, sums, W, scale, zero, out, group_size)
    chunk = item_rows(X.shape[0], W.shape[0])
    items = torch.empty((items_bound(X.shape[0], W.shape[0], chunk), 3), dtype=torch.int32, device=X.device)
    xp, sums = relabelled_activations(X, shuffled, sizes, items, chunk)
    return multiply(xp, sums, W, scale, zero, out, group_size, items, chunk)
