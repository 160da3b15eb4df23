"""hostopt.jax with the parameters on the default device against optax.adamw there.

On a GPU (`.ci/gpu` with HOSTOPT_GPU_JAX=1) this is the check the CPU cannot make: the
gradients go down through the pipeline's CUDA engine, the f32 masters and moments stay in
host memory, and the new parameters come back to the GPU. Prints the device memory in use
with each optimizer (the HBM the state no longer takes), the step time of each, and checks
that 30 steps of a small MLP agree with optax.adamw to float tolerance. On a CPU it runs the
same loop with offload="host" (CPU arrays standing in), where the memory numbers mean nothing.

  PYTHONPATH=<build>/python python tests/python/jax_offload_check.py [--width 2048]
"""
import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import hostopt.jax as hj


def in_use(device):
  return (device.memory_stats() or {}).get("bytes_in_use")


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--width", type=int, default=2048)
  ap.add_argument("--steps", type=int, default=30)
  args = ap.parse_args()
  device = jax.devices()[0]
  on_gpu = device.platform != "cpu"
  w = args.width
  keys = jax.random.split(jax.random.PRNGKey(0), 5)
  params = {f"l{i}": {"w": jax.random.normal(keys[i], (w, w)) / np.sqrt(w), "b": jnp.zeros(w)} for i in range(4)}
  x = jax.random.normal(keys[4], (256, w))

  def loss(p):
    h = x
    for i in range(4):
      h = jnp.tanh(h @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"])
    return jnp.mean(h ** 2)

  grad_fn = jax.jit(jax.value_and_grad(loss))
  n = sum(a.size for a in jax.tree_util.tree_leaves(params))
  print(f"device: {device} ({device.platform}); {n / 1e6:.1f}M params")

  base = in_use(device)
  ref = optax.adamw(1e-3, weight_decay=0.1)
  state = ref.init(params)
  with_optax = in_use(device)

  @jax.jit
  def optax_step(p, s, g):
    u, s = ref.update(g, s, p)
    return optax.apply_updates(p, u), s

  opt = hj.adamw(params, 1e-3, weight_decay=0.1, offload=None if on_gpu else "host")
  print(f"path: {'offload pipeline, CUDA engine' if on_gpu else 'offload pipeline, host engine (CPU stand-in)'}")
  p, q = params, params
  t_opt, t_ref = [], []
  for step in range(args.steps):
    la, ga = grad_fn(p)
    lb, gb = grad_fn(q)
    jax.block_until_ready((ga, gb))
    t0 = time.perf_counter()
    p = opt.step(ga)
    jax.block_until_ready(p)
    t1 = time.perf_counter()
    q, state = optax_step(q, state, gb)
    jax.block_until_ready(q)
    t2 = time.perf_counter()
    if step >= 3:
      t_opt.append(t1 - t0)
      t_ref.append(t2 - t1)
  diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree_util.tree_leaves(p), jax.tree_util.tree_leaves(q)))
  print(f"final loss: hostopt.jax {float(la):.6f}, optax {float(lb):.6f}; max |param difference| {diff:.2e}")
  print(f"step (grads in, params out): hostopt.jax {1e3 * np.median(t_opt):.2f} ms, optax.adamw on the device "
        f"{1e3 * np.median(t_ref):.2f} ms")
  if base is not None and with_optax is not None:
    print(f"device memory for optax's state: {(with_optax - base) / 2**20:.1f} MiB; hostopt.jax keeps it in host "
          f"memory ({opt.state_bytes / 2**20:.1f} MiB there)")
  ds = opt._device_step
  print(f"hostopt.jax on the device: one flat parameter buffer ({ds.n * ds.out_dtype.itemsize / 2**20:.1f} MiB) and, "
        f"during a step, one flat gradient buffer ({ds.n * ds.grad_dtype.itemsize / 2**20:.1f} MiB)")
  ok = diff < 1e-4 and abs(float(la) - float(lb)) < 1e-4 * max(1.0, abs(float(lb)))
  print("agree with optax.adamw:", "yes" if ok else "NO")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
