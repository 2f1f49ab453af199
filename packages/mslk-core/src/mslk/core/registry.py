"""How a domain declares its ops and backends, and how a call picks a backend.

An op is one `torch.library` schema (namespace `mslk` or the one spec/API.md gives) with:
- a reference implementation in plain PyTorch: the CPU kernel and the oracle of every test;
- GPU backends in priority order, each saying whether it is usable on this machine (`available`) and
  whether it can serve given inputs (`supports`, a list of reasons why not);
- a fake kernel, so torch.compile and torch.export trace it without running it;
- samples (small random inputs) that `mslk check` and the opcheck conformance test run.

An op that returns its output argument when one is given (upstream's `Tensor(a!)? output=None) -> Tensor`)
names it `out_arg`: a returned alias of an input is outside what torch.library allows (opcheck fails, Inductor
cannot lower the optional mutated argument), so the schema is registered as a composite of two hidden ops,
`_NAME_functional` without the argument and `_NAME_out`, which writes it and returns nothing.

The torch op (`torch.ops.mslk.NAME`) dispatches to the first backend that supports the inputs. When none
does, NotSupportedError lists the inputs, every backend's reasons and a next step. A backend can be pinned
with MSLK_BACKEND or with `op(..., backend=NAME)`; a pinned backend that cannot serve the inputs raises
ValueError with its reasons instead of falling back.

Example (a domain module)::

    axpy = registry.Op(
        "mslk::axpy(Tensor x, Tensor y, float alpha=1.0) -> Tensor",
        domain="example",
        reference=lambda x, y, alpha=1.0: alpha * x + y,
        fake=lambda x, y, alpha=1.0: torch.empty_like(x),
        samples=lambda device: [registry.Sample((randn(5, device=device), randn(5, device=device)))],
    )

    @axpy.backend("triton", available=registry.triton_missing, supports=_axpy_triton_supports)
    def _axpy_triton(x, y, alpha=1.0): ...
"""

from __future__ import annotations

import contextvars
import functools
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd import forward_ad

from mslk.core import env

log = logging.getLogger("mslk.dispatch")


def dispatch_logging(*switches: env.EnvVar) -> bool:
    """Whether to log a dispatch decision: MSLK_LOG_DISPATCH or one of `switches` is on. The logger's level is asked
    first (reading the environment costs a few us a call), except while torch.compile traces, which cannot trace
    a Logger method."""
    if not torch.compiler.is_compiling() and not log.isEnabledFor(logging.INFO):
        return False
    return env.LOG_DISPATCH.enabled() or any(switch.enabled() for switch in switches)


REFERENCE = "reference"


class NotSupportedError(NotImplementedError):
    """No backend of an op can serve the given inputs; the message says why for each backend."""


@dataclass(frozen=True)
class Sample:
    """One call of an op on small random inputs: what `mslk check` and opcheck run."""

    args: tuple
    kwargs: dict = field(default_factory=dict)
    name: str = ""


@dataclass
class Backend:
    """One implementation of an op.

    `devices`: device types it runs on. `available()`: None when usable on this machine, else why not
    (checked once and cached). `supports(*args, **kwargs)`: reasons why it cannot serve these inputs.
    `requires(tensor)`: why the GPU holding the call's first tensor cannot run it (None: it can), e.g.
    `arch.fp8_e4m3_missing`.
    """

    name: str
    impl: Callable[..., Any]
    devices: frozenset[str]
    supports: Callable[..., Iterable[str]] | None = None
    available: Callable[[], str | None] | None = None
    requires: Callable[[torch.Tensor], str | None] | None = None

    @functools.cached_property
    def unavailable_reason(self) -> str | None:
        return self.available() if self.available is not None else None

    def reasons(self, device_type: str, args: tuple, kwargs: dict) -> list[str]:
        if device_type not in self.devices:
            return [f"device={device_type} (supported: {', '.join(sorted(self.devices))})"]
        if self.unavailable_reason is not None:
            return [self.unavailable_reason]
        first = _first_tensor(args, kwargs) if self.requires is not None else None
        missing = self.requires(first) if first is not None else None
        if missing is not None:
            return [missing]
        return list(self.supports(*args, **kwargs)) if self.supports is not None else []


@functools.cache
def triton_missing() -> str | None:
    """Availability check for Triton backends: None when Triton imports, else why not."""
    try:
        import triton  # noqa: F401
    except Exception as exc:
        return f"triton is not available ({type(exc).__name__}: {exc})"
    return None


# Native libraries of the domains: name -> None when loaded, else why not. `mslk env` prints them.
native_libraries: dict[str, str | None] = {}


def record_native(name: str, error: str | None) -> None:
    native_libraries[name] = error


# (qualname, backend) of an `op(..., backend=NAME)` call in progress: its torch.ops call reaches `_dispatch` pinned.
_pinned_call: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar("mslk_pinned_call", default=None)

_libraries: dict[str, torch.library.Library] = {}  # kept alive: a collected Library unregisters its ops
OPS: dict[str, Op] = {}


def _library(namespace: str) -> torch.library.Library:
    if namespace not in _libraries:
        _libraries[namespace] = torch.library.Library(namespace, "FRAGMENT")
    return _libraries[namespace]


def alias(schema: str, impl: Callable[..., Any]) -> None:
    """An upstream name for calls of MSLK's ops (`impl` only calls torch ops): registered CompositeImplicitAutograd,
    so autograd, fake tensors and torch.compile go through the ops it calls."""
    namespace, rest = schema.split("::", 1)
    lib = _library(namespace)
    lib.define(rest)
    lib.impl(rest.split("(", 1)[0], impl, "CompositeImplicitAutograd")


class Op:
    """A public op: schema, reference, fake, backends, samples. See the module docstring."""

    def __init__(
        self,
        schema: str,
        *,
        domain: str,
        reference: Callable[..., Any],
        fake: Callable[..., Any] | None = None,
        samples: Callable[[torch.device], Iterable[Sample]] | None = None,
        validate: Callable[..., None] | None = None,
        reference_devices: Sequence[str] = ("cpu",),
        next_step: str | None = None,
        tolerance: float | None = None,
        out_arg: str | None = None,
        backward: Callable[..., Any] | None = None,
        setup_context: Callable[..., Any] | None = None,
    ):
        parsed = torch._C.parse_schema(schema)
        self.qualname: str = parsed.name  # "mslk::name"
        if "::" not in self.qualname:
            raise ValueError(f"op schema needs a namespace (`mslk::name(...)`), got {schema!r}")
        if self.qualname in OPS:
            raise ValueError(f"op {self.qualname} is defined twice")
        self.namespace, self.name = self.qualname.split("::")
        if out_arg is not None and backward is not None:
            raise ValueError(f"{self.qualname}: an op with out_arg has no backward")
        self.arg_names: list[str] = [arg.name for arg in parsed.arguments]
        # The arguments the op writes into (`Tensor(a!)`): outputs to check as much as the returned ones.
        self.mutated_args: list[str] = [
            arg.name for arg in parsed.arguments if arg.alias_info is not None and arg.alias_info.is_write
        ]
        self.domain = domain
        self.reference = reference
        self.samples = samples
        # Raises on bad input before any backend (or the fake) runs; torch passes None for a Tensor argument on.
        required = [(i, arg.name) for i, arg in enumerate(parsed.arguments) if arg.type.kind() == "TensorType"]
        self.validate = _refusing_none(self.name, required, validate) if required else validate
        self.next_step = next_step
        self.tolerance = tolerance  # relative error `mslk check` accepts; None: by output dtype
        self.differentiable = backward is not None
        self.backends: list[Backend] = [Backend(REFERENCE, reference, frozenset(reference_devices))]

        lib = _library(self.namespace)
        lib.define(schema.split("::", 1)[1])
        if out_arg is not None:
            self._define_with_output(lib, schema, parsed, out_arg, fake)
            OPS[self.qualname] = self
            return
        for key in ("CPU", "CUDA"):
            lib.impl(self.name, self._dispatch, key)
        if not any(arg.type.kind() == "TensorType" for arg in parsed.arguments):
            # Called with no tensor at all (empty lists, optionals None), the dispatcher has no device to go by:
            # this key takes such calls, whose validation says what is wrong, instead of its "no fallback" error.
            lib.impl(self.name, self._dispatch, "CompositeExplicitAutograd")
        if fake is not None:
            torch.library.register_fake(self.qualname, self._validated(fake), lib=lib)
        if backward is not None:
            torch.library.register_autograd(self.qualname, backward, setup_context=setup_context, lib=lib)
        elif not self.mutated_args:
            _register_no_backward(lib, self.qualname, self.qualname)
        OPS[self.qualname] = self

    def _define_with_output(self, lib, schema: str, parsed, out_arg: str, fake: Callable[..., Any] | None) -> None:
        """The op as a composite of `_NAME_functional` (no out_arg; returns a new tensor; only where out_arg is
        optional) and `_NAME_out` (out_arg first and written; returns nothing), both served by the backends and the
        fake with out_arg None or given."""
        arguments = _schema_arguments(schema)
        position = self.arg_names.index(out_arg)
        others = self.arg_names[:position] + self.arg_names[position + 1 :]
        declared = ", ".join(arguments[:position] + arguments[position + 1 :])
        returns = schema.rsplit("->", 1)[1].strip()
        functional, written = f"_{self.name}_functional", f"_{self.name}_out"
        optional = arguments[position].split()[0].endswith("?")
        if optional:
            lib.define(f"{functional}({declared}) -> {returns}")
        lib.define(f"{written}(Tensor(a!) {out_arg}, {declared}) -> ()")
        ops = getattr(torch.ops, self.namespace)
        functional_op = getattr(ops, functional).default if optional else None
        written_op = getattr(ops, written).default

        defaults = {arg.name: arg.default_value for arg in parsed.arguments if arg.has_default_value()}

        def public_args(output, args, kwargs) -> list:
            """A hidden op's arguments (the dispatcher leaves defaults out) as the public op's, in schema order,
            out_arg = output."""
            values = [*args, *(kwargs.get(name, defaults.get(name)) for name in others[len(args) :])]
            return [*values[:position], output, *values[position:]]

        def composite(*args, **kwargs):
            values = {**dict(zip(self.arg_names, args, strict=False)), **kwargs}
            output = values.pop(out_arg, None)
            if output is None:
                if functional_op is None:  # (torch lets None through to a Tensor argument)
                    raise ValueError(f"{self.name}: {out_arg} must be a tensor, got None")
                return functional_op(**values)
            written_op(output, **values)
            return output

        def served(fn: Callable[..., Any], writes: bool) -> Callable[..., Any]:
            """fn (the backends' dispatch, or the fake) as a hidden op's kernel: the written op's first argument is
            out_arg, and it returns nothing."""

            def kernel(*args, **kwargs):
                output, args = (args[0], args[1:]) if writes else (None, args)
                result = fn(*public_args(output, args, kwargs))
                return None if writes else result

            return kernel

        lib.impl(self.name, composite, "CompositeImplicitAutograd")
        for name, writes in ((functional, False), (written, True)) if optional else ((written, True),):
            for key in ("CPU", "CUDA"):
                lib.impl(name, served(self._dispatch, writes), key)
            if fake is not None:
                torch.library.register_fake(f"{self.namespace}::{name}", served(self._validated(fake), writes), lib=lib)
        if optional:
            _register_no_backward(lib, f"{self.namespace}::{functional}", self.qualname)

    # -- declaring backends -------------------------------------------------------------------------
    def backend(
        self,
        name: str,
        *,
        devices: Sequence[str] = ("cuda",),
        supports: Callable[..., Iterable[str]] | None = None,
        available: Callable[[], str | None] | None = None,
        before: str | None = None,
        requires: Callable[[torch.Tensor], str | None] | None = None,
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator registering `impl` as a backend, after those already registered (before reference), or
        just ahead of the backend named `before` (a backend that another module adds to an op defined elsewhere)."""
        if any(b.name == name for b in self.backends):
            raise ValueError(f"{self.qualname} already has a backend named {name!r}")
        position = -1 if before is None else self.backends.index(self.get_backend(before))

        def register(impl: Callable[..., Any]) -> Callable[..., Any]:
            self.backends.insert(position, Backend(name, impl, frozenset(devices), supports, available, requires))
            return impl

        return register

    # -- calling ------------------------------------------------------------------------------------
    @property
    def torch_op(self):
        return getattr(getattr(torch.ops, self.namespace), self.name)

    def __call__(self, *args: Any, backend: str | None = None, **kwargs: Any) -> Any:
        """Call through torch.ops (autograd, compile, export); `backend=` pins that backend for this call."""
        if backend is None:
            return self.torch_op(*args, **kwargs)
        token = _pinned_call.set((self.qualname, backend))
        try:
            return self.torch_op(*args, **kwargs)
        finally:
            _pinned_call.reset(token)

    def _dispatch(self, *args: Any, **kwargs: Any) -> Any:
        pin = _pinned_call.get()
        pinned = pin[1] if pin is not None and pin[0] == self.qualname else None
        return self.select(args, kwargs, pinned=pinned).impl(*args, **kwargs)

    def _validated(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """fn (the fake kernel) after the checks a real call makes first (torch.compile then refuses alike)."""

        def run(*args: Any, **kwargs: Any) -> Any:
            self._check_inputs(args, kwargs)
            return fn(*args, **kwargs)

        return fn if self.validate is None and not self.mutated_args else functools.wraps(fn)(run)

    def _check_inputs(self, args: tuple, kwargs: dict) -> None:
        """The op's validation, then the tensors it writes into may be written (no element twice), and no input
        requires grad where it writes (the write has no backward), and none carries a forward-mode tangent."""
        if self.validate is not None:
            self.validate(*args, **kwargs)
        # (A tangent the kernels would drop.)
        if forward_ad._current_level >= 0 and _any_tensor((*args, *kwargs.values()), _has_tangent):
            raise RuntimeError(
                f"{self.qualname} has no forward-mode derivative, and an input of it is a dual tensor "
                "(torch.autograd.forward_ad): unpack it, or use reverse mode where the op has a backward"
            )
        if self.mutated_args:
            values = {**dict(zip(self.arg_names, args, strict=False)), **kwargs}
            written = [name for name in self.mutated_args if values.get(name) is not None]
            for name in written:
                check_writable(self.name, name, values[name])
            if written and torch.is_grad_enabled():
                needing = [name for name, value in values.items() if _any_tensor(value, lambda t: t.requires_grad)]
                if needing:
                    raise RuntimeError(
                        f"{self.qualname} writes into {', '.join(written)} and has no backward, but "
                        f"{', '.join(needing)} requires grad: call it under torch.no_grad() or on detached tensors"
                    )

    def get_backend(self, name: str) -> Backend:
        for b in self.backends:
            if b.name == name:
                return b
        raise ValueError(
            f"{self.qualname} has no backend {name!r} (it has: {', '.join(b.name for b in self.backends)})"
        )

    def select(self, args: tuple, kwargs: dict, pinned: str | None = None) -> Backend:
        """The backend that serves these inputs: the pinned one, else the first that supports them.
        Bad input (the op's `validate`) raises before any backend is considered."""
        self._check_inputs(args, kwargs)
        pinned = pinned or self._pinned_by_env()
        device_type = _device_type(args, kwargs)
        if pinned is not None:
            chosen = self.get_backend(pinned)
            reasons = chosen.reasons(device_type, args, kwargs)
            if reasons:
                raise ValueError(
                    format_not_supported(
                        f"Operator `{self.qualname}` does not support inputs:",
                        self.inputs(args, kwargs),
                        {chosen.name: reasons},
                    )
                )
        else:
            all_reasons = {}
            for candidate in self.backends:
                reasons = candidate.reasons(device_type, args, kwargs)
                if not reasons:
                    chosen = candidate
                    break
                all_reasons[candidate.name] = reasons
            else:
                raise NotSupportedError(
                    format_not_supported(
                        f"No operator found for `{self.qualname}` with inputs:",
                        self.inputs(args, kwargs),
                        all_reasons,
                        next_step=self.next_step or _default_next_step(self),
                    )
                )
        if dispatch_logging():
            log.info("%s -> %s%s", self.qualname, chosen.name, " (pinned)" if pinned else "")
        return chosen

    def _pinned_by_env(self) -> str | None:
        value = env.BACKEND.get()
        if not value:  # the common case, on every call: nothing pinned
            return None
        per_op, anywhere = _parse_pins(value)
        pinned = per_op.get(self.qualname) or per_op.get(self.name)
        if pinned is not None:
            return pinned
        names = {b.name for b in self.backends}
        return next((name for name in anywhere if name in names), None)

    def inputs(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        """The call's arguments by schema name, for error messages."""
        return {**dict(zip(self.arg_names, args, strict=False)), **kwargs}

    def usable_backends(self, device_type: str) -> list[Backend]:
        """Backends that could run on this device type here (inputs aside)."""
        return [b for b in self.backends if device_type in b.devices and b.unavailable_reason is None]


def _any_tensor(value: Any, test: Callable[[torch.Tensor], bool]) -> bool:
    """Whether a tensor in value (a tensor, or a list or tuple of them, nested) passes test."""
    if isinstance(value, (list, tuple)):
        return any(_any_tensor(v, test) for v in value)
    return isinstance(value, torch.Tensor) and test(value)


def _has_tangent(t: torch.Tensor) -> bool:
    return forward_ad.unpack_dual(t).tangent is not None


# -- the backward of an op without one ---------------------------------------------------------------
# Its inputs' gradients come from `mslk::_no_backward`, which raises when it runs: in eager backward, and in a compiled
# backward graph (where it traces to an empty tensor, so that a compiled forward still traces).
_library("mslk").define("_no_backward(Tensor grad, SymInt[] size, ScalarType dtype, Device device, str op) -> Tensor")


def _refuse_backward(grad: torch.Tensor, size: list[int], dtype: torch.dtype, device: torch.device, op: str):
    raise RuntimeError(
        f"{op} has no backward, and an input of it requires grad: gradients cannot flow through it. Call it "
        "under torch.no_grad() or on detached tensors (of MSLK's ops, attention's are differentiable)"
    )


torch.library.register_fake(
    "mslk::_no_backward",
    lambda grad, size, dtype, device, op: torch.empty(size, dtype=dtype, device=device),
    lib=_library("mslk"),
)
_library("mslk").impl("_no_backward", _refuse_backward, "CompositeExplicitAutograd")


def _input_layout(value: Any) -> Any:
    """(shape, dtype, device) of a tensor input, a list of them for a tensor list, None for anything else."""
    if isinstance(value, torch.Tensor):
        return value.shape, value.dtype, value.device
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        return [_input_layout(v) for v in value]
    return None


def _register_no_backward(lib: torch.library.Library, qualname: str, name: str) -> None:
    """qualname's backward: what `mslk::_no_backward` gives (the error names the op `name`)."""

    def setup_context(ctx, inputs, output, keyword_only_inputs=None) -> None:
        ctx.layouts = [_input_layout(value) for value in inputs]

    def backward(ctx, *grads):
        grad = _first_tensor(grads, {})  # (autograd gives zeros for the outputs the loss leaves out)

        def refused(layout: Any, needed: Any) -> Any:
            if isinstance(layout, list):
                return [refused(lay, need) for lay, need in zip(layout, needed, strict=True)]
            return torch.ops.mslk._no_backward(grad, *layout, name) if needed else None

        # (needs_input_grad leaves out the trailing arguments the dispatcher dropped as equal to their defaults)
        return tuple(refused(lay, need) for lay, need in zip(ctx.layouts, ctx.needs_input_grad, strict=False))

    torch.library.register_autograd(qualname, backward, setup_context=setup_context, lib=lib)


def _refusing_none(
    op: str, required: list[tuple[int, str]], validate: Callable[..., None] | None
) -> Callable[..., None]:
    """validate, after a check that no required Tensor argument (position, name) is None (torch lets None through
    to them; a validator would fail on None.dtype)."""

    def checked(*args: Any, **kwargs: Any) -> None:
        for position, name in required:
            if (args[position] if position < len(args) else kwargs.get(name)) is None:
                raise ValueError(f"{op}: {name} must be a tensor, got None")
        if validate is not None:
            validate(*args, **kwargs)

    return checked


def _schema_arguments(schema: str) -> list[str]:
    """The arguments of a schema string as written ("Tensor(a!)? out=None", "int[2] stride=[1, 1]", ...)."""
    text = schema.rsplit("->", 1)[0].split("(", 1)[1].strip()[:-1]  # (what lies between the name's parentheses)
    arguments, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += (char in "([") - (char in ")]")
        if char == "," and depth == 0:
            arguments.append(text[start:i].strip())
            start = i + 1
    return [*arguments, text[start:].strip()] if text.strip() else arguments


@functools.lru_cache(maxsize=16)
def _parse_pins(value: str) -> tuple[dict[str, str], tuple[str, ...]]:
    per_op, anywhere = {}, []
    for item in filter(None, (part.strip() for part in value.split(","))):
        op, sep, backend = item.partition("=")
        if sep:
            per_op[op.strip()] = backend.strip()
        else:
            anywhere.append(item)
    return per_op, tuple(anywhere)


def _first_tensor(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The call's first tensor, also inside a list or tuple argument."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, torch.Tensor):
                    return item
    return None


def _device_type(args: tuple, kwargs: dict) -> str:
    first = _first_tensor(args, kwargs)
    return "cpu" if first is None else first.device.type


def _default_next_step(op: Op) -> str:
    return (
        f"run `mslk env` to see which backends of {op.qualname} are usable on this machine, "
        "or move the inputs to a device and layout that a backend above supports."
    )


def check_devices(where: str, **tensors: torch.Tensor | None) -> None:
    """ValueError unless the named tensors (None skipped) are on one device: a kernel reads them all, and one on
    another device would fail inside it, or read the wrong memory, instead of naming the cause."""
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        placed = ", ".join(f"{name} on {device}" for name, device in devices.items())
        raise ValueError(f"{where}: all tensors must be on one device, got {placed}")


def check_output(
    where: str,
    name: str,
    out: torch.Tensor | None,
    shape: Sequence[int],
    dtypes: Sequence[torch.dtype],
    device: torch.device,
) -> None:
    """ValueError unless a caller's output tensor `out` (None skipped) has the shape, one of the dtypes and the
    device that the op writes."""
    if out is not None and (tuple(out.shape) != tuple(shape) or out.dtype not in dtypes or out.device != device):
        wanted = " or ".join(str(d).removeprefix("torch.") for d in dict.fromkeys(dtypes))
        raise ValueError(
            f"{where}: {name} must be {wanted} {tuple(shape)} on {device}, got {tuple(out.shape)} {out.dtype} on "
            f"{out.device}"
        )


def check_writable(where: str, name: str, t: torch.Tensor | None) -> None:
    """ValueError if elements of a tensor an op writes share memory (an `expand()`ed view): each kernel lane would
    write its own value there, one of them winning. Checked as strides sorted ascending, each past the reach of
    those below it (a layout that interleaves dimensions otherwise is refused too)."""
    if t is None or t.is_contiguous():
        return
    reach = 0
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape, strict=True) if sz > 1):
        if stride <= reach:
            raise ValueError(
                f"{where}: {name} is written, but its elements overlap in memory (shape {tuple(t.shape)}, strides "
                f"{tuple(t.stride())}; an expand()ed view?): pass a tensor with memory of its own for each element"
            )
        reach += stride * (size - 1)


def describe(value: Any, detailed: bool = True) -> str:
    """One input in an error message: tensors by shape and dtype (and device and strides if detailed)."""
    if isinstance(value, torch.Tensor):
        text = f"shape={tuple(value.shape)} ({value.dtype})"
        if detailed:
            text += f" device={value.device} stride={tuple(value.stride())}"
        return text
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        inner = ", ".join(describe(v, detailed) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    return repr(value)


def format_not_supported(
    headline: str,
    inputs: dict[str, Any],
    reasons: dict[str, list[str]],
    next_step: str | None = None,
    detailed: bool = True,
) -> str:
    """The dispatch error text, in the format xFormers/MSLK users know::

    No operator found for `op` with inputs:
         query       : shape=(2, 498, 8, 32) (torch.float16)
    `backend` is not supported because:
        reason
    """
    lines = [headline]
    lines += [f"     {name:<12}: {describe(value, detailed)}" for name, value in inputs.items()]
    for backend, why in reasons.items():
        lines.append(f"`{backend}` is not supported because:")
        lines += [f"    {reason}" for reason in why]
    if next_step:
        lines.append(f"Next step: {next_step}")
    return "\n".join(lines)


def get(name: str) -> Op:
    """An op by `ns::name` or by bare name (namespace mslk)."""
    qualname = name if "::" in name else f"mslk::{name}"
    try:
        return OPS[qualname]
    except KeyError:
        raise KeyError(f"no MSLK op named {name!r} is registered (is its domain package installed?)") from None
