"""The stacked rowwise FP8 grouped GEMM of grouped_gemm.py on Hopper (sm_90), written in Gluon:

    out[rows of group g] = (XQ[rows of g] · WQ[g]ᵀ) · x_scale[row] · w_scale[g, col]     (bf16 out)

for K-major e4m3 operands that TMA can read (XQ [ΣM, K], WQ [G, N, K] seen as [G·N, K]). The Triton kernel's
compiler keeps the loads and the products of a program in the same warps; here, as in CUTLASS's Hopper kernels,
the program is persistent and warp-specialized: one warp loads the K steps of the program's tiles through a ring
of TMA stages, running ahead across tiles (so the next tile's first steps land during a tile's epilogue), and two
warpgroups multiply, 64 rows of the tile each, with one wgmma in flight while the next step's operands are
waited for. Tiles are walked as in the Triton kernel: the groups in order, every P-th tile of the concatenated
tile list, the sizes read on the device (CUDA graphs record the call; no host sync). Rows of a tile past its
group read the next group's rows (or TMA's zeros past XQ) and are never stored; so are columns past N.

H200, ms, direct calls, N = 2048 (4096 at G = 8), K = 7168 (5120 at G = 16), against the Triton kernel in the same
run (RESULTS.md, twenty-third session): G=8 x 2048 rows 0.698 / 0.778, G=64 x 128 0.288 / 0.304, G=16 x 512
0.154 / 0.164, G=128 x 64 0.568 / 0.618. The same kernel on bf16 (64-deep K steps) was not faster than the Triton
kernel there (G=8 x 2048: 1.353 ms with 128 x 256 tiles on 3 stages, 1.486 with 128 x 128 on 5, Triton 1.233;
G=64 x 128: 0.528 / 0.529), nor on 128 x 256 tiles with 4 stages and the tile stored from the wgmma layout (no
shared memory for the epilogue; forty-second session: G=64 x 128 547 us against the Triton kernel's 546, G=8 x 2048
1485 against 1434): 16-bit grouped GEMMs stay on the Triton kernel.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from mslk.core import arch, launch
from mslk.gemm.triton.fp8_gemm import tma_ready
from mslk.gemm.triton.gluon_tile_order import group_tiles, operand_ring, row_store_layout, tile_offsets, wgmma_layout

BLOCK_M = 128  # rows of a tile: 64 per multiplying warpgroup
NUM_WARPS = 8  # the multiplying warpgroups; the loading warp comes on top
# Per thread of the loading warp (setmaxnreg). The compiler gives the multiplying warps 240 whatever this is: with
# 32 the 12 warps asked for more than the CTA holds, and the launch hung on the H200.
LOAD_REGISTERS = 24
GROUP_M = gl.constexpr(16)  # a group's tiles go in bands of 16 rows of tiles, column by column (operands shared in L2)
# 128 x 128 tiles, 128-byte-deep K steps on 5 stages (160 KiB; the epilogue's layout change takes 32 more). 128 x 256
# tiles on 3 stages measured faster at G=16 x 512 only (0.145 against 0.154 ms) and slower at the other three shapes.
BLOCK_N = BLOCK_K = 128
STAGES = 5
# Dispatch takes this kernel from this many multiply-adds (rows · N · K) up: its launch costs more host time than the
# Triton kernel's, and `mslk bench` (eager, L2 flushed) measured G=16 x 512 rows, N=2048, K=5120 (8.6e10) at 0.232
# ms through the op against 0.154 for the kernel alone and 0.162-0.188 for the Triton kernel in earlier sessions;
# from G=64 x 128, N=2048, K=7168 (1.2e11) on the op measured faster.
MIN_MACS = 10**11
# Shared-memory layout of the [128, 128] operand tiles, made once (get_default_for costs host time on every launch).
_TILE_LAYOUT = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.float8e4nv)


@gluon.jit
def _load_partition(a_desc, b_desc, a_bufs, b_bufs, ready, empty, sizes_ptr, G, ROWS, N, K,
                    SIZES_ARE_ENDS: gl.constexpr):  # fmt: skip
    """The loading warp: the K steps of the program's tiles, in order, into the ring. Step c (counted over all the
    program's tiles) goes to stage c % STAGES once the multiplying warps have released the step before it there."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    STAGES: gl.constexpr = a_bufs.shape[0]
    steps = gl.cdiv(K, BK)
    tiles_n = gl.cdiv(N, BN)
    first = 0  # the group's first row
    first_tile = 0  # the group's first tile in the concatenated list
    next_tile = gl.program_id(0)  # the program's next tile there
    c = 0
    for g in range(G):
        size, tiles, taken = group_tiles(sizes_ptr, g, first, first_tile, next_tile, ROWS, tiles_n, BM, SIZES_ARE_ENDS)
        # Counted from 0, not as range(next_tile - first_tile, tiles, P): the loading warp's compiled loop then
        # kept next_tile and first_tile at their first values (Triton 3.6 and 3.7: other programs' tiles, a hang).
        for i in range(taken):
            off_m, off_n = tile_offsets(next_tile - first_tile + i * gl.num_programs(0), size, N, BM, BN, GROUP_M)
            for step in range(steps):
                stage = c % STAGES
                # The first turn through the ring finds the stages free: a fresh barrier counts its phase before
                # the first as complete.
                mbarrier.wait(empty.index(stage), ((c // STAGES) & 1) ^ 1)
                bar = ready.index(stage)
                mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(a_desc, [first + off_m, step * BK], bar, a_bufs.index(stage))
                tma.async_copy_global_to_shared(b_desc, [g * N + off_n, step * BK], bar, b_bufs.index(stage))
                c += 1
        first += size
        next_tile += taken * gl.num_programs(0)
        first_tile += tiles


@gluon.jit
def _mma_partition(a_bufs, b_bufs, ready, empty, out_ptr, a_scale_ptr, b_scale_ptr, sizes_ptr, G, ROWS, N, K,
                   stride_om, SIZES_ARE_ENDS: gl.constexpr, ZERO_FILL: gl.constexpr):  # fmt: skip
    """The multiplying warpgroups: each of the program's tiles, K step by K step from the ring, then its
    rowwise-scaled stores; with ZERO_FILL, zeros in the rows past the groups' sum."""
    BM: gl.constexpr = a_bufs.shape[1]
    BK: gl.constexpr = a_bufs.shape[2]
    BN: gl.constexpr = b_bufs.shape[1]
    STAGES: gl.constexpr = a_bufs.shape[0]
    mma_layout: gl.constexpr = wgmma_layout(BN, a_bufs.dtype, gl.num_warps())
    out_layout: gl.constexpr = row_store_layout(BN, gl.num_warps())  # bf16 rows, masked at the output's edges
    steps = gl.cdiv(K, BK)
    tiles_n = gl.cdiv(N, BN)
    first = 0  # the group's first row
    first_tile = 0  # the group's first tile in the concatenated list
    next_tile = gl.program_id(0)  # the program's next tile there
    c = 0
    for g in range(G):
        size, tiles, taken = group_tiles(sizes_ptr, g, first, first_tile, next_tile, ROWS, tiles_n, BM, SIZES_ARE_ENDS)
        for i in range(taken):
            off_m, off_n = tile_offsets(next_tile - first_tile + i * gl.num_programs(0), size, N, BM, BN, GROUP_M)
            acc = gl.zeros([BM, BN], gl.float32, mma_layout)
            for step in range(steps):
                stage = c % STAGES
                mbarrier.wait(ready.index(stage), (c // STAGES) & 1)
                acc = warpgroup_mma(a_bufs.index(stage), b_bufs.index(stage).permute((1, 0)), acc, is_async=True)
                # The step before this one is done: its stage goes back to the loading warp.
                acc = warpgroup_mma_wait(1, deps=(acc,))
                if step > 0:
                    mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES))
                c += 1
            acc = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES))
            rows = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, mma_layout))  # of the group
            cols = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, mma_layout))
            # Rows and columns past the group read scales in range (their results are not stored).
            acc *= gl.load(a_scale_ptr + first + gl.minimum(rows, size - 1))[:, None]
            acc *= gl.load(b_scale_ptr + g * N + gl.minimum(cols, N - 1))[None, :]
            out = gl.convert_layout(acc.to(out_ptr.dtype.element_ty), out_layout)
            rows = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, out_layout))
            cols = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, out_layout))
            mask = (rows < size)[:, None] & (cols < N)[None, :]
            gl.store(out_ptr + (first + rows).to(gl.int64)[:, None] * stride_om + cols[None, :], out, mask=mask)
        first += size
        next_tile += taken * gl.num_programs(0)
        first_tile += tiles
    if ZERO_FILL:  # the rows past the groups' sum, as one more group of the tile list
        tail = ROWS - first
        zeros = gl.zeros([BM, BN], out_ptr.dtype.element_ty, out_layout)
        for tile in range(next_tile - first_tile, gl.cdiv(tail, BM) * tiles_n, gl.num_programs(0)):
            rows = tile // tiles_n * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, out_layout))
            cols = tile % tiles_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, out_layout))
            mask = (rows < tail)[:, None] & (cols < N)[None, :]
            gl.store(out_ptr + (first + rows).to(gl.int64)[:, None] * stride_om + cols[None, :], zeros, mask=mask)


@gluon.jit
def _grouped_wgmma_kernel(
    a_desc, b_desc, out_ptr, a_scale_ptr, b_scale_ptr, sizes_ptr, G, ROWS, N, K, stride_om,
    SIZES_ARE_ENDS: gl.constexpr, ZERO_FILL: gl.constexpr, STAGES: gl.constexpr, LOAD_REGISTERS: gl.constexpr,
):  # fmt: skip
    """out [ROWS, N] (unit column stride, row stride stride_om) of the stacked groups of A [ROWS, K] and B [G·N, K]
    (TMA descriptors of [BM, BK] and [BN, BK] tiles), sizes [G] row counts (or cumulative ends), times a_scale
    [ROWS] and b_scale [G·N] (fp32). Persistent: program p takes tiles p, p + programs, ..."""
    a_bufs, b_bufs, ready, empty = operand_ring(a_desc, b_desc, STAGES)
    gl.warp_specialize(
        [
            (_mma_partition, (
                a_bufs, b_bufs, ready, empty, out_ptr, a_scale_ptr, b_scale_ptr, sizes_ptr, G, ROWS, N, K, stride_om,
                SIZES_ARE_ENDS, ZERO_FILL,
            )),
            (_load_partition, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, sizes_ptr, G, ROWS, N, K, SIZES_ARE_ENDS)),
        ],
        [1],
        [LOAD_REGISTERS],
    )  # fmt: skip


def supports(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the kernel serves a [R, K] and b [G, N, K] into out [R, N]: an sm_90 GPU, FP8 e4m3 operands that
    TMA can read as [R, K] and [G·N, K] (K-contiguous, 16-byte aligned rows, b's groups back to back), out with
    unit column stride."""
    return (
        arch.on_hopper(a)
        and a.dtype == b.dtype == torch.float8_e4m3fn
        and b.dim() == 3
        and b.stride(0) == b.shape[1] * b.stride(1)
        and out.dim() == 2
        and out.stride(1) == 1
        and tma_ready(a)
        and tma_ready(b.view(-1, b.shape[2]))
    )


def run(a, b, out, sizes, a_scale, b_scale, *, ends=False, zero_fill=True, programs=None):
    """out [R, N] of a [R, K] and b [G, N, K] with a_scale [R] and b_scale [G, N] contiguous fp32 (see
    _grouped_wgmma_kernel and supports()); `programs` caps the persistent programs (default: one per SM)."""
    (rows, k), (groups, n, _) = a.shape, b.shape
    a_desc = TensorDescriptor(a, [rows, k], [a.stride(0), 1], [BLOCK_M, BLOCK_K], _TILE_LAYOUT)
    b_desc = TensorDescriptor(b, [groups * n, k], [b.stride(1), 1], [BLOCK_N, BLOCK_K], _TILE_LAYOUT)
    tiles = (launch.cdiv(rows, BLOCK_M) + groups + 1) * launch.cdiv(n, BLOCK_N)  # at most, the tail included
    grid = (max(1, min(programs or arch.sm_count(a.device), tiles)),)
    launch.fast(_grouped_wgmma_kernel)[grid](
        a_desc, b_desc, out, a_scale, b_scale, sizes, groups, rows, n, k, out.stride(0), SIZES_ARE_ENDS=ends,
        ZERO_FILL=zero_fill, STAGES=STAGES, LOAD_REGISTERS=LOAD_REGISTERS, num_warps=NUM_WARPS,
    )  # fmt: skip
    return out
