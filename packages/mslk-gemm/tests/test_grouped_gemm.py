"""Grouped GEMMs of stacked groups (spec G-06, G-12): bf16bf16bf16_grouped_stacked, f8f8bf16_rowwise_grouped_stacked.

T1 (CPU, interpreter) and T2 (GPU): the persistent Triton kernel against per-group float64 matmuls, with ragged
and empty groups, sizes summing short of the rows (those rows are zero), int32 and int64 M_sizes; errors.
"""

import pytest
import torch

from mslk.core import testing
from mslk.gemm.triton import grouped_gemm as g
from mslk.gemm.triton.fp8_gemm import quantize_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def kernel(op):
    return op.get_backend("triton").impl


def oracle(x, w, sizes, x_scale=None, w_scale=None):
    out = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float64, device=x.device)
    start = 0
    for group, m in enumerate(sizes):
        part = x[start : start + m].double() @ w[group].double().T
        if x_scale is not None:
            part = part * x_scale[start : start + m, None].double() * w_scale[group][None, :].double()
        out[start : start + m] = part
        start += m
    return out


CASES = [
    # (rows of X, group sizes, N, K)
    (37, [10, 0, 27], 24, 64),
    (5, [1, 1, 3, 0], 130, 48),
    (300, [129, 0, 1, 170], 70, 200),
    (50, [7, 3], 33, 32),  # sizes sum to 10 of 50 rows: the rest is zero
    (0, [0, 0], 16, 32),
]


@pytest.mark.parametrize(("rows", "sizes", "n", "k"), CASES, ids=str)
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32], ids=str)
def test_bf16_grouped(rows, sizes, n, k, index_dtype):
    _check_bf16(rows, sizes, n, k, index_dtype, DEVICE)


@pytest.mark.parametrize(("rows", "sizes", "n", "k"), CASES, ids=str)
def test_fp8_grouped(rows, sizes, n, k):
    _check_fp8(rows, sizes, n, k, DEVICE)


def _check_bf16(rows, sizes, n, k, index_dtype, device, dtype=torch.bfloat16):
    x = testing.randn(rows, k, dtype=dtype, device=device)
    w = testing.randn(len(sizes), n, k, dtype=dtype, device=device)
    m_sizes = torch.tensor(sizes, dtype=index_dtype, device=device)
    out = kernel(g.bf16bf16bf16_grouped_stacked_op)(x, w, m_sizes)
    assert out.dtype == dtype and out.shape == (rows, n)
    expected = oracle(x, w, sizes)
    testing.assert_rel_close(out, expected, 1e-2)
    assert (out[sum(sizes) :] == 0).all()
    poisoned = testing.empty_poisoned(rows, n, dtype=dtype, device=device)
    assert kernel(g.bf16bf16bf16_grouped_stacked_op)(x, w, m_sizes, poisoned, 2) is poisoned
    testing.assert_rel_close(poisoned, expected, 1e-2)


def _check_fp8(rows, sizes, n, k, device):
    xq, x_scale = quantize_rows(testing.randn(rows, k, device=device, std=3.0))
    wq, w_scale = quantize_rows(testing.randn(len(sizes), n, k, device=device))
    m_sizes = torch.tensor(sizes, device=device)
    out = kernel(g.f8f8bf16_rowwise_grouped_stacked_op)(xq, wq, x_scale, w_scale, m_sizes)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    testing.assert_rel_close(out, oracle(xq, wq, sizes, x_scale, w_scale), 1e-2)
    assert (out[sum(sizes) :] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("groups", "rows_per_group", "n", "k"), [(8, 2048, 4096, 7168), (64, 128, 2048, 7168), (128, 17, 512, 256)]
)
def test_grouped_gpu(groups, rows_per_group, n, k):
    sizes = [rows_per_group + (i % 3 - 1) * (rows_per_group // 4) for i in range(groups)]
    _check_bf16(sum(sizes), sizes, n, k, torch.int64, "cuda")
    _check_bf16(sum(sizes), sizes, n, k, torch.int32, "cuda", torch.float16)
    _check_fp8(sum(sizes), sizes, n, k, "cuda")


@pytest.mark.gpu
def test_grouped_records_into_a_cuda_graph():
    x = testing.randn(300, 128, dtype=torch.bfloat16, device="cuda")
    w = testing.randn(4, 96, 128, dtype=torch.bfloat16, device="cuda")
    m_sizes = torch.tensor([100, 0, 150, 50], device="cuda")
    g.bf16bf16bf16_grouped_stacked(x, w, m_sizes)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = g.bf16bf16bf16_grouped_stacked(x, w, m_sizes)
    m_sizes.copy_(torch.tensor([0, 300, 0, 0]))  # new sizes, same graph
    graph.replay()
    testing.assert_rel_close(out, oracle(x, w, [0, 300, 0, 0]), 1e-2)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: g.bf16bf16bf16_grouped_stacked(torch.rand(4, 8), torch.rand(2, 3, 8), torch.tensor([2, 2])),
            "bfloat16",
        ),
        (
            lambda: g.bf16bf16bf16_grouped_stacked(
                torch.rand(4, 8).bfloat16(), torch.rand(2, 3, 9).bfloat16(), torch.tensor([2, 2])
            ),
            "same K",
        ),
        (
            lambda: g.bf16bf16bf16_grouped_stacked(
                torch.rand(4, 8).bfloat16(), torch.rand(2, 3, 8).bfloat16(), torch.tensor([2.0, 2.0])
            ),
            r"M_sizes must be int32/int64 \[G\] = \[2\]",
        ),
    ],
)
def test_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()
