"""Pieces of the Gluon GEMMs for Hopper (fp8_blockwise_hopper.py, grouped_gemm_hopper.py, int4_hopper.py,
int4_decode_hopper.py): the output tile order of the persistent ones and the barriers of a TMA ring."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier


@gluon.jit
def tile_offsets(tile, M, N, BM: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr):
    """(off_m, off_n) of output tile `tile` in the tile order of fp8_gemm.tile_coordinates (a Triton function,
    which Gluon kernels cannot call): groups of GROUP_M rows of tiles, column by column, so that neighbouring
    programs share operands in L2."""
    tiles_n = gl.cdiv(N, BN)
    first_m = (tile // (GROUP_M * tiles_n)) * GROUP_M
    group_rows = min(gl.cdiv(M, BM) - first_m, GROUP_M)
    return (first_m + tile % group_rows) * BM, ((tile % (GROUP_M * tiles_n)) // group_rows) * BN


@gluon.jit
def ring_barriers(STAGES: gl.constexpr):
    """(ready, empty): an mbarrier per stage of a ring for each, initialized (count 1): `ready` completes when a
    stage's TMA loads have landed, `empty` when its reader has released it."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    return ready, empty
