"""The `mslk` command: `mslk env`, `mslk check`, `mslk bench`."""

from __future__ import annotations

import argparse
import platform
import sys

import torch

from mslk.core import arch, env, registry, version


def _triton_status() -> str:
    missing = registry.triton_missing()
    if missing is not None:
        return missing
    import triton

    return triton.__version__


def _gpu_status() -> str:
    if not arch.has_gpu():
        return "none (torch.cuda.is_available() is False)"
    info = arch.device_info()
    line = f"{info.name}, capability {info.capability[0]}.{info.capability[1]}, {info.sm_count} SMs"
    if info.gfx_arch:
        line += f", {info.gfx_arch}"
    try:
        fp8 = info.fp8_dtype()
        line += f", FP8 {fp8} (max {torch.finfo(fp8).max:g})"
    except RuntimeError as exc:
        line += f", FP8: {exc}"
    return f"{line} ({torch.cuda.device_count()} visible)"


def _print_section(title: str, rows: list[tuple[str, str]]) -> None:
    print(f"\n{title}")
    width = max((len(k) for k, _ in rows), default=0)
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")


def cmd_env(_: argparse.Namespace) -> int:
    import mslk
    from mslk.core import domains

    _print_section(
        "Platform",
        [
            ("python", platform.python_version()),
            ("torch", f"{torch.__version__} (CUDA {torch.version.cuda}, HIP {torch.version.hip})"),
            ("triton", _triton_status()),
            ("GPU", _gpu_status()),
            ("mslk", f"{mslk.__version__} (variant {mslk.__variant__})"),
        ],
    )
    dists = version.installed_distributions()
    _print_section(
        "Installed MSLK distributions",
        list(dists.items()) or [("(none)", "running from source (PYTHONPATH), no package metadata")],
    )
    if dists:
        problems = version.compatibility_problems()
        verdict = "every installed distribution's torch and mslk ranges are met"
    else:
        problems = version.source_compat_problems()
        verdict = f"source checkout: torch {torch.__version__} is within compat.toml's tested range"
    if problems is None:
        rows = [("-", "nothing to check: no installed distributions and no compat.toml")]
    else:
        rows = [("PROBLEM", p) for p in problems] or [("OK", verdict)]
    _print_section("Compatibility", rows)

    domain_rows = []
    for domain, dist in domains.KNOWN_DOMAINS.items():
        if domain in domains.loaded:
            domain_rows.append((domain, f"loaded ({domains.loaded[domain]})"))
        elif domain in domains.failed:
            domain_rows.append((domain, f"FAILED to import: {domains.failed[domain]}"))
        else:
            domain_rows.append((domain, f"not installed (pip install {dist})"))
    _print_section("Domains", domain_rows)
    native = [(name, "loaded" if err is None else f"missing: {err}") for name, err in registry.native_libraries.items()]
    _print_section("Native libraries", native or [("(none)", "no installed domain ships native code")])
    _print_section(
        "MSLK_* variables",
        [(name, f"{value!r} ({'set' if is_set else 'default'})") for name, (value, is_set) in env.effective().items()],
    )
    device_type = "cuda" if arch.has_gpu() else "cpu"
    op_rows = []
    for qualname, op in sorted(registry.OPS.items()):
        usable = ", ".join(b.name for b in op.usable_backends(device_type)) or "none"
        others = [
            f"{b.name}: {b.unavailable_reason or 'needs ' + '/'.join(sorted(b.devices))}"
            for b in op.backends
            if b not in op.usable_backends(device_type)
        ]
        op_rows.append(
            (qualname, f"[{op.domain}] {usable}" + (f"   (not here: {'; '.join(others)})" if others else ""))
        )
    _print_section(f"Ops and the backends usable here ({device_type})", op_rows or [("(none)", "no ops registered")])
    return 0


def cmd_check(_: argparse.Namespace) -> int:
    from tqdm import tqdm

    from mslk.core import testing

    device = torch.device("cuda" if arch.has_gpu() else "cpu")
    ops = [op for _, op in sorted(registry.OPS.items()) if op.samples is not None]
    if not ops:
        print("mslk check: no ops registered: no installed MSLK domain package declares ops yet. Nothing to check.")
        return 0
    results = []
    for op in tqdm(ops, desc=f"mslk check on {device.type}", unit="op", file=sys.stderr):
        try:
            problems = [p for sample in op.samples(device) for p in testing.check_against_reference(op, sample)]
        except Exception as exc:
            problems = [f"{type(exc).__name__}: {exc}"]
        results.append((op.qualname, problems))
    for qualname, problems in results:
        print(f"{'PASS' if not problems else 'FAIL'}  {qualname}")
        for problem in problems:
            print(f"        {problem}")
    failed = sum(1 for _, problems in results if problems)
    print(f"mslk check: {len(results) - failed} passed, {failed} failed")
    return 1 if failed else 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def cmd_bench(args: argparse.Namespace) -> int:
    from mslk.core import bench

    return bench.main(args.op, args.json, args.shape or (), not args.no_baselines, args.rounds or bench.ROUNDS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mslk", description="MSLK: fused GPU kernels for transformer workloads")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("env", help="versions, GPU, installed domains, compatibility, env variables, ops").set_defaults(
        run=cmd_env
    )
    sub.add_parser(
        "check", help="run every registered op once on small random inputs against its reference"
    ).set_defaults(run=cmd_check)
    bench_parser = sub.add_parser("bench", help="run benchmarks on the GPU (side by side with torch baselines)")
    bench_parser.add_argument("--op", help="only the bench specs of this op (or spec name)")
    bench_parser.add_argument(
        "--shape", action="append", help="only the shapes whose text (e.g. 'M=16 N=8192') contains this (repeatable)"
    )
    bench_parser.add_argument("--no-baselines", action="store_true", help="MSLK's rows only (A/B of two trees)")
    bench_parser.add_argument(
        "--rounds", type=_positive_int, help="timings per implementation, in rotating order (median kept; default 3)"
    )
    bench_parser.add_argument("--json", help="also write the results to this JSON file")
    bench_parser.set_defaults(run=cmd_bench)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
