"""Quality of compressed optimizer state: the character-level GPT of examples/torch_lm.py
trained with f32, bf16 and 8-bit Adam moments (hostopt's one-buffer steps over flat f32
masters), the same seed, batches, cosine schedule, clipping and weight decay on matrices.

  PYTHONPATH=build/release/python python bench/compare_states.py [--steps 300] [--png states.png]

`--states f32,bf16,8bit,torchao-8bit` adds torchao's AdamW8bit on the same model (needs torchao).
Prints each format's final loss (mean of the last 10 steps), its ratio to the f32 state's and
the optimizer state's bytes per parameter.
"""

import argparse
import math
import os
import sys
from typing import Dict, List

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import torch_lm  # noqa: E402  (the model, data and schedule of the example)

import hostopt  # noqa: E402


class FlatAdamW:
  """AdamW over one flat float32 master per group; the model's parameters are views of it."""

  def __init__(self, groups: List[Dict], state: str, betas=(0.9, 0.95), seed: int = 0):
    self.groups, self.state, self.betas, self.seed, self.t = [], state, betas, seed, 0
    for g in groups:
      params = list(g["params"])
      flat = np.concatenate([p.detach().numpy().ravel() for p in params]).astype(np.float32)
      offset = 0
      for p in params:  # the model reads the master directly
        n = p.numel()
        p.data = torch.from_numpy(flat[offset:offset + n]).view(p.shape)
        offset += n
      entry = {"params": params, "flat": flat, "grad": np.zeros_like(flat), "wd": g["weight_decay"]}
      if state == "f32":
        entry["m"], entry["v"] = np.zeros_like(flat), np.zeros_like(flat)
      else:
        entry["moments"] = hostopt.CompressedMoments(flat.size, state)
      self.groups.append(entry)

  def state_bytes(self) -> int:
    total = 0
    for g in self.groups:
      total += g["flat"].nbytes + (g["m"].nbytes + g["v"].nbytes if self.state == "f32" else g["moments"].nbytes)
    return total

  def num_params(self) -> int:
    return sum(g["flat"].size for g in self.groups)

  def step(self, lr: float) -> None:
    self.t += 1
    for g in self.groups:
      offset = 0
      for p in g["params"]:
        n = p.numel()
        g["grad"][offset:offset + n] = p.grad.numpy().ravel()
        offset += n
      hyper = dict(step=self.t, lr=lr, betas=self.betas, weight_decay=g["wd"])
      if self.state == "f32":
        hostopt.adam_step(g["flat"], g["m"], g["v"], g["grad"], **hyper)
      else:
        hostopt.adam_step_compressed(g["flat"], g["moments"], g["grad"], seed=self.seed, **hyper)


class TorchaoAdamW8bit:
  """torchao's AdamW8bit (block-wise 8-bit moments, GPU-first; it runs on CPU tensors too),
  with the same interface as FlatAdamW, for the same comparison."""

  def __init__(self, groups: List[Dict], betas=(0.9, 0.95)):
    from torchao.optim import AdamW8bit
    self.params = [p for g in groups for p in g["params"]]
    self.opt = AdamW8bit(groups, lr=3e-3, betas=betas)

  def state_bytes(self) -> int:
    total = sum(p.numel() * 4 for p in self.params)
    for st in self.opt.state.values():
      for v in st.values():
        if torch.is_tensor(v) and v.numel() > 1:
          # torchao's 8-bit state: codes plus per-block scales (its tensor subclass)
          inner = [getattr(v, a) for a in ("codes", "scale", "qmap") if hasattr(v, a)]
          total += sum(t.numel() * t.element_size() for t in inner) if inner else v.numel() * v.element_size()
    return total

  def num_params(self) -> int:
    return sum(p.numel() for p in self.params)

  def step(self, lr: float) -> None:
    for g in self.opt.param_groups:
      g["lr"].fill_(lr)  # torchao keeps lr as a tensor (no recompiles)
    self.opt.step()


def train(state: str, steps: int, seed: int = 0, rounding_seed: int = 0) -> Dict:
  batch, ctx = 16, 64
  data = torch.frombuffer(bytearray(torch_lm.stdlib_text()), dtype=torch.uint8).long()
  torch.manual_seed(seed)
  model = torch_lm.CharGPT(d=64, layers=2, ctx=ctx)
  decay = [p for p in model.parameters() if p.dim() >= 2]
  other = [p for p in model.parameters() if p.dim() < 2]
  groups = [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}]
  opt = TorchaoAdamW8bit(groups) if state == "torchao-8bit" else FlatAdamW(groups, state, seed=rounding_seed)
  schedule = torch_lm.cosine(max(1, steps // 10), steps)
  gen = torch.Generator().manual_seed(seed + 1)
  losses = []
  for step in range(steps):
    starts = torch.randint(0, len(data) - ctx - 1, (batch,), generator=gen)
    x = torch.stack([data[s:s + ctx] for s in starts])
    y = torch.stack([data[s + 1:s + ctx + 1] for s in starts])
    for p in model.parameters():
      p.grad = None
    loss = F.cross_entropy(model(x).view(-1, 256), y.view(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step(3e-3 * schedule(step))
    losses.append(float(loss.detach()))
  return {"losses": losses, "bytes_per_param": opt.state_bytes() / opt.num_params()}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--steps", type=int, default=300)
  ap.add_argument("--states", default="f32,bf16,8bit",
                  help="comma-separated: f32, bf16, 8bit, and torchao-8bit (torchao.optim.AdamW8bit, if installed)")
  ap.add_argument("--rounding-seeds", type=int, default=1,
                  help="runs of bf16/8bit with rounding seeds 0..N-1: the final loss's mean and range")
  ap.add_argument("--png", help="write the loss curves to this PNG (needs matplotlib)")
  a = ap.parse_args(argv)
  runs, finals = {}, {}
  for s in a.states.split(","):
    seeds = range(a.rounding_seeds) if s in ("bf16", "8bit") else [0]
    for k in seeds:
      r = train(s, a.steps, rounding_seed=k)
      runs.setdefault(s, r)  # the curve drawn: rounding seed 0
      finals.setdefault(s, []).append(sum(r["losses"][-10:]) / 10)
  base = finals["f32"][0] if "f32" in finals else None
  for s, r in runs.items():
    f = finals[s]
    mean = sum(f) / len(f)
    spread = f" (range {min(f):.4f}..{max(f):.4f} over {len(f)} rounding seeds)" if len(f) > 1 else ""
    ratio = f"  {mean / base:.4f}x the f32 state's" if base else ""
    print(f"{s:12s} state {r['bytes_per_param']:.3f} B/param  loss {r['losses'][0]:.4f} -> {mean:.4f} "
          f"(mean of the last 10 steps){spread}{ratio}")
  if a.png:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    for s, r in runs.items():
      plt.plot(r["losses"], label=f"{s} moments ({r['bytes_per_param']:.2f} B/param)", alpha=0.8)
    plt.xlabel("step")
    plt.ylabel("loss")
    plt.legend()
    plt.savefig(a.png, dpi=120)
    print(f"wrote {a.png}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
