"""bf16i4bf16_rowwise's GEMM (int4_gemm.py: plain int4 layout, group scales and zeros) for prefill shapes on Hopper
(sm_90), written in Gluon, and its grouped form (bf16i4bf16_rowwise_grouped, rows stacked by group):

    out[m, n] = Σ_k X[m, k] · (q[n, k] · scale[k // gs, n] + zero[k // gs, n])      (bf16 out, fp32 sums)

The product is computed transposed, weights first, since wgmma takes its first operand from registers, where the
weights are dequantized. Triton's kernel (int4_gemm._int4_k_loop) has to end each K step waiting for its wgmmas
(Triton lets the next step's dequantization rewrite the registers they read), so the tensor cores idle while each
step's weights are dequantized, and its compiler moves the dequantized weights through shared memory to reach
the operand's register layout. Here each thread reads its nibble pairs from shared memory straight into that
layout (8 bytes of a weight row at a stride of 4), and step j + 1's weights are dequantized into a second register
tile while step j's wgmma runs; step j + 1's wgmma is issued before the wait that retires step j's, whose `deps`
name the tile that one reads (_mma_partition says why this order). As in fp8_blockwise_hopper.py, the program is
persistent and warp-specialized: one warp loads X and W tiles through rings of TMA stages, two warpgroups
multiply, 64 weight rows of the tile each.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from mslk.core import arch, launch
from mslk.core.gluon import ring_barriers
from mslk.gemm.triton.fp8_gemm import tma_ready
from mslk.gemm.triton.gluon_tile_order import group_tiles, tile_offsets
from mslk.gemm.triton.int4_ptx import DEQUANT_BYTES_PTX

BLOCK_N = 128  # weight rows of a tile (wgmma's M): 64 per multiplying warpgroup
BLOCK_M = 256  # activation rows of a tile (wgmma's N)
BLOCK_K = 64  # k per step: 32 bytes of each weight row; group sizes must be multiples of it
NUM_WARPS = 8  # the multiplying warpgroups; the loading warp comes on top
LOAD_REGISTERS = 24  # per thread of the loading warp (setmaxnreg)
X_STAGES = 4  # 256 · 64 · 2 B each
W_SLOTS = 4  # a pair of K steps each: 128 · 64 B
GROUP_M = 8  # tiles go in groups of 8 rows of tiles, so that neighbouring programs share weights in L2
# Dispatch takes this kernel from this M up, where the Triton kernel's tiles grow to 256 rows too. H200, N = K = 8192,
# CUDA graphs, us, this kernel / the Triton kernel (RESULTS.md, seventeenth session): M = 128 88.9 / 51.5, 256 91.4 /
# 80.9, 300 119.1 / 124.3, 512 107.8 / 139.7, 1024 222.0 / 265.5; eager (L2 flushed), M = 2048 426 / 536, 8192 1760 /
# 2171.
MIN_M = 257
_X_LAYOUTS = {bm: gl.NVMMASharedLayout.get_default_for([bm, BLOCK_K], gl.bfloat16) for bm in (BLOCK_M, BLOCK_M // 2)}
_W_LAYOUT = gl.NVMMASharedLayout.get_default_for([2, BLOCK_N, BLOCK_K // 2], gl.int8)


@gluon.jit
def _bf16_pairs(v):
    """Values as bf16 in both halves of an int32 (DEQUANT_BYTES_PTX's scale and zero operands): int4_gemm._bf16x2
    for Gluon, which cannot call Triton functions."""
    bits = v.to(gl.bfloat16).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    return bits | (bits << 16)


@gluon.jit
def _group_rows(s_ptr, z_ptr, rows, N, groups, stride_sg, step, BK: gl.constexpr, GROUP_SIZE: gl.constexpr):
    """The scales and zeros of step's group for the weight rows `rows` [BN, 1], as bf16 pairs (zero past N, where
    the weights are zero-filled too, and past the last group: the loads a step ahead of the last)."""
    g = (step * BK) // GROUP_SIZE
    mask = (rows < N) & (g < groups)
    s = gl.load(s_ptr + g * stride_sg + rows, mask=mask, other=0.0)
    z = gl.load(z_ptr + g * stride_sg + rows, mask=mask, other=0.0)
    return _bf16_pairs(s), _bf16_pairs(z)


@gluon.jit
def _dequantized(w_tiles, w_ready, pair, HALF: gl.constexpr, s, z, byte_layout: gl.constexpr, a_layout: gl.constexpr):
    """The weight tile [BN, BK] of half HALF of ring pair `pair` (two K steps; w_tiles holds a pair's halves one
    after the other) as wgmma's register operand: its bytes [BN, BK / 2] read into byte_layout (each thread's nibble
    pairs of a_layout), then q · s + z. The first half waits for the pair's TMA load to land."""
    SLOTS: gl.constexpr = w_tiles.shape[0] // 2
    slot = pair % SLOTS
    if HALF == 0:
        mbarrier.wait(w_ready.index(slot), (pair // SLOTS) & 1)
    packed = w_tiles.index(2 * slot + HALF).load(byte_layout)
    pairs = gl.inline_asm_elementwise(
        DEQUANT_BYTES_PTX, "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r", [packed, s, z], dtype=gl.int32, is_pure=True, pack=4
    )
    halves = gl.join(pairs.to(gl.int16), (pairs >> 16).to(gl.int16))  # (k = 2j, k = 2j + 1) of byte j
    w = halves.reshape([packed.shape[0], 2 * packed.shape[1]]).to(gl.bfloat16, bitcast=True)
    return gl.convert_layout(w, a_layout)


@gluon.jit
def _x_tile(x_bufs, x_ready, g):
    """Ring step g's activation tile as wgmma's second operand [BK, BM], once its TMA load has landed."""
    STAGES: gl.constexpr = x_bufs.shape[0]
    mbarrier.wait(x_ready.index(g % STAGES), (g // STAGES) & 1)
    return x_bufs.index(g % STAGES).permute((1, 0))


@gluon.jit
def _load_partition(x_desc, w_desc, x_bufs, w_bufs, x_ready, x_empty, w_ready, w_empty, sizes_ptr, G, M, N, K,
                    GROUP_M: gl.constexpr):  # fmt: skip
    """The loading warp: the program's tiles in order (group_tiles' walk), each as pairs of K steps: the pair's
    weights (64 bytes of each row in one load; a step's 32 bytes a load measured 0-3.5% slower on the H200), then
    its two X tiles, each into the next slot of its ring once the multiplying warps have released the one loaded
    there before."""
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    BN: gl.constexpr = w_desc.block_type.shape[1]
    X_STAGES: gl.constexpr = x_bufs.shape[0]
    W_SLOTS: gl.constexpr = w_bufs.shape[0]
    steps = gl.cdiv(K, BK)
    tiles_n = gl.cdiv(N, BN)
    first = 0  # the group's first row
    first_tile = 0  # the group's first tile in the concatenated list
    next_tile = gl.program_id(0)  # the program's next tile there
    c = 0  # X steps loaded
    p = 0  # weight pairs loaded
    for g in range(G):
        size, tiles, taken = group_tiles(sizes_ptr, g, first, first_tile, next_tile, M, tiles_n, BM, False)
        for i in range(taken):  # (counted from 0: grouped_gemm_hopper's loading warp says why)
            off_m, off_n = tile_offsets(next_tile - first_tile + i * gl.num_programs(0), size, N, BM, BN, GROUP_M)
            for pair in range(gl.cdiv(steps, 2)):
                slot = p % W_SLOTS
                # A fresh barrier counts its phase before the first as complete: the first turn finds the slots free.
                mbarrier.wait(w_empty.index(slot), ((p // W_SLOTS) & 1) ^ 1)
                mbarrier.expect(w_ready.index(slot), w_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(
                    w_desc, [2 * pair, g * N + off_n, 0], w_ready.index(slot), w_bufs.index(slot)
                )
                p += 1
                for step in range(2 * pair, gl.minimum(2 * pair + 2, steps)):
                    stage = c % X_STAGES
                    mbarrier.wait(x_empty.index(stage), ((c // X_STAGES) & 1) ^ 1)
                    mbarrier.expect(x_ready.index(stage), x_desc.block_type.nbytes)
                    tma.async_copy_global_to_shared(
                        x_desc, [first + off_m, step * BK], x_ready.index(stage), x_bufs.index(stage)
                    )
                    c += 1
        first += size
        next_tile += taken * gl.num_programs(0)
        first_tile += tiles


@gluon.jit
def _mma_partition(
    x_bufs, w_tiles, x_ready, x_empty, w_ready, w_empty, s_ptr, z_ptr, c_ptr, sizes_ptr, G, M, N, K, groups,
    stride_sgrp, stride_sg, stride_cm, GROUP_SIZE: gl.constexpr, GROUP_M: gl.constexpr,
):  # fmt: skip
    """The multiplying warpgroups: each of the program's tiles, K step by K step from the rings, then its bf16
    store, transposed into C; grouped (sizes_ptr given), zeros in the rows past the groups' sum."""
    BM: gl.constexpr = x_bufs.shape[1]
    BK: gl.constexpr = x_bufs.shape[2]
    BN: gl.constexpr = w_tiles.shape[1]
    X_STAGES: gl.constexpr = x_bufs.shape[0]
    W_SLOTS: gl.constexpr = w_tiles.shape[0] // 2
    gl.static_assert(BN == 16 * gl.num_warps() and BK == 64, "the byte layout below is for these tiles")
    # wgmma: warps stacked along the weight rows (16 each), an instruction spans the tile's activation rows.
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[gl.num_warps(), 1], instr_shape=[16, BM, 16]
    )
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
    # The bytes [BN, BK / 2] of a_layout's pairs: lane 4r + c of warp w holds rows 16w + r and 16w + r + 8, bytes
    # c + 4i (k = 2c + 8i and 2c + 8i + 1). The registers of four bytes go to one DEQUANT_BYTES_PTX.
    byte_layout: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[8, 0], [0, 4], [0, 8], [0, 16]],
        lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0], [64, 0]],
        block_bases=[],
        shape=[BN, BK // 2],
    )
    # Epilogue: 8 consecutive weight rows per thread, 16 bytes of a row of C, masked at the edges of C.
    out_layout: gl.constexpr = gl.BlockedLayout([8, 1], [BN // 8, 256 // BN], [1, gl.num_warps()], [0, 1])
    steps = gl.cdiv(K, BK)
    tiles_n = gl.cdiv(N, BN)
    first = 0  # the group's first row
    first_tile = 0  # the group's first tile in the concatenated list
    next_tile = gl.program_id(0)  # the program's next tile there
    c0 = 0  # the X ring's step count at the tile's first step
    p0 = 0  # the weight ring's pair count at the tile's first step
    for g in range(G):
        size, tiles, taken = group_tiles(sizes_ptr, g, first, first_tile, next_tile, M, tiles_n, BM, False)
        s_group = s_ptr + g.to(gl.int64) * stride_sgrp
        z_group = z_ptr + g.to(gl.int64) * stride_sgrp
        for i in range(taken):
            off_m, off_n = tile_offsets(next_tile - first_tile + i * gl.num_programs(0), size, N, BM, BN, GROUP_M)
            rows = (off_n + gl.arange(0, BN, layout=gl.SliceLayout(1, byte_layout)))[:, None]
            # One wgmma in flight at a time, across the loop's back edge too: the next step's weights are
            # dequantized while it runs, into the other of two register tiles (a0 for even steps, a1 for odd), and
            # the wgmma that multiplies them is issued before the wait for the one in flight (ptxas serializes every
            # wgmma, C7513, or holds the dequantization back until the wait, where registers of a later wgmma are
            # written while one runs).
            s, z = _group_rows(s_group, z_group, rows, N, groups, stride_sg, 0, BK, GROUP_SIZE)
            a0 = _dequantized(w_tiles, w_ready, p0, 0, s, z, byte_layout, a_layout)
            s, z = _group_rows(s_group, z_group, rows, N, groups, stride_sg, 1, BK, GROUP_SIZE)  # a step ahead
            product = warpgroup_mma(a0, _x_tile(x_bufs, x_ready, c0), gl.zeros([BN, BM], gl.float32, mma_layout),
                                    use_acc=False, is_async=True)  # fmt: skip
            product, a0 = warpgroup_mma_wait(1, deps=(product, a0))  # returns at once (the loop carries a tensor)
            for step in range(1, steps - 1, 2):  # odd steps: the second half of pair p0 + step // 2
                a1 = _dequantized(w_tiles, w_ready, p0 + step // 2, 1, s, z, byte_layout, a_layout)
                s, z = _group_rows(s_group, z_group, rows, N, groups, stride_sg, step + 1, BK, GROUP_SIZE)
                product = warpgroup_mma(a1, _x_tile(x_bufs, x_ready, c0 + step), product, is_async=True)
                product, a0 = warpgroup_mma_wait(1, deps=(product, a0))
                mbarrier.arrive(x_empty.index((c0 + step - 1) % X_STAGES))
                a0 = _dequantized(w_tiles, w_ready, p0 + step // 2 + 1, 0, s, z, byte_layout, a_layout)
                s, z = _group_rows(s_group, z_group, rows, N, groups, stride_sg, step + 2, BK, GROUP_SIZE)
                product = warpgroup_mma(a0, _x_tile(x_bufs, x_ready, c0 + step + 1), product, is_async=True)
                product, a1 = warpgroup_mma_wait(1, deps=(product, a1))
                mbarrier.arrive(x_empty.index((c0 + step) % X_STAGES))
                mbarrier.arrive(w_empty.index((p0 + step // 2) % W_SLOTS))
            if steps % 2 == 0:  # the last step is odd
                a1 = _dequantized(w_tiles, w_ready, p0 + steps // 2 - 1, 1, s, z, byte_layout, a_layout)
                last = warpgroup_mma(a1, _x_tile(x_bufs, x_ready, c0 + steps - 1), product, is_async=True)
                acc, a0, a1 = warpgroup_mma_wait(0, deps=(last, a0, a1))
                mbarrier.arrive(x_empty.index((c0 + steps - 2) % X_STAGES))
            else:
                acc, a0 = warpgroup_mma_wait(0, deps=(product, a0))
            mbarrier.arrive(x_empty.index((c0 + steps - 1) % X_STAGES))
            mbarrier.arrive(w_empty.index((p0 + (steps - 1) // 2) % W_SLOTS))
            c0 += steps
            p0 += gl.cdiv(steps, 2)
            out = gl.convert_layout(acc.to(gl.bfloat16), out_layout)
            cols = off_n + gl.arange(0, BN, layout=gl.SliceLayout(1, out_layout))
            out_rows = off_m + gl.arange(0, BM, layout=gl.SliceLayout(0, out_layout))  # of the group
            mask = (cols < N)[:, None] & (out_rows < size)[None, :]
            gl.store(c_ptr + (first + out_rows).to(gl.int64)[None, :] * stride_cm + cols[:, None], out, mask=mask)
        first += size
        next_tile += taken * gl.num_programs(0)
        first_tile += tiles
    if sizes_ptr is not None:  # the rows past the groups' sum, as one more group of the tile list
        tail = M - first
        zeros = gl.zeros([BN, BM], c_ptr.dtype.element_ty, out_layout)
        for tile in range(next_tile - first_tile, gl.cdiv(tail, BM) * tiles_n, gl.num_programs(0)):
            cols = tile % tiles_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, out_layout))
            out_rows = tile // tiles_n * BM + gl.arange(0, BM, layout=gl.SliceLayout(0, out_layout))
            mask = (cols < N)[:, None] & (out_rows < tail)[None, :]
            gl.store(c_ptr + (first + out_rows).to(gl.int64)[None, :] * stride_cm + cols[:, None], zeros, mask=mask)


@gluon.jit
def _int4_wgmma_kernel(
    x_desc, w_desc, s_ptr, z_ptr, c_ptr, sizes_ptr, G, M, N, K, groups, stride_sgrp, stride_sg, stride_cm,
    GROUP_SIZE: gl.constexpr, X_STAGES: gl.constexpr, W_SLOTS: gl.constexpr, GROUP_M: gl.constexpr,
    LOAD_REGISTERS: gl.constexpr,
):  # fmt: skip
    """C [M, N] (bf16, row stride stride_cm) of X [M, K] bf16 and plain packed int4 W [N, K / 2] (TMA descriptors of
    X's [BM, BK] tiles and of W as [K / BK, N, BK / 2], in [2, BN, BK / 2] boxes: two K steps of a tile's rows;
    zeros past their edges) with scales and zeros [groups, N] (row stride stride_sg) of GROUP_SIZE k each.
    Grouped (sizes_ptr: G row counts, read on the device): X [M, K] stacks the groups' rows, W is [K / BK, G·N,
    BK / 2] (group g's weights from row g·N), scales and zeros [G, groups, N] (group stride stride_sgrp), and the
    rows past the sizes' sum are zero; rows of a tile past its group read the next group's (never stored), and
    weight rows past N the next group's (their scales read as zero). Persistent: program p takes tiles p,
    p + programs, ... of the groups' concatenated tile list."""
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [X_STAGES, BM, BK], x_desc.layout)
    BN: gl.constexpr = w_desc.block_type.shape[1]
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [W_SLOTS, 2, BN, BK // 2], w_desc.layout)
    # The same bytes as [2 · W_SLOTS, BN, BK / 2] tiles: the boxes' leading dim only stacks tiles of one swizzle.
    tile_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=w_desc.layout.swizzle_byte_width,
                                                     element_bitwidth=8, rank=2)  # fmt: skip
    w_tiles = w_bufs._reinterpret(w_desc.dtype, [2 * W_SLOTS, BN, BK // 2], tile_layout)
    x_ready, x_empty = ring_barriers(X_STAGES)
    w_ready, w_empty = ring_barriers(W_SLOTS)
    # The partitions' argument tuples are written in the call: a tuple assigned to a name first turns its
    # constexprs into tensors.
    gl.warp_specialize(
        [
            (_mma_partition, (
                x_bufs, w_tiles, x_ready, x_empty, w_ready, w_empty, s_ptr, z_ptr, c_ptr, sizes_ptr, G, M, N, K,
                groups, stride_sgrp, stride_sg, stride_cm, GROUP_SIZE, GROUP_M,
            )),
            (_load_partition, (x_desc, w_desc, x_bufs, w_bufs, x_ready, x_empty, w_ready, w_empty, sizes_ptr, G, M,
                               N, K, GROUP_M)),
        ],
        [1],
        [LOAD_REGISTERS],
    )  # fmt: skip


def supports(X: torch.Tensor, W: torch.Tensor, group_size: int) -> bool:
    """Whether the kernel serves X [M, K] and plain packed W [N, K / 2] (or the groups' [G, N, K / 2], one after
    another in memory): an sm_90 GPU, bf16 activations, whole K steps and groups of whole K steps, operands TMA can
    read (K-contiguous, 16-byte aligned rows)."""
    return (
        arch.on_hopper(X)
        and X.dtype == torch.bfloat16
        and group_size % BLOCK_K == 0
        and X.shape[1] % BLOCK_K == 0
        and tma_ready(X)
        and (W.dim() == 2 or W.stride(0) == W.shape[1] * W.stride(1))
        and tma_ready(W.view(-1, W.shape[-1]) if W.dim() == 3 else W)
    )


def run(X, W, scale, zero, out, group_size: int, sizes=None):
    """out [M, N] bf16 (unit column stride) of X [M, K] and W [N, K / 2] with scales and zeros [groups, N] (unit
    column stride, one dtype); grouped, sizes [G] row counts (int32 / int64, on the device), W [G, N, K / 2] and
    scales and zeros [G, groups, N]. See _int4_wgmma_kernel and supports()."""
    (m, k), n = X.shape, W.shape[-2]
    groups = 1 if sizes is None else W.shape[0]
    # Grouped, tiles of 128 activation rows where the groups average fewer than 256 rows (fewer rows past a group).
    block_m = BLOCK_M if sizes is None or m >= BLOCK_M * groups else BLOCK_M // 2
    x_desc = TensorDescriptor(X, [m, k], [X.stride(0), 1], [block_m, BLOCK_K], _X_LAYOUTS[block_m])
    row_bytes = BLOCK_K // 2  # of a weight row, a K step
    w_desc = TensorDescriptor(
        W, [k // BLOCK_K, groups * n, row_bytes], [row_bytes, W.stride(-2), 1], [2, BLOCK_N, row_bytes], _W_LAYOUT
    )
    tiles = (launch.cdiv(m, block_m) + (0 if sizes is None else groups + 1)) * launch.cdiv(n, BLOCK_N)  # at most
    grid = (max(1, min(arch.sm_count(X.device), tiles)),)
    launch.fast(_int4_wgmma_kernel)[grid](
        x_desc, w_desc, scale, zero, out, sizes, groups, m, n, k, scale.shape[-2],
        0 if sizes is None else scale.stride(0), scale.stride(-2), out.stride(0),
        GROUP_SIZE=group_size, X_STAGES=X_STAGES, W_SLOTS=W_SLOTS, GROUP_M=GROUP_M, LOAD_REGISTERS=LOAD_REGISTERS,
        num_warps=NUM_WARPS,
    )  # fmt: skip
    return out
