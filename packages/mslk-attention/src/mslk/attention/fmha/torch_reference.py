"""MSLK's reference backend: attention in float64 PyTorch ops on any device (`attention_reference`), with its
backward. It serves every mask, layout and dtype the kernels do, so memory_efficient_attention works on the CPU;
it is last in every priority list, so it never shadows a GPU kernel (there it is a slow fallback that
materializes the Mq × Mk scores).

Backward in float64, from the output O and log-sum-exp L of the forward (S = scale · Q·Kᵀ + bias):
P = exp(S − L), dV = Pᵀ·dO, dS = P ∘ (dO·Vᵀ − rowsum(dO ∘ O)), dQ = scale · dS·K, dK = scale · dSᵀ·Q,
dbias = dS. Given the merged O and L of partial attentions, it gives each chunk's share of the merged gradient.
"""

from __future__ import annotations

import itertools

import torch

from mslk.attention.fmha.common import (
    AttentionBwOpBase,
    AttentionFwOpBase,
    Context,
    Gradients,
    Inputs,
    bias_types,
    tensor_bias,
    varlen_num_sequences,
)
from mslk.attention.fmha.reference import _heads_first, attention_reference, attention_scores, logical_keys

_DEVICES = frozenset({"cpu", "cuda", "mtia", "xpu"})
_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
_ALL_BIASES = bias_types("None T B01-B22")


def _heads_last(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """[B, (G, H,) M, K] float64 -> like's layout [B, M, (G, H,) K] and dtype, contiguous as a kernel writes it."""
    return t.movedim(-2, 1).to(like.dtype).contiguous()  # (`to` keeps a float64 view as it is, memory_format or not)


class FwOp(AttentionFwOpBase):
    """Reference forward: exact (float64) attention, output in any float dtype, LSE float32."""

    OPERATOR = attention_reference
    NAME = "mslkF-reference"
    SUPPORTED_DEVICES = _DEVICES
    SUPPORTED_DTYPES = _DTYPES
    SUPPORTED_MAX_K = float("inf")
    SUPPORTED_ATTN_BIAS_TYPES = _ALL_BIASES
    SUPPORTS_CUSTOM_SCALE = True
    SUPPORTS_DIFFERENT_VALUE_EMBED = True
    SUPPORTS_OUTPUT_DTYPE = True
    SUPPORTS_PARTIAL = True
    SUPPORTS_BMGHK = True
    VARLEN_LSE_PACKED = True  # varlen LSE [1, (G,) H, ΣMq], like the scores

    @classmethod
    def apply(cls, inp: Inputs, needs_gradient: bool) -> tuple[torch.Tensor, Context | None]:
        # A float64 query keeps the output exact until the cast to the requested dtype.
        out, lse = attention_reference(inp.query.double(), inp.key, inp.value, inp.attn_bias, inp.scale)
        out = out.to(inp.get_output_dtype()).contiguous()
        return out, Context(lse=lse, out=out) if needs_gradient else None


class BwOp(AttentionBwOpBase):
    """Reference backward from the given output and LSE (those of the merged attention when the forward was
    partial): it follows a forward of any backend, in either varlen LSE layout."""

    OPERATOR = attention_reference
    NAME = "mslkB-reference"
    SUPPORTED_DEVICES = _DEVICES
    SUPPORTED_DTYPES = _DTYPES
    SUPPORTED_MAX_K = float("inf")
    SUPPORTED_ATTN_BIAS_TYPES = _ALL_BIASES
    SUPPORTS_CUSTOM_SCALE = True
    SUPPORTS_DIFFERENT_VALUE_EMBED = True
    SUPPORTS_BMGHK = True
    SUPPORTS_ATTN_BIAS_GRAD = True
    VARLEN_LSE_PACKED = None  # either layout

    @classmethod
    def apply(cls, ctx: Context, inp: Inputs, grad: torch.Tensor) -> Gradients:
        scale = inp.scale_float
        key, value, mask, pool_rows = logical_keys(inp.key, inp.value, inp.attn_bias)
        scores = attention_scores(inp.query, key, mask, scale)
        lse = _lse_per_query(ctx.lse, inp).double()[..., None]
        p = torch.where(lse == -torch.inf, 0.0, torch.exp(scores - lse))  # a query with no key: zero weights
        q, k, v, out, do = (_heads_first(t) for t in (inp.query, key, value, ctx.out, grad))
        dv = p.transpose(-1, -2) @ do
        ds = p * (do @ v.transpose(-1, -2) - (do * out).sum(dim=-1, keepdim=True))
        dq = ds @ k * scale
        dk = ds.transpose(-1, -2) @ q * scale
        if pool_rows is not None:  # paged: each logical key's share added to its pool row
            dk, dv = (t.new_zeros(*t.shape[:-2], inp.key.shape[1], t.shape[-1]).index_add_(-2, pool_rows, t)
                      for t in (dk, dv))  # fmt: skip
        bias = tensor_bias(inp.attn_bias)
        db = ds.to(bias.dtype) if bias is not None and bias.requires_grad else None
        return Gradients(_heads_last(dq, inp.query), _heads_last(dk, inp.key), _heads_last(dv, inp.value), db)


def _lse_per_query(lse: torch.Tensor, inp: Inputs) -> torch.Tensor:
    """The LSE as [B, (G,) H, Mq], the scores' layout: a padded varlen LSE [nseq, (G,) H, >= max Mq] is packed,
    columns past Mq (kernels pad to their block size) dropped."""
    starts = inp.attn_bias.q_seqinfo.seqstart_py if varlen_num_sequences(inp.attn_bias) else None
    if starts is None or lse.shape[0] == 1:
        return lse[..., : inp.query.shape[1]]
    return torch.cat([lse[b, ..., : end - start] for b, (start, end) in enumerate(itertools.pairwise(starts))], -1)[
        None
    ]
