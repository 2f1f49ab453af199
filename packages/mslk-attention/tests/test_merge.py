"""merge_attentions and its ops (spec A-06, A-22, A-23), merge_training (A-07..A-09), unbind (A-13).

T0: the merge against attention over all the keys (float64 oracle), both forms and layouts, empty chunks, errors,
opcheck, torch.compile, gradients against float64 autograd. T1 (CPU, interpreter) and T2 (GPU): the Triton
kernels against the reference.
"""

import itertools
import math

import pytest
import torch

from mslk.attention.fmha import attn_bias as ab
from mslk.attention.fmha import merge as mg
from mslk.attention.fmha import merge_training as mt
from mslk.attention.fmha.merge import merge_attentions
from mslk.attention.fmha.reference import attention_reference
from mslk.attention.fmha.unbind import get_stack_strides, stack_or_none, unbind
from mslk.core import testing

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
OPS = [mg.merge_attentions_varargs_op, mg.merge_attentions_stacked_op, mg.merge_attentions_varargs_backward_op]
# Under the interpreter numpy reports the −inf − −inf and log(0) of masked-out rows, which the kernels discard.
quiet_numpy = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")


def qkv(layout, batch=2, mq=5, mk=13, heads=3, groups=2, k=16, dtype=torch.float32, device="cpu"):
    head_dims = (groups, heads) if layout == "BMGHK" else (heads,)
    return tuple(testing.randn(batch, m, *head_dims, k, dtype=dtype, device=device) for m in (mq, mk, mk))


def chunk_attentions(q, k, v, bounds, attn_bias=None):
    """[(out, lse)] of the attention of q over the keys [bounds[i], bounds[i + 1]); an empty chunk gives
    out = 0 and lse = −inf."""
    return [attention_reference(q, k[:, a:b], v[:, a:b], attn_bias) for a, b in itertools.pairwise(bounds)]


# ------------------------------------------------------------------------------------------- T0: math


@pytest.mark.parametrize("layout", ["BMHK", "BMGHK"])
@pytest.mark.parametrize("form", ["list", "stacked"])
def test_merge_equals_attention_over_all_keys(layout, form):
    q, k, v = qkv(layout)
    parts = chunk_attentions(q, k, v, [0, 4, 4, 9, 13])  # the second chunk is empty
    attn, lse = [p[0] for p in parts], [p[1] for p in parts]
    if form == "stacked":
        attn, lse = torch.stack(attn), torch.stack(lse)
    out, merged_lse = merge_attentions(attn, lse)
    ref_out, ref_lse = attention_reference(q, k, v)
    assert out.dtype == q.dtype and merged_lse.dtype == torch.float32
    testing.assert_rel_close(out, ref_out, 1e-6)
    testing.assert_rel_close(merged_lse, ref_lse, 1e-6)


def test_merge_with_masks_equals_masked_attention():
    """A KV cache prefix (no mask) and new keys under a bottom-right causal mask: the causal attention over all."""
    q, k, v = qkv("BMHK", mq=4, mk=11)
    prefix, new = chunk_attentions(q, k, v, [0, 7]), chunk_attentions(q, k, v, [7, 11], ab.LowerTriangularMask())
    out, lse = merge_attentions(*zip(*(prefix + new), strict=True))
    ref_out, ref_lse = attention_reference(q, k, v, ab.LowerTriangularFromBottomRightMask())
    testing.assert_rel_close(out, ref_out, 1e-6)
    testing.assert_rel_close(lse, ref_lse, 1e-6)


@pytest.mark.parametrize("form", ["list", "stacked"])
def test_rows_without_keys_give_zero_and_minus_inf(form):
    q, k, v = qkv("BMHK", mq=6)
    bias = testing.randn(2, 3, 6, 13)
    bias[..., :3, :] = -math.inf  # queries 0-2 see no key
    parts = [*chunk_attentions(q, k, v, [0, 0]), attention_reference(q, k, v, bias)]  # chunk 0 has no keys
    attn, lse = [p[0] for p in parts], [p[1] for p in parts]
    assert (lse[0] == -math.inf).all() and (lse[1][..., :3] == -math.inf).all()
    if form == "stacked":
        attn, lse = torch.stack(attn), torch.stack(lse)
    out, merged_lse = merge_attentions(attn, lse)
    assert not out.isnan().any() and not merged_lse.isnan().any()
    assert (out[:, :3] == 0).all() and (merged_lse[..., :3] == -math.inf).all()
    testing.assert_rel_close(out, attention_reference(q, k, v, bias)[0], 1e-6)


def test_write_lse_output_dtype_and_dtypes():
    q, k, v = qkv("BMGHK", dtype=torch.float16)
    attn, lse = zip(*chunk_attentions(q, k, v, [0, 6, 13]), strict=True)
    out, merged_lse = merge_attentions(attn, lse)
    assert out.dtype == torch.float16 and merged_lse.dtype == torch.float32, "defaults: the chunks' dtypes"
    for form in (list, torch.stack):
        out32, none = merge_attentions(form(attn), form(lse), write_lse=False, output_dtype=torch.float32)
        assert none is None and out32.dtype == torch.float32 and out32.shape == out.shape
        testing.assert_rel_close(out32, attention_reference(q.double(), k.double(), v.double())[0], 2e-3)


def test_input_errors():
    attn, lse = testing.randn(2, 3, 4, 8), testing.randn(2, 4, 3)
    with pytest.raises(ValueError, match="at least one chunk"):
        merge_attentions([], [])
    with pytest.raises(ValueError, match="one LSE per chunk"):
        merge_attentions([attn, attn], [lse])
    with pytest.raises(ValueError, match=r"lse_split\[1\] has shape"):
        merge_attentions([attn, attn], [lse, testing.randn(2, 4, 2)])
    with pytest.raises(ValueError, match="all BMHK or all BMGHK"):
        merge_attentions([attn, attn.unsqueeze(2)], [lse, lse.unsqueeze(1)])
    with pytest.raises(ValueError, match="one floating dtype"):
        merge_attentions([attn, attn.half()], [lse, lse])
    with pytest.raises(ValueError, match="stacked attn_split"):
        merge_attentions(attn, lse)
    with pytest.raises(ValueError, match="at least one chunk"):
        merge_attentions(attn[None, None][:0], lse[None, None][:0])
    with pytest.raises(ValueError, match="output_dtype must be a floating dtype"):
        merge_attentions([attn], [lse], output_dtype=torch.int32)


# -------------------------------------------------------------------------------- T0: ops, compile, grads


@pytest.mark.parametrize("op", OPS, ids=lambda op: op.name)
def test_opcheck_and_reference(op):
    testing.run_opcheck(op)
    for sample in op.samples(torch.device(DEVICE)):
        got, ref = op.torch_op(*sample.args), op.reference(*sample.args)
        if op is mg.merge_attentions_varargs_backward_op:  # two lists of gradients
            got, ref = [*got[0], *got[1]], [*ref[0], *ref[1]]
        assert len(got) == len(ref)
        for g, r in zip(got, ref, strict=True):
            assert g.dtype == r.dtype
            testing.assert_rel_close(g, r)


def merge_formula(attn, lse):
    """merge_attentions in plain differentiable PyTorch, stacked BMHK: the gradients' oracle."""
    merged_lse = torch.logsumexp(lse, 0)
    return (torch.exp(lse - merged_lse).movedim(-1, 2)[..., None] * attn).sum(0), merged_lse


@pytest.mark.parametrize("form", ["list", "stacked"])
@pytest.mark.parametrize("write_lse", [True, False])
def test_gradients_match_float64_autograd(form, write_lse):
    attn = testing.randn(3, 2, 5, 3, 8, dtype=torch.float64).requires_grad_()
    lse = testing.randn(3, 2, 3, 5, dtype=torch.float64, std=2.0).requires_grad_()
    grad_out, grad_lse = testing.randn(2, 5, 3, 8, dtype=torch.float64), testing.randn(2, 3, 5, dtype=torch.float64)

    def loss(out, merged_lse):
        return (out * grad_out).sum() + ((merged_lse * grad_lse).sum() if write_lse else 0)

    ref = torch.autograd.grad(loss(*merge_formula(attn, lse)), (attn, lse))
    inputs = (list(attn.unbind(0)), list(lse.unbind(0))) if form == "list" else (attn, lse)
    out, merged_lse = merge_attentions(*inputs, write_lse=write_lse)
    assert (merged_lse is None) != write_lse
    got = torch.autograd.grad(loss(out, merged_lse), (attn, lse))
    for g, r, name in zip(got, ref, ("d attn", "d lse"), strict=True):
        testing.assert_rel_close(g, r, 1e-12, what=name)


def test_gradients_of_empty_chunks_are_zero():
    attn = testing.randn(2, 1, 4, 2, 8).requires_grad_()
    lse = testing.randn(2, 1, 2, 4).requires_grad_()
    with torch.no_grad():
        lse[0, ..., :2] = -math.inf  # chunk 0 is empty for rows 0-1
        lse[1, ..., 0] = -math.inf  # row 0 sees no key at all
    out, merged_lse = merge_attentions(attn, lse)
    (out.sum() + merged_lse[..., 1:].sum()).backward()
    assert not attn.grad.isnan().any() and not lse.grad.isnan().any()
    assert (attn.grad[0, :, :2] == 0).all() and (lse.grad[0, ..., :2] == 0).all() and (attn.grad[1, :, 0] == 0).all()


def test_torch_compile_fullgraph_with_backward():
    def merged(attn_list, lse_stacked):
        out1, lse1 = merge_attentions(attn_list, list(lse_stacked))
        out2, _ = merge_attentions(torch.stack(attn_list), lse_stacked, write_lse=False, output_dtype=torch.float64)
        return out1.sum() + lse1.sum() + out2.sum()

    attn = [testing.randn(2, 3, 2, 4, 8).requires_grad_() for _ in range(3)]
    lse = testing.randn(3, 2, 2, 4, 3).requires_grad_()
    eager = torch.autograd.grad(merged(attn, lse), [*attn, lse])
    compiled = torch.compile(merged, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(attn, lse), [*attn, lse])
    for g, e in zip(got, eager, strict=True):
        testing.assert_rel_close(g, e, 1e-6)


class _MergeList(torch.nn.Module):
    def forward(self, a0, a1, l0, l1):
        return merge_attentions([a0, a1], [l0, l1])


def test_torch_export_with_dynamic_batch_and_queries():
    """The list form's op takes the sizes B, M, G, H, Kq: as `int`s, export fixed them (a named Dim was refused,
    Dim.AUTO specialized and the program then refused other sizes); as SymInts they follow the inputs."""
    batch, queries = torch.export.Dim("batch"), torch.export.Dim("queries")
    attn_dims, lse_dims = {0: batch, 1: queries}, {0: batch, 2: queries}
    args = [testing.randn(2, 5, 2, 8), testing.randn(2, 5, 2, 8), testing.randn(2, 2, 5), testing.randn(2, 2, 5)]
    program = torch.export.export(_MergeList(), tuple(args), dynamic_shapes=(attn_dims, attn_dims, lse_dims, lse_dims))
    other = [testing.randn(3, 4, 2, 8), testing.randn(3, 4, 2, 8), testing.randn(3, 2, 4), testing.randn(3, 2, 4)]
    for got, want in zip(program.module()(*other), _MergeList()(*other), strict=True):
        assert torch.equal(got, want)


# ------------------------------------------------------------------------ T1 (CPU, interpreter) / T2 (GPU)


def random_chunks(n, shape, dtype, noncontiguous):
    """n chunks [B, M, G, H, K] (rows padded apart when noncontiguous) and LSEs [B, G, H, M] with empty chunks:
    chunk 0 for every third row, every chunk for row 0 of batch 0."""
    B, M, G, H, _ = shape
    attn = [testing.randn(*shape, dtype=dtype, device=DEVICE) for _ in range(n)]
    if noncontiguous:
        attn = [testing.padded_rows(a) for a in attn]
    lse = [testing.randn(B, G, H, M, device=DEVICE, std=3.0) for _ in range(n)]
    lse[0][..., ::3] = -math.inf
    for t in lse:
        t[0, ..., 0] = -math.inf
    return attn, lse


KERNEL_CASES = [  # (n chunks, [B, M, G, H, K], dtype, non-contiguous)
    (1, (1, 3, 1, 2, 16), torch.float32, False),
    (3, (2, 5, 2, 3, 40), torch.bfloat16, True),
    (4, (1, 33, 1, 1, 5), torch.float16, False),
    (2, (3, 1, 1, 4, 128), torch.float32, True),
]


@quiet_numpy
@pytest.mark.parametrize("case", KERNEL_CASES, ids=str)
def test_triton_forward_matches_reference(case):
    n, shape, dtype, noncontiguous = case
    attn, lse = random_chunks(n, shape, dtype, noncontiguous)
    varargs = ([a.movedim(1, 3) for a in attn], lse, True, torch.float32, *shape)
    stacked = (torch.stack(attn), torch.stack(lse), True, None)
    for got, ref in (
        (mg.triton_merge_attentions_varargs(*varargs), mg.merge_attentions_varargs_op.reference(*varargs)),
        (mg.triton_merge_attentions_stacked(*stacked), mg.merge_attentions_stacked_op.reference(*stacked)),
    ):
        assert [t.dtype for t in got] == [t.dtype for t in ref]
        assert (got[1][0, ..., 0] == -math.inf).all() and (got[0][0, 0] == 0).all(), "rows without keys"
        finite = got[1] > -math.inf
        testing.assert_rel_close(got[0], ref[0], testing.default_tolerance(dtype))
        testing.assert_rel_close(got[1][finite], ref[1][finite], 1e-5, what="lse")
    out_only = mg.triton_merge_attentions_stacked(stacked[0], stacked[1], False, torch.bfloat16)
    assert len(out_only) == 1 and out_only[0].dtype == torch.bfloat16


@quiet_numpy
@pytest.mark.parametrize(
    "case", [(200, (2, 3, 1, 2, 128), torch.float32, True), (37, (2, 2, 1, 3, 40), torch.bfloat16, False)], ids=str
)
def test_triton_stacked_merge_of_many_chunks(case):
    """Split-K decoding's stacked parts, more than a tile's chunks (32 at head dim 128, 64 at 40) and not a multiple
    of them: every chunk counted once, the last block's missing chunks none."""
    n, shape, dtype, noncontiguous = case
    attn, lse = random_chunks(n, shape, dtype, noncontiguous)
    stacked = (torch.stack(attn), torch.stack(lse), True, None)
    got, ref = mg.triton_merge_attentions_stacked(*stacked), mg.merge_attentions_stacked_op.reference(*stacked)
    finite = got[1] > -math.inf
    assert finite.float().mean() > 0.5  # (random_chunks empties the first row of every chunk)
    testing.assert_rel_close(got[0], ref[0], testing.default_tolerance(dtype))
    testing.assert_rel_close(got[1][finite], ref[1][finite], 1e-5, what="lse")


@quiet_numpy
@pytest.mark.parametrize("case", KERNEL_CASES, ids=str)
def test_triton_backward_matches_reference(case):
    n, shape, dtype, noncontiguous = case
    attn, lse = random_chunks(n, shape, dtype, noncontiguous)
    attn = [a.movedim(1, 3) for a in attn]  # the op's [B, G, H, M, K]
    out, merged_lse = mg.merge_attentions_varargs_op.reference(attn, lse, True, None, *shape)
    grad_out = testing.padded_rows(testing.randn(*out.shape, dtype=dtype, device=DEVICE))
    args = (attn, lse, out, merged_lse, grad_out, testing.randn(*merged_lse.shape, device=DEVICE))
    got, ref = (
        mg.triton_merge_attentions_varargs_backward(*args),
        mg.merge_attentions_varargs_backward_op.reference(*args),
    )
    for name, got_list, ref_list in zip(("d attn", "d lse"), got, ref, strict=True):
        for g, r in zip(got_list, ref_list, strict=True):
            assert g.shape == r.shape and g.dtype == r.dtype
            testing.assert_rel_close(g, r, max(testing.default_tolerance(g.dtype), 1e-5), what=name)


# -------------------------------------------------------------------------------------- merge_training


def reference_partial(query, key, value, attn_bias=None, p=0.0, scale=None, *, op=None, output_dtype=None):
    return attention_reference(query, key, value, attn_bias, scale)


def reference_backward(grad, output, lse, query, key, value, attn_bias=None, p=0.0, scale=None, *, op=None):
    """(dq, dk, dv) of BMHK attention in float64 from the given output and LSE, as a fused kernel's backward
    computes them: P = exp(S − lse), dS = P · (dO·Vᵀ − rowsum(dO ∘ O))."""
    q, k, v, g, o = (t.double().transpose(1, 2) for t in (query, key, value, grad, output))
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    scores = q @ k.transpose(-1, -2) * scale
    if attn_bias is not None:
        scores = scores + attn_bias.materialize(scores.shape, dtype=torch.float64, device=scores.device)
    weights = torch.exp(scores - lse.double()[..., None])
    d_scores = weights * (g @ v.transpose(-1, -2) - (g * o).sum(-1, keepdim=True))
    dq, dk, dv = d_scores @ k * scale, d_scores.transpose(-1, -2) @ q * scale, weights.transpose(-1, -2) @ g
    return tuple(t.transpose(1, 2).to(query.dtype) for t in (dq, dk, dv))


@pytest.fixture
def reference_dispatcher(monkeypatch):
    """fmha's partial attention and backward replaced by the float64 references above (merge_training's math
    alone, whatever the state of the dispatcher)."""
    from mslk.attention import fmha

    def backward(ctx, inp, grad, op=None):
        dq, dk, dv = reference_backward(grad, ctx.out, ctx.lse, inp.query, inp.key, inp.value, inp.attn_bias,
                                        scale=inp.scale)  # fmt: skip
        return fmha.Gradients(dq, dk, dv)

    monkeypatch.setattr(fmha, "memory_efficient_attention_partial", reference_partial, raising=False)
    monkeypatch.setattr(fmha, "_memory_efficient_attention_backward", backward, raising=False)


def check_partials_gradients(dtype, tol, rows=slice(None), device="cpu"):
    """Partials over a prefix (no mask) and new keys (causal): gradients of the merged output's `rows` equal
    those of the bottom-right causal attention over all keys, by float64 autograd."""
    q, k, v = (t.requires_grad_() for t in qkv("BMHK", mq=4, mk=11, dtype=dtype, device=device))
    partials = [
        mt.memory_efficient_attention_partial_autograd(q, k[:, :7], v[:, :7]),
        mt.memory_efficient_attention_partial_autograd(q, k[:, 7:], v[:, 7:], ab.LowerTriangularMask()),
    ]
    assert not partials[0].is_bmghk()
    out = mt.merge_attentions_autograd(*(p.apply(lambda x: x[:, rows]) for p in partials))
    grad = testing.randn(*out.shape, dtype=out.dtype, device=device)
    got = torch.autograd.grad(out, (q, k, v), grad)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_out = attention_reference(q64, k64, v64, ab.LowerTriangularFromBottomRightMask())[0][:, rows]
    testing.assert_rel_close(out, ref_out, tol)
    ref = torch.autograd.grad(ref_out, (q64, k64, v64), grad.double())
    for g, r, name in zip(got, ref, ("dq", "dk", "dv"), strict=True):
        testing.assert_rel_close(g, r, tol, what=name)


@pytest.mark.usefixtures("reference_dispatcher")
@pytest.mark.parametrize("rows", [slice(None), slice(1, 3)], ids=["all queries", "Partial.apply slice"])
def test_merge_training_gradients_with_reference_partials(rows):
    check_partials_gradients(torch.float64, 1e-6, rows)  # the partials' LSEs are fp32


@pytest.mark.usefixtures("reference_dispatcher")
def test_merge_training_single_partial_and_errors():
    q, k, v = (t.requires_grad_() for t in qkv("BMGHK", dtype=torch.float64))
    partial = mt.memory_efficient_attention_partial_autograd(q, k, v)
    assert partial.is_bmghk()
    sliced = partial.apply(lambda x: x[:, 1:])
    assert sliced._lse.shape == (2, 2, 3, 4) and sliced._placeholder.shape == sliced._attn.shape
    out = mt.merge_attentions_autograd(partial)
    testing.assert_rel_close(out, attention_reference(q, k, v)[0], 1e-12)
    with pytest.raises(ValueError, match="no partials"):
        mt.merge_attentions_autograd()
    # Merged twice, its backward would get the sum of the merges' outputs and LSEs: refused.
    with pytest.raises(ValueError, match="a Partial is merged once"):
        mt.merge_attentions_autograd(partial)
    other = mt.memory_efficient_attention_partial_autograd(q, k, v)
    with pytest.raises(ValueError, match="a Partial is merged once"):
        mt.merge_attentions_autograd(other, other)


@pytest.mark.parametrize(
    ("device", "dtype", "tol"),
    [("cpu", torch.float64, 1e-6), pytest.param("cuda", torch.float32, 1e-4, marks=pytest.mark.gpu)],
    ids=["cpu", "cuda"],
)
def test_merge_training_bias_gradient(device, dtype, tol):
    """A tensor bias of the partials gets its gradient (it was dropped: None), equal to attention's over all keys
    (float64 reference)."""
    q, k, v = (t.requires_grad_() for t in qkv("BMHK", mq=3, mk=6, dtype=dtype, device=device))
    bias = testing.randn(2, 3, 3, 6, dtype=dtype, device=device).requires_grad_()
    partials = [
        mt.memory_efficient_attention_partial_autograd(q, k[:, a:b], v[:, a:b], bias[..., a:b])
        for a, b in ((0, 2), (2, 6))
    ]
    out = mt.merge_attentions_autograd(*partials)
    grad = testing.randn(*out.shape, dtype=out.dtype, device=device)
    got = torch.autograd.grad(out, (q, k, v, bias), grad)
    inputs = [t.detach().double().requires_grad_() for t in (q, k, v, bias)]
    ref = torch.autograd.grad(attention_reference(*inputs)[0], inputs, grad.double())
    for g, r, name in zip(got, ref, ("dq", "dk", "dv", "dbias"), strict=True):
        testing.assert_rel_close(g, r, tol, what=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_merge_training_with_the_dispatcher(dtype):
    from mslk.attention import fmha

    missing = [n for n in ("memory_efficient_attention_partial", "memory_efficient_attention_backward")
               if not hasattr(fmha, n)]  # fmt: skip
    if missing:
        pytest.skip(f"the fmha dispatcher lacks {', '.join(missing)} (not merged yet)")
    check_partials_gradients(dtype, 1e-5 if dtype == torch.float32 else 2e-2, device=DEVICE)


# ---------------------------------------------------------------------------------------------- unbind


def test_unbind_backward_reuses_shared_storage():
    x = testing.randn(4, 3, 5).requires_grad_()
    parts = unbind(x, 1)
    assert all(torch.equal(p, r) for p, r in zip(parts, x.unbind(1), strict=True))
    packed = testing.randn(4, 3, 5)  # grads that are the slices of one tensor: the stack is that tensor
    (grad,) = torch.autograd.grad(parts, x, list(packed.unbind(1)))
    assert torch.equal(grad, packed) and grad.data_ptr() == packed.data_ptr()
    separate = [testing.randn(4, 5) for _ in range(3)]
    (grad,) = torch.autograd.grad(parts, x, separate)
    assert torch.equal(grad, torch.stack(separate, 1))
    (grad,) = torch.autograd.grad(parts[2].sum(), x)  # unused outputs: zero gradients
    assert torch.equal(grad, torch.stack([torch.zeros(4, 5)] * 2 + [torch.ones(4, 5)], 1))


def test_get_stack_strides_and_stack_or_none():
    base = testing.randn(2, 3, 4)
    assert get_stack_strides(base.unbind(1), 1) == (12, 4, 1)
    assert get_stack_strides(base.unbind(1), -1) == (12, 1, 4)
    assert get_stack_strides(base.unbind(0), 0) == (12, 4, 1)
    assert get_stack_strides(base.unbind(1)[::-1], 1) is None, "reversed order: a negative stride"
    assert get_stack_strides([base[:, 0], base[:, 0]], 1) is None, "the same slice twice overlaps"
    assert get_stack_strides([base[:, 0], testing.randn(2, 4)], 1) is None, "two storages"
    x = base.clone().requires_grad_()
    stacked = stack_or_none(x.unbind(2), 0)
    assert stacked.data_ptr() == x.data_ptr() and torch.equal(stacked, torch.stack(x.unbind(2)))
    (stacked * torch.arange(4.0)[:, None, None]).sum().backward()
    assert torch.equal(x.grad, torch.arange(4.0).expand(2, 3, 4))
    assert stack_or_none([base[0], base[0].clone()], 0) is None


def test_unbind_under_torch_compile():
    def f(x):
        a, b = unbind(x, 0)
        return (a * b).sum()

    x = testing.randn(2, 3).requires_grad_()
    (grad,) = torch.autograd.grad(torch.compile(f, fullgraph=True, backend="aot_eager")(x), x)
    assert torch.equal(grad, x.detach().flip(0))


def test_merging_differentiable_partials_points_to_merge_training():
    """A partial's LSE cannot take a gradient in the attention backward: merging partials made with
    _allow_backward and differentiating raises (instead of dropping the LSE term) and names merge_training."""
    from mslk.attention import fmha

    q, k, v = (testing.randn(1, 6, 2, 16, dtype=torch.float64).requires_grad_() for _ in range(3))
    parts = [fmha.memory_efficient_attention_partial(q, k[:, s], v[:, s], _allow_backward=True) for s in (
        slice(0, 3), slice(3, 6))]  # fmt: skip
    out, _ = merge_attentions([p[0] for p in parts], [p[1] for p in parts])
    with pytest.raises(NotImplementedError, match="merge_training"):
        out.sum().backward()
    # Without the LSE in the graph the partial's own backward still works.
    attn, _ = fmha.memory_efficient_attention_partial(q, k, v, _allow_backward=True)
    attn.sum().backward()
    assert q.grad is not None

    # Compiled, the backward gets zeros for an unused LSE and could not tell: the partial refuses to be traced (the
    # LSE's gradient was dropped, dq 0.67 off). Whole graphs raise; otherwise that frame runs eagerly, as above.
    def merged(q, k, v):
        parts = [fmha.memory_efficient_attention_partial(q, k[:, s], v[:, s], _allow_backward=True)
                 for s in (slice(0, 3), slice(3, 6))]  # fmt: skip
        return merge_attentions([p[0] for p in parts], [p[1] for p in parts])[0]

    torch._dynamo.reset()
    with pytest.raises(Exception, match="partial_autograd"):
        torch.compile(merged, fullgraph=True, backend="aot_eager")(q, k, v)
    with pytest.raises(NotImplementedError, match="merge_training"):
        torch.compile(merged, backend="aot_eager")(q, k, v).sum().backward()
