"""Benchmark specs and the runner behind `mslk bench`.

A domain declares what to measure with a `BenchSpec` and `register`s it: the shapes, how to build random
inputs for one shape, the MSLK call, and the torch baselines that run on the same inputs. The runner times
every implementation of every shape in one run, in rounds of rotating order (the median of the rounds' medians
of `triton.testing.do_bench`), and reports, per row:

    TFLOP/s = flops(shape) / (ms · 1e-3) / 1e12
    GB/s    = bytes(shape) / (ms · 1e-3) / 1e9        (bytes: each input read once, each output written once)
    ratio   = baseline_ms / mslk_ms                   (> 1: MSLK is faster than the first baseline)

Example (a domain's bench module)::

    bench.register(bench.BenchSpec(
        name="f8f8bf16_rowwise",
        op="mslk::f8f8bf16_rowwise",
        shapes=[{"M": 8192, "N": 8192, "K": 8192}, {"M": 16, "N": 8192, "K": 8192}],
        make_inputs=_rowwise_inputs,
        run=lambda a: torch.ops.mslk.f8f8bf16_rowwise(*a),
        baselines={"torch._scaled_mm": _scaled_mm_rowwise},
        flops=lambda s: 2 * s["M"] * s["N"] * s["K"],
        bytes=lambda s: s["M"] * s["K"] + s["N"] * s["K"] + 4 * (s["M"] + s["N"]) + 2 * s["M"] * s["N"],
    ))
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from mslk.core import arch, registry

MSLK = "mslk"  # the impl name of the MSLK rows


@dataclass(frozen=True)
class BenchSpec:
    """What to measure for one op: shapes, inputs, the MSLK call and the torch baselines.

    `make_inputs(shape, device)` builds random inputs once per shape; `run` and every baseline take them.
    `flops(shape)` and `bytes(shape)` give the work of one call (None: that rate is not reported).
    `cuda_graph`: time under a CUDA graph, for launch-bound small shapes.
    """

    name: str
    op: str  # the qualname of the measured op, e.g. "mslk::f8f8bf16_rowwise"
    shapes: Sequence[Mapping[str, Any]]
    make_inputs: Callable[[dict, torch.device], Any]
    run: Callable[[Any], Any]
    baselines: Mapping[str, Callable[[Any], Any]] = field(default_factory=dict)
    flops: Callable[[dict], float] | None = None
    bytes: Callable[[dict], float] | None = None
    cuda_graph: bool = False
    domain: str = ""

    def matches(self, op_filter: str) -> bool:
        """True for the op's qualname, its bare name (after `::`) or the spec's name."""
        return op_filter in (self.op, self.op.rpartition("::")[2], self.name)


SPECS: dict[str, BenchSpec] = {}


def register(spec: BenchSpec) -> BenchSpec:
    """Add `spec` to SPECS and return the stored spec; an empty `domain` is taken from the registered op."""
    if spec.name in SPECS:
        raise ValueError(f"bench spec {spec.name!r} is registered twice")
    if not spec.domain and spec.op in registry.OPS:
        spec = replace(spec, domain=registry.OPS[spec.op].domain)
    SPECS[spec.name] = spec
    return spec


def copy_buffers(moved_bytes: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(source, destination) for the "copy same bytes" baseline of a data mover: `dst.copy_(src)` reads and writes
    half of `moved_bytes` each, the bytes the op must move."""
    half = moved_bytes // 2
    return torch.empty(half, dtype=torch.uint8, device=device), torch.empty(half, dtype=torch.uint8, device=device)


def specs(op_filter: str | None = None) -> list[BenchSpec]:
    """The registered specs (all when `op_filter` is None, else those that `BenchSpec.matches` it)."""
    return [s for s in SPECS.values() if op_filter is None or s.matches(op_filter)]


def measure(fn: Callable[[], Any], cuda_graph: bool = False) -> float:
    """Median milliseconds of `fn()`: `triton.testing.do_bench` (or `do_bench_cudagraph`).

    One call and a synchronize come first, so compilation and autotuning stay out of do_bench's run-time
    estimate. do_bench flushes L2 before every timed call; do_bench_cudagraph replays calls back to back, so
    a working set that fits in L2 stays hot there. Making inputs larger than L2 (or rotating copies) where
    that matters is the spec author's job.
    """
    import triton.testing  # not a dependency of mslk-core: only the runner on a GPU needs it

    fn()
    torch.cuda.synchronize()
    if cuda_graph:
        return triton.testing.do_bench_cudagraph(fn, return_mode="median")
    return triton.testing.do_bench(fn, return_mode="median")


@dataclass
class Row:
    """One implementation on one shape. `baseline`, `baseline_ms` and `ratio` are set on MSLK rows only."""

    spec: str
    shape: dict
    impl: str  # "mslk" or the baseline name
    ms: float | None = None
    tflops: float | None = None
    gbps: float | None = None
    baseline: str | None = None
    baseline_ms: float | None = None
    ratio: float | None = None  # baseline_ms / ms: > 1 means MSLK is faster
    spread: float | None = None  # (slowest - fastest round) / ms
    error: str | None = None


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


ROUNDS = 3  # timings of each implementation per shape; the median is reported


def _timings(impls: Mapping[str, Callable[[Any], Any]], inputs: Any, cuda_graph: bool, rounds: int) -> dict:
    """name -> per-round milliseconds, or the error text of the implementation's first failure (it then sits out
    the later rounds). Round r starts r places further along the implementations: the first heavy call of a shape
    tends to run faster (clocks, power; session 16 of RESULTS.md measured one kernel at 0.95-1.10x of itself by its
    place alone), so each implementation takes each place in turn."""
    names = list(impls)
    results: dict[str, list[float] | str] = {name: [] for name in names}
    for r in range(rounds):
        start = r % len(names)
        for name in names[start:] + names[:start]:
            if isinstance(results[name], str):
                continue
            try:
                results[name].append(measure(lambda fn=impls[name]: fn(inputs), cuda_graph))
            except Exception as exc:  # e.g. NotSupportedError for this shape: report it, keep benchmarking
                results[name] = _error_text(exc)
    return results


def _timed_row(spec: BenchSpec, shape: dict, impl: str, result: list[float] | str) -> Row:
    row = Row(spec.name, shape, impl)
    if isinstance(result, str):
        row.error = result
        return row
    row.ms = statistics.median(result)
    row.spread = (max(result) - min(result)) / row.ms
    if spec.flops is not None:
        row.tflops = spec.flops(shape) / row.ms / 1e9  # FLOP / (ms·1e-3 s) / 1e12
    if spec.bytes is not None:
        row.gbps = spec.bytes(shape) / row.ms / 1e6  # B / (ms·1e-3 s) / 1e9
    return row


def _run_shape(spec: BenchSpec, shape: dict, device: torch.device, baselines: bool, rounds: int) -> list[Row]:
    try:
        inputs = spec.make_inputs(shape, device)
    except Exception as exc:
        return [Row(spec.name, shape, MSLK, error=f"make_inputs: {_error_text(exc)}")]
    # Every implementation runs on the same inputs in the same run, so the ratio compares like with like.
    impls = {MSLK: spec.run, **(spec.baselines if baselines else {})}
    timings = _timings(impls, inputs, spec.cuda_graph, rounds)
    mslk, *others = (_timed_row(spec, shape, name, result) for name, result in timings.items())
    if others:
        first = others[0]
        mslk.baseline, mslk.baseline_ms = first.impl, first.ms
        if mslk.ms is not None and first.ms is not None:
            mslk.ratio = first.ms / mslk.ms
    return [mslk, *others]


def run(
    bench_specs: Sequence[BenchSpec],
    device: torch.device | str | None = None,
    shape_filter: Sequence[str] = (),
    baselines: bool = True,
    rounds: int = ROUNDS,
) -> list[Row]:
    """Time MSLK and every baseline (none when `baselines` is False) of every spec and shape (only those whose
    text, e.g. "M=16 N=8192 K=8192", contains one of `shape_filter` when given) `rounds` times in rotating
    order; failures become rows with `error` set."""
    device = torch.device("cuda" if device is None else device)
    # Inputs live only inside _run_shape, so one shape's tensors are freed before the next shape's are built.
    return [
        row
        for spec in bench_specs
        for shape in spec.shapes
        if not shape_filter or any(part in _shape_text(shape) for part in shape_filter)
        for row in _run_shape(spec, dict(shape), device, baselines, rounds)
    ]


def _shape_text(shape: Mapping[str, Any]) -> str:
    return " ".join(f"{key}={value}" for key, value in shape.items())


def _rate_text(value: float | None) -> str:
    return "" if value is None else f"{value:.1f}"


def format_table(rows: Sequence[Row]) -> str:
    """Fixed-width table: bench, shape, impl, ms (4 significant digits), spread, TFLOP/s, GB/s, vs baseline, error.

    "spread" is (slowest - fastest round) / ms; "vs baseline" is the ratio on MSLK rows (1.05x: MSLK 5% faster than
    the first baseline); the error column shows the first line of the error (the JSON has it whole).
    """
    header = ("bench", "shape", "impl", "ms", "spread", "TFLOP/s", "GB/s", "vs baseline", "error")
    right_aligned = {"ms", "spread", "TFLOP/s", "GB/s", "vs baseline"}
    cells = [header] + [
        (
            row.spec,
            _shape_text(row.shape),
            row.impl,
            "" if row.ms is None else f"{row.ms:.4g}",
            "" if row.spread is None else f"{row.spread:.1%}",
            _rate_text(row.tflops),
            _rate_text(row.gbps),
            "" if row.ratio is None else f"{row.ratio:.2f}x",
            (row.error or "").partition("\n")[0],
        )
        for row in rows
    ]
    widths = [max(len(line[i]) for line in cells) for i in range(len(header))]
    lines = [
        "  ".join(
            cell.rjust(width) if name in right_aligned else cell.ljust(width)
            for name, cell, width in zip(header, line, widths, strict=True)
        ).rstrip()
        for line in cells
    ]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def environment() -> dict[str, Any]:
    """Where the numbers come from: date (UTC), GPU name, torch, triton, CUDA and HIP versions."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": arch.device_info().name if arch.has_gpu() else None,
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "hip": torch.version.hip,
    }


def write_json(rows: Sequence[Row], path: str) -> None:
    """Write `{**environment(), "rows": [...]}` to `path`."""
    with open(path, "w") as f:
        json.dump({**environment(), "rows": [asdict(row) for row in rows]}, f, indent=2)
        f.write("\n")


NO_GPU_MESSAGE = "mslk bench: no GPU here (torch.cuda.is_available() is False); benchmarks run on a CUDA or ROCm device"
NO_SPECS_MESSAGE = "no bench specs are registered: install a domain package (pip install mslk-gemm ...)"


def main(
    op_filter: str | None = None,
    json_path: str | None = None,
    shape_filter: Sequence[str] = (),
    baselines: bool = True,
    rounds: int = ROUNDS,
) -> int:
    """`mslk bench [--op NAME] [--shape TEXT ...] [--no-baselines] [--rounds N] [--json PATH]`; --no-baselines and
    --json serve A/B runs of two source trees (one process each, PYTHONPATH picking the tree), MSLK's rows alone.

    Exit code: 0 when every row ran (also with no GPU or no specs), 1 when a row has an error, 2 when
    `op_filter` matches no spec, `shape_filter` no shape of them, or `json_path` cannot be written (said before
    anything runs).
    """
    if not arch.has_gpu():
        print(NO_GPU_MESSAGE)
        return 0
    if json_path is not None and (
        os.path.isdir(json_path) or not os.access(os.path.dirname(os.path.abspath(json_path)), os.W_OK)
    ):
        print(f"mslk bench: cannot write --json {json_path!r} (its folder is missing or read-only)", file=sys.stderr)
        return 2
    selected = specs(op_filter)
    if not selected:
        out = sys.stdout if op_filter is None else sys.stderr
        if not SPECS:
            print(NO_SPECS_MESSAGE, file=out)
        else:
            print(f"mslk bench: no bench spec matches {op_filter!r}; registered specs:", file=out)
            for spec in SPECS.values():
                print(f"  {spec.name}  ({spec.op}{', ' + spec.domain if spec.domain else ''})", file=out)
        return 0 if op_filter is None else 2
    rows = run(selected, shape_filter=shape_filter, baselines=baselines, rounds=rounds)
    if not rows:
        print(
            f"mslk bench: no shape of {', '.join(s.name for s in selected)} matches --shape {list(shape_filter)}",
            file=sys.stderr,
        )
        return 2
    info = environment()
    print(
        f"{info['gpu']}, torch {info['torch']}, triton {info['triton']}, "
        f"CUDA {info['cuda'] or '-'}, HIP {info['hip'] or '-'}, {info['date']}"
    )
    print(format_table(rows))
    if json_path is not None:
        write_json(rows, json_path)
    return 1 if any(row.error is not None for row in rows) else 0
