#!/usr/bin/env python3
"""hostopt.optax.adamw vs optax.adamw (jitted, JAX CPU) at equal threads.

XLA's CPU thread count is fixed when JAX starts, so each thread count runs in its own
process (this script re-runs itself with --worker).

  PYTHONPATH=build/release/python .venv/bin/python bench/compare_optax.py --sizes 64M,256M --threads 1,2
"""
import argparse
import os
import statistics
import subprocess
import sys
import time


def parse_size(s):
  mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
  return int(float(s[:-1]) * mult[s[-1]]) if s[-1] in mult else int(s)


def worker(size, threads, leaves, iterations):
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  import hostopt.optax as hoptax

  n = parse_size(size)
  shapes = [n // leaves] * (leaves - 1) + [n - (n // leaves) * (leaves - 1)]
  rng = np.random.default_rng(0)
  params_np = {f"p{i}": rng.standard_normal(s, dtype=np.float32) for i, s in enumerate(shapes)}
  grads_np = {k: (0.01 * rng.standard_normal(v.shape, dtype=np.float32)) for k, v in params_np.items()}
  results = {}

  # optax, jitted, state donated (its fastest form).
  opt = optax.adamw(1e-3, weight_decay=0.01)
  params = jax.device_put(params_np)
  grads = jax.device_put(grads_np)
  state = opt.init(params)

  @jax.jit
  def step(g, s, p):
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s
  step = jax.jit(step, donate_argnums=(1, 2))
  params, state = step(grads, state, params)
  jax.block_until_ready(params)
  times = []
  for _ in range(iterations):
    t0 = time.perf_counter()
    params, state = step(grads, state, params)
    jax.block_until_ready(params)
    times.append(time.perf_counter() - t0)
  results["optax (jit)"] = statistics.median(times)
  del params, state, grads

  # hostopt.optax on numpy trees: update + apply_updates (what a user's loop does).
  for label, reuse in (("hostopt.optax", False), ("hostopt.optax reuse_state", True)):
    hopt = hoptax.adamw(1e-3, weight_decay=0.01, threads=threads, reuse_state=reuse)
    p = {k: v.copy() for k, v in params_np.items()}
    s = hopt.init(p)
    times = []
    for i in range(iterations + 1):
      t0 = time.perf_counter()
      u, s = hopt.update(grads_np, s, p)
      for k in p:
        p[k] += u[k]
      if i:
        times.append(time.perf_counter() - t0)
    results[label] = statistics.median(times)
  print(f"{size:>6} {threads:>7} {leaves:>6} " + " ".join(f"{results[k] * 1e3:>14.1f}" for k in results) +
        f" {results['optax (jit)'] / results['hostopt.optax reuse_state']:>9.2f}x")


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--sizes", default="64M")
  ap.add_argument("--threads", default="1,2")
  ap.add_argument("--leaves", type=int, default=16)
  ap.add_argument("--iterations", type=int, default=5)
  ap.add_argument("--worker", nargs=2, metavar=("SIZE", "THREADS"), help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.worker:
    worker(args.worker[0], int(args.worker[1]), args.leaves, args.iterations)
    return 0
  try:
    import hostopt.optax  # noqa: F401
  except ImportError as e:
    print(f"skipped: {e} (needs jax, optax and the hostopt module on PYTHONPATH)")
    return 0
  print(f"{'size':>6} {'threads':>7} {'leaves':>6} {'optax jit ms':>14} {'hostopt ms':>14} {'reuse_state ms':>14} "
        f"{'speedup':>10}")
  for size in args.sizes.split(","):
    for threads in args.threads.split(","):
      env = dict(os.environ)
      env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=" +
                          ("false" if threads == "1" else "true") + f" intra_op_parallelism_threads={threads}")
      env["JAX_PLATFORMS"] = "cpu"
      subprocess.run([sys.executable, __file__, "--worker", size, threads, "--leaves", str(args.leaves),
                      "--iterations", str(args.iterations)], env=env, check=True)
  print("hostopt times include numpy's apply_updates (p += u, single-threaded); optax's jitted step fuses it.")
  return 0


if __name__ == "__main__":
  sys.exit(main())
