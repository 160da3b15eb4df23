"""hostopt._xla_ffi under whichever jaxlib is installed: one build serves every jaxlib whose XLA
FFI is API 0.1 or newer (jaxlib >= 0.4.34), whichever jaxlib's headers built it, so jax may be
installed before or after hostopt. CI runs this file with jaxlib 0.4.38 (API 0.1) and the
current jaxlib, against builds with both versions' headers; the jit routes of test_optax.py
(the FFI handlers' results and their refusals) run in the same lanes."""

import os
import subprocess
import sys
import textwrap

import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("optax")

import jax.numpy as jnp
import numpy as np
import optax

import hostopt.optax as hoptax
from hostopt import _xla


def test_the_handlers_are_registered_on_this_jaxlib():
  import jaxlib.version
  assert _xla.available() is None, _xla.available()
  from hostopt import _xla_ffi
  major, minor = _xla_ffi.FFI_API_VERSION
  assert (major, minor) >= (0, 1), "built with FFI headers older than API 0.1"
  print(f"handlers built with jaxlib {_xla_ffi.BUILT_WITH_JAXLIB}'s headers (API {major}.{minor}), "
        f"running on jaxlib {jaxlib.version.__version__}")


def test_a_jitted_update_is_the_handlers_and_equals_the_eager_one():
  params = {"w": jnp.linspace(-1, 1, 1000, dtype=jnp.float32), "b": jnp.zeros((3, 5), jnp.float32)}
  grads = jax.tree_util.tree_map(lambda p: jnp.cos(3 * p) + 0.5, params)
  opt = hoptax.adamw(1e-2, weight_decay=0.1)
  update = jax.jit(opt.update)
  assert "hostopt_adam_update" in update.lower(grads, opt.init(params), params).as_text()
  s_jit, s_eager = opt.init(params), opt.init(params)
  for _ in range(3):
    u_jit, s_jit = update(grads, s_jit, params)
    u_eager, s_eager = opt.update(grads, s_eager, jax.tree_util.tree_map(np.asarray, params))
  for a, b in zip(jax.tree_util.tree_leaves((u_jit, s_jit)), jax.tree_util.tree_leaves((u_eager, s_eager))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # and optax's own arithmetic agrees, to the rounding of its float32 bias corrections (1 - b2^t
  # in float32 is off by up to ~1e-5 relative at t = 3; hostopt forms them in double)
  ref = optax.adamw(1e-2, weight_decay=0.1)
  rs = ref.init(params)
  for _ in range(3):
    ru, rs = ref.update(grads, rs, params)
  for a, b in zip(jax.tree_util.tree_leaves(u_jit), jax.tree_util.tree_leaves(ru)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=0)


def test_a_refusal_under_jit_reaches_jax_as_the_handlers_error():
  # The error path calls XLA_FFI_Error_Create through the running XLA's API table.
  opt = optax.inject_hyperparams(hoptax.adam)(learning_rate=1e-2)
  params = {"w": jnp.ones(64, jnp.float32)}
  state = opt.init(params)
  state.hyperparams["b1"] = jnp.asarray(1.5, state.hyperparams["b1"].dtype)
  with pytest.raises((RuntimeError, ValueError), match=r"b1 = 1\.5: expected"):
    jax.block_until_ready(jax.jit(opt.update)(params, state, params))


@pytest.mark.parametrize("version, release", [("0.4.34", (0, 4, 34)), ("0.10.2", (0, 10, 2)),
                                              ("0.4.36.dev20241122", (0, 4, 36)), ("0.5", (0, 5))])
def test_release_numbers(version, release):
  assert _xla._release(version) == release


def test_an_api_0_0_jaxlib_gets_a_message_and_keeps_a_working_jax():
  # jaxlib < 0.4.34 (XLA FFI API 0.0) lays the API table out otherwise: the handlers are never
  # registered there (a registration XLA refuses would also break jax's CPU backend).
  code = textwrap.dedent("""
    import jax.numpy as jnp  # jax checks its jaxlib's version first
    import jaxlib.version
    jaxlib.version.__version__ = "0.4.31"
    from hostopt import _xla
    print("message:", _xla.available())
    print("sum:", float(jnp.arange(4.0).sum()))
  """)
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert out.returncode == 0, out.stderr
  assert "need jaxlib >= 0.4.34" in out.stdout and "jaxlib 0.4.31 is installed" in out.stdout, out.stdout
  assert "sum: 6.0" in out.stdout
