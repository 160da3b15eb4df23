#!/usr/bin/env python3
"""hostopt vs torch.optim.AdamW (foreach off and on) at equal threads, in one process.

Also measures the Python layer: hostopt.torch.AdamW.step() against the bare C++ step
(hostopt._core) on a model-like list of hundreds of tensors.

  PYTHONPATH=build/release/python .venv/bin/python bench/compare_torch.py --sizes 64M,256M --threads 1,2
"""
import argparse
import statistics
import sys
import time


def parse_size(s):
  mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
  return int(float(s[:-1]) * mult[s[-1]]) if s[-1] in mult else int(s)


def median_time(fn, iters):
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--sizes", default="64M", help="parameter counts, K/M/G suffixes (default 64M)")
  ap.add_argument("--threads", default="1,2", help="thread counts (default 1,2)")
  ap.add_argument("--tensors", type=int, default=64, help="tensors the parameters are split into (default 64)")
  ap.add_argument("--iterations", type=int, default=5)
  args = ap.parse_args()
  try:
    import torch
    import hostopt
    import hostopt.torch as htorch
  except ImportError as e:
    print(f"skipped: {e} (build the Python module and set PYTHONPATH=build/<preset>/python)")
    return 0

  print(f"hostopt {hostopt.__version__} ({hostopt.active_kernel()}), torch {torch.__version__}")
  print(f"{'size':>6} {'threads':>7} {'torch foreach=False ms':>22} {'foreach=True ms':>15} {'hostopt ms':>10} "
        f"{'speedup':>8}")
  for size in args.sizes.split(","):
    n = parse_size(size)
    k = args.tensors
    shapes = [n // k] * (k - 1) + [n - (n // k) * (k - 1)]
    for threads in (int(t) for t in args.threads.split(",")):
      torch.set_num_threads(threads)
      results = {}
      for name in ("foreach=False", "foreach=True", "hostopt"):
        params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
        for p in params:
          p.grad = torch.randn_like(p) * 0.01
        if name == "hostopt":
          opt = htorch.AdamW(params, lr=1e-3, threads=threads)
        else:
          opt = torch.optim.AdamW(params, lr=1e-3, foreach=(name == "foreach=True"))
        opt.step()  # warm-up: state allocated
        results[name] = median_time(opt.step, args.iterations)
        del opt, params
      best_torch = min(results["foreach=False"], results["foreach=True"])
      print(f"{size:>6} {threads:>7} {results['foreach=False'] * 1e3:>22.1f} {results['foreach=True'] * 1e3:>15.1f} "
            f"{results['hostopt'] * 1e3:>10.1f} {best_torch / results['hostopt']:>7.1f}x")

  # Python layer overhead: ~300 tensors shaped like GPT-2 small's, 124M parameters.
  torch.set_num_threads(int(args.threads.split(",")[-1]))
  d, layers = 768, 12
  shapes = [(50257, d), (1024, d)] + [s for _ in range(layers) for s in
                                      [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,),
                                       (4 * d, d), (d,)]] + [(d,), (d,)]
  threads = int(args.threads.split(",")[-1])
  params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
  for p in params:
    p.grad = torch.randn_like(p) * 0.01
  opt = htorch.AdamW(params, lr=1e-3, threads=threads)
  opt.step()
  core, tensors, _ = opt._layout["f32"]
  grads = [p.grad.numpy() for p in tensors]
  bare = lambda: core.step_tensors(grads, "f32", [], "f32", 1.0)
  t_layer, t_bare = [], []
  for _ in range(args.iterations):  # interleaved
    t_layer.append(median_time(opt.step, 1))
    t_bare.append(median_time(bare, 1))
  layer, base = statistics.median(t_layer), statistics.median(t_bare)
  print(f"python layer: {len(shapes)} tensors, {sum(p.numel() for p in params) / 1e6:.1f}M params, {threads} threads: "
        f"hostopt.torch.AdamW.step {layer * 1e3:.1f} ms vs C++ step {base * 1e3:.1f} ms: "
        f"overhead {100 * (layer / base - 1):+.1f}%")
  return 0


if __name__ == "__main__":
  sys.exit(main())
