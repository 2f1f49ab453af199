"""Pieces shared by the MoE ops: the optional `valid_token_count` (a one-element device tensor) and its mask."""

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
