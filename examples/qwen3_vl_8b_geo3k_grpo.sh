#!/usr/bin/env bash
# GRPO on Qwen3-VL-8B-Instruct with geometry3k, one node of 8 GPUs.
# Qwen3-VL spends one image token per 32 x 32 px (Qwen2.5-VL: 28 x 28), so the
# config's pixel bounds give it 256 .. 4096 tokens per image (Qwen2.5-VL: 334 .. 5350).
# Not yet run on a GPU with vlmrl; the CPU tests cover Qwen2.5-VL only.
# Extra key=value arguments are passed on (see qwen2_5_vl_7b_geo3k_grpo.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1

MODEL_PATH=${MODEL_PATH:-Qwen/Qwen3-VL-8B-Instruct}  # a Hub id, or a local directory

exec "${PYTHON:-python3}" -m vlmrl.main \
    config=examples/config.yaml \
    data.train_files=hiyouga/geometry3k@train \
    data.val_files=hiyouga/geometry3k@test \
    worker.actor.model.model_path="${MODEL_PATH}" \
    trainer.experiment_name=qwen3_vl_8b_geo3k_grpo \
    trainer.n_gpus_per_node=8 \
    "$@"
