"""mslk.core.bench without a GPU: `measure` and `arch.has_gpu` are faked; the math and bookkeeping are real.

The fake `measure` calls the timed function once and takes its return value as the milliseconds, so each
test's implementations say how fast they "are".
"""

from __future__ import annotations

import datetime
import json
import types
from dataclasses import asdict

import pytest
import torch
import triton

from mslk.core import arch, bench, registry


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch):
    monkeypatch.setattr(bench, "SPECS", {})


@pytest.fixture
def timings(monkeypatch):
    """Replace `measure`: ms = fn(); records the cuda_graph flag of every call."""
    calls = []

    def fake_measure(fn, cuda_graph=False):
        calls.append(cuda_graph)
        return fn()

    monkeypatch.setattr(bench, "measure", fake_measure)
    return calls


@pytest.fixture
def gpu(monkeypatch):
    monkeypatch.setattr(arch, "has_gpu", lambda: True)
    monkeypatch.setattr(arch, "device_info", lambda device=None: types.SimpleNamespace(name="Fake GPU 9000"))


def make_spec(name, run=lambda inputs: 1.0, **kwargs):
    kwargs.setdefault("op", f"mslk::{name}_op")
    kwargs.setdefault("shapes", [{"M": 4}])
    kwargs.setdefault("make_inputs", lambda shape, device: dict(shape))
    return bench.BenchSpec(name=name, run=run, **kwargs)


def test_tflops_and_gbps(timings):
    shape = {"M": 1024, "N": 2048, "K": 512}
    spec = make_spec(
        "rates",
        shapes=[shape],
        run=lambda inputs: 1.0,
        baselines={"torch.mm": lambda inputs: 0.5},
        flops=lambda s: 2 * s["M"] * s["N"] * s["K"],
        bytes=lambda s: 2 * (s["M"] * s["K"] + s["N"] * s["K"] + s["M"] * s["N"]),
    )
    mslk_row, base_row = bench.run([spec], device="cpu")
    flops = 2 * 1024 * 2048 * 512
    nbytes = 2 * (1024 * 512 + 2048 * 512 + 1024 * 2048)
    assert mslk_row.ms == 1.0
    assert mslk_row.tflops == pytest.approx(flops / 1e-3 / 1e12)
    assert mslk_row.gbps == pytest.approx(nbytes / 1e-3 / 1e9)
    # Half the time, twice the rate.
    assert base_row.tflops == pytest.approx(2 * flops / 1e-3 / 1e12)
    assert base_row.gbps == pytest.approx(2 * nbytes / 1e-3 / 1e9)


def test_rates_are_none_without_formulas(timings):
    (row,) = bench.run([make_spec("no_rates")], device="cpu")
    assert row.ms == 1.0
    assert row.tflops is None and row.gbps is None
    assert row.baseline is None and row.baseline_ms is None and row.ratio is None


def test_ratio_is_baseline_over_mslk_against_the_first_baseline(timings):
    spec = make_spec(
        "ratio",
        run=lambda inputs: 2.0,
        baselines={"first": lambda inputs: 3.0, "second": lambda inputs: 1.0},
    )
    rows = bench.run([spec], device="cpu")
    assert [r.impl for r in rows] == ["mslk", "first", "second"]
    mslk_row = rows[0]
    assert mslk_row.baseline == "first"
    assert mslk_row.baseline_ms == 3.0
    assert mslk_row.ratio == pytest.approx(1.5)  # MSLK faster: ratio > 1
    assert all(r.ratio is None and r.baseline is None for r in rows[1:])


def test_every_impl_gets_the_same_inputs_built_once_per_shape(timings):
    built, seen = [], []

    def make_inputs(shape, device):
        inputs = object()
        built.append((shape["M"], device))
        return inputs

    def record(inputs):
        seen.append(inputs)
        return 1.0

    spec = make_spec(
        "same_inputs",
        shapes=[{"M": 1}, {"M": 2}],
        make_inputs=make_inputs,
        run=record,
        baselines={"a": record, "b": record},
    )
    bench.run([spec], device="cpu")
    assert built == [(1, torch.device("cpu")), (2, torch.device("cpu"))]
    assert len(seen) == 2 * 3 * bench.ROUNDS
    first, second = seen[: 3 * bench.ROUNDS], seen[3 * bench.ROUNDS :]
    assert all(inputs is first[0] for inputs in first)
    assert all(inputs is second[0] for inputs in second)
    assert first[0] is not second[0]


def test_rounds_rotate_the_order_and_report_median_and_spread(timings):
    order, times = [], {"mslk": [3.0, 1.0, 2.0], "a": [5.0, 4.0, 4.0], "b": [1.0, 1.0, 1.0]}

    def impl(name):
        def timed(inputs):
            order.append(name)
            return times[name][sum(1 for done in order if done == name) - 1]

        return timed

    spec = make_spec("rounds", run=impl("mslk"), baselines={"a": impl("a"), "b": impl("b")})
    mslk_row, a_row, b_row = bench.run([spec], device="cpu", rounds=3)
    # Each implementation takes each place once: no one is always first.
    assert order == ["mslk", "a", "b", "a", "b", "mslk", "b", "mslk", "a"]
    assert (mslk_row.ms, a_row.ms, b_row.ms) == (2.0, 4.0, 1.0)
    assert mslk_row.spread == pytest.approx(1.0) and a_row.spread == pytest.approx(0.25) and b_row.spread == 0.0
    assert mslk_row.ratio == pytest.approx(2.0)
    (once,) = bench.run([make_spec("once")], device="cpu", rounds=1)
    assert once.ms == 1.0 and once.spread == 0.0


def test_an_implementation_that_fails_sits_out_the_later_rounds(timings):
    calls = []

    def flaky(inputs):
        calls.append("flaky")
        if len(calls) == 2:
            raise RuntimeError("second call fails")
        return 1.0

    mslk_row, base_row = bench.run([make_spec("flaky", run=flaky, baselines={"b": lambda i: 2.0})], "cpu", rounds=4)
    assert calls == ["flaky", "flaky"]
    assert mslk_row.error == "RuntimeError: second call fails" and mslk_row.ms is None and mslk_row.ratio is None
    assert base_row.ms == 2.0 and base_row.error is None


def test_cuda_graph_flag_reaches_measure(timings):
    bench.run([make_spec("graphed", cuda_graph=True, baselines={"b": lambda i: 1.0}), make_spec("plain")], "cpu")
    assert timings == [True, True] * bench.ROUNDS + [False] * bench.ROUNDS


def test_errors_become_rows_and_the_run_goes_on(timings):
    def mslk_run(inputs):
        if inputs["M"] == 1:
            raise registry.NotSupportedError("No operator found for `mslk::x`\n  M=1 is too small")
        return 2.0

    def bad_inputs(shape, device):
        raise RuntimeError("out of memory")

    specs = [
        make_spec("partly_supported", shapes=[{"M": 1}, {"M": 2}], run=mslk_run, baselines={"b": lambda i: 4.0}),
        make_spec("no_inputs", make_inputs=bad_inputs),
        make_spec("fine"),
    ]
    rows = bench.run(specs, device="cpu")
    assert [(r.spec, r.shape["M"], r.impl) for r in rows] == [
        ("partly_supported", 1, "mslk"),
        ("partly_supported", 1, "b"),
        ("partly_supported", 2, "mslk"),
        ("partly_supported", 2, "b"),
        ("no_inputs", 4, "mslk"),
        ("fine", 4, "mslk"),
    ]
    failed, baseline_of_failed, ok, _, no_inputs, fine = rows
    assert failed.error.startswith("NotSupportedError: No operator found")
    assert failed.ms is None and failed.ratio is None
    assert failed.baseline == "b" and failed.baseline_ms == 4.0  # the baseline still ran
    assert baseline_of_failed.error is None and baseline_of_failed.ms == 4.0
    assert ok.error is None and ok.ratio == pytest.approx(2.0)
    assert no_inputs.error == "make_inputs: RuntimeError: out of memory"
    assert fine.error is None and fine.ms == 1.0


def test_filter_by_qualname_bare_name_or_spec_name():
    a = bench.register(make_spec("f8f8bf16_rowwise_decode", op="mslk::f8f8bf16_rowwise"))
    b = bench.register(make_spec("quantize_row", op="mslk::quantize_fp8_row"))
    assert bench.specs(None) == [a, b]
    assert bench.specs("mslk::f8f8bf16_rowwise") == [a]
    assert bench.specs("f8f8bf16_rowwise") == [a]
    assert bench.specs("f8f8bf16_rowwise_decode") == [a]
    assert bench.specs("quantize_row") == [b]
    assert bench.specs("quantize_fp8") == []  # no prefix matching
    assert bench.specs("other::f8f8bf16_rowwise") == []


def test_duplicate_name_is_an_error():
    bench.register(make_spec("twice"))
    with pytest.raises(ValueError, match="twice"):
        bench.register(make_spec("twice", op="mslk::another"))
    assert list(bench.SPECS) == ["twice"]


def test_register_takes_the_domain_from_the_op(monkeypatch):
    monkeypatch.setattr(registry, "OPS", {"mslk::gemm_op": types.SimpleNamespace(domain="gemm")})
    assert bench.register(make_spec("from_op", op="mslk::gemm_op")).domain == "gemm"
    assert bench.register(make_spec("explicit", op="mslk::gemm_op", domain="mine")).domain == "mine"
    assert bench.SPECS["from_op"].domain == "gemm"


def test_measure_warms_up_then_takes_the_median(monkeypatch):
    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: events.append("sync"))

    def fake_bench(kind):
        def do_bench(fn, return_mode):
            events.append((kind, return_mode))
            return 0.25

        return do_bench

    monkeypatch.setattr(triton.testing, "do_bench", fake_bench("do_bench"))
    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", fake_bench("cudagraph"))
    assert bench.measure(lambda: events.append("call")) == 0.25
    assert bench.measure(lambda: events.append("call"), cuda_graph=True) == 0.25
    assert events == ["call", "sync", ("do_bench", "median"), "call", "sync", ("cudagraph", "median")]


def test_format_table():
    rows = [
        bench.Row(
            "f8f8bf16_rowwise",
            {"M": 8192, "N": 8192, "K": 8192},
            "mslk",
            ms=0.8765432,
            tflops=1254.3,
            gbps=230.04,
            baseline="torch._scaled_mm",
            baseline_ms=0.92,
            ratio=0.92 / 0.8765432,
            spread=0.0123,
        ),
        bench.Row(
            "f8f8bf16_rowwise",
            {"M": 8192, "N": 8192, "K": 8192},
            "torch._scaled_mm",
            ms=0.92,
            tflops=1195.1,
            gbps=219.2,
        ),
        bench.Row("f8f8bf16_rowwise", {"M": 1, "N": 8, "K": 8}, "mslk", error="NotSupportedError: no\ndetails"),
    ]
    lines = bench.format_table(rows).splitlines()
    assert lines[0].split() == ["bench", "shape", "impl", "ms", "spread", "TFLOP/s", "GB/s", "vs", "baseline", "error"]
    assert set(lines[1]) == {"-", " "}
    assert len(lines) == 5  # header, rule, one line per row: the error's details stay out
    first = lines[2]
    assert "M=8192 N=8192 K=8192" in first
    assert "0.8765 " in first and "1.2%" in first and "1254.3" in first and "230.0" in first and "1.05x" in first
    assert "1.05x" not in lines[3] and "0.92" in lines[3]
    assert lines[4].endswith("NotSupportedError: no")
    # Fixed width: every column starts at the same offset on every line.
    impl_column = lines[0].index("impl")
    assert lines[2][impl_column:].startswith("mslk")
    assert lines[3][impl_column:].startswith("torch._scaled_mm")
    assert lines[2].index("0.8765") + len("0.8765") == lines[3].index("0.92") + len("0.92")  # right-aligned


def test_write_json(tmp_path, gpu):
    rows = [
        bench.Row("j", {"M": 2}, "mslk", ms=1.5, tflops=3.0, baseline="b", baseline_ms=3.0, ratio=2.0),
        bench.Row("j", {"M": 2}, "b", ms=3.0, tflops=1.5),
    ]
    path = tmp_path / "bench.json"
    before = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    bench.write_json(rows, str(path))
    data = json.loads(path.read_text())
    assert set(data) == {"date", "gpu", "torch", "triton", "cuda", "hip", "rows"}
    assert data["gpu"] == "Fake GPU 9000"
    assert data["torch"] == torch.__version__
    assert data["triton"] == triton.__version__
    assert data["cuda"] == torch.version.cuda
    date = datetime.datetime.fromisoformat(data["date"])
    assert date.utcoffset() == datetime.timedelta(0)
    assert before <= date <= datetime.datetime.now(datetime.timezone.utc)
    assert data["rows"] == [asdict(r) for r in rows]


def test_main_without_gpu(monkeypatch, capsys):
    monkeypatch.setattr(arch, "has_gpu", lambda: False)
    monkeypatch.setattr(bench, "run", lambda *a, **k: pytest.fail("nothing runs without a GPU"))
    bench.register(make_spec("needs_gpu"))
    assert bench.main(None, None) == 0
    assert capsys.readouterr().out.strip() == (
        "mslk bench: no GPU here (torch.cuda.is_available() is False); benchmarks run on a CUDA or ROCm device"
    )


def test_main_without_specs(gpu, capsys):
    assert bench.main(None, None) == 0
    assert "no bench specs are registered: install a domain package (pip install mslk-gemm" in (capsys.readouterr().out)
    assert bench.main("anything", None) == 2
    assert "no bench specs are registered" in capsys.readouterr().err


def test_main_no_match_lists_specs(gpu, capsys):
    bench.register(make_spec("listed_a", op="mslk::op_a", domain="gemm"))
    bench.register(make_spec("listed_b", op="mslk::op_b"))
    assert bench.main("nope", None) == 2
    err = capsys.readouterr().err
    assert "'nope'" in err
    assert "listed_a  (mslk::op_a, gemm)" in err
    assert "listed_b  (mslk::op_b)" in err


def test_main_runs_prints_and_writes_json(gpu, timings, capsys, tmp_path):
    bench.register(make_spec("main_ok", op="mslk::main_op", baselines={"torch": lambda i: 2.0}))
    bench.register(make_spec("main_other"))
    path = tmp_path / "out.json"
    assert bench.main("main_op", str(path)) == 0
    out = capsys.readouterr().out
    assert "Fake GPU 9000" in out and f"torch {torch.__version__}" in out
    assert "main_ok" in out and "2.00x" in out
    assert "main_other" not in out
    data = json.loads(path.read_text())
    assert [(r["spec"], r["impl"], r["ms"]) for r in data["rows"]] == [
        ("main_ok", "mslk", 1.0),
        ("main_ok", "torch", 2.0),
    ]


def test_main_refuses_what_it_cannot_do_before_running(gpu, timings, capsys, tmp_path):
    """A --json path it cannot write, or a --shape no shape matches: exit 2 and why, nothing run (the path failed
    with a traceback after the whole run; the shape gave an empty table and exit 0)."""
    ran = []
    bench.register(make_spec("main_guarded", run=lambda i: ran.append(1)))
    assert bench.main("main_guarded", str(tmp_path / "missing" / "out.json")) == 2
    assert bench.main("main_guarded", str(tmp_path)) == 2
    assert "cannot write --json" in capsys.readouterr().err and not ran
    assert bench.main("main_guarded", None, shape_filter=["M=12345"]) == 2
    assert "no shape of main_guarded matches --shape ['M=12345']" in capsys.readouterr().err


def test_main_exit_code_1_on_an_error_row(gpu, timings, capsys):
    bench.register(make_spec("main_fails", run=lambda i: 1 / 0))
    bench.register(make_spec("main_fine"))
    assert bench.main(None, None) == 1
    out = capsys.readouterr().out
    assert "ZeroDivisionError" in out and "main_fine" in out


def test_shape_filter_and_no_baselines(timings):
    """`--shape` keeps the shapes whose text contains one of its parts; `--no-baselines` leaves MSLK's rows alone
    (A/B runs of two source trees)."""
    shapes = [{"M": 16, "K": 64}, {"M": 16, "K": 128}, {"M": 4096, "K": 64}]
    spec = make_spec("filtered", shapes=shapes, baselines={"b": lambda i: 2.0})
    rows = bench.run([spec], "cpu", shape_filter=["M=16 K=128", "M=4096"])
    assert [(r.shape, r.impl) for r in rows] == [(s, impl) for s in shapes[1:] for impl in ("mslk", "b")]
    rows = bench.run([spec], "cpu", baselines=False)
    assert [r.impl for r in rows] == ["mslk"] * 3 and all(r.ratio is None for r in rows)


def test_cli_passes_shape_no_baselines_and_rounds(monkeypatch):
    from mslk.core import cli

    seen = []
    monkeypatch.setattr(bench, "main", lambda *args: seen.append(args) or 0)
    assert cli.main(["bench", "--op", "x", "--shape", "K=64", "--shape", "M=1 ", "--no-baselines"]) == 0
    assert cli.main(["bench", "--rounds", "5"]) == 0
    assert seen == [("x", None, ["K=64", "M=1 "], False, bench.ROUNDS), (None, None, (), True, 5)]
    with pytest.raises(SystemExit):
        cli.main(["bench", "--rounds", "0"])


@pytest.mark.gpu
def test_runner_on_the_gpu(monkeypatch):
    """T3 smoke: the real runner times a device copy (1 GiB read + 1 GiB written) against torch.clone."""
    monkeypatch.setattr(bench, "SPECS", {})
    n = 1 << 28  # fp32 elements: 1 GiB, far beyond L2
    spec = bench.register(
        bench.BenchSpec(
            name="selftest_copy",
            op="mslk_selftest::copy",
            shapes=[{"N": n}],
            make_inputs=lambda s, d: (torch.randn(s["N"], device=d), torch.empty(s["N"], device=d)),
            run=lambda a: a[1].copy_(a[0]),
            baselines={"torch.clone": lambda a: a[0].clone()},
            bytes=lambda s: 8 * s["N"],
        )
    )
    rows = bench.run([spec])
    assert [r.impl for r in rows] == ["mslk", "torch.clone"] and all(r.error is None for r in rows)
    assert all(r.ms > 0 and r.gbps > 0 for r in rows)
    assert rows[0].ratio == pytest.approx(rows[1].ms / rows[0].ms)
    assert "selftest_copy" in bench.format_table(rows)
