"""fmha.utils.bench.do_bench_cudagraph (spec A-15): upstream's signature, and a clear error where no graph can be
captured."""

import inspect

import pytest
import torch

from mslk.attention.fmha.utils import bench
from mslk.core import arch, testing


def test_signature():
    params = inspect.signature(bench.do_bench_cudagraph).parameters
    assert [(name, p.default) for name, p in params.items()] == [
        ("fn", inspect.Parameter.empty),
        ("rep", 20),
        ("grad_to_none", None),
    ]


def test_without_a_gpu_it_says_so(monkeypatch):
    monkeypatch.setattr(arch, "has_gpu", lambda: False)
    calls = []
    with pytest.raises(RuntimeError, match="needs a CUDA"):
        bench.do_bench_cudagraph(lambda: calls.append(1))
    assert calls == []  # fn is not run


@pytest.mark.gpu
@testing.skipUnlessGpu()
def test_times_a_kernel_on_the_gpu():
    x = torch.randn(1024, 1024, device="cuda")
    ms = bench.do_bench_cudagraph(lambda: x @ x, rep=5)
    assert isinstance(ms, float) and 0 < ms < 1000
