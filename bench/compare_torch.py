#!/usr/bin/env python3
"""hostopt vs torch.optim.AdamW (foreach off, on, and fused) at equal threads, in one process, interleaved.

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
  variants = ["foreach=False", "foreach=True", "fused=True", "hostopt"]
  print(f"{'size':>6} {'threads':>7} " + " ".join(f"{v + ' ms':>18}" for v in variants) + f" {'fused/hostopt':>13}"
        f" {'best torch/hostopt':>18}")
  for size in args.sizes.split(","):
    n = parse_size(size)
    k = args.tensors
    shapes = [n // k] * (k - 1) + [n - (n // k) * (k - 1)]
    for threads in (int(t) for t in args.threads.split(",")):
      torch.set_num_threads(threads)
      opts = {}
      for name in variants:
        params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
        for p in params:
          p.grad = torch.randn_like(p) * 0.01
        try:
          if name == "hostopt":
            opts[name] = htorch.AdamW(params, lr=1e-3, threads=threads)
          elif name == "fused=True":  # torch >= 2.4's fused CPU AdamW (what torchao's CPU offload runs)
            opts[name] = torch.optim.AdamW(params, lr=1e-3, fused=True)
          else:
            opts[name] = torch.optim.AdamW(params, lr=1e-3, foreach=(name == "foreach=True"))
          opts[name].step()  # warm-up: state allocated
        except (RuntimeError, TypeError, ValueError):
          opts.pop(name, None)  # this torch has no such variant
      times = {name: [] for name in opts}
      for _ in range(args.iterations):  # interleaved: every variant once per round
        for name, opt in opts.items():
          times[name].append(median_time(opt.step, 1))
      med = {name: statistics.median(t) for name, t in times.items()}
      cells = " ".join(f"{(med[v] * 1e3 if v in med else float('nan')):>18.1f}" for v in variants)
      best = min(v for name, v in med.items() if name != "hostopt")
      fused = med.get("fused=True", float("nan")) / med["hostopt"]
      print(f"{size:>6} {threads:>7} {cells} {fused:>12.2f}x {best / med['hostopt']:>17.2f}x")
      del opts

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
  layout = opt._layout["f32"]
  core, tracked, seg_of = layout.core, layout.tracked, layout.seg_of
  grads = [None] * len(seg_of)
  for t, si in zip(tracked, seg_of):
    grads[si] = t.param.grad.numpy()
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
