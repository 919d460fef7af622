#!/usr/bin/env bash
# CISPO (MiniMax-M1, 2025) on Qwen2.5-VL-7B-Instruct with geometry3k, one node of 8 GPUs.
# A REINFORCE loss weighted by the token's importance ratio, where the weight
# is clipped and detached instead of the token being dropped: every token keeps
# its gradient. clip_ratio_high caps the weight at 1.28; clip_ratio_low=0.99
# leaves it almost open below (weights down to 0.01), as the paper does.
# Extra key=value arguments are passed on (see qwen2_5_vl_7b_geo3k_grpo.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1

MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-VL-7B-Instruct}  # a Hub id, or a local directory

exec "${PYTHON:-python3}" -m vlmrl.main \
    config=examples/config.yaml \
    data.train_files=hiyouga/geometry3k@train \
    data.val_files=hiyouga/geometry3k@test \
    worker.actor.model.model_path="${MODEL_PATH}" \
    worker.actor.loss_type=cispo \
    worker.actor.clip_ratio_low=0.99 \
    worker.actor.clip_ratio_high=0.28 \
    trainer.experiment_name=qwen2_5_vl_7b_geo3k_cispo \
    trainer.n_gpus_per_node=8 \
    "$@"
