"""`unbind` whose backward avoids a copy (spec A-13).

torch.unbind's backward stacks the gradients into a new tensor. When the gradients are already laid out as the
slices of one tensor (a backward kernel that wrote dq, dk and dv into one packed buffer, say), that tensor exists:
`stack_or_none` returns it as a view of their storage, and `unbind` uses it in its backward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _non_overlapping(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether no two elements of the strided layout share memory: with the dims sorted by stride, each stride
    passes the span of the dims inside it."""
    span = 1
    for stride, size in sorted((st, sz) for sz, st in zip(shape, strides, strict=True) if sz > 1):
        if stride < span:
            return False
        span += (size - 1) * stride
    return True


def get_stack_strides(tensors: Sequence[torch.Tensor], dim: int) -> tuple[int, ...] | None:
    """The strides of `torch.stack(tensors, dim)` as a view of the storage the tensors share, or None when they
    are not laid out as its slices: same shape, strides and dtype, one storage, storage offsets in steps of one
    non-negative stride, and a stacked layout whose elements do not overlap."""
    if not tensors:
        return None
    first = tensors[0]
    dim = dim + first.dim() + 1 if dim < 0 else dim
    if not 0 <= dim <= first.dim():
        return None
    step = tensors[1].storage_offset() - first.storage_offset() if len(tensors) > 1 else 0
    base = first.untyped_storage().data_ptr()
    for i, t in enumerate(tensors):
        if (
            t.shape != first.shape
            or t.stride() != first.stride()
            or t.dtype != first.dtype
            or t.device != first.device
            or t.storage_offset() != first.storage_offset() + i * step
            or t.untyped_storage().data_ptr() != base
        ):
            return None
    strides = (*first.stride()[:dim], step, *first.stride()[dim:])
    shape = (*first.shape[:dim], len(tensors), *first.shape[dim:])
    return strides if step >= 0 and _non_overlapping(shape, strides) else None


def _stack_view(tensors: Sequence[torch.Tensor], dim: int) -> torch.Tensor | None:
    strides = get_stack_strides(tensors, dim)
    if strides is None:
        return None
    first = tensors[0]
    dim = dim + first.dim() + 1 if dim < 0 else dim
    return first.as_strided((*first.shape[:dim], len(tensors), *first.shape[dim:]), strides)


class _StackView(torch.autograd.Function):
    """The stack as a view; each input's gradient is its slice of the stack's."""

    @staticmethod
    def forward(ctx, dim: int, *tensors: torch.Tensor) -> torch.Tensor:
        ctx.dim = dim
        return _stack_view(tensors, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, *grad.unbind(ctx.dim)


def stack_or_none(tensors: Sequence[torch.Tensor], dim: int) -> torch.Tensor | None:
    """`torch.stack(tensors, dim)` when it needs no copy (a view of the storage the tensors share, see
    get_stack_strides), else None. Differentiable."""
    if get_stack_strides(tensors, dim) is None:
        return None
    return _StackView.apply(dim, *tensors)


class _Unbind(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int):
        ctx.dim = dim
        return x.unbind(dim)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # unused outputs get zeros (autograd materializes them)
        # Under torch.compile the grads are traced values without storage to compare: stack them.
        stacked = None if torch.compiler.is_compiling() else _stack_view(grads, ctx.dim)
        return (torch.stack(grads, ctx.dim) if stacked is None else stacked), None


def unbind(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, ...]:
    """`torch.unbind(x, dim)`; its backward returns the gradients' stack as a view, without a copy, when they
    already are the slices of one tensor (see get_stack_strides)."""
    return _Unbind.apply(x, dim)
