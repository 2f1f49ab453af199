"""Pieces shared by the MoE ops: the optional `valid_token_count` (a one-element device tensor) and its mask;
zeroed int32 buffers that kernels leave zeroed, kept from call to call."""

from __future__ import annotations

import torch


def check_valid_token_count(where: str, valid_token_count: torch.Tensor | None) -> None:
    if valid_token_count is not None and (valid_token_count.numel() != 1 or valid_token_count.dtype.is_floating_point):
        raise ValueError(
            f"{where}: valid_token_count must be one integer (a tensor of one element), got shape "
            f"{tuple(valid_token_count.shape)} {valid_token_count.dtype}"
        )


def valid_rows(n: int, valid_token_count: torch.Tensor | None, device) -> torch.Tensor | None:
    """Mask of the first valid_token_count of n rows (None: all), without reading the count on the host."""
    if valid_token_count is None:
        return None
    return torch.arange(n, device=device) < valid_token_count.reshape(()).to(device)


# Per device and use, int32 buffers that are all zero between kernels (spin locks, barrier counters: the
# kernels using them leave them zero), kept from call to call so that a call needs no memset launch. A kept
# buffer is never freed (the last one is used): CUDA graphs captured with an older one, or kernels still running
# on another stream, may hold its address. They grow by doubling, so they add up to at most twice the largest.
_kept: dict[tuple[torch.device, str], list[torch.Tensor]] = {}


def kept_zeros(device: torch.device, use: str, numel: int) -> torch.Tensor:
    """At least `numel` zeros on device for `use`, which must leave them zero. While a CUDA graph is being
    captured and the kept ones are too few, a new buffer that is not kept (allocated during a capture, it
    belongs to the graph's memory pool; its memset is part of the graph)."""
    kept = _kept.setdefault((device, use), [])
    if not kept or kept[-1].numel() < numel:
        size = max(numel, 2 * kept[-1].numel() if kept else 1024)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return torch.zeros(numel, dtype=torch.int32, device=device)
        kept.append(torch.zeros(size, dtype=torch.int32, device=device))
    return kept[-1]
