"""mslk.core.launch: host-side launch arithmetic against Triton's own helpers, and the Launcher's kept kernels."""

import dataclasses
import gc
import weakref
from types import SimpleNamespace

import numpy
import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given
from hypothesis import strategies as st

from mslk.core import arch, launch


@given(a=st.integers(0, 2**40), b=st.integers(1, 2**20))
def test_cdiv(a, b):
    assert launch.cdiv(a, b) == triton.cdiv(a, b) == -(-a // b)


@given(n=st.integers(1, 2**40))
def test_next_power_of_2(n):
    p = launch.next_power_of_2(n)
    assert p == triton.next_power_of_2(n) and p >= n and p & (p - 1) == 0 and (p == 1 or p // 2 < n)


def test_numpy_integers():
    """Sizes computed with NumPy: an unsigned -a wrapped (cdiv(uint8 200, 16) was 253), int64 had no bit_length."""
    assert launch.cdiv(numpy.uint8(200), 16) == 13 and launch.cdiv(numpy.uint32(100), 16) == 7
    assert launch.next_power_of_2(numpy.int64(17)) == 32 and launch.next_power_of_2(numpy.uint16(1)) == 1


@pytest.mark.parametrize(
    ("programs", "work", "splits"),
    [(64, 4096, 2), (256, 4096, 1), (16, 16384, 8), (70, 4096, 5), (2, 32768, 66), (1, 300, 1), (3, 100, 1)],
)
def test_fewest_waves(programs, work, splits):
    """On 132 slots: B=32 MLA decode steps' 64 programs split in 2 (128 parts, one wave), not 3 (192: 1.45 waves);
    parts keep at least 256 rows (1 x 300: one part) and at most one a slot (2 x 32768: 66 each)."""
    assert launch.fewest_waves(programs, work, 132) == splits


H100 = arch.DeviceInfo(0, "nvidia", "NVIDIA H100 80GB HBM3", (9, 0), 132, None, 232448, 65536, 233472, 2048)


@pytest.mark.parametrize(
    ("registers", "warps", "shared", "device", "programs"),
    [
        (168, 1, 2048, H100, 12),  # the int4 split-K kernel: 3 warps in each sub-partition's 16384 registers
        (142, 1, 2048, H100, 12),  # 4608 registers a warp: still 3 a sub-partition (not 65536 // 4608 = 14)
        (255, 1, 2048, H100, 8),
        (128, 1, 0, H100, 16),
        (76, 8, 73728, H100, 3),  # registers (6 warps a sub-partition) and shared memory (3 blocks) alike
        (32, 4, 100_000, H100, 2),  # shared memory: 101,120 bytes a block with the driver's
        (16, 1, 0, H100, 32),  # the SM's block slots
        (16, 4, 0, H100, 16),  # its 2048 threads
        (16, 1, 0, dataclasses.replace(H100, capability=(8, 6), threads_per_sm=1536), 16),  # an RTX 3090's slots
        (0, 1, 0, H100, None),  # no registers reported (a stand-in driver)
        (168, 1, 2048, dataclasses.replace(H100, vendor="amd"), None),
        (168, 1, 2048, dataclasses.replace(H100, registers_per_sm=None), None),
    ],
)
def test_programs_per_sm(registers, warps, shared, device, programs, monkeypatch):
    """CUDA's occupancy rule (cuda_occupancy.h), worked by hand; the GPU tests hold it to the driver's count."""
    monkeypatch.setattr(arch, "device_info", lambda index: device)
    kernel = SimpleNamespace(n_regs=registers, metadata=SimpleNamespace(num_warps=warps, shared=shared))
    assert launch.programs_per_sm(kernel, torch.device("cuda", 0)) == programs


# -- Launcher: Triton's compiled kernels kept by the arguments' specialization ------------------------------------


def _specialization_samples():
    """Arguments of every kind Triton specializes on, with the edges of each property."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    from triton.tools.tensor_descriptor import TensorDescriptor

    storage = torch.empty(4096, dtype=torch.uint8)
    samples = []
    for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int32):
        size = torch.empty(0, dtype=dtype).element_size()
        for byte_offset in (0, 4, 8, 16, 32):
            if byte_offset % size == 0:
                samples.append(storage[byte_offset : byte_offset + 64 * size].view(dtype))
    for edge in (0, 1, 16, 2**31, 2**63, 2**64 - 16):
        samples += [edge + d for d in (-17, -16, -1, 0, 1, 15, 16) if edge + d < 2**64]
    samples += [True, False, 0.0, 1.0, 1.5, None]
    samples += [torch.nn.Parameter(t, requires_grad=False) for t in samples[:2]]  # a Tensor subclass (aligned, not)
    matrix = torch.empty(64, 64, dtype=torch.bfloat16)
    for t in (matrix, matrix[1:], matrix[:, :24], matrix.float()):
        for block in ([16, 16], [16, 32], [8, 16]):
            samples.append(TensorDescriptor(t, list(t.shape), list(t.stride()), block))
            element = gl.float32 if t.dtype == torch.float32 else gl.bfloat16
            layout = gl.NVMMASharedLayout.get_default_for(block, element)
            samples.append(GluonDescriptor(t, list(t.shape), list(t.stride()), block, layout))
    aligned, misaligned = samples[0], samples[1]
    samples += [(aligned, aligned), (aligned, misaligned), (1, 16, 17), (16, 1, 17), ((1, 2), aligned), ((1,), 2), ()]
    return samples


def test_specialization_is_at_least_as_fine_as_tritons():
    """Arguments with one launch.specialization have one Triton specialization, so a kernel kept for one serves
    the other (Triton's own function, the one its launches call)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    seen = {}
    for value in _specialization_samples():
        theirs = native_specialize_impl(BaseBackend, value, False, True, True)
        ours = launch.specialization(value)
        assert seen.setdefault(ours, theirs) == theirs, (value, ours, theirs, seen[ours])
    assert len(seen) > 20  # the samples do differ


def test_launch_keys_are_at_least_as_fine_as_tritons(fake_launch):
    """The key a launch computes (by a function written for the arguments' types) tells apart whatever Triton's
    specialization does, argument by argument, with one launcher across every kind of argument."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    kernel, *_ = fake_launch
    launcher = launch.Launcher(kernel)
    launcher._first_launch()
    seen = {}
    for value in _specialization_samples():
        theirs = native_specialize_impl(BaseBackend, value, False, True, True)
        ours = launcher._key((value, 32, 0.5), {"BLOCK": 128})
        assert seen.setdefault(ours, theirs) == theirs, (value, ours, theirs, seen[ours])
    assert len(seen) > 20
    assert len(launcher._key_functions) > 5  # one a type: tensors, ints, bools, floats, descriptors, tuples


class _FakeCompiled:
    """What a Triton launch returns: its launcher records the calls."""

    function, packed_metadata = "function", "metadata"

    def __init__(self):
        self.calls = []

    def run(self, *args):
        self.calls.append(args)


class _FakeRuntime:
    hooks = False

    def current_device(self):
        return 0

    def current_stream(self, device):
        return 7

    def hooks_set(self):
        return self.hooks


def _kernel_source(x_ptr, n, scale, BLOCK: tl.constexpr, EVEN: tl.constexpr = True):
    pass


@pytest.fixture
def fake_launch(monkeypatch):
    """A real (not interpreted) JITFunction whose Triton launches are recorded, and the runtime launch.Launcher
    sees: (kernel, Triton's launches and warmups (grid, args, kwargs, warmup?), the compiled kernel, the runtime)."""
    from triton.runtime.jit import JITFunction

    kernel = JITFunction(_kernel_source)
    compiled, slow = _FakeCompiled(), []

    def triton_run(*args, grid, warmup, **kwargs):
        slow.append((grid, args, kwargs, warmup))
        return compiled

    kernel.run = triton_run
    runtime = _FakeRuntime()
    monkeypatch.setattr(launch._TritonRuntime, "_instance", runtime)
    return kernel, slow, compiled, runtime


def test_launcher_calls_the_kept_kernel_directly(fake_launch):
    kernel, slow, compiled, _ = fake_launch
    launcher = launch.Launcher(kernel)
    x = torch.empty(64)
    launcher[(3, 2)](x, 32, 0.5, BLOCK=128, num_warps=4)
    assert len(slow) == 1 and not compiled.calls
    y = torch.empty(64)  # another tensor, same dtype and alignment; another n, same properties
    assert launcher[(5,)](y, 48, 2.0, BLOCK=128, num_warps=4) is compiled
    assert len(slow) == 1
    # every parameter in the kernel's order, constexprs and defaults included, after Triton's launch arguments
    assert compiled.calls == [(5, 1, 1, 7, "function", "metadata", None, None, None, y, 48, 2.0, 128, True)]


def test_launcher_keeps_kernels_of_tuple_arguments_without_their_tensors(fake_launch):
    """A tuple of tensors (the merge kernels' chunks) keys by its items' properties: new tensors of the same dtypes
    and alignment take the kept kernel, and no key holds a tensor (keyed as themselves, every launch missed and the
    kept keys held up to 64 launches' tensors)."""
    kernel, slow, compiled, _ = fake_launch
    launcher = launch.Launcher(kernel)
    tensors = []
    for _ in range(3):
        chunks = (torch.empty(64), torch.empty(64, dtype=torch.float16))
        tensors.append(weakref.ref(chunks[0]))
        launcher[(1,)](chunks, 32, 0.5, BLOCK=128)
    assert len(slow) == 1 and len(compiled.calls) == 2 and compiled.calls[-1][9] is chunks
    del chunks
    slow.clear()
    compiled.calls.clear()
    gc.collect()
    assert all(ref() is None for ref in tensors)
    launcher[(1,)]((torch.empty(64), torch.empty(64)), 32, 0.5, BLOCK=128)  # another dtype: another kernel
    assert len(slow) == 1


@pytest.mark.parametrize(
    "change",
    ["misaligned", "dtype", "n_is_1", "n_not_multiple_of_16", "n_64_bit", "constexpr", "default_given", "option"],
)
def test_launcher_goes_through_triton_when_a_property_differs(fake_launch, change):
    kernel, slow, compiled, _ = fake_launch
    launcher = launch.Launcher(kernel)
    args, kwargs = [torch.empty(64), 32, 0.5], {"BLOCK": 128, "num_warps": 4}
    launcher[(1,)](*args, **kwargs)
    if change == "misaligned":
        args[0] = torch.empty(65)[1:]
    elif change == "dtype":
        args[0] = torch.empty(64, dtype=torch.float16)
    elif change == "n_is_1":
        args[1] = 1
    elif change == "n_not_multiple_of_16":
        args[1] = 33
    elif change == "n_64_bit":
        args[1] = 2**32
    elif change == "constexpr":
        kwargs["BLOCK"] = 256
    elif change == "default_given":
        kwargs["EVEN"] = False
    else:
        kwargs["num_warps"] = 8
    launcher[(1,)](*args, **kwargs)
    assert len(slow) == 2 and not compiled.calls
    launcher[(1,)](*args, **kwargs)  # and kept under its own key
    assert len(slow) == 2 and len(compiled.calls) == 1


def test_compiled_loads_the_kernel_without_launching_it(fake_launch):
    """launch.compiled: Triton's compile of those arguments (its warmup: no launch), loaded on the GPU, which
    reports its registers; None for kernels Triton does not compile (the interpreter's)."""
    kernel, slow, compiled, _ = fake_launch
    compiled._init_handles = lambda: setattr(compiled, "n_regs", 40)
    x = torch.empty(64)
    assert launch.compiled(kernel, x, 32, 0.5, BLOCK=128) is compiled and compiled.n_regs == 40
    assert slow == [((1,), (x, 32, 0.5), {"BLOCK": 128}, True)] and not compiled.calls
    from triton.runtime.interpreter import InterpretedFunction

    assert launch.compiled(InterpretedFunction(_kernel_source), x, 32, 0.5, BLOCK=128) is None


@pytest.mark.parametrize("case", ["launch_hook", "grid_function", "unhashable", "interpreted", "too_many_arguments"])
def test_launcher_leaves_to_triton(fake_launch, case):
    """Launch hooks (a profiler), grids given as functions, arguments it cannot key, more arguments than the kernel
    has parameters (Triton raises), kernels Triton does not compile (the interpreter's, autotuned ones): every
    launch through Triton."""
    kernel, slow, compiled, runtime = fake_launch
    grid, extra = (1,), 0.5
    if case == "too_many_arguments":
        launcher = launch.Launcher(kernel)
        for _ in range(3):
            launcher[grid](torch.empty(64), 32, 0.5, 128, True, 7)
        assert len(slow) == 3 and not compiled.calls
        return
    if case == "launch_hook":
        runtime.hooks = True
    elif case == "grid_function":
        grid = lambda meta: (1,)  # noqa: E731
    elif case == "unhashable":
        extra = [0.5]
    else:
        jit = kernel
        kernel = type("Interpreted", (), {"__getitem__": lambda self, g: jit[g]})()
    launcher = launch.Launcher(kernel)
    for _ in range(3):
        launcher[grid](torch.empty(64), 32, extra, BLOCK=128)
    assert len(slow) == 3 and not compiled.calls


@pytest.mark.parametrize("hooks", [False, True])
def test_launcher_runs_fewer_stages_where_shared_memory_is_short(fake_launch, hooks, caplog):
    """A GPU whose blocks have less shared memory than the stages asked for (Triton raises OutOfResources at the first
    launch): the same kernel on fewer stages, kept under the launch's own key; on Triton's path (hooks) too."""
    from triton.runtime.errors import OutOfResources

    kernel, slow, compiled, runtime = fake_launch
    runtime.hooks = hooks
    fits = 2
    run = kernel.run

    def short_of_shared_memory(*args, num_stages, **kwargs):
        run(*args, num_stages=num_stages, **kwargs)
        if num_stages > fits:
            raise OutOfResources(49152 * num_stages, 101376, "shared memory")
        return compiled

    kernel.run = short_of_shared_memory
    launcher = launch.Launcher(kernel)
    with caplog.at_level("INFO", logger="mslk.launch"):
        for _ in range(2):
            assert launcher[(1,)](torch.empty(64), 32, 0.5, BLOCK=128, num_stages=4) is compiled
    stages = [kwargs["num_stages"] for _, _, kwargs, _ in slow]
    assert stages == ([4, 3, 2] * 2 if hooks else [4, 3, 2])
    assert len(compiled.calls) == (0 if hooks else 1)
    assert "4 pipeline stages take 196608 bytes of shared memory, this GPU has 101376 a block: trying 3" in caplog.text


@pytest.mark.parametrize(("error", "stages"), [(("threads",), 4), (("shared memory",), 1), (("shared memory",), None)])
def test_launcher_raises_what_fewer_stages_cannot_mend(fake_launch, error, stages):
    from triton.runtime.errors import OutOfResources

    kernel, *_ = fake_launch

    def out_of_resources(*args, **kwargs):
        raise OutOfResources(1 << 20, 1024, *error)

    kernel.run = out_of_resources
    options = {} if stages is None else {"num_stages": stages}
    with pytest.raises(OutOfResources):
        launch.Launcher(kernel)[(1,)](torch.empty(64), 32, 0.5, BLOCK=128, **options)
