#!/usr/bin/env bash
# Slim install (DESIGN.md §2): build every wheel, install only mslk-core + mslk-gemm in a fresh venv, check
# that the other domains are absent and say which package to install, run mslk-gemm's CPU tests against
# the installed wheels (their one run in CI: ci/cpu.sh leaves them to this), then install and uninstall another
# domain and check that mslk survives. mslk-gemm's wheel carries its native library (CMakeLists.txt); the same
# package built without it must import and say why.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
UV="$ROOT/tools/uv"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

$UV build --all-packages --wheel --out-dir "$WORK/dist" -q
$UV build --package mslk-gemm --wheel --out-dir "$WORK/pure" -q -C cmake.define.MSLK_GEMM_NATIVE=OFF
ls "$WORK/dist" "$WORK/pure"
$UV venv -q "$WORK/venv"
PY="$WORK/venv/bin/python"
install() { $UV pip install -q --python "$PY" "$@"; }
install "$WORK/dist"/mslk_core-*.whl "$WORK/dist"/mslk_gemm-*.whl pytest pytest-timeout hypothesis

# Run from an empty folder so that nothing of the source tree is importable: only the installed wheels.
cd "$WORK"
"$PY" - <<'PY'
import importlib.metadata as md
import mslk, mslk.gemm
from mslk.core import domains, registry

assert "site-packages" in mslk.gemm.__file__, mslk.gemm.__file__
assert domains.loaded == {"gemm": "mslk.gemm"}, domains.loaded
assert domains.failed == {}, domains.failed
assert registry.native_libraries == {"mslk_gemm_cublas": None}, registry.native_libraries
names = {d.metadata["Name"] for d in md.distributions()}
assert not names & {"mslk", "mslk-attention", "mslk-quantize", "mslk-moe", "mslk-conv"}, names
for domain in ("attention", "quantize", "moe", "conv"):
    try:
        __import__(f"mslk.{domain}")
    except ModuleNotFoundError as e:
        assert f"pip install mslk-{domain}" in str(e), e
    else:
        raise AssertionError(f"mslk.{domain} imported in a slim install")
print("slim: mslk-core + mslk-gemm OK; other domains absent with the right message")
PY
"$WORK/venv/bin/mslk" env
"$WORK/venv/bin/mslk" check
"$PY" -m pytest "$ROOT/packages/mslk-gemm/tests" -q -p no:cacheprovider --rootdir "$ROOT" -c "$ROOT/pyproject.toml" -m "not gpu"

install "$WORK/dist"/mslk_quantize-*.whl
"$PY" -c "import mslk; from mslk.core import domains; assert set(domains.loaded) == {'gemm', 'quantize'}, domains.loaded"
$UV pip uninstall -q --python "$PY" mslk-quantize
"$PY" - <<'PY'
import mslk, mslk.gemm
from mslk.core import domains

assert domains.loaded == {"gemm": "mslk.gemm"}, domains.loaded
try:
    import mslk.quantize
except ModuleNotFoundError as e:
    assert "pip install mslk-quantize" in str(e), e
else:
    raise AssertionError("mslk.quantize still imports after its uninstall")
print("slim: install + uninstall of mslk-quantize OK; mslk survives")
PY

# The pure-Python mslk-gemm: imports, reports why its native library is missing, and loads its domain. Its ops'
# conformance on CPU runs the same Python as the wheel above (the native backends are CUDA-only), so not again.
install --reinstall --no-deps "$WORK/pure"/mslk_gemm-*.whl
"$PY" - <<'PY'
import mslk, mslk.gemm
from mslk.core import registry

reason = registry.native_libraries["mslk_gemm_cublas"]
assert reason is not None and "MSLK_GEMM_NATIVE=OFF" in reason, reason
print(f"slim: pure-Python mslk-gemm imports; its native library is missing: {reason}")
PY
"$PY" -m pytest "$ROOT/packages/mslk-gemm/tests/test_native.py" \
    "$ROOT/packages/mslk-gemm/tests/test_conformance.py::test_domain_loaded" -q \
    -p no:cacheprovider --rootdir "$ROOT" -c "$ROOT/pyproject.toml" -m "not gpu"
