# vlmrl for GPU nodes: CUDA vLLM, torch 2.14.1 (CUDA 13.0), Ray, vlmrl with its gpu extra.
#
#   docker build -t vlmrl:gpu .
#   docker run --rm --gpus all --ipc=host vlmrl:gpu                      # prints usage
#   docker run --rm --gpus all --ipc=host -v /shared:/shared vlmrl:gpu \
#       python -m vlmrl.main config=examples/config.yaml trainer.output_dir=/shared/outputs
#
# Version choice (see the README, "GPU nodes and multi-node"):
# - torch 2.14.1 / torchvision 0.29.1, as pyproject.toml pins them. The PyPI
#   wheels of torch 2.14 are CUDA 13.0 builds (driver >= 580 on the host).
# - vllm 0.33.0, the release built against torch 2.14 (its metadata pins
#   torch==2.14.0, torchvision==0.29.0). The patch release 2.14.1 keeps the
#   ABI of 2.14.0, so uv's --override replaces vLLM's exact pins with ours
#   instead of installing a second torch; no vllm release pins 2.14.1 itself.
# - flash-attn has no prebuilt wheel for torch 2.14 / CUDA 13 (PyPI holds only
#   its sdist, a build of hours). Pass a matching wheel with
#   --build-arg FLASH_ATTN_WHEEL=<wheel URL>; without one the actor uses
#   PyTorch's SDPA, and vLLM its own bundled attention kernels.

# The devel image has nvcc: FlashInfer (vLLM's sampler and attention backend)
# compiles some kernels just in time, and flash-attn builds need it too.
ARG BASE_IMAGE=nvidia/cuda:13.0.1-devel-ubuntu24.04
FROM ${BASE_IMAGE}

ARG VLLM_VERSION=0.33.0
ARG TORCH_VERSION=2.14.1
ARG TORCHVISION_VERSION=0.29.1
ARG UV_VERSION=0.13.8
ARG FLASH_ATTN_WHEEL=""
# The uid of the non-root user; match the owner of shared checkpoint storage.
ARG VLMRL_UID=1000

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    UV_NO_CACHE=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH}

# Python 3.12 (Ubuntu 24.04's) with headers and a C compiler: Triton and
# FlashInfer compile small launchers and kernels at run time. Ubuntu's package
# versions are not pinned: the base image tag fixes the release they come from.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3 python3-dev python3-venv build-essential git ca-certificates curl procps iproute2 \
    && rm -rf /var/lib/apt/lists/*

RUN python3 -m venv /opt/venv \
    && pip install --no-cache-dir "uv==${UV_VERSION}"

WORKDIR /opt/vlmrl

# Third-party dependencies first (pyproject.toml only), so that editing vlmrl's
# code does not re-download vLLM and torch.
COPY pyproject.toml README.md ./
RUN printf 'torch==%s\ntorchvision==%s\n' "${TORCH_VERSION}" "${TORCHVISION_VERSION}" > /opt/torch-overrides.txt \
    && uv pip install --override /opt/torch-overrides.txt \
        -r pyproject.toml --extra gpu \
        "vllm==${VLLM_VERSION}" "torch==${TORCH_VERSION}" "torchvision==${TORCHVISION_VERSION}" \
    && if [ -n "${FLASH_ATTN_WHEEL}" ]; then uv pip install --no-deps "${FLASH_ATTN_WHEEL}"; fi \
    && python -c "import torch, vllm; assert torch.__version__.startswith('${TORCH_VERSION}'), torch.__version__"

# Non-root user. Ubuntu 24.04 images ship a user "ubuntu" with uid 1000; it
# makes way so that vlmrl can take the uid that the shared storage expects.
RUN if id ubuntu >/dev/null 2>&1; then userdel --remove ubuntu; fi \
    && groupadd --gid "${VLMRL_UID}" vlmrl \
    && useradd --create-home --uid "${VLMRL_UID}" --gid "${VLMRL_UID}" --shell /bin/bash vlmrl \
    && mkdir -p /cache /opt/vlmrl/outputs \
    && chown vlmrl:vlmrl /cache /opt/vlmrl /opt/vlmrl/outputs

COPY --chown=vlmrl:vlmrl vlmrl ./vlmrl
COPY --chown=vlmrl:vlmrl reward_functions ./reward_functions
COPY --chown=vlmrl:vlmrl examples ./examples
COPY --chown=vlmrl:vlmrl scripts ./scripts
COPY --chown=vlmrl:vlmrl benchmarks ./benchmarks
RUN uv pip install --no-deps -e . \
    && chown -R vlmrl:vlmrl /opt/vlmrl

# vLLM: spawn its worker processes (a forked CUDA context is unusable); the
# engine inside each FSDP worker runs in process (vlmrl sets
# VLLM_ENABLE_V1_MULTIPROCESSING=0 per worker). Ray: no usage reporting, and
# no warning about the container's CPU quota. Caches go to /cache: mount a
# volume there to keep downloaded models between runs. (hadolint takes the
# TOKEN in TOKENIZERS_PARALLELISM for a secret; it is not one.)
# hadolint ignore=DL3064
ENV VLLM_WORKER_MULTIPROC_METHOD=spawn \
    VLLM_CONFIGURE_LOGGING=1 \
    RAY_USAGE_STATS_ENABLED=0 \
    RAY_DISABLE_DOCKER_CPU_WARNING=1 \
    TOKENIZERS_PARALLELISM=false \
    HF_HOME=/cache/huggingface \
    VLMRL_CACHE_DIR=/cache/vlmrl \
    TRITON_CACHE_DIR=/cache/triton

USER ${VLMRL_UID}:${VLMRL_UID}

CMD ["bash", "scripts/docker_help.sh"]
