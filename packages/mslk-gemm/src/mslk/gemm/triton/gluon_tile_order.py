"""Pieces of the Gluon GEMMs for Hopper (fp8_blockwise_hopper.py, grouped_gemm_hopper.py, int4_hopper.py,
int4_decode_hopper.py): the output tile order of the persistent ones and the walk of a grouped GEMM's tiles, a TMA
ring and its barriers, and the layouts of a wgmma product over shared-memory operands and of its row-wise stores."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from mslk.core.gluon import ring_barriers


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
def group_tiles(sizes_ptr, g, first, first_tile, next_tile, ROWS, tiles_n, BM: gl.constexpr,
                 SIZES_ARE_ENDS: gl.constexpr):  # fmt: skip
    """(rows, tiles, taken) of group g, which starts at row `first` and tile `first_tile` of the concatenated tile
    list: its rows sizes[g] (or sizes[g] − first for cumulative ends) clamped to [0, ROWS − first] as the Triton
    kernels clamp them (grouped_gemm.py, int4_gemm.py), its tiles, and how many of them the program takes (every
    P-th from its next tile, next_tile). sizes_ptr None: one group of all ROWS rows (a dense GEMM)."""
    if sizes_ptr is None:
        size = ROWS - first
    else:
        size = gl.load(sizes_ptr + g)  # clamped in its own type: an int64 size past 2^31 holds the rest
        if SIZES_ARE_ENDS:
            size -= first
        size = gl.minimum(gl.maximum(size, 0), ROWS - first).to(gl.int32)
    tiles = gl.cdiv(size, BM) * tiles_n
    return size, tiles, gl.maximum(gl.cdiv(first_tile + tiles - next_tile, gl.num_programs(0)), 0)


@gluon.jit
def operand_ring(a_desc, b_desc, STAGES: gl.constexpr):
    """(a_bufs, b_bufs, ready, empty): STAGES shared-memory slots for a tile of each TMA descriptor's block, and
    the ring's barriers (mslk.core.gluon.ring_barriers)."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BN, BK], b_desc.layout)
    ready, empty = ring_barriers(STAGES)
    return a_bufs, b_bufs, ready, empty


@gluon.constexpr_function
def wgmma_layout(block_n, dtype, num_warps):
    """The layout of a [BM, block_n] fp32 wgmma product of `dtype` operands: warps stacked along M (16 rows each),
    an instruction spanning the tile's N and 32 bytes of K."""
    return gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, block_n, 256 // dtype.primitive_bitwidth]
    )


@gluon.constexpr_function
def row_store_layout(block_n, num_warps):
    """Stores of a [BM, block_n] 16-bit tile: 16 bytes a thread, a warp along a row."""
    return gl.BlockedLayout([1, 8], [32 * 8 // block_n, block_n // 8], [num_warps, 1], [1, 0])
