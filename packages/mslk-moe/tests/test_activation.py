"""silu_mul / silu_mul_quant (spec M-07, M-08) and their fused Triton kernel.

T0: the references against the math, bad input, the backend's support reasons. T1 (CPU, interpreter) and T2
(GPU, marked gpu): the Triton backends against the references, bit for bit on the GPU. The interpreter casts
fp32 to bf16 by truncation (the GPU rounds to nearest even) and has no libdevice (its exp is numpy's), so
under it silu_mul is checked to one step of its dtype (4 ulps in fp32), and silu_mul_quant exactly against
quantizing the kernel's own silu_mul output (FP8 with testing.assert_fp8_equal, DESIGN.md §4).
"""

import pytest
import torch

from mslk.core import arch, testing
from mslk.moe.activation import silu_mul, silu_mul_op, silu_mul_quant, silu_mul_quant_op
from mslk.quantize import reference
from mslk.quantize.triton.fp8_quantize import quantize_fp8_row_op

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
triton_silu_mul = silu_mul_op.get_backend("triton").impl
triton_silu_mul_quant = silu_mul_quant_op.get_backend("triton").impl


def _count(n, dtype=torch.int32):
    return torch.tensor([n], dtype=dtype, device=DEVICE)


# ------------------------------------------------------------------------------------------- T0


def test_reference_is_the_math():
    x0, x1 = testing.randn(9, 70, std=3.0), testing.randn(9, 70)
    a = x0.double()
    testing.assert_rel_close(silu_mul(x0, x1), a / (1 + torch.exp(-a)) * x1.double(), 1e-6)
    x0[6, 3], x1[7, 4] = float("nan"), float("inf")
    out = silu_mul(x0, x1, torch.tensor([6]))
    testing.assert_rel_close(out[:6], silu_mul(x0[:6], x1[:6]), 1e-6)  # CPU sigmoid's last bit depends on the shape
    assert (out[6:] == 0).all() and not out[6:].signbit().any(), "rows at or past the count are +0, NaN rows too"
    xq, scale = silu_mul_quant(x0, x1, None, torch.tensor([6]))
    assert (xq[6:].view(torch.uint8) == 0).all() and (scale[6:] == arch.FP8_EPS / 448).all()


def test_quant_floors_amax_at_1e_12():
    """Rows of tiny values use FP8's whole range, as the reference's MoE kernels (eps 1e-12), where
    quantize_fp8_row's 1/512 floor would leave them a few levels."""
    x0, x1 = testing.randn(3, 64, std=1e-3), testing.randn(3, 64, std=1e-3)
    xq, scale = silu_mul_quant(x0, x1)
    amax = silu_mul(x0, x1).abs().amax(-1).float()
    assert (amax < reference.FP8_ROW_EPS).all()
    torch.testing.assert_close(scale, amax / 448, rtol=1e-6, atol=0)
    assert (xq.float().abs().amax(-1) == 448).all()


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: silu_mul(torch.rand(4, 8), torch.rand(4, 9)), "silu_mul: x0 and x1 must be .* one shape and dtype"),
        (lambda: silu_mul(torch.rand(4, 8), torch.rand(4, 8).half()), "one shape and dtype"),
        (lambda: silu_mul(torch.rand(2, 4, 8), torch.rand(2, 4, 8)), r"\[T, D\]"),
        (lambda: silu_mul(torch.ones(4, 8, dtype=torch.int32), torch.ones(4, 8, dtype=torch.int32)), "floating"),
        (lambda: silu_mul(torch.rand(4, 8), torch.rand(4, 8, device="meta")), "one device, got x0 on cpu, x1 on meta"),
        (lambda: silu_mul(torch.rand(4, 8), torch.rand(4, 8), torch.tensor([1, 2])), "one integer"),
        (lambda: silu_mul(torch.rand(4, 8), torch.rand(4, 8), torch.tensor([1.0])), "one integer"),
        (lambda: silu_mul_quant(torch.rand(4, 8), torch.rand(4, 9)), "silu_mul_quant: x0 and x1"),
        (lambda: silu_mul_quant(torch.rand(4, 8).double(), torch.rand(4, 8).double()), "silu_mul_quant: x0 must be"),
        (lambda: silu_mul_quant(torch.rand(4, 8), torch.rand(4, 8), torch.ones(2)), "scale_ub must be one float32"),
    ],
)
def test_bad_input_is_refused_before_any_kernel(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("op", [silu_mul_op, silu_mul_quant_op], ids=lambda op: op.name)
def test_triton_backend_says_what_it_cannot_serve(op):
    backend = op.get_backend("triton")
    x, xt = testing.randn(6, 40), testing.randn(40, 6).t()
    assert backend.reasons("cuda", (x, x), {}) == []
    assert backend.reasons("cuda", (x[:, :1], xt[:, :1]), {}) == [], "a last dim of size 1 needs no stride 1"
    (reason,) = backend.reasons("cuda", (x.double(), x.double()), {})
    assert "dtype=torch.float64" in reason
    (reason,) = backend.reasons("cuda", (x, xt), {})
    assert "contiguous last dim" in reason and "x1.stride()=(1, 6)" in reason


# -------------------------------------------------------------------------- T1 (CPU) / T2 (GPU)


def _assert_within_one_step(out, ref):
    """Each element within one step of out's dtype from ref (the interpreter's bf16 truncation), or 4 fp32 ulps
    (numpy's exp against torch's CPU sigmoid: 2.5 seen); NaN exactly where ref has NaN, infinities equal."""
    o, r = out.double().cpu(), ref.double().cpu()
    assert torch.equal(o.isnan(), r.isnan()), "NaN where the reference has NaN, and nowhere else"
    finite = r.isfinite()
    assert torch.equal(o[~finite & ~r.isnan()], r[~finite & ~r.isnan()])
    info = torch.finfo(out.dtype)
    steps = 4 if out.dtype == torch.float32 else 1
    step = (r.abs() * info.eps * steps).clamp(min=info.tiny * info.eps)  # eps · |r| bounds a step at |r|
    bad = finite & ((o - r).abs() > step)
    assert not bad.any(), f"{int(bad.sum())} elements off by more than a step, e.g. {o[bad][:3]} vs {r[bad][:3]}"


def _check(x0, x1, scale_ub=None, count=None):
    """Both Triton backends against the references (see the module docstring for the interpreter's case)."""
    out = triton_silu_mul(x0, x1, count)
    ref = silu_mul_op.reference(x0, x1, count)
    assert out.shape == ref.shape and out.dtype == ref.dtype and out.is_contiguous()
    xq, scale = triton_silu_mul_quant(x0, x1, scale_ub, count)
    if testing.interpreting():
        _assert_within_one_step(out, ref)
        ref_xq, ref_scale = quantize_fp8_row_op.reference(out, scale_ub, eps_opt=arch.FP8_EPS)
    else:
        torch.testing.assert_close(out, ref, rtol=0, atol=0, equal_nan=True)
        ref_xq, ref_scale = silu_mul_quant_op.reference(x0, x1, scale_ub, count)
    assert scale.shape == ref_scale.shape == (x0.shape[0],)
    torch.testing.assert_close(scale, ref_scale, rtol=0, atol=0, equal_nan=True)
    testing.assert_fp8_equal(xq, ref_xq)


@pytest.mark.parametrize("d", [1, 33, 80, 200], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("t", [0, 1, 7], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_matches_reference(t, d, dtype):
    _check(testing.randn(t, d, dtype=dtype, device=DEVICE, std=3.0), testing.randn(t, d, dtype=dtype, device=DEVICE))


def test_kernel_long_rows_two_passes():
    x0, x1 = (testing.randn(2, 16385, dtype=torch.bfloat16, device=DEVICE, std=2.0) for _ in range(2))
    _check(x0, x1, torch.tensor([1.5], device=DEVICE), _count(1))


@pytest.mark.parametrize("count", [0, 3, 7, 20, -1], ids=lambda n: f"count{n}")
def test_kernel_valid_token_count(count):
    x0, x1 = (testing.randn(7, 45, dtype=torch.bfloat16, device=DEVICE, std=3.0) for _ in range(2))
    _check(x0, x1, None, _count(count, torch.int64))
    _check(x0, x1, None, torch.tensor([[count, 99]], dtype=torch.int32, device=DEVICE)[:, 0])  # strided, 2-D


def test_kernel_scale_ub():
    x0, x1 = (testing.randn(5, 100, device=DEVICE, std=10.0) for _ in range(2))
    _check(x0, x1, torch.tensor([2.0], device=DEVICE))
    _check(x0, x1, torch.tensor([1e6], device=DEVICE), _count(3))


def test_kernel_strided_rows():
    x0, x1 = (testing.randn(9, 70, dtype=torch.float16, device=DEVICE) for _ in range(2))
    _check(testing.padded_rows(x0, 5), testing.padded_rows(x1, 2))
    # SwiGLU's usual layout: the two halves of one [T, 2D] GEMM output
    h = testing.randn(6, 2 * 96, dtype=torch.bfloat16, device=DEVICE, std=2.0)
    _check(h[:, :96], h[:, 96:], None, _count(5))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy's inf · 0 (interpreter)
def test_kernel_inf_and_nan_rows():
    x0, x1 = (testing.randn(6, 33, device=DEVICE, std=2.0) for _ in range(2))
    x0[1, 3] = float("nan")
    x0[2, 5] = float("inf")  # silu(inf) · x1 = ±inf
    x0[3, 7] = -float("inf")  # silu(-inf) = -inf · 0 = NaN, as torch computes it
    x1[4, 0] = float("inf")
    _check(x0, x1)
    _check(x0, x1, torch.tensor([3.0], device=DEVICE))
    _check(x0, x1, None, _count(2))  # the count cuts the NaN and inf rows: they come out zero
    _, scale = triton_silu_mul_quant(x0, x1)
    assert scale[1].isnan() and scale[2].isinf() and scale[3].isnan() and scale[4].isinf()


def test_kernel_writes_every_output(monkeypatch):
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *args, **kwargs: testing.poison_(empty(*args, **kwargs)))
    for t, d in [(33, 70), (3, 1025), (2, 16400)]:
        x0, x1 = (testing.randn(t, d, dtype=torch.bfloat16, device=DEVICE) for _ in range(2))
        _check(x0, x1, None, _count(t - 1))


# ------------------------------------------------------------------------------------------- T2


@pytest.mark.gpu
@pytest.mark.parametrize("d", [1, 127, 5120, 8192, 14336, 16384], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("t", [1, 100, 4096], ids=lambda t: f"T{t}")
def test_gpu_kernel_matches_reference_bitwise(t, d):
    for dtype in DTYPES if t * d <= 2**20 else [torch.bfloat16]:
        x0 = testing.randn(t, d, dtype=dtype, device="cuda", std=3.0)
        x1 = testing.randn(t, d, dtype=dtype, device="cuda")
        _check(x0, x1)
        _check(x0, x1, torch.tensor([4.0], device="cuda"), _count(t // 2))


@pytest.mark.gpu
def test_gpu_dispatch_and_cuda_graph():
    x0, x1 = (testing.randn(64, 4096, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    assert silu_mul_op.select((x0, x1), {}).name == "triton"
    assert silu_mul_quant_op.select((x0, x1), {}).name == "triton"
    assert silu_mul_op.select((x0.double(), x1.double()), {}).name == "reference"
    count = _count(64)
    silu_mul_quant(x0, x1, None, count)  # compile outside the capture
    silu_mul(x0, x1, count)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        xq, scale = silu_mul_quant(x0, x1, None, count)
        out = silu_mul(x0, x1, count)
    for n in (10, 0, 64):
        count.fill_(n)  # read on the device at each replay: no host sync, nothing baked in
        graph.replay()
        ref_xq, ref_scale = silu_mul_quant_op.reference(x0, x1, None, count)
        testing.assert_fp8_equal(xq, ref_xq)
        assert torch.equal(scale, ref_scale)
        assert torch.equal(out, silu_mul_op.reference(x0, x1, count))
