"""The output tile order of the persistent Gluon GEMMs for Hopper (fp8_blockwise_hopper.py, int4_hopper.py)."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def tile_offsets(tile, M, N, BM: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr):
    """(off_m, off_n) of output tile `tile` in the tile order of fp8_gemm.tile_coordinates (a Triton function,
    which Gluon kernels cannot call): groups of GROUP_M rows of tiles, column by column, so that neighbouring
    programs share operands in L2."""
    tiles_n = gl.cdiv(N, BN)
    first_m = (tile // (GROUP_M * tiles_n)) * GROUP_M
    group_rows = min(gl.cdiv(M, BM) - first_m, GROUP_M)
    return (first_m + tile % group_rows) * BM, ((tile % (GROUP_M * tiles_n)) // group_rows) * BN
