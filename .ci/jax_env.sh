#!/usr/bin/env bash
# Makes .venv-jax: Debian's python3 (the interpreter the release build's extensions are for)
# with the current jax, jaxlib, optax and numpy 2 from PyPI and nothing from Debian — the
# lane that runs the JAX/optax suites (and optax's own tests) as today's JAX users would.
# hostopt comes in as the wheel (.ci/wheel), installed after jax. Sets HOSTOPT_JAX_PYTHON.
set -euo pipefail
HOSTOPT_JAX_PYTHON="$PWD/.venv-jax/bin/python"
if ! "$HOSTOPT_JAX_PYTHON" -c "import jax, optax, numpy, pytest, ml_dtypes
assert int(numpy.__version__.split('.')[0]) >= 2" 2>/dev/null; then
  echo "hostopt: making .venv-jax (current jax, optax and numpy from PyPI)" >&2
  /usr/bin/python3 -m venv .venv-jax
  "$HOSTOPT_JAX_PYTHON" -m pip install -q --disable-pip-version-check jax jaxlib optax numpy ml_dtypes pytest
fi
# Flax (NNX) for its integration test, kept to the jax, jaxlib, optax and numpy already there.
if ! "$HOSTOPT_JAX_PYTHON" -c "import flax.nnx" 2>/dev/null; then
  echo "hostopt: adding flax to .venv-jax" >&2
  "$HOSTOPT_JAX_PYTHON" -m pip freeze | grep -iE '^(jax|jaxlib|optax|numpy)==' > .venv-jax/keep.txt
  "$HOSTOPT_JAX_PYTHON" -m pip install -q --disable-pip-version-check -c .venv-jax/keep.txt flax
fi
export HOSTOPT_JAX_PYTHON
