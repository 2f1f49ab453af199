"""The cuBLAS backends that mslk.gemm.native adds to ops defined in mslk.gemm.triton (T2, GPU): bf16x9_gemm
(cuBLAS's BF16x9 FP32 emulation, sm_100/sm_103) and i8i8bf16 (cuBLASLt INT8), each against float64 math, on odd
shapes and strided layouts; where a backend declines, the reason and the backend that serves instead.
"""

import pytest
import torch

from mslk.core import arch, testing
from mslk.gemm.native import library
from mslk.gemm.native.int8_gemm import int32_product
from mslk.gemm.triton.bf16x9_gemm import bf16x9_gemm_op
from mslk.gemm.triton.int8_gemm import i8i8bf16_dynamic_op, i8i8bf16_op, random_int8

pytestmark = pytest.mark.gpu


def test_bf16x9_cublas_serves_blackwell_and_leaves_other_gpus_to_triton():
    A, B = testing.randn(100, 300, device="cuda"), testing.randn(70, 300, device="cuda")
    backend = bf16x9_gemm_op.get_backend("cublas")
    if library.missing() is not None:
        pytest.fail(f"the native library is missing on this GPU machine: {library.missing()}")
    if arch.capability()[0] != 10:
        assert "sm_100/sm_103 only" in backend.unavailable_reason
        assert bf16x9_gemm_op.select((A, B), {}).name == "triton"
    else:
        assert bf16x9_gemm_op.select((A, B), {}).name == "cublas"


LAYOUTS = {
    "row-major": lambda t: t,
    "transposed": lambda t: t.T.contiguous().T,  # column-major, passed as is
    "strided rows": lambda t: testing.padded_rows(t, 5),
    "no unit stride": lambda t: torch.empty(*t.shape, 2, device=t.device)[..., 0].copy_(t),  # copied first
}


@pytest.mark.parametrize(("m", "n", "k"), [(1, 1, 1), (37, 24, 100), (1000, 1500, 777), (4096, 4096, 4096)], ids=str)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_bf16x9_cublas_is_fp32_accurate(m, n, k, layout):
    if arch.capability()[0] != 10:
        pytest.skip("cuBLAS emulates FP32 with BF16x9 on sm_100/sm_103 only")
    A = LAYOUTS[layout](testing.randn(m, k, device="cuda"))
    B = LAYOUTS[layout](testing.randn(n, k, device="cuda"))
    expected = A.double() @ B.double().T
    out = bf16x9_gemm_op(A, B, backend="cublas")
    assert out.dtype == torch.float32 and out.shape == (m, n)
    testing.assert_rel_close(out, expected, 1e-5)
    bf16_error = testing.rel_error(A.bfloat16().double() @ B.bfloat16().double().T, expected)
    assert testing.rel_error(out, expected) < bf16_error / 100, "clearly better than one bf16 product"
    output = testing.empty_poisoned(n, m, dtype=torch.float32, device="cuda").T  # a column-major output: copied into
    assert bf16x9_gemm_op(A, B, output, backend="cublas") is output
    testing.assert_rel_close(output, expected, 1e-5)


# K and N off multiples of 16 (padded), M = 1, a strided XQ (copied).
@pytest.mark.parametrize(("m", "n", "k"), [(1, 16, 16), (37, 40, 200), (5, 1000, 33), (300, 512, 4096)], ids=str)
def test_int8_cublas_product_is_exact_and_scaled(m, n, k):
    if library.missing() is not None:
        pytest.fail(f"the native library is missing on this GPU machine: {library.missing()}")
    xq = testing.padded_rows(random_int8(m, k, device="cuda"), 3)
    wq = random_int8(n, k, device="cuda")
    exact = xq.double() @ wq.double().T  # integer sums below 2^53: exact
    product = int32_product(xq, wq)
    assert product.dtype == torch.int32 and torch.equal(product.double(), exact)
    scale = 1.7e-3
    for op, s in ((i8i8bf16_op, scale), (i8i8bf16_dynamic_op, torch.tensor([scale], device="cuda"))):
        out = op(xq, wq, s, backend="cublas")
        assert out.dtype == torch.bfloat16 and out.shape == (m, n)
        testing.assert_rel_close(out, exact * scale, 1e-2)
        assert op.select((xq, wq, s), {}).name == "triton", "cuBLAS comes after the Triton kernel"
