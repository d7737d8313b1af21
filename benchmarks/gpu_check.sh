#!/usr/bin/env bash
# The GPU check, in two parts (~5-8 minutes on one H100/H200):
#  1. benchmarks/gpu_check.py: sampling and GRPO updates with a Qwen2.5-0.5B-shaped random-init policy in bf16
#     (needs only torch and transformers): generation and training tokens/s, the measured peak memory and the
#     preflight's estimate of it, as one JSON line.
#  2. where the project's environment is installed (.venv, `make install`): the real pipeline on the device in a
#     scratch clone: `scalinginter check` on this machine, then the BabyAI smoke curriculum in bf16 as a Prefect
#     flow (three phases, each resuming from the last one's checkpoint, the evaluation and the report), then
#     each phase's peak device memory and tokens/s from its dvclive metrics. Skipped, saying so, without .venv.
# DEVICE (default cuda), STEPS (default 4) and PYTHON may be set; extra arguments go to gpu_check.py.
set -euo pipefail
cd "$(dirname "$0")/.."
DEVICE="${DEVICE:-cuda}"
PY="${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python)}"  # the project's, else the image's
"$PY" benchmarks/gpu_check.py --device "$DEVICE" --steps "${STEPS:-4}" "$@"
if [ ! -x .venv/bin/scalinginter ]; then
  echo '{"flow": "skipped: no .venv here (run make install first)"}'
  exit 0
fi
root=$PWD
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
git clone -q "$root" "$work/repo"
cd "$work/repo"
ln -s "$root/.venv" .venv
[ -d "$root/.venv-vllm" ] && ln -s "$root/.venv-vllm" .venv-vllm
.venv/bin/python - <<'PY'
import yaml
params = yaml.safe_load(open("params.yaml"))
params["train"]["smoke"]["precision"] = "bf16"
yaml.safe_dump(params, open("params.yaml", "w"), sort_keys=False)
PY
export SCALINGINTER_DEVICE="$DEVICE" PREFECT_SERVER_ANALYTICS_ENABLED=false
.venv/bin/scalinginter check babyai --profile smoke
started=$(date +%s)
.venv/bin/scalinginter run --env babyai --profile smoke --record none
.venv/bin/python - "$(( $(date +%s) - started ))" <<'PY'
import json, sys
from pathlib import Path
phases = {}
for metrics in sorted(Path("runs/babyai").glob("phase-*/dvclive/metrics.json")):
    data = json.loads(metrics.read_text())
    perf = data.get("perf", {})
    phases[metrics.parts[-3]] = {"peak_memory_gib": perf.get("peak_memory_gib"), "tokens_per_s": perf.get("tokens_per_s")}
evaluation = json.loads(Path("runs/babyai/eval/metrics.json").read_text())
print(json.dumps({"flow": "babyai smoke, bf16", "flow_s": int(sys.argv[1]), "phases": phases,
                  "report": Path("reports/babyai.html").exists(),
                  "eval_success": {name: c.get("success") for name, c in evaluation["checkpoints"].items()}}))
PY
