"""`f8f8bf16_cublas` (cuBLASLt FP8 GEMM; mslk.gemm.native.fp8_gemm).

T0: the reference against float64 math for every scale kind, validation errors, the output argument.
T2 (GPU): the cuBLAS backend against the float64 dequantized product on odd shapes (K and N not multiples of 16:
padded), 3-D A, both accumulation modes, tensorwise, missing and (sm_90) rowwise scales; bad devices.
"""

import pytest
import torch

from mslk.core import arch, formats, testing
from mslk.gemm.native import fp8_gemm as g
from mslk.gemm.native import library
from mslk.gemm.triton.fp8_gemm import quantize_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def oracle(xq, wq, x_scale=None, w_scale=None) -> torch.Tensor:
    """float64 (A · Bᵀ) · Ainvs · Binvs, each scale one value (tensorwise) or one per row (rowwise)."""
    out = torch.matmul(xq.double(), wq.double().T)
    if x_scale is not None:
        out = out * x_scale.double().reshape(*xq.shape[:-1], 1) if x_scale.numel() > 1 else out * x_scale.double()
    if w_scale is not None:
        out = out * w_scale.double().reshape(-1)
    return out


def inputs(shape_x, n, scales, device=DEVICE):
    """Quantized A [*shape_x] and B [n, K] with scales of the given kind: tensorwise, rowwise, none, mixed."""
    x = testing.randn(*shape_x, device=device, std=2.0)
    w = testing.randn(n, shape_x[-1], device=device, std=0.5)
    if scales == "rowwise":
        (xq, x_scale), (wq, w_scale) = quantize_rows(x), quantize_rows(w)
        return xq, wq, x_scale, w_scale
    xq, x_scale = g.quantize_tensor(x)
    wq, w_scale = g.quantize_tensor(w)
    if scales == "none":
        return xq, wq, None, None
    if scales == "mixed":  # rowwise A, tensorwise B
        xq, x_scale = quantize_rows(x)
    return xq, wq, x_scale, w_scale


SCALES = ["tensorwise", "rowwise", "none", "mixed"]


@pytest.mark.parametrize("scales", SCALES)
def test_reference_is_the_scaled_product(scales):
    xq, wq, xs, ws = inputs((3, 7, 48), 20, scales, device="cpu")
    out = g.f8f8bf16_cublas_op.reference(xq, wq, xs, ws)
    assert out.dtype == torch.bfloat16 and out.shape == (3, 7, 20)
    testing.assert_rel_close(out, oracle(xq, wq, xs, ws), 1e-2)
    output = testing.empty_poisoned(3, 7, 20, dtype=torch.bfloat16)
    assert torch.ops.mslk.f8f8bf16_cublas(xq, wq, xs, ws, True, output) is output
    testing.assert_rel_close(output, oracle(xq, wq, xs, ws), 1e-2)


def test_bad_inputs_raise_before_any_kernel():
    xq, wq, xs, ws = inputs((8, 32), 16, "tensorwise", device="cpu")
    op = torch.ops.mslk.f8f8bf16_cublas
    with pytest.raises(formats.ScaleFormatError, match=r"A: expected torch.float8_e4m3fn"):
        op(xq.to(torch.bfloat16), wq, xs, ws)
    with pytest.raises(ValueError, match="same K"):
        op(xq, wq[:, :16], xs, ws)
    with pytest.raises(ValueError, match=r"B \[N, K\]"):
        op(xq, wq[None], xs, ws)
    with pytest.raises(formats.ScaleFormatError, match=r"Ainvs: expected a rowwise scale.*tensorwise scale.*accepted"):
        op(xq, wq, torch.ones(9), ws)
    with pytest.raises(formats.ScaleFormatError, match=r"Binvs.*dtype torch.bfloat16"):
        op(xq, wq, xs, torch.ones(16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="output must be bfloat16"):
        op(xq, wq, xs, ws, True, torch.empty(8, 16))


# ------------------------------------------------------------------------------------------------ T2 (GPU)

# K and N off multiples of 16 (padded for cuBLASLt), M = 1 and odd M.
SHAPES = [((1, 16), 16), ((37, 64), 24), ((100, 200), 130), ((5, 33), 1000), ((2, 9, 128), 48), ((256, 1024), 512)]


def cublas():
    backend = g.f8f8bf16_cublas_op.get_backend("cublas")
    if backend.unavailable_reason is not None:
        pytest.fail(f"the cuBLAS backend is unavailable on this GPU machine: {backend.unavailable_reason}")
    return backend.impl


def skip_unless_rowwise(scales):
    if scales in ("rowwise", "mixed") and arch.capability() != (9, 0):
        pytest.skip("cuBLASLt scales FP8 by rows on sm_90 only")


@pytest.mark.gpu
@pytest.mark.parametrize(("shape_x", "n"), SHAPES, ids=str)
@pytest.mark.parametrize("scales", SCALES)
def test_gpu_cublas_matches_the_dequantized_product(shape_x, n, scales):
    skip_unless_rowwise(scales)
    xq, wq, xs, ws = inputs(shape_x, n, scales)
    for use_fast_accum in (True, False):
        out = cublas()(xq, wq, xs, ws, use_fast_accum)
        assert out.dtype == torch.bfloat16 and out.shape == (*shape_x[:-1], n) and out.is_contiguous()
        testing.assert_rel_close(out, oracle(xq, wq, xs, ws), 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [48, 40])  # written in place, or through a copy of the padded result
def test_gpu_output_argument(n):
    xq, wq, xs, ws = inputs((70, 96), n, "tensorwise")
    output = testing.empty_poisoned(70, n, dtype=torch.bfloat16, device=DEVICE)
    assert g.f8f8bf16_cublas(xq, wq, xs, ws, output=output) is output
    testing.assert_rel_close(output, oracle(xq, wq, xs, ws), 1e-2)


@pytest.mark.gpu
def test_gpu_dispatch_and_errors():
    xq, wq, xs, ws = inputs((64, 64), 32, "tensorwise")
    assert g.f8f8bf16_cublas_op.select((xq, wq, xs, ws), {}).name == "cublas"
    with pytest.raises(ValueError, match="one device"):
        g.f8f8bf16_cublas(xq, wq.cpu(), xs, ws)
    with pytest.raises(ValueError, match="one device"):
        g.f8f8bf16_cublas(xq, wq, xs.cpu(), ws)
    empty = g.f8f8bf16_cublas(xq[:0], wq, xs, ws)
    assert empty.shape == (0, 32)
    assert g.f8f8bf16_cublas(xq[:, :0], wq[:, :0], xs, ws).abs().max() == 0
    if arch.capability() != (9, 0):
        xq, wq, xs, ws = inputs((64, 64), 32, "rowwise")
        with pytest.raises(NotImplementedError, match="on sm_90 only"):
            g.f8f8bf16_cublas(xq, wq, xs, ws)


@pytest.mark.gpu
def test_gpu_misaligned_views_are_copied():
    """Contiguous views starting 1 byte into their storage are not 16-byte aligned: the backend copies them."""
    xq, wq, xs, ws = inputs((33, 64), 32, "tensorwise")
    xv, wv = (torch.empty(1 + t.numel(), dtype=t.dtype, device=DEVICE)[1:].view_as(t).copy_(t) for t in (xq, wq))
    assert xv.is_contiguous() and xv.data_ptr() % 16 and library.tn_operand(xv, 33, 64).data_ptr() % 16 == 0
    testing.assert_rel_close(cublas()(xv, wv, xs, ws), oracle(xq, wq, xs, ws), 1e-2)
