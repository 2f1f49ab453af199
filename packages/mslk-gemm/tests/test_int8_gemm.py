"""INT8 GEMMs (spec G-22, G-23): i8i8bf16 (float scale), i8i8bf16_dynamic (device-tensor scale).

T0: errors and compile/export. T1 (CPU, interpreter) and T2 (GPU): the Triton kernel against the float64 product,
with odd M and N, K tails, split K (bit-identical for every split: int32 sums are exact), poisoned allocations
and strided inputs.
"""

import pytest
import torch

from mslk.core import formats, testing
from mslk.gemm.triton import int8_gemm as g

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-2  # bf16 output; the interpreter truncates to bf16 (about twice the GPU's error)


def kernel(op):
    """The op's Triton backend itself (on a CPU it runs under the interpreter)."""
    return op.get_backend("triton").impl


def oracle(xq, wq, scale):
    """float64 (XQ · WQᵀ) · scale: exact products and sums."""
    return torch.matmul(xq.double(), wq.double().T) * float(scale)


def inputs(m, n, k, device=DEVICE):
    return g.random_int8(m, k, device=device), g.random_int8(n, k, device=device), 2e-4


SHAPES = [(1, 40, 256), (16, 24, 200), (37, 130, 1000), (65, 72, 128), (300, 260, 384)]


@pytest.mark.parametrize(("m", "n", "k"), SHAPES, ids=str)
def test_i8i8bf16(m, n, k):
    xq, wq, scale = inputs(m, n, k)
    out = kernel(g.i8i8bf16_op)(xq, wq, scale)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    testing.assert_rel_close(out, oracle(xq, wq, scale), TOL)
    dynamic = kernel(g.i8i8bf16_dynamic_op)(xq, wq, torch.tensor([scale], device=DEVICE))
    assert torch.equal(dynamic, out)


@pytest.mark.parametrize(("m", "n", "k"), [(5, 70, 1024), (33, 24, 1000)], ids=str)
def test_every_split_gives_the_same_bits(m, n, k):
    """Split K (int32 partials, then the ordered reduction) with the K tail in the last split: integer sums are
    exact, so the bf16 results are identical."""
    xq, wq, scale = inputs(m, n, k)
    scale_tensor = torch.tensor(scale, device=DEVICE)
    results = [kernel(g.i8i8bf16_op)(xq, wq, scale, split_k) for split_k in (1, 2, 3, 8, 100)]
    results += [kernel(g.i8i8bf16_dynamic_op)(xq, wq, scale_tensor, split_k) for split_k in (1, 5)]
    testing.assert_rel_close(results[0], oracle(xq, wq, scale), TOL)
    for out in results[1:]:
        assert torch.equal(out, results[0])


def test_sums_past_int32():
    """Sums past 2^31 (K = 2^17 + 128 products of -128 · -128) come out right: K is split in parts whose int32 sums
    are exact, added in int64 (a single int32 sum wrapped to a negative)."""
    k = 2**17 + 128
    xq = torch.full((1, k), -128, dtype=torch.int8, device=DEVICE)
    wq = torch.stack([xq[0], -xq[0] - 1])  # -128 and 127
    out = kernel(g.i8i8bf16_op)(xq, wq, 1e-6)
    testing.assert_rel_close(out, oracle(xq, wq, 1e-6), TOL)
    assert out[0, 0] > 2000


def test_every_output_and_partial_is_written(monkeypatch):
    """Allocations come poisoned (NaN outputs, int32-max partials): a single unwritten element shows."""
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *args, **kwargs: testing.poison_(empty(*args, **kwargs)))
    xq, wq, scale = inputs(3, 130, 1024)
    outs = [kernel(g.i8i8bf16_op)(xq, wq, scale, split_k) for split_k in (1, 3)]
    monkeypatch.undo()
    for out in outs:
        testing.assert_rel_close(out, oracle(xq, wq, scale), TOL)


def test_strided_and_empty_inputs():
    xq, wq, scale = inputs(21, 40, 256)
    expected = oracle(xq, wq, scale)
    padded = testing.padded_rows(xq, 16)
    testing.assert_rel_close(kernel(g.i8i8bf16_op)(padded, wq, scale), expected, TOL)
    transposed = wq.t().contiguous().t()  # column-major: copied to K-contiguous rows
    testing.assert_rel_close(kernel(g.i8i8bf16_op)(xq, transposed, scale), expected, TOL)
    assert g.i8i8bf16(xq[:0], wq, scale).shape == (0, 40)
    assert torch.equal(
        g.i8i8bf16(xq[:, :0], wq[:, :0], scale), torch.zeros(21, 40, dtype=torch.bfloat16, device=DEVICE)
    )


def _args(**changes):
    args = {"XQ": g.random_int8(4, 64), "WQ": g.random_int8(8, 64), "scale": torch.tensor(0.5), "split_k": 1}
    return {**args, **changes}


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        (_args(XQ=torch.zeros(4, 64)), ValueError, r"expected int8 XQ \[M, K\]"),
        (_args(WQ=g.random_int8(2, 8, 64)), ValueError, r"WQ \[N, K\]"),
        (_args(WQ=g.random_int8(8, 32)), ValueError, "disagree on K"),
        (_args(split_k=0), ValueError, "split_k must be positive"),
        (_args(scale=torch.tensor([0.5, 1.0])), formats.ScaleFormatError, "one float32 value"),
        (_args(scale=torch.tensor(0.5, dtype=torch.float64)), formats.ScaleFormatError, "dtype torch.float64"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_bad_input(args, error, message):
    with pytest.raises(error, match=message):
        g.i8i8bf16_dynamic(*args.values())
    if error is ValueError:  # the float-scale op validates its tensors alike
        with pytest.raises(error, match=message):
            g.i8i8bf16(args["XQ"], args["WQ"], 0.5, args["split_k"])


def test_compile_and_export():
    class Linear(torch.nn.Module):
        def forward(self, xq, wq, scale):
            return g.i8i8bf16(xq, wq, 0.25) + g.i8i8bf16_dynamic(xq, wq, scale)

    args = (g.random_int8(5, 64), g.random_int8(8, 64), torch.tensor(0.25))
    out = torch.compile(Linear(), fullgraph=True, backend="aot_eager")(*args)
    assert out.shape == (5, 8) and out.dtype == torch.bfloat16
    graph = str(torch.export.export(Linear(), args).graph)
    assert "mslk.i8i8bf16.default" in graph and "mslk.i8i8bf16_dynamic" in graph


@pytest.mark.gpu
@pytest.mark.parametrize(("m", "n", "k"), [(1, 8192, 8192), (16, 8192, 8192), (8192, 8192, 8192), (300, 1000, 5000)])
def test_i8i8bf16_gpu(m, n, k):
    xq, wq, scale = inputs(m, n, k, device="cuda")
    out = g.i8i8bf16(xq, wq, scale)
    testing.assert_rel_close(out, oracle(xq, wq, scale), 1e-2)
    assert torch.equal(g.i8i8bf16(xq, wq, scale, 4), out)


@pytest.mark.gpu
def test_dynamic_scale_records_into_a_cuda_graph():
    xq, wq, _ = inputs(16, 4096, 8192, device="cuda")
    scale = torch.tensor(1e-4, device="cuda")
    g.i8i8bf16_dynamic(xq, wq, scale)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = g.i8i8bf16_dynamic(xq, wq, scale)
    scale.fill_(3e-4)  # a new scale, same graph
    graph.replay()
    testing.assert_rel_close(out, oracle(xq, wq, 3e-4), 1e-2)
