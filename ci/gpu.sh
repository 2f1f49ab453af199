#!/usr/bin/env bash
# Tiers T2 + T3 on the GPU machine (DESIGN.md §4): `bash ci/gpu.sh [all | tests [PYTEST ARGS] | bench [BENCH ARGS]]`
# (`all`, the default: both, as they are). That machine has torch, triton and pytest but no package registry, so
# the packages run from source: PYTHONPATH over packages/*/src, nothing installed. Logs go to $OUT (the device
# tool's output folder) or ./gpu-results.
set -euo pipefail
stage=${1:-all}
shift $(($# > 0))
if [[ ! $stage =~ ^(all|tests|bench)$ || ($stage == all && $# -gt 0) ]]; then
    echo "usage: bash ci/gpu.sh [all | tests [PYTEST ARGS] | bench [BENCH ARGS]]" >&2
    exit 2
fi
cd "$(dirname "$0")/.."
PYTHONPATH="$(printf '%s:' "$PWD"/packages/*/src)${PYTHONPATH:-}"
export PYTHONPATH PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/gpu-results}
mkdir -p "$OUT"

run_pytest() { # LOG PYTEST-ARGS...: the GPU tests, logged to $OUT/LOG; exit code 5 (no test selected) passes
    local log=$1
    shift
    python3 -m pytest packages -q -p no:cacheprovider -rfEs "$@" 2>&1 | tee "$OUT/$log" || (($? == 5))
}

if [[ $stage != bench ]]; then
    # mslk-gemm's native library, built in place (docs/native.md); if it cannot be, `mslk env` and the tests say why.
    python3 -m mslk.gemm.native.build 2>&1 | tee "$OUT/native-build.txt" || true
    python3 -m mslk.core.cli env 2>&1 | tee "$OUT/env.txt"
    python3 -m mslk.core.cli check 2>&1 | tee "$OUT/check.txt"
    # The `gpu`-marked tests (the CPU tiers are CI's), Triton kernels compiled for the GPU. Their time is mostly
    # compilation, so with pytest-xdist they run one worker a CPU core: all of them in about 3.5 minutes on the
    # H200 machine's 16 cores, against about 18 one after another (1.2 s a test). At most a worker for 6 GiB of
    # the GPU's memory: each keeps what its tests' tensors took cached, and 16 of them ran an 80 GB H100 out of
    # memory (13 fit).
    workers=()
    if python3 -c "import xdist" 2>/dev/null; then
        gib=$(python3 -c "import torch; print(torch.cuda.get_device_properties(0).total_memory >> 30)")
        workers=(-n "$(( $(nproc) < gib / 6 ? $(nproc) : gib / 6 ))")
    fi
    failed=0
    run_pytest pytest.txt -m "gpu and not big_memory" "${workers[@]}" "$@" || failed=1
    # Tests holding several GiB each run one at a time after the others: beside 16 workers they overflow an 80 GB
    # H100.
    run_pytest pytest-big-memory.txt -m "gpu and big_memory" "$@" || failed=1
    ((failed == 0)) || exit 1
fi
if [[ $stage != tests ]]; then
    python3 -m mslk.core.cli bench --json "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.txt"
fi
