"""MSLK's Triton flash-attention forward (`triton_flash.FwOp`) against the float64 oracle: every mask it takes,
BMHK / BMGHK / stride-0 GQA, Kv != K, fp32 / fp16 / bf16, custom scale, output dtype, partial (empty keys),
the LSE layouts. T1 on the CPU (interpreter, small shapes), T2 on the GPU (marked gpu)."""

import contextlib
import math
import sys
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mslk.attention import fmha
from mslk.attention.fmha import attn_bias_utils, common, triton_flash, triton_flash_hopper_fwd
from mslk.attention.fmha.common import _BIAS_BY_ID
from mslk.attention.fmha.reference import attention_reference
from mslk.core import testing

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SUPPORTED_IDS = ["None", "T", *[f"B{i:02d}" for i in range(1, 15)], "B18", "B19", "B20"]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _inputs(bias_id, fmt, sizes, dtype, device, kv=None):
    batch, mq, mk, groups, heads, k = sizes
    cls = {"None": None, "T": torch.Tensor}.get(bias_id) or _BIAS_BY_ID.get(bias_id)
    bias = attn_bias_utils.create_attn_bias(cls, batch, heads, groups, mq, mk, device, dtype, False, fmt)
    lead_q, lead_k = (batch, mq), (batch, mk)
    if bias is not None and hasattr(bias, "q_seqinfo"):  # varlen: one batch of all the sequences
        lead_q, lead_k = (1, bias.q_seqinfo.seqstart_py[-1]), (1, bias.k_seqinfo.seqstart_py[-1])
    heads_shape = (groups, heads) if fmt == "BMGHK" else (heads,)
    q = testing.randn(*lead_q, *heads_shape, k, dtype=dtype, device=device)
    key = testing.randn(*lead_k, *heads_shape, k, dtype=dtype, device=device)
    value = testing.randn(*lead_k, *heads_shape, kv or k, dtype=dtype, device=device)
    return q, key, value, bias


def _check(q, k, v, bias, dtype, scale=None, output_dtype=None, reference_bias=None):
    """The Triton forward against the float64 oracle (under reference_bias where given: the mask the kernels should
    see when the op's differs on the host, as a CUDA graph's captured one does)."""
    inp = common.Inputs(q, k, v, bias, scale=scale, output_dtype=output_dtype)
    assert triton_flash.FwOp.not_supported_reasons(inp) == []
    out, ctx = triton_flash.FwOp.apply(inp, needs_gradient=True)
    ref, lse = attention_reference(q.double(), k, v, bias if reference_bias is None else reference_bias, scale)
    assert out.dtype == (output_dtype or dtype) and out.shape == ref.shape
    testing.assert_rel_close(out, ref, TOLERANCE[dtype])
    assert ctx.lse.shape == lse.shape
    finite = torch.isfinite(lse)
    assert torch.equal(finite, torch.isfinite(ctx.lse))  # queries without keys: -inf in both
    torch.testing.assert_close(ctx.lse[finite].double(), lse[finite].double(), atol=1e-3, rtol=0)


@pytest.mark.parametrize("bias_id", SUPPORTED_IDS)
@pytest.mark.parametrize(
    ("fmt", "sizes"),
    [("BMHK", (2, 37, 45, 1, 3, 32)), ("BMGHK", (2, 20, 20, 2, 2, 16)), ("BMHK", (3, 50, 70, 1, 2, 64))],
)
def test_masks_and_layouts(bias_id, fmt, sizes):
    try:
        q, k, v, bias = _inputs(bias_id, fmt, sizes, torch.float32, DEVICE)
    except ValueError:
        pytest.skip("this mask does not exist for these sizes (e.g. more queries than keys bottom-right)")
    _check(q, k, v, bias, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_dtypes_gqa_kv_and_output_dtype(dtype):
    q, k, v, bias = _inputs("B03", "BMHK", (2, 33, 40, 1, 4, 32), dtype, DEVICE, kv=48)
    _check(q, k, v, bias, dtype, scale=0.3)
    _check(q, k, v, bias, dtype, scale=-0.3)  # a negative scale is not folded into the exponent
    _check(q, k, v, bias, dtype, output_dtype=torch.float32)
    # Grouped-query attention: one K/V head expanded over 4 query heads with stride 0 (never copied).
    k1, v1 = k[:, :, :1].expand_as(k), v[:, :, :1].expand_as(v)
    assert k1.stride(2) == 0
    _check(q, k1, v1, None, dtype)


# Tensor bias layouts [B, H, Mq, Mk] and whether the Hopper forward reads them through a TMA descriptor: rows
# padded to 8 elements (what create_attn_bias gives), broadcast over the batch (ALiBi-like) or the heads (stride 0:
# one descriptor element), over the queries (a key-padding bias: pointer loads), rows not 16-byte aligned.
BIAS_LAYOUTS = {"padded": True, "over-batch": True, "over-heads": True, "over-queries": False, "unaligned": False}


def _layout_bias(layout, batch, heads, mq, mk, dtype, device):
    def padded(b, h, m):
        return attn_bias_utils.create_attn_bias(torch.Tensor, b, h, 1, m, mk, device, dtype, False, "BMHK")

    shape = (batch, heads, mq, mk)
    return {
        "padded": lambda: padded(batch, heads, mq),
        "over-batch": lambda: padded(1, heads, mq).expand(shape),
        "over-heads": lambda: padded(batch, 1, mq).expand(shape),
        "over-queries": lambda: padded(batch, heads, 1).expand(shape),
        "unaligned": lambda: testing.randn(*shape[:-1], mk | 1, dtype=dtype, device=device)[..., :mk],
    }[layout]()


def _check_bias_layout(monkeypatch, layout, sizes, dtype, device, mask=None):
    """The forward against the oracle with a tensor bias in `layout` (`mask`: the bias's class, e.g. causal with
    B02), and that it took the bias path expected: on Hopper, where TMA reads the bias, the Gluon forward at its head
    dim and number of keys, else the Triton kernel's bias tiles through a descriptor; pointer loads otherwise."""
    paths = []

    def recorded(*args):
        paths.append("descriptor" if bias_descriptor(*args) is not None else "pointers")
        return bias_descriptor(*args)

    def gluon_recorded(*args):
        paths.append("gluon")
        return gluon_run(*args)

    bias_descriptor, gluon_run = triton_flash._bias_descriptor, triton_flash_hopper_fwd.run
    monkeypatch.setattr(triton_flash, "_bias_descriptor", recorded)
    monkeypatch.setattr(triton_flash_hopper_fwd, "run", gluon_recorded)
    batch, mq, mk, _, heads, head_dim = sizes
    q, k, v, _ = _inputs("None", "BMHK", sizes, dtype, device)
    bias = _layout_bias(layout, batch, heads, mq, mk, dtype, device)
    _check(q, k, v, bias if mask is None else mask(bias), dtype)
    path = "pointers"
    if BIAS_LAYOUTS[layout] and triton_flash._tma_readable(k, v):
        gluon = head_dim in triton_flash_hopper_fwd.HEAD_DIMS and mk >= triton_flash._GLUON_FORWARD_MIN_KEYS
        path = "gluon" if gluon else "descriptor"
    assert paths == [path]


@pytest.mark.skipif(DEVICE != "cpu", reason="the GPU tests run this path for real")
@pytest.mark.parametrize("bias_id", ["T", "B03", *BIAS_LAYOUTS])
def test_tma_forward_path_with_a_bias(monkeypatch, bias_id):
    """The forward's TMA path (K and V tiles through tensor descriptors, Hopper's) on the Hopper tiles it takes with
    a tensor bias, 128 queries by 64 keys, under the interpreter: partial query and key blocks, Mq != Mk; tensor
    biases in each layout, through their own descriptor where TMA reads them."""
    monkeypatch.setattr(triton_flash, "_tma_readable", lambda *tensors: True)
    tiles = triton_flash._tiles

    def hopper_forward_tiles(q, head_block, kind, tma=False, *args):
        return (128, 64, 8, 3) if kind == "fwd" and tma else tiles(q, head_block, kind, tma, *args)

    monkeypatch.setattr(triton_flash, "_tiles", hopper_forward_tiles)
    sizes = (2, 200, 150, 1, 2, 64)
    if bias_id in BIAS_LAYOUTS:
        _check_bias_layout(monkeypatch, bias_id, sizes, torch.float16, DEVICE)
    else:
        _check(*_inputs(bias_id, "BMHK", sizes, torch.float16, DEVICE), torch.float16)


def test_empty_keys_give_zero_and_minus_inf():
    q = testing.randn(1, 5, 2, 16, device=DEVICE)
    k = torch.empty(1, 0, 2, 16, device=DEVICE)
    out, ctx = triton_flash.FwOp.apply(common.Inputs(q, k, k, is_partial=True), needs_gradient=True)
    assert (out == 0).all() and (ctx.lse == -torch.inf).all()


@pytest.mark.parametrize(
    ("device", "dtype"), [(DEVICE, torch.float32), pytest.param("cuda", torch.bfloat16, marks=pytest.mark.gpu)]
)
def test_queries_that_see_no_key(device, dtype):
    """Bottom-right causal with more queries than keys: the first query blocks see no key at all (output 0, LSE
    −inf), and no program walks key blocks outside the keys (whole blocks of them, several in a row)."""
    q, k, v, bias = _inputs("B03", "BMHK", (2, 300, 40, 1, 2, 64), dtype, device)
    _check(q, k, v, bias, dtype)


def test_pinned_through_memory_efficient_attention():
    q, k, v, bias = _inputs("B07", "BMHK", (2, 20, 20, 1, 2, 32), torch.float32, DEVICE)
    out = fmha.memory_efficient_attention(q, k, v, bias, op=fmha.MemoryEfficientAttentionMslkTritonOp)
    testing.assert_rel_close(out, attention_reference(q.double(), k, v, bias)[0], 1e-5)
    assert triton_flash.FwOp in fmha.ALL_FW_OPS


def test_an_output_of_another_dtype_and_its_gradient():
    """The backward kernels multiply in the inputs' dtype: an fp32 output (a partial's, or output_dtype's) and its
    gradient are cast to it (they once reached the kernel as they were and failed inside; output_dtype with a
    gradient was refused by every backward)."""
    pinned = fmha.MemoryEfficientAttentionMslkTritonOp
    q, k, v = (testing.randn(1, 5, 2, 16, dtype=torch.float16, device=DEVICE).requires_grad_() for _ in "qkv")
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = attention_reference(q64, k64, v64)[0]
    do = testing.randn(*ref.shape, device=DEVICE)
    ref.backward(do.double())
    calls = [lambda: fmha.memory_efficient_attention_partial(q, k, v, op=pinned, _allow_backward=True)[0]]
    calls += [lambda op=op: fmha.memory_efficient_attention(q, k, v, op=op, output_dtype=torch.float32)
              for op in (pinned, None)]  # fmt: skip
    for call in calls:
        q.grad = k.grad = v.grad = None
        out = call()
        assert out.dtype == torch.float32
        testing.assert_rel_close(out, ref, TOLERANCE[torch.float16])
        out.backward(do)
        for got, want in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
            assert got.dtype == torch.float16
            testing.assert_rel_close(got, want, TOLERANCE[torch.float16])
    out, lse = fmha.memory_efficient_attention_forward_requires_grad(q.detach(), k.detach(), v.detach(), op=pinned[0])
    grads = fmha.memory_efficient_attention_backward(do, out.float(), lse, q, k, v, op=pinned[1])
    for got, want in zip(grads, (q64.grad, k64.grad, v64.grad), strict=True):
        testing.assert_rel_close(got, want, TOLERANCE[torch.float16])


@pytest.mark.gpu
@pytest.mark.parametrize("bias_id", ["None", "T", "B01", "B03", "B07", "B12", "B19"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_gpu(bias_id, dtype, head_dim):
    q, k, v, bias = _inputs(bias_id, "BMHK", (2, 300, 513, 1, 4, head_dim), dtype, "cuda")
    _check(q, k, v, bias, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("mask", [None, fmha.attn_bias.LowerTriangularMaskWithTensorBias], ids=["T", "B02"])
@pytest.mark.parametrize("layout", BIAS_LAYOUTS)
@pytest.mark.parametrize(("head_dim", "keys"), [(64, 513), (128, 513), (128, 1000), (128, 300), (256, 513)])
def test_gpu_bias_layouts(monkeypatch, layout, head_dim, keys, mask):
    """Tensor biases in every layout on the GPU, alone and under a causal mask (Hopper: the Gluon forward at head
    dim 128 from 512 keys, the Triton kernel's bias tiles through a descriptor below, where TMA reads them)."""
    _check_bias_layout(monkeypatch, layout, (2, 300, keys, 1, 4, head_dim), torch.bfloat16, "cuda", mask)


BACKWARD_IDS = ["None", "T", *[f"B{i:02d}" for i in range(1, 15)]]


@contextlib.contextmanager
def _poisoned_allocations():
    """torch.empty gives NaN-filled floating tensors: a gradient row that no kernel writes and nothing zeroes (rows
    outside every varlen sequence, dQ's fp32 sum) shows instead of reading whatever memory held."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    with mock.patch.object(torch, "empty", poisoned):
        yield


def _check_backward(q, k, v, bias, tolerance, bias_grad=True, reference_bias=None, kv_grads_summed=False):
    """The Triton backward from the Triton forward's output and LSE, against float64 autograd of the oracle
    (a tensor bias gets its gradient too, unless not bias_grad; reference_bias as in _check); the backward's
    allocations poisoned. kv_grads_summed: K/V expanded over the heads get dK/dV of one head, the heads' sum."""
    dtype = q.dtype
    dense = common.tensor_bias(bias)
    if dense is not None:
        dense.requires_grad_(bias_grad)
    inp = common.Inputs(q, k, v, bias, kv_grads_summed=kv_grads_summed)
    out, ctx = triton_flash.FwOp.apply(inp, needs_gradient=True)
    do = testing.randn(*out.shape, dtype=dtype, device=q.device)
    with _poisoned_allocations():
        grads = triton_flash.BwOp.apply(ctx, inp, do)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    bias64 = bias if reference_bias is None else reference_bias
    if dense is not None:
        dense64 = dense.detach().double().requires_grad_()
        bias64 = dense64 if isinstance(bias, torch.Tensor) else type(bias)(dense64)
    ref, _ = attention_reference(q64, k64, v64, bias64)
    ref.backward(do.double())
    dk64, dv64 = (t.grad.sum(-2, keepdim=True) if kv_grads_summed else t.grad for t in (k64, v64))
    pairs = [("dq", grads.dq, q64.grad), ("dk", grads.dk, dk64), ("dv", grads.dv, dv64)]
    if dense is not None and bias_grad:
        pairs.append(("db", grads.db, dense64.grad))
    else:
        assert grads.db is None
    for name, got, want in pairs:
        assert got.dtype == (dtype if name != "db" else dense.dtype) and got.shape == want.shape, name
        testing.assert_rel_close(got, want, tolerance, what=name)


@pytest.mark.parametrize("mq", [6, 9])  # more queries than keys too (a negative bottom-right shift)
@pytest.mark.parametrize(
    "mask",
    [
        fmha.attn_bias.LocalAttentionFromBottomRightMask(100, sys.maxsize),
        fmha.attn_bias.LocalAttentionFromBottomRightMask(sys.maxsize, 2**31 - 1),
        fmha.attn_bias.LowerTriangularFromBottomRightLocalAttentionMask(sys.maxsize),
    ],
    ids=["right_unbounded", "both_unbounded", "causal_left_unbounded"],
)
def test_unbounded_windows(mask, mq):
    """A window wider than every row (sys.maxsize as "unbounded") reaches every key: it once overflowed the
    kernels' 32-bit key ranges (zeros and an LSE of -inf, or a failed launch)."""
    q = testing.randn(1, mq, 2, 16, device=DEVICE)
    k, v = (testing.randn(1, 7, 2, 16, device=DEVICE) for _ in "kv")
    _check(q, k, v, mask, torch.float32)
    _check_backward(q, k, v, mask, TOLERANCE[torch.float32])


@pytest.fixture(params=[False, True], ids=["atomic_dq", "deterministic"])
def backward_mode(request):
    """Both backwards: one pass with dQ summed by atomics, and two passes under torch.use_deterministic_algorithms."""
    saved = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(request.param)
    yield request.param
    torch.use_deterministic_algorithms(saved)


@pytest.mark.parametrize(
    ("device", "dtype"), [(DEVICE, torch.float32), pytest.param("cuda", torch.bfloat16, marks=pytest.mark.gpu)]
)
@pytest.mark.parametrize("bias_id", ["T", "B02"])
def test_backward_of_queries_a_bias_masks_whole(bias_id, device, dtype, backward_mode):
    """Queries whose every score a tensor bias makes −inf (LSE −inf, output 0) get no gradient and give none, where
    exp2(s − LSE) was NaN in unmasked blocks (every gradient NaN through the shared keys)."""
    q, k, v, bias = _inputs(bias_id, "BMHK", (2, 70, 90, 1, 2, 64), dtype, device)
    dense = common.tensor_bias(bias)
    with torch.no_grad():
        dense[1, 0, 5] = dense[0, 1, :3] = dense[0, 1, 64] = -torch.inf  # in the first and second query blocks
    _check_backward(q, k, v, bias, 1e-5 if dtype == torch.float32 else 3e-2)


@pytest.mark.parametrize("bias_id", BACKWARD_IDS)
@pytest.mark.parametrize(("fmt", "sizes"), [("BMHK", (2, 37, 45, 1, 3, 32)), ("BMGHK", (2, 20, 20, 2, 2, 16))])
def test_backward(bias_id, fmt, sizes, backward_mode):
    q, k, v, bias = _inputs(bias_id, fmt, sizes, torch.float32, DEVICE, kv=24 if fmt == "BMHK" else None)
    _check_backward(q, k, v, bias, 1e-5)


def test_heads_in_a_narrower_last_section(backward_mode):
    """3 heads of 2 blocks each (forward, dQ and dK/dV passes alike): the interpreter's schedule takes heads in
    sections of 2, the last one of a single head, whose programs must still cover both of its blocks."""
    q, k, v, bias = _inputs("B01", "BMHK", (1, 50, 45, 1, 3, 32), torch.float32, DEVICE)
    if DEVICE == "cpu":
        assert triton_flash._heads_per_section(2, q.device) == 2
    _check(q, k, v, bias, torch.float32)
    _check_backward(q, k, v, bias, 1e-5)


@pytest.mark.parametrize("bias_id", ["None", "B03"])
@pytest.mark.parametrize(("mq", "mk", "head_dim"), [(1, 7, 80), (129, 130, 96), (129, 129, 80), (7, 129, 96)])
def test_odd_head_dims_and_lengths(bias_id, mq, mk, head_dim):
    """Head dims that are not powers of two (the tiles are padded, the padding masked) and lengths of 1, 7 and
    129 (a partial block), forward and backward (every query sees a key: the oracle's gradient of a query
    without keys is NaN)."""
    q, k, v, bias = _inputs(bias_id, "BMHK", (1, mq, mk, 1, 2, head_dim), torch.float32, DEVICE)
    _check(q, k, v, bias, torch.float32)
    _check_backward(q, k, v, bias, 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("bias_id", ["None", "B01", "B03"])
@pytest.mark.parametrize("head_dim", [32, 80, 96])
@pytest.mark.parametrize(("mq", "mk"), [(1, 1000), (7, 129), (129, 1000), (1000, 1000)])
def test_odd_head_dims_and_lengths_gpu(bias_id, head_dim, mq, mk):
    q, k, v, bias = _inputs(bias_id, "BMHK", (2, mq, mk, 1, 4, head_dim), torch.bfloat16, "cuda")
    _check(q, k, v, bias, torch.bfloat16)
    _check_backward(q, k, v, bias, 3e-2)


def test_backward_through_memory_efficient_attention_and_gqa():
    q, k, v, bias = _inputs("B07", "BMHK", (2, 20, 20, 1, 4, 32), torch.float32, DEVICE)
    k1, v1 = (t[:, :, :1].expand_as(t).detach().requires_grad_() for t in (k, v))  # GQA: stride-0 heads
    q.requires_grad_()
    out = fmha.memory_efficient_attention(q, k1, v1, bias, op=fmha.MemoryEfficientAttentionMslkTritonOp)
    do = testing.randn(*out.shape, device=DEVICE)
    out.backward(do)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k1, v1))
    ref, _ = attention_reference(q64, k64.expand_as(k), v64.expand_as(v), bias)
    ref.backward(do.double())
    for got, want in ((q.grad, q64.grad), (k1.grad, k64.grad), (v1.grad, v64.grad)):
        testing.assert_rel_close(got, want, 1e-5)


@pytest.mark.parametrize("bias_id", ["None", "T", "B07"])
def test_backward_kv_grads_summed(bias_id, backward_mode):
    """GQA whose dK and dV autograd takes a K/V head (Inputs.kv_grads_summed): the backward takes one K/V head a group
    (kv_heads) and returns dK and dV of that head, the sums over the group's query heads."""
    q, k, v, bias = _inputs(bias_id, "BMGHK", (2, 20, 33, 2, 3, 16), torch.float32, DEVICE)
    k, v = (t[..., :1, :].contiguous().expand(*t.shape) for t in (k, v))
    _check_backward(q, k, v, bias, 1e-5, kv_grads_summed=True)


@pytest.mark.parametrize("operand", ["query", "key", "value"])
def test_operands_not_contiguous_along_the_head_dim(operand):
    """A column-major Q, K or V (head dim not the fastest), and the gradient of `out.sum()` (expanded: all strides
    0): the kernels read rows of unit stride, so these are copied first; they were read as unit-stride rows."""
    dtype = torch.float16 if DEVICE == "cuda" else torch.float32
    q, k, v, bias = _inputs("B03", "BMHK", (2, 37, 45, 1, 3, 64), dtype, DEVICE)
    operands = {"query": q, "key": k, "value": v}
    operands[operand] = operands[operand].mT.contiguous().mT.requires_grad_()
    assert operands[operand].stride(-1) != 1
    out = fmha.memory_efficient_attention(*operands.values(), bias, op=fmha.MemoryEfficientAttentionMslkTritonOp)
    out.sum().backward()
    leaves = [t.detach().double().requires_grad_() for t in operands.values()]
    ref, _ = attention_reference(*leaves, bias)
    ref.sum().backward()
    testing.assert_rel_close(out, ref, TOLERANCE[dtype])
    testing.assert_rel_close(operands[operand].grad, leaves[list(operands).index(operand)].grad, 10 * TOLERANCE[dtype])


_RELAYOUTS = {
    "contiguous": lambda t: t,
    "column-major": lambda t: t.mT.contiguous().mT,
    "padded rows": testing.padded_rows,
    "heads first": lambda t: t.movedim(1, -2).contiguous().movedim(-2, 1),  # [B, (G,) H, M, K] storage
}


def _close_where_finite(got, want, tol, what):
    """Relative error over the reference's finite elements (the oracle's gradient of a query without keys is NaN),
    against at least 0.01 per element (the inputs are of order 1): a gradient that is 0 in exact arithmetic (one key
    per query) is rounding noise in any kernel."""
    finite = torch.isfinite(want)
    diff = (got.double()[finite] - want[finite]).norm().item()
    norm = max(want[finite].norm().item(), 0.01 * finite.sum().item() ** 0.5)
    assert diff <= tol * norm, f"{what}: relative error {diff / norm:.3g} > {tol}"


@settings(deadline=None, max_examples=20 if DEVICE == "cpu" else 60, derandomize=True)
@given(data=st.data())
def test_random_masks_layouts_and_gradients(data):
    """Random masks, sizes, head dims, memory layouts of Q, K and V (stride-0 GQA too), scales and output gradients
    (random, column-major, or the expanded one of `out.sum()`) through memory_efficient_attention pinned to the
    Triton ops, forward and backward against float64 autograd of the oracle."""
    draw = data.draw
    bias_id, fmt = draw(st.sampled_from(BACKWARD_IDS)), draw(st.sampled_from(["BMHK", "BMGHK"]))
    sizes = (
        draw(st.integers(1, 3)), draw(st.sampled_from([1, 6, 17, 40])), draw(st.sampled_from([1, 7, 17, 45])),
        draw(st.integers(1, 2)) if fmt == "BMGHK" else 1, draw(st.integers(1, 3)), draw(st.sampled_from([8, 24, 32])),
    )  # fmt: skip
    dtype = torch.float32 if DEVICE == "cpu" else draw(st.sampled_from([torch.float16, torch.bfloat16]))
    try:
        q, k, v, bias = _inputs(bias_id, fmt, sizes, dtype, DEVICE, kv=draw(st.sampled_from([None, 16])))
    except ValueError:
        return  # no such mask for these sizes (e.g. more queries than keys bottom-right)
    if fmt == "BMGHK" and draw(st.booleans()):  # GQA: one K/V head per group, expanded with stride 0
        k, v = (t[..., :1, :].expand(t.shape) for t in (k, v))
    else:
        k, v = (_RELAYOUTS[draw(st.sampled_from(list(_RELAYOUTS)))](t) for t in (k, v))
    q = _RELAYOUTS[draw(st.sampled_from(list(_RELAYOUTS)))](q)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    scale, gradient = draw(st.sampled_from([None, 0.3])), draw(st.sampled_from(["random", "column-major", "sum"]))
    out = fmha.memory_efficient_attention(q, k, v, bias, scale=scale, op=fmha.MemoryEfficientAttentionMslkTritonOp)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, _ = attention_reference(*leaves, bias, scale)
    _close_where_finite(out, ref.detach(), TOLERANCE[dtype], "out")
    grad = testing.randn(*out.shape, dtype=dtype, device=DEVICE)
    if gradient == "sum":  # what autograd passes for out.sum(): one element, all strides 0
        grad = torch.ones((), dtype=dtype, device=DEVICE).expand(out.shape)
    elif gradient == "column-major":
        grad = grad.mT.contiguous().mT
    out.backward(grad)
    ref.backward(grad.double())
    for name, got, want in zip(("dq", "dk", "dv"), (q, k, v), leaves, strict=True):
        _close_where_finite(got.grad, want.grad, 10 * TOLERANCE[dtype], name)


def test_offsets_past_int32_take_the_wide_path(monkeypatch, backward_mode):
    """The backward computes head offsets in int32 unless a tensor's elements reach 2**31 past its start
    (`_past_int32`, checked on meta tensors); its int64 path gives the same gradients here (the GPU tests past 2**31
    elements take it for real)."""
    meta = {"device": "meta"}
    assert triton_flash._past_int32(None, torch.empty(2, 3, **meta), torch.empty(1, 16, 16384, 16384, **meta))
    assert triton_flash._past_int32(torch.empty(2**31 + 1, **meta))
    assert not triton_flash._past_int32(torch.empty(2**31, **meta), torch.empty(1, **meta).expand(2**40))
    q, k, v, bias = _inputs("T", "BMGHK", (2, 20, 20, 2, 2, 16), torch.float32, DEVICE)
    monkeypatch.setattr(triton_flash, "_past_int32", lambda *tensors: True)
    _check_backward(q, k, v, bias, 1e-5)


def test_flat_rows_of_the_2d_descriptors():
    """The backward's 2D TMA descriptors read [B, M, G, H, K] as [B·M, G·H·K]: contiguous tensors and Q/K/V
    unbound from one packed [B, M, 3, H, K] tensor qualify; a [B, H, M, K] tensor transposed to BMHK and
    stride-0 expanded heads do not (they take the pointer path)."""
    x = torch.empty(2, 5, 3, 4, 8)
    assert triton_flash._flat_rows(x)
    assert triton_flash._flat_rows(triton_flash._bmghk(x[:, :, 0]))
    assert triton_flash._flat_rows(torch.empty(1, 5, 2, 4, 8)[:, 1:])  # B = 1: the batch stride is free
    assert not triton_flash._flat_rows(triton_flash._bmghk(torch.empty(2, 4, 5, 8).transpose(1, 2)))
    assert not triton_flash._flat_rows(triton_flash._bmghk(torch.empty(2, 5, 1, 8).expand(2, 5, 4, 8)))


def test_backward_declines_gappy_keys():
    q, k, v, bias = _inputs("B18", "BMHK", (2, 20, 30, 1, 2, 16), torch.float32, DEVICE)
    reasons = triton_flash.BwOp.not_supported_reasons(common.Inputs(q, k, v, bias))
    assert any("attn_bias type" in reason for reason in reasons)


@pytest.mark.gpu
@pytest.mark.parametrize("bias_id", ["None", "T", "B01", "B03", "B07", "B12"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_backward_gpu(bias_id, dtype, head_dim, backward_mode):
    q, k, v, bias = _inputs(bias_id, "BMHK", (2, 300, 513, 1, 4, head_dim), dtype, "cuda")
    _check_backward(q, k, v, bias, {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype])


# The Gluon kernels' sizes (head dim 128): partial query and key blocks, Mq != Mk, groups.
_HOPPER_SIZES = [
    ("BMHK", (2, 1000, 1000, 1, 3, 128)),
    ("BMHK", (1, 7, 129, 1, 2, 128)),
    ("BMHK", (3, 129, 200, 1, 2, 128)),
    ("BMGHK", (2, 300, 513, 2, 2, 128)),
]


@pytest.fixture
def gluon_backward_runs(monkeypatch):
    """The launches of the Gluon backward (triton_flash_hopper.run), their arguments by name; sm_90 only."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm_90 only")
    import inspect

    from mslk.attention.fmha import triton_flash_hopper

    runs = []
    run = triton_flash_hopper.run

    def recorded_run(*args):
        runs.append(inspect.signature(run).bind(*args).arguments)
        run(*args)

    monkeypatch.setattr(triton_flash_hopper, "run", recorded_run)
    return runs


@pytest.mark.gpu
@pytest.mark.parametrize("bias_id", ["None", "B01", "B03", "B04", "B05"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    ("fmt", "sizes"),
    [
        *_HOPPER_SIZES,
        ("BMHK", (1, 2048, 2048, 1, 2, 128)),
        ("BMHK", (3, 129, 200, 1, 2, 64)),
        ("BMGHK", (2, 300, 513, 2, 2, 64)),
    ],
)
def test_hopper_backward_gpu(bias_id, dtype, fmt, sizes, gluon_backward_runs):
    """The Gluon backward (triton_flash_hopper) where BwOp takes it: masks of one sequence, lengths of partial
    blocks and key blocks past the keys, Mq != Mk, groups, many query blocks (the ring's slots turn over)."""
    q, k, v, bias = _inputs(bias_id, fmt, sizes, dtype, "cuda")
    _check_backward(q, k, v, bias, {torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype])
    assert gluon_backward_runs


@pytest.mark.gpu
@pytest.mark.parametrize("sliced", [False, True], ids=["own-heads", "sliced"])
@pytest.mark.parametrize("bias_id", ["None", "B01", "B04", "B07"])
@pytest.mark.parametrize(("fmt", "sizes"), [("BMGHK", (2, 300, 513, 2, 3, 128)), ("BMHK", (1, 1000, 1000, 1, 4, 64))])
def test_hopper_backward_gqa_gpu(sliced, bias_id, fmt, sizes, gluon_backward_runs):
    """The Gluon backward with K/V expanded over the heads with stride 0 (GQA and MQA): the group's query heads read
    its one K/V head through TMA; dK and dV are still a query head's (their sum is autograd's or _fMHA's). K/V heads
    of their own tensor ([B, M, G, 1, K] expanded), or sliced from a wider one: over several groups those heads are
    no rows of one [B·M, G·K] matrix, and the Triton kernel serves them."""
    q, k, v, bias = _inputs(bias_id, fmt, sizes, torch.bfloat16, "cuda")
    k, v = (t[..., :1, :] if sliced else t[..., :1, :].contiguous() for t in (k, v))
    k, v = (t.expand(*t.shape[:-2], q.shape[-2], t.shape[-1]) for t in (k, v))
    _check_backward(q, k, v, bias, 3e-2)
    assert len(gluon_backward_runs) == (0 if sliced and fmt == "BMGHK" else 1)


@pytest.mark.parametrize(
    ("shape", "sequences", "loops"),
    [((4, 4096, 8, 4), None, True), ((1, 8192, 8, 4), None, False), ((4, 4096, 8, 8), None, False),
     ((2, 4096, 16, 2), None, True), ((1, 16384, 8, 4), (32, 512), True), ((1, 4096, 8, 4), (16, 256), False)],
)  # fmt: skip
def test_head_loop_choice(shape, sequences, loops, monkeypatch):
    """The Gluon backward sums a group's query heads in a program with at least h waves of its programs (key blocks
    x sequences x groups >= h x SMs: where RESULTS.md's H100 measurements found it faster), never with a tensor
    bias. [B, M, G, h] with K/V expanded over h; varlen: (sequences, longest)."""
    from mslk.attention.fmha import triton_flash_hopper

    monkeypatch.setattr(triton_flash_hopper.arch, "sm_count", lambda device: 132)
    b, m, g, h = shape
    k = torch.empty(b, m, g, 1, 64, device="meta").expand(b, m, g, h, 64)
    varlen = None if sequences is None else SimpleNamespace(num_sequences=sequences[0], max_seqlen_k=sequences[1])
    assert triton_flash_hopper.sums_heads(k, None, varlen) is loops
    assert not triton_flash_hopper.sums_heads(k, torch.empty(0), varlen)


@pytest.mark.gpu
@pytest.mark.parametrize("head_loop", [True, False], ids=["kernel-sums", "torch-sums"])
@pytest.mark.parametrize("bias_id", ["None", "B01", "B04", "B07"])
@pytest.mark.parametrize(("fmt", "sizes"), [("BMGHK", (2, 300, 513, 2, 3, 128)), ("BMHK", (1, 1000, 1000, 1, 4, 64))])
def test_hopper_backward_gqa_summed_gpu(head_loop, bias_id, fmt, sizes, gluon_backward_runs, monkeypatch):
    """GQA whose dK and dV autograd takes a K/V head (Inputs.kv_grads_summed): the Gluon backward sums the group's
    query heads in a program (kernel-sums: dK and dV of one head written), or a program a head and torch sums them
    (torch-sums: too few programs, HEAD_LOOP_MIN_WAVES; a tensor bias always, test_backward_kv_grads_summed)."""
    from mslk.attention.fmha import triton_flash_hopper

    monkeypatch.setattr(triton_flash_hopper, "HEAD_LOOP_MIN_WAVES", 0 if head_loop else math.inf)
    q, k, v, bias = _inputs(bias_id, fmt, sizes, torch.bfloat16, "cuda")
    k, v = (t[..., :1, :].contiguous().expand(*t.shape) for t in (k, v))
    _check_backward(q, k, v, bias, 3e-2, bias_grad=False, kv_grads_summed=True)
    [run] = gluon_backward_runs
    assert run["dk"].shape[3] == (1 if head_loop else q.shape[-2])


@pytest.mark.gpu
@pytest.mark.parametrize("layout", [*BIAS_LAYOUTS, "masked-rows", "B02"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_hopper_backward_bias_gpu(layout, head_dim, gluon_backward_runs):
    """The Gluon backward with a tensor bias that needs no gradient, where TMA reads it (its tiles through the ring,
    one dQ slot at head dim 128): every layout of the forward's tests, queries the bias masks whole (their LSE
    −inf, in unmasked blocks), a causal mask with a bias (B02); the Triton kernel takes the other layouts."""
    sizes = (2, 300, 513, 1, 4, head_dim)
    if layout == "B02":
        q, k, v, bias = _inputs("B02", "BMHK", sizes, torch.bfloat16, "cuda")
    else:
        q, k, v, _ = _inputs("None", "BMHK", sizes, torch.bfloat16, "cuda")
        bias = _layout_bias("padded" if layout == "masked-rows" else layout, 2, 4, 300, 513, torch.bfloat16, "cuda")
        if layout == "masked-rows":
            bias[1, 0, 5] = bias[0, 3, 64:70] = -torch.inf
    _check_backward(q, k, v, bias, 3e-2, bias_grad=False)
    assert bool(gluon_backward_runs) == BIAS_LAYOUTS.get(layout, True)


@pytest.mark.gpu
@pytest.mark.parametrize("bias_id", ["B06", "B07", "B08", "B09", "B10"])
@pytest.mark.parametrize(
    ("fmt", "sizes"),
    [
        ("BMHK", (5, 300, 513, 1, 2, 128)),
        ("BMGHK", (3, 129, 200, 2, 2, 64)),
        ("BMHK", (2, 1000, 1000, 1, 3, 128)),
        ("BMHK", (3, 2, 100, 1, 1, 64)),
    ],
)
def test_hopper_backward_varlen_gpu(bias_id, fmt, sizes, gluon_backward_runs):
    """The Gluon backward on varlen masks without padded keys: ragged sequences packed in one batch element, key
    blocks that reach into the next sequence (their dK and dV rows stored from registers), query blocks that do;
    one head and 6 queries in all, whose LSE and delta rows TMA reads from a padded copy (it failed on the
    stride: "strides must be 16-byte aligned")."""
    q, k, v, bias = _inputs(bias_id, fmt, sizes, torch.bfloat16, "cuda")
    _check_backward(q, k, v, bias, 3e-2)
    assert [run["varlen"] is not None for run in gluon_backward_runs] == [True]


@pytest.mark.parametrize(
    ("device", "dtype", "head_dim", "scale"),
    [
        pytest.param(DEVICE, torch.float32, 32, 0.1, id="fp32"),
        pytest.param("cuda", torch.bfloat16, 128, 1, marks=pytest.mark.gpu, id="gluon"),
        pytest.param("cuda", torch.bfloat16, 256, 1, marks=pytest.mark.gpu, id="triton"),
    ],
)
@pytest.mark.parametrize("bottom_right", [False, True], ids=["B07", "B08"])
def test_varlen_rows_past_the_last_sequence(bottom_right, device, dtype, head_dim, scale):
    """A varlen mask updated in place to fewer rows (a CUDA graph's buffers): the rows past its last sequence hold
    NaN, which no output or gradient inside the sequences may see (tiles that reach past a sequence read them on
    Hopper's TMA paths); the gradients of those rows are zero (the backward's allocations poisoned)."""

    def causal(lengths):
        mask = fmha.attn_bias.BlockDiagonalMask.from_seqlens(lengths, device=device)
        return mask.make_causal_from_bottomright() if bottom_right else mask.make_causal()

    full, lengths = [int(n * scale) for n in (300, 200, 130)], [int(n * scale) for n in (300, 177, 60)]
    q, k, v = (testing.randn(1, sum(full), 2, head_dim, dtype=dtype, device=device) for _ in range(3))
    mask = causal(full)
    mask.q_seqinfo.from_seqlens_inplace(lengths)
    mask.k_seqinfo.from_seqlens_inplace(lengths)
    used = sum(lengths)
    for t in (q, k, v):
        t[:, used:] = float("nan")
    inp = common.Inputs(q, k, v, mask)
    out, ctx = triton_flash.FwOp.apply(inp, needs_gradient=True)
    do = testing.randn(*out.shape, dtype=dtype, device=device)
    do[:, used:] = float("nan")
    with _poisoned_allocations():
        grads = triton_flash.BwOp.apply(ctx, inp, do)
    q64, k64, v64 = (t[:, :used].detach().double().requires_grad_() for t in (q, k, v))
    ref, _ = attention_reference(q64, k64, v64, causal(lengths))
    ref.backward(do[:, :used].double())
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    testing.assert_rel_close(out[:, :used], ref, TOLERANCE[dtype], what="out")
    for name, got, want in (("dq", grads.dq, q64.grad), ("dk", grads.dk, k64.grad), ("dv", grads.dv, v64.grad)):
        testing.assert_rel_close(got[:, :used], want, tolerance, what=name)
        assert (got[:, used:] == 0).all(), name


def test_padded_keys_grown_past_the_captured_longest(backward_mode):
    """A CUDA graph replays the launches with the host values of its capture: padded keys grown in place past the
    longest of the capture (up to the padding, as a KV cache's) must still get their share of the products and
    their gradients. Emulated without a graph: the device lengths grow, the host's max_seqlen stays."""
    ab = fmha.attn_bias
    mask = ab.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens([3, 5], 40, [5, 20], device=DEVICE)
    grown = [40, 33]
    mask.k_seqinfo.seqlen.copy_(torch.tensor(grown))  # what from_seqlens_padded_inplace writes to the device
    fresh = ab.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens([3, 5], 40, grown, device=DEVICE)
    q = testing.randn(1, 8, 2, 16, device=DEVICE)
    k, v = (testing.randn(1, 80, 2, 16, device=DEVICE) for _ in "kv")
    _check(q, k, v, mask, torch.float32, reference_bias=fresh)
    _check_backward(q, k, v, mask, TOLERANCE[torch.float32], reference_bias=fresh)


# Captured (query, key) lengths, then in-place updates: ragged, empty and one-row sequences, each at most the captured
# longest, but B12's keys, which grow up to the 320-row padding past the captured longest, as a KV cache does.
_GRAPH_LENGTHS = {
    "B07": ([130, 200, 300], [300, 200, 130], [([60, 0, 299], [1, 177, 130]), ([130, 1, 17], [300, 0, 60])]),
    # Equal at capture (FA2 would serve them, bottom-right causal), not after.
    "B07=": ([130, 200, 300], [130, 200, 300], [([60, 0, 299], [1, 177, 130]), ([130, 1, 17], [300, 0, 60])]),
    "B08": ([100, 50, 130], [300, 200, 130], [([60, 1, 0], [200, 177, 60]), ([100, 50, 30], [100, 64, 129])]),
    "B12": ([1, 64, 60], [130, 100, 64], [([1, 0, 50], [320, 1, 60]), ([17, 64, 1], [17, 300, 1])]),
}


def _graph_mask(bias_id, q_lengths, k_lengths):
    if bias_id == "B12":
        return fmha.attn_bias.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens(
            q_lengths, 320, k_lengths, device="cuda"
        )
    ab = fmha.attn_bias
    cls = ab.BlockDiagonalCausalMask if bias_id.startswith("B07") else ab.BlockDiagonalCausalFromBottomRightMask
    return cls.from_seqlens(q_lengths, k_lengths, device="cuda")


def _captured(step):
    """step run once on a side stream (compiling the kernels, warming the allocator outside the capture), then
    captured in a CUDA graph with poisoned allocations: (the graph, what the captured step returned)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with _poisoned_allocations(), torch.cuda.graph(graph):
        result = step()
    return graph, result


@pytest.mark.gpu
@pytest.mark.parametrize("op", [fmha.MemoryEfficientAttentionMslkTritonOp, None], ids=["pinned", "dispatched"])
@pytest.mark.parametrize("head_dim", [128, 256], ids=["gluon", "triton"])
@pytest.mark.parametrize("bias_id", sorted(_GRAPH_LENGTHS))
def test_cuda_graph_replays_after_in_place_mask_updates(bias_id, head_dim, op):
    """memory_efficient_attention, forward and backward captured in one CUDA graph and replayed after the mask's
    lengths change in place: each replay equals the float64 oracle of a mask built anew with those lengths in the
    sequences' rows. The rows outside hold NaN and so do the ops' allocations, so that nothing a kernel skips or a
    host value captured stale can pass. Pinned to the Triton ops, the gradients are zero outside the sequences
    (PyTorch's kernels, which the dispatcher may pick, leave those rows unwritten)."""
    q_lengths, k_lengths, updates = _GRAPH_LENGTHS[bias_id]
    mask = _graph_mask(bias_id, q_lengths, k_lengths)
    rows_k = mask.k_seqinfo.seqstart_py[-1] if bias_id != "B12" else 3 * 320
    q = torch.zeros(1, sum(q_lengths), 2, head_dim, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    k, v = (torch.zeros(1, rows_k, 2, head_dim, dtype=torch.bfloat16, device="cuda", requires_grad=True) for _ in "kv")
    grad = torch.zeros_like(q)

    def step():
        q.grad = k.grad = v.grad = None
        out = fmha.memory_efficient_attention(q, k, v, attn_bias=mask, op=op)
        out.backward(grad)
        return out

    graph, out = _captured(step)
    out = out.detach()  # (rewritten in place below, which autograd's view checks refuse)
    for new_q, new_k in updates:
        mask.q_seqinfo.from_seqlens_inplace(new_q)
        if bias_id == "B12":
            mask.k_seqinfo.from_seqlens_padded_inplace(new_k)
        else:
            mask.k_seqinfo.from_seqlens_inplace(new_k)
        fresh = _graph_mask(bias_id, new_q, new_k)
        used_q = torch.zeros(q.shape[1], dtype=torch.bool, device="cuda")
        used_k = torch.zeros(k.shape[1], dtype=torch.bool, device="cuda")
        for used, seqinfo in ((used_q, fresh.q_seqinfo), (used_k, fresh.k_seqinfo)):
            for start, end in seqinfo.intervals():
                used[start:end] = True
        with torch.no_grad():
            for t in (q, k, v, grad):
                t.copy_(testing.randn(*t.shape, dtype=t.dtype, device="cuda"))
            for t, used in ((q, used_q), (k, used_k), (v, used_k), (grad, used_q)):
                t[:, ~used] = float("nan")
            for t in (out, q.grad, k.grad, v.grad):
                t.fill_(float("nan"))
        graph.replay()
        # The oracle on zeros where the kernels saw NaN (its masked scores would carry NaN through).
        q64, k64, v64 = (t.detach().nan_to_num(0.0).double().requires_grad_() for t in (q, k, v))
        ref, _ = attention_reference(q64, k64, v64, fresh)
        ref.backward(grad.nan_to_num(0.0).double())
        testing.assert_rel_close(out[:, used_q], ref[:, used_q], TOLERANCE[torch.bfloat16], what="out")
        for name, got, want, used in (
            ("dq", q.grad, q64.grad, used_q), ("dk", k.grad, k64.grad, used_k), ("dv", v.grad, v64.grad, used_k)
        ):  # fmt: skip
            testing.assert_rel_close(got[:, used], want[:, used], 3e-2, what=f"{name} after {new_q}, {new_k}")
            if op is not None:
                assert (got[:, ~used] == 0).all(), f"{name} outside the sequences after {new_q}, {new_k}"


@pytest.mark.gpu
@pytest.mark.parametrize("op", [None, triton_flash.FwOp], ids=["dispatched", "triton"])
def test_cuda_graph_decode_as_the_keys_grow(op):
    """A decode step (one query a sequence, a KV cache of 320-row slots) captured in a CUDA graph, replayed as the
    cache grows in place past the captured longest, up to its padding: each replay equals the float64 oracle of
    the new lengths (the rows past them hold NaN)."""
    ab = fmha.attn_bias
    mask = ab.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens([1, 1, 1], 320, [5, 64, 130], device="cuda")
    q = torch.zeros(1, 3, 8, 128, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.zeros(1, 3 * 320, 8, 128, dtype=torch.bfloat16, device="cuda") for _ in "kv")
    graph, out = _captured(lambda: fmha.memory_efficient_attention_forward(q, k, v, attn_bias=mask, op=op))
    for lengths in ([6, 65, 131], [200, 1, 320], [320, 320, 320]):
        mask.k_seqinfo.from_seqlens_padded_inplace(lengths)
        fresh = ab.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens([1, 1, 1], 320, lengths, device="cuda")
        for t in (q, k, v):
            t.copy_(testing.randn(*t.shape, dtype=t.dtype, device="cuda"))
        for b, n in enumerate(lengths):
            k[:, b * 320 + n : (b + 1) * 320] = v[:, b * 320 + n : (b + 1) * 320] = float("nan")
        out.fill_(float("nan"))
        graph.replay()
        ref, _ = attention_reference(*(t.nan_to_num(0.0).double() for t in (q, k, v)), fresh)
        testing.assert_rel_close(out, ref, TOLERANCE[torch.bfloat16], what=f"out after {lengths}")


@pytest.mark.gpu
def test_memory_efficient_kernels_decline_varlen_while_capturing():
    """PyTorch's memory-efficient kernels get a sequence without keys wrong, which in-place updates may bring about
    after a capture: pinned, the forward serves a varlen decode step eagerly (the warm-up) and declines it while
    capturing."""
    mask = fmha.attn_bias.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens([1, 1], 320, [5, 64], device="cuda")
    q = testing.randn(1, 2, 8, 128, dtype=torch.bfloat16, device="cuda")
    k, v = (testing.randn(1, 2 * 320, 8, 128, dtype=torch.bfloat16, device="cuda") for _ in "kv")
    with pytest.raises(ValueError, match="varlen mask in a CUDA graph capture"):
        _captured(lambda: fmha.memory_efficient_attention_forward(q, k, v, attn_bias=mask, op=fmha.cutlass.FwOp))


def test_hopper_backward_declines_what_it_does_not_serve():
    """The Gluon backward takes sm_90 GPUs, 16-bit operands of head dims 64 and 128 and rows TMA reads; the rest
    (here: CPU tensors, fp32, head dims 96 and 256, Kv != K, stride-0 GQA heads) runs the Triton kernel."""
    from mslk.attention.fmha import triton_flash_hopper

    def takes(q, k, v):
        return triton_flash_hopper.supports(q, k, v, q)

    q = torch.randn(1, 64, 1, 2, 128, dtype=torch.bfloat16)
    assert not takes(q, q, q)  # not a GPU
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        q = q.cuda()
        assert takes(q, q, q)
        half = q[..., :64].contiguous()
        assert takes(half, half, half)
        assert not takes(q.float(), q.float(), q.float())
        for other in (q[..., :96].contiguous(), torch.cat([q, q], -1)):
            assert not takes(other, other, other)
        assert not takes(q, q, q[..., :64].contiguous())
        assert not takes(q, q[:, :, :, :1].expand_as(q), q)


@pytest.fixture
def gluon_forward_runs(monkeypatch):
    """The launches of the Gluon forward (triton_flash_hopper_fwd.run), each with its output and LSE poisoned first;
    sm_90 only."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm_90 only")
    runs = []
    run = triton_flash_hopper_fwd.run

    def poisoned_run(q, k, v, out, lse, *args):
        runs.append(1)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        run(q, k, v, out, lse, *args)

    monkeypatch.setattr(triton_flash_hopper_fwd, "run", poisoned_run)
    return runs


@pytest.mark.gpu
@pytest.mark.parametrize("bias_id", ["None", "B01", "B03"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    ("fmt", "sizes"),
    [
        *_HOPPER_SIZES,
        ("BMHK", (1, 1, 4100, 1, 2, 128)),
        ("BMHK", (2, 4096, 4096, 1, 2, 128)),
        ("BMHK", (1, 700, 520, 1, 2, 128)),  # bottom-right: the first 180 queries see no key
    ],
)
def test_hopper_forward_gpu(bias_id, dtype, fmt, sizes, monkeypatch, gluon_forward_runs):
    """The Gluon forward (triton_flash_hopper_fwd) at any length (FwOp takes it from _GLUON_FORWARD_MIN_KEYS keys
    on), without a mask and causal: partial query and key blocks, Mq != Mk, groups, one query, many key blocks (the
    ring and the warpgroups' turns go round), its output and LSE poisoned first; a custom scale and an fp32 output
    at one size."""
    monkeypatch.setattr(triton_flash, "_GLUON_FORWARD_MIN_KEYS", 0)
    q, k, v, bias = _inputs(bias_id, fmt, sizes, dtype, "cuda")
    _check(q, k, v, bias, dtype)
    if sizes[1] == 129:
        _check(q, k, v, bias, dtype, scale=0.3, output_dtype=torch.float32)
    assert len(gluon_forward_runs) == (2 if sizes[1] == 129 else 1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mask", ["none", "causal", "ramp_bias"])
def test_hopper_forward_growing_maxima_gpu(dtype, mask, gluon_forward_runs):
    """The Gluon forward where rows' maxima keep growing along the keys, by up to about 2^8 a key block (keys whose
    norms grow, or a bias rising along them), so that the output is rescaled block after block: the oracle's output
    and LSE."""
    b, m, h, d = 2, 1000, 2, 128
    q, k, v = (testing.randn(b, m, h, d, dtype=dtype, device="cuda") for _ in "qkv")
    keys = torch.arange(m, device="cuda")
    bias = fmha.attn_bias.LowerTriangularMask() if mask == "causal" else None
    if mask == "ramp_bias":  # about 4-8 (log2) a key block, noisy
        ramp = 0.04 * keys + testing.randn(b, h, m, m, device="cuda")
        bias = ramp.to(dtype)
    else:  # scores up to ~60 (log2) at the last keys
        k = (k.float() * (1 + 6 * keys / m)[None, :, None, None]).to(dtype)
    _check(q, k, v, bias, dtype)
    assert gluon_forward_runs == [1]


def test_hopper_forward_declines_what_it_does_not_serve():
    """FwOp takes the Gluon forward for one sequence without a mask or causal, over long keys only, and the kernel
    serves sm_90 GPUs, 16-bit operands of head dim 128, a positive scale and rows TMA reads; the rest (here: a
    tensor bias TMA cannot read, broadcast over the queries; a left window, dropout, short keys, CPU tensors, a
    negative scale, fp32, head dims 64 and 256, Kv != K, stride-0 GQA heads) runs the Triton kernel."""
    from mslk.attention.fmha import attn_bias

    q = torch.randn(1, triton_flash._GLUON_FORWARD_MIN_KEYS, 1, 2, 128, dtype=torch.bfloat16)
    q4 = q[:, :, 0]
    scores_bias = torch.randn(()).expand(1, 2, q.shape[1], q.shape[1])
    for inp in (
        common.Inputs(q4, q4, q4, attn_bias.LowerTriangularMaskWithTensorBias(scores_bias)),
        common.Inputs(q4, q4, q4, p=0.1),
        common.Inputs(q4[:, :-1], q4[:, :-1], q4[:, :-1]),
    ):
        k = triton_flash._bmghk(inp.key)
        bias = triton_flash._bias_args(common.tensor_bias(inp.attn_bias))[0]
        assert triton_flash._gluon_forward(k, k, k, bias, inp.p, inp.scale_float, None, -1) is None
    takes = triton_flash_hopper_fwd.supports
    assert not takes(q, q, q, 0.1)  # not a GPU
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        q = q.cuda()
        assert takes(q, q, q, 0.1)
        assert triton_flash._gluon_forward(q, q, q, None, 0.0, 0.1, None, -1) is triton_flash_hopper_fwd
        assert triton_flash._gluon_forward(q, q, q, None, 0.0, 0.1, None, 100) is None  # a left window
        assert not takes(q, q, q, -0.1)
        assert not takes(q.float(), q.float(), q.float(), 0.1)
        for other in (q[..., :64].contiguous(), torch.cat([q, q], -1)):
            assert not takes(other, other, other, 0.1)
        assert not takes(q, q, q[..., :64].contiguous(), 0.1)
        assert not takes(q, q[:, :, :, :1].expand_as(q), q, 0.1)


@pytest.mark.gpu
def test_deterministic_backward_repeats_bitwise(backward_mode):
    """Under torch.use_deterministic_algorithms two runs give the same bits; 4096 keys in 32 key blocks make
    the one-pass backward's atomic dQ sums land in varying orders (dK and dV are per program either way)."""
    q, k, v, bias = _inputs("B03", "BMHK", (2, 1024, 4096, 1, 8, 128), torch.bfloat16, "cuda")
    inp = common.Inputs(q, k, v, bias)
    out, ctx = triton_flash.FwOp.apply(inp, needs_gradient=True)
    do = testing.randn(*out.shape, dtype=torch.bfloat16, device="cuda")
    first, second = (triton_flash.BwOp.apply(ctx, inp, do) for _ in range(2))
    assert torch.equal(first.dk, second.dk) and torch.equal(first.dv, second.dv)
    if backward_mode:
        assert torch.equal(first.dq, second.dq)


@pytest.mark.parametrize(
    ("bias_id", "fmt", "sizes"), [("None", "BMHK", (2, 33, 40, 1, 2, 16)), ("B07", "BMGHK", (2, 20, 20, 2, 2, 16))]
)
def test_dropout_replays_its_mask_forward_and_backward(bias_id, fmt, sizes):
    """The output equals the oracle with the mask the kernels draw (dropout_mask of the forward's seed), the
    backward equals float64 autograd through that mask, and torch.manual_seed reproduces the draw."""
    p = 0.3
    q, k, v, bias = _inputs(bias_id, fmt, sizes, torch.float32, DEVICE)
    inp = common.Inputs(q, k, v, bias, p=p)
    torch.manual_seed(7)
    out, ctx = triton_flash.FwOp.apply(inp, needs_gradient=True)
    assert ctx.op_bw is triton_flash.BwOp  # only its own backward replays the draw
    groups = q.shape[2] if q.dim() == 5 else 1
    mask = triton_flash.dropout_mask(ctx.rng_state, q.shape[0], groups, q.shape[-2], q.shape[1], k.shape[1], p, DEVICE)
    mask = mask if q.dim() == 5 else mask[:, 0]
    assert 0.6 < mask.float().mean() < 0.8  # about 1 - p kept
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    expected = attn_bias_utils.ref_attention(q64, k64, v64, bias, drop_mask=mask, p=p)
    testing.assert_rel_close(out, expected, 1e-5)
    do = testing.randn(*out.shape, device=DEVICE)
    grads = triton_flash.BwOp.apply(ctx, inp, do)
    expected.backward(do.double())
    for got, want in ((grads.dq, q64.grad), (grads.dk, k64.grad), (grads.dv, v64.grad)):
        testing.assert_rel_close(got, want, 1e-5)
    torch.manual_seed(7)
    assert torch.equal(triton_flash.FwOp.apply(inp, needs_gradient=False)[0], out)
    with pytest.raises(ValueError, match="holds no seed"):  # a context without the forward's draw
        triton_flash.BwOp.apply(common.Context(lse=ctx.lse, out=out), inp, do)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_dropout_gpu(dtype):
    p = 0.2
    q, k, v, bias = _inputs("B01", "BMHK", (2, 200, 200, 1, 4, 64), dtype, "cuda")
    inp = common.Inputs(q, k, v, bias, p=p)
    out, ctx = triton_flash.FwOp.apply(inp, needs_gradient=True)
    mask = triton_flash.dropout_mask(ctx.rng_state, 2, 1, 4, 200, 200, p, "cuda")[:, 0]
    expected = attn_bias_utils.ref_attention(q.double(), k.double(), v.double(), bias, drop_mask=mask, p=p)
    testing.assert_rel_close(out, expected, TOLERANCE[dtype])


@pytest.mark.gpu
@pytest.mark.big_memory
def test_gpu_tensor_bias_heads_past_two_to_the_31():
    """A [1, 16, 16384, 16384] bias: heads 8 and up start 2**31 elements in (their offsets once wrapped in int32).
    The last head's output, LSE and dQ, dK, dV and bias gradient against float64 autograd of that head alone."""
    mq = mk = 16384
    q, k, v = (testing.randn(1, m, 16, 64, dtype=torch.bfloat16, device="cuda") for m in (mq, mk, mk))
    bias = testing.randn(1, 16, mq, mk, dtype=torch.bfloat16, device="cuda").requires_grad_()
    inp = common.Inputs(q, k, v, bias)
    out, ctx = triton_flash.FwOp.apply(inp, needs_gradient=True)
    do = testing.randn(*out.shape, dtype=torch.bfloat16, device="cuda")
    grads = triton_flash.BwOp.apply(ctx, inp, do)
    q64, k64, v64 = (t[:, :, -1:].detach().double().requires_grad_() for t in (q, k, v))
    bias64 = bias[:, -1:].detach().double().requires_grad_()
    ref, lse = attention_reference(q64, k64, v64, bias64)
    ref.backward(do[:, :, -1:].double())
    testing.assert_rel_close(out[:, :, -1:], ref, TOLERANCE[torch.bfloat16], what="out")
    testing.assert_rel_close(ctx.lse[:, -1:], lse, 1e-3, what="lse")
    for name, got, want in [
        ("dq", grads.dq[:, :, -1:], q64.grad), ("dk", grads.dk[:, :, -1:], k64.grad),
        ("dv", grads.dv[:, :, -1:], v64.grad), ("db", grads.db[:, -1:], bias64.grad),
    ]:  # fmt: skip
        testing.assert_rel_close(got, want, 2e-2, what=name)


@pytest.mark.gpu
def test_gpu_more_than_65535_heads(backward_mode):
    """B·H = 65600 (decode-like batches): the delta kernel and dropout_mask take one grid axis (the second and
    third take at most 65535 programs, and the launch failed)."""
    q, k, v, bias = _inputs("None", "BMHK", (4100, 16, 16, 1, 16, 64), torch.bfloat16, "cuda")
    _check_backward(q, k, v, bias, 2e-2)
    mask = triton_flash.dropout_mask(1234, 4100, 1, 16, 16, 16, 0.5, "cuda")
    assert torch.equal(mask[:2], triton_flash.dropout_mask(1234, 2, 1, 16, 16, 16, 0.5, "cuda"))
    assert 0.4 < mask[-1].float().mean().item() < 0.6


# ------------------------------------------------------------------------------------------------ torch.compile


def _check_compiled(bias_id, dtype, sizes, backend, calls=1, **options):
    """memory_efficient_attention pinned to the Triton kernels and compiled by `backend` (fullgraph, with `options`),
    called `calls` times with one mask on new random inputs: each call's forward and backward (a tensor bias's
    gradient too) against float64 autograd of the oracle, before the next call (CUDA-graph replays reuse outputs)."""
    q, k, v, bias = _inputs(bias_id, "BMHK", sizes, dtype, DEVICE)
    # `attend` is one code object to Dynamo: in a process running more than 8 of these tests, its recompile limit.
    torch._dynamo.reset()

    def attend(q, k, v, bias):
        return fmha.memory_efficient_attention(q, k, v, bias, op=fmha.MemoryEfficientAttentionMslkTritonOp)

    compiled = torch.compile(attend, backend=backend, fullgraph=True, **options)
    for _ in range(calls):
        q, k, v = (testing.randn(*t.shape, dtype=dtype, device=DEVICE) for t in (q, k, v))
        leaves = [t.requires_grad_() for t in (q, k, v, common.tensor_bias(bias)) if t is not None]
        out = compiled(q, k, v, bias)
        do = testing.randn(*out.shape, dtype=dtype, device=DEVICE)
        grads = torch.autograd.grad(out, leaves, do)
        leaves64 = [t.detach().double().requires_grad_() for t in leaves]
        bias64 = (
            bias if len(leaves) == 3 else leaves64[3] if isinstance(bias, torch.Tensor) else type(bias)(leaves64[3])
        )
        ref, _ = attention_reference(*leaves64[:3], bias64)
        want = torch.autograd.grad(ref, leaves64, do.double())
        tolerance = 1e-5 if dtype == torch.float32 else 3e-2
        for name, got, expected in zip(("out", "dq", "dk", "dv", "db"), (out, *grads), (ref, *want), strict=False):
            testing.assert_rel_close(got, expected, tolerance, what=name)


@pytest.mark.parametrize("bias_id", ["None", "T", "B02", "B08", "B12"])
def test_torch_compile_calls_the_launches_as_ops(bias_id):
    """Compiled code calls the forward's and backward's launches as torch ops, whose fake kernels give the shapes
    (Dynamo does not trace into them, so Inductor does not compile the kernels itself), with the eager results."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    backend = AotEagerAndRecordGraphs()
    _check_compiled(bias_id, torch.float32, (2, 20, 28, 1, 2, 16), backend)
    assert "mslk_triton.flash_attention_forward" in "".join(g.code for g in backend.fw_graphs)
    assert "mslk_triton.flash_attention_backward" in "".join(g.code for g in backend.bw_graphs)


@pytest.mark.parametrize("bias_id", ["T", "B12"])
def test_opcheck_of_the_launches(bias_id):
    """torch.library.opcheck of the launch ops (schema, fake kernels against the real ones, tracing); dropout with
    the tensor bias."""
    q, k, v, bias = _inputs(bias_id, "BMHK", (2, 20, 28, 1, 2, 16), torch.float32, DEVICE)
    alignment, window_left, window_right = triton_flash._alignment(common.Inputs(q, k, v, bias))
    dense = common.tensor_bias(bias)
    p, seed = (0.2, torch.tensor([77], dtype=torch.int32, device=DEVICE)) if bias_id == "T" else (0.0, None)
    mask_args = (*triton_flash._varlen_fields(bias), 0.25, p, seed, window_left, window_right, alignment is not None)
    forward_args = (q, k, v, dense, *mask_args, torch.float32)
    torch.library.opcheck(torch.ops.mslk_triton.flash_attention_forward.default, forward_args)
    out, lse = torch.ops.mslk_triton.flash_attention_forward(*forward_args)
    do = testing.randn(*out.shape, device=DEVICE)
    backward_args = (q, k, v, out, do, lse, dense, dense is not None, *mask_args, False)
    torch.library.opcheck(torch.ops.mslk_triton.flash_attention_backward.default, backward_args)


@pytest.mark.gpu
@pytest.mark.parametrize("bias_id", ["None", "T", "B03", "B07", "B12"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_torch_compile_inductor(bias_id, dtype, head_dim):
    """Inductor over the Triton kernels (at head dim 128 on Hopper the Gluon ones), forward and backward (fp32
    failed to compile while Dynamo traced into the launches and Inductor compiled the kernels itself)."""
    _check_compiled(bias_id, dtype, (2, 150, 230, 1, 4, head_dim), "inductor")


@pytest.mark.gpu
@pytest.mark.parametrize("bias_id", ["None", "B02", "B07", "B12"])
def test_gpu_torch_compile_reduce_overhead(bias_id):
    """mode="reduce-overhead": Inductor's CUDA graphs around the kernels, the way small launch-bound calls are
    compiled. Three calls (warm-up, recording, replay), each on new inputs, forward and backward."""
    _check_compiled(bias_id, torch.bfloat16, (3, 150, 230, 1, 4, 128), "inductor", calls=3, mode="reduce-overhead")


def _dropout_draws_replayed(out, v, device):
    """The output is linear in V, out = A·V with A the dropped-out weights, and dV = Aᵀ·dO: <out, dO> = <V, dV>
    holds only if the backward applies the forward's A. The tolerance scales with Σ|out·dO|: the sums may nearly
    cancel (a relative 1e-4 of the result failed at -0.0589 on fp32 rounding), while another draw's A missed by
    2.2e-3 of it (CPU, the shapes below)."""
    do = testing.randn(*out.shape, device=device)
    (dv,) = torch.autograd.grad(out, v, do)
    terms = (out * do).double()
    torch.testing.assert_close(terms.sum(), (v * dv).double().sum(), rtol=0, atol=1e-4 * terms.abs().sum().item())


@pytest.mark.parametrize(
    ("device", "backend"), [(DEVICE, "aot_eager"), pytest.param("cuda", "inductor", marks=pytest.mark.gpu)]
)
def test_torch_compile_dropout_replays_its_draws(device, backend):
    """Compiled (fullgraph) dropout draws a new seed each call, on the device, and its backward replays it."""
    q, k, v = (testing.randn(2, 60, 2, 32, device=device).requires_grad_() for _ in range(3))

    def attend(q, k, v):
        return fmha.memory_efficient_attention(q, k, v, p=0.3, op=fmha.MemoryEfficientAttentionMslkTritonOp)

    compiled = torch.compile(attend, backend=backend, fullgraph=True)
    outs = [compiled(q, k, v) for _ in range(2)]
    for out in outs:
        _dropout_draws_replayed(out, v, device)
    assert testing.rel_error(outs[0], outs[1]) > 0.1, "each call drops other weights"


@pytest.mark.gpu
def test_gpu_cuda_graph_dropout_draws_each_replay():
    """A CUDA graph of dropout attention draws a new seed each replay (drawn on the device by torch's generator,
    which graphs advance; a seed fixed at capture would drop the same weights every step)."""
    q, k, v = (testing.randn(2, 60, 2, 32, device="cuda") for _ in range(3))
    op = fmha.MemoryEfficientAttentionMslkTritonOp
    graph, out = _captured(lambda: fmha.memory_efficient_attention(q, k, v, p=0.3, op=op))
    outs = []
    for _ in range(2):
        graph.replay()
        outs.append(out.clone())
    assert testing.rel_error(outs[0], outs[1]) > 0.1, "each replay drops other weights"
