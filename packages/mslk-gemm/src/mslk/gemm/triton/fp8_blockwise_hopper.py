"""The block-scaled FP8 GEMM of fp8_blockwise_gemm.py on Hopper (sm_90), written in Gluon.

    out[m, n] = Σ_kb (XQ[m, kb] · WQ[n, kb]ᵀ) · x_scale(tile, kb) · w_scale(tile, kb)      (bf16 out, fp32 sums)

for scale blocks that cover whole 128 x 128 output tiles (one scalar per tile and K block), or rows of XQ and
128 x 128 blocks of WQ (the groupwise recipe), K-major operands that TMA can read. Each K step's product has to be
scaled before it joins the accumulator, and Triton's compiler waits for every wgmma before that multiply (the
tensor cores idle meanwhile). Here, as in DeepGEMM's and CUTLASS's Hopper kernels, the program is persistent and
warp-specialized: one warp loads the operands through a ring of TMA stages, running ahead across tiles, and two
warpgroups multiply, 64 rows of the tile each. Two products take turns: step j + 1's wgmma starts before step j's
product is waited for, scaled and added, and the loop goes UNROLL steps at a time, so the tensor cores wait only at
its back edge (where no wgmma may be in flight). With blockwise scales a finished tile leaves through shared memory
by a TMA store, which runs on while the next tile's products start.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from mslk.core import arch, launch
from mslk.core.gluon import partition_barrier
from mslk.gemm.triton.fp8_gemm import tma_ready
from mslk.gemm.triton.gluon_tile_order import operand_ring, row_store_layout, tile_offsets, wgmma_layout

BLOCK_M = BLOCK_N = BLOCK_K = 128
# Shared-memory layout of the A and B tiles, made once (a call to get_default_for costs host time on every launch).
_TILE_LAYOUT = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.float8e4nv)
_OUT_LAYOUT = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], gl.bfloat16)
NUM_WARPS = 8  # the multiplying warpgroups, 64 rows of the tile each; the loading warp comes on top
LOAD_REGISTERS = 24  # per thread of the loading warp (setmaxnreg), which leaves 240 to the multiplying ones
# H200, us, the variants in turn in one process (RESULTS.md, fifteenth session), 8192^3 / 4096 x 28672 x 8192 /
# 4096 x 7168 x 4096: one program per tile without warp specialization (eight steps a turn) 1030 / 1784 / 239;
# warp-specialized 985 / 1781 / 231; persistent and warp-specialized, 4 / 5 stages, 8 steps 955 / 945, 1690 / 1636,
# 215 / 218; 16 steps 916 / 930, 1676 / 1601, 213 / 207.
STAGES = 5  # (128 + 128) · 128 B each: 160 KiB of shared memory, and 32 KiB for the output tile's TMA store
UNROLL = 16  # K steps per loop iteration (even: the two products alternate)
GROUP_M = 16  # tiles go in groups of 16 rows of tiles, so that neighbouring programs share B in L2
# Dispatch takes this kernel from this K up. On the H200 its GPU time beat the Triton kernel's at every shape
# measured already in its first form (fifth session: 989 against 875 TFLOP/s at 8192^3, 957 / 804 at 4096 x 7168 x
# 4096, 872 / 742 at 2048 x 7168 x 2048), but its launch costs more host time, and an eager call at 2048 x 7168 x 2048
# took 0.132 ms against 0.091.
MIN_K = 4096


@gluon.jit
def _load_partition(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, GROUP_M: gl.constexpr):
    """The loading warp: the program's tiles' K steps, in order, into the ring. Step g (counted over all the
    program's tiles) goes to stage g % STAGES once the multiplying warps have released the step before it there."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    STAGES: gl.constexpr = a_bufs.shape[0]
    steps = gl.cdiv(K, BK)
    g = 0
    for tile in range(gl.program_id(0), gl.cdiv(M, BM) * gl.cdiv(N, BN), gl.num_programs(0)):
        off_m, off_n = tile_offsets(tile, M, N, BM, BN, GROUP_M)
        for step in range(steps):
            stage = g % STAGES
            # The first turn through the ring finds the stages free: a fresh barrier counts its phase before
            # the first as complete.
            mbarrier.wait(empty.index(stage), ((g // STAGES) & 1) ^ 1)
            bar = ready.index(stage)
            mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [off_m, step * BK], bar, a_bufs.index(stage))
            tma.async_copy_global_to_shared(b_desc, [off_n, step * BK], bar, b_bufs.index(stage))
            g += 1


@gluon.jit
def _issue_step(a_bufs, b_bufs, ready, g, part):
    """Once its TMA loads have landed, start step g's product into part's registers (asynchronous)."""
    STAGES: gl.constexpr = a_bufs.shape[0]
    stage = g % STAGES
    mbarrier.wait(ready.index(stage), (g // STAGES) & 1)
    return warpgroup_mma(a_bufs.index(stage), b_bufs.index(stage).permute((1, 0)), part, use_acc=False, is_async=True)


@gluon.jit
def _step_scale(a_scales, b_scales, step, stride_sa_k, stride_sb_k, STEPS_PER_SCALE: gl.constexpr):
    kb = step // STEPS_PER_SCALE
    return gl.load(a_scales + kb * stride_sa_k) * gl.load(b_scales + kb * stride_sb_k)


@gluon.jit
def _next_step(a_bufs, b_bufs, ready, empty, g, acc, current, following, scale, LAST: gl.constexpr):
    """Step g, whose product `current` is in flight: start step g + 1's into `following` unless LAST, then wait
    for `current`, release its stage to the loading warp, scale it and add it. Returns (acc, current, following)."""
    STAGES: gl.constexpr = a_bufs.shape[0]
    if not LAST:
        following = _issue_step(a_bufs, b_bufs, ready, g + 1, following)
    current = warpgroup_mma_wait(0 if LAST else 1, deps=(current,))
    mbarrier.arrive(empty.index(g % STAGES))
    acc += current * scale
    if not LAST:
        # A wait that returns at once, on acc: it keeps the multiply-adds ahead of the next step's wgmma. Left
        # free, the compiler sinks them below it, and that wgmma has to write a copy of the product they still read
        # (the registers spill from 4 steps a turn on).
        acc = warpgroup_mma_wait(1, deps=(acc,))
    return acc, current, following


@gluon.jit
def _mma_partition(
    a_bufs, b_bufs, ready, empty, c_ptr, c_desc, c_smem, a_scale_ptr, b_scale_ptr, M, N, K, stride_cm,
    stride_sa_rows, stride_sa_k, stride_sb_rows, stride_sb_k,
    A_SCALE_ROWS: gl.constexpr, B_SCALE_ROWS: gl.constexpr, STEPS_PER_SCALE: gl.constexpr, GROUP_M: gl.constexpr,
    UNROLL: gl.constexpr, TMA_STORE: gl.constexpr,
):  # fmt: skip
    """The multiplying warpgroups: each of the program's tiles, K step by K step from the ring, then its bf16
    store: TMA_STORE, through c_smem by c_desc, the copy running on under the next tile's products; else from
    registers to c_ptr."""
    BM: gl.constexpr = a_bufs.shape[1]
    BK: gl.constexpr = a_bufs.shape[2]
    BN: gl.constexpr = b_bufs.shape[1]
    mma_layout: gl.constexpr = wgmma_layout(BN, a_bufs.dtype, gl.num_warps())
    out_layout: gl.constexpr = row_store_layout(BN, gl.num_warps())  # bf16 rows, masked at the output's edges
    steps = gl.cdiv(K, BK)
    # No wgmma is in flight across a loop's back edge: copying an in-flight product's registers there (a product
    # carried from one iteration to the next) makes ptxas serialize every wgmma (C7514). Each product is restarted
    # in its own registers once added (use_acc=False ignores their values).
    part0 = gl.zeros([BM, BN], gl.float32, mma_layout)
    part1 = gl.zeros([BM, BN], gl.float32, mma_layout)
    g0 = 0  # the ring's step count at the tile's first step
    for tile in range(gl.program_id(0), gl.cdiv(M, BM) * gl.cdiv(N, BN), gl.num_programs(0)):
        off_m, off_n = tile_offsets(tile, M, N, BM, BN, GROUP_M)
        if A_SCALE_ROWS == 1:  # a scale per row: [BM, 1], rows past M read row M - 1's (their sums are not stored)
            scale_rows = gl.minimum(off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, mma_layout)), M - 1)
            a_scales = (a_scale_ptr + scale_rows * stride_sa_rows)[:, None]
        else:
            a_scales = a_scale_ptr + (off_m // A_SCALE_ROWS) * stride_sa_rows
        b_scales = b_scale_ptr + (off_n // B_SCALE_ROWS) * stride_sb_rows
        acc = gl.zeros([BM, BN], gl.float32, mma_layout)
        for first in range(0, steps - steps % UNROLL, UNROLL):
            part0 = _issue_step(a_bufs, b_bufs, ready, g0 + first, part0)
            for j in gl.static_range(UNROLL):
                scale = _step_scale(a_scales, b_scales, first + j, stride_sa_k, stride_sb_k, STEPS_PER_SCALE)
                if j % 2 == 0:
                    acc, part0, part1 = _next_step(a_bufs, b_bufs, ready, empty, g0 + first + j, acc, part0, part1,
                                                   scale, j + 1 == UNROLL)  # fmt: skip
                else:
                    acc, part1, part0 = _next_step(a_bufs, b_bufs, ready, empty, g0 + first + j, acc, part1, part0,
                                                   scale, j + 1 == UNROLL)  # fmt: skip
        for step in range(steps - steps % UNROLL, steps):
            scale = _step_scale(a_scales, b_scales, step, stride_sa_k, stride_sb_k, STEPS_PER_SCALE)
            part0 = _issue_step(a_bufs, b_bufs, ready, g0 + step, part0)
            acc, part0, part1 = _next_step(a_bufs, b_bufs, ready, empty, g0 + step, acc, part0, part1, scale, True)
        g0 += steps
        if TMA_STORE:
            tma.store_wait(0)  # the last tile's copy has read c_smem
            partition_barrier()
            c_smem.store(acc.to(gl.bfloat16))
            fence_async_shared()
            partition_barrier()
            tma.async_copy_shared_to_global(c_desc, [off_m, off_n], c_smem)  # (not past M and N: TMA clips)
        else:
            out = gl.convert_layout(acc.to(gl.bfloat16), out_layout)
            rows = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, out_layout))
            cols = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, out_layout))
            mask = (rows < M)[:, None] & (cols < N)[None, :]
            gl.store(c_ptr + rows.to(gl.int64)[:, None] * stride_cm + cols[None, :], out, mask=mask)
    if TMA_STORE:
        tma.store_wait(0)  # before the kernel ends: the copy reads shared memory


@gluon.jit
def _blockwise_wgmma_kernel(
    a_desc, b_desc, c_ptr, c_desc, a_scale_ptr, b_scale_ptr, M, N, K, stride_cm,
    stride_sa_rows, stride_sa_k, stride_sb_rows, stride_sb_k,
    A_SCALE_ROWS: gl.constexpr, B_SCALE_ROWS: gl.constexpr, STEPS_PER_SCALE: gl.constexpr, STAGES: gl.constexpr,
    GROUP_M: gl.constexpr, UNROLL: gl.constexpr, LOAD_REGISTERS: gl.constexpr, TMA_STORE: gl.constexpr,
):  # fmt: skip
    """C [M, N] (bf16, row stride stride_cm; with TMA_STORE also c_desc, its [BM, BN] tiles) of A [M, K] and B
    [N, K] (TMA descriptors of [BM, BK] and [BN, BK] tiles) with scales a_scale[m // A_SCALE_ROWS, kb] and
    b_scale[n // B_SCALE_ROWS, kb] (A_SCALE_ROWS 1 or a multiple of BM, B_SCALE_ROWS a multiple of BN),
    kb = step // STEPS_PER_SCALE. Persistent: program p takes tiles p, p + programs, ..."""
    a_bufs, b_bufs, ready, empty = operand_ring(a_desc, b_desc, STAGES)
    if TMA_STORE:
        c_smem = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
    else:  # warp_specialize's partitions take no None: A's descriptor and ring stand in (never used)
        c_desc, c_smem = a_desc, a_bufs
    # The partitions' argument tuples are written in the call: a tuple assigned to a name first turns its
    # constexprs into tensors.
    gl.warp_specialize(
        [
            (_mma_partition, (
                a_bufs, b_bufs, ready, empty, c_ptr, c_desc, c_smem, a_scale_ptr, b_scale_ptr, M, N, K, stride_cm,
                stride_sa_rows, stride_sa_k, stride_sb_rows, stride_sb_k, A_SCALE_ROWS, B_SCALE_ROWS, STEPS_PER_SCALE,
                GROUP_M, UNROLL, TMA_STORE,
            )),
            (_load_partition, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, GROUP_M)),
        ],
        [1],
        [LOAD_REGISTERS],
    )  # fmt: skip


def supports(a: torch.Tensor, b: torch.Tensor, a_scale_rows: int, b_scale_rows: int, scale_k: int) -> bool:
    """Whether the kernel serves these operands: an sm_90 GPU, FP8 e4m3 operands TMA can read (K-contiguous,
    16-byte aligned rows), more than 64 rows (smaller M runs the Triton kernel's 64-row tiles), scale blocks
    covering whole K steps and whole tiles (or single rows of a)."""
    return (
        arch.on_hopper(a)
        and a.dtype == b.dtype == torch.float8_e4m3fn
        and a.shape[0] > 64
        and (a_scale_rows == 1 or a_scale_rows % BLOCK_M == 0)
        and b_scale_rows % BLOCK_N == 0
        and scale_k % BLOCK_K == 0
        and tma_ready(a)
        and tma_ready(b)
    )


def run(a, b, out, a_scale, a_scale_strides, b_scale, b_scale_strides, a_scale_rows, b_scale_rows, scale_k):
    """out [M, N] bf16 (unit column stride) of a [M, K] and b [N, K]; see _blockwise_wgmma_kernel and supports()."""
    (m, k), n = a.shape, b.shape[0]
    a_desc = TensorDescriptor(a, [m, k], [a.stride(0), 1], [BLOCK_M, BLOCK_K], _TILE_LAYOUT)
    b_desc = TensorDescriptor(b, [n, k], [b.stride(0), 1], [BLOCK_N, BLOCK_K], _TILE_LAYOUT)
    # Blockwise scales store tiles by TMA (H200, eager, session 38: 1.1-2.0% faster at all five shapes measured,
    # 8192^3 1198 -> 1211 TFLOP/s); a scale per row of a keeps the stores from registers (TMA stores were 1.2-2.3%
    # slower at four of the five).
    tma_store = a_scale_rows != 1 and tma_ready(out)
    c_desc = TensorDescriptor(out, [m, n], [out.stride(0), 1], [BLOCK_M, BLOCK_N], _OUT_LAYOUT) if tma_store else None
    grid = (min(arch.sm_count(a.device), launch.cdiv(m, BLOCK_M) * launch.cdiv(n, BLOCK_N)),)
    launch.fast(_blockwise_wgmma_kernel)[grid](
        a_desc, b_desc, out, c_desc, a_scale, b_scale, m, n, k, out.stride(0), *a_scale_strides, *b_scale_strides,
        A_SCALE_ROWS=a_scale_rows, B_SCALE_ROWS=b_scale_rows, STEPS_PER_SCALE=scale_k // BLOCK_K, STAGES=STAGES,
        GROUP_M=GROUP_M, UNROLL=UNROLL, LOAD_REGISTERS=LOAD_REGISTERS, TMA_STORE=tma_store, num_warps=NUM_WARPS,
    )  # fmt: skip
    return out
