#!/usr/bin/env bash
# The README's test command: everything CI runs (CPU tiers, then the slim-install check).
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/cpu.sh
bash ci/slim.sh
