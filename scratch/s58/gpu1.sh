#!/usr/bin/env bash
# Session 58, call 1: the GPU tier on main (not run since session 56), then the conv bench.
cd "$(dirname "$0")/../.."
export PYTHONPATH=$(printf '%s:' $PWD/packages/*/src) PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv,noheader
timeout 420 bash ci/gpu.sh tests > $OUT/tier.txt 2>&1; echo "tier rc=$?"
tail -5 $OUT/tier.txt
grep -E "FAILED|ERROR" $OUT/tier.txt | head -20
timeout 120 python3 -m mslk.core.cli bench --op f8f8bf16_conv --json $OUT/conv.json > $OUT/conv.txt 2>&1; echo "conv rc=$?"
tail -15 $OUT/conv.txt
