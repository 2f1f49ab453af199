"""Split-K's second kernel and the dependent launches around it, shared by the INT4 and INT8 GEMMs.

A GEMM that splits K writes fp32 (or int32) partial sums to a workspace [splits, R, N]; `splitk_reduce` adds them
in split order (deterministic) into the output. On Hopper and later both kernels are launched as dependents
(programmatic dependent launch, `griddepcontrol`): a kernel's programs take their places while the kernel before
it ends, and wait for it on the GPU before touching memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from mslk.core import launch


@triton.jit
def splitk_reduce_kernel(
    ws_ptr, out_ptr, row_scale_ptr, col_scale_ptr, scalar_ptr, scalar, R, N,
    SPLITS: tl.constexpr, ROW_SCALE: tl.constexpr, COL_SCALE: tl.constexpr, SCALAR_PTR: tl.constexpr,
    DEPENDENT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """out[r, n] = (Σ_s ws[s, r, n]) · row_scale[r] · col_scale[n] · scalar (· scalar_ptr[0]), for the
    workspace [SPLITS, R, N] of split-K partial sums (fp32, or int32 for exact integer GEMMs, added in int64: the
    sum of exact int32 parts may pass 2^31), added in split order: deterministic. out [R, N] contiguous; each
    program takes BLOCK of its R·N elements. The splits are unrolled so that all their loads are in flight at once
    (a loop waits for each in turn: 9 us instead of about 2 for 8 splits of 16 x 8192 on the H200)."""
    if DEPENDENT:  # launched early (dependent launch): the workspace is complete only past this wait
        gdc_wait()
    total = tl.cast(R, tl.int64) * N
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < total
    acc = tl.load(ws_ptr + offsets, mask=mask, other=0)
    if ws_ptr.dtype.element_ty == tl.int32:
        acc = acc.to(tl.int64)
    for s in tl.static_range(1, SPLITS):
        acc += tl.load(ws_ptr + s * total + offsets, mask=mask, other=0)
    out = acc.to(tl.float32) * scalar
    if ROW_SCALE:
        out *= tl.load(row_scale_ptr + offsets // N, mask=mask, other=0.0)
    if COL_SCALE:
        out *= tl.load(col_scale_ptr + offsets % N, mask=mask, other=0.0)
    if SCALAR_PTR:
        out *= tl.load(scalar_ptr)
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)
    if DEPENDENT:  # only now: programs of the next kernel taking places early slowed it (RESULTS.md)
        gdc_launch_dependents()


def splitk_reduce(ws, out, row_scale=None, col_scale=None, scalar=1.0, scalar_tensor=None) -> torch.Tensor:
    """out [R, N] from the split-K workspace ws [splits, R, N], both contiguous; see splitk_reduce_kernel. Where
    the GPU has dependent launches, the kernel is launched as one: its programs take their places while the kernel
    before it (which wrote ws) ends and wait for it on the GPU, not for a new launch; and it lets the kernel after
    it do the same."""
    splits, r, n = ws.shape
    block = 512
    dependent = launch.dependent_launch(ws.device)
    launch.fast(splitk_reduce_kernel)[(launch.cdiv(r * n, block),)](
        ws, out, row_scale, col_scale, scalar_tensor, scalar, r, n, SPLITS=splits, ROW_SCALE=row_scale is not None,
        COL_SCALE=col_scale is not None, SCALAR_PTR=scalar_tensor is not None, DEPENDENT=dependent, BLOCK=block,
        num_warps=4, **launch.dependent_launch_options(dependent),
    )  # fmt: skip
    return out


@triton.jit
def begin_as_dependent():
    """The start of a GEMM kernel launched as a dependent: wait for the kernel before it (and its writes), then let
    the one after it (a split-K reduction) launch."""
    gdc_wait()
    gdc_launch_dependents()
