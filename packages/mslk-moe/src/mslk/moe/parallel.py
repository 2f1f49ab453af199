"""The torch.distributed side of the MoE layers (mslk.moe.layers): process groups, the token exchange of expert
parallelism and the reductions of tensor parallelism.

A group of None means a single rank (not torch.distributed's default group): every collective is then the
identity and torch.distributed need not be initialised. The collectives used here (all_to_all_single,
all_reduce, all_gather and reduce_scatter into one tensor) exist in NCCL and in gloo, so the layers run on GPUs
and, for tests, on CPUs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


def all_to_all(
    x: torch.Tensor,
    group: dist.ProcessGroup | None,
    send_splits: list[int] | None = None,
    recv_splits: list[int] | None = None,
) -> torch.Tensor:
    """Rows of x [R, ...] sent to the ranks of the group, send_splits[r] rows to rank r in rank order (None: R/n
    each), and the rows received from them, recv_splits[r] from rank r (None: R/n each), in rank order."""
    if group_size(group) == 1:
        return x
    rows = x.shape[0] if recv_splits is None else sum(recv_splits)
    out = x.new_empty((rows, *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
    return out


def all_reduce_(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum of x over the ranks of the group, in place."""
    if group_size(group) > 1:
        dist.all_reduce(x, group=group)
    return x


def column_block(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's block of the columns of x [R, C·n] (n ranks in the group): x[:, rank·C : (rank+1)·C]."""
    return x.chunk(group_size(group), dim=1)[group_rank(group)]


def all_gather_rows(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """x [R, ...] of every rank one after the other in rank order: [n·R, ...]."""
    n = group_size(group)
    if n == 1:
        return x
    out = x.new_empty((n * x.shape[0], *x.shape[1:]))
    # torch 2.13 renamed all_gather_into_tensor (the old name warns); torch 2.11 has only the old name.
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    all_gather(out, x.contiguous(), group=group)
    return out


def all_gather_columns(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """x [R, C] of every rank side by side in rank order: [R, C·n], the inverse of column_block."""
    n = group_size(group)
    rows, cols = x.shape
    return all_gather_rows(x, group).view(n, rows, cols).transpose(0, 1).reshape(rows, n * cols)


def reduce_scatter_columns(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The sum over the ranks of x [R, C·n], this rank's column block only: [R, C]."""
    n = group_size(group)
    if n == 1:
        return x
    rows, cols = x.shape[0], x.shape[1] // n
    blocks = x.view(rows, n, cols).transpose(0, 1).reshape(n * rows, cols)  # block b for rank b
    out = x.new_empty((rows, cols))
    # Renamed in torch 2.13, like all_gather_into_tensor.
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    reduce_scatter(out, blocks, group=group)
    return out
