"""INT4 weight-only GEMMs (spec G-24..G-31, G-56): bf16i4bf16_{rowwise,shuffled}{,_batched,_grouped},
f8i4bf16_rowwise, f8i4bf16_shuffled{,_grouped}.

T0: the reference dequantization against mslk.quantize's layouts, group-size inference, errors, compile/export.
T1 (CPU, interpreter) and T2 (GPU): the Triton kernels against X · Wdqᵀ in float64, with odd M and N, K tails,
every group size, split K, batches, ragged groups, poisoned allocations and strided activations.
"""

import itertools

import pytest
import torch

from mslk.core import formats, testing
from mslk.gemm.triton import int4_gemm as g
from mslk.gemm.triton.fp8_gemm import quantize_rows
from mslk.gemm.triton.int4_grouped_gemm import matmul_bf16i4_rowwise_grouped
from mslk.gemm.triton.int4_grouped_gemm_fused import matmul_bf16i4_rowwise_grouped_fused

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter truncates fp32 -> bf16 (a biased error about twice the GPU's) and rounds fp32 -> fp8 wrongly
# just below powers of two (DESIGN.md §4): looser there, and FP8 tables of power-of-two scales where exactness
# is the point.
TOL = 1.5e-2 if testing.interpreting() else 1e-2


def kernel(op):
    """The op's Triton backend itself (on a CPU it runs under the interpreter)."""
    return op.get_backend("triton").impl


def oracle(x, w, x_scale=None, w_scale=None):
    """float64 x · wᵀ (w [..., N, K] dequantized), times the rowwise scales."""
    out = torch.matmul(x.double(), w.double().transpose(-1, -2))
    if x_scale is not None:
        out = out * x_scale.double().reshape(*x.shape[:-1], 1)
    return out if w_scale is None else out * w_scale.double()


def bf16_inputs(*lead, m, n, k, gs, scale_dtype=torch.bfloat16, device=DEVICE):
    x = testing.randn(*lead, m, k, dtype=torch.bfloat16, device=device)
    scale, zero = g.random_group_scales(*lead, n, k, group_size=gs, dtype=scale_dtype, device=device)
    return x, g.random_int4(*lead, n, k, device=device), scale, zero


def pow2_table(*shape, group_size, device=DEVICE):
    """FP8 tables of power-of-two scales: every entry is exact, so no fp8 rounding happens anywhere."""
    *lead, n, k = shape
    exponents = torch.randint(-7, -3, (*lead, -(-k // group_size), n), device=device)
    return g.fp8_table(torch.exp2(exponents.float()).to(torch.float8_e4m3fn))


# ------------------------------------------------------------------------------------------ T0: reference


def test_group_size_inference():
    size = formats.int4_group_size
    assert size(256, 2) == 128 and size(8192, 64) == 128
    assert size(384, 2) == 192 and size(192, 2) == 96 and size(480, 5) == 96  # K / groups, the spec's rule
    assert size(200, 7) == 32  # 7 does not divide 200: a power of two, the last group shorter
    assert size(100, 1) == 128 and size(0, 0) == 1  # one group: any size covering K, a power of two
    assert size(200, 3) is None and size(64, 0) is None


def test_group_size_that_is_not_a_power_of_two():
    """K = 384 in groups of 192 (two scale rows) through mslk.quantize's quantizer: the GEMM reads groups of 192,
    not of 256 with a shorter last group (0.26 relative error before)."""
    shuffle = pytest.importorskip("mslk.quantize.shuffle")
    w, x = testing.randn(32, 384), testing.randn(8, 384, dtype=torch.bfloat16)
    q, scale, zero = shuffle.int4_row_quantize_zp(w, 192)
    groups = torch.arange(384) // 192
    expected = x.double() @ (q.double() * scale.double()[groups].T + zero.double()[groups].T).T
    for gemm in (g.bf16i4bf16_rowwise_op.reference, kernel(g.bf16i4bf16_rowwise_op)):
        testing.assert_rel_close(gemm(x, shuffle.pack_int4(q), scale, zero), expected, TOL)


def test_layouts_match_mslk_quantize():
    """The reference dequantization reads mslk.quantize.shuffle's formats: plain packing with asymmetric group
    scales, the preshuffled layout (bf16 and FP8-table forms), K not a multiple of the group."""
    shuffle = pytest.importorskip("mslk.quantize.shuffle")
    w = testing.randn(24, 200)
    q, scale, zero = shuffle.int4_row_quantize_zp(w, 32)
    expected = q.float() * scale.T.repeat_interleave(32, 1)[:, :200] + zero.T.repeat_interleave(32, 1)[:, :200]
    torch.testing.assert_close(g.dequantize_int4(shuffle.pack_int4(q), scale, zero, shuffled=False), expected)
    assert testing.rel_error(expected, w) < 0.1

    w = testing.randn(2, 24, 256)
    wq, (scale, zero) = shuffle.quantize_int4_preshuffle(w, 64, "bf16")
    assert torch.equal(g.unpack_int4(wq, shuffled=True), shuffle.unshuffle_i4(wq))
    assert testing.rel_error(g.dequantize_int4(wq, scale, zero, shuffled=True), w) < 0.1

    wq, (table, row_scale) = shuffle.quantize_int4_preshuffle(w[0], 128, "fp8")
    assert torch.equal(g.fp8_table(table[:, 0]), table)
    assert testing.rel_error(g.dequantize_int4_table(wq, table) * row_scale[:, None], w[0]) < 0.15


def test_table_reference_reads_entry_zero_as_the_kernels():
    q = torch.tensor([[-8, -7, -1, 0, 1, 5, 7, 3] * 16], dtype=torch.int8)
    packed = ((q[:, :64] & 0xF) | (q[:, 64:] << 4)).to(torch.int8)  # preshuffled: k and k + 64 in one byte
    table = g.fp8_table(torch.tensor([[0.375]]).to(torch.float8_e4m3fn))
    expected = (q.float() * 0.375).to(torch.float8_e4m3fn).float()  # 7 · 0.375 = 2.625 rounds to 2.5
    assert torch.equal(g.dequantize_int4_table(packed, table), expected)
    other = table.clone()  # entries past the first that are not e4m3(m · entry 0): read as the kernels read them
    other[:, 1:] = torch.rand(1, 7, 1).to(torch.float8_e4m3fn)
    assert torch.equal(g.dequantize_int4_table(packed, other), expected)


@pytest.mark.parametrize("op", [g.bf16i4bf16_rowwise, g.bf16i4bf16_shuffled], ids=["rowwise", "shuffled"])
def test_compile_and_export(op):
    class Linear(torch.nn.Module):
        def forward(self, x, w, scale, zero):
            return op(x, w, scale, zero)

    _, w, scale, zero = bf16_inputs(m=1, n=8, k=256, gs=128, device="cpu")
    args = (testing.randn(2, 5, 256, dtype=torch.bfloat16), w, scale, zero)
    out = torch.compile(Linear(), fullgraph=True, backend="aot_eager")(*args)
    assert out.shape == (2, 5, 8) and out.dtype == torch.bfloat16
    assert f"mslk.{op.__name__}" in str(torch.export.export(Linear(), args).graph)


# ----------------------------------------------------------------------------------------- T1/T2: kernels

# (M, N, K, group size): decode and prefill tiles, odd M and N, K tails (plain layout) and short last groups.
SHAPES = [
    (1, 40, 256, 128),
    (16, 72, 512, 32),
    (37, 130, 200, 32),  # 7 groups, the last shorter
    (65, 24, 384, 192),  # 2 groups of 192
    (300, 96, 128, 16),
    (5, 40, 480, 96),  # a group size that is not a power of two
]
SHUFFLED_SHAPES = [(1, 40, 256, 128), (16, 72, 512, 32), (37, 130, 384, 64), (65, 24, 256, 256)]


@pytest.mark.parametrize(("m", "n", "k", "gs"), SHAPES, ids=str)
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32, torch.float16], ids=str)
def test_bf16i4bf16_rowwise(m, n, k, gs, scale_dtype):
    x, w, scale, zero = bf16_inputs(m=m, n=n, k=k, gs=gs, scale_dtype=scale_dtype)
    out = kernel(g.bf16i4bf16_rowwise_op)(x, w, scale, zero)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    testing.assert_rel_close(out, oracle(x, g.dequantize_int4(w, scale, zero, shuffled=False)), TOL)


@pytest.mark.parametrize(("m", "n", "k", "gs"), SHUFFLED_SHAPES, ids=str)
def test_bf16i4bf16_shuffled(m, n, k, gs):
    x, w, scale, zero = bf16_inputs(m=m, n=n, k=k, gs=gs)
    out = kernel(g.bf16i4bf16_shuffled_op)(x, w, scale, zero)
    testing.assert_rel_close(out, oracle(x, g.dequantize_int4(w, scale, zero, shuffled=True)), TOL)


@pytest.mark.parametrize("shuffled", [False, True], ids=["rowwise", "shuffled"])
def test_batched(shuffled):
    op = g.bf16i4bf16_shuffled_batched_op if shuffled else g.bf16i4bf16_rowwise_batched_op
    x, w, scale, zero = bf16_inputs(3, m=17, n=40, k=256, gs=64)
    out = kernel(op)(x, w, scale, zero)
    assert out.shape == (3, 17, 40)
    testing.assert_rel_close(out, oracle(x, g.dequantize_int4(w, scale, zero, shuffled=shuffled)), TOL)


@pytest.mark.parametrize(("m", "n", "k", "gs"), [(1, 40, 200, 32), (37, 130, 256, 128)], ids=str)
def test_f8i4bf16_rowwise(m, n, k, gs):
    xq, x_scale = quantize_rows(testing.randn(2, m, k, device=DEVICE))
    w = g.random_int4(n, k, device=DEVICE)
    scale, zero = g.random_group_scales(n, k, group_size=gs, dtype=torch.float32, device=DEVICE)
    out = kernel(g.f8i4bf16_rowwise_op)(xq, w, x_scale, scale, zero)
    assert out.shape == (2, m, n)
    testing.assert_rel_close(out, oracle(xq, g.dequantize_int4(w, scale, zero, shuffled=False), x_scale), TOL)


@pytest.mark.parametrize(("m", "n", "k", "gs"), SHUFFLED_SHAPES, ids=str)
def test_f8i4bf16_shuffled(m, n, k, gs):
    xq, x_scale = quantize_rows(testing.randn(m, k, device=DEVICE))
    w, w_scale = g.random_int4(n, k, device=DEVICE), torch.rand(n, device=DEVICE) + 0.5
    table = pow2_table(n, k, group_size=gs)
    out = kernel(g.f8i4bf16_shuffled_op)(xq, w, x_scale, w_scale, table)
    testing.assert_rel_close(out, oracle(xq, g.dequantize_int4_table(w, table), x_scale, w_scale), TOL)


def test_f8i4bf16_shuffled_rounds_to_the_table():
    """General e4m3 scales: q · scale rounds to the table's entries (exact on a GPU; the interpreter's fp8
    conversion halves values that round up to a power of two)."""
    xq, x_scale = quantize_rows(testing.randn(33, 256, device=DEVICE))
    w, w_scale = g.random_int4(48, 256, device=DEVICE), torch.rand(48, device=DEVICE) + 0.5
    table = g.random_fp8_table(48, 256, group_size=64, device=DEVICE)
    out = kernel(g.f8i4bf16_shuffled_op)(xq, w, x_scale, w_scale, table)
    tol = 0.08 if testing.interpreting() else 1e-2
    testing.assert_rel_close(out, oracle(xq, g.dequantize_int4_table(w, table), x_scale, w_scale), tol)


GROUPED = [
    # (rows of X, group sizes, N, K, group size)
    (37, [10, 0, 27], 40, 256, 128),
    (5, [1, 1, 3, 0], 130, 128, 32),
    (300, [129, 0, 1, 70], 24, 384, 64),  # sizes sum to 200 of 300 rows: the rest is zero
    (0, [0, 0], 16, 128, 128),
    (7, [], 24, 128, 64),  # no group: every row is zero
]
# The plain layout takes any even K: K past whole steps of 128, groups of 96 (K / groups), K = 0 (zeros).
GROUPED_PLAIN = [(23, [7, 0, 9], 72, 200, 32), (6, [2, 4], 40, 480, 96), (5, [3, 2], 24, 0, 32)]
GROUPED_OPS = {True: "bf16i4bf16_shuffled_grouped_op", False: "bf16i4bf16_rowwise_grouped_op"}


@pytest.mark.parametrize(
    ("rows", "sizes", "n", "k", "gs", "shuffled"),
    [(*case, True) for case in GROUPED] + [(*case, False) for case in GROUPED[:3] + GROUPED_PLAIN],
    ids=str,
)
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32], ids=str)
def test_bf16i4bf16_grouped(rows, sizes, n, k, gs, shuffled, index_dtype):
    x = testing.randn(rows, k, dtype=torch.bfloat16, device=DEVICE)
    _, w, scale, zero = bf16_inputs(len(sizes), m=1, n=n, k=k, gs=gs)
    m_sizes = torch.tensor(sizes, dtype=index_dtype, device=DEVICE)
    out = kernel(getattr(g, GROUPED_OPS[shuffled]))(x, w, scale, zero, m_sizes)
    assert out.shape == (rows, n)
    expected = torch.zeros(rows, n, dtype=torch.float64, device=DEVICE)
    wdq = g.dequantize_int4(w, scale, zero, shuffled=shuffled)
    start = 0
    for group, size in enumerate(sizes):
        expected[start : start + size] = oracle(x[start : start + size], wdq[group])
        start += size
    testing.assert_rel_close(out, expected, TOL)
    assert (out[sum(sizes) :] == 0).all()


def test_spec_grouped_entries_are_the_plain_layout():
    """The reference's grouped Triton entries (G-56) over plain weights, X a strided view."""
    x = testing.randn(40, 2 * 200, dtype=torch.bfloat16, device=DEVICE)[:, ::2]
    _, w, scale, zero = bf16_inputs(3, m=1, n=24, k=200, gs=32)
    m_sizes = torch.tensor([17, 0, 20], dtype=torch.int32, device=DEVICE)
    expected = g.bf16i4bf16_rowwise_grouped_op.reference(x, w, scale, zero, m_sizes)
    for entry in (matmul_bf16i4_rowwise_grouped, matmul_bf16i4_rowwise_grouped_fused):
        out = entry(x, w, scale, zero, m_sizes)
        testing.assert_rel_close(out, expected, TOL)
        assert (out[37:] == 0).all()


def test_shuffled_grouped_sizes_clamped():
    """M_sizes live on the device, unchecked: a negative size takes no rows, one of 2^31 or more (int64) the rows
    left, in the kernel and the reference alike (the reference once sliced X[start:start + m] with m < 0, Python's
    negative indexing; the kernel cut 2^32 + 1 to 32 bits, 1 row)."""
    x = testing.randn(5, 128, dtype=torch.bfloat16, device=DEVICE)
    _, w, scale, zero = bf16_inputs(2, m=1, n=40, k=128, gs=64)
    wdq = g.dequantize_int4(w, scale, zero, shuffled=True)
    op = g.bf16i4bf16_shuffled_grouped_op
    for sizes, group in (([-2, 5], 1), ([2**32 + 1, 3], 0)):
        expected = oracle(x, wdq[group])
        for grouped in (op.get_backend("triton").impl, op.reference):
            testing.assert_rel_close(grouped(x, w, scale, zero, torch.tensor(sizes, device=DEVICE)), expected, TOL)


@pytest.mark.parametrize(("rows", "sizes", "n", "k", "gs"), GROUPED[:3], ids=str)
def test_f8i4bf16_shuffled_grouped(rows, sizes, n, k, gs):
    xq, x_scale = quantize_rows(testing.randn(rows, k, device=DEVICE))
    w = g.random_int4(len(sizes), n, k, device=DEVICE)
    w_scale = torch.rand(len(sizes), n, device=DEVICE) + 0.5
    table = pow2_table(len(sizes), n, k, group_size=gs)
    m_sizes = torch.tensor(sizes, device=DEVICE)
    out = kernel(g.f8i4bf16_shuffled_grouped_op)(xq, w, x_scale, w_scale, table, m_sizes)
    expected = torch.zeros(rows, n, dtype=torch.float64, device=DEVICE)
    wdq = g.dequantize_int4_table(w, table)
    start = 0
    for group, size in enumerate(sizes):
        part = slice(start, start + size)
        expected[part] = oracle(xq[part], wdq[group], x_scale[part], w_scale[group])
        start += size
    testing.assert_rel_close(out, expected, TOL)
    # Row scales flat [G·N] (Rowwise takes either): the reference once read w_scale[g] as one scale a group.
    reference = g.f8i4bf16_shuffled_grouped_op.reference(xq, w, x_scale, w_scale.reshape(-1), table, m_sizes)
    testing.assert_rel_close(reference, expected, TOL)


@pytest.mark.parametrize(
    ("shuffled", "k", "splits", "per_split", "warps"),
    [(False, 1024, 3, 3, 4), (False, 1000, 2, 4, 4), (True, 1024, 3, 3, 4), (True, 896, 7, 1, 4),
     (False, 1024, 3, 3, 2), (False, 1000, 2, 4, 2), (True, 896, 7, 1, 2)],
    ids=str,
)  # fmt: skip
def test_split_k(shuffled, k, splits, per_split, warps, monkeypatch):
    """K split over programs (fp32 partials, then the ordered reduction), with the K tail in the last split, on a
    batch of two; 2 warps: the decode tiles' scaling after the products."""
    cfg = {"BLOCK_M": 16, "BLOCK_N": 64, "GROUP_M": 1, "num_warps": warps, "num_stages": 4, "splits": splits,
           "steps_per_split": per_split}  # fmt: skip
    monkeypatch.setattr(g, "_config", lambda *shape: cfg)
    x, w, scale, zero = bf16_inputs(2, m=5, n=70, k=k, gs=128 if k % 128 == 0 else 64)  # K = 1000: 16 groups
    op = g.bf16i4bf16_shuffled_batched_op if shuffled else g.bf16i4bf16_rowwise_batched_op
    expected = oracle(x, g.dequantize_int4(w, scale, zero, shuffled=shuffled))
    testing.assert_rel_close(kernel(op)(x, w, scale, zero), expected, TOL)
    # FP8 table: the row scales wait for the reduction.
    if shuffled:
        xq, x_scale = quantize_rows(x[0].float())
        table, w_scale = pow2_table(70, k, group_size=128), torch.rand(70, device=DEVICE) + 0.5
        out = kernel(g.f8i4bf16_shuffled_op)(xq, w[0], x_scale, w_scale, table)
        testing.assert_rel_close(out, oracle(xq, g.dequantize_int4_table(w[0], table), x_scale, w_scale), TOL)


@pytest.mark.parametrize("form", ["rowwise", "shuffled", "table"])
def test_tma_and_pointer_loads(form, monkeypatch):
    """Both load paths of the K loop: TMA descriptors (zeros past M, N and K; past a batch's rows the next batch's)
    and pointers, on batches of odd M and N with a K tail (plain layout), each against the oracle."""
    k = 352 if form == "rowwise" else 256  # rowwise: a K tail (two steps of 128, then 96)
    x, w, scale, zero = bf16_inputs(2, m=19, n=70, k=k, gs=32)
    if form == "table":
        xq, x_scale = quantize_rows(x.float())
        w_scale, table = torch.rand(2, 70, device=DEVICE) + 0.5, pow2_table(2, 70, k, group_size=32)
        expected = oracle(xq, g.dequantize_int4_table(w, table), x_scale, w_scale[:, None])
    else:
        expected = oracle(x, g.dequantize_int4(w, scale, zero, shuffled=form == "shuffled"))

    def run():
        if form != "table":  # the batched ops: both batches in one launch
            op = g.bf16i4bf16_shuffled_batched_op if form == "shuffled" else g.bf16i4bf16_rowwise_batched_op
            return kernel(op)(x, w, scale, zero)
        return torch.stack(
            [kernel(g.f8i4bf16_shuffled_op)(xq[i], w[i], x_scale[i], w_scale[i], table[i]) for i in (0, 1)]
        )

    descriptors = g._descriptors
    used = []
    monkeypatch.setattr(g, "_descriptors", lambda *args: used.append(descriptors(*args)) or used[-1])
    testing.assert_rel_close(run(), expected, TOL)
    assert used and used[-1][0] is not None  # the TMA path ran
    monkeypatch.setattr(g, "_descriptors", lambda *args: (None, None))
    testing.assert_rel_close(run(), expected, TOL)


def test_every_output_and_partial_is_written(monkeypatch):
    """Allocations come NaN-filled (outputs and the split-K workspace): a single unwritten element shows."""
    empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        return testing.poison_(empty(*args, **kwargs))

    x, w, scale, zero = bf16_inputs(m=3, n=130, k=1024, gs=64)
    w3 = g.random_int4(2, 130, 1024, device=DEVICE)
    scale3, zero3 = g.random_group_scales(2, 130, 1024, group_size=64, device=DEVICE)
    m_sizes = torch.tensor([1, 1], device=DEVICE)
    monkeypatch.setattr(torch, "empty", poisoned_empty)
    out = kernel(g.bf16i4bf16_rowwise_op)(x, w, scale, zero)
    grouped = [kernel(getattr(g, name))(x, w3, scale3, zero3, m_sizes) for name in GROUPED_OPS.values()]
    monkeypatch.undo()
    testing.assert_rel_close(out, oracle(x, g.dequantize_int4(w, scale, zero, shuffled=False)), TOL)
    for result in grouped:
        assert not result.isnan().any() and (result[2] == 0).all()


def test_strided_3d_and_empty_activations():
    x, w, scale, zero = bf16_inputs(2, m=7, n=40, k=256, gs=128)
    expected = oracle(x, g.dequantize_int4(w[0], scale[0], zero[0], shuffled=False))
    out = kernel(g.bf16i4bf16_rowwise_op)(x, w[0], scale[0], zero[0])
    assert out.shape == (2, 7, 40)
    testing.assert_rel_close(out, expected, TOL)
    padded = testing.padded_rows(x.reshape(14, 256), 16)  # rows 272 elements apart
    out = kernel(g.bf16i4bf16_rowwise_op)(padded, w[0], scale[0], zero[0])
    testing.assert_rel_close(out, expected.reshape(14, 40), TOL)
    transposed = x.reshape(14, 256).t().contiguous().t()  # column-major: copied to K-contiguous rows
    testing.assert_rel_close(kernel(g.bf16i4bf16_shuffled_op)(transposed, w[0], scale[0], zero[0]),
                             oracle(x.reshape(14, 256), g.dequantize_int4(w[0], scale[0], zero[0], shuffled=True)),
                             TOL)  # fmt: skip
    empty = kernel(g.bf16i4bf16_rowwise_op)(x[:, :0], w[0], scale[0], zero[0])  # the Triton path on a CPU too
    assert empty.shape == (2, 0, 40)


def test_zero_k_gives_zeros_on_the_triton_path():
    """K = 0: the empty sum (zeros), from the Triton backend too, which a GPU selects (it refused the scales'
    group size before)."""
    x, w = testing.randn(3, 0, dtype=torch.bfloat16), torch.empty(8, 0, dtype=torch.int8)
    scale = zero = torch.ones(0, 8, dtype=torch.bfloat16)
    backend = g.bf16i4bf16_rowwise_op.get_backend("triton")
    assert backend.supports(x, w, scale, zero) == []
    out = backend.impl(x, w, scale, zero)
    assert out.shape == (3, 8) and (out == 0).all()


# ------------------------------------------------------------------------------------------------ T0: errors


def _bf16_args(**changes):
    names = ("X", "W", "w_scale_group", "w_zero_group")
    return {**dict(zip(names, bf16_inputs(m=4, n=8, k=256, gs=128, device="cpu"), strict=True)), **changes}


def _f8_args(**changes):
    xq, x_scale = quantize_rows(testing.randn(4, 256))
    table = g.random_fp8_table(8, 256, group_size=128)
    args = {"XQ": xq, "WQ": g.random_int4(8, 256), "x_scale": x_scale, "w_scale": torch.ones(8), "w_scale_group": table}
    return {**args, **changes}


@pytest.mark.parametrize(
    ("op", "args", "error", "message"),
    [
        (g.bf16i4bf16_rowwise, _bf16_args(X=torch.zeros(4, 256)), ValueError, "X must be bfloat16"),
        (g.bf16i4bf16_rowwise, _bf16_args(W=torch.zeros(8, 128, dtype=torch.uint8)), ValueError, "W must be int8"),
        (g.bf16i4bf16_rowwise, _bf16_args(W=torch.zeros(8, 64, dtype=torch.int8)), ValueError, "holds K = 128"),
        (g.bf16i4bf16_rowwise, _bf16_args(w_scale_group=torch.ones(3, 8)), formats.ScaleFormatError, "3 groups"),
        (g.bf16i4bf16_rowwise, _bf16_args(w_scale_group=torch.ones(2, 9)), formats.ScaleFormatError, r"\(2, 8\)"),
        (g.bf16i4bf16_rowwise, _bf16_args(w_zero_group=torch.ones(2, 8)), formats.ScaleFormatError, "one dtype"),
        (g.bf16i4bf16_rowwise, _bf16_args(w_scale_group=torch.ones(8, 2).t()), formats.ScaleFormatError, "contiguous"),
        (
            g.bf16i4bf16_shuffled,
            _bf16_args(X=torch.zeros(4, 192, dtype=torch.bfloat16), W=torch.zeros(8, 96, dtype=torch.int8)),
            ValueError,
            "K % 128 == 0",
        ),
        (g.bf16i4bf16_rowwise_batched, _bf16_args(), ValueError, r"X must be bfloat16 \[B, M, K\]"),
        (g.f8i4bf16_shuffled, _f8_args(XQ=torch.zeros(4, 256, dtype=torch.bfloat16)), ValueError, "XQ: expected"),
        (g.f8i4bf16_shuffled, _f8_args(x_scale=torch.ones(5)), formats.ScaleFormatError, "x_scale.*rowwise"),
        (g.f8i4bf16_shuffled, _f8_args(w_scale=torch.ones(8).half()), formats.ScaleFormatError, "must be float32"),
        (
            g.f8i4bf16_shuffled,
            _f8_args(w_scale_group=torch.ones(2, 8, 8, dtype=torch.bfloat16)),
            formats.ScaleFormatError,
            "FP8 table",
        ),
        (  # the group scales where preshuffle_i4's table goes: its shape named (once "-1 groups")
            g.f8i4bf16_shuffled,
            _f8_args(w_scale_group=torch.ones(2, 8).to(torch.float8_e4m3fn)),
            formats.ScaleFormatError,
            r"expected preshuffle_i4's FP8 table scales \[\.\.\., ⌈K/group_size⌉, 8, N\] for W \(8, 128\)",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_bad_input(op, args, error, message):
    with pytest.raises(error, match=message):
        op(*args.values())


def test_bad_grouped_input():
    x, w, scale, zero = bf16_inputs(2, m=1, n=8, k=128, gs=64, device="cpu")
    with pytest.raises(ValueError, match=r"M_sizes must be int32/int64 \[G\] = \[2\]"):
        g.bf16i4bf16_shuffled_grouped(x[0], w, scale, zero, torch.tensor([1.0, 0.0]))
    with pytest.raises(ValueError, match=r"WQ must be int8 packed int4 \[G, N, K/2\]"):
        g.bf16i4bf16_shuffled_grouped(x[0], w[0], scale, zero, torch.tensor([1, 0]))
    with pytest.raises(ValueError, match=r"bf16i4bf16_rowwise_grouped: W .* holds K = 128 values per row, X has K"):
        g.bf16i4bf16_rowwise_grouped(x[0, :, :96], w, scale, zero, torch.tensor([1, 0]))
    x, w, scale, zero = bf16_inputs(2, m=1, n=8, k=96, gs=32, device="cpu")
    with pytest.raises(ValueError, match=r"preshuffled weights \(preshuffle_i4\) need K % 128 == 0, got K = 96"):
        g.bf16i4bf16_shuffled_grouped(x[0], w, scale, zero, torch.tensor([1, 0]))
    x, w, scale, zero = bf16_inputs(2, m=1, n=8, k=200, gs=67, device="cpu")  # 3 groups: no size fits K = 200
    with pytest.raises(formats.ScaleFormatError, match=r"rowwise_grouped: scales of shape \(2, 3, 8\) give 3 groups"):
        g.bf16i4bf16_rowwise_grouped(x[0], w, scale, zero, torch.tensor([1, 0]))


@pytest.mark.parametrize(
    ("m", "k", "shuffled"),
    [(1, 64, False), (5, 320, False), (16, 512, False), (9, 1024, False), (1, 128, True), (16, 384, True),
     (9, 1024, True)],
)  # fmt: skip
def test_decode_relabelling(m, k, shuffled):
    """int4_decode_hopper's two sides of the relabelled K agree: the weights' operand as its `_relabelled` builds it
    from a run's bytes (the nibbles (j, j + 4) of word b // 4 at byte b, then its join, reshape and permute, replayed
    here on the biased values 136 + q), times X' of the first kernel (interpreted on a CPU), is X · (136 + q)ᵀ with q
    in the real k order of the plain or preshuffled layout; X' is zero past M and past K (its runs fill whole
    stages), and the sums are X's per run."""
    d = g.int4_decode_hopper
    x = testing.randn(m, k, 2, dtype=torch.bfloat16, device=DEVICE)[..., 0]  # strided along K
    xp, sums = d.relabelled_activations(x, shuffled)
    w = g.random_int4(24, k, device=DEVICE)
    by_byte = 136 + g.unpack_int4(w, shuffled=False).double()  # nibble 2b + h of a row is byte b's low (h = 0) / high
    runs = by_byte.unflatten(-1, (-1, 32, 2))  # [24, runs, byte, nibble]: a run's 32 bytes
    b = torch.arange(32, device=DEVICE)
    word_k = runs.flatten(-2)[..., 8 * (b // 4)[:, None] + (b % 4)[:, None] + torch.tensor([0, 4], device=DEVICE)]
    operand = word_k.reshape(24, -1, 2, 4, 4, 2).permute(0, 1, 2, 4, 3, 5).reshape(24, -1, 64)
    bm, runs = xp.shape[1], k // 64
    assert xp.shape == (-(-k // 256) * 4, bm, 64) and not xp[:, m:].any() and not xp[runs:].any()
    products = torch.einsum("nrt,rmt->mn", operand, xp[:runs, :m].double())
    biased = 136 + g.unpack_int4(w, shuffled=shuffled).double()  # in real k order
    torch.testing.assert_close(products, x.double() @ biased.T, rtol=1e-12, atol=1e-9)
    assert sums.shape == (xp.shape[0] // 4, bm, 4)
    run_sums = sums.transpose(1, 2).flatten(0, 1)  # [runs, bm]
    expected_sums = xp[:, :m].double().sum(-1)  # X' is checked above: its runs hold the k they should
    torch.testing.assert_close(run_sums[:, :m].double(), expected_sums, rtol=1e-5, atol=1e-4)
    assert not run_sums[:, m:].any()


def _work_list(sizes, rows, chunk):
    """The grouped decode kernel's items, as _work_items should write them: each group's rows (sizes clamped to the
    rows left) in runs of `chunk`, then the rows past them (group -1)."""
    items, start = [], 0
    for group, size in enumerate(sizes):
        size = max(0, min(size, rows - start))
        items += [(group, start + first, min(chunk, size - first)) for first in range(0, size, chunk)]
        start += size
    return items + [(-1, first, min(chunk, rows - first)) for first in range(start, rows, chunk)]


@pytest.mark.parametrize(
    ("sizes", "rows"),
    [([3, 0, 20, 5], 28), ([3, 0, 20, 5], 40), ([1] * 5, 3), ([0, 0], 7), ([40, -3, 2], 30), ([16] * 4, 64),
     ([2] * 130, 300), ([9, 0, 0, 7, 1], 17), ([5], 5), ([20], 33), ([2, 2**32 + 1, 4], 30)],
    ids=str,
)  # fmt: skip
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32], ids=str)
def test_grouped_decode_work_list(sizes, rows, index_dtype):
    """The grouped decode kernel's first kernel (interpreted on a CPU): its work list holds each group's rows in runs
    of 8 or 16 (empty groups none, sizes past the rows clamped), then the rows past the sizes' sum, then items of no
    rows, within the host's bound; X' and the sums hold every row (at least an item's) in the relabelled order the
    dense form gives."""
    if max(sizes) > torch.iinfo(index_dtype).max:
        pytest.skip("an int64 size")
    d = g.int4_decode_hopper
    x = testing.randn(rows, 320, dtype=torch.bfloat16, device=DEVICE)
    chunk = d.item_rows(rows, len(sizes))
    items = torch.full((d.items_bound(rows, len(sizes), chunk), 3), 12345, dtype=torch.int32, device=DEVICE)
    m_sizes = torch.tensor(sizes, dtype=index_dtype, device=DEVICE)
    xp, sums = d.relabelled_activations(x, False, m_sizes, items, chunk)
    expected = _work_list(sizes, rows, chunk)
    assert len(expected) <= items.shape[0]
    got = [tuple(item) for item in items.tolist()]
    assert got[: len(expected)] == expected
    assert all(count == 0 for _, _, count in got[len(expected) :])
    assert xp.shape[1] >= max(rows, chunk) and sums.shape == (xp.shape[0] // 4, xp.shape[1], 4)
    dense_xp, dense_sums = d.relabelled_activations(x[:5], False)
    torch.testing.assert_close(xp[:, :5], dense_xp[:, :5], rtol=0, atol=0)
    torch.testing.assert_close(sums[:, :5], dense_sums[:, :5])
    assert not xp[:, rows:].any() and not sums[:, rows:].any()


def test_unsupported_group_size_names_the_reason():
    x, w, scale, zero = bf16_inputs(m=4, n=8, k=240, gs=24, device="cpu")  # 10 groups of 24 (no power of two)
    reasons = g.bf16i4bf16_rowwise_op.get_backend("triton").reasons("cuda", (x, w, scale, zero), {})
    assert "group size 24" in reasons[0]


# ---------------------------------------------------------------------------------------------------- T2


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("m", "n", "k"),
    [(1, 8192, 8192), (16, 8192, 8192), (64, 8192, 8192), (8192, 8192, 8192), (5, 777, 1536), (29, 1000, 3900),
     (50, 520, 2048), (300, 520, 2304)],
)  # fmt: skip
def test_bf16i4bf16_rowwise_gpu(m, n, k):
    """Every tile class of _config (M <= 16, <= 32, <= 64, <= 256, larger), odd N, K not a multiple of 128."""
    x, w, scale, zero = bf16_inputs(m=m, n=n, k=k, gs=128, device="cuda")
    out = g.bf16i4bf16_rowwise(x, w, scale, zero)
    testing.assert_rel_close(out, oracle(x, g.dequantize_int4(w, scale, zero, shuffled=False)), 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("m", "n", "k", "gs"),
    [(1, 130, 64, 64), (300, 520, 2368, 64), (1000, 1000, 3904, 128), (2000, 4000, 2048, 256),
     (4096, 4096, 4096, 128)],
)  # fmt: skip
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32, torch.float16], ids=str)
def test_hopper_kernel(m, n, k, gs, scale_dtype):
    """int4_hopper's Gluon kernel: one K step, odd and even step counts, a short last group, tiles cut by M and N,
    several tiles per program; poisoned output."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernel runs on sm_90 GPUs")
    x, w, scale, zero = bf16_inputs(m=m, n=n, k=k, gs=gs, scale_dtype=scale_dtype, device="cuda")
    assert g.int4_hopper.supports(x, w, gs)
    out = g.int4_hopper.run(x, w, scale, zero, testing.empty_poisoned(m, n, dtype=torch.bfloat16, device="cuda"), gs)
    testing.assert_rel_close(out, oracle(x, g.dequantize_int4(w, scale, zero, shuffled=False)), 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("m", "k", "gs", "gluon"),
    [(g.int4_hopper.MIN_M - 1, 1024, 128, False), (g.int4_hopper.MIN_M, 1024, 128, True),
     (g.int4_hopper.MIN_M, 1056, 64, False), (g.int4_hopper.MIN_M, 1024, 32, False),
     (g.int4_hopper.MIN_M, 1536, 192, True), (g.int4_hopper.MIN_M - 1, 1536, 192, False)],
)  # fmt: skip
def test_hopper_kernel_dispatch(m, k, gs, gluon, monkeypatch):
    """bf16i4bf16_rowwise takes the Gluon kernel on sm_90 GPUs from MIN_M rows up, for whole K steps and groups of
    whole steps (192 too, not a power of two); the Triton kernel serves the rest (fewer rows, K % 64 == 32, groups
    of 32)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernel runs on sm_90 GPUs")
    x, w, scale, zero = bf16_inputs(m=m, n=256, k=k, gs=gs, device="cuda")
    calls = []
    monkeypatch.setattr(g.int4_hopper, "run", lambda *args, run=g.int4_hopper.run: calls.append(1) or run(*args))
    out = g.bf16i4bf16_rowwise(x, w, scale, zero)
    assert len(calls) == gluon
    testing.assert_rel_close(out, oracle(x, g.dequantize_int4(w, scale, zero, shuffled=False)), 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("m", "n", "k", "gs"),
    [(1, 64, 64, 64), (16, 8192, 8192, 128), (8, 200, 320, 64), (9, 1000, 4096, 512), (16, 1024, 2048, 256),
     (3, 520, 768, 128), (13, 4104, 2304, 256)],
)  # fmt: skip
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32, torch.float16], ids=str)
def test_decode_kernel(m, n, k, gs, scale_dtype):
    """int4_decode_hopper's Gluon kernel: one run, N cut by the tile, K ending inside a stage, groups from a run to two
    stages, K split (and not), 8- and 16-row activation tiles; poisoned output."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernel runs on sm_90 GPUs")
    x, w, scale, zero = bf16_inputs(m=m, n=n, k=k, gs=gs, scale_dtype=scale_dtype, device="cuda")
    assert g.int4_decode_hopper.supports(x, w, scale, zero, gs)
    out = testing.empty_poisoned(m, n, dtype=torch.bfloat16, device="cuda")
    out = g.int4_decode_hopper.run(x, w, scale, zero, out, gs)
    testing.assert_rel_close(out, oracle(x, g.dequantize_int4(w, scale, zero, shuffled=False)), 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("m", "n", "k", "gs"), [(1, 64, 128, 128), (16, 8192, 8192, 128), (9, 1000, 4096, 512), (13, 4104, 2304, 256)]
)
def test_decode_kernel_shuffled(m, n, k, gs):
    """The decode kernel on preshuffled weights (its first kernel orders X by their layout; the rest is the same)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernel runs on sm_90 GPUs")
    x, w, scale, zero = bf16_inputs(m=m, n=n, k=k, gs=gs, device="cuda")
    assert g.int4_decode_hopper.supports(x, w, scale, zero, gs, shuffled=True)
    out = testing.empty_poisoned(m, n, dtype=torch.bfloat16, device="cuda")
    out = g.int4_decode_hopper.run(x, w, scale, zero, out, gs, shuffled=True)
    testing.assert_rel_close(out, oracle(x, g.dequantize_int4(w, scale, zero, shuffled=True)), 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("shuffled", "m", "k", "gs", "gluon"),
    [(False, 16, 1024, 128, True), (False, 17, 1024, 128, False), (False, 1, 1056, 32, False),
     (False, 4, 1536, 192, False), (False, 2, 1024, 128, False), (True, 16, 1024, 128, True),
     (True, 17, 1024, 128, False), (True, 1, 1024, 64, False), (True, 2, 1024, 128, False)],
)  # fmt: skip
def test_decode_kernel_dispatch(shuffled, m, k, gs, gluon, monkeypatch):
    """bf16i4bf16_rowwise and _shuffled take the Gluon decode kernel on sm_90 GPUs up to MAX_M rows, for whole runs
    (64 k; preshuffled: blocks of 128 k), groups of whole runs (blocks) that divide a stage or are whole stages, and
    scale rows TMA can read; the Triton kernel serves the rest (M = 2: N = 260, bf16 scale rows of 520 bytes)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernel runs on sm_90 GPUs")
    d = g.int4_decode_hopper
    x, w, scale, zero = bf16_inputs(m=m, n=256 if m != 2 else 260, k=k, gs=gs, device="cuda")
    calls = []
    monkeypatch.setattr(d, "run", lambda *args, run=d.run: calls.append(1) or run(*args))
    out = (g.bf16i4bf16_shuffled if shuffled else g.bf16i4bf16_rowwise)(x, w, scale, zero)
    assert len(calls) == gluon
    testing.assert_rel_close(out, oracle(x, g.dequantize_int4(w, scale, zero, shuffled=shuffled)), 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("m", "n", "k", "gs"), [(16, 8192, 8192, 128), (2048, 4096, 7168, 64), (100, 1024, 4096, 32), (29, 1000, 1024, 128)]
)
def test_int4_forms_gpu(m, n, k, gs):
    x, w, scale, zero = bf16_inputs(m=m, n=n, k=k, gs=gs, device="cuda")
    out = g.bf16i4bf16_shuffled(x, w, scale, zero)
    testing.assert_rel_close(out, oracle(x, g.dequantize_int4(w, scale, zero, shuffled=True)), 1e-2)
    xq, x_scale = quantize_rows(x.float())
    out = g.f8i4bf16_rowwise(xq, w, x_scale, scale.float(), zero.float())
    testing.assert_rel_close(out, oracle(xq, g.dequantize_int4(w, scale, zero, shuffled=False), x_scale), 1e-2)
    table, w_scale = g.random_fp8_table(n, k, group_size=gs, device="cuda"), torch.rand(n, device="cuda") + 0.5
    out = g.f8i4bf16_shuffled(xq, w, x_scale, w_scale, table)
    testing.assert_rel_close(out, oracle(xq, g.dequantize_int4_table(w, table), x_scale, w_scale), 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize(("groups", "rows", "n", "k"), [(8, 512, 4096, 7168), (64, 3, 2048, 1024)])
def test_grouped_gpu(groups, rows, n, k):
    sizes = [rows + (i % 3 - 1) * (rows // 4) for i in range(groups)]
    x, w, scale, zero = bf16_inputs(groups, m=1, n=n, k=k, gs=128, device="cuda")
    x = testing.randn(sum(sizes), k, dtype=torch.bfloat16, device="cuda")
    m_sizes = torch.tensor(sizes, device="cuda")
    out = g.bf16i4bf16_shuffled_grouped(x, w, scale, zero, m_sizes)
    wdq = g.dequantize_int4(w, scale, zero, shuffled=True)
    expected = torch.cat([oracle(part, wdq[i]) for i, part in enumerate(x.split(sizes))])
    testing.assert_rel_close(out, expected, 1e-2)
    xq, x_scale = quantize_rows(x.float())
    table, w_scale = g.random_fp8_table(groups, n, k, group_size=128, device="cuda"), torch.rand(groups, n).cuda()
    out = g.f8i4bf16_shuffled_grouped(xq, w, x_scale, w_scale + 0.5, table, m_sizes)
    wdq = g.dequantize_int4_table(w, table)
    parts = zip(xq.split(sizes), x_scale.split(sizes), strict=True)
    expected = torch.cat([oracle(p, wdq[i], s, w_scale[i] + 0.5) for i, (p, s) in enumerate(parts)])
    testing.assert_rel_close(out, expected, 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("groups", "rows", "n", "k", "gs", "picked"),
    [
        (8, 512, 4096, 7168, 128, "prefill"),  # the Gluon prefill kernel's 256-row tiles
        (16, 100, 1000, 2048, 64, "prefill"),  # its 128-row tiles; N past whole tiles
        (16, 20, 1000, 2048, 64, "prefill"),  # more than MAX_M rows a group on average
        (64, 3, 2048, 1024, 64, "decode"),  # decode-like groups: the Gluon decode kernel
        (64, 3, 2048, 1000, 64, "triton"),  # K past whole steps of 64: the Triton kernel
    ],
    ids=str,
)
def test_plain_grouped_gpu_and_graph(groups, rows, n, k, gs, picked, monkeypatch):
    """The plain layout's grouped GEMM at MoE-like shapes, with an empty group, eager and replayed from a CUDA graph
    with new sizes written into M_sizes (read on the device, so the replay follows them; the rows past their sum
    are zero), in the kernel that dispatch picks."""
    calls = []
    for name, module in (("prefill", g.int4_hopper), ("decode", g.int4_decode_hopper)):
        monkeypatch.setattr(
            module, "run", lambda *a, run=module.run, name=name, **kw: calls.append(name) or run(*a, **kw)
        )
    sizes = [0 if i == 1 else rows + (i % 3 - 1) * (rows // 4) for i in range(groups)]
    _, w, scale, zero = bf16_inputs(groups, m=1, n=n, k=k, gs=gs, device="cuda")
    x = testing.randn(sum(sizes), k, dtype=torch.bfloat16, device="cuda")
    wdq = g.dequantize_int4(w, scale, zero, shuffled=False)

    def expected(sizes):
        parts = [oracle(part, wdq[i]) for i, part in enumerate(x[: sum(sizes)].split(sizes))]
        return torch.cat([*parts, torch.zeros(x.shape[0] - sum(sizes), n, dtype=torch.float64, device="cuda")])

    m_sizes = torch.tensor(sizes, dtype=torch.int32 if groups == 16 else torch.int64, device="cuda")
    testing.assert_rel_close(matmul_bf16i4_rowwise_grouped(x, w, scale, zero, m_sizes), expected(sizes), 1e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = matmul_bf16i4_rowwise_grouped_fused(x, w, scale, zero, m_sizes)
    fewer = [size // 2 for size in sizes]
    m_sizes.copy_(torch.tensor(fewer))
    testing.poison_(out)
    graph.replay()
    testing.assert_rel_close(out, expected(fewer), 1e-2)
    assert set(calls) == ({picked} - {"triton"})


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("sizes", "rows", "n", "k", "gs"),
    [
        ([3, 0, 20, 5, 1], 40, 200, 512, 128),  # 8-row items: an empty group, one of three items; rows past the sum
        ([1] * 8, 8, 64, 64, 64),  # one run of K (plain only)
        ([17, 0, 30, 9], 64, 1000, 2304, 256),  # 16-row items; K ending inside a stage; N past whole tiles
        ([5, 0], 5, 64, 4096, 128),  # one tile, three items at most: K split
        ([4] * 100 + [0] * 28, 400, 256, 1024, 512),  # many groups, empty ones last
        ([2, 70, -1, 3], 60, 136, 768, 128),  # a size past the rows (clamped), a negative one
    ],
    ids=str,
)  # fmt: skip
@pytest.mark.parametrize("shuffled", [False, True], ids=["plain", "shuffled"])
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_grouped_decode_kernel(sizes, rows, n, k, gs, shuffled, scale_dtype):
    """int4_decode_hopper's grouped form, called directly: poisoned output, the rows past the sizes' sum zero."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernel runs on sm_90 GPUs")
    if shuffled and (k % 128 or gs % 128):
        pytest.skip("the preshuffled layout comes in blocks of 128 k")
    _, w, scale, zero = bf16_inputs(len(sizes), m=1, n=n, k=k, gs=gs, scale_dtype=scale_dtype, device="cuda")
    x = testing.randn(rows, k, dtype=torch.bfloat16, device="cuda")
    m_sizes = torch.tensor(sizes, device="cuda")
    assert g.int4_decode_hopper.supports(x, w, scale, zero, gs, shuffled)
    out = testing.empty_poisoned(rows, n, dtype=torch.bfloat16, device="cuda")
    out = g.int4_decode_hopper.run(x, w, scale, zero, out, gs, shuffled, sizes=m_sizes)
    wdq = g.dequantize_int4(w, scale, zero, shuffled=shuffled)
    expected, start = torch.zeros(rows, n, dtype=torch.float64, device="cuda"), 0
    for group, size in enumerate(sizes):
        size = max(0, min(size, rows - start))
        expected[start : start + size] = oracle(x[start : start + size], wdq[group])
        start += size
    testing.assert_rel_close(out, expected, 1e-2)
    assert (out[start:] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("batches", "m", "n", "k", "gs"), [(3, 1, 200, 512, 128), (4, 16, 1000, 2304, 256), (2, 9, 64, 4096, 128)]
)
@pytest.mark.parametrize("shuffled", [False, True], ids=["plain", "shuffled"])
def test_batched_decode_takes_the_grouped_decode_kernel(batches, m, n, k, gs, shuffled, monkeypatch):
    """bf16i4bf16_{rowwise,shuffled}_batched with at most MAX_M rows a batch: the decode kernel's grouped form
    (a group a batch), poisoned output."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernel runs on sm_90 GPUs")
    calls = []
    d = g.int4_decode_hopper
    monkeypatch.setattr(d, "run", lambda *a, run=d.run, **kw: calls.append(kw.get("sizes")) or run(*a, **kw))
    x, w, scale, zero = bf16_inputs(batches, m=m, n=n, k=k, gs=gs, device="cuda")
    op = g.bf16i4bf16_shuffled_batched if shuffled else g.bf16i4bf16_rowwise_batched
    out = op(x, w, scale, zero)
    assert len(calls) == 1 and calls[0].tolist() == [m] * batches
    testing.assert_rel_close(out, oracle(x, g.dequantize_int4(w, scale, zero, shuffled=shuffled)), 1e-2)


@pytest.mark.gpu
def test_decode_records_into_a_cuda_graph():
    """Split K included: the workspace is allocated while capturing and the reduction is recorded too. Three calls,
    each reading the output of the one before, eager and replayed: each kernel launched as a dependent (the split-K
    reduction, and the next call's GEMM) must see all the writes of the kernel before it."""
    x, w, scale, zero = bf16_inputs(m=16, n=8192, k=8192, gs=128, device="cuda")
    wdq = g.dequantize_int4(w, scale, zero, shuffled=False)

    def chain(x):
        outs = [x]
        for _ in range(3):
            outs.append(g.bf16i4bf16_rowwise(outs[-1], w, scale, zero))
        return outs

    def check(outs):
        for before, out in itertools.pairwise(outs):
            testing.assert_rel_close(out, oracle(before, wdq), 1e-2)

    check(chain(x))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = chain(x)
    x.copy_(testing.randn(16, 8192, dtype=torch.bfloat16, device="cuda"))
    graph.replay()
    check(outs)
