"""Partial attention and merge with autograd (spec A-07..A-09)::

    partial1 = memory_efficient_attention_partial_autograd(q, k1, v1)
    partial2 = memory_efficient_attention_partial_autograd(q, k2, v2)
    out = merge_attentions_autograd(partial1, partial2)  # attention of q over [k1; k2], with gradients

How the gradients flow: the gradient of the merged attention with respect to chunk i's query, keys and values
is exactly the attention backward of chunk i run with the *merged* output and LSE (the softmax weights
exp(S − LSE) and the row sums ⟨dO, O⟩ of the backward are then those of the whole attention). So the merge's
backward hands each partial, as the gradients of its LSE and of a placeholder shaped like its output, the merged
LSE and output; the partial's backward runs the attention backward with them (a tensor bias gets its gradient too).
This holds when each of a partial's rows is merged once: a Partial may be merged once (two merges of it would sum
their outputs and LSEs as gradients: wrong), and the partials `Partial.apply` makes of it, of disjoint rows, once each.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mslk.attention.fmha.merge import merge_attentions


class _PartialAttention(torch.autograd.Function):
    """(attn, lse, placeholder) of memory_efficient_attention_partial; see the module docstring."""

    @staticmethod
    def forward(ctx, query, key, value, mask, dense_bias, p, scale, op, output_dtype):
        # The bias as (mask, its tensor) inputs (fmha._bias_inputs), so that autograd sees the tensor of a tensor bias
        # and of a LowerTriangularMaskWithTensorBias alike: it gets the bias gradient.
        from mslk.attention import fmha  # imported here: fmha/__init__ imports this module

        attn_bias = dense_bias if mask is None else mask
        attn, lse = fmha.memory_efficient_attention_partial(
            query, key, value, attn_bias, p, scale, op=op, output_dtype=output_dtype
        )
        ctx.save_for_backward(query, key, value)
        ctx.attn_bias, ctx.p, ctx.scale = attn_bias, p, scale
        ctx.op_bw = op[1] if isinstance(op, tuple) else None
        # The placeholder only carries the merged output back as its gradient: one element, expanded.
        return attn, lse, attn.new_empty(()).expand(attn.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_attn, merged_lse, merged_out):
        from mslk.attention import fmha

        query, key, value = ctx.saved_tensors
        # Backward kernels take dO and O in the query's dtype; partial outputs may be fp32.
        grad_attn, merged_out = grad_attn.to(query.dtype), merged_out.to(query.dtype)
        grads = fmha._memory_efficient_attention_backward(
            fmha.Context(out=merged_out, lse=merged_lse.contiguous()),
            fmha.Inputs(query, key, value, ctx.attn_bias, ctx.p, ctx.scale), grad_attn, ctx.op_bw,
        )  # fmt: skip
        return grads.dq, grads.dk, grads.dv, None, grads.db, None, None, None, None


class _MergePartials(torch.autograd.Function):
    """The merged output of partials given as (attn, lse, placeholder) triples; see the module docstring."""

    @staticmethod
    def forward(ctx, *tensors):
        attn, lse = tensors[0::3], tensors[1::3]
        if len(attn) == 1:  # nothing to merge (autograd turns a returned input into a view of it)
            out, merged_lse = attn[0], lse[0]
        else:
            out, merged_lse = merge_attentions(list(attn), list(lse))
        ctx.save_for_backward(out, merged_lse)
        ctx.num_partials = len(attn)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        # Unscaled dO for each partial's output: its backward weighs it with the merged LSE.
        out, merged_lse = ctx.saved_tensors
        return (grad_out, merged_lse, out) * ctx.num_partials


class Partial:
    """A partial attention awaiting its merge (spec A-09): made by memory_efficient_attention_partial_autograd,
    consumed by merge_attentions_autograd. Holds the output [B, M, (G,) H, K], its LSE [B, (G,) H, M] and the
    placeholder through which the backward receives the merged output."""

    def __init__(self, attn: torch.Tensor, lse: torch.Tensor, placeholder: torch.Tensor) -> None:
        self._attn, self._lse, self._placeholder = attn, lse, placeholder
        self._merged = False

    def is_bmghk(self) -> bool:
        return self._attn.dim() == 5

    def apply(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Partial:
        """fn applied to the output as if this were a [B, M, (G,) H, K] tensor, and alike to the LSE (seen as
        [B, M, (G,) H, 1]) and the placeholder, e.g. `lambda x: x[:, start:end]` to keep some queries. fn must
        not mix the last dimension, which the LSE lacks."""
        lse = fn(self._lse.movedim(-1, 1).unsqueeze(-1)).squeeze(-1).movedim(1, -1)
        return Partial(fn(self._attn), lse, fn(self._placeholder))

    def _tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._attn, self._lse, self._placeholder


def memory_efficient_attention_partial_autograd(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_bias=None,
    p: float = 0.0,
    scale: float | None = None,
    *,
    op=None,
    output_dtype: torch.dtype | None = None,
) -> Partial:
    """memory_efficient_attention_partial (same arguments) with autograd (spec A-07): the attention of the
    queries over one chunk of keys, to be merged by merge_attentions_autograd. `op` may be a (forward, backward)
    pair; the backward op runs with the merged output and LSE."""
    from mslk.attention import fmha

    mask, dense_bias = fmha._bias_inputs(attn_bias)
    return Partial(*_PartialAttention.apply(query, key, value, mask, dense_bias, p, scale, op, output_dtype))


def merge_attentions_autograd(*partials: Partial) -> torch.Tensor:
    """The attention over all the partials' keys, [B, M, (G,) H, K], differentiable (spec A-08). One partial
    gives its own output."""
    if not partials:
        raise ValueError("merge_attentions_autograd: no partials to merge")
    if any(partial._merged for partial in partials) or len(set(map(id, partials))) < len(partials):
        raise ValueError(
            "merge_attentions_autograd: a Partial is merged once (its backward takes the merged output and LSE as "
            "the gradients of its own: two merges would add them up); for several merges, compute the partial again"
        )
    for partial in partials:
        partial._merged = True
    return _MergePartials.apply(*(t for partial in partials for t in partial._tensors()))
