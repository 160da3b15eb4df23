#!/usr/bin/env bash
# Makes .venv (again when its jax is not the pinned one): Debian's python3 (which sees
# Debian's numpy 1.24 and torch 1.13) plus JAX,
# optax, ml_dtypes and scikit-build-core from PyPI, pinned to versions that keep numpy 1.x
# (torch 1.13 breaks under numpy 2). Sourced after deps.sh; sets HOSTOPT_PYTHON.
set -euo pipefail
HOSTOPT_PYTHON="$PWD/.venv/bin/python"
if ! "$HOSTOPT_PYTHON" -c "import jax, optax, ml_dtypes, safetensors, scikit_build_core
assert jax.__version__ == '$(sed -n 's/^jax==//p' .ci/python-constraints.txt)'" 2>/dev/null; then
  echo "hostopt: making .venv (jax, optax from PyPI)" >&2
  /usr/bin/python3 -m venv --clear --system-site-packages .venv
  "$HOSTOPT_PYTHON" -m pip install -q --disable-pip-version-check -c .ci/python-constraints.txt \
    jax jaxlib optax chex ml_dtypes safetensors scikit-build-core pybind11
fi
export HOSTOPT_PYTHON
