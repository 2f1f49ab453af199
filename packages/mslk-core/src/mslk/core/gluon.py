"""Pieces the domains' Gluon kernels share (Hopper): a TMA ring's barriers, a barrier of a partition's warps.
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
