#!/usr/bin/env bash
# One-GPU smoke check of vlmrl's own actor passes: a random-init
# Qwen2.5-VL-3B-shaped model (no download), sharded with FSDP2 as a worker
# shards it; vlmrl's padding-free log-prob pass (compute_log_probs) and one
# policy update (update_policy) on a batch made by build_batch, in bf16.
# Prints tokens/s, MFU (vlmrl.driver.perf's count), peak memory and a
# packed-vs-alone log-prob check. No vLLM engine, no Ray, no network.
#
#   bash scripts/gpu_smoke.sh                  # Qwen2.5-VL-3B shapes on GPU 0
#   bash scripts/gpu_smoke.sh --model 7b       # 7B shapes
#   bash scripts/gpu_smoke.sh --cpu            # tiny shapes on the CPU (CI)
#   bash scripts/gpu_smoke.sh KEY=VALUE ...    # config overrides, e.g. worker.actor.loss_type=gspo
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
