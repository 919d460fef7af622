#!/usr/bin/env bash
# GRPO on Qwen2.5-VL-7B-Instruct with geometry3k, one node of 8 GPUs: exactly
# examples/config.yaml. Extra key=value arguments are passed on, for example
#   bash examples/qwen2_5_vl_7b_geo3k_grpo.sh trainer.max_steps=20 trainer.logger=[console,wandb]
#   MODEL_PATH=/models/Qwen2.5-VL-7B-Instruct bash examples/qwen2_5_vl_7b_geo3k_grpo.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1

MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-VL-7B-Instruct}  # a Hub id, or a local directory

exec "${PYTHON:-python3}" -m vlmrl.main \
    config=examples/config.yaml \
    data.train_files=hiyouga/geometry3k@train \
    data.val_files=hiyouga/geometry3k@test \
    worker.actor.model.model_path="${MODEL_PATH}" \
    trainer.experiment_name=qwen2_5_vl_7b_geo3k_grpo \
    trainer.n_gpus_per_node=8 \
    "$@"
