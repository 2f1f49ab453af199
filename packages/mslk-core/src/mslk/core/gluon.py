"""Pieces the domains' Gluon kernels share (Hopper): a TMA ring's barriers, a barrier of a partition's warps, and
conversions and a row reduction in fewer instructions than Gluon's own.
Imported by those kernels only, so that mslk.core itself imports without Triton."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

# A barrier of the partition's warps (the CTA's outside warp specialization): gl.barrier from Triton 3.7 on,
# gl.thread_barrier before.
partition_barrier = getattr(gl, "barrier", None) or gl.thread_barrier


@gluon.jit
def ring_barriers(STAGES: gl.constexpr, READERS: gl.constexpr = 1):
    """(ready, empty): an mbarrier per stage of a ring for each, initialized: `ready` (count 1) completes when a
    stage's TMA loads have landed, `empty` (count READERS) when each of the stage's READERS readers has released
    it."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=READERS)
    return ready, empty


@gluon.jit
def to_16bit(x, dtype: gl.constexpr):
    """x (fp32).to(dtype), fp16 or bf16, rounded to nearest even, two elements an instruction: Gluon converts them
    one by one and ptxas packs each pair with a PRMT (an attention forward's weights: 32 instructions a thread a key
    block)."""
    cvt: gl.constexpr = "cvt.rn.bf16x2.f32" if dtype == gl.bfloat16 else "cvt.rn.f16x2.f32"
    return gl.inline_asm_elementwise(cvt + " $0, $2, $1;", "=r,r,r", [x], dtype=dtype.value, is_pure=True, pack=2)


@gluon.jit
def to_fp32(x):
    """x (fp16 or bf16).to(fp32); a bf16 pair in two instructions, its halves moved into place, where Gluon's
    conversion takes three (a PRMT and two shifts)."""
    if x.dtype == gl.bfloat16:
        return gl.inline_asm_elementwise("{ shl.b32 $0, $2, 16; and.b32 $1, $2, 0xffff0000; }", "=r,=r,r", [x],
                                         dtype=gl.float32, is_pure=True, pack=2)  # fmt: skip
    else:
        return x.to(gl.float32)


@gluon.jit
def row_max(x):
    """gl.max(x, 1) of a [M, N] tensor whose columns' high bits a thread holds (a warpgroup MMA's result) as a tree:
    Gluon chains a row's maxima one after the other, a dependent instruction each, before the shuffles."""
    for _ in gl.static_range(4):
        x = gl.max(gl.reshape(x, [x.shape[0], 2, x.shape[1] // 2]), 1)
    return gl.max(x, 1)
