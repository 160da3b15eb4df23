#!/usr/bin/env python3
"""hostopt.optax.adamw vs optax.adamw on JAX CPU, every variant interleaved round by round.

Per size and thread count, in one process (XLA's CPU thread count is fixed when JAX starts,
so each thread count runs in a process of its own; this script re-runs itself):
  optax jit          jit(update + apply_updates), nothing donated
  optax jit+donate   the same with params, state and gradients donated (optax's fastest form)
  hostopt jit        jit(hostopt.optax update + optax.apply_updates), nothing donated
  hostopt jit+donate the same, all donated: mu/nu updated in place (the update gets a
                     buffer of its own: it is written over the gradient only when the step
                     computes the gradient itself)
  ho bf16 / ho 8bit  hostopt jit+donate with moments="bf16" / "8bit" (compressed moments:
                     2 + 2 or 1 + 1 + 1/16 bytes of moments read and written per parameter)
  hostopt numpy      hostopt.optax on numpy trees with reuse_state, then p += u (numpy)
  hostopt.jax        hostopt.jax.adamw: params = opt.step(grads), jax arrays in and out (the
                     fused step in the arena plus a float32 copy-out JAX takes without a copy)
  C++ floor          hostopt.Optimizer.step: the fused step in place, no update array
Bytes per parameter moved by each (f32): the fused step reads g, p, m, v and writes p, m, v
(28); the optax form writes an update u that apply_updates reads back with p to write p
(+12 = 40); without donation XLA first copies m and v (+16 = 56). XLA fuses optax's update
and apply into one loop (28 donated, 44 without: it keeps the old m, v).

Page faults per step are printed under each row: XLA:CPU maps every temporary it needs
afresh each run (buffers of 32 MB and more come from mmap), and touching a fresh page costs
a fault. optax's fused step needs no temporary; the FFI call needs its results in memory, so
the update takes one gradient-sized temporary per step (none when the step computes its
gradient, whose buffer the update then reuses). GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (glibc 2.35+) backs such
buffers with huge pages and cuts those faults by ~500x.

Then the per-call overhead of an update under jit on a small model's tree (54 leaves,
0.84M parameters, the character LM of the issue), against optax's.

  PYTHONPATH=build/release/python .venv/bin/python bench/compare_optax.py --sizes 16M,64M --threads 1,2
"""
import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

SHORT = {"optax jit": "ox jit", "optax jit+donate": "ox donate", "hostopt jit": "ho jit",
         "hostopt jit+donate": "ho donate", "hostopt bf16": "ho bf16", "hostopt 8bit": "ho 8bit",
         "hostopt numpy": "ho numpy", "hostopt.jax": "ho.jax", "C++ floor": "C++ floor"}
BYTES = {"optax jit": 44, "optax jit+donate": 28, "hostopt jit": 56, "hostopt jit+donate": 40, "hostopt bf16": 32,
         "hostopt 8bit": 28.1, "hostopt numpy": 40, "hostopt.jax": 32, "C++ floor": 28}


def parse_size(s):
  mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
  return int(float(s[:-1]) * mult[s[-1]]) if s[-1] in mult else int(s)


def _shapes(n, leaves):
  return [n // leaves] * (leaves - 1) + [n - (n // leaves) * (leaves - 1)]


def worker(size, threads, leaves, iterations):
  import jax
  import numpy as np
  import optax
  import hostopt
  import hostopt.optax as hoptax

  n = parse_size(size)
  shapes = _shapes(n, leaves)
  rng = np.random.default_rng(0)
  params_np = {f"p{i:03d}": rng.standard_normal(s, dtype=np.float32) for i, s in enumerate(shapes)}
  grads_np = {k: 0.01 * rng.standard_normal(v.shape, dtype=np.float32) for k, v in params_np.items()}
  grads = jax.device_put(grads_np)

  faults = {}  # minor page faults of the last step, per jitted variant

  def jitted(opt, donate):
    def train_step(p, s, g):
      u, s = opt.update(g, s, p)
      return optax.apply_updates(p, u), s
    # Donated: params, state and the gradients (as a step that computes them inside has them).
    step = jax.jit(train_step, donate_argnums=(0, 1, 2) if donate else ())
    carry = [jax.device_put({k: v.copy() for k, v in params_np.items()}), None]
    carry[1] = opt.init(carry[0])

    def run():
      g = jax.device_put(grads_np) if donate else grads  # a fresh copy to donate, made untimed
      jax.block_until_ready(g)
      f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
      t0 = time.perf_counter()
      carry[0], carry[1] = step(carry[0], carry[1], g)
      jax.block_until_ready(carry[0])
      dt = time.perf_counter() - t0
      faults[id(run)] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
      return dt
    return run

  ref = optax.adamw(1e-3, weight_decay=0.01)
  ours = hoptax.adamw(1e-3, weight_decay=0.01, threads=threads)
  numpy_opt = hoptax.adamw(1e-3, weight_decay=0.01, threads=threads, reuse_state=True)
  p_np = {k: v.copy() for k, v in params_np.items()}
  s_np = [numpy_opt.init(p_np)]

  numpy_update_time = []

  def run_numpy():
    t0 = time.perf_counter()
    u, s_np[0] = numpy_opt.update(grads_np, s_np[0], p_np)
    numpy_update_time.append(time.perf_counter() - t0)
    for k in p_np:
      p_np[k] += u[k]

  import hostopt.jax as hj
  front = hj.adamw(jax.device_put(params_np), 1e-3, weight_decay=0.01, threads=threads)

  def run_front():
    t0 = time.perf_counter()
    new = front.step(grads)
    jax.block_until_ready(new)
    return time.perf_counter() - t0

  floor = hostopt.Optimizer([{"params": {k: v.shape for k, v in params_np.items()}, "lr": 1e-3,
                              "weight_decay": 0.01, "mode": "adamw"}], threads=threads)
  bf16 = hoptax.adamw(1e-3, weight_decay=0.01, threads=threads, moments="bf16")
  q8 = hoptax.adamw(1e-3, weight_decay=0.01, threads=threads, moments="8bit")
  variants = {"optax jit": jitted(ref, False), "optax jit+donate": jitted(ref, True),
              "hostopt jit": jitted(ours, False), "hostopt jit+donate": jitted(ours, True),
              "hostopt bf16": jitted(bf16, True), "hostopt 8bit": jitted(q8, True),
              "hostopt numpy": run_numpy, "hostopt.jax": run_front, "C++ floor": lambda: floor.step(grads_np) and None}
  times = {k: [] for k in variants}
  for r in range(iterations + 1):  # round 0 compiles and warms up
    for name, fn in variants.items():
      t0 = time.perf_counter()
      dt = fn()
      if r:
        times[name].append(dt if dt is not None else time.perf_counter() - t0)
  med = {k: statistics.median(v) for k, v in times.items()}
  numpy_update = statistics.median(numpy_update_time[1:])
  page_faults = {k: faults.get(id(fn), 0) for k, fn in variants.items()}
  print(f"{size:>6} {threads:>7} {leaves:>6} " + " ".join(f"{med[k] * 1e3:>9.1f}" for k in variants) +
        f" {med['hostopt jit+donate'] / med['optax jit+donate']:>12.2f} {med['hostopt numpy'] / med['C++ floor']:>12.2f}",
        flush=True)
  print(f"{'page faults/step':>21} " + " ".join(f"{page_faults[k]:>9}" for k in variants) +
        f"   numpy update alone {numpy_update * 1e3:.1f} ms = {numpy_update / med['C++ floor']:.2f}x floor; "
        f"hostopt.jax: {med['optax jit+donate'] / med['hostopt.jax']:.2f}x faster than optax donated, "
        f"{med['hostopt.jax'] / med['C++ floor']:.2f}x the floor", flush=True)


def overhead_worker(iterations):
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  import hostopt.optax as hoptax

  # 54 leaves, 0.84M parameters: a small transformer's tree (embeddings, 4 blocks, head).
  rng = np.random.default_rng(1)
  sizes = [65 * 128, 256 * 128] + [s for _ in range(4) for s in
                                   (128, 128, 128 * 384, 384, 128 * 128, 128, 128, 128, 128 * 512, 512, 512 * 128, 128, 128)]
  # 2 + 4 x 13 = 54 leaves
  params = {f"l{i:02d}": jnp.asarray(rng.standard_normal(s, dtype=np.float32)) for i, s in enumerate(sizes)}
  grads = jax.tree_util.tree_map(lambda x: 0.01 * x, params)
  total = sum(sizes)
  out = {}
  for label, opt in (("optax", optax.adamw(1e-3)), ("hostopt", hoptax.adamw(1e-3))):
    def train_step(p, s, g):
      u, s = opt.update(g, s, p)
      return optax.apply_updates(p, u), s
    step = jax.jit(train_step, donate_argnums=(0, 1))
    p = jax.tree_util.tree_map(jnp.copy, params)
    s = opt.init(p)
    p, s = step(p, s, grads)
    ts = []
    for _ in range(iterations * 20):
      t0 = time.perf_counter()
      p, s = step(p, s, grads)
      jax.block_until_ready(p)
      ts.append(time.perf_counter() - t0)
    out[label] = statistics.median(ts)
  print(f"small model ({len(sizes)} leaves, {total / 1e6:.2f}M params), jit+donate step: optax "
        f"{out['optax'] * 1e3:.3f} ms, hostopt {out['hostopt'] * 1e3:.3f} ms "
        f"(difference {1e3 * (out['hostopt'] - out['optax']):+.3f} ms per call)")


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--sizes", default="16M,64M")
  ap.add_argument("--threads", default="1,2")
  ap.add_argument("--leaves", type=int, default=16)
  ap.add_argument("--iterations", type=int, default=5)
  ap.add_argument("--worker", nargs=2, metavar=("SIZE", "THREADS"), help=argparse.SUPPRESS)
  ap.add_argument("--overhead-worker", action="store_true", help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.worker:
    worker(args.worker[0], int(args.worker[1]), args.leaves, args.iterations)
    return 0
  if args.overhead_worker:
    overhead_worker(args.iterations)
    return 0
  try:
    import hostopt.optax  # noqa: F401
    import jax
    import optax
  except ImportError as e:
    print(f"skipped: {e} (needs jax, optax and the hostopt module on PYTHONPATH)")
    return 0
  print(f"jax {jax.__version__}, optax {optax.__version__}; median ms per step over {args.iterations} interleaved rounds")
  names = list(BYTES)
  print(f"{'size':>6} {'threads':>7} {'leaves':>6} " + " ".join(f"{SHORT[n]:>9}" for n in names) +
        f" {'ho/optax don':>12} {'numpy/floor':>12}")
  print(f"{'bytes/param':>21} " + " ".join(f"{BYTES[n]:>9}" for n in names))
  for size in args.sizes.split(","):
    for threads in args.threads.split(","):
      env = dict(os.environ)
      env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=" +
                          ("false" if threads == "1" else "true") + f" intra_op_parallelism_threads={threads}")
      env["JAX_PLATFORMS"] = "cpu"
      subprocess.run([sys.executable, __file__, "--worker", size, threads, "--leaves", str(args.leaves),
                      "--iterations", str(args.iterations)], env=env, check=True)
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  subprocess.run([sys.executable, __file__, "--overhead-worker", "--iterations", str(args.iterations)], env=env,
                 check=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
