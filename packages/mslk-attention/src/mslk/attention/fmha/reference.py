"""Attention in plain PyTorch (spec A-01 semantics): the oracle of the attention kernels' tests and the CPU
path of memory_efficient_attention.

`out = softmax(scale · Q·Kᵀ + bias) · V` per head, in float64, with its log-sum-exp. Layouts: BMK [B, M, K]
(one head), BMHK [B, M, H, K], BMGHK [B, M, G, H, K] (grouped-query attention: K/V expanded over H by the
caller, possibly with stride 0). Masks are materialized (`AttentionBias.materialize`); varlen masks take packed
inputs with B = 1. A query with no allowed key gets zeros and a log-sum-exp of −inf.
"""

from __future__ import annotations

import torch

from mslk.attention.fmha.attn_bias import AttentionBias, _Paged


def _heads_first(t: torch.Tensor) -> torch.Tensor:
    """[B, M, (G, H,) K] -> [B, (G, H,) M, K] in float64."""
    if t.dim() == 3:
        return t.double()
    return t.movedim(1, -2).double()


def logical_keys(key: torch.Tensor, value: torch.Tensor, attn_bias) -> tuple:
    """(key, value, mask, pool rows): with a paged mask, the pool's rows gathered into its logical keys, lane after
    lane, with the unpaged mask over them and the pool row of each (the mask materialized over the pool's rows
    would count a page that a lane uses twice once); otherwise the arguments as they are and None."""
    if not isinstance(attn_bias, _Paged):
        return key, value, attn_bias, None
    rows = attn_bias.pool_rows(key.device)
    # (Values of a tensor, which torch.compile and torch.export cannot branch on: a page past the pool then fails
    # in the indexing below.)
    checked = rows.numel() and not torch.compiler.is_compiling()
    if checked and not 0 <= int(rows.min()) <= int(rows.max()) < key.shape[1]:
        raise ValueError(
            f"{type(attn_bias).__name__}: block_tables must hold pages of the pool of {key.shape[1]} rows "
            f"({key.shape[1] // attn_bias.page_size} pages of {attn_bias.page_size})"
        )
    return key[:, rows], value[:, rows], attn_bias._unpaged(), rows


def attention_scores(
    query: torch.Tensor,
    key: torch.Tensor,
    attn_bias: torch.Tensor | AttentionBias | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """`scale · Q·Kᵀ + bias` in float64, heads first: [B, (G, H,) Mq, Mk] (−inf where the mask forbids)."""
    scores = _heads_first(query) @ _heads_first(key).transpose(-1, -2)
    scores = scores * (query.shape[-1] ** -0.5 if scale is None else scale)
    if isinstance(attn_bias, AttentionBias):
        return scores + attn_bias.materialize(scores.shape, dtype=torch.float64, device=scores.device)
    if attn_bias is not None:
        return scores + attn_bias.double()
    return scores


def attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_bias: torch.Tensor | AttentionBias | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out in query's layout and dtype with value's last dim, lse float32 [B, (G, H,) Mq]); see the module
    docstring. A tensor bias has the shape of the scores, [B, (G, H,) Mq, Mk] (broadcast by expand)."""
    if not query.dim() == key.dim() == value.dim() or query.dim() not in (3, 4, 5):
        raise ValueError(
            f"attention_reference: query, key and value must all be BMK, BMHK or BMGHK, got shapes "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    key, value, attn_bias, _ = logical_keys(key, value, attn_bias)
    scores = attention_scores(query, key, attn_bias, scale)
    # A fully masked row (every score −inf) has LSE −inf, zero weights and no gradient: its scores are taken as
    # zeros, whose weights are then dropped (exp(−inf − (−inf)) would be NaN, in autograd's backward too).
    masked = (scores == -torch.inf).all(dim=-1, keepdim=True)
    scores = scores.masked_fill(masked, 0.0)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    weights = torch.exp(scores - lse).masked_fill(masked, 0.0)
    out = weights @ _heads_first(value)
    if query.dim() > 3:
        out = out.movedim(-2, 1)
    return out.to(query.dtype), lse.masked_fill(masked, -torch.inf).squeeze(-1).float()
