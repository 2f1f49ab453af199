import os
import subprocess
import sys
from pathlib import Path

import pytest

import mslk
from mslk.core import domains

REPO = Path(__file__).resolve().parents[3]


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)


def test_every_known_domain_is_loaded_in_the_workspace():
    assert domains.loaded == {d: f"mslk.{d}" for d in domains.KNOWN_DOMAINS}
    assert domains.failed == {}


def test_reference_attributes():
    assert mslk.open_source is True
    assert mslk.__version__ == "1.3.0"
    assert isinstance(mslk.__variant__, str) and isinstance(mslk.__target__, str)


@pytest.mark.parametrize(("value", "python_only"), [("1", "True"), ("0", "False")])
def test_python_only_attribute(value, python_only):
    """mslk._python_only, as the reference library's: True where MSLK_PYTHON_ONLY=1 keeps native libraries out."""
    code = "import mslk; print(mslk._python_only)"
    env = {**os.environ, "MSLK_PYTHON_ONLY": value}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 0 and done.stdout.strip() == python_only, done.stderr[-2000:]


def test_missing_domain_import_names_the_package():
    # Hide mslk-conv's source folder from this interpreter: `import mslk` must survive and `mslk.conv` must say
    # which package to install.
    code = (
        "import sys, warnings\n"
        "sys.path = [p for p in sys.path if 'mslk-conv' not in p]\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import mslk\n"
        "from mslk.core import domains\n"
        "print(sorted(domains.loaded))\n"
        "try:\n"
        "    import mslk.conv\n"
        "except ModuleNotFoundError as e:\n"
        "    print('IMPORT:', e)\n"
        "try:\n"
        "    mslk.conv\n"
        "except AttributeError as e:\n"
        "    print('ATTR:', e)\n"
        "print('HASATTR:', hasattr(mslk, 'conv'))\n"
    )
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "['attention', 'gemm', 'moe', 'quantize']"
    message = "mslk.conv is not installed: it ships in the `mslk-conv` package. Install it with `pip install mslk-conv`"
    assert lines[1].startswith(f"IMPORT: {message}")
    assert lines[2].startswith(f"ATTR: {message}")
    assert lines[3] == "HASATTR: False"


def test_a_broken_domain_is_recorded_not_fatal(monkeypatch):
    monkeypatch.setattr(domains, "declared", lambda: {"broken": "mslk_selftest_no_such_module.broken"})
    monkeypatch.setattr(domains, "failed", {})
    with pytest.warns(UserWarning, match="MSLK domain 'broken'"):
        domains.load_installed()
    assert "ModuleNotFoundError" in domains.failed["broken"]


def test_unknown_attribute():
    with pytest.raises(AttributeError, match="has no attribute 'nonexistent'"):
        mslk.nonexistent  # noqa: B018


def test_source_checkout_without_metadata_finds_domains():
    # The GPU machine runs from source with PYTHONPATH over packages/*/src and no installed metadata.
    src = [str(p) for p in sorted((REPO / "packages").glob("*/src"))]
    code = (
        "import sys, importlib.metadata as md\n"
        "every = md.entry_points\n"
        "md.entry_points = lambda **kw: md.EntryPoints([]) if kw.get('group') == 'mslk.domains' else every(**kw)\n"
        f"sys.path[:0] = {src!r}\n"
        "import mslk\n"
        "from mslk.core import domains\n"
        "print(sorted(domains.loaded), mslk.__version__)\n"
    )
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["['attention',", "'conv',", "'gemm',", "'moe',", "'quantize']", "1.3.0"]


def test_only_core_ships_the_mslk_root():
    for package in (REPO / "packages").iterdir():
        if package.name in ("mslk-core", "mslk") or not package.is_dir():
            continue
        assert not (package / "src" / "mslk" / "__init__.py").exists(), f"{package.name} would shadow mslk-core"
        domain = package.name.removeprefix("mslk-")
        assert (package / "src" / "mslk" / domain / "__init__.py").is_file()
        assert f'{domain} = "mslk.{domain}"' in (package / "pyproject.toml").read_text()
    assert not (REPO / "packages" / "mslk" / "src").exists(), "the meta-package ships no code"
