"""Test helpers shared by every domain: skip decorators, random inputs, poisoned outputs, relative-error
tolerances, and the conformance checks (reference comparison, fake kernel, opcheck) of a registered op.

The skip decorators keep the reference library's names (spec U-02; `mslk.testing.device` re-exports them)
and work on unittest classes and pytest functions alike.
"""

from __future__ import annotations

import functools
import math
import os
import unittest
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from mslk.core import arch, registry
from mslk.core.registry import Op, Sample

# ---------------------------------------------------------------------------------------------- skips


def skipUnlessCuda() -> Callable:
    return unittest.skipUnless(arch.is_cuda(), "needs an NVIDIA GPU")


def skipUnlessRocm() -> Callable:
    return unittest.skipUnless(arch.is_rocm(), "needs an AMD GPU (ROCm)")


def skipUnlessGpu() -> Callable:
    return unittest.skipUnless(arch.has_gpu(), "needs a GPU (CUDA or ROCm)")


def skipUnlessCudaCapability(major_min: int, major_max: int | None = None, *, minor_min: int = 0) -> Callable:
    """Skip unless an NVIDIA GPU has capability >= (major_min, minor_min) and major <= major_max.
    Passes on ROCm (capability numbers mean nothing there), as in the reference library."""
    if arch.is_rocm():
        return unittest.skipIf(False, "")
    ok = arch.is_cuda() and arch.capability() >= (major_min, minor_min)
    ok = ok and (major_max is None or arch.capability()[0] <= major_max)
    upper = f" and <= {major_max}.x" if major_max is not None else ""
    return unittest.skipUnless(ok, f"needs an NVIDIA GPU of capability >= {major_min}.{minor_min}{upper}")


def skipUnlessCudaVersion(major_min: int) -> Callable:
    version = arch.cuda_version()
    ok = arch.is_cuda() and version is not None and version[0] >= major_min
    return unittest.skipUnless(ok, f"needs CUDA >= {major_min}")


def skipUnlessGfxArch(gfx: str, *more: str) -> Callable:
    """Skip unless the ROCm GPU is one of the gfx archs. Passes on CUDA, as in the reference library."""
    if arch.is_cuda():
        return unittest.skipIf(False, "")
    wanted = (gfx, *more)
    ok = arch.is_rocm() and arch.gfx_arch() in wanted
    return unittest.skipUnless(ok, f"needs a ROCm GPU of arch {', '.join(wanted)}")


# ----------------------------------------------------------------------------------- random inputs


def randn(*shape: int, dtype: torch.dtype = torch.float32, device: Any = "cpu", std: float = 1.0) -> torch.Tensor:
    """Fresh normal random values (drawn in fp32, then cast): never zeros, never a fixed pattern."""
    return (torch.randn(*shape, device=device) * std).to(dtype)


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill with NaN (floats) or the dtype's max (integers), so an element a kernel never wrote shows up."""
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return t.fill_(float("nan"))
    return t.fill_(torch.iinfo(t.dtype).max if t.dtype != torch.bool else True)


def empty_poisoned(*shape: int, dtype: torch.dtype, device: Any = "cpu") -> torch.Tensor:
    return poison_(torch.empty(*shape, dtype=dtype, device=device))


def padded_rows(t: torch.Tensor, pad: int = 3) -> torch.Tensor:
    """The same values in a non-contiguous tensor whose rows are `pad` elements apart beyond their length
    (last-dim stride stays 1, as most kernels require)."""
    storage = poison_(torch.empty(*t.shape[:-1], t.shape[-1] + pad, dtype=t.dtype, device=t.device))
    view = storage[..., : t.shape[-1]]
    view.copy_(t)
    return view


# ------------------------------------------------------------------------------------- tolerances

_DEFAULT_TOLERANCE = {
    torch.float64: 1e-12,
    torch.float32: 1e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1.6e-2,
    torch.float8_e4m3fn: 8e-2,
    torch.float8_e4m3fnuz: 8e-2,
    torch.float8_e5m2: 0.15,
}


def default_tolerance(dtype: torch.dtype) -> float:
    """Relative error `||out - ref|| / ||ref||` allowed for an output of `dtype`; 0 (exact) for integers."""
    return _DEFAULT_TOLERANCE.get(dtype, 0.0 if not dtype.is_floating_point else 0.15)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """`||out - ref|| / ||ref||` in float64; inf when shapes differ or anything is NaN."""
    if out.shape != ref.shape:
        return math.inf
    out64, ref64 = out.detach().cpu().to(torch.float64), ref.detach().cpu().to(torch.float64)
    if out64.isnan().any() or ref64.isnan().any():
        return math.inf
    diff = torch.linalg.vector_norm(out64 - ref64).item()
    norm = torch.linalg.vector_norm(ref64).item()
    return diff / norm if norm > 0 else diff


def assert_rel_close(out: torch.Tensor, ref: torch.Tensor, tol: float | None = None, what: str = "output") -> None:
    tol = default_tolerance(out.dtype) if tol is None else tol
    if out.dtype != ref.dtype and not (out.dtype.is_floating_point and ref.dtype.is_floating_point):
        raise AssertionError(f"{what}: dtype {out.dtype}, reference {ref.dtype}")
    err = rel_error(out, ref)
    if not err <= tol:
        raise AssertionError(
            f"{what}: relative error {err:.3g} > {tol:.3g} (shape {tuple(out.shape)}, ref {tuple(ref.shape)}, "
            f"dtype {out.dtype})"
        )


_FP8_MANTISSA_BITS = {
    torch.float8_e4m3fn: 3,
    torch.float8_e4m3fnuz: 3,
    torch.float8_e5m2: 2,
    torch.float8_e5m2fnuz: 2,
}


def interpreting() -> bool:
    """True when Triton kernels run under the interpreter (tier T1)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def vectorize_interpreter_reductions() -> bool:
    """Make the Triton interpreter's tl.reduce with a combine function of our own (quantize's max_nan: a
    NaN-propagating max) combine whole slices at a time. Triton's interpreter (triton/runtime/interpreter.py,
    ReduceOps.generic_reduce, up to 3.7 at least) calls such a combine function once per element in Python: 3.5 s
    for one 128 x 128 tile, and most of the CPU tier's time in the quantize tests. Here it combines the two halves of
    each pair of neighbours along the axis, log2(n) calls, in the tree order a GPU's reduction takes (Triton asks
    combine functions to be associative), keeping the left-right order of the operands. Returns whether it did
    (False where that interpreter has no such method)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    reduce_ops = getattr(interpreter, "ReduceOps", None)
    if reduce_ops is None or not all(hasattr(reduce_ops, name) for name in ("generic_reduce", "unravel", "to_tensor")):
        return False

    def generic_reduce(self, inputs):
        original_axis = self.axis
        inputs, axis = self.unravel(inputs, self.axis)
        ndim = inputs[0].handle.data.ndim
        dtypes = [arg.dtype for arg in inputs]
        data = [np.moveaxis(arg.handle.data, axis, 0) for arg in inputs]
        while data[0].shape[0] > 1:
            pairs = data[0].shape[0] // 2
            left = [self.to_tensor(d[0 : 2 * pairs : 2], t) for d, t in zip(data, dtypes, strict=True)]
            right = [self.to_tensor(d[1 : 2 * pairs : 2], t) for d, t in zip(data, dtypes, strict=True)]
            out = self.combine_fn.fn(*left, *right)
            out = out if isinstance(out, tuple) else (out,)
            combined = [
                np.broadcast_to(o.handle.data if isinstance(o, tl.core.tensor) else o, d[:pairs].shape).astype(d.dtype)
                for o, d in zip(out, data, strict=True)
            ]
            # (an odd one out stays last)
            data = [np.concatenate([c, d[2 * pairs :]]) for c, d in zip(combined, data, strict=True)]
        results = []
        for d, t in zip(data, dtypes, strict=True):
            d = d[0]
            if self.keep_dims:  # as Triton's own: the axis kept, or (all reduced) one dim a dim of the flat input
                d = np.expand_dims(d, axis) if original_axis is not None else d.reshape((1,) * ndim)
            elif original_axis is None:
                d = d.item()
            results.append(self.to_tensor(d, t))
        return results

    if not hasattr(reduce_ops.generic_reduce, "__wrapped__"):  # (once)
        generic_reduce.__wrapped__ = reduce_ops.generic_reduce  # Triton's own, for the tests to compare
        reduce_ops.generic_reduce = generic_reduce
    return True


def assert_fp8_equal(out: torch.Tensor, ref: torch.Tensor, what: str = "xq") -> None:
    """FP8 outputs equal to the reference bit for bit, as the GPU's round-to-nearest-even conversion gives.

    Under the Triton interpreter (T1) its float-to-fp8 conversion rounds some values wrongly (DESIGN.md §4):
    there each element may be one FP8 step off, or half the reference where the reference is a power of two
    (127.9 -> 64, not 128), and NaN converts to 384. Nothing else passes; on a GPU, NaN must match NaN.
    """
    if out.shape != ref.shape or out.dtype != ref.dtype:
        raise AssertionError(f"{what}: {tuple(out.shape)} {out.dtype}, reference {tuple(ref.shape)} {ref.dtype}")
    o, r = out.float().cpu(), ref.float().cpu()
    differs = (out.view(torch.uint8) != ref.view(torch.uint8)).cpu() & ~(o.isnan() & r.isnan())
    if interpreting():
        mag = r.abs()
        bits = _FP8_MANTISSA_BITS[ref.dtype]
        # One FP8 step at |ref|: 2^(exponent - mantissa bits), and the fixed subnormal step below the normals.
        step = torch.exp2(torch.floor(torch.log2(mag)) - bits).clamp(min=torch.finfo(ref.dtype).tiny * 2**-bits)
        power_of_two = mag == torch.exp2(torch.floor(torch.log2(mag)))
        tolerated = ((o - r).abs() <= step) | (power_of_two & (o == r / 2)) | r.isnan()
        differs &= ~tolerated
    if differs.any():
        index = tuple(differs.nonzero()[0].tolist())
        raise AssertionError(
            f"{what}: {int(differs.sum())} of {out.numel()} elements differ, first at {index}: "
            f"{o[index].item()} vs reference {r[index].item()}"
        )


# ------------------------------------------------------------------------- conformance of an op


def _flat(result: Any) -> list[Any]:
    """The tensors of an op's result, nested lists and tuples flattened (e.g. `(Tensor[], Tensor[])`)."""
    return [x for item in result for x in _flat(item)] if isinstance(result, (tuple, list)) else [result]


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`value` with fn applied to each tensor in it (in lists, tuples and dicts too)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    return value


def _copy(value: Any, device: torch.device | str) -> Any:
    """A copy of value's tensors on `device` (a copy also where they are already there: ops write into some)."""
    return _map_tensors(value, lambda t: t.to(device, copy=True))


def _outputs(op: Op, fn: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[list[Any], list[torch.Tensor]]:
    """(fn's results, the tensors given for the arguments the op's schema says it writes into) after the call."""
    results = _flat(fn(*args, **kwargs))
    named = op.inputs(args, kwargs)  # args may stop before the defaults
    return results, [named[name] for name in op.mutated_args if named.get(name) is not None]


def _compare(op: Op, out: list[Any], ref: list[Any]) -> list[str]:
    if len(out) != len(ref):
        return [f"{len(out)} outputs, the reference gives {len(ref)}"]
    problems = []
    for i, (o, r) in enumerate(zip(out, ref, strict=True)):
        if not isinstance(o, torch.Tensor):
            if o != r:
                problems.append(f"output {i}: {o!r}, reference {r!r}")
            continue
        try:
            assert_rel_close(o, r, op.tolerance, what=f"output {i}")
        except AssertionError as exc:
            problems.append(str(exc))
    return problems


def _reference_outputs(op: Op, sample: Sample) -> list[Any]:
    results, written = _outputs(op, op.reference, _copy(sample.args, "cpu"), _copy(sample.kwargs, "cpu"))
    return results + written


def check_against_reference(op: Op, sample: Sample) -> list[str]:
    """Run `op` through torch.ops on a copy of the sample (on its device) and the reference on CPU copies,
    comparing the results and the tensors the op writes into; also check that the fake kernel predicts each
    result's shape and dtype. Returns what went wrong."""
    results, written = _outputs(op, op.torch_op, *_replaced(sample))
    problems = _compare(op, results + written, _reference_outputs(op, sample))
    return problems + _fake_problems(op, sample, results)


def keyword_problems(op: Op, sample: Sample) -> list[str]:
    """The op with its reference pinned (`op(..., backend="reference")`) and every argument given by its schema
    name, on CPU copies, against the reference called by position: a pinned backend takes the schema's names, as
    torch.ops does (the backends' own parameter names may differ). Returns what went wrong."""
    keywords = dict(zip(op.arg_names, _copy(sample.args, "cpu"), strict=False)) | _copy(sample.kwargs, "cpu")
    try:
        results, written = _outputs(op, functools.partial(op, backend="reference"), (), keywords)
    except Exception as exc:  # (any failure is the finding)
        return [f"{op.name}(<arguments by name>, backend='reference'): {type(exc).__name__}: {exc}"]
    return _compare(op, results + written, _reference_outputs(op, sample))


def gradient_problems(op: Op, sample: Sample) -> list[str]:
    """An op without a backward, on copies of the sample whose floating-point tensors require grad: the results are
    those of a call without, and differentiating them raises a RuntimeError naming the op; an op that writes into an
    argument refuses such inputs in its forward. Returns what went wrong."""
    args, kwargs = _replaced(sample)
    tensors = [t for t in _flat([args, list(kwargs.values())]) if isinstance(t, torch.Tensor)]
    floating = [t for t in tensors if t.is_floating_point()]
    if op.differentiable or not floating:
        return []
    written = [name for name in op.mutated_args if op.inputs(tuple(args), kwargs).get(name) is not None]
    expected_args, expected_kwargs = _replaced(sample)
    expected = None if written else _flat(op.torch_op(*expected_args, **expected_kwargs))
    for t in floating:
        t.requires_grad_()
    refusal = f"{op.qualname} writes into" if written else f"{op.qualname} has no backward"
    try:
        results = _flat(op.torch_op(*args, **kwargs))
        if written:
            return [f"{op.name} wrote into {', '.join(written)} with inputs that require grad"]
        problems = _compare(op, results, expected)
        differentiable = [r for r in results if isinstance(r, torch.Tensor) and r.requires_grad]
        if differentiable:
            sum(r.float().sum() for r in differentiable).backward()
            problems.append(f"{op.name}: its backward ran")
        return problems
    except RuntimeError as exc:
        return [] if refusal in str(exc) else [f"{op.name}: {exc}, not the refusal {refusal!r}"]


def _fake_problems(op: Op, sample: Sample, real: list[Any]) -> list[str]:
    """Where the fake kernel's outputs differ from the real ones in shape, dtype or strides (torch.compile lays out
    the code around an op by its fake kernel)."""
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        args = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in sample.args)
        fake = _flat(op.torch_op(*args, **sample.kwargs))
    return [
        f"output {i}: the fake kernel says {tuple(f.shape)} {f.dtype} strides {f.stride()}, the kernel gives "
        f"{tuple(r.shape)} {r.dtype} strides {r.stride()}"
        for i, (f, r) in enumerate(zip(fake, real, strict=True))
        if isinstance(r, torch.Tensor) and (f.shape != r.shape or f.dtype != r.dtype or not _same_layout(f, r))
    ]


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one shape hold their elements alike in memory (a dimension of size 1 may have any
    stride; an empty tensor has no layout)."""
    return a.numel() == 0 or all(n == 1 or s == t for n, s, t in zip(a.shape, a.stride(), b.stride(), strict=True))


def _padded(t: torch.Tensor) -> torch.Tensor:
    """The same values with rows (or, in one dimension, elements) apart by more than their length."""
    if t.dim() == 0 or t.numel() == 0:
        return t
    return padded_rows(t) if t.dim() > 1 else padded_rows(t[:, None], pad=1)[:, 0]


def _column_major(t: torch.Tensor) -> torch.Tensor:
    return t.mT.contiguous().mT if t.dim() > 1 and t.shape[-1] > 1 and t.shape[-2] > 1 else t


def _strides(value: Any) -> Any:
    return _map_tensors(value, lambda t: t.stride())


def _arguments(op: Op, sample: Sample) -> dict[int | str, tuple[str, Any]]:
    """The sample's arguments that hold tensors: position (or keyword) -> (name, value)."""
    named = {i: (op.arg_names[i], a) for i, a in enumerate(sample.args)} | {k: (k, v) for k, v in sample.kwargs.items()}
    return {key: named[key] for key in named if any(isinstance(t, torch.Tensor) for t in _flat([named[key][1]]))}


def _replaced(sample: Sample, key: int | str | None = None, value: Any = None) -> tuple[list[Any], dict[str, Any]]:
    """Copies of the sample's (args, kwargs) (ops write into some), the argument at `key` (a position or keyword)
    replaced by value."""
    args = [value if i == key else _map_tensors(a, torch.clone) for i, a in enumerate(sample.args)]
    return args, {k: value if k == key else _map_tensors(v, torch.clone) for k, v in sample.kwargs.items()}


def _layout_problems(op: Op, sample: Sample, call: Callable[..., list[Any]], expected: list[Any]) -> list[str]:
    """`call(args, kwargs)` (outputs and tensors written into) with each tensor argument of the sample in turn in
    other memory layouts, same values: rows padded (`padded_rows`; vectors with a stride of 2), and column-major.
    Each must give the expected outputs, or refuse with a ValueError or NotImplementedError (the registry's "not
    supported because") before any kernel runs: never a wrong result, never another error."""
    problems = []
    for key, (name, value) in _arguments(op, sample).items():
        for layout, relayout in (("padded rows", _padded), ("column-major", _column_major)):
            moved = _map_tensors(value, relayout)
            if _strides(moved) == _strides(value):
                continue  # no tensor of this argument takes another layout of this kind
            what = f"{op.qualname}: {name} in {layout}"
            try:
                out = call(*_replaced(sample, key, moved))
            except (ValueError, NotImplementedError):
                continue  # refused, clearly
            except Exception as exc:  # any other failure is the problem to report
                problems.append(f"{what}: {type(exc).__name__}: {exc}")
                continue
            problems += [f"{what}: {p}" for p in _compare(op, out, expected)]
    return problems


def layout_problems(op: Op, sample: Sample) -> list[str]:
    """The op (through torch.ops) on the sample's tensors in other layouts against the reference (see
    `_layout_problems`). Returns what went wrong."""

    expected = _reference_outputs(op, sample)
    return _layout_problems(op, sample, lambda args, kwargs: _outputs_as_faked(op, op.torch_op, args, kwargs), expected)


def _outputs_as_faked(op: Op, fn: Callable[..., Any], args: list[Any], kwargs: dict[str, Any]) -> list[Any]:
    """fn's results and the tensors it wrote into (`_outputs`), its results first checked against the fake kernel's:
    an AssertionError where they differ (which `_layout_problems` reports with the layout)."""
    results, written = _outputs(op, fn, args, kwargs)
    fake = _fake_problems(op, Sample(tuple(args), kwargs), results)
    if fake:
        raise AssertionError("; ".join(fake))
    return results + written


def triton_layout_problems(op: Op, sample: Sample) -> list[str]:
    """Each Triton backend of the op called directly (validation and its `supports` first) on the sample's tensors
    in other layouts, against its own outputs on the sample as given (see `_layout_problems`). On CPU the kernels
    run under the Triton interpreter, where a call through torch.ops would run the reference; its rounding of
    FP8 differs from the reference's, not from itself. A backend the interpreter cannot run on the sample (bf16
    atomics) is left to the GPU run. Returns what went wrong."""
    problems = []
    for backend in op.backends:
        if backend.available is not registry.triton_missing:
            continue

        def call(args, kwargs, backend=backend):
            if op.validate is not None:
                op.validate(*args, **kwargs)
            reasons = list(backend.supports(*args, **kwargs)) if backend.supports is not None else []
            if reasons:
                raise NotImplementedError(f"{backend.name}: {'; '.join(reasons)}")
            return _outputs_as_faked(op, backend.impl, args, kwargs)

        try:
            expected = call(*_replaced(sample))
        except AssertionError as exc:  # (not refused: the fake kernel says other outputs)
            problems.append(f"{op.qualname}: {backend.name}: {exc}")
            continue
        except Exception:  # refused, or beyond the interpreter (see the docstring)
            continue
        problems += _layout_problems(op, sample, call, expected)
    return problems


def device_mixing_problems(op: Op, sample: Sample, other: torch.device | str) -> list[str]:
    """The sample with each tensor argument in turn moved alone to device `other`: the op must raise a ValueError
    that names that device before any kernel runs (a kernel would fail inside, or read the wrong memory). Returns
    what went wrong."""
    tensors = {
        key: (name, value) for key, (name, value) in _arguments(op, sample).items() if isinstance(value, torch.Tensor)
    }
    if len(tensors) < 2:
        return []
    problems = []
    for key, (name, value) in tensors.items():
        what = f"{op.qualname}: {name} on {other}"
        args, kwargs = _replaced(sample, key, value.to(other))
        try:
            op.torch_op(*args, **kwargs)
        except ValueError as exc:
            if torch.device(other).type not in str(exc):
                problems.append(f"{what}: the ValueError does not name the device: {exc}")
        except Exception as exc:  # any other failure is the problem to report
            problems.append(f"{what}: {type(exc).__name__} instead of a ValueError: {exc}")
        else:
            problems.append(f"{what}: no error")
    return problems


_OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def run_opcheck(op: Op, device: Any = "cpu") -> None:
    """torch.library.opcheck on every sample of `op` (schema, fake kernel, autograd registration)."""
    if op.samples is None:
        raise ValueError(f"{op.qualname} declares no samples")
    for sample in op.samples(torch.device(device)):
        tests = _OPCHECK_TESTS
        if any(_is_fp8(t) for t in _flat([*sample.args, *sample.kwargs.values()])):
            # test_schema compares the inputs before and after with allclose, which torch lacks for FP8.
            tests = tuple(t for t in tests if t != "test_schema")
        torch.library.opcheck(op.torch_op.default, sample.args, sample.kwargs, test_utils=tests)


def _is_fp8(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype.is_floating_point and value.element_size() == 1


def domain_conformance(domain: str):
    """The conformance tests every domain package runs (T0, and T2 on a GPU), as two pytest functions:
    the domain is loaded by `import mslk`, and each of its ops passes opcheck, matches its reference on its
    samples (on the GPU when there is one), also with its tensors in other layouts (its Triton kernels too, under
    the interpreter on CPU) and with its arguments by name to a pinned backend, and rejects a tensor on another
    device with a clear ValueError. Use in a domain's tests:

        test_domain_loaded, test_op_conformance = domain_conformance("gemm")
    """
    import pytest

    from mslk.core import domains, registry

    def test_domain_loaded():
        import mslk  # noqa: F401  (loads every installed domain)

        assert domains.loaded.get(domain) == f"mslk.{domain}", domains.failed.get(domain, "not declared")

    ops = sorted((op for op in registry.OPS.values() if op.domain == domain), key=lambda op: op.qualname)

    @pytest.mark.parametrize("op", ops, ids=[op.qualname for op in ops])
    def test_op_conformance(op):
        device = torch.device("cuda" if arch.has_gpu() else "cpu")
        run_opcheck(op, device)
        samples = list(op.samples(device))
        problems = [p for sample in samples for p in check_against_reference(op, sample) + layout_problems(op, sample)]
        problems += keyword_problems(op, samples[0]) + gradient_problems(op, samples[0])
        other = "cpu" if device.type == "cuda" else "meta"
        problems += [p for sample in samples for p in device_mixing_problems(op, sample, other)]
        if device.type == "cpu":  # the kernels under the interpreter (on a GPU, torch.ops above ran them)
            problems += triton_layout_problems(op, samples[0])
        assert not problems, "\n".join(problems)

    return test_domain_loaded, test_op_conformance
