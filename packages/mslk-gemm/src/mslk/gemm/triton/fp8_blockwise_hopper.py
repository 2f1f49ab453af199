"""The block-scaled FP8 GEMM of fp8_blockwise_gemm.py on Hopper (sm_90), written in Gluon.

    out[m, n] = Σ_kb (XQ[m, kb] · WQ[n, kb]ᵀ) · x_scale(tile, kb) · w_scale(tile, kb)      (bf16 out, fp32 sums)

for scale blocks that cover whole 128 x 128 output tiles (one scalar per tile and K block), K-major operands that
TMA can read. Each K step's product has to be scaled before it joins the accumulator; while a warpgroup scales
one, the tensor cores must be busy with another. The kernel is persistent and warp-specialized: one warp issues
the TMA loads into a ring of stages, and two consumer warpgroups, 64 rows of the tile each, run independently of
each other (each frees a stage on its own), so one's scaling overlaps the other's wgmmas. Inside a warpgroup, K
steps go in pairs: both steps' wgmmas start, each into a fresh product, and the first product is scaled and added
while the second runs (no wgmma stays in flight across the loop's back edge: copying an in-flight product's
registers there makes ptxas serialize every wgmma, C7514).
"""

# No `from __future__ import annotations`: _Shared's field annotations must be types, not strings.
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.language.core import _aggregate as aggregate

from mslk.core import arch, launch
from mslk.gemm.triton.fp8_gemm import tma_ready

BLOCK_M = BLOCK_N = BLOCK_K = 128
STAGES = 4  # (128 + 128) · 128 B each: 128 KiB of shared memory
GROUP_M = 8  # tiles go in groups of 8 rows of tiles, so that neighbouring programs share B in L2
CONSUMER_ROWS = gl.constexpr(64)  # rows of the tile per consumer warpgroup
# Registers: 12 warps (the loader's warp rounds up to a warpgroup) at 168 each fill the SM's 64 Ki; the loader
# gives most of its share to the consumers.
MAX_REGISTERS = 168
CONSUMER_REGISTERS, LOADER_REGISTERS = gl.constexpr(232), gl.constexpr(40)
# Dispatch takes this kernel from this K up. On the H200 its GPU time beats the Triton kernel's at every shape
# measured, but its launch costs more host time (an eager call of the earlier, non-persistent version at
# 2048 x 7168 x 2048 took 0.132 ms against 0.091).
MIN_K = 4096


@aggregate
class _Shared:
    """What every partition sees: operands, the ring of stages and its barriers, the output and the scales."""

    a_desc: tma.tensor_descriptor
    b_desc: tma.tensor_descriptor
    a_bufs: gl.shared_memory_descriptor
    b_bufs: gl.shared_memory_descriptor
    ready: gl.shared_memory_descriptor  # per stage: its TMA loads landed
    empty: gl.shared_memory_descriptor  # per stage: both consumers are past the wgmmas that read it
    c_ptr: gl.tensor
    a_scale_ptr: gl.tensor
    b_scale_ptr: gl.tensor
    M: gl.tensor
    N: gl.tensor
    K: gl.tensor
    stride_cm: gl.tensor
    stride_sa_rows: gl.tensor
    stride_sa_k: gl.tensor
    stride_sb_rows: gl.tensor
    stride_sb_k: gl.tensor
    A_SCALE_ROWS: gl.constexpr
    B_SCALE_ROWS: gl.constexpr
    STEPS_PER_SCALE: gl.constexpr
    GROUP_M: gl.constexpr

    @gluon.constexpr_function  # an explicit constructor: Triton 3.6 makes none
    def __init__(self, a_desc, b_desc, a_bufs, b_bufs, ready, empty, c_ptr, a_scale_ptr, b_scale_ptr, M, N, K,
                 stride_cm, stride_sa_rows, stride_sa_k, stride_sb_rows, stride_sb_k, A_SCALE_ROWS, B_SCALE_ROWS,
                 STEPS_PER_SCALE, GROUP_M):  # fmt: skip
        self.a_desc, self.b_desc, self.a_bufs, self.b_bufs = a_desc, b_desc, a_bufs, b_bufs
        self.ready, self.empty = ready, empty
        self.c_ptr, self.a_scale_ptr, self.b_scale_ptr = c_ptr, a_scale_ptr, b_scale_ptr
        self.M, self.N, self.K, self.stride_cm = M, N, K, stride_cm
        self.stride_sa_rows, self.stride_sa_k = stride_sa_rows, stride_sa_k
        self.stride_sb_rows, self.stride_sb_k = stride_sb_rows, stride_sb_k
        self.A_SCALE_ROWS, self.B_SCALE_ROWS = gl.constexpr(A_SCALE_ROWS), gl.constexpr(B_SCALE_ROWS)
        self.STEPS_PER_SCALE, self.GROUP_M = gl.constexpr(STEPS_PER_SCALE), gl.constexpr(GROUP_M)


@gluon.jit
def _tile(p, tile):
    """Row and column offsets of output tile `tile`, in fp8_gemm.tile_coordinates' order (groups of GROUP_M rows
    of tiles; a Triton function, which Gluon kernels cannot call)."""
    BM: gl.constexpr = p.a_desc.block_type.shape[0]
    BN: gl.constexpr = p.b_desc.block_type.shape[0]
    tiles_m = gl.cdiv(p.M, BM)
    tiles_n = gl.cdiv(p.N, BN)
    first_m = (tile // (p.GROUP_M * tiles_n)) * p.GROUP_M
    group_rows = min(tiles_m - first_m, p.GROUP_M)
    return (first_m + tile % group_rows) * BM, ((tile % (p.GROUP_M * tiles_n)) // group_rows) * BN


@gluon.jit
def _tiles(p):
    BM: gl.constexpr = p.a_desc.block_type.shape[0]
    BN: gl.constexpr = p.b_desc.block_type.shape[0]
    return gl.cdiv(p.M, BM) * gl.cdiv(p.N, BN)


@gluon.jit
def _loader(p, consumer: gl.constexpr):
    """One warp: the A and B tiles of every K step of the program's tiles, into the stages in turn, each once
    both consumers have freed it. (`consumer` is unused: partitions share one signature.)"""
    BK: gl.constexpr = p.a_desc.block_type.shape[1]
    STAGES: gl.constexpr = p.a_bufs.shape[0]
    steps = gl.cdiv(p.K, BK)
    it = 0
    for tile in range(gl.program_id(0), _tiles(p), gl.num_programs(0)):
        off_m, off_n = _tile(p, tile)
        for step in range(steps):
            stage = it % STAGES
            mbarrier.wait(p.empty.index(stage), ((it // STAGES) & 1) ^ 1)  # fresh barriers pass phase 1
            bar = p.ready.index(stage)
            mbarrier.expect(bar, p.a_desc.block_type.nbytes + p.b_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(p.a_desc, [off_m, step * BK], bar, p.a_bufs.index(stage))
            tma.async_copy_global_to_shared(p.b_desc, [off_n, step * BK], bar, p.b_bufs.index(stage))
            it += 1


@gluon.jit
def _start(p, it, part, consumer: gl.constexpr):
    """Once its loads have landed, start the product of ring position `it` (rows of `consumer`) into part."""
    STAGES: gl.constexpr = p.a_bufs.shape[0]
    stage = it % STAGES
    mbarrier.wait(p.ready.index(stage), (it // STAGES) & 1)
    a = p.a_bufs.index(stage).slice(consumer * CONSUMER_ROWS, CONSUMER_ROWS)
    return warpgroup_mma(a, p.b_bufs.index(stage).permute((1, 0)), part, use_acc=False, is_async=True)


@gluon.jit
def _finish(p, it, started, IN_FLIGHT: gl.constexpr):
    """The product of ring position `it`, waited for with IN_FLIGHT later ones left running; its stage is freed."""
    STAGES: gl.constexpr = p.a_bufs.shape[0]
    done = warpgroup_mma_wait(IN_FLIGHT, deps=(started,))
    mbarrier.arrive(p.empty.index(it % STAGES), count=1)
    return done


@gluon.jit
def _step_scale(p, a_scales, b_scales, step):
    kb = step // p.STEPS_PER_SCALE
    return gl.load(a_scales + kb * p.stride_sa_k) * gl.load(b_scales + kb * p.stride_sb_k)


@gluon.jit
def _consumer(p, consumer: gl.constexpr):
    """One warpgroup: rows [consumer · 64, consumer · 64 + 64) of each of the program's tiles."""
    BK: gl.constexpr = p.a_desc.block_type.shape[1]
    BN: gl.constexpr = p.b_desc.block_type.shape[0]
    # wgmma: the 4 warps stacked along M (16 rows each), an instruction spans the tile's N, k = 32 bytes of FP8.
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 256 // p.a_desc.dtype.primitive_bitwidth]
    )
    steps = gl.cdiv(p.K, BK)
    it = 0
    part0 = gl.zeros([CONSUMER_ROWS, BN], gl.float32, mma_layout)
    part1 = gl.zeros([CONSUMER_ROWS, BN], gl.float32, mma_layout)
    for tile in range(gl.program_id(0), _tiles(p), gl.num_programs(0)):
        off_m, off_n = _tile(p, tile)
        a_scales = p.a_scale_ptr + (off_m // p.A_SCALE_ROWS) * p.stride_sa_rows
        b_scales = p.b_scale_ptr + (off_n // p.B_SCALE_ROWS) * p.stride_sb_rows
        acc = gl.zeros([CONSUMER_ROWS, BN], gl.float32, mma_layout)
        for pair in range(steps // 2):
            step = 2 * pair
            scale0 = _step_scale(p, a_scales, b_scales, step)
            scale1 = _step_scale(p, a_scales, b_scales, step + 1)
            started0 = _start(p, it, part0, consumer)
            started1 = _start(p, it + 1, part1, consumer)
            part0 = _finish(p, it, started0, 1)
            acc += part0 * scale0
            part1 = _finish(p, it + 1, started1, 0)
            acc += part1 * scale1
            it += 2
        if steps % 2 == 1:
            scale0 = _step_scale(p, a_scales, b_scales, steps - 1)
            part0 = _finish(p, it, _start(p, it, part0, consumer), 0)
            acc += part0 * scale0
            it += 1
        # Straight from the wgmma layout (pairs of columns per thread), masked at the edges of C.
        rows = off_m + consumer * CONSUMER_ROWS + gl.arange(0, CONSUMER_ROWS, layout=gl.SliceLayout(1, mma_layout))
        cols = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, mma_layout))
        mask = (rows < p.M)[:, None] & (cols < p.N)[None, :]
        gl.store(p.c_ptr + rows.to(gl.int64)[:, None] * p.stride_cm + cols[None, :], acc.to(gl.bfloat16), mask=mask)


# _Shared's scalar fields must be tensors: no argument may become a constant (Triton makes ints equal to 1 ones).
@gluon.jit(do_not_specialize=["M", "N", "K", "stride_cm", "stride_sa_rows", "stride_sa_k", "stride_sb_rows", "stride_sb_k"])
def _blockwise_wgmma_kernel(
    a_desc, b_desc, c_ptr, a_scale_ptr, b_scale_ptr, M, N, K, stride_cm,
    stride_sa_rows, stride_sa_k, stride_sb_rows, stride_sb_k,
    A_SCALE_ROWS: gl.constexpr, B_SCALE_ROWS: gl.constexpr, STEPS_PER_SCALE: gl.constexpr, STAGES: gl.constexpr,
    GROUP_M: gl.constexpr,
):  # fmt: skip
    """C [M, N] (bf16, row stride stride_cm) of A [M, K] and B [N, K] (TMA descriptors of [BM, BK] and [BN, BK]
    tiles) with scales a_scale[m // A_SCALE_ROWS, kb] and b_scale[n // B_SCALE_ROWS, kb] (A_SCALE_ROWS a multiple
    of BM, B_SCALE_ROWS of BN), kb = step // STEPS_PER_SCALE. Programs take tiles pid, pid + programs, ..."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BN, BK], b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=BM // CONSUMER_ROWS)
    p = _Shared(
        a_desc, b_desc, a_bufs, b_bufs, ready, empty, c_ptr, a_scale_ptr, b_scale_ptr, M, N, K, stride_cm,
        stride_sa_rows, stride_sa_k, stride_sb_rows, stride_sb_k, A_SCALE_ROWS, B_SCALE_ROWS, STEPS_PER_SCALE,
        GROUP_M,
    )  # fmt: skip
    gl.warp_specialize(
        [(_consumer, (p, 0)), (_consumer, (p, 1)), (_loader, (p, 0))],
        [4, 1],
        [CONSUMER_REGISTERS, LOADER_REGISTERS],
    )


def supports(a: torch.Tensor, b: torch.Tensor, a_scale_rows: int, b_scale_rows: int, scale_k: int) -> bool:
    """Whether the kernel serves these operands: an sm_90 GPU, FP8 e4m3 operands TMA can read (K-contiguous,
    16-byte aligned rows), more than 64 rows (smaller M runs the Triton kernel's 64-row tiles), scale blocks
    covering whole tiles and whole K steps."""
    return (
        a.is_cuda
        and torch.version.hip is None
        and arch.capability(a.device) == (9, 0)
        and a.dtype == b.dtype == torch.float8_e4m3fn
        and a.shape[0] > 64
        and a_scale_rows % BLOCK_M == 0
        and b_scale_rows % BLOCK_N == 0
        and scale_k % BLOCK_K == 0
        and tma_ready(a)
        and tma_ready(b)
    )


def run(a, b, out, a_scale, a_scale_strides, b_scale, b_scale_strides, a_scale_rows, b_scale_rows, scale_k):
    """out [M, N] bf16 (unit column stride) of a [M, K] and b [N, K]; see _blockwise_wgmma_kernel and supports()."""
    (m, k), n = a.shape, b.shape[0]
    layout = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.float8e4nv)
    a_desc = TensorDescriptor(a, [m, k], [a.stride(0), 1], [BLOCK_M, BLOCK_K], layout)
    b_desc = TensorDescriptor(b, [n, k], [b.stride(0), 1], [BLOCK_N, BLOCK_K], layout)
    tiles = launch.cdiv(m, BLOCK_M) * launch.cdiv(n, BLOCK_N)
    _blockwise_wgmma_kernel[(min(tiles, arch.sm_count(a.device)),)](
        a_desc, b_desc, out, a_scale, b_scale, m, n, k, out.stride(0), *a_scale_strides, *b_scale_strides,
        A_SCALE_ROWS=a_scale_rows, B_SCALE_ROWS=b_scale_rows, STEPS_PER_SCALE=scale_k // BLOCK_K, STAGES=STAGES,
        GROUP_M=GROUP_M, num_warps=4, maxnreg=MAX_REGISTERS,
    )  # fmt: skip
    return out
