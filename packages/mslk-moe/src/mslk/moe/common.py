"""Pieces shared by the MoE ops: the optional `valid_token_count` (a one-element device tensor) and its mask;
zeroed int32 buffers that kernels leave zeroed, kept from call to call; the row tiles of the quantizing kernels."""

from __future__ import annotations

import torch

from mslk.core import launch

# The kernels that quantize whole rows to FP8 (silu_mul_quant, gather_scale_quant_dense_tokens) hold rows up to this
# long in registers; longer ones are read twice (amax, then quantize; the second read mostly from L2), in pieces of
# _TWO_PASS_BLOCK_D.
_SINGLE_PASS_MAX_D = 16384
_TWO_PASS_BLOCK_D = 2048


def row_quant_tiles(d: int) -> tuple[int, bool]:
    """(BLOCK_D, SINGLE_PASS) of a kernel quantizing rows of d elements."""
    block_d = min(launch.next_power_of_2(max(d, 1)), _SINGLE_PASS_MAX_D)
    single_pass = d <= block_d
    return (block_d if single_pass else _TWO_PASS_BLOCK_D), single_pass


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


# Int32 buffers that are all zero between kernels (spin locks, barrier counters: the kernels using them leave them
# zero), kept from call to call so that a call needs no memset launch. One per device, stream and use: kernels of
# one stream run one after another, so no two kernels use a buffer at the same time (a grid barrier's counter
# must not be shared). A kept buffer is never freed (the last one is used): kernels still running may hold its
# address. They grow by doubling, so they add up to at most twice the largest.
_kept: dict[tuple[torch.device, int, str], list[torch.Tensor]] = {}


def kept_zeros(device: torch.device, use: str, numel: int) -> torch.Tensor:
    """At least `numel` zeros on device for `use` on the current stream, which `use` must leave zero. While a
    CUDA graph is being captured: a new buffer, not kept (allocated during the capture, it belongs to the
    graph's memory pool and the graph zeroes it on each replay), so that graphs share none with other work."""
    stream = 0
    if device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            return torch.zeros(numel, dtype=torch.int32, device=device)
        stream = torch.cuda.current_stream(device).stream_id
    kept = _kept.setdefault((device, stream, use), [])
    if not kept or kept[-1].numel() < numel:
        kept.append(torch.zeros(max(numel, 2 * kept[-1].numel() if kept else 1024), dtype=torch.int32, device=device))
    return kept[-1]
