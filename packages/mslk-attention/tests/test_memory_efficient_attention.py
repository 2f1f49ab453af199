"""memory_efficient_attention and its API (spec A-01..A-05, A-16, A-20, A-21): on the CPU through the reference
backend, against the float64 oracle (`attention_reference`) and its autograd; the input errors; the torch ops and
torch.compile. GPU tests (marked `gpu`) run PyTorch's CUTLASS and FlashAttention-2 kernels against the oracle."""

import math
import random
import warnings

import pytest
import torch

from mslk.attention import fmha
from mslk.attention.fmha import attn_bias as ab
from mslk.attention.fmha import cudnn, cutlass, flash, torch_reference, triton_flash
from mslk.attention.fmha.attn_bias_utils import MASK_CLASSES, create_attn_bias
from mslk.attention.fmha.reference import attention_reference
from mslk.core import arch, testing

GRAD_TOL = 1e-5  # float64 autograd vs the float64 backward, through a float32 LSE


def qkv(shape_q, shape_kv, kv_dim=None, dtype=torch.float32, requires_grad=False):
    """Fresh random q [shape_q], k [shape_kv], v [shape_kv with last dim kv_dim]."""
    q = testing.randn(*shape_q, dtype=dtype)
    k = testing.randn(*shape_kv, dtype=dtype)
    v = testing.randn(*shape_kv[:-1], kv_dim or shape_kv[-1], dtype=dtype)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def reference_grads(q, k, v, bias, grad, scale=None):
    """Gradients of <attention_reference(q, k, v, bias), grad> in float64 autograd."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    if isinstance(bias, torch.Tensor):
        leaves.append(bias.detach().double().requires_grad_())
        bias = leaves[-1]
    out, _ = attention_reference(*leaves[:3], bias, scale)
    return torch.autograd.grad(out, leaves, grad.double())


# ------------------------------------------------------------------------------------- forward


@pytest.mark.parametrize(
    ("shape_q", "shape_kv"),
    [((2, 5, 16), (2, 7, 16)), ((2, 5, 3, 16), (2, 7, 3, 16)), ((2, 5, 2, 3, 16), (2, 7, 2, 3, 16))],
    ids=["BMK", "BMHK", "BMGHK"],
)
def test_layouts_match_reference(shape_q, shape_kv):
    q, k, v = qkv(shape_q, shape_kv, kv_dim=8)
    out = fmha.memory_efficient_attention(q, k, v)
    assert out.shape == (*shape_q[:-1], 8) and out.dtype == q.dtype
    testing.assert_rel_close(out, attention_reference(q, k, v)[0])


def test_gqa_expanded_kv_is_not_copied():
    q = testing.randn(1, 4, 2, 3, 16)
    k, v = (testing.randn(1, 9, 2, 1, 16).expand(1, 9, 2, 3, 16) for _ in range(2))
    inp = fmha.Inputs(q, k, v)
    inp.validate_inputs()
    inp.normalize_bmhk()
    assert inp.key.data_ptr() == k.data_ptr() and inp.key.stride(3) == 0
    assert inp.nbytes == 4 * (q.numel() + 2 * 9 * 2 * 16), "expanded heads count once"
    testing.assert_rel_close(fmha.memory_efficient_attention(q, k, v), attention_reference(q, k, v)[0])


def _masks():
    """(mask, Mq, Mk) for BMHK inputs with B = 1 where the mask is varlen."""
    q_lens, k_lens = [3, 1, 4], [4, 2, 6]
    paged_tables = torch.tensor([[2, 0], [1, 3], [5, 4]], dtype=torch.int32)
    return [
        (ab.LowerTriangularMask(), 6, 6),
        (ab.LowerTriangularFromBottomRightMask(), 5, 9),
        (ab.LowerTriangularFromBottomRightMask().make_local_attention(3), 5, 9),
        (ab.LocalAttentionFromBottomRightMask(2, 1), 5, 9),
        (ab.BlockDiagonalMask.from_seqlens(q_lens, k_lens, device="cpu").make_causal_from_bottomright(), 8, 12),
        (ab.BlockDiagonalCausalMask.from_seqlens(q_lens, device="cpu"), 8, 8),
        (ab.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens([1, 1, 1], 5, [3, 5, 2], device="cpu"), 3, 15),
        (
            ab.BlockDiagonalCausalWithOffsetGappyKeysMask.from_seqlens(q_lens, [0, 5, 9, 20], k_lens, device="cpu"),
            8,
            20,
        ),
        (
            ab.PagedBlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens(
                [1, 2, 1], [3, 6, 1], paged_tables, 4, device="cpu"
            ),
            4,
            24,
        ),
    ]


@pytest.mark.parametrize(
    ("mask", "mq", "mk"), _masks(), ids=lambda m: type(m).__name__ if not isinstance(m, int) else ""
)
def test_masks_forward_and_backward(mask, mq, mk):
    b = 1 if isinstance(mask, ab.VARLEN_BIASES) else 2
    q, k, v = qkv((b, mq, 2, 8), (b, mk, 2, 8), requires_grad=True)
    out = fmha.memory_efficient_attention(q, k, v, mask, scale=0.4)
    ref, _ = attention_reference(q, k, v, mask, scale=0.4)
    testing.assert_rel_close(out, ref)
    grad = testing.randn(*out.shape)
    out.backward(grad)
    for got, want, name in zip((q.grad, k.grad, v.grad), reference_grads(q, k, v, mask, grad, 0.4), "qkv", strict=True):
        testing.assert_rel_close(got, want, GRAD_TOL, what=f"d{name}")


def test_a_page_used_twice_counts_twice():
    """Paged keys are logical keys read through the page table: a page that a lane's table holds twice gives two
    keys (and sums their gradients), as a kernel walking the table reads it. The reference once attended over the
    pool's rows and counted it once."""
    page, tables = 2, torch.tensor([[3, 3, 2], [0, 1, 3]], dtype=torch.int32)
    mask = ab.PagedBlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens([2, 3], [5, 6], tables, page, device="cpu")
    q, k, v = qkv((1, 5, 2, 8), (1, 4 * page, 2, 8), requires_grad=True)  # a pool of 4 pages
    out = fmha.memory_efficient_attention(q, k, v, mask, scale=0.4)
    grad = testing.randn(*out.shape)
    out.backward(grad)
    # The logical keys gathered by hand (autograd of the gather sums a pool row's gradients), the unpaged mask.
    rows = [int(tables[b, j // page]) * page + j % page for b in range(2) for j in range(3 * page)]
    unpaged = ab.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens([2, 3], 3 * page, [5, 6], device="cpu")
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, _ = attention_reference(q64, k64[:, rows], v64[:, rows], unpaged, scale=0.4)
    ref.backward(grad.double())
    testing.assert_rel_close(out, ref)
    for got, want, name in ((q.grad, q64.grad, "dq"), (k.grad, k64.grad, "dk"), (v.grad, v64.grad, "dv")):
        testing.assert_rel_close(got, want, GRAD_TOL, what=name)
    # A pool that is not whole pages: its last page would be read past key's end (the split-K kernel did).
    with pytest.raises(ValueError, match=r"the K/V pool must be whole pages, but key.shape\[1\] = 7 is not a multiple"):
        fmha.memory_efficient_attention(q, k[:, :7], v[:, :7], mask)


def test_tensor_bias_gradient_and_broadcast_bias():
    q, k, v = qkv((2, 5, 3, 8), (2, 7, 3, 8), kv_dim=4, requires_grad=True)
    bias = testing.randn(2, 3, 5, 7).requires_grad_()
    out = fmha.memory_efficient_attention(q, k, v, bias)
    testing.assert_rel_close(out, attention_reference(q, k, v, bias)[0])
    grad = testing.randn(*out.shape)
    out.backward(grad)
    want = reference_grads(q, k, v, bias, grad)
    for got, ref in zip((q.grad, k.grad, v.grad, bias.grad), want, strict=True):
        testing.assert_rel_close(got, ref, GRAD_TOL)
    # A bias broadcast over batch and heads by expand: its gradient sums over them (autograd of the expand).
    small = testing.randn(1, 1, 5, 7).requires_grad_()
    fmha.memory_efficient_attention(q.detach(), k.detach(), v.detach(), small.expand(2, 3, 5, 7)).sum().backward()
    full = small.detach().expand(2, 3, 5, 7).clone().requires_grad_()
    fmha.memory_efficient_attention(q.detach(), k.detach(), v.detach(), full).sum().backward()
    testing.assert_rel_close(small.grad, full.grad.sum((0, 1), keepdim=True), 1e-6)


def test_gradient_of_the_tensor_of_a_causal_mask_with_bias():
    """LowerTriangularMaskWithTensorBias's tensor gets its gradient as a tensor bias does, also when it alone
    requires one (autograd once failed: the mask was no tensor to it), and backward ops without bias gradients
    decline it."""
    q, k, v = qkv((2, 5, 3, 8), (2, 7, 3, 8))
    bias = testing.randn(2, 3, 5, 7).requires_grad_()
    out = fmha.memory_efficient_attention(q, k, v, ab.LowerTriangularMaskWithTensorBias(bias))
    grad = testing.randn(*out.shape)
    out.backward(grad)
    bias64 = bias.detach().double().requires_grad_()
    ref, _ = attention_reference(q.double(), k.double(), v.double(), ab.LowerTriangularMaskWithTensorBias(bias64))
    testing.assert_rel_close(bias.grad, torch.autograd.grad(ref, bias64, grad.double())[0], GRAD_TOL)

    class WithoutBiasGradient(torch_reference.BwOp):
        SUPPORTS_ATTN_BIAS_GRAD = False

    mask = ab.LowerTriangularMaskWithTensorBias(bias)
    reasons = WithoutBiasGradient.not_supported_reasons(fmha.Inputs(q, k, v, mask))
    assert "Computing the bias gradient is not supported (attn_bias.requires_grad = True)" in reasons


def test_gqa_and_bmk_gradients():
    q = testing.randn(1, 4, 2, 3, 8).requires_grad_()
    k_base, v_base = (testing.randn(1, 6, 2, 1, 8).requires_grad_() for _ in range(2))
    k, v = (t.expand(1, 6, 2, 3, 8) for t in (k_base, v_base))
    out = fmha.memory_efficient_attention(q, k, v, ab.LowerTriangularFromBottomRightMask())
    grad = testing.randn(*out.shape)
    out.backward(grad)
    dq, dk, dv = reference_grads(q, k, v, ab.LowerTriangularFromBottomRightMask(), grad)
    testing.assert_rel_close(q.grad, dq, GRAD_TOL)
    testing.assert_rel_close(k_base.grad, dk.sum(3, keepdim=True), GRAD_TOL)
    testing.assert_rel_close(v_base.grad, dv.sum(3, keepdim=True), GRAD_TOL)
    # Leaves expanded with stride 0 get a gradient a head, as the reference's (no expansion sums them).
    k_leaf, v_leaf = (t.detach().expand(1, 6, 2, 3, 8).requires_grad_() for t in (k_base, v_base))
    fmha.memory_efficient_attention(q.detach(), k_leaf, v_leaf, ab.LowerTriangularFromBottomRightMask()).backward(grad)
    testing.assert_rel_close(k_leaf.grad, dk, GRAD_TOL)
    testing.assert_rel_close(v_leaf.grad, dv, GRAD_TOL)
    q, k, v = qkv((3, 5, 8), (3, 6, 8), requires_grad=True)
    out = fmha.memory_efficient_attention(q, k, v, ab.LowerTriangularMask())
    out.backward(grad := testing.randn(*out.shape))
    testing.assert_rel_close(k.grad, reference_grads(q, k, v, ab.LowerTriangularMask(), grad)[1], GRAD_TOL)


def test_gqa_gradients_reach_what_kv_were_expanded_from():
    """K/V expanded over the heads from a projection's view, a slice of a fused projection, and a view made a leaf
    of a tensor without gradient: autograd takes one head (the projection's own view where it can, no zeros filled
    for the expansion's sum), and every gradient equals the one through K/V copied out a head."""
    g, h, d = 2, 3, 8
    x, q = testing.randn(1, 6, 16), testing.randn(1, 4, g, h, d).requires_grad_()
    w = testing.randn(16, 3 * g * d).requires_grad_()
    b0 = testing.randn(1, 6, g * d)
    leaf = b0.view(1, 6, g, 1, d).requires_grad_()  # a view made a leaf: its base gets no gradient

    def kv(pair: int, contiguous: bool) -> list[torch.Tensor]:
        fused = x @ w
        k = (x @ w[:, : g * d]).view(1, 6, g, 1, d)  # a projection of K alone, viewed a head a group
        v = fused[..., g * d : 2 * g * d].view(1, 6, g, 1, d)  # a slice of one fused projection
        expanded = [t.expand(1, 6, g, h, d) for t in ((k, v), (k, leaf))[pair]]
        return [t.contiguous() for t in expanded] if contiguous else expanded

    k, v = kv(0, contiguous=False)
    on_leaf = kv(1, contiguous=False)[1]
    assert [type(fmha._one_head(t).grad_fn).__name__ for t in (k, v, on_leaf)] == [
        "ViewBackward0", "SliceBackward0", "SliceBackward0"]  # fmt: skip
    grad = testing.randn(1, 4, g, h, d)
    results = []
    for contiguous in (False, True):
        for pair in (0, 1):
            out = fmha.memory_efficient_attention(q, *kv(pair, contiguous), ab.LowerTriangularFromBottomRightMask())
            out.backward(grad)
        results.append([t.grad for t in (q, w, leaf)])
        q.grad = w.grad = leaf.grad = None
    for got, want, name in zip(*results, ("dq", "dw", "d(leaf)"), strict=True):
        testing.assert_rel_close(got, want, GRAD_TOL, what=name)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_dtypes_and_output_dtype(dtype):
    q, k, v = qkv((2, 5, 2, 16), (2, 6, 2, 16), dtype=dtype)
    ref, _ = attention_reference(q.double(), k, v)
    out = fmha.memory_efficient_attention(q, k, v)
    assert out.dtype == dtype
    testing.assert_rel_close(out, ref)
    out32 = fmha.memory_efficient_attention(q, k, v, output_dtype=torch.float32)
    assert out32.dtype == torch.float32
    testing.assert_rel_close(out32, ref, 1e-6)  # not rounded through the input dtype


def test_strided_and_empty_inputs():
    q, k, v = qkv((2, 5, 3, 16), (2, 7, 3, 16))
    q_s, k_s, v_s = (testing.padded_rows(t) for t in (q, k, v))
    testing.assert_rel_close(fmha.memory_efficient_attention(q_s, k_s, v_s), attention_reference(q, k, v)[0])
    assert fmha.memory_efficient_attention(q[:, :0], k, v).shape == (2, 0, 3, 16)
    assert fmha.memory_efficient_attention(q[:0], k[:0], v[:0]).shape == (0, 5, 3, 16)
    # BMK without queries or value columns: the backward (its BMK -> BMHK view crashed on empty tensors)
    for mq, kv in ((0, 8), (4, 0)):
        q3, k3, v3 = testing.randn(2, mq, 8), testing.randn(2, 5, 8), testing.randn(2, 5, kv)
        out, lse = fmha.memory_efficient_attention_forward_requires_grad(q3, k3, v3)
        dq, dk, dv = fmha.memory_efficient_attention_backward(testing.randn(*out.shape), out, lse, q3, k3, v3)
        assert (dq.shape, dk.shape, dv.shape) == (q3.shape, k3.shape, v3.shape)
        assert not dk.any() and not dv.any()


# ---------------------------------------------------------------------- lower-level API and partial


def test_forward_requires_grad_and_backward_api():
    q, k, v = qkv((1, 8, 2, 8), (1, 12, 2, 8))
    mask = ab.BlockDiagonalMask.from_seqlens([3, 1, 4], [4, 2, 6], device="cpu").make_causal_from_bottomright()
    out, lse = fmha.memory_efficient_attention_forward_requires_grad(q, k, v, mask)
    ref_out, ref_lse = attention_reference(q, k, v, mask)
    testing.assert_rel_close(out, ref_out)
    testing.assert_rel_close(lse, ref_lse)
    assert lse.shape == (1, 2, 8), "varlen LSE packed [1, H, ΣMq]"
    grad = testing.randn(*out.shape)
    dq, dk, dv = fmha.memory_efficient_attention_backward(grad, out, lse, q, k, v, mask)
    for got, want in zip((dq, dk, dv), reference_grads(q, k, v, mask, grad), strict=True):
        testing.assert_rel_close(got, want, GRAD_TOL)
    # The padded layout of a varlen LSE [nseq, H, >= max Mq] (cutlass') serves the reference backward too.
    padded = torch.full((3, 2, 32), math.inf)
    for b, (start, end) in enumerate(zip([0, 3, 4], [3, 4, 8], strict=True)):
        padded[b, :, : end - start] = lse[0, :, start:end]
    dq2, _, _ = fmha.memory_efficient_attention_backward(grad, out, padded, q, k, v, mask)
    testing.assert_rel_close(dq2, dq, 1e-12)
    with pytest.raises(ValueError, match="Wrong LSE shape"):
        fmha.memory_efficient_attention_backward(grad, out, lse[:, :, :5], q, k, v, mask)
    with pytest.raises(ValueError, match=r"must be floating point, got lse torch\.int64"):
        fmha.memory_efficient_attention_backward(grad, out, lse.long(), q, k, v, mask)
    with pytest.raises(ValueError, match=r"must be floating point, got lse torch\.float32, grad torch\.int32"):
        fmha.memory_efficient_attention_backward(grad.int(), out, lse, q, k, v, mask)
    with pytest.raises(NotImplementedError, match="dropout is not supported on the non-autograd API"):
        fmha.memory_efficient_attention_forward_requires_grad(q, k, v, p=0.1)


@pytest.mark.parametrize("op", [None, triton_flash.BwOp], ids=["dispatched", "triton"])
def test_backward_api_refuses_mis_shaped_tensors(op):
    """A backward kernel reads grad, out and the LSE by the inputs' shapes: any other shape is refused before it
    runs (the Triton backward read past their ends; the reference broadcast a wrong LSE)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if op is not None and device == "cpu" and not testing.interpreting():
        pytest.skip("the Triton backward runs on the CPU under TRITON_INTERPRET=1")
    q, k, v = (t.to(device) for t in qkv((2, 8, 2, 16), (2, 5, 2, 16), kv_dim=12))
    out, lse = fmha.memory_efficient_attention_forward_requires_grad(q, k, v)
    grad = testing.randn(*out.shape, device=device)
    want = reference_grads(q, k, v, None, grad)
    for got, ref in zip(fmha.memory_efficient_attention_backward(grad, out, lse, q, k, v, op=op), want, strict=True):
        testing.assert_rel_close(got, ref, 1e-4)
    bad = {
        "lse": [lse[..., :-1], lse[:, :1], lse[:1], lse.transpose(1, 2), lse[..., None]],
        "out": [out[:, :-1], out[..., :-1], out[:, :, :1]],
        "grad": [grad[:, :-1], grad[..., :-4], grad[:1]],
    }
    for name, tensors in bad.items():
        for t in tensors:
            args = {"grad": grad, "out": out, "lse": lse, name: t.clone()}
            if name == "lse":
                match = "Wrong LSE shape"
            else:
                match = f"{name}.shape .* should be the output's" if t.dim() == 4 else "should be either in BMK"
            with pytest.raises(ValueError, match=match):
                fmha.memory_efficient_attention_backward(args["grad"], args["out"], args["lse"], q, k, v, op=op)


def test_partial_attention_merges_to_full_attention_and_gradients():
    q, k, v = qkv((2, 5, 3, 8), (2, 11, 3, 8), dtype=torch.float16)
    chunks = [(k[:, :4], v[:, :4]), (k[:, 4:], v[:, 4:]), (k[:, :0], v[:, :0])]
    parts = [fmha.memory_efficient_attention_partial(q, kc, vc) for kc, vc in chunks]
    for out, lse in parts:
        assert out.dtype == torch.float32 and lse.shape == (2, 3, 5)
    assert (parts[2][0] == 0).all() and (parts[2][1] == -math.inf).all(), "no keys: out 0, lse −inf"
    lse = torch.logsumexp(torch.stack([lse for _, lse in parts]), 0)
    out = sum(o * torch.exp(l - lse).movedim(-1, 1)[..., None] for o, l in parts)
    ref_out, ref_lse = attention_reference(q.double(), k, v)
    testing.assert_rel_close(out, ref_out, 1e-6)
    testing.assert_rel_close(lse, ref_lse, 1e-6)
    # The backward of each chunk from the merged output and LSE: its share of the full gradient.
    grad = testing.randn(*out.shape, dtype=torch.float16)
    grads = [fmha.memory_efficient_attention_backward(grad, out, lse, q, kc, vc) for kc, vc in chunks[:2]]
    dq, dk, dv = reference_grads(q, k, v, None, grad)
    testing.assert_rel_close(grads[0][0].double() + grads[1][0].double(), dq, 5e-3)
    testing.assert_rel_close(torch.cat([grads[0][1], grads[1][1]], 1), dk)
    testing.assert_rel_close(torch.cat([grads[0][2], grads[1][2]], 1), dv)


def test_partial_errors_and_autograd():
    q, k, v = qkv((2, 5, 3, 8), (2, 6, 3, 8), requires_grad=True)
    with pytest.raises(NotImplementedError, match="dropout is not supported"):
        fmha.memory_efficient_attention_partial(q, k, v, p=0.5)
    q5, k5, v5 = qkv((2, 5, 1, 3, 8), (2, 6, 1, 3, 8), requires_grad=True)
    with pytest.raises(ValueError, match="gradients not supported for 5D tensors"):
        fmha.memory_efficient_attention_partial(q5, k5, v5, _allow_backward=True)
    out, lse = fmha.memory_efficient_attention_partial(q, k, v, _allow_backward=True)
    assert out.grad_fn is not None and lse.shape == (2, 3, 5)
    out.backward(grad := testing.randn(*out.shape))
    testing.assert_rel_close(q.grad, reference_grads(q, k, v, None, grad)[0], GRAD_TOL)


# ---------------------------------------------------------------------------------------- errors


def _shapes_text(q, k, v):
    return f"  query.shape: {q.shape}\n  key.shape  : {k.shape}\n  value.shape: {v.shape}"


def test_validate_inputs_errors():
    q, k, v = qkv((2, 5, 3, 8), (2, 6, 3, 8))
    cases = [
        ((q, k[0], v), f"Query/Key/Value should all have BMGHK, BMHK or BMK shape.\n{_shapes_text(q, k[0], v)}"),
        (
            (q, k.to("meta"), v),
            "Query/Key/Value should all be on the same device\n  query.device: cpu\n  key.device  : meta\n"
            "  value.device: cpu",
        ),
        (
            (q, k.half(), v),
            "Query/Key/Value should either all have the same dtype, or (in the quantized case) Key/Value should "
            "have dtype torch.int32\n  query.dtype: torch.float32\n  key.dtype  : torch.float16\n"
            "  value.dtype: torch.float32",
        ),
        (
            (q, k[:, :, :2], v),
            "Incompatible shapes for attention inputs:\n"
            + _shapes_text(q, k[:, :, :2], v)
            + "\nHINT: We don't support broadcasting, please use `expand` yourself before calling "
            "`memory_efficient_attention` if you need to",
        ),
    ]
    for (qq, kk, vv), message in cases:
        with pytest.raises(ValueError) as info:
            fmha.memory_efficient_attention(qq, kk, vv)
        assert str(info.value) == message
    bias = torch.zeros(2, 3, 5, 5)
    with pytest.raises(ValueError) as info:
        fmha.memory_efficient_attention(q, k, v, bias)
    assert str(info.value) == (
        f"Invalid shape for attention bias: {bias.shape} (expected (2, 3, 5, 6))\n{_shapes_text(q, k, v)}"
    )
    with pytest.raises(ValueError, match=r"^Query/Key need a head dim of at least 1\n"):
        fmha.memory_efficient_attention(q[..., :0], k[..., :0], v)
    with pytest.raises(ValueError, match=r"^Please provide inputs in BMHK format rather than BMK when using bias "):
        fmha.memory_efficient_attention(q[:, :, 0], k[:, :, 0], v[:, :, 0], ab.LowerTriangularFromBottomRightMask())
    mask = ab.BlockDiagonalMask.from_seqlens([2, 3], [3, 3], device="cpu")
    with pytest.raises(ValueError, match=r"^Expected batch_size=1 when using block-diagonal bias\n"):
        fmha.memory_efficient_attention(q, k, v, mask)
    mask = ab.BlockDiagonalMask.from_seqlens([2, 3], [3, 4], device="cpu")
    q1, k1, v1 = qkv((1, 5, 3, 8), (1, 6, 3, 8))
    with pytest.raises(ValueError) as info:
        fmha.memory_efficient_attention(q1, k1, v1, mask)
    assert str(info.value) == (
        "BlockDiagonalMask describes 5 queries and keys up to row 7, but query.shape[1] = 5 and key.shape[1] = 6"
    )
    with pytest.raises(ValueError, match=r"^Invalid dropout probability: p=1\.5$"):
        fmha.memory_efficient_attention(q, k, v, p=1.5)
    # A boolean (or integer) tensor would be added as 0 / 1: SDPA's boolean masks mean "keep".
    for mask in (torch.ones(2, 3, 5, 6, dtype=torch.bool), torch.ones(2, 3, 5, 6, dtype=torch.int64)):
        with pytest.raises(ValueError, match=r"^attn_bias: a tensor bias is added to the scores and must be float"):
            fmha.memory_efficient_attention(q, k, v, mask)
    with pytest.raises(ValueError, match=r"^output_dtype must be a floating-point dtype, got torch.int32$"):
        fmha.memory_efficient_attention(q, k, v, output_dtype=torch.int32)


def test_no_operator_error_text():
    q, k, v = qkv((2, 5, 3, 16), (2, 6, 3, 16))
    with pytest.raises(NotImplementedError) as info:
        fmha.memory_efficient_attention(q, k, v, p=0.3)
    text = str(info.value)
    head = (
        "No operator found for `memory_efficient_attention_forward` with inputs:\n"
        "     query       : shape=(2, 5, 3, 16) (torch.float32)\n"
        "     key         : shape=(2, 6, 3, 16) (torch.float32)\n"
        "     value       : shape=(2, 6, 3, 16) (torch.float32)\n"
        "     attn_bias   : <class 'NoneType'>\n"
        "     p           : 0.3\n"
    )
    assert text.startswith(head)
    assert (
        f"`{cutlass.FwOp.NAME}` is not supported because:\n    device=cpu (supported: {{'cuda'}})\n"
        f"`{fmha.triton_splitk.FwOp.NAME}` is not supported because:\n"
    ) in text
    assert "\n`mslkF-reference` is not supported because:\n    dropout > 0.0\nNext step: " in text
    assert (
        f"`{fmha.triton_splitk.FwOp.NAME}` is not supported because:\n    device=cpu (supported: {{'cuda'}})\n"
        "    dtype=torch.float32 (supported: {torch.bfloat16, torch.float16})\n    dropout > 0.0\n"
    ) in text


def test_pinned_operator_error_text():
    q, k, v = qkv((2, 5, 3, 16), (2, 6, 3, 16))
    with pytest.raises(ValueError) as info:
        fmha.memory_efficient_attention(q, k, v, op=fmha.MemoryEfficientAttentionCutlassOp)
    assert str(info.value) == (
        "Operator `memory_efficient_attention` does not support inputs:\n"
        "     query       : shape=(2, 5, 3, 16) (torch.float32)\n"
        "     key         : shape=(2, 6, 3, 16) (torch.float32)\n"
        "     value       : shape=(2, 6, 3, 16) (torch.float32)\n"
        "     attn_bias   : <class 'NoneType'>\n"
        "     p           : 0.0\n"
        "`cutlassF-pt` is not supported because:\n"
        "    device=cpu (supported: {'cuda'})"
    )
    out = fmha.memory_efficient_attention(q, k, v, op=fmha.MemoryEfficientAttentionReferenceOp)
    testing.assert_rel_close(out, attention_reference(q, k, v)[0])
    # An op of the wrong form: a TypeError that says which (they crashed inside: a tuple has no
    # not_supported_reasons, a class does not unpack).
    fw, bw = fmha.MemoryEfficientAttentionReferenceOp
    with pytest.raises(TypeError, match=r"op must be a pair \(FwOp, BwOp\) or None"):
        fmha.memory_efficient_attention(q, k, v, op=fw)
    with pytest.raises(TypeError, match="op: expected a forward operator class"):
        fmha.memory_efficient_attention_forward(q, k, v, op=(fw, bw))
    with pytest.raises(TypeError, match="op: expected a backward operator class"):
        fmha.memory_efficient_attention(q.clone().requires_grad_(), k, v, op=(fw, fw))
    out, lse = fmha.memory_efficient_attention_forward_requires_grad(q, k, v)
    with pytest.raises(TypeError, match="op: expected a backward operator class"):
        fmha.memory_efficient_attention_backward(out, out, lse, q, k, v, op=fw)


# ------------------------------------------------------------------------------- fp8 scaled tensors


def test_scaled_tensor_per_head():
    x = testing.randn(2, 5, 3, 8)
    scale = torch.rand(2, 3) + 0.5
    data = (x / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    packed = fmha.common.pack_fp8_tensorwise_per_head(data, scale, torch.bfloat16)
    assert packed.dtype == torch.float8_e4m3fn and packed.unpack()[1] is scale
    assert type(packed[0]) is torch.Tensor, "ops on it give plain tensors"
    deq = packed.dequantize()
    assert deq.dtype == torch.bfloat16
    testing.assert_rel_close(deq.float(), x, 0.08)
    with pytest.raises(ValueError, match="scale must be"):
        fmha.common.pack_fp8_tensorwise_per_head(data, torch.ones(3), torch.bfloat16)


# ------------------------------------------------------------------------------- torch ops, compile


def test_torch_ops_value_and_fake_shape():
    """(opcheck and the reference comparison of the samples: test_conformance.)"""
    q, k, v = qkv((2, 5, 3, 32), (2, 7, 3, 32), kv_dim=16)
    out = torch.ops.mslk.memory_efficient_attention_forward(q, k, v, None, 0.0, 0.5)
    testing.assert_rel_close(out, attention_reference(q, k, v, scale=0.5)[0])
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = torch.ops.mslk.memory_efficient_attention_forward(*(mode.from_tensor(t) for t in (q, k, v)))
    assert fake.shape == (2, 5, 3, 16), "the output has value's head dim"


@pytest.mark.parametrize("bmk", [False, True], ids=["BMHK", "BMK"])
def test_torch_ops_gradients(bmk):
    """The torch ops are differentiable in q, k, v and the bias (with no autograd kernel, torch only warned of
    "silently incorrect behavior"); their backward runs the forward again for the LSE they do not return."""
    shape_q, shape_kv = ((2, 5, 24), (2, 7, 24)) if bmk else ((2, 5, 3, 24), (2, 7, 3, 24))
    q, k, v = qkv(shape_q, shape_kv, kv_dim=16, requires_grad=True)
    bias = testing.randn(*shape_q[:-1], 7).movedim(1, -2).requires_grad_()  # [B, (H,) Mq, Mk]
    out = torch.ops.mslk.memory_efficient_attention_forward_with_bias(q, k, v, bias, 0.0, 0.3)
    grad = testing.randn(*out.shape)
    with warnings.catch_warnings():  # (on CPU the reference's own autograd gave gradients, with that warning)
        warnings.simplefilter("error", UserWarning)
        got = torch.autograd.grad(out, (q, k, v, bias), grad)
    for name, g, want in zip("q k v bias".split(), got, reference_grads(q, k, v, bias, grad, 0.3), strict=True):
        testing.assert_rel_close(g, want, GRAD_TOL, what=name)
    out = torch.ops.mslk.memory_efficient_attention_forward(q, k, v)
    assert out.grad_fn is not None
    testing.assert_rel_close(torch.autograd.grad(out, q, grad)[0], reference_grads(q, k, v, None, grad)[0], GRAD_TOL)


class _Attention(torch.nn.Module):
    def forward(self, q, k, v, bias):
        causal = fmha.memory_efficient_attention(q, k, v, ab.LowerTriangularFromBottomRightMask(), scale=0.3)
        with_bias = torch.ops.mslk.memory_efficient_attention_forward_with_bias(
            q.detach(), k.detach(), v.detach(), bias
        )
        return causal + with_bias


def test_torch_compile_fullgraph():
    q, k, v = qkv((2, 5, 3, 8), (2, 7, 3, 8), requires_grad=True)
    bias = testing.randn(2, 3, 5, 7)
    torch._dynamo.reset()
    compiled = torch.compile(_Attention(), fullgraph=True, backend="aot_eager")
    out = compiled(q, k, v, bias)
    testing.assert_rel_close(out, _Attention()(q, k, v, bias), 1e-6)
    out.backward(grad := testing.randn(*out.shape))
    causal_grads = reference_grads(q, k, v, ab.LowerTriangularFromBottomRightMask(), grad, 0.3)
    testing.assert_rel_close(q.grad, causal_grads[0], GRAD_TOL)


class _MasksBuiltInForward(torch.nn.Module):
    """Masks made from Python ints inside forward, and (`paged`) a paged mask over a block table given as an input."""

    def __init__(self, paged: bool):
        super().__init__()
        self.paged = paged

    def forward(self, q, k, v, pool, table):
        varlen = ab.BlockDiagonalMask.from_seqlens([3, 5], [4, 6])
        local = ab.LocalAttentionFromBottomRightMask(2, 1)
        padded = ab.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens([1, 1, 1], 3, [1, 3, 2])
        outs = [
            fmha.memory_efficient_attention(q, k, v, varlen),
            fmha.memory_efficient_attention(q, k, v, local),
            fmha.memory_efficient_attention(q[:, :3], k[:, :9], v[:, :9], padded),
        ]
        if self.paged:
            paged = ab.PagedBlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens([1, 1, 1], [3, 8, 5], table, 4)
            outs.append(fmha.memory_efficient_attention(q[:, :3], pool, pool, paged))
        return outs


@pytest.mark.parametrize("strict", [False, True])
def test_torch_export_of_masks_built_in_forward(strict):
    """Varlen masks' starts were summed through a tensor (export then met unknown values), strict export could not
    trace the MTIA check of the default device nor `getattr(super(), "__post_init__")`, and a paged mask's bounds
    check read the table's values. (Strict export still cannot build a paged mask: Dynamo takes no
    `dataclasses.fields` of a class.)"""
    module = _MasksBuiltInForward(paged=not strict)
    q, k, v = testing.randn(1, 8, 2, 16), testing.randn(1, 10, 2, 16), testing.randn(1, 10, 2, 16)
    pool = testing.randn(1, 32, 2, 16)
    table = torch.tensor([[0, 1], [2, 3], [5, 4]], dtype=torch.int32)
    program = torch.export.export(module, (q, k, v, pool, table), strict=strict)
    args = [testing.randn(*t.shape) for t in (q, k, v, pool)] + [table.flip(0)]
    outs = program.module()(*args)
    assert len(outs) == 3 + module.paged
    for got, want in zip(outs, module(*args), strict=True):
        assert torch.equal(got, want)


def test_torch_compile_gqa_gradients():
    """K/V expanded over the heads inside a compiled function: autograd takes a head's slice (Dynamo cannot look
    at what K/V are views of), gradients as in eager mode."""

    def attention(q, k_base, v_base):
        k, v = (t.expand(1, 6, 2, 3, 8) for t in (k_base, v_base))
        return fmha.memory_efficient_attention(q, k, v, ab.LowerTriangularFromBottomRightMask())

    leaves = [testing.randn(1, 4, 2, 3, 8), testing.randn(1, 6, 2, 1, 8), testing.randn(1, 6, 2, 1, 8)]
    leaves = [t.requires_grad_() for t in leaves]
    grad = testing.randn(1, 4, 2, 3, 8)
    torch._dynamo.reset()
    torch.compile(attention, fullgraph=True, backend="aot_eager")(*leaves).backward(grad)
    compiled = [t.grad for t in leaves]
    eager = torch.autograd.grad(attention(*leaves), leaves, grad)
    for got, want, name in zip(compiled, eager, ("dq", "dk", "dv"), strict=True):
        testing.assert_rel_close(got, want, 1e-6, what=name)


def test_bench_gqa_row_compares_like_with_like():
    """The bench's GQA row: MSLK (K/V expanded over the query heads, BMGHK) and SDPA's enable_gqa get the same
    tensors and agree on the output and on every gradient (K/V's a K/V head); the CPU runs SDPA's math backend."""
    from torch.nn.attention import SDPBackend

    from mslk.attention import bench

    s = {"B": 2, "M": 7, "H": 6, "Hkv": 2, "K": 16, "mask": "causal"}
    inputs = bench._inputs(s, torch.device("cpu"), requires_grad=True)
    q, k, v, _, flex_kwargs, grad = inputs
    assert k.shape == v.shape == (2, 7, 2, 16) and flex_kwargs["enable_gqa"]
    results = []
    for run in (bench._mslk(None), bench._sdpa(SDPBackend.MATH)):
        out = run(inputs)
        out.backward(grad)
        results.append([out, *(t.grad for t in (q, k, v))])
        q.grad = k.grad = v.grad = None
    for got, want, name in zip(*results, ("output", "dq", "dk", "dv"), strict=True):
        testing.assert_rel_close(got, want, 1e-2, what=name)  # (bf16)


def test_dispatch_log(monkeypatch, caplog):
    monkeypatch.setenv("MSLK_FMHA_LOG_DISPATCH", "1")
    q, k, v = qkv((1, 3, 1, 8), (1, 4, 1, 8))
    with caplog.at_level("INFO", logger="mslk.dispatch"):
        fmha.memory_efficient_attention(q, k, v)
    assert "memory_efficient_attention_forward -> mslkF-reference" in caplog.text


# -------------------------------------------------------------------------------------- GPU (T2)

_GPU_MASKS = [
    (None, 1),
    (ab.LowerTriangularMask(), 1),
    (ab.LowerTriangularFromBottomRightMask(), 2),
    (ab.LowerTriangularFromBottomRightMask().make_local_attention(5), 2),
    (ab.BlockDiagonalMask.from_seqlens([7, 1, 12], [9, 30, 12], device="cpu"), 1),
    (ab.BlockDiagonalMask.from_seqlens([7, 1, 12], [9, 30, 12], device="cpu").make_causal_from_bottomright(), 1),
    (ab.BlockDiagonalCausalMask.from_seqlens([7, 1, 12], device="cpu"), 1),
    ("tensor", 2),
]


def _gpu_case(op_pair, dtype, mask, kv_factor, layout):
    op_fw, op_bw = op_pair
    varlen = isinstance(mask, ab.VARLEN_BIASES)
    b, mq = (1, 20) if varlen else (3, 33)
    mk = mask.k_seqinfo.seqstart_py[-1] if varlen else mq * kv_factor
    heads = (2, 3) if layout == "BMGHK" else (3,)
    q, k, v = (testing.randn(b, m, *heads, 64, dtype=dtype, device="cuda") for m in (mq, mk, mk))
    if layout == "MQA":  # one K/V head expanded over the query heads with stride 0
        k, v = (t[:, :, :1].expand(b, mk, 3, 64) for t in (k, v))
    if isinstance(mask, str):  # a tensor bias
        # Rows of the bias 128-bit aligned, as CUTLASS wants: slices of a wider buffer.
        mask = testing.randn(b, *heads, mq, mk + 8 - mk % 8, dtype=dtype, device="cuda")[..., :mk]
    elif mask is not None:
        mask = mask.to("cuda")
    inp = fmha.Inputs(q, k, v, mask)
    reasons = op_fw.not_supported_reasons(inp)
    if reasons:
        pytest.skip(f"{op_fw.NAME}: {reasons}")
    return op_fw, op_bw, q, k, v, mask


@pytest.mark.gpu
@testing.skipUnlessCuda()
@pytest.mark.parametrize("layout", ["BMHK", "BMGHK", "MQA"])
@pytest.mark.parametrize(
    ("mask", "kv_factor"),
    _GPU_MASKS,
    ids=["none", "causal", "bottom-right", "local", "block-diag", "block-diag-bottom-right", "block-diag-causal", "T"],
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize(
    "op_pair",
    [
        fmha.MemoryEfficientAttentionCutlassOp,
        fmha.MemoryEfficientAttentionFlashAttentionOp,
        fmha.MemoryEfficientAttentionCudnnOp,
    ],
    ids=["cutlass", "flash", "cudnn"],
)
def test_gpu_kernels_match_reference(op_pair, dtype, mask, kv_factor, layout):
    op_fw, op_bw, q, k, v, mask = _gpu_case(op_pair, dtype, mask, kv_factor, layout)
    out, lse = fmha.memory_efficient_attention_forward_requires_grad(q, k, v, mask, op=op_fw)
    ref_out, ref_lse = attention_reference(q, k, v, mask)
    testing.assert_rel_close(out, ref_out)
    packed = fmha.common.varlen_lse_packed(lse, fmha.Inputs(q, k, v, mask))
    if packed is not False:
        testing.assert_rel_close(lse[..., : q.shape[1]], ref_lse, 1e-5)
    partial = op_fw.SUPPORTS_PARTIAL and fmha.memory_efficient_attention_partial(q, k, v, mask, op=op_fw)
    if partial:
        testing.assert_rel_close(partial[0], ref_out)
    if layout == "BMGHK" or op_bw.not_supported_reasons(fmha.Inputs(q, k, v, mask)):
        return
    grad = testing.randn(*out.shape, dtype=dtype, device="cuda")
    grads = fmha.memory_efficient_attention_backward(grad, out, lse, q, k, v, mask, op=op_bw)
    for got, want in zip(grads, reference_grads(q, k, v, mask, grad)[:3], strict=True):
        testing.assert_rel_close(got, want, 2 * testing.default_tolerance(dtype))


@pytest.mark.gpu
@testing.skipUnlessCuda()
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_gpu_autograd_dispatch_and_dropout(dtype):
    q, k, v = (testing.randn(2, 40, 4, 64, dtype=dtype, device="cuda").requires_grad_() for _ in range(3))
    inp = fmha.Inputs(q, k, v, ab.LowerTriangularMask())
    chosen = fmha.dispatch._dispatch_fw(inp, needs_gradient=True)
    assert chosen is not torch_reference.FwOp, "a GPU kernel serves it"
    out = fmha.memory_efficient_attention(q, k, v, ab.LowerTriangularMask())
    testing.assert_rel_close(out, attention_reference(q, k, v, ab.LowerTriangularMask())[0])
    out.backward(grad := testing.randn(*out.shape, dtype=dtype, device="cuda"))
    want = reference_grads(q, k, v, ab.LowerTriangularMask(), grad)
    testing.assert_rel_close(q.grad, want[0], 2 * testing.default_tolerance(dtype))
    # Dropout: the forward forces its own backward; same seed, same mask.
    out_p = fmha.memory_efficient_attention(q, k, v, p=0.3)
    out_p.sum().backward()
    assert not out_p.isnan().any() and not q.grad.isnan().any()
    torch.compile(fmha.memory_efficient_attention, fullgraph=True)(q, k, v).sum().backward()


@pytest.mark.gpu
@testing.skipUnlessCuda()
@pytest.mark.parametrize(
    "case", ["causal", "query", "grad", "long-rows", "band", "band-grad", "band-fp16-bottom-right"]
)
def test_gpu_few_pairs_dispatch(case):
    """Causal attention over 8 (batch x head) pairs of 8192 rows, and attention without a mask over 2 pairs of 16384
    rows: on Hopper the dispatcher picks MSLK's forward and cuDNN's backward; over 16 pairs of 8192 rows (2^30
    scores, "band", in fp16 with the bottom-right mask too) MSLK's backward too; all match the reference. A query 8
    bytes off a 16-byte boundary takes MSLK's Triton kernels (the Gluon forward reads through TMA; FlashAttention-2
    and CUTLASS stopped on such a query, cuDNN got it wrong), such an output gradient an aligned copy for cuDNN,
    MSLK's Triton backward kernel for MSLK's."""
    band = case.startswith("band")
    shape = (1, 16384, 2, 128) if case == "long-rows" else (1, 8192, 16 if band else 8, 128)
    dtype = torch.float16 if case.endswith("fp16-bottom-right") else torch.bfloat16

    def operand(offset=0):
        return testing.randn(offset + math.prod(shape), dtype=dtype, device="cuda")[offset:].view(shape)

    q = operand(4 if case == "query" else 0).requires_grad_()
    k, v = (operand().requires_grad_() for _ in "kv")
    mask = {"long-rows": None, "band-fp16-bottom-right": ab.LowerTriangularFromBottomRightMask()}
    mask = mask.get(case, ab.LowerTriangularMask())
    if arch.capability() == (9, 0):
        assert fmha.dispatch._dispatch_fw(fmha.Inputs(q, k, v, mask), needs_gradient=True) is triton_flash.FwOp
        backward = fmha.dispatch._dispatch_bw(fmha.Inputs(q, k, v, mask), None)
        assert backward is (triton_flash.BwOp if case == "query" or band else cudnn.BwOp), backward
    out = fmha.memory_efficient_attention(q, k, v, mask)
    out.backward(grad := operand(4 if case in ("grad", "band-grad") else 0))
    # 16 heads of float64 references would take tens of GB: then the first and the last (heads are independent)
    heads = slice(None) if shape[2] <= 8 else [0, shape[2] - 1]
    grads = [t.grad[:, :, heads] for t in (q, k, v)]
    q, k, v, out, grad = (t.detach()[:, :, heads] for t in (q, k, v, out, grad))
    testing.assert_rel_close(out, attention_reference(q, k, v, mask)[0])
    for got, want in zip(grads, reference_grads(q, k, v, mask, grad)[:3], strict=True):
        testing.assert_rel_close(got, want, 2 * testing.default_tolerance(dtype))


@pytest.mark.gpu
@testing.skipUnlessCuda()
@pytest.mark.parametrize("head_dim", [136, 192, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_gpu_cudnn_past_head_dim_128(head_dim, causal, dtype):
    """Head dims past 128 take cuDNN's kernels on Hopper (measured 2x FlashAttention-2's forward at 256); its
    forward and backward as dispatched match the float64 oracle."""
    if arch.capability() != (9, 0):
        pytest.skip("cuDNN serves head dims past 128 on Hopper only")
    mask = ab.LowerTriangularMask() if causal else None
    q, k, v = (testing.randn(2, 257, 3, head_dim, dtype=dtype, device="cuda").requires_grad_() for _ in "qkv")
    inp = fmha.Inputs(q, k, v, mask)
    assert fmha.dispatch._dispatch_fw(inp, needs_gradient=True) is cudnn.FwOp
    assert fmha.dispatch._dispatch_bw(inp, None) is cudnn.BwOp
    out = fmha.memory_efficient_attention(q, k, v, mask)
    out.backward(grad := testing.randn(*out.shape, dtype=dtype, device="cuda"))
    grads = [t.grad for t in (q, k, v)]
    q, k, v = (t.detach() for t in (q, k, v))
    testing.assert_rel_close(out, attention_reference(q, k, v, mask)[0])
    for got, want in zip(grads, reference_grads(q, k, v, mask, grad)[:3], strict=True):
        testing.assert_rel_close(got, want, 2 * testing.default_tolerance(dtype))


@pytest.mark.gpu
@testing.skipUnlessCuda()
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads", [(2, 3), (5,)], ids=["GQA", "MQA"])
@pytest.mark.parametrize("case", ["decode", "4-queries", "padded-decode", "prefill", "prefill-causal"])
def test_gpu_expanded_kv_dispatch(case, heads, dtype, head_dim):
    """K/V of 2 heads under 6 query heads (BMGHK) or of one under 5 (BMHK), expanded with stride 0: on Hopper one
    query a sequence and prefill take cuDNN's own GQA, 2 to 32 queries a sequence and sequences packed with padded
    keys (B12) split-K; the dispatched forward (and cuDNN's LSE) match the float64 oracle, with K/V read once a K/V
    head."""
    batch, mq, mk, mask = 3, {"decode": 1, "4-queries": 4}.get(case, 333), 333, None
    if case == "prefill-causal":
        mask = ab.LowerTriangularMask()
    elif case == "padded-decode":  # three sequences of one query, packed
        batch, mq, mk = 1, 3, 3 * 333
        mask = ab.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens([1] * 3, 333, [333, 200, 7], device="cuda")
    q = testing.randn(batch, mq, *heads, head_dim, dtype=dtype, device="cuda")
    k, v = (testing.randn(batch, mk, *heads[:-1], 1, head_dim, dtype=dtype, device="cuda").expand(batch, mk, *heads,
            head_dim) for _ in "kv")  # fmt: skip
    inp = fmha.Inputs(q, k, v, mask)
    if arch.capability() == (9, 0):
        chosen = fmha.dispatch._dispatch_fw(inp, needs_gradient=False)
        splitk = case in ("4-queries", "padded-decode")
        assert chosen is (fmha.triton_splitk.FwOp if splitk else cudnn.FwOp), chosen
    ref_out, ref_lse = attention_reference(q, k, v, mask)
    out = fmha.memory_efficient_attention_forward(q, k, v, mask)
    testing.assert_rel_close(out, ref_out)
    if cudnn.FwOp.not_supported_reasons(inp):
        return
    out, lse = fmha.memory_efficient_attention_forward_requires_grad(q, k, v, mask, op=cudnn.FwOp)
    testing.assert_rel_close(out, ref_out)
    testing.assert_rel_close(lse, ref_lse, 1e-5)


@pytest.mark.gpu
@testing.skipUnlessCuda()
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads", [(2, 3), (5,)], ids=["GQA", "MQA"])
@pytest.mark.parametrize(
    ("mq", "mk", "mask"), [(333, 333, "causal"), (200, 333, None), (1, 77, None), (333, 333, "window")]
)
def test_gpu_gqa_training(mq, mk, mask, heads, dtype):
    """K/V of one head a group expanded over the query heads (non-leaf: autograd sums the heads' gradients): on
    Hopper the backward of dense and causal attention is cuDNN's own GQA (dK/dV a K/V head); the dispatched forward
    and backward match the float64 oracle, as do FlashAttention-2's own GQA pinned and MSLK's Triton backward pinned
    (dK/dV a K/V head too: the heads summed in the Gluon kernel where its programs are enough, else by torch)."""
    q = testing.randn(2, mq, *heads, 128, dtype=dtype, device="cuda").requires_grad_()
    k_base, v_base = (
        testing.randn(2, mk, *heads[:-1], 1, 128, dtype=dtype, device="cuda").requires_grad_() for _ in "kv"
    )
    window = ab.LowerTriangularFromBottomRightLocalAttentionMask(64)
    mask = {"causal": ab.LowerTriangularMask(), "window": window}.get(mask)
    grad = testing.randn(2, mq, *heads, 128, dtype=dtype, device="cuda")
    k, v = (t.expand(2, mk, *heads, 128) for t in (k_base, v_base))
    want = reference_grads(q, k, v, mask, grad)
    want = [want[0], *(w.sum(-2, keepdim=True) for w in want[1:])]
    if arch.capability() == (9, 0) and mask is not window:
        inp = fmha.Inputs(q, k, v, mask, kv_grads_summed=True)
        assert fmha.dispatch._dispatch_bw(inp, None) is cudnn.BwOp
    tol = 2 * testing.default_tolerance(dtype)
    for op in (None, (None, triton_flash.BwOp), (flash.FwOp, flash.BwOp)):
        out = fmha.memory_efficient_attention(q, k, v, mask, op=op)
        testing.assert_rel_close(out, attention_reference(q, k, v, mask)[0], tol)
        out.backward(grad)
        for got, w, name in zip((q.grad, k_base.grad, v_base.grad), want, "qkv", strict=True):
            testing.assert_rel_close(got, w, tol, what=f"d{name} ({op})")
        q.grad = k_base.grad = v_base.grad = None


def _no_key_case(case: str, head_dim: int, dtype: torch.dtype):
    """(q, k, v, mask) in which some queries see no key."""
    if case == "bottom-right":  # the first 260 of 300 queries
        mask, b, mq, mk = ab.LowerTriangularFromBottomRightMask(), 2, 300, 40
    elif case == "varlen":  # a sequence of 40 queries and no keys
        mask, b, mq, mk = ab.BlockDiagonalCausalMask.from_seqlens([40, 3, 70], [0, 50, 64], device="cuda"), 1, 113, 114
    else:  # decoding with an empty cache
        mask = ab.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens([1, 1, 1], 64, [0, 50, 64], device="cuda")
        b, mq, mk = 1, 3, 192
    q, k, v = (testing.randn(b, m, 2, head_dim, dtype=dtype, device="cuda").requires_grad_() for m in (mq, mk, mk))
    return q, k, v, mask


@pytest.mark.gpu
@testing.skipUnlessCuda()
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("case", ["bottom-right", "varlen", "padded"])
def test_gpu_queries_that_see_no_key(case, head_dim, dtype):
    """Queries that see no key get a zero output and zero dQ, and the others theirs, from whichever kernels the
    dispatcher picks. PyTorch's memory-efficient kernels get such inputs wrong (garbage in those rows, and in the
    others when queries outnumber keys from the bottom right), so they decline them, pinned too."""
    q, k, v, mask = _no_key_case(case, head_dim, dtype)
    out = fmha.memory_efficient_attention(q, k, v, mask)
    testing.assert_rel_close(out, attention_reference(q, k, v, mask)[0], testing.default_tolerance(dtype))
    out.backward(grad := testing.randn(*out.shape, dtype=dtype, device="cuda"))
    for got, want, name in zip((q.grad, k.grad, v.grad), reference_grads(q, k, v, mask, grad), "qkv", strict=True):
        testing.assert_rel_close(got, want, 2 * testing.default_tolerance(dtype), what=f"d{name}")
    with pytest.raises(ValueError, match="a query sees no key"):
        fmha.memory_efficient_attention(q, k, v, mask, op=fmha.MemoryEfficientAttentionCutlassOp)


# Masks that take any lengths (the others' queries need about as many keys: create_attn_bias's sequences)
_ANY_LENGTHS = (None, torch.Tensor, ab.LowerTriangularMask, ab.LowerTriangularMaskWithTensorBias, ab.BlockDiagonalMask,
                ab.BlockDiagonalCausalMask)  # fmt: skip


def _random_case(seed: int):
    """(q, k, v, bias, scale) for memory_efficient_attention, random by seed: a mask of any class (create_attn_bias,
    its tensors requiring gradients), BMK / BMHK / BMGHK, fp16 / bf16 / fp32, head dims from 16 to 256 (value's
    another at times), lengths from 1 to 300, K and V heads expanded with stride 0 (MQA) or rows of wider buffers."""
    r = random.Random(seed)
    bias_type = r.choice([None, torch.Tensor, *MASK_CLASSES])
    fmt = r.choice(["BMHK", "BMGHK", *(["BMK"] if bias_type in (None, torch.Tensor, ab.LowerTriangularMask) else [])])
    dtype = r.choice([torch.float16, torch.bfloat16, torch.float32])
    dim = r.choice([16, 32, 40, 64, 80, 96, 128, 160, 256])
    dim_v = dim if r.random() < 0.8 else r.choice([32, 64, 128])
    batch, heads, groups, page = r.randint(1, 3), r.randint(1, 3), r.randint(1, 2), r.choice([16, 64, 256])
    while True:  # lengths that the mask's random sequences can split (a query of some needs as many keys)
        mq, mk = r.choice([1, 7, 33, 129, 300]), r.choice([1, 7, 33, 129, 300])
        if bias_type not in _ANY_LENGTHS:
            mq, mk = sorted((mq, mk))
        try:
            bias = create_attn_bias(bias_type, batch, heads, groups, mq, mk, "cuda", dtype, True, fmt, page_size=page)
            break
        except ValueError:
            continue
    if isinstance(bias, (ab.PagedBlockDiagonalPaddedKeysMask, ab.PagedBlockDiagonalGappyKeysMask)):
        batch, mq, mk = 1, batch * mq, batch * -(-mk // page) * page  # a pool of pages
    elif isinstance(bias, ab.VARLEN_BIASES):  # the sequences packed in one batch element
        batch, mq, mk = 1, batch * mq, batch * mk
    lead = {"BMK": (), "BMHK": (heads,), "BMGHK": (groups, heads)}[fmt]
    if fmt == "BMK":  # heads folded into the batch, as create_attn_bias's BMK bias has them
        batch *= heads
    strided = r.random() < 0.25
    q, k, v = (
        testing.randn(batch, m, *lead, d + 8 * strided, dtype=dtype, device="cuda")[..., :d]
        for m, d in ((mq, dim), (mk, dim), (mk, dim_v))
    )
    if lead and r.random() < 0.25:  # one K/V head expanded over the query heads
        k, v = (t[..., :1, :].expand(*t.shape[:-2], heads, t.shape[-1]) for t in (k, v))
    return q, k, v, bias, r.choice([None, 0.3])


@pytest.mark.gpu
@testing.skipUnlessCuda()
@pytest.mark.parametrize("seed", range(64))
def test_gpu_random_cases(seed):
    """What users get (the dispatched op) and MSLK's Triton op pinned, forward and backward where the op takes it,
    against the float64 oracle on a random case (`_random_case`). Cases like these found PyTorch's CUTLASS kernel
    wrong on K/V expanded with stride 0, cuDNN's backward raising on one query and one key, and the Gluon backward
    failing on one head of few queries."""
    q, k, v, bias, scale = _random_case(seed)
    tol = testing.default_tolerance(q.dtype)
    for op in (None, fmha.MemoryEfficientAttentionMslkTritonOp):
        inp = fmha.Inputs(q, k, v, bias, scale=scale)
        if op is not None and op[0].not_supported_reasons(inp):
            continue
        if op is not None and op[1].not_supported_reasons(inp):  # (gappy masks) the forward refuses such a pair
            op = (op[0], None)  # the dispatcher's backward
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
        bias_leaf, bias64 = _fresh_bias(bias), _fresh_bias(bias, torch.float64)
        out = fmha.memory_efficient_attention(*leaves, bias_leaf, scale=scale, op=op)
        ref = attention_reference(*leaves64, bias64, scale)[0]
        testing.assert_rel_close(out, ref, 2 * tol, what=f"output ({op and op[0].NAME})")
        out.backward(grad := testing.randn(*out.shape, dtype=out.dtype, device="cuda"))
        want = torch.autograd.grad(ref, leaves64 + _bias_tensors(bias64), grad.double())
        got = [t.grad for t in leaves + _bias_tensors(bias_leaf)]
        for g, w, name in zip(got, want, ["dq", "dk", "dv", "dbias"], strict=False):
            testing.assert_rel_close(g, w, 4 * tol, what=f"{name} ({op and op[1] and op[1].NAME})")


def _fresh_bias(bias, dtype=None):
    """A copy of a tensor bias (alone or in B02) as a leaf of its own (dtype: another), other masks as they are."""
    if isinstance(bias, torch.Tensor):
        return bias.detach().to(dtype or bias.dtype).requires_grad_()
    if isinstance(bias, ab.LowerTriangularMaskWithTensorBias):
        return ab.LowerTriangularMaskWithTensorBias(_fresh_bias(bias._bias, dtype))
    return bias


def _bias_tensors(bias) -> list[torch.Tensor]:
    """The tensor of a tensor bias (alone or in B02): the one with a gradient."""
    if isinstance(bias, ab.LowerTriangularMaskWithTensorBias):
        bias = bias._bias
    return [bias] if isinstance(bias, torch.Tensor) else []
