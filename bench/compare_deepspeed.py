#!/usr/bin/env python3
"""hostopt.torch.AdamW vs DeepSpeed's DeepSpeedCPUAdam (the ZeRO-Offload CPU optimizer), in
one process per thread count, interleaved round by round:

- fp32: f32 parameters and gradients, both step in place;
- mixed: bf16 parameters and gradients (what a GPU model holds), f32 masters on the host.
  DeepSpeed steps its f32 masters and then casts them into the bf16 parameters (what
  ZeRO-Offload does after the CPU step); hostopt fuses the cast into its step.

Needs PyPI deepspeed in the torch 2 venv; with DS_ACCELERATOR=cpu its op builder compiles
cpu_adam on first use (a minute or two):

  .venv-torch2/bin/python -m pip install deepspeed
  DS_ACCELERATOR=cpu PYTHONPATH=build/release/python .venv-torch2/bin/python bench/compare_deepspeed.py \\
      --sizes 64M,256M --threads 1,2
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


def run_one(size: str, threads: int, iterations: int, tensors: int) -> int:
  """Runs in a child with OMP_NUM_THREADS set (DeepSpeed's kernel takes OpenMP's count)."""
  import torch
  import hostopt
  import hostopt.torch as htorch
  from deepspeed.ops.adam import DeepSpeedCPUAdam
  torch.set_num_threads(threads)
  n = parse_size(size)
  shapes = [n // tensors] * (tensors - 1) + [n - (n // tensors) * (tensors - 1)]
  gen = torch.Generator().manual_seed(0)
  rows = []
  for mode in ("fp32", "mixed"):
    steps = {}
    if mode == "fp32":
      ds_params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
      for p in ds_params:
        p.grad = torch.randn(p.shape, generator=gen) * 0.01
      ho_params = [torch.nn.Parameter(p.detach().clone()) for p in ds_params]
      for p, q in zip(ho_params, ds_params):
        p.grad = q.grad.clone()
      ds = DeepSpeedCPUAdam(ds_params, lr=1e-3, weight_decay=0.01, adamw_mode=True)
      steps["deepspeed"] = ds.step
    else:
      # The "device" bf16 parameters and gradients; DeepSpeed's f32 masters get the
      # gradients as f32 (what ZeRO-Offload hands its CPU optimizer) and are cast back.
      dev = [torch.randn(s, generator=gen).to(torch.bfloat16) for s in shapes]
      masters = [torch.nn.Parameter(d.float()) for d in dev]
      for m in masters:
        m.grad = (torch.randn(m.shape, generator=gen) * 0.01).to(torch.bfloat16).float()
      ds = DeepSpeedCPUAdam(masters, lr=1e-3, weight_decay=0.01, adamw_mode=True)

      def ds_step(ds=ds, masters=masters, dev=dev):
        ds.step()
        with torch.no_grad():
          for d, m in zip(dev, masters):
            d.copy_(m)  # the cast DeepSpeed's offload does after the step

      steps["deepspeed"] = ds_step
      ho_params = [torch.nn.Parameter(d.clone()) for d in dev]
      for p, m in zip(ho_params, masters):
        p.grad = m.grad.to(torch.bfloat16)
    ho = htorch.AdamW(ho_params, lr=1e-3, weight_decay=0.01, threads=threads)
    steps["hostopt"] = ho.step
    for fn in steps.values():
      fn()  # warm-up: state allocated, pages touched
    times = {k: [] for k in steps}
    for _ in range(iterations):
      for k, fn in steps.items():
        t0 = time.perf_counter()
        fn()
        times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    rows.append((mode, med["deepspeed"], med["hostopt"]))
    del ds, ho, steps
  for mode, d, h in rows:
    bytes_per = 28  # p, m, v read + written (24) + a f32 gradient (fp32), or bf16 gradient + bf16 copy-out (mixed)
    print(f"{size:>6} {threads:>7} {mode:>6} {d * 1e3:>14.1f} {h * 1e3:>11.1f} {d / h:>9.2f}x "
          f"{parse_size(size) * bytes_per / h / 1e9:>12.1f}", flush=True)
  print(f"# hostopt {hostopt.__version__} ({hostopt.active_kernel()}), torch {torch.__version__}", flush=True)
  return 0


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--sizes", default="64M")
  ap.add_argument("--threads", default="1,2")
  ap.add_argument("--iterations", type=int, default=7)
  ap.add_argument("--tensors", type=int, default=64)
  ap.add_argument("--child", nargs=2, metavar=("SIZE", "THREADS"), help=argparse.SUPPRESS)
  a = ap.parse_args()
  if a.child:
    return run_one(a.child[0], int(a.child[1]), a.iterations, a.tensors)
  try:
    import deepspeed  # noqa: F401
  except ImportError as e:
    print(f"skipped: {e} (pip install deepspeed in the torch 2 venv; DS_ACCELERATOR=cpu)")
    return 0
  print(f"{'size':>6} {'threads':>7} {'mode':>6} {'deepspeed ms':>14} {'hostopt ms':>11} {'speedup':>10} "
        f"{'hostopt GB/s':>12}")
  for size in a.sizes.split(","):
    for threads in a.threads.split(","):
      env = dict(os.environ, OMP_NUM_THREADS=threads, DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"))
      r = subprocess.run([sys.executable, __file__, "--child", size, threads, "--iterations", str(a.iterations),
                          "--tensors", str(a.tensors)], env=env, capture_output=True, text=True)
      lines = [l for l in r.stdout.splitlines() if not l.startswith("#") and l.strip()]
      if r.returncode != 0 or not lines:
        print(f"{size} {threads}: failed (rc {r.returncode}): {r.stderr.strip().splitlines()[-3:]}")
        continue
      print("\n".join(lines[-2:]), flush=True)
  print("speedup = DeepSpeed's time / hostopt's; the mixed row's DeepSpeed time includes the cast its offload "
        "performs after the step (hostopt fuses it). GB/s: the bytes the step must move (28 per parameter, fp32 "
        "and mixed) over hostopt's time.")
  return 0


if __name__ == "__main__":
  sys.exit(main())
