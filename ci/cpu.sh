#!/usr/bin/env bash
# CI tiers T0 + T1 (DESIGN.md §4): lint, consistency checks, and every package's CPU tests, with the
# Triton kernels under TRITON_INTERPRET=1 (conftest.py sets it when there is no GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
UV=tools/uv

$UV sync --locked
$UV run --locked ruff check .
$UV run --locked ruff format --check .
$UV run --locked python tools/compat.py check
$UV run --locked mslk env
$UV run --locked mslk check
$UV run --locked pytest packages tools -m "not gpu" -q
