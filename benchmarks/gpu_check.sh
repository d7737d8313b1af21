#!/usr/bin/env bash
# The GPU check (see benchmarks/gpu_check.py): one command, ~2-4 minutes on one H200 with only torch and
# transformers installed. Prints one JSON line with generation and training tokens/s and peak memory.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python benchmarks/gpu_check.py --steps "${STEPS:-4}" "$@"
