#!/usr/bin/env bash
# DAPO (Yu et al. 2025) on Qwen2.5-VL-7B-Instruct with geometry3k, one node of 8 GPUs:
# - no KL term and no reference model;
# - clip-higher: the ratio may rise to 1.28 but fall only to 0.8;
# - token-level loss averaging (token_mean);
# - dynamic sampling: prompt groups whose responses are all right or all wrong
#   teach nothing (zero advantage) and are dropped, and more prompts are
#   generated, up to trainer.max_try_make_batch rounds, to fill the step;
# - the +1/-1 answer reward with the soft overlong penalty (reward_functions/dapo.py)
#   and DAPO's "Answer: ..." prompt.
# Extra key=value arguments are passed on (see qwen2_5_vl_7b_geo3k_grpo.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1

MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-VL-7B-Instruct}  # a Hub id, or a local directory
MAX_RESPONSE_LENGTH=2048

exec "${PYTHON:-python3}" -m vlmrl.main \
    config=examples/config.yaml \
    data.train_files=hiyouga/geometry3k@train \
    data.val_files=hiyouga/geometry3k@test \
    data.format_prompt=examples/format_prompt/dapo.jinja \
    data.max_response_length=${MAX_RESPONSE_LENGTH} \
    algorithm.disable_kl=true \
    algorithm.online_filtering=true \
    algorithm.filter_key=accuracy \
    algorithm.filter_low=0.01 \
    algorithm.filter_high=0.99 \
    worker.actor.model.model_path="${MODEL_PATH}" \
    worker.actor.loss_avg_mode=token_mean \
    worker.actor.clip_ratio_low=0.2 \
    worker.actor.clip_ratio_high=0.28 \
    worker.actor.clip_ratio_dual=10.0 \
    worker.actor.optim.weight_decay=0.1 \
    worker.rollout.n=8 \
    worker.reward.reward_function=reward_functions/dapo.py:compute_score \
    worker.reward.reward_function_kwargs="{max_response_length: ${MAX_RESPONSE_LENGTH}, overlong_buffer_length: 512, overlong_penalty_factor: 1.0}" \
    trainer.max_try_make_batch=10 \
    trainer.experiment_name=qwen2_5_vl_7b_geo3k_dapo \
    trainer.n_gpus_per_node=8 \
    "$@"
