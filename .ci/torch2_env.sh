#!/usr/bin/env bash
# Makes .venv-torch2: Debian's python3 (the interpreter the release build's extension is
# for) with the current torch 2.x and numpy 2 from PyPI and nothing from Debian — the lane
# that runs the Python suites as today's torch users would, and hostopt.torch inside the
# current Hugging Face Trainer/accelerate, Lightning and DeepSpeed. torch's wheel brings its CUDA
# libraries (~3 GB): pip's cache keeps them. Sets HOSTOPT_TORCH2_PYTHON.
set -euo pipefail
HOSTOPT_TORCH2_PYTHON="$PWD/.venv-torch2/bin/python"
if ! "$HOSTOPT_TORCH2_PYTHON" -c "import torch, numpy, pytest; assert torch.__version__ >= '2'" 2>/dev/null; then
  echo "hostopt: making .venv-torch2 (current torch 2.x and numpy from PyPI)" >&2
  /usr/bin/python3 -m venv .venv-torch2
  "$HOSTOPT_TORCH2_PYTHON" -m pip install -q --disable-pip-version-check torch numpy pytest
fi
# The trainers and engines the integration tests run hostopt.torch inside (tests/python/
# test_integration_*.py): installed after torch so DeepSpeed's setup.py finds it, and kept to
# the torch and numpy already there.
if ! "$HOSTOPT_TORCH2_PYTHON" -c "import transformers, accelerate, lightning, deepspeed" 2>/dev/null; then
  echo "hostopt: adding transformers, accelerate, lightning and deepspeed to .venv-torch2" >&2
  "$HOSTOPT_TORCH2_PYTHON" -m pip freeze | grep -iE '^(torch|numpy)==' > .venv-torch2/keep.txt
  "$HOSTOPT_TORCH2_PYTHON" -m pip install -q --disable-pip-version-check -c .venv-torch2/keep.txt \
    transformers accelerate lightning deepspeed
fi
export HOSTOPT_TORCH2_PYTHON
