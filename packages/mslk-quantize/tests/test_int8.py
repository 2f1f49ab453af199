"""Rowwise INT8 quantization (quantize_int8_row).

T0: the reference against the formula; errors; compile/export. T1 (CPU, interpreter) and T2 (GPU): the
Triton kernel against the reference, bit for bit.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mslk.core import testing
from mslk.quantize import reference
from mslk.quantize.triton import int8_quantize as i8
from mslk.quantize.triton.fp8_quantize import dequantize_fp8_row

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_reference_rounds_half_to_even_and_saturates_at_127():
    # amax 127 makes the factor 1, so the values are rounded as they are.
    row = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, 126.4, -127.0, 3.0]])
    xq, scale = reference.quantize_int8_row(row, None, 1e-12)
    assert xq.dtype == torch.int8 and scale.item() == 1.0
    assert xq.tolist() == [[127, 0, 2, 2, 0, -2, 126, -127, 3]]
    bounded, bounded_scale = reference.quantize_int8_row(row, torch.tensor([63.5]), 1e-12)
    assert bounded_scale.item() == 0.5 and bounded[0, 0] == 127 and bounded[0, 8] == 6, "scale_ub clamps"


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(0, 5), k=st.integers(1, 300), std=st.floats(1e-3, 1e3))
def test_reference_round_trip_within_half_a_step(rows, k, std):
    x = testing.randn(rows, k, std=std)
    xq, scale = reference.quantize_int8_row(x, None, 1e-12)
    assert xq.shape == x.shape and scale.shape == (rows,)
    err = (dequantize_fp8_row(xq, scale).float() - x).abs()
    # Half a step of rounding, plus the bf16 rounding of the dequantized value: 2^-8 of it at most, which is up to
    # half a step larger than |x| (|x| alone failed: x = -0.13349, step 0.26676, dequantized -0.26758).
    half_step = scale[:, None] / 2
    assert (err <= half_step * 1.0001 + (x.abs() + half_step) * 2**-8).all()
    if rows:
        assert (xq.abs().amax(dim=-1) == 127).all(), "the largest element of each row maps to ±127"


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: i8.quantize_int8_row(torch.ones(2, 4, dtype=torch.int32)), "float32, float16 or bfloat16"),
        (lambda: i8.quantize_int8_row(torch.ones(())), "at least one dimension"),
        (lambda: i8.quantize_int8_row(torch.ones(2, 4), torch.ones(2)), "scale_ub must be one float32 value"),
    ],
)
def test_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_compile_and_export():
    class Quantize(torch.nn.Module):
        def forward(self, x):
            return i8.quantize_int8_row(x)

    x = testing.randn(4, 3, 40, dtype=torch.bfloat16)
    xq, scale = torch.compile(Quantize(), fullgraph=True, backend="aot_eager")(x)
    assert xq.dtype == torch.int8 and xq.shape == x.shape and scale.shape == (4, 3)
    assert "mslk.quantize_int8_row" in str(torch.export.export(Quantize(), (x,)).graph)


# -------------------------------------------------------------------------- T1 (CPU) / T2 (GPU)


@pytest.mark.parametrize(
    "shape", [(1, 8192), (7, 5), (33, 130), (2, 3, 257), (2, 2, 3, 16), (0, 64), (5,), (4, 9000)], ids=str
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_kernel_matches_reference(shape, dtype):
    x = testing.randn(*shape, dtype=dtype, device=DEVICE, std=4.0)
    xq, scale = i8.quantize_int8_row_op.get_backend("triton").impl(x)
    rq, rs = reference.quantize_int8_row(x.cpu(), None, 1e-12)
    assert torch.equal(xq.cpu(), rq) and torch.equal(scale.cpu(), rs)


def test_kernel_ties_special_values_strides_and_scale_ub():
    x = testing.randn(6, 130, device=DEVICE)
    x[0, :5] = torch.tensor([127.0, 0.5, 1.5, 2.5, -2.5])  # amax 127: exact ties
    x[0, 5:] = x[0, 5:].clamp(-126, 126)
    x[1, 3], x[2, 7], x[3] = float("nan"), float("inf"), 0.0
    transposed = testing.randn(130, 6, device=DEVICE).t()
    for inp, ub in ((x, None), (x, torch.tensor([1.5], device=DEVICE)), (transposed, None)):
        xq, scale = i8.quantize_int8_row_op.get_backend("triton").impl(inp, ub)
        rq, rs = reference.quantize_int8_row(inp.cpu(), None if ub is None else ub.cpu(), 1e-12)
        assert torch.equal(xq.cpu(), rq)
        torch.testing.assert_close(scale.cpu(), rs, rtol=0, atol=0, equal_nan=True)
        if inp is x:
            assert rs[1].isnan() and rq[1, 3] == 0, "a NaN row: NaN scale, its NaN element 0"
