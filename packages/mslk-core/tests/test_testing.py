import math
import unittest

import pytest
import torch
import triton
import triton.language as tl

from mslk.core import arch, testing


def test_rel_error():
    ref = testing.randn(100, dtype=torch.float64)
    assert testing.rel_error(ref, ref) == 0.0
    assert testing.rel_error(ref * 1.01, ref) == pytest.approx(0.01)
    bad = ref.clone()
    bad[3] = float("nan")
    assert testing.rel_error(bad, ref) == math.inf, "NaN never passes"
    assert testing.rel_error(ref[:10], ref) == math.inf


def test_assert_rel_close_uses_dtype_tolerances():
    ref = testing.randn(1000, dtype=torch.float64)
    testing.assert_rel_close(ref.bfloat16(), ref)
    with pytest.raises(AssertionError, match="relative error"):
        testing.assert_rel_close((ref * 1.1).bfloat16(), ref)
    with pytest.raises(AssertionError, match="relative error"):
        testing.assert_rel_close(ref.bfloat16().float(), ref)  # fp32 output held to the fp32 tolerance
    assert testing.default_tolerance(torch.int32) == 0.0


def test_poison_and_padded_rows():
    assert testing.empty_poisoned(4, dtype=torch.bfloat16).isnan().all()
    assert testing.empty_poisoned(4, dtype=torch.float8_e4m3fn).float().isnan().all()
    assert (testing.empty_poisoned(4, dtype=torch.int32) == torch.iinfo(torch.int32).max).all()
    x = testing.randn(5, 7)
    padded = testing.padded_rows(x, pad=3)
    assert padded.stride() == (10, 1) and not padded.is_contiguous()
    assert torch.equal(padded, x)


def test_randn_is_fresh_and_nonzero():
    a, b = testing.randn(64), testing.randn(64)
    assert not torch.equal(a, b) and (a != 0).all()


def _skipped(decorator) -> bool:
    class Case(unittest.TestCase):
        @decorator
        def test(self):
            pass

    result = unittest.TestResult()
    Case("test").run(result)
    return bool(result.skipped)


def test_skip_decorators_on_cuda(monkeypatch):
    monkeypatch.setattr(arch, "vendor", lambda: "nvidia")
    monkeypatch.setattr(arch, "capability", lambda device=None: (9, 0))
    assert not _skipped(testing.skipUnlessCuda())
    assert _skipped(testing.skipUnlessRocm())
    assert not _skipped(testing.skipUnlessCudaCapability(9))
    assert _skipped(testing.skipUnlessCudaCapability(9, minor_min=1))
    assert _skipped(testing.skipUnlessCudaCapability(10))
    assert _skipped(testing.skipUnlessCudaCapability(8, 8))
    assert not _skipped(testing.skipUnlessGfxArch("gfx942")), "gfx decorators pass on CUDA"


def test_skip_decorators_on_rocm(monkeypatch):
    monkeypatch.setattr(arch, "vendor", lambda: "amd")
    monkeypatch.setattr(arch, "gfx_arch", lambda device=None: "gfx942")
    assert not _skipped(testing.skipUnlessCudaCapability(10)), "capability decorators pass on ROCm"
    assert not _skipped(testing.skipUnlessGfxArch("gfx950", "gfx942"))
    assert _skipped(testing.skipUnlessGfxArch("gfx950"))
    assert _skipped(testing.skipUnlessCuda())


@triton.jit
def _nan_max(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _first_argmax(value, index, other_value, other_index):
    take = (other_value > value) | ((other_value == value) & (other_index < index))
    return tl.where(take, other_value, value), tl.where(take, other_index, index)


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _custom_reductions_kernel(x_ptr, n_ptr, max_ptr, argmax_ptr, sum_ptr, all_ptr, A: tl.constexpr,
                              B: tl.constexpr, AXIS: tl.constexpr):  # fmt: skip
    offsets = tl.arange(0, A)[:, None] * B + tl.arange(0, B)[None, :]
    x = tl.load(x_ptr + offsets)
    out = tl.arange(0, B if AXIS == 0 else A)
    tl.store(max_ptr + out, tl.reduce(x, AXIS, _nan_max))
    index = tl.arange(0, A)[:, None] + tl.zeros([A, B], tl.int32) if AXIS == 0 else offsets % B
    tl.store(argmax_ptr + out, tl.reduce((tl.where(x == x, x, 0.0), index), AXIS, _first_argmax)[1])
    kept = tl.reduce(tl.load(n_ptr + offsets), AXIS, _add, keep_dims=True)  # [1, B] or [A, 1]
    tl.store(sum_ptr + out, tl.reshape(kept, [B if AXIS == 0 else A]))
    tl.store(all_ptr, tl.reduce(x, None, _nan_max))


@pytest.mark.parametrize("axis", [0, 1])
def test_vectorized_interpreter_reductions(axis, monkeypatch):
    """vectorize_interpreter_reductions' tl.reduce of our own combine functions (a NaN-propagating max, a first-index
    argmax over ties, an integer sum keeping the axis, a max over all) gives what Triton's element-by-element one
    and torch give."""
    if not testing.interpreting():
        pytest.skip("the Triton interpreter's reductions (tier T1)")
    from triton.runtime import interpreter

    assert testing.vectorize_interpreter_reductions()
    x = torch.randint(-3, 4, (8, 16)).float()  # ties for the argmax
    x[2, 5] = x[7, 0] = float("nan")
    n = torch.randint(-1000, 1000, (8, 16), dtype=torch.int32)

    def run():
        outs = [testing.empty_poisoned(x.shape[1 - axis], dtype=dtype) for dtype in (x.dtype, torch.int32, n.dtype)]
        outs.append(testing.empty_poisoned(1, dtype=x.dtype))
        _custom_reductions_kernel[(1,)](x, n, *outs, A=8, B=16, AXIS=axis)
        return outs

    got = run()
    monkeypatch.setattr(interpreter.ReduceOps, "generic_reduce", interpreter.ReduceOps.generic_reduce.__wrapped__)
    for mine, tritons in zip(got, run(), strict=True):
        torch.testing.assert_close(mine, tritons, rtol=0, atol=0, equal_nan=True)
    expected_max = x.amax(axis).where(~x.isnan().any(axis), float("nan"))
    torch.testing.assert_close(got[0], expected_max, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(got[1], x.nan_to_num(0.0).argmax(axis).int(), rtol=0, atol=0)
    torch.testing.assert_close(got[2], n.sum(axis, dtype=torch.int32), rtol=0, atol=0)
    assert got[3].isnan().all(), "a NaN anywhere: the max over all is NaN"
