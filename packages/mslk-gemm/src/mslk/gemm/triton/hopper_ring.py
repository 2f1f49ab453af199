"""What the persistent, warp-specialized Gluon GEMMs for Hopper share (fp8_blockwise_hopper.py, int4_hopper.py):
their tile order and their loading warp, which feeds the multiplying warpgroups A and B tiles through a ring of TMA
stages."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma


@gluon.jit
def tile_offsets(tile, M, N, BM: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr):
    """(off_m, off_n) of output tile `tile` in the tile order of fp8_gemm.tile_coordinates (a Triton function,
    which Gluon kernels cannot call)."""
    tiles_n = gl.cdiv(N, BN)
    first_m = (tile // (GROUP_M * tiles_n)) * GROUP_M
    group_rows = min(gl.cdiv(M, BM) - first_m, GROUP_M)
    return (first_m + tile % group_rows) * BM, ((tile % (GROUP_M * tiles_n)) // group_rows) * BN


@gluon.jit
def load_partition(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, GROUP_M: gl.constexpr):
    """The loading warp: the K steps of the program's tiles (programs take tiles p, p + programs, ...), in order,
    into the ring. A step covers BK = a's tile width of K; b's tile is as wide as that step of b's rows (BK / 2
    for two int4 values a byte). Step g (counted over all the program's tiles) goes to stage g % STAGES once the
    multiplying warps have released the step before it there."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    B_WIDTH: gl.constexpr = b_desc.block_type.shape[1]
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
            tma.async_copy_global_to_shared(b_desc, [off_n, step * B_WIDTH], bar, b_bufs.index(stage))
            g += 1
