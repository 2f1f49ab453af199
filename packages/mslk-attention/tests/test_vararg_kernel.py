"""`fmha._triton.vararg_kernel.unroll_varargs` (spec U-06): kernels over arrays of arguments, rewritten for N.
The kernels run under the interpreter in T1 and compiled on the GPU in T2."""

# ruff: noqa: F821 (the kernels' arrays are names the rewriting defines: `scaling: VAR_ARGS_ARRAY` binds nothing)

import inspect

import pytest
import torch
import triton
import triton.language as tl

from mslk.attention.fmha._triton.vararg_kernel import VAR_ARGS_ARRAY, VarargMode, unroll_varargs
from mslk.core import testing

DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not testing.interpreting(), reason="T1 runs Triton interpreted")),
    pytest.param("cuda", marks=pytest.mark.gpu),
]


@triton.jit
def _scaled_sum(output_ptr, scaling_ptr, *inputs, BLOCK: tl.constexpr):
    """output = 2 Σ_j inputs[j] · scaling[j]: *args, a local array assigned in one loop, read in a nested one."""
    offset = tl.arange(0, BLOCK)
    output = tl.zeros([BLOCK], tl.float32)
    scaling: VAR_ARGS_ARRAY
    for i in range(len(scaling)):
        scaling[i] = tl.load(scaling_ptr + i)
    for _ in range(2):
        for j in range(len(inputs)):
            output = output + tl.load(inputs[j] + offset) * scaling[j]
    tl.store(output_ptr + offset, output)


@triton.jit
def _weighted_sum(output_ptr, a_ptr: "VAR_ARGS_ARRAY", b: "VAR_ARGS_ARRAY", BLOCK: tl.constexpr):
    """output = Σ_i a[i] · b[i] (b scalars); a[0] read by a constant index too."""
    offset = tl.arange(0, BLOCK)[:]
    output = tl.load(a_ptr[0] + offset) * 0.0
    for i in range(len(a_ptr)):
        output = output + tl.load(a_ptr[i] + offset) * b[i]
    tl.store(output_ptr + offset, output)


@triton.jit
def _squares(x_ptrs: "VAR_ARGS_ARRAY", y_ptrs: "VAR_ARGS_ARRAY", numel, BLOCK: tl.constexpr):
    offsets = BLOCK * tl.program_id(0) + tl.arange(0, BLOCK)
    mask = offsets < numel
    for i in range(len(x_ptrs)):
        x_ptr = x_ptrs[i]
        y_ptr = y_ptrs[i]
        data = tl.load(x_ptr + offsets, mask)
        tl.store(y_ptr + offsets, data * data, mask)


@triton.jit
def _reversed_copy(x_ptrs: "VAR_ARGS_ARRAY", y_ptrs: "VAR_ARGS_ARRAY", BLOCK: tl.constexpr):
    """y[i] = x[N - 1 - i]: an index folded to a constant in each unrolled step."""
    offsets = tl.arange(0, BLOCK)
    for i in range(len(x_ptrs)):
        tl.store(y_ptrs[i] + offsets, tl.load(x_ptrs[len(x_ptrs) - 1 - i] + offsets))


def _source_and_params(kernel) -> tuple[str, list[str]]:
    """(source, parameter names) of a rewritten kernel, compiled (JITFunction) or interpreted alike."""
    return inspect.getsource(kernel.fn), list(inspect.signature(kernel.fn).parameters)


def test_rewritten_source():
    unrolled = unroll_varargs(_squares, 3)
    source, params = _source_and_params(unrolled)
    assert params == ["x_ptrs0", "x_ptrs1", "x_ptrs2", "y_ptrs0", "y_ptrs1", "y_ptrs2", "numel", "BLOCK"]
    assert "for " not in source and "x_ptr = x_ptrs2" in source
    source, _ = _source_and_params(unroll_varargs(_squares, 3, mode=VarargMode.CONDITIONAL))
    assert "for i in range(3):" in source
    assert "x_ptr = x_ptrs0 if i == 0 else x_ptrs1 if i == 1 else x_ptrs2" in source
    assert _source_and_params(unroll_varargs(_scaled_sum, 2))[1] == ["output_ptr", "scaling_ptr", "inputs0", "inputs1",
                                                                     "BLOCK"]  # fmt: skip
    assert unroll_varargs(_squares, 3) is unrolled  # cached: compiled once


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [1, 3])
def test_scaled_sum(device, n):
    inputs = [testing.randn(32, device=device) for _ in range(n)]
    scaling = testing.randn(n, device=device)
    output = torch.full((32,), float("nan"), device=device)
    unroll_varargs(_scaled_sum, n)[(1,)](output, scaling, *inputs, BLOCK=32)
    expected = 2 * (torch.stack(inputs).double() * scaling.double()[:, None]).sum(0)
    torch.testing.assert_close(output.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", list(VarargMode))
@pytest.mark.parametrize("n", [1, 2, 5])
def test_weighted_sum_and_squares(device, mode, n):
    a = [testing.randn(64, device=device) for _ in range(n)]
    b = testing.randn(n).tolist()
    output = torch.full((64,), float("nan"), device=device)
    unroll_varargs(_weighted_sum, n, mode)[(1,)](output, *a, *b, BLOCK=64)
    expected = sum(x.double() * w for x, w in zip(a, b, strict=True))
    torch.testing.assert_close(output.double(), expected, rtol=1e-5, atol=1e-5)

    xs = [testing.randn(100, device=device) for _ in range(n)]
    ys = [torch.full((100,), float("nan"), device=device) for _ in range(n)]
    unroll_varargs(_squares, n, mode)[(triton.cdiv(100, 32),)](*xs, *ys, 100, BLOCK=32)
    for x, y in zip(xs, ys, strict=True):
        torch.testing.assert_close(y, x * x)


@pytest.mark.parametrize("device", DEVICES)
def test_folded_index(device):
    xs = [testing.randn(16, device=device) for _ in range(3)]
    ys = [torch.full((16,), float("nan"), device=device) for _ in range(3)]
    unroll_varargs(_reversed_copy, 3)[(1,)](*xs, *ys, BLOCK=16)
    for x, y in zip(xs[::-1], ys, strict=True):
        assert torch.equal(x, y)


@triton.jit
def _neighbours(x_ptrs: "VAR_ARGS_ARRAY", out_ptr):
    """out[i] = x[i + 1] (unrolled: i + 1 folded), or x[j] for a j computed at run time (not an array index)."""
    for i in range(len(x_ptrs)):
        tl.store(out_ptr + i, tl.load(x_ptrs[i + 1]))


@triton.jit
def _run_time_index(x_ptrs: "VAR_ARGS_ARRAY", out_ptr, j):
    tl.store(out_ptr, tl.load(x_ptrs[j]))


@triton.jit
def _assigned(out_ptr):
    values: VAR_ARGS_ARRAY
    for i in range(len(values)):
        values[i] = i
    tl.store(out_ptr, values[0])


@triton.jit
def _star_with_default(out_ptr, *xs, BLOCK: tl.constexpr = 16):
    tl.store(out_ptr, tl.load(xs[0]))


def test_errors():
    with pytest.raises(ValueError, match="N must be a positive int"):
        unroll_varargs(_squares, 0)
    with pytest.raises(TypeError, match="expected a triton\\.jit function"):
        unroll_varargs(lambda x: x, 2)
    with pytest.raises(ValueError, match=r"x_ptrs\[1 \+ 1\]: past the array's 2 elements"):
        unroll_varargs(_neighbours, 2)
    with pytest.raises(ValueError, match=r"x_ptrs\[j\]: an argument array is indexed by constants"):
        unroll_varargs(_run_time_index, 2)
    with pytest.raises(ValueError, match="CONDITIONAL reads arrays, never writes"):
        unroll_varargs(_assigned, 2, VarargMode.CONDITIONAL)
    with pytest.raises(ValueError, match=r"takes \*xs and has default values"):
        unroll_varargs(_star_with_default, 2)
