"""Repository-wide pytest setup for the test tiers of DESIGN.md §4."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # T1: without a GPU, Triton kernels run under the interpreter. Set before any kernel module is imported,
    # since @triton.jit decides at decoration time.
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    # The interpreter's tl.reduce with our combine functions, a slice a call instead of an element (a quarter of T1).
    from mslk.core import testing

    testing.vectorize_interpreter_reductions()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="tier T2: needs a GPU (run ci/gpu.sh on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _gpu_memory_returned(request):
    """The GPU tier's pytest-xdist workers share one card: after a GPU test, the memory its tensors took goes back
    to the card, so that a worker does not keep a big test's blocks cached while the others run out (one worker
    held 25 GiB of an 80 GB H100 when another's 896 MiB allocation failed; RESULTS.md, seventy-second session)."""
    yield
    if "gpu" in request.keywords and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
