#!/usr/bin/env bash
# CI tiers T0 + T1 (DESIGN.md §4): lint, consistency checks, and every package's CPU tests (mslk-gemm's in
# ci/slim.sh), with the Triton kernels under TRITON_INTERPRET=1 (conftest.py sets it when there is no GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
UV=tools/uv

$UV sync --locked
$UV run --locked ruff check .
$UV run --locked ruff format --check .
$UV run --locked python tools/compat.py check
$UV run --locked mslk env
$UV run --locked mslk check
# mslk-gemm's tests run in ci/slim.sh, against its installed wheel; here only the one that needs another domain.
# Two workers (pytest-xdist), one a core of the CI machine: 11 min against 19-20 on a slow day (fiftieth session).
$UV run --locked pytest packages tools -m "not gpu" -q -n 2 --ignore=packages/mslk-gemm/tests \
    packages/mslk-gemm/tests/test_int4_gemm.py::test_layouts_match_mslk_quantize
