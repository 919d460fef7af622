#!/usr/bin/env bash
# One-GPU smoke check: a random-init Qwen2.5-VL-3B-shaped model (no download),
# the actor's padding-free log-prob pass and an update micro-step in bf16;
# prints tokens/s, MFU, peak memory and a packed-vs-unpacked log-prob check.
# Needs torch and transformers only (no vLLM, no Ray, no network).
#
#   bash scripts/gpu_smoke.sh                  # Qwen2.5-VL-3B shapes on GPU 0
#   bash scripts/gpu_smoke.sh --model 7b       # 7B shapes
#   bash scripts/gpu_smoke.sh --cpu            # tiny shapes on the CPU (CI)
#   bash scripts/gpu_smoke.sh --help           # all options
#
# Exit status: 0 ok, 1 a check failed, 2 no GPU visible (without --cpu).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
if [[ " $* " != *" --cpu "* ]] && command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
exec "$PYTHON" -m benchmarks.gpu_smoke "$@"
