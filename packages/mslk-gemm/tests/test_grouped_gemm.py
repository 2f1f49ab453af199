"""Grouped GEMMs of stacked groups (spec G-06, G-12, G-13, G-14, G-17, G-53..G-55, G-58): the stacked forward
(bf16/fp16, FP8 rowwise, FP8 groupwise), dgrad, wgrad, and the Triton entry points grouped_gemm(_fp8_rowwise)
with the fused scatter-add.

T1 (CPU, interpreter) and T2 (GPU): the persistent Triton kernel against per-group float64 matmuls, with ragged
and empty groups (G from 1 to 128), sizes summing short of the rows (those rows are zero), int32 and int64
M_sizes, N and K off the tile sizes, poisoned outputs; errors; CUDA-graph capture (GPU).
"""

import functools

import pytest
import torch

from mslk.core import testing
from mslk.gemm.triton import grouped_gemm as g
from mslk.gemm.triton.fp8_gemm import quantize_rows
from mslk.gemm.triton.fp8_groupwise_grouped_gemm import matmul_f8f8bf16_groupwise_grouped

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
    (420, [260, 140], 300, 32),  # groups of several rows and columns of tiles (the tile order's bands)
    (9, [4, 5], 24, 0),  # K = 0: zeros
    (9, [], 24, 32),  # no group: every row is past their (empty) sum
]


@pytest.mark.parametrize(("rows", "sizes", "n", "k"), CASES, ids=str)
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32], ids=str)
def test_bf16_grouped(rows, sizes, n, k, index_dtype):
    _check_bf16(rows, sizes, n, k, index_dtype, DEVICE)


def test_sizes_past_int32_hold_the_rows_left():
    """An int64 size of 2^31 or more takes the rows left, as the reference clamps it (the kernel once cut it to 32
    bits first: 2^32 + 3 rows became 3)."""
    for sizes in ([5, 2**32 + 3], [2**31, 4]):
        _check_bf16(37, sizes, 24, 64, torch.int64, DEVICE)
        _check_fp8(37, sizes, 24, 64, DEVICE)


def test_fp16_inputs_give_bf16():
    """The bf16bf16bf16 forms return bf16 for fp16 inputs, as the reference library allocates them (spec §5.1)."""
    x, w = testing.randn(9, 32, dtype=torch.float16), testing.randn(2, 24, 32, dtype=torch.float16)
    sizes = torch.tensor([4, 5])
    n_major = w.mT.contiguous().mT  # as the dgrad reads the forward's [G, K, N] weights
    for op, weights in ((g.bf16bf16bf16_grouped_stacked_op, w), (g.bf16bf16bf16_grouped_grad_op, n_major)):
        for impl in (op.reference, kernel(op)):
            out = impl(x, weights, sizes)
            assert out.dtype == torch.bfloat16
            testing.assert_rel_close(out, oracle(x, w, [4, 5]), 1e-2)
    dw = g.bf16bf16bf16_grouped_wgrad(testing.randn(9, 24, dtype=torch.float16), x, sizes)
    assert dw.dtype == torch.bfloat16 and dw.shape == (2, 24, 32)


@pytest.mark.parametrize(("rows", "sizes", "n", "k"), CASES, ids=str)
def test_fp8_grouped(rows, sizes, n, k):
    _check_fp8(rows, sizes, n, k, DEVICE)


def _check_bf16(rows, sizes, n, k, index_dtype, device, dtype=torch.bfloat16):
    x = testing.randn(rows, k, dtype=dtype, device=device)
    w = testing.randn(len(sizes), n, k, dtype=dtype, device=device)
    m_sizes = torch.tensor(sizes, dtype=index_dtype, device=device)
    out = kernel(g.bf16bf16bf16_grouped_stacked_op)(x, w, m_sizes)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n), "bf16, as the name says (fp16 inputs too)"
    expected = oracle(x, w, sizes)
    testing.assert_rel_close(out, expected, 1e-2)
    assert (out[sum(sizes) :] == 0).all()
    poisoned = testing.empty_poisoned(rows, n, dtype=dtype, device=device)  # an `out` of the inputs' dtype
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
@pytest.mark.parametrize(
    ("sizes", "n", "k"), [([300, 0, 77, 1024, 5], 600, 528), ([64] * 37 + [0, 3, 200], 136, 256)], ids=str
)
def test_hopper_kernel_serves_the_fp8_stacked_forward(sizes, n, k, monkeypatch):
    """On sm_90 the stacked rowwise FP8 forward runs grouped_gemm_hopper's Gluon kernel (here below its dispatch
    size): ragged and empty groups, rows past the groups' sum (zeros), N and K off the tiles, 3 programs walking all
    tiles, into a poisoned output whose rows are padded; also as torch._grouped_mm's offsets (cumulative ends).
    bf16 stays on the Triton kernel."""
    from mslk.core import arch
    from mslk.gemm.triton import grouped_gemm_forms, grouped_gemm_hopper

    if arch.capability(torch.device("cuda")) != (9, 0):
        pytest.skip("the Gluon grouped kernel serves sm_90")
    launches = []
    run = grouped_gemm_hopper.run
    monkeypatch.setattr(grouped_gemm_hopper, "run", lambda *args, **kwargs: launches.append(1) or run(*args, **kwargs))
    monkeypatch.setattr(grouped_gemm_hopper, "MIN_MACS", 0)
    rows = sum(sizes) + 50
    m_sizes = torch.tensor(sizes, device="cuda")
    xq, x_scale = quantize_rows(testing.randn(rows, k, device="cuda", std=3.0))
    wq, w_scale = quantize_rows(testing.randn(len(sizes), n, k, device="cuda"))
    expected = oracle(xq, wq, sizes, x_scale, w_scale)
    out = testing.padded_rows(testing.empty_poisoned(rows, n, dtype=torch.bfloat16, device="cuda"))
    g._run_grouped(xq, wq, out, m_sizes, a_scale=x_scale, b_scale=w_scale, scales=g.ROWWISE, num_sms=3)
    testing.assert_rel_close(out, expected, 1e-2)
    assert (out[sum(sizes) :] == 0).all()
    output = testing.empty_poisoned(rows, n, dtype=torch.bfloat16, device="cuda")
    grouped_gemm_forms.f8f8bf16_rowwise_grouped_mm(xq, wq.mT, x_scale, w_scale, m_sizes.cumsum(0).int(), output)
    testing.assert_rel_close(output[: sum(sizes)], expected[: sum(sizes)], 1e-2)
    assert len(launches) == 2
    x = testing.randn(rows, k, dtype=torch.bfloat16, device="cuda")
    g.bf16bf16bf16_grouped_stacked(x, testing.randn(len(sizes), n, k, dtype=torch.bfloat16, device="cuda"), m_sizes)
    assert len(launches) == 2


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
        (
            lambda: g.bf16bf16bf16_grouped_stacked(
                torch.rand(4, 8).bfloat16(), torch.rand(2, 3, 8).bfloat16(), torch.tensor([2, 2]), torch.empty(4, 3)
            ),
            r"out must be bfloat16 \(4, 3\) on cpu, got \(4, 3\) torch.float32",  # (bfloat16 once)
        ),
    ],
)
def test_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# ------------------------------------------------------------------- many groups, dgrad, wgrad (G-13, G-14)


def ragged(groups: int, total: int) -> list[int]:
    """Random sizes summing to total with about a third of the groups empty (the first one non-empty)."""
    weights = torch.rand(groups) * (torch.rand(groups) > 0.35)
    weights[0] += 0.5
    sizes = (weights / weights.sum() * total).floor().long()
    sizes[0] += total - sizes.sum()
    return sizes.tolist()


def wgrad_oracle(dy, x, sizes):
    """float64 [G, N, K]: dy[rows of g]ᵀ · x[rows of g], zeros for empty groups."""
    out, start = [], 0
    for m in sizes:
        out.append(dy[start : start + m].double().T @ x[start : start + m].double())
        start += m
    return torch.stack(out)


# (groups, rows of X): G = 128 with about 90 non-empty groups of 0..3 rows.
MANY = [(1, 45), (4, 150), (16, 50), (128, 130)]


@pytest.mark.parametrize(("groups", "rows"), MANY, ids=str)
def test_many_groups(groups, rows):
    index_dtype = torch.int32 if groups in (4, 128) else torch.int64
    sizes, n, k = ragged(groups, rows), 24, 40
    m_sizes = torch.tensor(sizes, dtype=index_dtype, device=DEVICE)
    x = testing.randn(rows, k, dtype=torch.bfloat16, device=DEVICE)
    w_t = testing.randn(groups, k, n, dtype=torch.bfloat16, device=DEVICE)  # dgrad's weights: N-contiguous [G, N, K]
    poisoned = testing.empty_poisoned(rows, n, dtype=torch.bfloat16, device=DEVICE)
    assert kernel(g.bf16bf16bf16_grouped_grad_op)(x, w_t.mT, m_sizes, poisoned) is poisoned
    testing.assert_rel_close(poisoned, oracle(x, w_t.mT, sizes), 1e-2)

    dy = testing.randn(rows, n, dtype=torch.bfloat16, device=DEVICE)
    dw = kernel(g.bf16bf16bf16_grouped_wgrad_op)(dy, x, m_sizes)
    assert dw.dtype == torch.bfloat16 and dw.shape == (groups, n, k)
    expected = wgrad_oracle(dy, x, sizes)
    testing.assert_rel_close(dw, expected, 1e-2)
    assert all((dw[i] == 0).all() for i, m in enumerate(sizes) if m == 0)


def test_wgrad_into_outputs():
    sizes, n, k = [0, 70, 1, 0, 29], 130, 72  # N and K off the tiles; rows past the sizes' sum (20) are ignored
    m_sizes = torch.tensor(sizes, device=DEVICE)
    dy = testing.randn(120, n, dtype=torch.bfloat16, device=DEVICE)
    x = testing.randn(120, k, dtype=torch.bfloat16, device=DEVICE)
    expected = wgrad_oracle(dy, x, sizes)
    poisoned = testing.empty_poisoned(5, n, k, dtype=torch.float32, device=DEVICE)  # every group written, zeros too
    assert kernel(g.bf16bf16bf16_grouped_wgrad_op)(dy, x, m_sizes, poisoned) is poisoned
    testing.assert_rel_close(poisoned, expected, 1e-2)
    assert (poisoned[0] == 0).all() and (poisoned[3] == 0).all()
    start = testing.randn(5, n, k, device=DEVICE)
    accumulated = start.clone()
    kernel(g.bf16bf16bf16_grouped_wgrad_op)(dy, x, m_sizes, accumulated, True)
    testing.assert_rel_close(accumulated, start.double() + expected, 1e-2)
    assert torch.equal(accumulated[0], start[0])


def test_inductor_compiles_the_grouped_ops_with_and_without_outputs():
    """The ops that return their output argument when given (out / output=None): Inductor failed on the argument
    left None ("getitem is not an OpOverload"); the reference path on the CPU."""
    x, w = testing.randn(10, 32, dtype=torch.bfloat16), testing.randn(3, 8, 32, dtype=torch.bfloat16)
    m_sizes = torch.tensor([3, 0, 7])
    expected = g.bf16bf16bf16_grouped_stacked(x, w, m_sizes)
    out = testing.empty_poisoned(10, 8, dtype=torch.bfloat16)
    for given in (None, out):
        call = functools.partial(g.bf16bf16bf16_grouped_stacked, x, w, m_sizes, given)
        torch._dynamo.reset()
        assert torch.equal(torch.compile(call, fullgraph=True, backend="inductor")(), expected)
    dy = testing.randn(10, 8, dtype=torch.bfloat16)
    torch._dynamo.reset()
    wgrad = torch.compile(lambda: g.bf16bf16bf16_grouped_wgrad(dy, x, m_sizes), fullgraph=True, backend="inductor")
    assert torch.equal(wgrad(), g.bf16bf16bf16_grouped_wgrad(dy, x, m_sizes))


# ------------------------------------------------------------------------------------ groupwise (G-17)


def groupwise_oracle(xq, wq, x_scale, w_scale, sizes):
    """float64: per group, Σ over 128-blocks of K of the block products times the block scales, with x_scale
    in per-group M-major blocks and w_scale [G, K/128, ⌈N/128⌉]."""
    rows, n, blocks = xq.shape[0], wq.shape[1], xq.shape[1] // 128
    out, start = torch.zeros(rows, n, dtype=torch.float64, device=xq.device), 0
    for group, m in enumerate(sizes):
        xs = x_scale.reshape(-1)[start * blocks : (start + m) * blocks].view(blocks, m).double()
        for kb in range(blocks):
            cols = slice(kb * 128, (kb + 1) * 128)
            part = xq[start : start + m, cols].double() @ wq[group, :, cols].double().T
            ws = w_scale[group, kb].double().repeat_interleave(128)[:n]
            out[start : start + m] += part * xs[kb][:, None] * ws[None, :]
        start += m
    return out


@pytest.mark.parametrize(("sizes", "n"), [([37], 130), ([10, 0, 25, 2], 40)], ids=str)
def test_groupwise_grouped(sizes, n):
    rows, k = sum(sizes) + 3, 256  # 3 rows past the groups: zero
    m_sizes = torch.tensor(sizes, device=DEVICE)
    x = testing.randn(rows, k, device=DEVICE, std=2.0)
    w = testing.randn(len(sizes), n, k, device=DEVICE)
    xq, wq, x_scale, w_scale = g.groupwise_grouped_inputs(x, w, m_sizes)
    out = kernel(g.f8f8bf16_groupwise_grouped_op)(xq, wq, x_scale, w_scale, m_sizes)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    testing.assert_rel_close(out, groupwise_oracle(xq, wq, x_scale, w_scale, sizes), 1e-2)
    assert (out[sum(sizes) :] == 0).all()
    poisoned = testing.empty_poisoned(rows, n, dtype=torch.bfloat16, device=DEVICE)  # the spec's import path (G-58)
    assert matmul_f8f8bf16_groupwise_grouped(xq, wq, x_scale, w_scale, m_sizes, poisoned) is poisoned
    testing.assert_rel_close(poisoned, out, 1e-2)
    # A wrong output is refused before the GEMM (an int32 one took the bf16 values cut to integers).
    for bad in (poisoned[:, :-1], poisoned.to(torch.int32), poisoned[:1].expand(rows, n)):
        with pytest.raises(ValueError, match="matmul_f8f8bf16_groupwise_grouped: output"):
            matmul_f8f8bf16_groupwise_grouped(xq, wq, x_scale, w_scale, m_sizes, bad)


# ------------------------------------------------------------- grouped_gemm entry points (G-53, G-54)


def entry_oracle(x, w, sizes, x_scale=None, w_scale=None, bias=None, token_weights=None):
    """float64 [ΣM rows of x, N] of grouped_gemm (w [G·N, K]); rows past the sizes zero."""
    groups = len(sizes)
    out = oracle(
        x, w.view(groups, -1, w.shape[-1]), sizes, x_scale, None if w_scale is None else w_scale.view(groups, -1)
    )
    start = 0
    for group, m in enumerate(sizes):
        if bias is not None:
            out[start : start + m] += bias[group].double()
        if token_weights is not None:
            out[start : start + m] *= token_weights[start : start + m, None].double()
        start += m
    return out


def entry_inputs(sizes, n, k, fp8, rows=None):
    rows = sum(sizes) if rows is None else rows
    x = testing.randn(rows, k, device=DEVICE, std=2.0)
    w = testing.randn(len(sizes) * n, k, device=DEVICE)
    if fp8:
        (xq, x_scale), (wq, w_scale) = quantize_rows(x), quantize_rows(w)
        return xq, wq, x_scale, w_scale
    return x.bfloat16(), w.bfloat16(), None, None


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_grouped_gemm_entry(fp8):
    sizes, n, k = [10, 0, 27, 3], 36, 72
    x, w, x_scale, w_scale = entry_inputs(sizes, n, k, fp8, rows=45)
    x = testing.padded_rows(x)  # rows apart in memory
    m_sizes = torch.tensor(sizes, dtype=torch.int32, device=DEVICE)
    bias = None if fp8 else testing.randn(len(sizes), n, device=DEVICE)
    token_weights = None if fp8 else torch.rand(45, device=DEVICE) + 0.5
    out = kernel(g.grouped_gemm_op)(x, w, m_sizes, x_scale, w_scale, bias, token_weights)
    assert out.dtype == torch.bfloat16 and out.shape == (45, n)
    testing.assert_rel_close(out, entry_oracle(x, w, sizes, x_scale, w_scale, bias, token_weights), 1e-2)
    assert (out[sum(sizes) :] == 0).all()


@pytest.mark.parametrize(("fp8", "groups"), [(False, 4), (True, 4), (False, 128)], ids=str)
def test_scatter_add(fp8, groups):
    sizes = ragged(groups, 90) if groups > 4 else [10, 0, 57, 23]
    n, k, tokens, rows = 40, 48, 30, 100  # 10 rows past the groups: never added
    x, w, x_scale, w_scale = entry_inputs(sizes, n, k, fp8, rows)
    m_sizes = torch.tensor(sizes, device=DEVICE)
    indices = torch.randint(-1, tokens + 1, (rows,), device=DEVICE)  # repeats, and some outside the output
    start = testing.randn(tokens, n, device=DEVICE)
    output = start.clone()  # fp32: the interpreter has no bf16 atomics
    kernel(g.grouped_gemm_scatter_add_op)(output, x, w, m_sizes, indices, x_scale, w_scale)
    product = entry_oracle(x, w, sizes, x_scale, w_scale)[: sum(sizes)]
    keep = (indices[: sum(sizes)] >= 0) & (indices[: sum(sizes)] < tokens)
    expected = start.double().index_add_(0, indices[: sum(sizes)][keep], product[keep])
    testing.assert_rel_close(output, expected, 1e-2)


def test_entry_points_return_the_scatter_target():
    x, w, x_scale, w_scale = entry_inputs([3, 2], 8, 16, fp8=True)
    m_sizes, indices = torch.tensor([3, 2], device=DEVICE), torch.tensor([0, 1, 0, 1, 0], device=DEVICE)
    output = torch.zeros(2, 8, device=DEVICE)
    assert (
        g.grouped_gemm_fp8_rowwise(x, w, m_sizes, x_scale, w_scale, _output_tensor=output, _scatter_add_indices=indices)
        is output
    )
    expected = torch.zeros(2, 8, dtype=torch.float64, device=DEVICE).index_add_(
        0, indices, entry_oracle(x, w, [3, 2], x_scale, w_scale)
    )
    testing.assert_rel_close(output, expected, 1e-2)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: g.bf16bf16bf16_grouped_wgrad(
                torch.rand(6, 4).bfloat16(), torch.rand(6, 8).bfloat16(), torch.tensor([2, 4]), output_accum=True
            ),
            "output_accum=True adds into `output`",
        ),
        (
            lambda: g.bf16bf16bf16_grouped_wgrad(
                torch.rand(6, 4).bfloat16(), torch.rand(5, 8).bfloat16(), torch.tensor([2, 4])
            ),
            "with the same rows",
        ),
        (
            lambda: g.grouped_gemm(torch.rand(6, 8).bfloat16(), torch.rand(9, 8).bfloat16(), torch.tensor([2, 4])),
            r"needs G = len\(m_sizes\) = 2 to divide its 9 rows",
        ),
        (
            lambda: g.grouped_gemm(
                torch.rand(6, 8).bfloat16(),
                torch.rand(4, 8).bfloat16(),
                torch.tensor([2, 4]),
                _output_tensor=torch.zeros(3, 2),
            ),
            "takes both _output_tensor and _scatter_add_indices",
        ),
        (
            lambda: g.grouped_gemm(
                torch.rand(6, 8).bfloat16(),
                torch.rand(4, 8).bfloat16(),
                torch.tensor([2, 4]),
                _output_tensor=torch.zeros(3, 2),
                _scatter_add_indices=torch.zeros(5, dtype=torch.int64),
            ),
            r"scatter_add_indices must be int32/int64 \[ΣM\] = \[6\]",
        ),
        (
            lambda: g.grouped_gemm(
                torch.rand(6, 8).bfloat16(), torch.rand(4, 8).bfloat16(), torch.tensor([2, 4]), bias=torch.rand(2, 3)
            ),
            r"bias must be floating \[G, N\] = \[2, 2\]",
        ),
    ],
)
def test_bad_input_backward_and_entry(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_bad_groupwise_scales():
    x = testing.randn(6, 256)
    w = testing.randn(2, 40, 256)
    m_sizes = torch.tensor([2, 4])
    xq, wq, x_scale, w_scale = g.groupwise_grouped_inputs(x, w, m_sizes)
    with pytest.raises(ValueError, match=r"w_scale must be contiguous float32 \(2, 2, 1\)"):
        g.f8f8bf16_groupwise_grouped(xq, wq, x_scale, w_scale.mT.contiguous(), m_sizes)
    with pytest.raises(ValueError, match="x_scale"):
        g.f8f8bf16_groupwise_grouped(xq, wq, x_scale.T.contiguous(), w_scale, m_sizes)
    with pytest.raises(ValueError, match=r"per_group_m_major: expected scale \[ΣM, K/128\]"):
        g.per_group_m_major(x_scale.reshape(-1), m_sizes)  # a 1-D scale made an IndexError
    with pytest.raises(ValueError, match="integer M_sizes"):
        g.per_group_m_major(x_scale, m_sizes.float())


# ----------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize(("groups", "rows_per_group", "n", "k"), [(8, 1024, 2048, 4096), (128, 17, 512, 256)])
def test_backward_and_entry_gpu(groups, rows_per_group, n, k):
    sizes = [rows_per_group + (i % 3 - 1) * (rows_per_group // 4) for i in range(groups)]
    sizes[1] = 0
    rows = sum(sizes)
    m_sizes = torch.tensor(sizes, device="cuda")
    x = testing.randn(rows, k, dtype=torch.bfloat16, device="cuda")
    w_t = testing.randn(groups, k, n, dtype=torch.bfloat16, device="cuda")
    testing.assert_rel_close(g.grouped_gemm_dgrad(x, w_t.mT, m_sizes), oracle(x, w_t.mT, sizes), 1e-2)
    dy = testing.randn(rows, n, dtype=torch.bfloat16, device="cuda")
    testing.assert_rel_close(g.grouped_gemm_wgrad(dy, x, m_sizes), wgrad_oracle(dy, x, sizes), 1e-2)
    for fp8 in (False, True):
        xe, we, xs, ws = entry_inputs(sizes, n, k, fp8)
        indices = torch.randperm(rows, device="cuda")
        for dtype in (torch.bfloat16, torch.float32):
            output = torch.zeros(rows, n, dtype=dtype, device="cuda")
            if fp8:
                g.grouped_gemm_fp8_rowwise(xe, we, m_sizes, xs, ws, _output_tensor=output, _scatter_add_indices=indices)
            else:
                g.grouped_gemm(xe, we, m_sizes, _output_tensor=output, _scatter_add_indices=indices)
            expected = torch.zeros(rows, n, dtype=torch.float64, device="cuda")
            expected.index_add_(0, indices, entry_oracle(xe, we, sizes, xs, ws))
            testing.assert_rel_close(output, expected, 1e-2)
    xq, wq, x_scale, w_scale = g.groupwise_grouped_inputs(x.float(), w_t.mT.float(), m_sizes)
    out = g.f8f8bf16_groupwise_grouped(xq, wq, x_scale, w_scale, m_sizes)
    testing.assert_rel_close(out, groupwise_oracle(xq, wq, x_scale, w_scale, sizes), 1e-2)


@pytest.mark.gpu
def test_backward_and_entry_record_into_a_cuda_graph():
    sizes, n, k = [100, 0, 150, 50], 96, 128
    m_sizes = torch.tensor(sizes, device="cuda")
    x = testing.randn(300, k, dtype=torch.bfloat16, device="cuda")
    w = testing.randn(4 * n, k, dtype=torch.bfloat16, device="cuda")
    dy = testing.randn(300, n, dtype=torch.bfloat16, device="cuda")
    indices = torch.randperm(300, device="cuda")
    output = torch.zeros(300, n, device="cuda")

    def run():
        output.zero_()
        g.grouped_gemm(x, w, m_sizes, _output_tensor=output, _scatter_add_indices=indices)
        return g.grouped_gemm_dgrad(dy, w.view(4, n, k).mT, m_sizes), g.grouped_gemm_wgrad(dy, x, m_sizes)

    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dx, dw = run()
    new_sizes = [0, 300, 0, 0]
    m_sizes.copy_(torch.tensor(new_sizes))  # new sizes, same graph
    graph.replay()
    expected = torch.zeros(300, n, dtype=torch.float64, device="cuda").index_add_(
        0, indices, entry_oracle(x, w, new_sizes)
    )
    testing.assert_rel_close(output, expected, 1e-2)
    testing.assert_rel_close(dx, oracle(dy, w.view(4, n, k).mT, new_sizes), 1e-2)
    testing.assert_rel_close(dw, wgrad_oracle(dy, x, new_sizes), 1e-2)
