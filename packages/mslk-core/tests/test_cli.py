import pytest
import torch

from mslk.core import bench, cli, registry, version

# The GPU machine runs from source (PYTHONPATH), where no distribution metadata exists.
needs_metadata = pytest.mark.skipif(not version.installed_distributions(), reason="MSLK is not installed (source run)")


def test_env_prints_every_section(capsys):
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    for section in (
        "Platform",
        "Installed MSLK distributions",
        "Compatibility",
        "Domains",
        "Native libraries",
        "MSLK_* variables",
        "Ops and the backends usable here",
    ):
        assert f"\n{section}" in out
    assert "MSLK_BACKEND" in out and "GPU" in out


@needs_metadata
def test_env_compatibility_verdict(capsys):
    cli.main(["env"])
    out = capsys.readouterr().out
    assert "mslk-gemm       1.3.0" in out
    assert "OK  every installed distribution's torch and mslk ranges are met" in out


def test_env_lists_ops_and_native_status(fresh_ops, capsys, monkeypatch):
    op = fresh_ops()
    monkeypatch.setattr(registry, "native_libraries", {"mslk_gemm_native": "libcublasLt.so.13 not found"})
    cli.main(["env"])
    out = capsys.readouterr().out
    assert "mslk_gemm_native  missing: libcublasLt.so.13 not found" in out
    line = next(line for line in out.splitlines() if op.qualname in line)
    if not torch.cuda.is_available():
        assert "[selftest] reference" in line and "triton: needs cuda" in line


def test_check_without_ops_says_so(capsys, monkeypatch):
    monkeypatch.setattr(registry, "OPS", {})
    assert cli.main(["check"]) == 0
    assert "no ops registered" in capsys.readouterr().out


def test_check_passes_good_ops_and_fails_bad_ones(fresh_ops, capsys, monkeypatch):
    monkeypatch.setattr(registry, "OPS", {})
    good = fresh_ops()
    wrong = fresh_ops(reference=lambda x, scale: (x.float() * 2 * scale[:, None]).to(x.dtype))
    # `wrong`'s reference is its CPU kernel, so make its kernel disagree: pin a backend that doubles again.
    wrong.backend("doubled", devices=("cpu", "cuda"))(lambda x, scale: (x.float() * 4 * scale[:, None]).to(x.dtype))
    wrong.backends.insert(0, wrong.backends.pop(wrong.backends.index(wrong.get_backend("doubled"))))
    assert cli.main(["check"]) == 1
    out = capsys.readouterr().out
    assert f"PASS  {good.qualname}" in out
    assert f"FAIL  {wrong.qualname}" in out and "relative error" in out
    assert "mslk check: 1 passed, 1 failed" in out


def test_bench_without_gpu(capsys, monkeypatch):
    monkeypatch.setattr(bench.arch, "has_gpu", lambda: False)
    assert cli.main(["bench", "--op", "anything"]) == 0
    assert "no GPU here" in capsys.readouterr().out


@needs_metadata
def test_console_script_entry_point():
    import importlib.metadata

    (script,) = [ep for ep in importlib.metadata.entry_points(group="console_scripts") if ep.name == "mslk"]
    assert script.value == "mslk.core.cli:main"


def test_usage_error():
    with pytest.raises(SystemExit):
        cli.main(["frobnicate"])


@needs_metadata
def test_compatibility_verdict_catches_a_wrong_pin(monkeypatch):
    installed = dict(version.installed_distributions(), **{"mslk-core": "1.4.0"})
    monkeypatch.setattr(version, "installed_distributions", lambda: installed)
    problems = version.compatibility_problems()
    assert "mslk-gemm needs mslk-core<1.4,>=1.3, found mslk-core 1.4.0" in problems
    assert len(problems) == 6  # the five domains and the meta-package all pin mslk-core


def test_source_checkout_verdict_reads_compat_toml(monkeypatch):
    assert version.source_compat_problems() == []  # this checkout's torch is in range
    monkeypatch.setattr(version, "package_version", lambda dist: "2.10.0" if dist == "torch" else None)
    assert version.source_compat_problems() == ["torch 2.10.0 is outside compat.toml's tested range >=2.11,<2.14"]
