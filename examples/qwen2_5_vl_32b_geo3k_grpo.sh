#!/usr/bin/env bash
# GRPO on Qwen2.5-VL-32B-Instruct with geometry3k, one node of 8 x 80 GB GPUs.
#
# NOT RUNNABLE YET: a 32B model needs vLLM tensor parallelism (its 65 GB of
# bf16 weights do not fit one GPU beside the actor's shard), which vlmrl
# rejects at validation for now ("not supported by vlmrl yet"); the actor's
# offload during generation (offload.*) is implemented. The settings are the
# ones to use once TP lands; until then, use the 7B script, or give the run
# more memory per GPU.
# Extra key=value arguments are passed on (see qwen2_5_vl_7b_geo3k_grpo.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1

MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-VL-32B-Instruct}  # a Hub id, or a local directory

"${PYTHON:-python3}" -m vlmrl.main \
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
