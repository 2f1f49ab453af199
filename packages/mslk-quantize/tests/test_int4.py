"""INT4 helpers (spec Q-18..Q-21, G-32): plain PyTorch, so tier T0 covers them on every device."""

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from mslk.core import formats, testing
from mslk.quantize import shuffle
from mslk.quantize.shuffle import int4_row_quantize, int4_row_quantize_zp, pack_int4, unpack_int4

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _per_element(s: torch.Tensor, k: int, group_size: int) -> torch.Tensor:
    """[G, N] group values -> [N, K]."""
    return s.t().repeat_interleave(group_size, dim=1)[:, :k]


def _readable(k: int, gs: int) -> bool:
    """Whether the INT4 GEMMs read group size gs back from ⌈k / gs⌉ scale rows (else the quantizers refuse it)."""
    groups = -(-k // gs)
    return groups == 1 or formats.int4_group_size(k, groups) == gs


def test_group_sizes_the_gemms_would_misread_are_refused():
    """The GEMMs read a scale row count that divides K as groups of K / count (the spec's rule): a group size
    whose shorter last group gives such a count would come back as another grouping."""
    for quantize in (int4_row_quantize, int4_row_quantize_zp):
        with pytest.raises(ValueError, match="would read its 2 scale rows as groups of 192"):
            quantize(torch.randn(4, 384), 256)
        with pytest.raises(ValueError, match="would read its 3 scale rows as no group size"):
            quantize(torch.randn(4, 200), 96)
        assert quantize(torch.randn(4, 384), 192)[1].shape == (2, 4)  # divides K
        assert quantize(torch.randn(4, 200), 32)[1].shape == (7, 4)  # 7 groups: 32, the last of 8
        assert quantize(torch.randn(4, 100), 128)[1].shape == (1, 4)  # one group: the same grouping


@settings(deadline=None, max_examples=30)
@given(n=st.integers(1, 9), k=st.integers(1, 300), gs=st.sampled_from([32, 64, 128, 256]))
def test_asymmetric_round_trip(n, k, gs):
    assume(_readable(k, gs))
    x = testing.randn(n, k, std=3.0)
    q, scale, zero = int4_row_quantize_zp(x, gs)
    groups = -(-k // gs)
    assert q.dtype == torch.int8 and q.shape == (n, k) and scale.shape == zero.shape == (groups, n)
    assert q.min() >= -8 and q.max() <= 7
    back = q.float() * _per_element(scale, k, gs) + _per_element(zero, k, gs)
    assert ((back - x).abs() <= _per_element(scale, k, gs) / 2 + 1e-5).all()


@settings(deadline=None, max_examples=30)
@given(n=st.integers(1, 9), k=st.integers(1, 300), gs=st.sampled_from([32, 128]))
def test_symmetric_round_trip(n, k, gs):
    assume(_readable(k, gs))
    x = testing.randn(n, k, std=3.0)
    q, scale = int4_row_quantize(x, gs)
    per = _per_element(scale, k, gs)
    back = q.float() * per
    # Half a step of error, except above 7.5 steps, where +8 clamps to 7 (at most one step).
    err = (back - x).abs()
    inside = x / per <= 7.5
    assert (err[inside] <= per[inside] / 2 + 1e-5).all() and (err <= per + 1e-5).all()


def test_constant_and_zero_groups_do_not_divide_by_zero():
    q, scale, zero = int4_row_quantize_zp(torch.full((2, 64), 3.0), 32)
    assert torch.isfinite(scale).all()
    torch.testing.assert_close(
        q.float() * _per_element(scale, 64, 32) + _per_element(zero, 64, 32), torch.full((2, 64), 3.0)
    )
    q, scale = int4_row_quantize(torch.zeros(2, 64), 32)
    assert (q == 0).all() and torch.isfinite(scale).all()


def test_pack_nibble_order_and_round_trip():
    x = torch.tensor([[1, -2, 7, -8]], dtype=torch.int8)
    packed = pack_int4(x)
    assert packed.view(torch.uint8).tolist() == [[0xE1, 0x87]]
    assert torch.equal(unpack_int4(packed), x)
    y = torch.randint(-8, 8, (5, 64), dtype=torch.int8)
    assert torch.equal(unpack_int4(pack_int4(y)), y)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_gpu_int4_preshuffle_in_cuda_graph(dtype):
    """Weights quantized inside a CUDA graph come out as eagerly (the quantizer packs without pack_int4's host
    check); pack_int4 itself says that it cannot be captured."""
    w = testing.randn(256, 384, device="cuda")
    expected = shuffle.quantize_int4_preshuffle(w, dtype=dtype)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = shuffle.quantize_int4_preshuffle(w, dtype=dtype)
        with pytest.raises(ValueError, match="outside CUDA graph capture"):
            pack_int4(torch.zeros(4, 8, dtype=torch.int8, device="cuda"))
    outputs = [got[0], *got[1]]
    for t in outputs:
        testing.poison_(t)
    graph.replay()
    for t, e in zip(outputs, [expected[0], *expected[1]], strict=True):
        assert torch.equal(t.view(torch.uint8), e.view(torch.uint8))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: pack_int4(torch.zeros(2, 3, dtype=torch.int8)), "K even"),
        (lambda: pack_int4(torch.zeros(2, 4)), "expected int8"),
        (lambda: pack_int4(torch.tensor([[3, 9]], dtype=torch.int8)), r"in \[-8, 7\], got \[3, 9\]"),  # 9 wrapped to -7
        (lambda: unpack_int4(torch.zeros(2, 4)), "unpack_int4: expected packed int4 int8"),
        (lambda: int4_row_quantize(torch.zeros(2, 4, dtype=torch.int32)), "floating-point"),
        (lambda: int4_row_quantize_zp(torch.zeros(2, 3, 4)), "2-D"),
        (lambda: int4_row_quantize(torch.zeros(2, 4), 0), "group_size must be a positive int"),
        (lambda: int4_row_quantize(torch.zeros(2, 4), 1.5), "group_size must be a positive int, got 1.5"),
        (lambda: int4_row_quantize_zp(torch.zeros(2, 128), 128, torch.int8), "scale_dtype must be one of"),
        (lambda: shuffle.quantize_int4_preshuffle(torch.ones(4, 0)), "positive multiple of 128"),
        (  # 3 scale rows for K = 256: no group size the GEMMs read (it went through to fail at the GEMM)
            lambda: shuffle.preshuffle_i4(
                torch.zeros(4, 128, dtype=torch.int8), torch.ones(3, 4, dtype=torch.bfloat16)
            ),
            r"\[\.\.\., K/group_size, N\]",
        ),
        (lambda: shuffle.preshuffle_i4(torch.zeros(4, 96, dtype=torch.int8), torch.ones(1, 4)), "multiple of 128"),
        (
            lambda: shuffle.preshuffle_i4(torch.zeros(4, 64, dtype=torch.int8), torch.ones(1, 4)),
            "float8_e4m3fn .* or bfloat16",
        ),
        (
            lambda: shuffle.preshuffle_i4(torch.zeros(4, 64, dtype=torch.int8), torch.ones(1, 5, dtype=torch.bfloat16)),
            r"\[\.\.\., K/group_size, N\]",
        ),
        (lambda: shuffle.quantize_int4_preshuffle(torch.ones(4, 192)), "multiple of 128"),
        (lambda: shuffle.quantize_int4_preshuffle(torch.ones(4, 384), 256), "multiple of the group size 256"),
        (lambda: shuffle.quantize_int4_preshuffle(torch.ones(4, 128), dtype="int8"), 'dtype must be "fp8" or "bf16"'),
    ],
)
def test_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_empty_weights():
    """No rows, no matrices: empty outputs of the right shapes (view(n, -1) and reshape(-1, K) had failed)."""
    assert int4_row_quantize_zp(torch.ones(0, 256), 128)[0].shape == (0, 256)
    assert int4_row_quantize(torch.ones(0, 256), 128)[1].shape == (2, 0)
    for shape in [(0, 256), (2, 0, 256), (0, 4, 256)]:
        wq, (scale, zero) = shuffle.quantize_int4_preshuffle(torch.ones(shape), 128, "bf16")
        assert wq.shape == (*shape[:-1], 128) and scale.shape == zero.shape == (*shape[:-2], 2, shape[-2])


@settings(deadline=None, max_examples=30)
@given(lead=st.lists(st.integers(1, 3), max_size=2), n=st.integers(1, 9), runs=st.integers(1, 3))
def test_preshuffle_round_trip(lead, n, runs):
    q = torch.randint(-8, 8, (*lead, n, 128 * runs), dtype=torch.int8)
    wq, _ = shuffle.preshuffle_i4(pack_int4(q), torch.ones(*lead, runs, n, dtype=torch.bfloat16))
    assert wq.shape == (*lead, n, 64 * runs) and torch.equal(shuffle.unshuffle_i4(wq), q)


def test_preshuffled_layout():
    q = torch.randint(-8, 8, (3, 5, 384), dtype=torch.int8)
    scale = torch.rand(3, 3, 5).to(torch.bfloat16)
    wq, same = shuffle.preshuffle_i4(pack_int4(q), scale)
    assert wq.shape == (3, 5, 192) and wq.dtype == torch.int8
    assert torch.equal(same, scale) and same.data_ptr() != scale.data_ptr(), "scales come back as a copy"
    # Byte j of run r: low nibble k = 128 r + j, high nibble k = 128 r + 64 + j.
    nibbles = wq.view(torch.uint8)
    for r, j in [(0, 0), (0, 63), (1, 5), (2, 40)]:
        byte = nibbles[1, 2, 64 * r + j].item()
        assert (byte & 0xF) == q[1, 2, 128 * r + j].item() & 0xF
        assert (byte >> 4) == q[1, 2, 128 * r + 64 + j].item() & 0xF
    assert torch.equal(shuffle.unshuffle_i4(wq), q)
    assert torch.equal(shuffle.unshuffle_i4(wq[:, 1:3]), q[:, 1:3]), "slicing N keeps the layout"


def test_preshuffle_fp8_scale_table():
    scale = (torch.rand(2, 6) * 4).to(torch.float8_e4m3fn)
    _, table = shuffle.preshuffle_i4(torch.zeros(6, 64, dtype=torch.int8), scale)
    assert table.shape == (2, 8, 6) and table.dtype == torch.float8_e4m3fn
    assert torch.equal(table[:, 0].float(), scale.float())
    for m in range(1, 9):
        assert torch.equal(table[:, m - 1], (scale.float() * m).to(torch.float8_e4m3fn))


def _per_k(scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """[..., K/gs, N] -> [..., N, K]."""
    return scale.float().repeat_interleave(group_size, dim=-2).transpose(-1, -2)


@pytest.mark.parametrize(
    ("shape", "group_size"), [((16, 256), 256), ((2, 24, 128), 32), ((3, 1, 8, 384), 128)], ids=str
)
def test_quantize_int4_preshuffle_fp8(shape, group_size):
    w = testing.randn(*shape, dtype=torch.bfloat16, device=DEVICE, std=0.05)
    wq, (table, row_scale) = shuffle.quantize_int4_preshuffle(w, group_size, "fp8")
    n, k = shape[-2:]
    assert wq.shape == (*shape[:-1], k // 2) and row_scale.shape == shape[:-1]
    assert table.shape == (*shape[:-2], k // group_size, 8, n)
    group_scale = _per_k(table[..., 0, :], group_size) * row_scale[..., None]
    back = shuffle.unshuffle_i4(wq).float() * group_scale
    # One int4 step at most (half a step of rounding, a step where +8 clamps to 7), plus FP8's rounding.
    assert ((back - w.float()).abs() <= group_scale + w.float().abs() * 2**-4).all()
    # Batched weights are quantized matrix by matrix.
    first = shuffle.quantize_int4_preshuffle(w.reshape(-1, n, k)[0], group_size, "fp8")
    assert torch.equal(first[0], wq.reshape(-1, n, k // 2)[0])
    # float64 weights as fp32 ones (quantize_fp8_row, the first step, takes 32 bits at most: its error was shown)
    wide, narrow = (
        shuffle.quantize_int4_preshuffle(w.to(dtype), group_size, "fp8") for dtype in (torch.float64, torch.float32)
    )
    assert torch.equal(wide[0], narrow[0]) and torch.equal(wide[1][1], narrow[1][1])


@pytest.mark.parametrize("use_zp", [True, False])
@pytest.mark.parametrize("shape", [(16, 256), (2, 24, 128)], ids=str)
def test_quantize_int4_preshuffle_bf16(shape, use_zp):
    w = testing.randn(*shape, device=DEVICE, std=0.05)
    wq, (scale, zero) = shuffle.quantize_int4_preshuffle(w, 64, "bf16", use_zp)
    assert scale.dtype == zero.dtype == torch.bfloat16 and scale.shape == (*shape[:-2], shape[-1] // 64, shape[-2])
    assert scale.is_contiguous() and zero.is_contiguous(), "as the shuffled GEMMs take them"
    assert use_zp or (zero == 0).all()
    step = _per_k(scale, 64)
    back = shuffle.unshuffle_i4(wq).float() * step + _per_k(zero, 64)
    # q is computed against the stored bf16 scale and zero: within half a step. Symmetric: up to a step where
    # +8 clamps to 7, and 8 · 2^-8 more as the bf16 scale may round below amax / 8.
    bound = step / 2 * 1.001 if use_zp else step * 1.04
    assert ((back - w).abs() <= bound + 1e-6).all()


@pytest.mark.parametrize("n_lane", [16, 32])
def test_ck_preshuffle_moves_each_element_to_its_lane(n_lane):
    """ck_preshuffle (spec Q-22): element (n, k) of tile (n0, k0), n = n0·NL + nl, k = (k0·KL + kl)·16 + kp, lands
    at [n0, k0, kl, nl, kp] of the output read as (N0, K0, KL, NL, 16); fnuz FP8 only, as CK's."""
    n, k, k_lane = 2 * n_lane, 2 * (64 // n_lane) * 16, 64 // n_lane
    values = torch.arange(n * k, dtype=torch.float32).reshape(n, k)  # indices, checked through a float copy
    src = testing.randn(n, k).to(torch.float8_e4m3fnuz)
    out = shuffle.ck_preshuffle(src, n_lane)
    moved = shuffle._mfma_b_layout("test", values, n_lane).reshape(n // n_lane, k // (k_lane * 16), k_lane, n_lane, 16)
    for n0, k0, kl, nl, kp in [(0, 0, 0, 0, 0), (1, 1, k_lane - 1, n_lane - 1, 15), (1, 0, 1, 3, 7)]:
        assert moved[n0, k0, kl, nl, kp] == values[n0 * n_lane + nl, (k0 * k_lane + kl) * 16 + kp]
    assert out.shape == src.shape and out.dtype == src.dtype
    assert torch.equal(out.view(torch.uint8).flatten().sort().values, src.view(torch.uint8).flatten().sort().values)
    assert torch.equal(shuffle._mfma_b_layout("test", src.view(torch.uint8), n_lane), out.view(torch.uint8))


def test_preshuffle_b_mfma_batched_and_bad_input():
    w = testing.randn(3, 32, 128, dtype=torch.bfloat16)
    out = shuffle.preshuffle_b_mfma(w)
    assert out.shape == w.shape and torch.equal(out[1], shuffle.preshuffle_b_mfma(w[1]))
    with pytest.raises(ValueError, match=r"N a multiple of 16 and K of 64, got shape \(3, 32, 96\)"):
        shuffle.preshuffle_b_mfma(w[..., :96])
    with pytest.raises(TypeError, match="float8_e4m3fnuz"):
        shuffle.ck_preshuffle(w[0])
    with pytest.raises(ValueError, match="divide a wave of 64"):
        shuffle.ck_preshuffle(w[0].to(torch.float8_e4m3fnuz), 24)
