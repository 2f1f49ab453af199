import math
import unittest

import pytest
import torch

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
