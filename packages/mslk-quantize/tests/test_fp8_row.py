"""quantize_fp8_row / triton_quantize_fp8_row / dequantize_fp8_row (spec Q-01, Q-02, Q-09).

T0: the reference against the formulas, errors, compile/export. T1 (CPU, interpreter) and T2 (GPU): the
Triton kernel against the reference, bit for bit on the GPU.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mslk.core import formats, testing
from mslk.quantize import reference
from mslk.quantize.triton.fp8_quantize import (
    dequantize_fp8_row,
    quantize_fp8_row,
    quantize_fp8_row_op,
    triton_quantize_fp8_row,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn  # the CPU's and the H200's flavour


# ------------------------------------------------------------------------------------------- T0


@settings(deadline=None, max_examples=40)
@given(
    rows=st.integers(1, 9),
    k=st.integers(1, 300),
    std=st.sampled_from([1e-3, 1.0, 300.0]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
)
def test_reference_round_trip(rows, k, std, dtype):
    a = testing.randn(rows, k, dtype=dtype, std=std)
    xq, scale = quantize_fp8_row(a)
    amax = a.float().abs().amax(dim=-1).clamp(min=reference.FP8_ROW_EPS)
    assert torch.equal(scale, amax / 448.0), "scale = amax / FP8_MAX"
    assert xq.dtype == FP8 and xq.shape == a.shape
    assert xq.float().abs().amax() <= 448.0
    back = dequantize_fp8_row(xq, scale).double()
    # e4m3 keeps 3 mantissa bits: each element within half a step (2^-4 relative) or the subnormal step.
    bound = a.double().abs() * 2**-4 + scale.double()[:, None] * 2**-9 * 448 / 2**-6 * 2**-3
    assert ((back - a.double()).abs() <= bound + 1e-2 * a.double().abs()).all()


@settings(deadline=None, max_examples=20)
@given(rows=st.integers(1, 6), k=st.integers(1, 200))
def test_reference_is_idempotent(rows, k):
    xq, scale = quantize_fp8_row(testing.randn(rows, k, std=5.0))
    xq2, scale2 = quantize_fp8_row(xq.float() * scale[:, None])
    testing.assert_rel_close(scale2, scale, 1e-6)
    testing.assert_fp8_equal(xq2, xq)


def test_reference_options():
    a = testing.randn(2, 3, 10, std=10.0)
    xq, scale = quantize_fp8_row(a, scale_ub=torch.tensor([1.0]))
    assert (scale == 1.0 / 448).all(), "scale_ub bounds amax"
    xq, _ = quantize_fp8_row(a, align_rows_to=16)
    assert xq.shape == (2, 3, 16) and (xq[..., 10:].float() == 0).all()
    xq, scale = quantize_fp8_row(a, zero_start_index_M=torch.tensor([1, 3]))
    assert (xq[0, 1:].float() == 0).all() and (scale[0, 1:] == reference.FP8_ROW_EPS / 448).all()
    assert (xq[1].float() != 0).any()
    tiny = torch.full((1, 4), 1e-6)
    assert quantize_fp8_row(tiny, eps_opt=None)[1].item() == pytest.approx(1e-6 / 448)
    assert quantize_fp8_row(tiny)[1].item() == pytest.approx(reference.FP8_ROW_EPS / 448)


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((torch.ones(2, 3, dtype=torch.int32),), {}, "a must be float32, float16 or bfloat16, got torch.int32"),
        ((torch.ones(1, 1, 1, 1, 2),), {}, "1 to 4 dimensions"),
        ((torch.ones(2, 3), torch.ones(2)), {}, "scale_ub must be one float32 value"),
        ((torch.ones(2, 3), torch.ones(1, dtype=torch.float64)), {}, "scale_ub must be one float32 value"),
        ((torch.ones(2, 3, 4), None, torch.tensor([1, 2, 3])), {}, "one integer row count per"),
        ((torch.ones(2, 3, 4), None, torch.tensor([1.0, 2.0])), {}, "one integer row count per"),
        ((torch.ones(2, 3),), {"align_rows_to": 0}, "align_rows_to must be a positive integer"),
        ((torch.ones(2, 3),), {"eps_opt": 0.0}, "eps_opt must be > 0"),
        ((torch.ones(2, 3),), {"eps_opt": math.inf}, "eps_opt must be > 0 and finite, got inf"),
    ],
)
def test_bad_input_is_refused_before_any_kernel(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        quantize_fp8_row(*args, **kwargs)


def test_dequantize_checks_the_scale_layout():
    xq, scale = quantize_fp8_row(testing.randn(4, 8))
    with pytest.raises(formats.ScaleFormatError, match="expected a rowwise scale"):
        dequantize_fp8_row(xq, scale[:2])
    xq3, scale3 = quantize_fp8_row(testing.randn(2, 3, 8))
    expected = dequantize_fp8_row(xq3, scale3)
    assert torch.equal(dequantize_fp8_row(xq3, scale3.reshape(-1)), expected)  # a flat scale, as the check accepts


def test_compile_and_export():
    class Quantize(torch.nn.Module):
        def forward(self, a):
            return quantize_fp8_row(a, align_rows_to=8)

    a = testing.randn(5, 12, dtype=torch.bfloat16)
    compiled = torch.compile(Quantize(), fullgraph=True, backend="aot_eager")
    xq, scale = compiled(a)
    assert xq.shape == (5, 16) and scale.shape == (5,)
    exported = torch.export.export(Quantize(), (a,))
    assert "triton.quantize_fp8_row" in str(exported.graph)


# -------------------------------------------------------------------------- T1 (CPU) / T2 (GPU)


def _kernel_vs_reference(a, *args, **kwargs):
    xq, scale = triton_quantize_fp8_row(a, *args, **kwargs)
    ref_xq, ref_scale = quantize_fp8_row_op.reference(
        a.cpu(), *(x.cpu() if isinstance(x, torch.Tensor) else x for x in args), **kwargs
    )
    assert scale.shape == ref_scale.shape
    torch.testing.assert_close(scale.cpu(), ref_scale, rtol=0, atol=0, equal_nan=True)
    testing.assert_fp8_equal(xq.cpu(), ref_xq)


def test_raw_entry_takes_the_spec_order_and_checks_its_inputs():
    """triton_quantize_fp8_row(a, scale_ub, zero_start_index_M, align_rows_to, eps_opt) (spec Q-02): positional
    align_rows_to and eps_opt land where the spec puts them (they were read as use_triton and output_device), and
    bad input gets quantize_fp8_row's errors (a 0-dim tensor raised an IndexError)."""
    a = testing.randn(3, 13, device=DEVICE, std=1e-4)
    backend = quantize_fp8_row_op.get_backend("triton").impl
    assert torch.equal(backend(a)[1], triton_quantize_fp8_row(a)[1]), "the op's backend takes the op's defaults"
    xq, scale = triton_quantize_fp8_row(a, None, None, 16, 1e-12)
    assert xq.shape == (3, 16) and scale.dtype == torch.float32
    torch.testing.assert_close(scale, a.abs().amax(-1) / torch.finfo(xq.dtype).max, rtol=1e-6, atol=0)
    for call, message in (
        (lambda: triton_quantize_fp8_row(torch.tensor(1.0)), "a must have 1 to 4 dimensions"),
        (lambda: triton_quantize_fp8_row(a, torch.tensor([1.0], dtype=torch.float64)), "scale_ub must be one float32"),
        (lambda: triton_quantize_fp8_row(a[None], None, torch.tensor([1.5])), "one integer row count"),
        (lambda: triton_quantize_fp8_row(a, None, None, -4), "align_rows_to must be a positive integer"),
    ):
        with pytest.raises(ValueError, match=message):
            call()


SHAPES = [(1, 8192), (3, 5), (17, 130), (2, 3, 200), (2, 2, 3, 7), (7,), (0, 5), (3, 0)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_kernel_matches_reference(shape, dtype):
    _kernel_vs_reference(testing.randn(*shape, dtype=dtype, device=DEVICE, std=3.0))


def test_kernel_long_rows_two_passes():
    _kernel_vs_reference(testing.randn(3, 20000, dtype=torch.bfloat16, device=DEVICE))


def test_kernel_non_contiguous_inputs():
    a = testing.randn(6, 70, dtype=torch.bfloat16, device=DEVICE)
    _kernel_vs_reference(testing.padded_rows(a))
    _kernel_vs_reference(testing.randn(40, 6, device=DEVICE).t())  # last-dim stride 6
    _kernel_vs_reference(testing.randn(4, 5, 9, device=DEVICE).transpose(0, 1))


def test_kernel_inf_and_nan_rows():
    a = testing.randn(4, 33, device=DEVICE)
    a[1, 3] = float("nan")
    a[2, 5] = float("inf")
    _kernel_vs_reference(a)
    _kernel_vs_reference(a, torch.tensor([2.0], device=DEVICE))
    _, scale = triton_quantize_fp8_row(a)
    assert scale[1].isnan() and scale[2].isinf(), "a NaN row must not look like a finite one"


def test_kernel_options():
    a = testing.randn(3, 4, 33, dtype=torch.bfloat16, device=DEVICE, std=50.0)
    _kernel_vs_reference(a, torch.tensor([20.0], device=DEVICE))
    _kernel_vs_reference(a, None, torch.tensor([4, 0, 2], device=DEVICE))
    _kernel_vs_reference(a, None, torch.tensor([[4, 9], [0, 9], [2, 9]], device=DEVICE)[:, 0])  # strided counts
    _kernel_vs_reference(a, align_rows_to=16)
    _kernel_vs_reference(a, eps_opt=None)
    _kernel_vs_reference(testing.randn(2, 10, device=DEVICE, std=1e-5))


def test_kernel_writes_every_output(monkeypatch):
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *args, **kwargs: testing.poison_(empty(*args, **kwargs)))
    for shape, align in [((33, 257), None), ((5, 3, 20), 32), ((2, 40000), None)]:
        _kernel_vs_reference(testing.randn(*shape, dtype=torch.bfloat16, device=DEVICE), align_rows_to=align)


@pytest.mark.gpu
def test_gpu_dispatch_and_use_triton_false():
    a = testing.randn(64, 512, dtype=torch.bfloat16, device="cuda")
    assert quantize_fp8_row_op.select((a,), {}).name == "triton"
    assert quantize_fp8_row_op.select((a, None, None, False), {}).name == "reference"
    xq, scale = quantize_fp8_row(a, use_triton=False)
    ref_xq, ref_scale = quantize_fp8_row(a)
    assert torch.equal(scale, ref_scale)
    testing.assert_fp8_equal(xq, ref_xq)
    xq, scale = quantize_fp8_row(a, output_device=torch.device("cpu"))
    assert xq.device.type == "cpu" and scale.device.type == "cpu"


@pytest.mark.gpu
@pytest.mark.big_memory
def test_gpu_transposed_rows_past_two_to_the_31():
    """Rows of x.t() for x [65536, 65536]: element k of a row is k · 65536 elements in, past 2**31 from k = 32768
    on (the column offset once wrapped in int32). Rows at both ends against the reference, bit for bit."""
    x = testing.randn(65536, 65536, dtype=torch.bfloat16, device="cuda")
    xq, scale = triton_quantize_fp8_row(x.t())
    for rows in (slice(0, 2), slice(-2, None)):
        ref_xq, ref_scale = quantize_fp8_row_op.reference(x.t()[rows].contiguous())
        torch.testing.assert_close(scale[rows], ref_scale, rtol=0, atol=0)
        testing.assert_fp8_equal(xq[rows], ref_xq)
