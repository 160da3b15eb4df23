"""hostopt.optax on a gradient cut over PART of a mesh axis (jax CPU, 4 devices, Shardy).

Shardy propagates sharding through a reshape with sub-axes: an (8,) vector cut 4 ways over
mesh axis x, reshaped to (2, 4), has dim 0 cut over the major half of x and dim 1 over its
minor half ("x":(1)2 and "x":(2)2). No PartitionSpec says that, and custom_partitioning's
default decode_shardings, which turns every sharding XLA hands the op into a NamedSharding
of the mesh, raised IndivisibleError ("dim_size=2 is not divisible by axis_size=4") inside
XLA's partitioner: the step failed to compile where optax.adamw compiles. The per-shard ops
now take XLA's sharding as it is (decode_shardings=False): the float32 call runs on each
device's shard of such a leaf, and the compressed call, which needs a leaf's shards as
mesh axes, decodes what it can and gathers the rest around the call, as for any other leaf
it cannot run per shard."""
import os
import subprocess
import sys

import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("optax")

from hostopt import _xla  # noqa: E402

SCRIPT = r"""
import re
import jax, jax.numpy as jnp, numpy as np, optax
import hostopt.optax as hoptax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
mesh = Mesh(np.array(jax.devices()), ("x",))
rng = np.random.default_rng(0)
# Flat vectors cut 4 ways over x, reshaped in the step: each leaf's dim 0 is cut over part of x.
flat = {"a": rng.standard_normal(8).astype(np.float32),      # -> (2, 4): dim 0 over "x":(1)2
        "b": rng.standard_normal(8 * 64).astype(np.float32), # -> (2, 256): whole 8-bit blocks per shard
        "c": rng.standard_normal(4 * 3).astype(np.float32)}  # -> (2, 6)
shapes = {"a": (2, 4), "b": (2, 256), "c": (2, 6)}
vectors = {k: jax.device_put(v, NamedSharding(mesh, P("x"))) for k, v in flat.items()}
params = {k: jnp.asarray(np.cos(np.arange(v.size, dtype=np.float32)).reshape(shapes[k])) for k, v in flat.items()}
host_params = jax.tree_util.tree_map(np.asarray, params)
same = lambda a, b: all(np.array_equal(np.asarray(x), np.asarray(y))
                        for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))

cases = [("optax", optax.adamw(1e-2, weight_decay=0.1)), ("f32", hoptax.adamw(1e-2, weight_decay=0.1)),
         ("bf16", hoptax.adamw(1e-2, weight_decay=0.1, moments="bf16")),
         ("8bit", hoptax.adamw(1e-2, weight_decay=0.1, moments="8bit"))]
for name, opt in cases:
  def step(vectors, state, params, t):
    g = {k: jnp.reshape(v * (t + 1.0), shapes[k]) for k, v in vectors.items()}
    return opt.update(g, state, params)
  step = jax.jit(step)
  state, state_np = opt.init(params), opt.init(host_params)
  try:
    hlo = step.lower(vectors, state, params, 0).compile().as_text()
  except Exception as e:
    why = next((l for l in str(e).splitlines() if "Error" in l and "Traceback" not in l), str(e)[-400:])
    print(f"{name}: fails to compile: {type(e).__name__}: {why.strip()}")
    raise SystemExit(1)
  # The reshaped gradient really is cut over part of x: a's shard is [1, 2] (not [2, 1]).
  assert re.search(r"f32\[1,2\]", hlo), name
  if name == "f32":  # per shard: the FFI call's operands are the shards of a, b and c
    call = [l for l in hlo.splitlines() if 'custom_call_target="hostopt_adam_update"' in l]
    assert len(call) == 1 and all(s in call[0] for s in ("f32[1,2]", "f32[1,128]", "f32[1,3]")), call
    assert not any(s in call[0] for s in ("f32[2,4]", "f32[2,256]", "f32[2,6]")), call
  if name == "optax":
    continue
  for t in range(3):  # step after step (the state carried with its shardings): the numpy route's bits
    u, state = step(vectors, state, params, t)
    g_np = {k: (v * np.float32(t + 1.0)).reshape(shapes[k]) for k, v in flat.items()}
    u_np, state_np = opt.update(g_np, state_np, host_params)
    assert same((u, state), (u_np, state_np)), (name, t)
  print(f"{name}: compiled and ran, the bits of whole arrays")
print("ok")
"""


def run_on_four_cpu_devices(script):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
  env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)
  return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(not _xla._SHARDY, reason=f"jax {jax.__version__}: no per-shard call without Shardy")
def test_a_gradient_cut_over_part_of_a_mesh_axis_compiles_and_gives_the_bits_of_whole_arrays():
  run = run_on_four_cpu_devices(SCRIPT)
  assert run.returncode == 0 and run.stdout.strip().endswith("ok"), (run.stdout[-2000:], run.stderr[-3000:])
