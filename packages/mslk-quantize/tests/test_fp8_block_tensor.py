"""quantize_fp8_block / quantize_fp8_group / quantize_fp8_tensor and their helpers (spec Q-03..Q-09).

T0: references against the formulas, errors, layouts. T1 (CPU, interpreter) and T2 (GPU): the Triton
kernels against the references, bit for bit on the GPU.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mslk.core import formats, testing
from mslk.quantize import reference
from mslk.quantize.triton import fp8_quantize
from mslk.quantize.triton.fp8_quantize import (
    dequantize_fp8_block,
    quantize_fp8_block,
    quantize_fp8_block_op,
    quantize_fp8_group,
    quantize_fp8_tensor,
    quantize_fp8_tensor_op,
    scale_fp8_row,
    triton_quantize_fp8_block,
    triton_quantize_fp8_group,
    triton_quantize_fp8_tensor,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-12


def _cpu(values):
    return [v.cpu() if isinstance(v, torch.Tensor) else v for v in values]


def _same(kernel_out, ref_out):
    (xq, scale), (ref_xq, ref_scale) = kernel_out, ref_out
    assert scale.shape == ref_scale.shape, (scale.shape, ref_scale.shape)
    torch.testing.assert_close(scale.cpu(), ref_scale, rtol=0, atol=0, equal_nan=True)
    testing.assert_fp8_equal(xq.cpu(), ref_xq)


# ------------------------------------------------------------------------------------------- T0


@settings(deadline=None, max_examples=30)
@given(
    m=st.integers(1, 300),
    k=st.integers(1, 300),
    bm=st.sampled_from([1, 32, 128, 256]),
    bk=st.sampled_from([32, 128, 256]),
    k_major=st.booleans(),
)
def test_block_reference_layout_and_bounds(m, k, bm, bk, k_major):
    x = testing.randn(m, k, std=4.0)
    xq, scale = quantize_fp8_block(x, bm, bk, k_major=k_major)
    formats.Blockwise(bm, bk, k_major=k_major).check(xq, scale)
    kmajor = scale if k_major else scale.t()
    for i, j in [(0, 0), (kmajor.shape[0] - 1, kmajor.shape[1] - 1)]:
        tile = x[i * bm : (i + 1) * bm, j * bk : (j + 1) * bk]
        assert kmajor[i, j] == max(tile.abs().max().item(), EPS) / 448.0
    back = dequantize_fp8_block(xq, kmajor.contiguous(), bm, bk).double()
    assert ((back - x.double()).abs() <= x.double().abs() / 16 + kmajor.max().item() * 448 * 2**-9 + 1e-3).all()


def test_group_is_block_with_one_row_and_m_sizes_layout():
    x = testing.randn(10, 300, dtype=torch.bfloat16)
    _, scale = quantize_fp8_group(x, 128)
    _, ref_scale = quantize_fp8_block(x, 1, 128)
    assert scale.shape == (10, 3) and torch.equal(scale, ref_scale)
    _, m_major = quantize_fp8_group(x, 128, k_major=False)
    assert torch.equal(m_major, ref_scale.t())
    _, per_expert = quantize_fp8_group(x, 128, m_sizes=torch.tensor([3, 0, 7]))
    flat = per_expert.reshape(-1)
    assert torch.equal(flat[:9], ref_scale[:3].t().reshape(-1))
    assert torch.equal(flat[9:], ref_scale[3:].t().reshape(-1))
    with pytest.raises(ValueError, match="m_sizes must be a 1-D integer tensor"):
        quantize_fp8_group(x, 128, m_sizes=torch.tensor([3.0, 7.0]))
    with pytest.raises(ValueError, match="quantize_fp8_group: x must be float32"):  # (quantize_fp8_block's error)
        quantize_fp8_group(torch.ones(4, 128, dtype=torch.int32))
    with pytest.raises(ValueError, match="quantize_fp8_group: group_size must be positive"):
        quantize_fp8_group(x, 0)
    with pytest.raises(ValueError, match="quantize_fp8_group: all tensors must be on one device"):
        quantize_fp8_group(x, 128, m_sizes=torch.tensor([3, 0, 7], device="meta"))
    _, raw = triton_quantize_fp8_group(x, 128, None, torch.tensor([3, 0, 7]))  # spec Q-06's entry and order
    assert torch.equal(raw, per_expert)


@pytest.mark.parametrize(
    ("sizes", "blocks"),
    [([3, 4], [3, 4, 3]), ([6, 9], [6, 4]), ([], [10]), ([2, -1, 5], [2, 0, 5, 3])],
    ids=["short", "past-M", "none", "negative"],
)
def test_group_m_sizes_that_do_not_fit_the_rows(sizes, blocks):
    """m_sizes summing below M (a padded MoE buffer), past it, empty or negative: every row's scales in a block of
    their own (the rows past the sum after the experts), none written over another's (they were, or IndexError)."""
    x = testing.randn(10, 256, std=3.0) * torch.arange(1, 11)[:, None]  # rows of distinct scales
    _, k_major = quantize_fp8_group(x, 128)
    _, per_expert = quantize_fp8_group(x, 128, m_sizes=torch.tensor(sizes, dtype=torch.int64))
    flat, first = per_expert.reshape(-1), 0
    for rows in blocks:  # each block [G, rows] M-major at offset first · G
        assert torch.equal(flat[first * 2 : (first + rows) * 2], k_major[first : first + rows].t().reshape(-1))
        first += rows


def test_tensor_reference():
    a = testing.randn(3, 4, 5, std=7.0)
    xq, scale = quantize_fp8_tensor(a)
    assert scale.dim() == 0 and torch.equal(scale, a.abs().max() / torch.tensor(448.0))
    testing.assert_rel_close(xq.float() * scale, a, 0.05)
    _, zero_scale = quantize_fp8_tensor(torch.zeros(4))
    assert zero_scale.item() == pytest.approx(EPS / 448.0)
    cl = testing.randn(2, 3, 4, 5, 6).to(memory_format=torch.channels_last_3d)
    assert quantize_fp8_tensor(cl)[0].is_contiguous(memory_format=torch.channels_last_3d)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: quantize_fp8_block(torch.ones(4, 4, dtype=torch.int8)), "x must be float32, float16 or bfloat16"),
        (lambda: quantize_fp8_block(torch.ones(4, 4), 0, 128), "block_m and block_k must be positive"),
        (
            lambda: dequantize_fp8_block(torch.ones(4, 4).to(torch.float8_e4m3fn), torch.ones(1, 1), 4, 0),
            "blockwise scales need a positive integer block_k, got 0",
        ),
        (lambda: quantize_fp8_block(torch.ones(4, 4), scale_ub=torch.ones(3)), "scale_ub must be one float32"),
        (lambda: quantize_fp8_tensor(torch.ones(4, dtype=torch.int32)), "a must be float32, float16 or bfloat16"),
        (lambda: scale_fp8_row(torch.ones(2, 3), torch.ones(3), torch.ones(3)), "expected a \\[M, N\\], x_scale"),
    ],
)
def test_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_dequantize_block_checks_layout():
    xq, scale = quantize_fp8_block(testing.randn(300, 300), 128, 128)
    with pytest.raises(formats.ScaleFormatError, match=r"expected a blockwise\(256, 256\) scale"):
        dequantize_fp8_block(xq, scale)


def test_scale_fp8_row():
    a, xs, ws = testing.randn(3, 4), testing.randn(3), testing.randn(4)
    testing.assert_rel_close(scale_fp8_row(a, xs, ws), a * xs[:, None] * ws[None, :], 0.0)


def test_non_power_of_two_blocks_fall_back_to_the_reference():
    x = testing.randn(50, 50, device=DEVICE)
    reasons = quantize_fp8_block_op.get_backend("triton").reasons(x.device.type, (x, 96, 128), {})
    if DEVICE == "cuda":
        assert reasons == ["block_m=96, block_k=128: the Triton kernel needs powers of two"]
    _same(
        quantize_fp8_block(x, 96, 128),
        reference.quantize_fp8_block(x.cpu(), 96, 128, None, True, EPS, torch.float8_e4m3fn),
    )


def test_blocks_past_the_data_are_one_block_of_it():
    """A block longer than the data is valid (scales [⌈M/bm⌉, ⌈K/bk⌉]): the reference once padded x to whole
    blocks, 2^30 columns and more (out of memory); the kernel cuts such a block to the data (BLOCK_CASES), and
    past 2^20 columns the reference serves."""
    x = testing.randn(5, 70, std=3.0)
    for bm, bk in ((1, 10**9), (2**40, 2**30)):
        xq, scale = quantize_fp8_block(x, bm, bk)
        blocks = [x] if bm > 5 else list(x[:, None])
        assert torch.equal(scale, torch.stack([b.abs().max() / 448.0 for b in blocks])[:, None])
        testing.assert_rel_close(dequantize_fp8_block(xq, scale, bm, bk), x, 0.07)
    wide = torch.ones(1, 2**21)
    assert "the kernel's tiles hold 1048576 at most" in fp8_quantize._triton_block_supports(wide, 1, 2**21)[-1]


def test_compile_and_export():
    class Quantize(torch.nn.Module):
        def forward(self, a):
            return quantize_fp8_block(a, 128, 128), quantize_fp8_tensor(a)

    a = testing.randn(130, 260, dtype=torch.bfloat16)
    (_, scale), (tq, tscale) = torch.compile(Quantize(), fullgraph=True, backend="aot_eager")(a)
    assert scale.shape == (2, 3) and tscale.shape == () and tq.shape == a.shape
    graph = str(torch.export.export(Quantize(), (a,)).graph)
    assert "triton.quantize_fp8_block" in graph and "triton.quantize_fp8_tensor" in graph


# -------------------------------------------------------------------------- T1 (CPU) / T2 (GPU)

GPU = pytest.mark.gpu  # shapes too large for the interpreter: T2 only
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# Several 128- or 256-wide tiles per axis take seconds a call under the interpreter: on CPU each of these runs in
# one dtype (the dtype changes only the load's conversion, which the cases below check in all three), on the GPU in
# all three.
TILED_CASES = [((150, 260), 128, 128, True), ((150, 260), 128, 128, False), ((150, 300), 256, 256, True)]
BLOCK_CASES = [  # (shape, block_m, block_k, k_major[, GPU])
    ((1000, 3000), 128, 128, True, GPU),
    ((4096, 7168), 1, 128, False, GPU),
    ((1000, 3000), 256, 256, False, GPU),
    ((5, 70), 1, 32, False),
    ((7, 9), 1, 128, True),
    ((2, 40, 33), 256, 256, True),
    ((5, 70), 2, 2**30, True),  # blocks past the data: one block of all of it
    ((3, 7, 70), 2**40, 2**30, False),
    ((1, 4096), 1, 128, True),
    ((129, 129), 64, 32, True),
    ((0, 5), 128, 128, True),
    ((3, 0), 128, 128, True),
]
BLOCK_PARAMS = [
    pytest.param(*case, dtype, marks=[] if dtype == DTYPES[i] else GPU)
    for i, case in enumerate(TILED_CASES)
    for dtype in DTYPES
] + [pytest.param(*case[:4], dtype, marks=case[4:]) for case in BLOCK_CASES for dtype in DTYPES]


@pytest.mark.parametrize(("shape", "bm", "bk", "k_major", "dtype"), BLOCK_PARAMS, ids=str)
def test_block_kernel_matches_reference(shape, bm, bk, k_major, dtype):
    x = testing.randn(*shape, dtype=dtype, device=DEVICE, std=3.0)
    _same(
        triton_quantize_fp8_block(x, bm, bk, k_major=k_major),
        quantize_fp8_block_op.reference(x.cpu(), bm, bk, k_major=k_major),
    )


def test_raw_block_entry_takes_the_spec_order_and_checks_its_inputs():
    """triton_quantize_fp8_block(x, block_m, block_k, scale_ub, k_major) (spec Q-04): a positional k_major lands
    there (it was read as use_triton); blocks the kernel cannot tile are refused before it runs."""
    x = testing.randn(130, 260, device=DEVICE)
    _, scale = triton_quantize_fp8_block(x, 128, 128, None, False)
    assert scale.shape == (3, 2)
    backend = quantize_fp8_block_op.get_backend("triton").impl
    tiny = x[:3, :300]
    assert backend(tiny)[1].shape == (1, 2), "the op's backend takes the op's defaults (256 x 256 blocks)"
    with pytest.raises(ValueError, match="block_m and block_k must be positive"):
        triton_quantize_fp8_block(x, 0, 16)
    with pytest.raises(ValueError, match=r"triton_quantize_fp8_block: block_m=24, block_k=40: .* powers of two"):
        triton_quantize_fp8_block(x, 24, 40)


def test_block_kernel_special_values_and_strides(monkeypatch):
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *args, **kwargs: testing.poison_(empty(*args, **kwargs)))
    x = testing.randn(140, 300, device=DEVICE)
    x[5, 7], x[130, 290] = float("nan"), float("inf")
    for args in [(x, 128, 128), (x, 1, 128), (x, 256, 256), (x, 128, 128, torch.tensor([3.0], device=DEVICE))]:
        _same(triton_quantize_fp8_block(*args), quantize_fp8_block_op.reference(*_cpu(args)))
    y = testing.padded_rows(testing.randn(130, 200, dtype=torch.bfloat16, device=DEVICE))
    _same(triton_quantize_fp8_block(y, 128, 128), quantize_fp8_block_op.reference(y.cpu(), 128, 128))
    t = testing.randn(200, 130, device=DEVICE).t()
    _same(triton_quantize_fp8_block(t, 1, 128), quantize_fp8_block_op.reference(t.cpu(), 1, 128))


TENSOR_CASES = [(7, 33), (2, 3, 4, 5, 6), (0, 3), (100_003,), pytest.param((4096, 8191), marks=GPU)]


@pytest.mark.parametrize("shape", TENSOR_CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_tensor_kernel_matches_reference(shape, dtype):
    a = testing.randn(*shape, dtype=dtype, device=DEVICE, std=5.0)
    _same(triton_quantize_fp8_tensor(a), quantize_fp8_tensor_op.reference(a.cpu()))


def test_tensor_kernel_layouts_and_special_values(monkeypatch):
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *args, **kwargs: testing.poison_(empty(*args, **kwargs)))
    cl = testing.randn(2, 3, 4, 5, device=DEVICE).to(memory_format=torch.channels_last)
    xq, _ = triton_quantize_fp8_tensor(cl)
    assert xq.is_contiguous(memory_format=torch.channels_last)
    _same((xq, _), quantize_fp8_tensor_op.reference(cl.cpu()))
    t = testing.randn(50, 6, device=DEVICE).t()
    _same(triton_quantize_fp8_tensor(t), quantize_fp8_tensor_op.reference(t.cpu()))
    a = testing.randn(1000, device=DEVICE)
    a[17] = float("inf")
    _same(triton_quantize_fp8_tensor(a), quantize_fp8_tensor_op.reference(a.cpu()))
    a[500] = float("nan")
    assert triton_quantize_fp8_tensor(a)[1].isnan(), "a NaN anywhere gives a NaN scale"


@pytest.mark.parametrize("bm", [1, 2, 32, 64, 128, 256])
@pytest.mark.parametrize("bk", [32, 128, 256, 1024])
@pytest.mark.parametrize(("m", "k"), [(1, 1), (5, 70), (8192, 8192), (16384, 5120)])
def test_block_tiles_stay_within_the_register_budget(bm, bk, m, k):
    from mslk.quantize.triton.fp8_quantize import _BLOCK_TILE, _block_launch_config

    config = _block_launch_config(bm, bk, m, k)
    assert config["TILE_M"] * config["TILE_K"] <= max(_BLOCK_TILE, bk)
    if config["WHOLE_BLOCKS"]:
        assert config["TILE_M"] % bm == 0 and config["TILE_K"] % bk == 0


def test_triton_namespace_schemas_take_symbolic_sizes():
    """The reference's torch.ops.triton schemas (its custom_op inference): sizes are SymInt, so that a compiled
    caller with dynamic shapes can pass one."""
    row = str(torch.ops.triton.quantize_fp8_row.default._schema)
    block = str(torch.ops.triton.quantize_fp8_block.default._schema)
    assert "SymInt? align_rows_to=None" in row
    assert "SymInt block_m=256, SymInt block_k=256" in block
