#!/usr/bin/env bash
# Tiers T2 + T3 on the GPU machine (DESIGN.md §4). It has torch, triton and pytest but no package registry,
# so the packages run from source: PYTHONPATH over packages/*/src, nothing installed.
# Logs go to $OUT (the device tool's output folder) or ./gpu-results.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHONPATH="$(printf '%s:' "$PWD"/packages/*/src)${PYTHONPATH:-}"
export PYTHONPATH PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/gpu-results}
mkdir -p "$OUT"

# mslk-gemm's native library, built in place (docs/native.md); if it cannot be, `mslk env` and the tests say why.
python3 -m mslk.gemm.native.build 2>&1 | tee "$OUT/native-build.txt" || true
python3 -m mslk.core.cli env 2>&1 | tee "$OUT/env.txt"
python3 -m mslk.core.cli check 2>&1 | tee "$OUT/check.txt"
# Every test, the `gpu`-marked T2 ones included; Triton kernels compile for the GPU (no interpreter).
python3 -m pytest packages tools -q -p no:cacheprovider -rs "$@" 2>&1 | tee "$OUT/pytest.txt"
python3 -m mslk.core.cli bench --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.txt"
