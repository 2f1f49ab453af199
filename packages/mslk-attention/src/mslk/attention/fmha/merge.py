"""Merging partial attentions (spec A-06, A-22, A-23): the attention of queries over several chunks of keys, each
computed apart with its log-sum-exp (`memory_efficient_attention_partial`), combined into the attention over all
the keys (arXiv 2402.05099). Per query row, with chunk outputs Out_i and log-sum-exps LSE_i:

    LSE = log Σ_i exp(LSE_i)        Out = Σ_i w_i · Out_i        w_i = exp(LSE_i − LSE)

An empty chunk (LSE_i = −inf) weighs 0; a row whose chunks are all empty gets Out = 0 and LSE = −inf, never NaN.
The math runs in fp32 (the reference runs fp64 inputs in fp64). The backward, with g = ∂L/∂Out and
g_LSE = ∂L/∂LSE (from ∂LSE/∂LSE_i = w_i and ∂w_j/∂LSE_i = w_j · (δ_ij − w_i)):

    ∂L/∂Out_i = w_i · g        ∂L/∂LSE_i = w_i · (⟨g, Out_i⟩ − ⟨g, Out⟩ + g_LSE)

The ops (layouts with the G dimension; merge_attentions adds G = 1 to BMHK inputs):
- `mslk::fmha_merge_attentions_varargs` (A-22), the list form: attn_split[i] [B, G, H, M, K] (the reference
  library's layout, a view of a [B, M, G, H, K] output with M moved after the heads), lse_split[i] [B, G, H, M];
  returns [out [B, M, G, H, K], lse [B, G, H, M]], or [out] when write_lse is false. out has output_dtype (default
  the chunks' dtype), lse the chunks' LSE dtype.
- `mslk::fmha_merge_attentions_stacked`, the stacked form (MSLK's own op, so that torch.compile traces it):
  attn_split [n, B, M, G, H, K], lse_split [n, B, G, H, M]; same returns.
- `mslk::merge_attentions_varargs_backward` (A-23): (∂L/∂attn_split, ∂L/∂lse_split) of the list form, laid out
  like attn_split and lse_split. Both forward ops are differentiable through it (unlike the reference library,
  whose merge raises in backward).

One Triton kernel serves both forward forms: it takes a tuple of tensors of `chunks_per_tensor` chunks each, the
list's tensors with one chunk each or the stacked tensor with all n. Triton specializes it on the tuple's length,
so the list form compiles once per number of chunks. A stacked tensor's chunks load a block at a time (_chunk_block):
split-K decoding merges up to a few hundred parts of a few rows each.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from mslk.core import launch, registry, testing

# Head dims up to this run in Triton (one [BLOCK_R, K] tile in registers); longer ones run the reference.
_MAX_TRITON_K = 4096


# ------------------------------------------------------------------------------------------- reference


def _math_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """fp32, or fp64 when an input is fp64."""
    return functools.reduce(torch.promote_types, (t.dtype for t in tensors), torch.float32)


def _weights(lse_chunks: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """w_i = exp(LSE_i − LSE), 0 for empty chunks (where LSE may be −inf too, and the difference NaN)."""
    return torch.where(lse_chunks == -torch.inf, 0.0, torch.exp(lse_chunks - lse))


def _merge_reference(attn_split, lse_split, write_lse, output_dtype):
    """The stacked form in PyTorch: attn_split [n, B, M, G, H, K], lse_split [n, B, G, H, M] -> [out (, lse)]."""
    dtype = _math_dtype(attn_split, lse_split)
    lse_chunks = lse_split.to(dtype)
    lse = torch.logsumexp(lse_chunks, 0)  # −inf where every chunk is empty
    weights = _weights(lse_chunks, lse).movedim(-1, 2)[..., None]  # [n, B, M, G, H, 1]
    out = (weights * attn_split.to(dtype)).sum(0).to(output_dtype or attn_split.dtype)
    return [out, lse.to(lse_split.dtype)] if write_lse else [out]


def _merge_varargs_reference(attn_split, lse_split, write_lse, output_dtype, B, M, G, H, Kq):
    stacked = torch.stack([a.movedim(-2, -4) for a in attn_split])  # [n, B, M, G, H, K]
    return _merge_reference(stacked, torch.stack(list(lse_split)), write_lse, output_dtype)


def _merge_backward_reference(attn_split, lse_split, attn_out, lse_out, grad_attn, grad_lse):
    dtype = _math_dtype(*attn_split, *lse_split, attn_out, lse_out, grad_attn, grad_lse)
    grad = grad_attn.to(dtype).movedim(-4, -2)  # [B, G, H, M, K], attn_split's layout
    grad_dot_out = (grad * attn_out.to(dtype).movedim(-4, -2)).sum(-1)  # ⟨g, Out⟩ [B, G, H, M]
    d_attn, d_lse = _backward_outputs(attn_split, lse_split)  # (the kernels' layouts)
    for attn, lse, d_a, d_l in zip(attn_split, lse_split, d_attn, d_lse, strict=True):
        w = _weights(lse.to(dtype), lse_out.to(dtype))  # [B, G, H, M]
        d_a.copy_(w[..., None] * grad)
        d_l.copy_(w * ((grad * attn.to(dtype)).sum(-1) - grad_dot_out + grad_lse.to(dtype)))
    return d_attn, d_lse


# ------------------------------------------------------------------------------------ checks and fakes


def _check_chunks(where, attn_split, lse_split, attn_shape, lse_shape, output_dtype=None) -> None:
    """Every chunk of the given shapes; one floating dtype per list; one device."""
    if not attn_split or len(attn_split) != len(lse_split):
        raise ValueError(
            f"{where}: needs at least one chunk and as many LSE chunks as attention chunks, got "
            f"{len(attn_split)} and {len(lse_split)}"
        )
    for name, chunks, shape in (("attn_split", attn_split, attn_shape), ("lse_split", lse_split, lse_shape)):
        for i, t in enumerate(chunks):
            if tuple(t.shape) != tuple(shape):
                raise ValueError(f"{where}: {name}[{i}] has shape {tuple(t.shape)}, expected {tuple(shape)}")
        dtypes = {t.dtype for t in chunks}
        if len(dtypes) > 1 or not chunks[0].dtype.is_floating_point:
            raise ValueError(
                f"{where}: the {name} chunks must share one floating dtype, got {sorted(map(str, dtypes))}"
            )
    if output_dtype is not None and not output_dtype.is_floating_point:
        raise ValueError(f"{where}: output_dtype must be a floating dtype, got {output_dtype}")
    registry.check_devices(
        where,
        **{f"attn_split[{i}]": t for i, t in enumerate(attn_split)},
        **{f"lse_split[{i}]": t for i, t in enumerate(lse_split)},
    )


def _validate_varargs(attn_split, lse_split, write_lse, output_dtype, B, M, G, H, Kq):
    _check_chunks("fmha_merge_attentions_varargs", attn_split, lse_split, (B, G, H, M, Kq), (B, G, H, M), output_dtype)


def _validate_stacked(attn_split, lse_split, write_lse, output_dtype):
    where = "fmha_merge_attentions_stacked"
    if attn_split.dim() != 6 or lse_split.dim() != 5:
        raise ValueError(
            f"{where}: attn_split must be [n, B, M, G, H, K] and lse_split [n, B, G, H, M], got shapes "
            f"{tuple(attn_split.shape)} and {tuple(lse_split.shape)}"
        )
    n, B, M, G, H, _ = attn_split.shape
    if n == 0:
        raise ValueError(f"{where}: needs at least one chunk, got attn_split of shape {tuple(attn_split.shape)}")
    _check_chunks(where, [attn_split], [lse_split], attn_split.shape, (n, B, G, H, M), output_dtype)


def _validate_backward(attn_split, lse_split, attn_out, lse_out, grad_attn, grad_lse):
    where = "merge_attentions_varargs_backward"
    if attn_out.dim() != 5:
        raise ValueError(f"{where}: attn_out must be [B, M, G, H, K], got shape {tuple(attn_out.shape)}")
    B, M, G, H, Kq = attn_out.shape
    _check_chunks(where, attn_split, lse_split, (B, G, H, M, Kq), (B, G, H, M))
    for name, t, shape in (("lse_out", lse_out, (B, G, H, M)), ("grad_attn", grad_attn, attn_out.shape),
                           ("grad_lse", grad_lse, (B, G, H, M))):  # fmt: skip
        if tuple(t.shape) != tuple(shape) or not t.dtype.is_floating_point:
            raise ValueError(
                f"{where}: {name} must be floating of shape {tuple(shape)}, got {tuple(t.shape)} {t.dtype}"
            )
    registry.check_devices(
        where,
        **{f"attn_split[{i}]": t for i, t in enumerate(attn_split)},
        attn_out=attn_out,
        lse_out=lse_out,
        grad_attn=grad_attn,
        grad_lse=grad_lse,
    )


# The ops' outputs, uninitialized: their fake kernels, and the Triton backends' allocation.


def _new_outputs(attn, lse, write_lse, output_dtype, B, M, G, H, Kq) -> list[torch.Tensor]:
    """[out [B, M, G, H, K] (, lse [B, G, H, M])]."""
    out = attn.new_empty((B, M, G, H, Kq), dtype=output_dtype or attn.dtype)
    return [out, lse.new_empty((B, G, H, M))] if write_lse else [out]


def _varargs_outputs(attn_split, lse_split, write_lse, output_dtype, B, M, G, H, Kq):
    return _new_outputs(attn_split[0], lse_split[0], write_lse, output_dtype, B, M, G, H, Kq)


def _stacked_outputs(attn_split, lse_split, write_lse, output_dtype):
    return _new_outputs(attn_split, lse_split, write_lse, output_dtype, *attn_split.shape[1:])


def _backward_outputs(attn_split, lse_split, *args):
    """The gradients of attn_split and lse_split, in their layouts."""
    return [torch.empty_like(a) for a in attn_split], [torch.empty_like(lse) for lse in lse_split]


# ------------------------------------------------------------------------------------------- samples


def _random_chunks(n, B, M, G, H, K, dtype, device, requires_grad=False):
    """n chunks [B, G, H, M, K] and their LSEs [B, G, H, M]; chunk 0 is empty (LSE −inf) for every other row,
    never all of a row's chunks (the merged LSE of such a row is −inf, which relative errors cannot compare)."""
    attn = [testing.randn(B, G, H, M, K, dtype=dtype, device=device) for _ in range(n)]
    lse = [testing.randn(B, G, H, M, device=device, std=3.0) for _ in range(n)]
    if n > 1:
        lse[0][..., ::2] = -torch.inf
    return [t.requires_grad_(requires_grad) for t in attn], [t.requires_grad_(requires_grad) for t in lse]


def _varargs_samples(device):
    attn, lse = _random_chunks(3, 2, 5, 2, 3, 24, torch.float32, device, requires_grad=True)
    yield registry.Sample((attn, lse, True, None, 2, 5, 2, 3, 24), name="fp32, differentiable")
    attn, lse = _random_chunks(2, 1, 7, 1, 2, 64, torch.bfloat16, device)
    yield registry.Sample((attn, lse, False, torch.float32, 1, 7, 1, 2, 64), name="bf16 in, fp32 out, no lse")


def _stacked_samples(device):
    for sizes, dtype, write_lse, output_dtype, requires_grad in (
        ((4, 2, 3, 2, 2, 40), torch.float32, True, None, True),
        ((2, 1, 9, 1, 3, 16), torch.float16, False, torch.bfloat16, False),
    ):
        attn, lse = _random_chunks(*sizes, dtype, device)
        stacked = torch.stack(attn).movedim(-2, -4).requires_grad_(requires_grad)  # [n, B, M, G, H, K]
        yield registry.Sample((stacked, torch.stack(lse).requires_grad_(requires_grad), write_lse, output_dtype))


def _backward_samples(device):
    attn, lse = _random_chunks(3, 2, 6, 1, 2, 33, torch.float32, device)
    out, merged_lse = _merge_varargs_reference(attn, lse, True, None, 2, 6, 1, 2, 33)
    grads = testing.randn(*out.shape, device=device), testing.randn(*merged_lse.shape, device=device)
    yield registry.Sample((attn, lse, out, merged_lse, *grads))


# -------------------------------------------------------------------------------------------- autograd


def _backward(attn_split, lse_split, outputs, grads):
    """(∂L/∂attn_split, ∂L/∂lse_split) of the list form (attn_split [B, G, H, M, K]) from its outputs and their
    gradients (None for an output that the loss does not use)."""
    out = outputs[0]
    # Without write_lse the forward kept no LSE: recompute it (one value per row and chunk).
    lse = outputs[1] if len(outputs) > 1 else torch.logsumexp(torch.stack(list(lse_split)), 0)
    grad_out = torch.zeros_like(out) if grads[0] is None else grads[0]
    grad_lse = torch.zeros_like(lse) if len(grads) < 2 or grads[1] is None else grads[1]
    return torch.ops.mslk.merge_attentions_varargs_backward(
        list(attn_split), list(lse_split), out, lse, grad_out, grad_lse
    )


def _setup_varargs(ctx, inputs, output):
    attn_split, lse_split = inputs[:2]
    ctx.n = len(attn_split)
    ctx.save_for_backward(*attn_split, *lse_split, *output)


def _varargs_backward(ctx, grads):
    saved, n = ctx.saved_tensors, ctx.n
    d_attn, d_lse = _backward(saved[:n], saved[n : 2 * n], saved[2 * n :], grads)
    return d_attn, d_lse, *[None] * 7


def _setup_stacked(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:2], *output)


def _stacked_backward(ctx, grads):
    attn_split, lse_split, *outputs = ctx.saved_tensors
    d_attn, d_lse = _backward(attn_split.movedim(-4, -2).unbind(0), lse_split.unbind(0), outputs, grads)
    return torch.stack(d_attn).movedim(-2, -4), torch.stack(d_lse), None, None


# ----------------------------------------------------------------------------------------------- ops

merge_attentions_varargs_op = registry.Op(
    "mslk::fmha_merge_attentions_varargs(Tensor[] attn_split, Tensor[] lse_split, bool write_lse, "
    "ScalarType? output_dtype, SymInt B, SymInt M, SymInt G, SymInt H, SymInt Kq) -> Tensor[]",
    domain="attention",
    reference=_merge_varargs_reference,
    fake=_varargs_outputs,
    samples=_varargs_samples,
    validate=_validate_varargs,
    reference_devices=("cpu", "cuda"),
    backward=_varargs_backward,
    setup_context=_setup_varargs,
)

merge_attentions_stacked_op = registry.Op(
    "mslk::fmha_merge_attentions_stacked(Tensor attn_split, Tensor lse_split, bool write_lse, "
    "ScalarType? output_dtype) -> Tensor[]",
    domain="attention",
    reference=_merge_reference,
    fake=_stacked_outputs,
    samples=_stacked_samples,
    validate=_validate_stacked,
    reference_devices=("cpu", "cuda"),
    backward=_stacked_backward,
    setup_context=_setup_stacked,
)

merge_attentions_varargs_backward_op = registry.Op(
    "mslk::merge_attentions_varargs_backward(Tensor[] attn_split, Tensor[] lse_split, Tensor attn_out, "
    "Tensor lse_out, Tensor grad_attn, Tensor grad_lse) -> (Tensor[], Tensor[])",
    domain="attention",
    reference=_merge_backward_reference,
    fake=_backward_outputs,
    samples=_backward_samples,
    validate=_validate_backward,
    reference_devices=("cpu", "cuda"),
)


# ---------------------------------------------------------------------------------------------- Triton


@triton.jit
def _row_coordinates(rows, M, G, H):
    """(b, m, g, h) of flat row numbers ordered like the rows of a contiguous [B, M, G, H, K] output."""
    h = rows % H
    g = (rows // H) % G
    m = (rows // (H * G)) % M
    return rows // (H * G * M), m, g, h


@triton.jit
def _tile_offsets(strides, b, m, g, h, cols):
    """Element offsets [BLOCK_R, BLOCK_K] of rows (b, m, g, h) of a tensor with strides (b, m, g, h, k)."""
    rows = b * strides[0] + m * strides[1] + g * strides[2] + h * strides[3]
    return rows[:, None] + cols[None, :] * strides[4]


@triton.jit
def _lse_offsets(strides, b, m, g, h):
    """Element offsets [BLOCK_R] of rows (b, m, g, h) of an LSE with strides (b, g, h, m)."""
    return b * strides[0] + g * strides[1] + h * strides[2] + m * strides[3]


@triton.jit
def _chunk_lse_offsets(strides, chunk_stride, b, m, g, h, chunks):
    """Element offsets [BLOCK_R, BLOCK_C] of rows (b, m, g, h) of the LSEs of `chunks` (chunk_stride apart)."""
    return _lse_offsets(strides, b, m, g, h)[:, None] + chunks[None, :] * chunk_stride


@triton.jit
def _weight(lse_chunk, lse):
    """w_i = exp(LSE_i − LSE), 0 for an empty chunk (whose row's LSE may be −inf too: −inf − −inf is NaN)."""
    return tl.where(lse_chunk == float("-inf"), 0.0, tl.exp(lse_chunk - lse))


@triton.jit
def _merge_kernel(
    attn, attn_strides, attn_chunk_strides, lse, lse_strides, lse_chunk_strides, chunks_per_tensor,
    out, out_strides, lse_out, lse_out_strides, n_rows, M, G, H, Kq,
    WRITE_LSE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Out and LSE of BLOCK_R rows, BLOCK_C chunks at a time. attn[t] / lse[t]: chunks_per_tensor chunks each,
    attn_chunk_strides[t] / lse_chunk_strides[t] apart, with strides attn_strides[t] (b, m, g, h, k) and
    lse_strides[t] (b, g, h, m)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    row_ok = rows < n_rows
    b, m, g, h = _row_coordinates(rows, M, G, H)
    cols = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    tile_ok = row_ok[:, None] & (cols < Kq)[None, :]  # [BLOCK_R, BLOCK_K]
    chunks = tl.arange(0, BLOCK_C).to(tl.int64)  # [BLOCK_C] (64-bit: chunk · stride may pass int32)

    # Pass 1, over the LSEs alone: their max, which shifts the exponentials of pass 2 out of overflow. Sums and
    # maxima run over a chunk block's positions apart, reduced after the loop (no reduction in it, no shuffles).
    lse_max = tl.full([BLOCK_R, BLOCK_C], float("-inf"), tl.float32)
    for t in tl.static_range(len(lse)):
        lse_ptrs = lse[t] + _chunk_lse_offsets(lse_strides[t], lse_chunk_strides[t], b, m, g, h, chunks)
        for first in range(0, chunks_per_tensor, BLOCK_C):
            lse_ok = row_ok[:, None] & (first + chunks < chunks_per_tensor)[None, :]  # [BLOCK_R, BLOCK_C]
            lse_max = tl.maximum(lse_max, tl.load(lse_ptrs, mask=lse_ok, other=float("-inf")).to(tl.float32))
            lse_ptrs += lse_chunk_strides[t] * BLOCK_C
    row_max = tl.max(lse_max, 1)  # [BLOCK_R]

    # Pass 2: Σ_i exp(LSE_i − max) and Σ_i exp(LSE_i − max) · Out_i.
    weights = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    sums = tl.zeros([BLOCK_R, BLOCK_C, BLOCK_K], tl.float32)
    for t in tl.static_range(len(attn)):
        lse_ptrs = lse[t] + _chunk_lse_offsets(lse_strides[t], lse_chunk_strides[t], b, m, g, h, chunks)
        attn_ptrs = attn[t] + _tile_offsets(attn_strides[t], b, m, g, h, cols)[:, None, :]
        attn_ptrs += (chunks * attn_chunk_strides[t])[None, :, None]  # [BLOCK_R, BLOCK_C, BLOCK_K]
        for first in range(0, chunks_per_tensor, BLOCK_C):
            chunk_ok = (first + chunks < chunks_per_tensor)[None, :]  # [1, BLOCK_C]
            lse_tile = tl.load(lse_ptrs, mask=row_ok[:, None] & chunk_ok, other=float("-inf")).to(tl.float32)
            w = _weight(lse_tile, row_max[:, None])  # [BLOCK_R, BLOCK_C]
            weights += w
            values = tl.load(attn_ptrs, mask=tile_ok[:, None, :] & chunk_ok[:, :, None], other=0.0).to(tl.float32)
            sums += w[:, :, None] * values
            lse_ptrs += lse_chunk_strides[t] * BLOCK_C
            attn_ptrs += attn_chunk_strides[t] * BLOCK_C
    total = tl.sum(weights, 1)  # [BLOCK_R]
    acc = tl.sum(sums, 1)  # [BLOCK_R, BLOCK_K]

    merged = tl.where(total[:, None] == 0.0, 0.0, acc / total[:, None])  # a NaN total stays NaN
    tl.store(out + _tile_offsets(out_strides, b, m, g, h, cols), merged.to(out.dtype.element_ty), mask=tile_ok)
    if WRITE_LSE:
        lse_ptrs = lse_out + _lse_offsets(lse_out_strides, b, m, g, h)
        tl.store(lse_ptrs, (row_max + tl.log(total)).to(lse_out.dtype.element_ty), mask=row_ok)


@triton.jit
def _merge_backward_kernel(
    attn, attn_strides, lse, lse_strides, d_attn, d_attn_strides, d_lse, d_lse_strides,
    out, out_strides, lse_out, lse_out_strides, grad_out, grad_out_strides, grad_lse, grad_lse_strides,
    n_rows, M, G, H, Kq, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """∂L/∂Out_i and ∂L/∂LSE_i of BLOCK_R rows, one chunk per tensor of the tuples (strides as in _merge_kernel)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    row_ok = rows < n_rows
    b, m, g, h = _row_coordinates(rows, M, G, H)
    cols = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    tile_ok = row_ok[:, None] & (cols < Kq)[None, :]  # [BLOCK_R, BLOCK_K]

    lse_all = tl.load(lse_out + _lse_offsets(lse_out_strides, b, m, g, h), mask=row_ok).to(tl.float32)
    g_lse = tl.load(grad_lse + _lse_offsets(grad_lse_strides, b, m, g, h), mask=row_ok).to(tl.float32)
    grad = tl.load(grad_out + _tile_offsets(grad_out_strides, b, m, g, h, cols), mask=tile_ok, other=0.0)
    grad = grad.to(tl.float32)  # [BLOCK_R, BLOCK_K]
    merged = tl.load(out + _tile_offsets(out_strides, b, m, g, h, cols), mask=tile_ok, other=0.0).to(tl.float32)
    grad_dot_out = tl.sum(grad * merged, 1)  # ⟨g, Out⟩ [BLOCK_R]
    for t in tl.static_range(len(attn)):
        w = _weight(tl.load(lse[t] + _lse_offsets(lse_strides[t], b, m, g, h), mask=row_ok).to(tl.float32), lse_all)
        chunk = tl.load(attn[t] + _tile_offsets(attn_strides[t], b, m, g, h, cols), mask=tile_ok, other=0.0)
        d_chunk = (w[:, None] * grad).to(d_attn[t].dtype.element_ty)
        tl.store(d_attn[t] + _tile_offsets(d_attn_strides[t], b, m, g, h, cols), d_chunk, mask=tile_ok)
        d_lse_chunk = w * (tl.sum(grad * chunk.to(tl.float32), 1) - grad_dot_out + g_lse)
        tl.store(d_lse[t] + _lse_offsets(d_lse_strides[t], b, m, g, h), d_lse_chunk.to(d_lse[t].dtype.element_ty),
                 mask=row_ok)  # fmt: skip


def _launch_config(n_rows: int, kq: int, chunk_block: int = 1) -> tuple[tuple[int], dict]:
    """Grid and tile: a row's whole head dim per tile, rows stacked up to ~2048 elements (16 per thread), with
    chunk_block chunks of each row in a tile."""
    block_k = launch.next_power_of_2(kq)
    block_r = max(1, min(64, 2048 // (block_k * chunk_block)))
    return (launch.cdiv(n_rows, block_r),), {"BLOCK_R": block_r, "BLOCK_K": block_k, "num_warps": 4}


def _chunk_block(chunks: int, kq: int) -> int:
    """Chunks a tile of the merge kernel, loaded at once: up to ~4096 elements (32 per thread). One at a time, each
    load waited for the last: 0.48 us a chunk, 65 us of a 64K-key decode's 121 in 132 parts (H100, RESULTS.md,
    sixty-seventh session)."""
    return min(launch.next_power_of_2(chunks), max(1, 4096 // launch.next_power_of_2(kq)))


def _triton_supports(kq: int) -> list[str]:
    return [] if 0 < kq <= _MAX_TRITON_K else [f"Kq={kq} (the Triton kernel takes 1 <= Kq <= {_MAX_TRITON_K})"]


def _run_merge(attn: tuple, lse: tuple, chunks_per_tensor: int, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The merge kernel over attn (tensors [..., B, M, G, H, K]) and lse ([..., B, G, H, M]), each of
    chunks_per_tensor chunks along an optional leading dim, into outputs = [out (, lse)]."""
    out = outputs[0]
    B, M, G, H, Kq = out.shape
    n_rows = B * M * G * H
    if n_rows:
        lse_out = outputs[1] if len(outputs) > 1 else None
        chunk_block = _chunk_block(chunks_per_tensor, Kq)
        grid, config = _launch_config(n_rows, Kq, chunk_block)
        launch.fast(_merge_kernel)[grid](
            attn, tuple(t.stride()[-5:] for t in attn), tuple(t.stride(0) if t.dim() == 6 else 0 for t in attn),
            lse, tuple(t.stride()[-4:] for t in lse), tuple(t.stride(0) if t.dim() == 5 else 0 for t in lse),
            chunks_per_tensor, out, out.stride(), lse_out, (0,) * 4 if lse_out is None else lse_out.stride(),
            n_rows, M, G, H, Kq, WRITE_LSE=lse_out is not None, BLOCK_C=chunk_block, **config,
        )  # fmt: skip
    return outputs


@merge_attentions_varargs_op.backend(
    "triton", available=registry.triton_missing, supports=lambda *args: _triton_supports(args[-1])
)
def triton_merge_attentions_varargs(attn_split, lse_split, write_lse, output_dtype, B, M, G, H, Kq):
    """The Triton kernel behind fmha_merge_attentions_varargs; same arguments and results."""
    outputs = _varargs_outputs(attn_split, lse_split, write_lse, output_dtype, B, M, G, H, Kq)
    return _run_merge(tuple(a.movedim(-2, -4) for a in attn_split), tuple(lse_split), 1, outputs)


@merge_attentions_stacked_op.backend(
    "triton", available=registry.triton_missing, supports=lambda attn_split, *_: _triton_supports(attn_split.shape[-1])
)
def triton_merge_attentions_stacked(attn_split, lse_split, write_lse, output_dtype):
    """The Triton kernel behind fmha_merge_attentions_stacked; same arguments and results."""
    return merge_stacked_into(attn_split, lse_split, *_stacked_outputs(attn_split, lse_split, write_lse, output_dtype))


def merge_stacked_into(
    attn_split: torch.Tensor, lse_split: torch.Tensor, out: torch.Tensor, lse_out: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """The Triton merge of stacked chunks attn_split [n, B, M, G, H, K] and lse_split [n, B, G, H, M] (fp32) into
    out [B, M, G, H, K] (and lse_out [B, G, H, M]), any strides; [out (, lse_out)]. Split-K kernels call it on their
    parts with outputs they made: no checks, no allocations (host time, on every decoding step)."""
    outputs = [out] if lse_out is None else [out, lse_out]
    return _run_merge((attn_split,), (lse_split,), attn_split.shape[0], outputs)


@merge_attentions_varargs_backward_op.backend(
    "triton", available=registry.triton_missing, supports=lambda *args: _triton_supports(args[2].shape[-1])
)
def triton_merge_attentions_varargs_backward(attn_split, lse_split, attn_out, lse_out, grad_attn, grad_lse):
    """The Triton kernel behind merge_attentions_varargs_backward; same arguments and results."""
    d_attn, d_lse = _backward_outputs(attn_split, lse_split, attn_out, lse_out, grad_attn, grad_lse)
    B, M, G, H, Kq = attn_out.shape
    n_rows = B * M * G * H
    if n_rows:
        # The kernel indexes every [B, M, G, H, K] tensor alike: view the chunks' [B, G, H, M, K] that way.
        attn, d_attn_rows = (tuple(t.movedim(-2, -4) for t in chunks) for chunks in (attn_split, d_attn))
        grid, config = _launch_config(n_rows, Kq)
        launch.fast(_merge_backward_kernel)[grid](
            attn, tuple(t.stride() for t in attn), tuple(lse_split), tuple(t.stride() for t in lse_split),
            d_attn_rows, tuple(t.stride() for t in d_attn_rows), tuple(d_lse), tuple(t.stride() for t in d_lse),
            attn_out, attn_out.stride(), lse_out, lse_out.stride(), grad_attn, grad_attn.stride(),
            grad_lse, grad_lse.stride(), n_rows, M, G, H, Kq, **config,
        )  # fmt: skip
    return d_attn, d_lse


# ------------------------------------------------------------------------------------------ public API


def merge_attentions(
    attn_split: torch.Tensor | Sequence[torch.Tensor],
    lse_split: torch.Tensor | Sequence[torch.Tensor],
    write_lse: bool = True,
    output_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The attention over all keys from the attentions over chunks of them (spec A-06; formulas in the module
    docstring): `Out = Σ_i Out_i · exp(LSE_i − LSE)`, `LSE = log Σ_i exp(LSE_i)`.

    attn_split: the chunks' outputs, a list of [B, M, (G,) H, K] or one stacked [n, B, M, (G,) H, K] tensor;
    lse_split: their log-sum-exps, a list of [B, (G,) H, M] or a stacked [n, B, (G,) H, M].
    Returns (out [B, M, (G,) H, K] in output_dtype, default the chunks' dtype; lse [B, (G,) H, M] in the LSE
    dtype, or None when write_lse is false). Differentiable in every form.
    """
    if isinstance(attn_split, torch.Tensor) and isinstance(lse_split, torch.Tensor):
        if attn_split.dim() != lse_split.dim() + 1 or attn_split.dim() not in (5, 6):
            raise ValueError(
                f"merge_attentions: stacked attn_split must be [n, B, M, (G,) H, K] and lse_split [n, B, (G,) H, M], "
                f"got shapes {tuple(attn_split.shape)} and {tuple(lse_split.shape)}"
            )
        bmhk = attn_split.dim() == 5
        if bmhk:
            attn_split, lse_split = attn_split.unsqueeze(3), lse_split.unsqueeze(2)
        outputs = torch.ops.mslk.fmha_merge_attentions_stacked(attn_split, lse_split, write_lse, output_dtype)
    else:
        attn_list, lse_list = list(attn_split), list(lse_split)  # a stacked tensor of one form splits along dim 0
        if not attn_list or len(attn_list) != len(lse_list):
            raise ValueError(
                f"merge_attentions: needs at least one chunk and one LSE per chunk, got {len(attn_list)} attention "
                f"chunks and {len(lse_list)} LSEs"
            )
        ndim = attn_list[0].dim()
        if ndim not in (4, 5) or any(
            a.dim() != ndim or t.dim() != ndim - 1 for a, t in zip(attn_list, lse_list, strict=True)
        ):
            raise ValueError(
                f"merge_attentions: every chunk must be [B, M, (G,) H, K] with an LSE [B, (G,) H, M] (all BMHK or all "
                f"BMGHK), got shapes {[tuple(a.shape) for a in attn_list]} and {[tuple(t.shape) for t in lse_list]}"
            )
        bmhk = ndim == 4
        if bmhk:
            attn_list, lse_list = [a.unsqueeze(2) for a in attn_list], [t.unsqueeze(1) for t in lse_list]
        outputs = torch.ops.mslk.fmha_merge_attentions_varargs(
            [a.movedim(1, 3) for a in attn_list], lse_list, write_lse, output_dtype, *attn_list[0].shape
        )
    out, lse = outputs[0], outputs[1] if write_lse else None
    if bmhk:
        out, lse = out.squeeze(2), None if lse is None else lse.squeeze(1)
    return out, lse
