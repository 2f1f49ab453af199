"""Rowwise FP8 GEMMs (spec G-01, G-03, G-19, G-50): f8f8bf16_rowwise, f8f8f16_rowwise, f8f8bf16_rowwise_batched.

T0: validation errors and compile/export. T1 (CPU, interpreter) and T2 (GPU): the Triton kernel against the
dequantized product computed in float64. Inputs are quantized here with torch (mslk-gemm runs without
mslk-quantize).
"""

import pytest
import torch

from mslk.core import arch, testing
from mslk.gemm.triton import fp8_gemm as g

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def kernel(op):
    """The op's Triton backend itself (on a CPU it runs under the interpreter)."""
    return op.get_backend("triton").impl


def oracle(xq, wq, x_scale, w_scale, bias=None) -> torch.Tensor:
    """float64 (XQ · WQᵀ) · x_scale · w_scale (+ bias)."""
    out = torch.matmul(xq.double(), wq.double().transpose(-1, -2))
    out = out * x_scale.double().reshape(*xq.shape[:-1], 1) * w_scale.double().reshape(*wq.shape[:-2], 1, -1)
    return out if bias is None else out + bias.double()


# M covers the swapped (decode) path up to 64 and the 128 x 128 / 128 x 256 tiles beyond; K not a multiple of
# the 128-wide K block; N not a multiple of any tile.
SHAPES = [(1, 40, 128), (16, 24, 256), (17, 130, 64), (64, 72, 160), (65, 40, 128), (200, 300, 96), (300, 1100, 128)]


@pytest.mark.parametrize(("m", "n", "k"), SHAPES, ids=str)
@pytest.mark.parametrize("bias_dtype", [None, torch.float32, torch.bfloat16], ids=str)
def test_rowwise_matches_the_dequantized_product(m, n, k, bias_dtype):
    xq, x_scale = g.quantize_rows(testing.randn(m, k, device=DEVICE, std=3.0))
    wq, w_scale = g.quantize_rows(testing.randn(n, k, device=DEVICE, std=0.5))
    bias = None if bias_dtype is None else testing.randn(n, device=DEVICE).to(bias_dtype)
    for use_fast_accum in (True, False):
        out = kernel(g.f8f8bf16_rowwise_op)(xq, wq, x_scale, w_scale, bias, use_fast_accum)
        assert out.dtype == torch.bfloat16 and out.shape == (m, n)
        testing.assert_rel_close(out, oracle(xq, wq, x_scale, w_scale, bias), 1e-2)


@pytest.mark.parametrize(
    ("m", "n", "k"),
    [(300, 1100, 128), (200, 1200, 128), (200, 500, 96), (2048, 4000, 256), (2048, 7168, 256), (1500, 4000, 272)],
    ids=str,
)
@pytest.mark.parametrize("group_m", [8, 16])
def test_persistent_tile_loop(m, n, k, group_m, monkeypatch):
    """The persistent variant (programs looping over tiles, the M >= 2048 default) on ragged tile grids, with and
    without a last round of half-wide tiles: on the GPU 2048 x 7168 (448 tiles: 52 left for the 132 programs'
    last round) and 1500 x 4000 (192: 60); under the interpreter's 3 programs 200 x 1200 (10: 1) and 200 x 500
    (4: 1), both halves of their last tile inside N. Whole tiles go out by TMA where the output's rows are 16-byte
    aligned (N = 1200, 4000, 7168) and through pointers where not (N = 500, 1100); the output is NaN-poisoned first."""
    if testing.interpreting() and m > 300:
        pytest.skip("large for the interpreter")
    cfg = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 128, "GROUP_M": group_m, "PERSISTENT": True, "num_stages": 4,
           "num_warps": 8}  # fmt: skip
    monkeypatch.setattr(g, "_rowwise_config", lambda *shape: cfg)
    xq, x_scale = g.quantize_rows(testing.randn(m, k, device=DEVICE))
    wq, w_scale = g.quantize_rows(testing.randn(n, k, device=DEVICE))
    bias = testing.randn(n, device=DEVICE)
    expected = oracle(xq, wq, x_scale, w_scale, bias)
    testing.assert_rel_close(kernel(g.f8f8bf16_rowwise_op)(xq, wq, x_scale, w_scale, bias), expected, 1e-2)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    testing.assert_rel_close(g._run_rowwise(xq, wq, x_scale, w_scale, bias, True, out), expected, 1e-2)


def test_fp16_output_3d_activations_and_strides():
    xq, x_scale = g.quantize_rows(testing.randn(3, 7, 96, device=DEVICE))
    wq, w_scale = g.quantize_rows(testing.randn(50, 96, device=DEVICE))
    out = kernel(g.f8f8f16_rowwise_op)(xq, wq, x_scale, w_scale)
    assert out.dtype == torch.float16 and out.shape == (3, 7, 50)
    testing.assert_rel_close(out, oracle(xq, wq, x_scale, w_scale), 1e-2)
    # Rows apart in memory (padded), and flat rowwise scales.
    padded = testing.padded_rows(xq.reshape(21, 96).view(torch.uint8), 16).view(xq.dtype)
    out = kernel(g.f8f8bf16_rowwise_op)(padded, wq, x_scale.reshape(-1), w_scale)
    testing.assert_rel_close(out, oracle(xq.reshape(21, 96), wq, x_scale.reshape(-1), w_scale), 1e-2)
    # Scales that are strided views.
    strided_w_scale = torch.stack([w_scale, w_scale], 1)[:, 0]
    out = kernel(g.f8f8bf16_rowwise_op)(xq, wq, x_scale, strided_w_scale)
    testing.assert_rel_close(out, oracle(xq, wq, x_scale, w_scale), 1e-2)


@pytest.mark.parametrize(("b", "m", "n", "k"), [(3, 20, 24, 32), (2, 100, 72, 160), (1, 1, 16, 128)], ids=str)
def test_batched(b, m, n, k):
    xq, x_scale = g.quantize_rows(testing.randn(b, m, k, device=DEVICE))
    wq, w_scale = g.quantize_rows(testing.randn(b, n, k, device=DEVICE))
    bias = testing.randn(n, device=DEVICE)
    output = testing.empty_poisoned(b, m, n, dtype=torch.bfloat16, device=DEVICE)
    out = kernel(g.f8f8bf16_rowwise_batched_op)(xq, wq, x_scale, w_scale, bias, True, output)
    testing.assert_rel_close(out, oracle(xq, wq, x_scale, w_scale, bias), 1e-2)
    assert torch.equal(output, out), "the output argument is filled"


def test_out_variant_fills_the_given_tensor():
    xq, x_scale = g.quantize_rows(testing.randn(2, 33, 64, device=DEVICE))
    wq, w_scale = g.quantize_rows(testing.randn(40, 64, device=DEVICE))
    expected = oracle(xq, wq, x_scale, w_scale)
    output = testing.empty_poisoned(2, 33, 40, dtype=torch.bfloat16, device=DEVICE)
    assert kernel(g.f8f8bf16_rowwise_out_op)(xq, wq, x_scale, w_scale, output) is None
    testing.assert_rel_close(output, expected, 1e-2)
    strided = testing.empty_poisoned(2, 40, 33, dtype=torch.bfloat16, device=DEVICE).transpose(1, 2)
    kernel(g.f8f8bf16_rowwise_out_op)(xq, wq, x_scale, w_scale, strided)
    testing.assert_rel_close(strided, expected, 1e-2)
    with pytest.raises(ValueError, match="output must be bfloat16"):
        g.f8f8bf16_rowwise_out_op(xq, wq, x_scale, w_scale, output[:, :32])


def test_empty_and_k_zero():
    fp8 = arch.fp8_dtype(torch.device(DEVICE))
    w, ws = g.quantize_rows(testing.randn(8, 32, device=DEVICE))
    empty = g.f8f8bf16_rowwise_op(torch.empty(0, 32, dtype=fp8, device=DEVICE), w, torch.empty(0, device=DEVICE), ws)
    assert empty.shape == (0, 8)
    xk0 = torch.empty(4, 0, dtype=fp8, device=DEVICE)
    bias = testing.randn(8, device=DEVICE)
    out = kernel(g.f8f8bf16_rowwise_op)(xk0, w[:, :0], torch.ones(4, device=DEVICE), ws, bias)
    assert torch.equal(out, bias.to(torch.bfloat16).expand(4, 8)), "K = 0: the bias alone"
    out = kernel(g.f8f8bf16_rowwise_op)(xk0.view(2, 2, 0), w[:, :0], torch.ones(2, 2, device=DEVICE), ws, bias)
    assert torch.equal(out, bias.to(torch.bfloat16).expand(2, 2, 8)), "3-D activations, K = 0"
    xq, xs = g.quantize_rows(testing.randn(0, 5, 32, device=DEVICE))
    for batched in (kernel(g.f8f8bf16_rowwise_batched_op), g.f8f8bf16_rowwise_batched_op):  # no batch
        assert batched(xq, w[None].expand(0, 8, 32), xs, ws[None].expand(0, 8)).shape == (0, 5, 8)


def test_keepdim_scales_and_the_triton_entry():
    """Scales of any shape holding a value a row ([M, 1], torchao's keepdim [B, T, 1] of inputs flattened to 2-D)
    read as the flat vector; torch.ops.triton.matmul_fp8_row (spec G-50) is the same GEMM, a None scale ones."""
    xq, xs = g.quantize_rows(testing.randn(2, 3, 64, device=DEVICE))
    wq, ws = g.quantize_rows(testing.randn(40, 64, device=DEVICE))
    x2 = xq.reshape(6, 64)
    expected = oracle(x2, wq, xs.reshape(6), ws)
    for x_scale, w_scale in ((xs[..., None], ws[:, None]), (xs.reshape(6, 1), ws[None])):
        testing.assert_rel_close(kernel(g.f8f8bf16_rowwise_op)(x2, wq, x_scale, w_scale), expected, 1e-2)
        assert torch.equal(g.f8f8bf16_rowwise(x2, wq, x_scale, w_scale), g.f8f8bf16_rowwise(x2, wq, xs.reshape(6), ws))
    entry = g.matmul_fp8_row(x2, wq, xs.reshape(6), ws, tma_persistent=False, dot_out_dtype=torch.float32)
    assert torch.equal(entry, g.f8f8bf16_rowwise(x2, wq, xs.reshape(6), ws))
    unscaled = torch.ops.triton.matmul_fp8_row(x2, wq, None, None)
    ones = torch.ones(6, device=DEVICE), torch.ones(40, device=DEVICE)
    testing.assert_rel_close(unscaled, oracle(x2, wq, *ones), 1e-2)
    compiled = torch.compile(lambda *args: torch.ops.triton.matmul_fp8_row(*args), fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x2, wq, xs, ws), entry)
    with pytest.raises(ValueError, match=r"x_scale.*rowwise"):
        g.f8f8bf16_rowwise(x2, wq, xs[:, :2, None], ws)


def test_batched_output_on_another_device():
    """The output argument's device is checked as the other tensors' (meta inputs once left a CPU output unwritten)."""
    xq, xs = g.quantize_rows(testing.randn(2, 3, 32))
    wq, ws = g.quantize_rows(testing.randn(2, 5, 32))
    output = torch.empty(2, 3, 5, dtype=torch.bfloat16)
    meta = [t.to("meta") for t in (xq, wq, xs, ws)]
    with pytest.raises(ValueError, match=r"f8f8bf16_rowwise_batched: output must be bfloat16 \(2, 3, 5\) on meta"):
        g.f8f8bf16_rowwise_batched_op(*meta, None, True, output)


def _bad(**changes):
    fp8 = arch.fp8_dtype(torch.device("cpu"))
    args = {
        "XQ": torch.zeros(4, 32, dtype=fp8),
        "WQ": torch.zeros(8, 32, dtype=fp8),
        "x_scale": torch.ones(4),
        "w_scale": torch.ones(8),
    }
    args.update(changes)
    return lambda: g.f8f8bf16_rowwise(**args)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (_bad(XQ=torch.zeros(4, 32, dtype=torch.bfloat16)), "XQ: expected .*float8_e4m3fn"),
        (_bad(WQ=torch.zeros(8, 16, dtype=arch.fp8_dtype(torch.device("cpu")))), "disagree on K"),
        (_bad(x_scale=torch.ones(5)), "x_scale.*rowwise"),
        (_bad(x_scale=None), "f8f8bf16_rowwise: x_scale must be a tensor, got None"),
        (_bad(w_scale=torch.ones(8, dtype=torch.float16)), "w_scale must be float32"),
        (_bad(bias=torch.ones(7)), r"bias must be float32 or bfloat16 \[N\] = \[8\]"),
        (_bad(WQ=torch.zeros(2, 8, 32, dtype=arch.fp8_dtype(torch.device("cpu")))), "WQ \\[N, K\\]"),
    ],
)
def test_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_compile_and_export():
    class Linear(torch.nn.Module):
        def forward(self, xq, wq, xs, ws):
            return g.f8f8bf16_rowwise(xq, wq, xs, ws)

    xq, xs = g.quantize_rows(testing.randn(5, 32))
    wq, ws = g.quantize_rows(testing.randn(8, 32))
    out = torch.compile(Linear(), fullgraph=True, backend="aot_eager")(xq, wq, xs, ws)
    assert out.shape == (5, 8) and out.dtype == torch.bfloat16
    assert "mslk.f8f8bf16_rowwise" in str(torch.export.export(Linear(), (xq, wq, xs, ws)).graph)


def test_scaled_mm_backend_serves_its_measured_shape_class(monkeypatch):
    """torch._scaled_mm (cuBLAS) serves M > 1024 on SM90 (where it measured faster); the Triton kernel the rest."""
    monkeypatch.setattr(arch, "on_hopper", lambda t: True)
    backend = g.f8f8bf16_rowwise_op.get_backend("torch._scaled_mm")
    backends = [b.name for b in g.f8f8bf16_rowwise_op.backends]
    assert backends.index("torch._scaled_mm") < backends.index("triton")

    def reasons(m, n=256, k=128, bias=None, dtype=torch.float8_e4m3fn):
        xq, wq = torch.empty(m, k, dtype=dtype), torch.empty(n, k, dtype=dtype)
        return backend.reasons("cuda", (xq, wq, torch.empty(m), torch.empty(n), bias), {})

    assert reasons(2048) == []
    assert reasons(2048, bias=torch.empty(256, dtype=torch.bfloat16)) == []
    assert "the Triton kernel is faster there" in reasons(1024)[0]
    assert "bias torch.float32" in reasons(2048, bias=torch.empty(256))[0]
    assert "multiples of 16" in reasons(2048, n=250)[0]
    monkeypatch.setattr(arch, "on_hopper", lambda t: False)
    assert "SM90 only" in reasons(2048)[0]


@pytest.mark.gpu
@pytest.mark.parametrize(("m", "n", "k"), [(2048, 7168, 2048), (1500, 1024, 4096)], ids=str)
def test_scaled_mm_backend_gpu(m, n, k):
    xq, x_scale = g.quantize_rows(testing.randn(m, k, device="cuda"))
    wq, w_scale = g.quantize_rows(testing.randn(n, k, device="cuda"))
    bias = testing.randn(n, device="cuda").to(torch.bfloat16)
    for args in ((xq, wq, x_scale, w_scale), (xq, wq, x_scale, w_scale, bias, False)):
        out = g.f8f8bf16_rowwise_op(*args, backend="torch._scaled_mm")
        testing.assert_rel_close(out, oracle(*args[:5]) if len(args) > 4 else oracle(*args), 1e-2)
    out3 = g.f8f8bf16_rowwise(xq.reshape(2, m // 2, k), wq, x_scale.reshape(2, m // 2), w_scale)
    testing.assert_rel_close(out3, oracle(xq, wq, x_scale, w_scale).reshape(2, m // 2, n), 1e-2)


@pytest.mark.gpu
@pytest.mark.big_memory
def test_gpu_batched_batches_of_two_to_the_31_elements():
    """XQ [2, 65536, 32768]: a batch of 2**31 elements makes its stride an int64 argument, and the TMA coordinates
    built from it have to come back to int32 (Triton refused to compile the kernel). Rows of the second batch
    checked (the rest of X is zero)."""
    b, m, n, k = 2, 65536, 256, 32768
    tail, tail_scale = g.quantize_rows(testing.randn(70, k, device="cuda"))
    xq = torch.zeros(b, m, k, dtype=tail.dtype, device="cuda")
    x_scale = torch.ones(b, m, device="cuda")
    xq[1, -70:], x_scale[1, -70:] = tail, tail_scale
    wq, w_scale = g.quantize_rows(testing.randn(b, n, k, device="cuda"))
    out = g.f8f8bf16_rowwise_batched_op(xq, wq, x_scale, w_scale)
    expected = oracle(xq[1, -70:], wq[1], x_scale[1, -70:], w_scale[1])
    testing.assert_rel_close(out[1, -70:], expected, 1e-2)
    assert (out[0, :5] == 0).all()
