"""hostopt.optax with state_memory="pinned_host" against optax.adamw, on the default device.

On a GPU (`.ci/gpu` with HOSTOPT_GPU_JAX=1) this is the check the CPU cannot make: the float32
moments live in pinned host memory (no HBM), the update runs on the host through the FFI call
(compute_on("device_host")), and the parameters stay on the GPU. Prints the device memory in
use with each optimizer's state (HBM saved), the step time of each, and checks that 20 jitted
steps agree with optax.adamw to float tolerance; then 8-bit moments (adamw_8bit) in pinned host
memory, bit for bit against the numpy route. Runs on a CPU too (jax >= 0.5 gives CPU devices
a pinned_host memory), where it checks the same logic and the memory numbers mean nothing.

  PYTHONPATH=<build>/python python tests/python/optax_pinned_host_check.py [--params 16M]
"""
import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import hostopt.optax as hoptax


def in_use(device):
  stats = device.memory_stats() or {}
  return stats.get("bytes_in_use")


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--params", default="16M")
  ap.add_argument("--steps", type=int, default=20)
  args = ap.parse_args()
  n = int(float(args.params[:-1]) * (1 << 20)) if args.params[-1] == "M" else int(args.params)
  device = jax.devices()[0]
  print(f"jax {jax.__version__} on {device.platform} ({device.device_kind}), memories "
        f"{sorted(m.kind for m in device.addressable_memories())}")
  rng = np.random.default_rng(0)
  init = {"w": rng.standard_normal((n // 1024, 1024), dtype=np.float32) * 0.02,
          "b": np.zeros(1024, np.float32)}
  target = jnp.asarray(rng.standard_normal(1024, dtype=np.float32))

  def loss(p):
    return jnp.mean((jnp.tanh(p["w"]) @ target[:, None] / 32.0) ** 2) + jnp.sum((p["b"] - 0.1) ** 2)

  results = {}
  for label, opt in (("optax.adamw", optax.adamw(1e-3, weight_decay=0.1)),
                     ("hostopt.optax pinned_host", hoptax.adamw(1e-3, weight_decay=0.1, state_memory="pinned_host"))):
    params = jax.device_put(init, device)
    before = in_use(device)
    state = opt.init(params)
    jax.block_until_ready(state)
    after = in_use(device)
    kinds = sorted({x.sharding.memory_kind for x in jax.tree_util.tree_leaves((state[0].mu, state[0].nu))})

    @jax.jit
    def step(p, s):
      u, s = opt.update(jax.grad(loss)(p), s, p)
      return optax.apply_updates(p, u), s
    params, state = step(params, state)  # compile
    times = []
    for _ in range(args.steps - 1):
      t0 = time.perf_counter()
      params, state = step(params, state)
      jax.block_until_ready(params)
      times.append(time.perf_counter() - t0)
    state_bytes = None if before is None or after is None else after - before
    if "pinned_host" in label:
      now = sorted({x.sharding.memory_kind for x in jax.tree_util.tree_leaves((state[0].mu, state[0].nu))})
      if kinds != ["pinned_host"] or now != kinds:
        raise SystemExit(f"the f32 moments were in {kinds} after init and in {now} after the steps, "
                         "expected ['pinned_host']")
    results[label] = params
    print(f"{label:>28}: moments in {kinds}, device memory for the state "
          f"{'n/a' if state_bytes is None else f'{state_bytes / 2**20:.1f} MiB'}, "
          f"median step {np.median(times) * 1e3:.2f} ms")
  a, b = (jax.device_get(p) for p in results.values())
  for k in a:
    np.testing.assert_allclose(a[k], b[k], rtol=2e-4, atol=2e-6)
  print(f"{args.steps} steps: hostopt.optax (pinned_host) agrees with optax.adamw")

  # 8-bit moments (codes and block exponents) in pinned host memory: the same bits as the
  # numpy route, which runs the same kernel on the host's copies, fed the same gradients.
  placed = hoptax.adamw_8bit(1e-3, weight_decay=0.1, state_memory="pinned_host")
  on_numpy = hoptax.adamw_8bit(1e-3, weight_decay=0.1)
  params = jax.device_put(init, device)
  before = in_use(device)
  state = placed.init(params)
  jax.block_until_ready(state)
  after = in_use(device)
  kinds = sorted({x.sharding.memory_kind for x in jax.tree_util.tree_leaves(tuple(state[0])[1:])})
  np_state = jax.tree_util.tree_map(np.asarray, state)
  update, grad = jax.jit(placed.update), jax.jit(jax.grad(loss))
  times = []
  for i in range(args.steps):
    g = grad(params)
    t0 = time.perf_counter()
    u, state = update(g, state, params)
    jax.block_until_ready(u)
    times.append(time.perf_counter() - t0)
    u_np, np_state = on_numpy.update(jax.device_get(g), np_state, jax.device_get(params))
    for a, b in zip(jax.tree_util.tree_leaves((u, state)), jax.tree_util.tree_leaves((u_np, np_state))):
      if not np.array_equal(np.asarray(a), np.asarray(b)):
        raise SystemExit(f"step {i}: 8-bit pinned_host and the numpy route differ")
    params = optax.apply_updates(params, u)
  after_steps = sorted({x.sharding.memory_kind for x in jax.tree_util.tree_leaves(tuple(state[0])[1:])})
  if kinds != ["pinned_host"] or after_steps != kinds:
    raise SystemExit(f"the 8-bit codes were in {kinds} after init and in {after_steps} after the updates, "
                     "expected ['pinned_host']")
  state_bytes = None if before is None or after is None else after - before
  print(f"{'hostopt.optax 8bit pinned_host':>28}: codes in {kinds}, device memory for the state "
        f"{'n/a' if state_bytes is None else f'{state_bytes / 2**20:.1f} MiB'}, "
        f"median update {np.median(times[1:]) * 1e3:.2f} ms")
  print(f"{args.steps} steps: 8-bit moments in pinned_host give the numpy route's bits")
  return 0


if __name__ == "__main__":
  sys.exit(main())
