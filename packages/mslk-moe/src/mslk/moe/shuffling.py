"""Token routing (spec M-01): `index_shuffling` sorts the tokens of a batch by the experts they are routed to.

This release runs the plain-PyTorch implementation on every device (device-side ops only: no host sync, so
it records into CUDA graphs); a Triton kernel will be a backend of the same op. Unlike the reference
library's kernel it takes any number of experts, any top_k up to E, and its order inside an expert's segment is
deterministic (ascending token index).
"""

from __future__ import annotations

import torch

from mslk.core import registry, testing


def _bounds(routing_scores, expert_index_start, expert_index_end) -> tuple[int, int]:
    experts = routing_scores.shape[1]
    start = 0 if expert_index_start is None else expert_index_start
    return start, experts if expert_index_end is None else expert_index_end


def _validate(routing_scores, expert_index_start=None, expert_index_end=None, valid_token_count=None, top_k=1):
    where = "index_shuffling"
    if routing_scores.dim() != 2 or routing_scores.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(
            f"{where}: routing_scores must be bfloat16 or float32 [T, E], got {tuple(routing_scores.shape)} "
            f"{routing_scores.dtype}"
        )
    experts = routing_scores.shape[1]
    if not 1 <= top_k <= max(experts, 1):
        raise ValueError(f"{where}: top_k must be in [1, E={experts}], got {top_k}")
    start, end = _bounds(routing_scores, expert_index_start, expert_index_end)
    if not 0 <= start <= end <= experts:
        raise ValueError(
            f"{where}: need 0 <= expert_index_start <= expert_index_end <= E={experts}, got {start}, {end}"
        )
    if valid_token_count is not None and (valid_token_count.numel() != 1 or valid_token_count.dtype.is_floating_point):
        raise ValueError(
            f"{where}: valid_token_count must be one integer (a tensor of one element), got shape "
            f"{tuple(valid_token_count.shape)} {valid_token_count.dtype}"
        )


def _index_shuffling(routing_scores, expert_index_start=None, expert_index_end=None, valid_token_count=None, top_k=1):
    tokens, experts = routing_scores.shape
    device = routing_scores.device
    start, end = _bounds(routing_scores, expert_index_start, expert_index_end)
    chosen = torch.topk(routing_scores.float(), top_k, dim=1).indices  # [T, k]; ties: torch.topk's choice
    token = torch.arange(tokens, device=device)[:, None].expand(tokens, top_k)
    valid = (chosen >= start) & (chosen < end)
    if valid_token_count is not None:
        valid &= token < valid_token_count.reshape(()).to(device)
    # Selected (token, expert) pairs first, by expert then token; the rest after them (their slots are unused).
    local = chosen - start
    key = torch.where(valid, local * tokens + token, (end - start) * tokens + token).flatten()
    order = torch.argsort(key, stable=True)
    expert_indices = local.flatten()[order].to(torch.int32)
    token_indices = token.flatten()[order].to(torch.int32)
    counts = torch.zeros(experts + 2, dtype=torch.int32, device=device)
    selected = valid.flatten()
    counts[:experts].index_add_(0, chosen.flatten(), selected.to(torch.int32))
    counts[experts] = tokens
    counts[experts + 1] = selected.sum()
    return counts, expert_indices, token_indices


def _fake(routing_scores, expert_index_start=None, expert_index_end=None, valid_token_count=None, top_k=1):
    tokens, experts = routing_scores.shape
    ints = {"dtype": torch.int32, "device": routing_scores.device}
    return torch.empty(experts + 2, **ints), torch.empty(tokens * top_k, **ints), torch.empty(tokens * top_k, **ints)


def _samples(device):
    yield registry.Sample((torch.softmax(testing.randn(37, 8, device=device), -1),))
    scores = testing.randn(64, 20, device=device).to(torch.bfloat16)
    yield registry.Sample((scores, 4, 12, torch.tensor([50], device=device), 2))


index_shuffling_op = registry.Op(
    "mslk::index_shuffling(Tensor routing_scores, int? expert_index_start=None, int? expert_index_end=None, "
    "Tensor? valid_token_count=None, int top_k=1) -> (Tensor, Tensor, Tensor)",
    domain="moe",
    reference=_index_shuffling,
    fake=_fake,
    samples=_samples,
    validate=_validate,
    reference_devices=("cpu", "cuda"),
)


def index_shuffling(
    routing_scores: torch.Tensor,
    expert_index_start: int | None = None,
    expert_index_end: int | None = None,
    valid_token_count: torch.Tensor | None = None,
    top_k: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Route tokens to their top_k experts and group them by expert (spec M-01).

    routing_scores [T, E] (bf16/fp32); experts [expert_index_start, expert_index_end) are kept (default all);
    tokens at or past valid_token_count (a one-element tensor) are skipped. Returns int32
    `(counts [E+2], expert_indices [T·k], token_indices [T·k])`: counts[e] tokens for each kept expert e (0 for
    the others), counts[E] = T, counts[E+1] = S the number of selected (token, expert) pairs; the first S
    entries of the index arrays list them by expert (local index e − start) then token, the rest is unused.
    """
    return torch.ops.mslk.index_shuffling(
        routing_scores, expert_index_start, expert_index_end, valid_token_count, top_k
    )
