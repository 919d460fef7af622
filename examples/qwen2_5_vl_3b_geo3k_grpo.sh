#!/usr/bin/env bash
# GRPO on Qwen2.5-VL-3B-Instruct with geometry3k, on 4 GPUs of one node.
# Per GPU: 160 responses per update in micro-batches of 8.
# Extra key=value arguments are passed on (see qwen2_5_vl_7b_geo3k_grpo.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1

MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-VL-3B-Instruct}  # a Hub id, or a local directory

exec "${PYTHON:-python3}" -m vlmrl.main \
    config=examples/config.yaml \
    data.train_files=hiyouga/geometry3k@train \
    data.val_files=hiyouga/geometry3k@test \
    worker.actor.model.model_path="${MODEL_PATH}" \
    worker.actor.micro_batch_size_per_device_for_update=8 \
    worker.actor.micro_batch_size_per_device_for_experience=32 \
    trainer.experiment_name=qwen2_5_vl_3b_geo3k_grpo \
    trainer.n_gpus_per_node=4 \
    "$@"
