"""Timing of launch-bound calls (spec A-15): a CUDA graph replays many calls of `fn` at once, so that the host's
launch overhead does not count (DESIGN §5)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from mslk.core import arch, registry


def do_bench_cudagraph(
    fn: Callable[[], object], rep: int = 20, grad_to_none: Sequence[torch.Tensor] | None = None
) -> float:
    """Mean time of one call of fn in ms, over CUDA-graph replays of about rep ms: `triton.testing.do_bench_cudagraph`
    (which captures on a side stream of its own). grad_to_none: tensors whose .grad is reset before each call, so
    that backward passes do not accumulate. RuntimeError without a GPU or without Triton."""
    if not arch.has_gpu():
        raise RuntimeError(
            "do_bench_cudagraph needs a CUDA (or ROCm) GPU to capture a graph: torch.cuda.is_available() is False"
        )
    missing = registry.triton_missing()
    if missing is not None:
        raise RuntimeError(f"do_bench_cudagraph times with triton.testing: {missing}")
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=rep, grad_to_none=grad_to_none)
