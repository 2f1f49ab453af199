"""The other layouts of the grouped GEMMs (spec G-04, G-05, G-07..G-11): the deprecated list and padded forms and
torch._scaled_grouped_mm's offsets forms (2D x 3D, 3D x 2D, 2D x 2D, 3D x 3D).

T1 (CPU, interpreter) and T2 (GPU): the kernel against float64 math per group, with empty groups, N and K off
the tile sizes, offsets ending short of the rows and non-monotone offsets (empty groups), poisoned outputs;
errors; CUDA-graph capture (GPU).
"""

import itertools

import pytest
import torch

from mslk.core import arch, testing
from mslk.gemm.triton import grouped_gemm_forms as f
from mslk.gemm.triton.fp8_gemm import quantize_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def kernel(op):
    return op.get_backend("triton").impl


def fp8_rows(*shape, std=1.0):
    return quantize_rows(testing.randn(*shape, device=DEVICE, std=std))


def scaled(xq, x_scale, wq, w_scale):
    """float64 (xq · wqᵀ) · x_scale[:, None] · w_scale[None, :] for 2-D xq [M, K] and wq [N, K]."""
    return (xq.double() @ wq.double().T) * x_scale.double()[:, None] * w_scale.double()[None, :]


# ---------------------------------------------------------------------------------- list forms (G-04/05/09/10)


@pytest.mark.parametrize("sizes", [[13], [5, 0, 40, 2]], ids=str)
def test_list_forms(sizes):
    n, k = 36, 40
    x = [testing.randn(m, k, dtype=torch.bfloat16, device=DEVICE) for m in sizes]
    w = [testing.randn(n, k, dtype=torch.bfloat16, device=DEVICE) for _ in sizes]
    expected = [xi.double() @ wi.double().T for xi, wi in zip(x, w, strict=True)]
    outs = kernel(f.bf16bf16bf16_grouped_op)(x, w)
    assert [o.shape for o in outs] == [(m, n) for m in sizes]
    for out, ref in zip(outs, expected, strict=True):
        testing.assert_rel_close(out, ref, 1e-2)
    testing.assert_rel_close(kernel(f.bf16bf16bf16_grouped_cat_op)(x, w), torch.cat(expected), 1e-2)

    xq, xs = zip(*(fp8_rows(m, k) for m in sizes), strict=True)
    wq, ws = zip(*(fp8_rows(n, k) for _ in sizes), strict=True)
    expected = [scaled(*args) for args in zip(xq, xs, wq, ws, strict=True)]
    outs = kernel(f.f8f8bf16_rowwise_grouped_op)(list(xq), list(wq), list(xs), list(ws))
    for out, ref in zip(outs, expected, strict=True):
        assert out.dtype == torch.bfloat16
        testing.assert_rel_close(out, ref, 1e-2)
    cat = kernel(f.f8f8bf16_rowwise_grouped_cat_op)(list(xq), list(wq), list(xs), list(ws))
    testing.assert_rel_close(cat, torch.cat(expected), 1e-2)


# ------------------------------------------------------------------------------- padded forms (G-07, G-11)


def padded_oracle(x, w, valid, x_scale=None, w_scale=None):
    """float64 [G, M, N]: group g's first valid[g] rows times w[g]ᵀ (scaled), zero below."""
    out = torch.zeros(*x.shape[:2], w.shape[1], dtype=torch.float64, device=x.device)
    for group, m in enumerate(valid):
        m = min(m, x.shape[1])
        if x_scale is None:
            out[group, :m] = x[group, :m].double() @ w[group].double().T
        else:
            out[group, :m] = scaled(x[group, :m], x_scale[group, :m], w[group], w_scale[group])
    return out


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32], ids=str)
def test_dynamic(index_dtype):
    groups, m, n, k = 4, 37, 40, 72
    valid = [7, 0, 37, 100]  # past M: the whole group
    zero_start = torch.tensor(valid, dtype=index_dtype, device=DEVICE)
    x = testing.randn(groups, m, k, dtype=torch.bfloat16, device=DEVICE)
    w = testing.randn(groups, n, k, dtype=torch.bfloat16, device=DEVICE)
    out = kernel(f.bf16bf16bf16_grouped_dynamic_op)(x, w, zero_start)
    expected = padded_oracle(x, w, valid)
    testing.assert_rel_close(out, expected, 1e-2)
    assert (out[0, 7:] == 0).all() and (out[1] == 0).all()

    (xq, xs), (wq, ws) = fp8_rows(groups, m, k), fp8_rows(groups, n, k)
    out = kernel(f.f8f8bf16_rowwise_grouped_dynamic_op)(xq, wq, xs, ws, zero_start)
    assert out.dtype == torch.bfloat16
    testing.assert_rel_close(out, padded_oracle(xq, wq, valid, xs, ws), 1e-2)
    assert (out[1] == 0).all()
    skipped = kernel(f.f8f8bf16_rowwise_grouped_dynamic_op)(xq, wq, xs, ws, zero_start, False)  # pads not written
    testing.assert_rel_close(skipped[0, :7], out[0, :7], 0.0)
    testing.assert_rel_close(skipped[2:], out[2:], 0.0)


@pytest.mark.parametrize(("groups", "m", "n", "k"), [(0, 5, 8, 16), (3, 0, 8, 16), (3, 5, 8, 0)], ids=str)
def test_dynamic_empty(groups, m, n, k):
    """No group, no rows per group, K = 0 (zeros), through the kernel and torch.ops alike."""
    zero_start = torch.full((groups,), m, device=DEVICE)
    x, w = testing.randn(groups, m, k, device=DEVICE), testing.randn(groups, n, k, device=DEVICE)
    (xq, xs), (wq, ws) = quantize_rows(x), quantize_rows(w)
    for op, args in [
        (f.bf16bf16bf16_grouped_dynamic_op, (x.bfloat16(), w.bfloat16(), zero_start)),
        (f.f8f8bf16_rowwise_grouped_dynamic_op, (xq, wq, xs, ws, zero_start)),
    ]:
        for out in (kernel(op)(*args), op(*args)):
            assert out.shape == (groups, m, n) and (out == 0).all()


# ---------------------------------------------------------------------------------- grouped_mm forms (G-08)


def ends(sizes):
    return torch.tensor(sizes, device=DEVICE).cumsum(0).to(torch.int32)


def test_grouped_mm_2d_3d():
    sizes, n, k = [10, 0, 33, 2], 40, 72
    rows = sum(sizes) + 5  # rows past offsets[-1]: zero
    (xq, xs), (wq, ws) = fp8_rows(rows, k, std=2.0), fp8_rows(len(sizes), n, k)
    output = testing.empty_poisoned(rows, n, dtype=torch.bfloat16, device=DEVICE)
    assert kernel(f.f8f8bf16_rowwise_grouped_mm_op)(xq, wq.mT, xs, ws, ends(sizes), output) is output
    expected, start = torch.zeros(rows, n, dtype=torch.float64), 0
    for group, m in enumerate(sizes):
        expected[start : start + m] = scaled(xq[start : start + m], xs[start : start + m], wq[group], ws[group])
        start += m
    testing.assert_rel_close(output, expected, 1e-2)
    assert (output[sum(sizes) :] == 0).all()


def test_grouped_mm_3d_2d():
    sizes, m, k = [24, 0, 17], 30, 64  # offsets over N
    (xq, xs), (wq, ws) = fp8_rows(len(sizes), m, k), fp8_rows(sum(sizes), k)
    output = testing.empty_poisoned(m, sum(sizes), dtype=torch.bfloat16, device=DEVICE)
    kernel(f.f8f8bf16_rowwise_grouped_mm_op)(xq, wq.T, xs, ws, ends(sizes), output)
    expected, start = torch.zeros(m, sum(sizes), dtype=torch.float64), 0
    for group, n in enumerate(sizes):
        expected[:, start : start + n] = scaled(xq[group], xs[group], wq[start : start + n], ws[start : start + n])
        start += n
    testing.assert_rel_close(output, expected, 1e-2)


def test_grouped_mm_2d_2d():
    sizes, m, n = [40, 0, 100, 7], 20, 36  # offsets over K; each K slice quantized on its own
    bounds = list(itertools.pairwise([0, *itertools.accumulate(sizes)]))
    x, w = testing.randn(m, sum(sizes), device=DEVICE), testing.randn(n, sum(sizes), device=DEVICE)
    xq, wq = torch.empty_like(x, dtype=arch.fp8_dtype(DEVICE)), torch.empty_like(w, dtype=arch.fp8_dtype(DEVICE))
    xs, ws = torch.ones(len(sizes), m, device=DEVICE), torch.ones(len(sizes), n, device=DEVICE)
    for g, (a, b) in enumerate(bounds):
        if b > a:
            (xq[:, a:b], xs[g]), (wq[:, a:b], ws[g]) = quantize_rows(x[:, a:b]), quantize_rows(w[:, a:b])
    output = testing.empty_poisoned(len(sizes), m, n, dtype=torch.bfloat16, device=DEVICE)
    kernel(f.f8f8bf16_rowwise_grouped_mm_op)(xq, wq.T, xs, ws, ends(sizes), output)  # WQ [ΣK, N], column-major
    expected = torch.stack([scaled(xq[:, a:b], xs[g], wq[:, a:b], ws[g]) for g, (a, b) in enumerate(bounds)])
    testing.assert_rel_close(output, expected, 1e-2)
    assert (output[1] == 0).all()


def test_grouped_mm_3d_3d_and_odd_offsets():
    groups, m, n, k = 3, 20, 24, 64
    (xq, xs), (wq, ws) = fp8_rows(groups, m, k), fp8_rows(groups, n, k)
    output = testing.empty_poisoned(groups, m, n, dtype=torch.bfloat16, device=DEVICE)
    kernel(f.f8f8bf16_rowwise_grouped_mm_op)(xq, wq.mT, xs, ws, None, output)
    testing.assert_rel_close(output, padded_oracle(xq, wq, [m] * groups, xs, ws), 1e-2)

    # Non-monotone offsets: a group ending before its start is empty, one ending past the rows is cut there.
    (xq, xs) = fp8_rows(40, k)
    offsets = torch.tensor([30, 10, 60], dtype=torch.int32, device=DEVICE)  # groups [0, 30), [30, 30), [30, 40)
    output = testing.empty_poisoned(40, n, dtype=torch.bfloat16, device=DEVICE)
    kernel(f.f8f8bf16_rowwise_grouped_mm_op)(xq, wq.mT, xs, ws, offsets, output)
    expected = torch.cat([scaled(xq[:30], xs[:30], wq[0], ws[0]), scaled(xq[30:], xs[30:], wq[2], ws[2])])
    testing.assert_rel_close(output, expected, 1e-2)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: f.bf16bf16bf16_grouped(
                [torch.rand(3, 8).bfloat16()] * 2, [torch.rand(4, 8).bfloat16(), torch.rand(5, 8).bfloat16()]
            ),
            "one N and K for all groups",
        ),
        (lambda: f.bf16bf16bf16_grouped([torch.rand(3, 8).bfloat16()], []), "equally long, non-empty lists"),
        (lambda: f.bf16bf16bf16_grouped([], []), "equally long, non-empty lists X and W, got 0 and 0"),
        (lambda: f.f8f8bf16_rowwise_grouped_cat([], [], [], []), "equally long, non-empty lists X and W, got 0"),
        (
            lambda: f.bf16bf16bf16_grouped_dynamic(
                torch.rand(2, 3, 8).bfloat16(), torch.rand(2, 4, 8).bfloat16(), torch.tensor([1, 2, 3])
            ),
            r"zero_start_index_M must be int32/int64 \[G\] = \[2\]",
        ),
        (
            lambda: f.f8f8bf16_rowwise_grouped_mm(
                fp8_rows(6, 16)[0],
                fp8_rows(2, 4, 16)[0].mT,
                torch.rand(6),
                torch.rand(2, 4),
                None,
                torch.empty(6, 4).bfloat16(),
            ),
            "needs offsets",
        ),
    ],
)
def test_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.gpu
def test_forms_gpu_and_cuda_graph():
    groups, m, n, k = 8, 512, 1024, 2048
    sizes = [m + (i % 3 - 1) * (m // 4) for i in range(groups)]
    sizes[2] = 0
    (xq, xs), (wq, ws) = fp8_rows(sum(sizes), k), fp8_rows(groups, n, k)
    offsets = ends(sizes)
    output = torch.empty(sum(sizes), n, dtype=torch.bfloat16, device="cuda")
    f.f8f8bf16_rowwise_grouped_mm(xq, wq.mT, xs, ws, offsets, output)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        f.f8f8bf16_rowwise_grouped_mm(xq, wq.mT, xs, ws, offsets, output)
    new_sizes = [0] * (groups - 1) + [sum(sizes)]
    offsets.copy_(ends(new_sizes))  # new offsets, same graph
    graph.replay()
    testing.assert_rel_close(output, scaled(xq, xs, wq[-1], ws[-1]), 1e-2)

    x3, w3 = (
        testing.randn(groups, m, k, dtype=torch.bfloat16, device="cuda"),
        testing.randn(groups, n, k, device="cuda"),
    )
    valid = torch.tensor(sizes, device="cuda")
    out = f.bf16bf16bf16_grouped_dynamic(x3, w3.bfloat16(), valid)
    testing.assert_rel_close(out, padded_oracle(x3, w3.bfloat16(), sizes), 1e-2)


@pytest.mark.gpu
@pytest.mark.big_memory
def test_gpu_grouped_mm_3d_2d_output_past_two_to_the_31():
    """3D x 2D runs the transposed problem on output.T, whose column stride is ΣN: rows m of [M, ΣN] = [65536,
    49152] start past 2**31 elements from m = 43691 on (their offsets once wrapped in int32)."""
    m, n, k = 65536, 49152, 128
    (xq, xs), (wq, ws) = fp8_rows(1, m, k), fp8_rows(n, k)
    output = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    f.f8f8bf16_rowwise_grouped_mm(xq, wq.T, xs, ws, torch.tensor([n], dtype=torch.int32, device="cuda"), output)
    for row in (0, 43690, 43691, m - 1):
        expected = scaled(xq[0, row : row + 1], xs[0, row : row + 1], wq, ws)
        testing.assert_rel_close(output[row : row + 1], expected, 1e-2, what=f"row {row}")


@pytest.mark.parametrize("form", ["2D x 3D", "3D x 3D"])
@pytest.mark.parametrize(("groups", "k"), [(0, 16), (2, 0)], ids=str)
def test_grouped_mm_empty(form, groups, k):
    """No group, or K = 0: zeros (rows past the offsets included), through the kernel and torch.ops alike."""
    m, n = 6, 8
    (wq, ws) = fp8_rows(groups, n, k)
    if form == "2D x 3D":
        (xq, xs), offsets = fp8_rows(m, k), ends([m // max(groups, 1)] * groups)
        shape = (m, n)
    else:
        (xq, xs), offsets = fp8_rows(groups, m, k), None
        shape = (groups, m, n)
    for run in (kernel(f.f8f8bf16_rowwise_grouped_mm_op), f.f8f8bf16_rowwise_grouped_mm_op):
        output = testing.empty_poisoned(*shape, dtype=torch.bfloat16, device=DEVICE)
        assert run(xq, wq.mT, xs, ws, offsets, output) is output and (output == 0).all()
