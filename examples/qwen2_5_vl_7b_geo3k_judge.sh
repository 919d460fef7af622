#!/usr/bin/env bash
# GRPO on Qwen2.5-VL-7B-Instruct with geometry3k, rewarded by the boxed answer and a judge VLM, one node of
# 8 GPUs: 4 train the policy, and the judge (Qwen2.5-VL-7B-Instruct by default, served by vLLM) has a fifth
# to itself (worker.reward.reward_model.placement=separate), so judging overlaps the log-prob passes. (examples/
# config.yaml's batch sizes split over 4 or 8 workers, not 7; with placement=colocated all 8 train and judge.)
# The reward is examples/reward_function/judge_math.py; the judge's question examples/format_prompt/judge_reasoning.jinja.
#   JUDGE_PATH=/models/Qwen2.5-VL-7B-Instruct bash examples/qwen2_5_vl_7b_geo3k_judge.sh trainer.max_steps=20
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1

MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-VL-7B-Instruct}  # a Hub id, or a local directory
JUDGE_PATH=${JUDGE_PATH:-Qwen/Qwen2.5-VL-7B-Instruct}

exec "${PYTHON:-python3}" -m vlmrl.main \
    config=examples/config.yaml \
    data.train_files=hiyouga/geometry3k@train \
    data.val_files=hiyouga/geometry3k@test \
    worker.actor.model.model_path="${MODEL_PATH}" \
    worker.reward.reward_function=examples/reward_function/judge_math.py:compute_score \
    worker.reward.reward_function_kwargs='{judge_weight: 0.5}' \
    worker.reward.reward_model.model_path="${JUDGE_PATH}" \
    worker.reward.reward_model.kind=judge \
    worker.reward.reward_model.placement=separate \
    worker.reward.reward_model.num_gpus=1 \
    worker.reward.reward_model.gpu_memory_utilization=0.8 \
    worker.reward.reward_model.max_length=8192 \
    worker.reward.reward_model.max_new_tokens=4 \
    worker.reward.reward_model.prompt_template=examples/format_prompt/judge_reasoning.jinja \
    trainer.experiment_name=qwen2_5_vl_7b_geo3k_judge \
    trainer.n_gpus_per_node=4 \
    "$@"
