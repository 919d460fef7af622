#!/usr/bin/env bash
# GRPO on Qwen2.5-VL-32B-Instruct with geometry3k, one node of 8 x 80 GB GPUs.
#
# A 32B model needs vLLM tensor parallelism (its 65 GB of bf16 weights do not
# fit one GPU beside the actor's shard): the 8 workers share one engine
# sharded over them (tensor_parallel_size=8, vLLM's external launcher in the
# workers' processes), and the actor is offloaded during generation. TP runs
# on CPU in the tests (2 workers, TP=2); on GPUs it has not been run yet.
# Extra key=value arguments are passed on (see qwen2_5_vl_7b_geo3k_grpo.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1

MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-VL-32B-Instruct}  # a Hub id, or a local directory

exec "${PYTHON:-python3}" -m vlmrl.main \
    config=examples/config.yaml \
    data.train_files=hiyouga/geometry3k@train \
    data.val_files=hiyouga/geometry3k@test \
    worker.actor.model.model_path="${MODEL_PATH}" \
    worker.actor.micro_batch_size_per_device_for_update=1 \
    worker.actor.micro_batch_size_per_device_for_experience=8 \
    worker.actor.offload.offload_params=true \
    worker.actor.offload.offload_optimizer=true \
    worker.rollout.tensor_parallel_size=8 \
    worker.rollout.gpu_memory_utilization=0.5 \
    trainer.experiment_name=qwen2_5_vl_32b_geo3k_grpo \
    trainer.n_gpus_per_node=8 \
    "$@"
