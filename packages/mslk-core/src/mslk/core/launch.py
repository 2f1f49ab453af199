"""The host side of kernel launches: arithmetic in plain Python, and a shorter launch path (`fast`, `Launcher`).

`triton.cdiv` and `triton.next_power_of_2` are constexpr functions in Triton 3.7, whose call from the host
costs about 5 us (their wrapper unwraps every argument): several per launch add up on small inputs. Triton is
imported at a launcher's first launch only: mslk.core imports without it.
"""

from __future__ import annotations

import functools
import logging
import operator
from collections.abc import Callable

import torch

from mslk.core import arch

log = logging.getLogger("mslk.launch")


def cdiv(a: int, b: int) -> int:
    """⌈a / b⌉ for non-negative a and positive b (Python ints: an unsigned NumPy integer would wrap in −a)."""
    return -(-operator.index(a) // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    n = operator.index(n)  # (a NumPy integer has no bit_length)
    return 1 << (n - 1).bit_length() if n > 1 else 1


@functools.lru_cache(maxsize=256)
def fewest_waves(programs: int, work: int, slots: int, least: int = 256) -> int:
    """The split count s of each program's `work` rows (parts of at least `least` rows, at most one a slot) that
    takes the least time when the programs · s parts run in waves of `slots` at once: ceil(programs · s / slots)
    waves of work / s rows, plus about 128 rows' worth a part (loading its queries, storing its output). Split-K
    attention's rule (MLA decode: 1.0-1.7x the speed of cdiv(SMs, programs) on 11 shapes, never slower; H200,
    RESULTS.md, sixtieth session)."""

    def time(s: int) -> float:
        return cdiv(programs * s, slots) * (work / s + 128)

    return min(range(1, max(1, min(work // least, slots)) + 1), key=time)


def dependent_launch(device: torch.device) -> bool:
    """Whether kernels on device can be launched as dependents of the kernel before them (programmatic dependent
    launch, `griddepcontrol`: NVIDIA Hopper and later)."""
    return device.type == "cuda" and torch.version.hip is None and arch.capability(device)[0] >= 9


def dependent_launch_options(dependent: bool) -> dict:
    """The launch option that makes a launch dependent, where it is (Triton for ROCm knows no `launch_pdl` and
    raises KeyError on it, False included)."""
    return {"launch_pdl": True} if dependent else {}


def compiled(kernel, *args, **kwargs):
    """The compiled kernel that `kernel[grid](*args, **kwargs)` runs, compiled now if it is new and loaded on the
    current GPU (not launched), for what it takes of an SM (programs_per_sm); None where Triton does not compile
    it (the interpreter, autotuners) or the GPU cannot run it as it is (too much shared memory: the launch says
    why, or runs fewer stages)."""
    from triton.runtime.errors import OutOfResources
    from triton.runtime.jit import JITFunction

    if not isinstance(kernel, JITFunction):
        return None
    kept = kernel.warmup(*args, grid=(1,), **kwargs)
    try:
        kept._init_handles()  # loading reports the registers (n_regs); Triton's own tutorials read them so
    except OutOfResources:
        return None
    return kept


_REGISTER_UNIT = 256  # registers go to a warp in units of 256 (compute capability 3.0 to 12.x)
_SUB_PARTITIONS = 4  # an SM's register file is split among its 4 sub-partitions, each holding whole warps
_SHARED_RESERVED = 1024  # bytes of shared memory the driver adds to each block (compute capability 8.0 on)
_SHARED_UNIT = 128  # bytes: shared memory goes to a block in these units
# Blocks an SM holds at most, where not 32 (cuda_occupancy.h)
_BLOCKS_PER_SM = {(7, 5): 16, (8, 6): 16, (8, 7): 16, (8, 9): 24, (10, 1): 24, (11, 0): 24, (12, 0): 24, (12, 1): 24}


def programs_per_sm(kernel, device: torch.device) -> int | None:
    """How many programs of a compiled kernel (`compiled`) one SM of `device` runs at once, by CUDA's occupancy rule
    (cuda_occupancy.h): each of the SM's sub-partitions holds the warps whose registers fit its quarter of the
    register file, and the SM the blocks its shared memory, threads and block slots hold. None where that is not
    known: no compiled kernel, ROCm (another register file), a driver or stand-in that reports no registers."""
    registers = getattr(kernel, "n_regs", 0)
    if not registers:
        return None
    info = arch.device_info(device)
    if info.vendor != "nvidia" or None in (info.registers_per_sm, info.shared_memory_per_sm, info.threads_per_sm):
        return None
    warps = kernel.metadata.num_warps
    per_warp = cdiv(registers * 32, _REGISTER_UNIT) * _REGISTER_UNIT
    by_registers = info.registers_per_sm // _SUB_PARTITIONS // per_warp * _SUB_PARTITIONS // warps
    shared = cdiv(kernel.metadata.shared + _SHARED_RESERVED, _SHARED_UNIT) * _SHARED_UNIT
    by_shared = info.shared_memory_per_sm // shared
    by_threads = info.threads_per_sm // (warps * 32)
    return min(by_registers, by_shared, by_threads, _BLOCKS_PER_SM.get(info.capability, 32))


def no_products(out: torch.Tensor, k: int) -> bool:
    """Whether a GEMM into out over a reduction of length k needs no kernel: out is empty, or k == 0 (out is
    zeroed here, as the empty sum)."""
    if out.numel() == 0:
        return True
    if k == 0:
        out.zero_()
        return True
    return False


class Launcher:
    """`Launcher(kernel)[grid](*args, **kwargs)` launches a `@triton.jit` or `@gluon.jit` kernel as
    `kernel[grid](*args, **kwargs)` does, in less host time once it has launched with arguments alike.

    Triton's launch path binds and specializes every argument, hashes the specialization to find the compiled
    kernel and builds launch metadata, on every call (45 us a launch of the FP8 rowwise GEMM's kernel, 37 arguments,
    on the GPU machine's host; its launcher alone 20 us). Here the first launch goes through Triton
    and its compiled kernel is kept under a key of the arguments' properties that Triton specializes on
    (`specialization`), so that later launches with the same key call its launcher directly. The key is at least as
    fine as Triton's (tested against Triton's own specialization), so a kept kernel only ever assumes what the new
    arguments also satisfy. Triton's own path still serves: the interpreter, autotuned kernels, grids given as
    functions, launch hooks (profilers), unhashable arguments. Triton's knobs are read at a kernel's first launch.
    Measured (H200 machine, host time a call): FP8 rowwise GEMM 106 -> 93 us at 2048 x 7168 x 2048 and 82 -> 75 us
    at 16 x 8192 x 8192, varlen attention forward and backward 1479-1892 -> 1249-1628 us (RESULTS.md, 38th session).

    The pipeline depths (`num_stages`) were measured on Hopper, whose blocks have 227 KiB of shared memory; A100's
    have 163 KiB, RTX 4090's and 5090's 99 KiB. Where a GPU's shared memory cannot hold the stages asked for
    (Triton's OutOfResources at the first launch, before the kernel runs), the kernel runs on fewer: slower, not
    wrong (a stage holds the same tiles; fewer only load less ahead), as the `mslk.launch` logger says (INFO).
    """

    MAX_KEPT = 64  # compiled kernels kept per launcher; more means keys that rarely repeat: start again

    def __init__(self, kernel):
        self.kernel = kernel
        self._kept: dict = {}
        self._runtime: _TritonRuntime | None = None  # after the first launch, None: Triton's path every launch
        self._first = True
        self._params: list[tuple[str, bool, object]] = []  # (name, constexpr?, default) in the kernel's order
        self._runtime_names: frozenset[str] = frozenset()  # the parameters Triton specializes on (not constexprs)
        self._key_functions: dict[tuple[type, ...], Callable] = {}  # the positional arguments' types: _key_function

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def _launch(self, grid, args: tuple, kwargs: dict):
        if self._first:
            self._first = False
            self._runtime = self._first_launch()
        runtime = self._runtime
        if runtime is None or not isinstance(grid, tuple) or runtime.hooks_set():
            return self._through_triton(grid, args, kwargs)
        device = runtime.current_device()
        try:
            key = (device, self._key(args, kwargs))
            kept = self._kept.get(key)
        except TypeError:  # an unhashable argument: Triton's path
            return self._through_triton(grid, args, kwargs)
        if kept is None:
            compiled = self._through_triton(grid, args, kwargs)
            if compiled is not None and not hasattr(compiled, "result"):  # (a future under async compilation)
                if len(self._kept) >= self.MAX_KEPT:
                    self._kept.clear()
                    self._key_functions.clear()
                self._kept[key] = compiled
            return compiled
        # Every parameter in order, constexprs included, as Triton's launcher takes them (it skips constexprs).
        values = [*args]
        for name, _, default in self._params[len(args) :]:
            values.append(kwargs.get(name, default))
        grid_x, grid_y, grid_z = (*grid, 1, 1)[:3]
        stream = runtime.current_stream(device)
        kept.run(grid_x, grid_y, grid_z, stream, kept.function, kept.packed_metadata, None, None, None, *values)
        return kept

    def _through_triton(self, grid, args: tuple, kwargs: dict):
        """kernel[grid](*args, **kwargs), on fewer pipeline stages while the GPU's shared memory cannot hold them
        (Triton keeps each compiled kernel and its OutOfResources: a retry costs no compile)."""
        stages = kwargs.get("num_stages")
        while True:
            try:
                return self.kernel[grid](*args, **kwargs)
            except _out_of_resources() as exc:
                if exc.name != "shared memory" or stages is None or stages <= 1:
                    raise
                log.info(
                    "%s: %d pipeline stages take %d bytes of shared memory, this GPU has %d a block: trying %d",
                    getattr(self.kernel, "__name__", self.kernel), stages, exc.required, exc.limit, stages - 1,
                )  # fmt: skip
                stages -= 1
                kwargs = {**kwargs, "num_stages": stages}

    def _first_launch(self) -> _TritonRuntime | None:
        """The runtime when the kernel is compiled by Triton: a JITFunction (not interpreted, not autotuned)
        without pre-run hooks; else None, and every launch takes Triton's path."""
        from triton.runtime.jit import JITFunction

        if not isinstance(self.kernel, JITFunction) or self.kernel.pre_run_hooks:
            return None
        self._params = [(p.name, p.is_constexpr, p.default) for p in self.kernel.params]
        self._runtime_names = frozenset(name for name, is_constexpr, _ in self._params if not is_constexpr)
        return _TritonRuntime.get()

    def _key(self, args: tuple, kwargs: dict) -> tuple:
        """The arguments' types and specialization (see `specialization`), computed by a function written for the
        positional arguments' types (_key_function): the 58 arguments of a split-K decoding launch took 12.0 us through
        specialization's function a value, 8.4 us so (CPU machine; RESULTS.md, sixty-eighth session)."""
        if len(args) > len(self._params):  # Triton's path, which raises
            raise TypeError
        types = tuple(map(type, args))
        key_function = self._key_functions.get(types)
        if key_function is None:
            key_function = self._key_functions[types] = _key_function(args, [p[1] for p in self._params])
        if self._runtime_names.isdisjoint(kwargs):  # launch options and constexprs by name: kept as they are
            named = tuple(kwargs.items())
        else:
            named = tuple((name, specialization(v) if name in self._runtime_names else v) for name, v in kwargs.items())
        return types, key_function(*args), named


def _out_of_resources() -> type[Exception]:
    from triton.runtime.errors import OutOfResources

    return OutOfResources


_launchers: dict[int, Launcher] = {}


def fast(kernel) -> Launcher:
    """The Launcher of `kernel` (one a kernel, kept for the process): `launch.fast(kernel)[grid](*args, **kwargs)`
    in place of `kernel[grid](*args, **kwargs)`."""
    launcher = _launchers.get(id(kernel))
    if launcher is None or launcher.kernel is not kernel:
        launcher = _launchers[id(kernel)] = Launcher(kernel)
    return launcher


def specialization(value):
    """What Triton may specialize a kernel on in a non-constexpr argument (Triton 3.6 and 3.7: a tensor's dtype and
    16-byte alignment; an int's width, whether it is 1 and whether 16 divides it; a TMA descriptor's dtype, block
    and layout; only the type of a bool or float; a tuple's items one by one), or the value itself for anything
    else."""
    return (_specializers.get(type(value)) or _specializer(value))(value)


# What Triton specializes a tensor and an int on, as expressions of the value `{0}` (an int's width as two tests:
# 32-bit, 64-bit or unsigned 64): `specialization`'s functions are made of them, and _key_function writes them inline
# (a function call a value cost most of a key).
_TENSOR_KEY = "{0}.dtype, {0}.data_ptr() % 16 == 0"
_INT_KEY = "-2147483648 <= {0} < 2147483648, {0} < 9223372036854775808, {0} == 1, {0} % 16 == 0"


def _function_of(expression: str) -> Callable[[object], tuple]:
    namespace = {}
    exec(f"def key(value):\n    return ({expression.format('value')},)", namespace)
    return namespace["key"]


_tensor_specialization = _function_of(_TENSOR_KEY)
_int_specialization = _function_of(_INT_KEY)


def _descriptor_specialization(value):
    return type(value), value.base.dtype, tuple(value.block_shape), getattr(value, "layout", None)


def _tuple_specialization(value: tuple):
    """Element by element, as Triton specializes a tuple: a tuple of tensors keyed as itself would hold the tensors
    in the kept kernels' keys, and miss at every launch of new ones."""
    return type(value), tuple(map(specialization, value))


def _specializer(value):
    """specialization's function for values of value's type, kept for the type (_specializers), so that the
    isinstance tests run once a type: a launch's key over the 27 arguments of the attention backward's kernel took
    10.0 us with them, 6.3 us without (CPU machine; RESULTS.md, forty-eighth session)."""
    if isinstance(value, torch.Tensor):
        function = _tensor_specialization
    elif isinstance(value, (bool, float)):
        function = _type_of
    elif isinstance(value, int):
        function = _int_specialization
    elif getattr(value, "block_shape", None) is not None and hasattr(value, "base"):
        function = _descriptor_specialization  # a TMA descriptor, triton.tools' or Gluon's
    elif isinstance(value, tuple):
        function = _tuple_specialization
    else:
        function = _itself
    _specializers[type(value)] = function
    return function


def _type_of(value):
    return type(value)


def _itself(value):
    return value


_specializers: dict[type, Callable[[object], object]] = {}

# specialization's functions as expressions of an argument `{0}`, inlined in _key_function's functions; the
# argument's type, which _type_of returns, is in the key already: nothing.
_INLINE = {_tensor_specialization: _TENSOR_KEY, _int_specialization: _INT_KEY, _type_of: "", _itself: "{0}"}


def _key_function(args: tuple, constexpr: list[bool]) -> Callable[..., tuple]:
    """A function of arguments of args' types that returns their specialization, flat: constexprs as they are, the
    others as `specialization` keys them (with the types, which this function is written for, the flat tuple tells
    the same arguments apart; a tuple's key holds its items' structure)."""
    names, body, namespace = [], [], {}
    for i, (value, is_constexpr) in enumerate(zip(args, constexpr, strict=False)):
        name = f"a{i}"
        names.append(name)
        specializer = None if is_constexpr else _specializers.get(type(value)) or _specializer(value)
        if specializer is None:
            body.append(name)
        elif specializer in _INLINE:
            body.append(_INLINE[specializer].format(name))
        else:  # tuples, descriptors: their function
            namespace[f"s{i}"] = specializer
            body.append(f"s{i}({name})")
    expressions = ", ".join(part for part in body if part)
    exec(f"def key({', '.join(names)}):\n    return ({expressions}{',' if expressions else ''})", namespace)
    return namespace["key"]


class _TritonRuntime:
    """Triton's driver and launch hooks, looked up once (the driver is a lazy proxy)."""

    _instance: _TritonRuntime | None = None

    def __init__(self):
        from triton import knobs
        from triton.runtime import driver

        self.knobs = knobs
        self.current_device = driver.active.get_current_device
        self.current_stream = driver.active.get_current_stream

    @classmethod
    def get(cls) -> _TritonRuntime:
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    def hooks_set(self) -> bool:
        """Whether a launch hook is set (a profiler's): Triton's path then, which calls it."""
        runtime = self.knobs.runtime
        # HookChain (Triton 3.6 on): its calls; a plain hook (older): itself
        return any(getattr(hook, "calls", hook) for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook))
