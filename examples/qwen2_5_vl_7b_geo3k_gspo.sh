#!/usr/bin/env bash
# GSPO (Zheng et al. 2025) on Qwen2.5-VL-7B-Instruct with geometry3k, one node of 8 GPUs.
# One importance ratio per response (the geometric mean of its token ratios),
# clipped to the paper's narrow range [1 - 3e-4, 1 + 4e-4] (narrow because the
# ratio is length-normalised), and a loss averaged per sequence first. No KL
# term, as in the paper. gspo_token keeps the sequence ratio's value with
# per-token gradients: worker.actor.loss_type=gspo_token.
# Extra key=value arguments are passed on (see qwen2_5_vl_7b_geo3k_grpo.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1

MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-VL-7B-Instruct}  # a Hub id, or a local directory

exec "${PYTHON:-python3}" -m vlmrl.main \
    config=examples/config.yaml \
    data.train_files=hiyouga/geometry3k@train \
    data.val_files=hiyouga/geometry3k@test \
    algorithm.disable_kl=true \
    worker.actor.model.model_path="${MODEL_PATH}" \
    worker.actor.loss_type=gspo \
    worker.actor.loss_avg_mode=seq_mean_token_mean \
    worker.actor.clip_ratio_low=3.0e-4 \
    worker.actor.clip_ratio_high=4.0e-4 \
    trainer.experiment_name=qwen2_5_vl_7b_geo3k_gspo \
    trainer.n_gpus_per_node=8 \
    "$@"
