"""A small character-level GPT trained on Python's own standard-library sources, with
torch.optim.AdamW and with hostopt.torch.AdamW side by side: the same seed, batches, cosine
schedule with warm-up, gradient clipping and weight decay on matrices only.

It also exercises what a real training run does to an optimizer: one parameter starts
frozen and is unfrozen later (its first gradient arrives late: torch counts its steps from
there), one is re-initialised mid-run by replacing its .data, and the run is saved and
resumed (state_dict of model, optimizer and schedule) half-way.

  python examples/torch_lm.py [--steps 300] [--dtype float32|bfloat16] [--png curves.png]

tests/python/test_torch_lm.py runs a short version of it in CI.
"""

import argparse
import copy
import math
import os
import sys
from typing import Dict, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


def stdlib_text(limit: int = 400_000) -> bytes:
  """Python's standard-library sources (ships with every Python), in a fixed order."""
  root = os.path.dirname(os.__file__)
  out = bytearray()
  for name in sorted(os.listdir(root)):
    if name.endswith(".py"):
      with open(os.path.join(root, name), "rb") as f:
        out += f.read()
      if len(out) >= limit:
        break
  return bytes(out[:limit])


class Block(nn.Module):
  def __init__(self, d: int, heads: int):
    super().__init__()
    self.heads = heads
    self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
    self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
    self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    b, t, d = x.shape
    q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
    q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
    att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
    mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
    att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    y = (att @ v).transpose(1, 2).reshape(b, t, d)
    x = x + self.proj(y)
    return x + self.out(F.gelu(self.fc(self.ln2(x))))


class CharGPT(nn.Module):
  def __init__(self, vocab: int = 256, d: int = 64, layers: int = 2, heads: int = 4, ctx: int = 64):
    super().__init__()
    self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
    self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
    self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

  def forward(self, idx: torch.Tensor) -> torch.Tensor:
    x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
    for blk in self.blocks:
      x = blk(x)
    return self.head(self.ln(x))


def make_optimizer(kind: str, model: nn.Module, lr: float):
  """Weight decay on matrices only (the usual GPT recipe)."""
  decay = [p for p in model.parameters() if p.dim() >= 2]
  other = [p for p in model.parameters() if p.dim() < 2]
  groups = [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}]
  if kind == "torch":
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))
  import hostopt.torch
  return hostopt.torch.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def cosine(warmup: int, total: int):
  return lambda s: (s + 1) / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, total - warmup)))


def train(kind: str, steps: int, dtype: torch.dtype = torch.float32, seed: int = 0, resume_at: Optional[int] = None,
          unfreeze_at: Optional[int] = None, reinit_at: Optional[int] = None, size: Optional[Dict] = None) -> Dict:
  """Trains with optimizer `kind` ("torch" or "hostopt"); returns losses and the model."""
  size = size or {}
  batch, ctx = size.get("batch", 16), size.get("ctx", 64)
  data = torch.frombuffer(bytearray(stdlib_text()), dtype=torch.uint8).long()
  torch.manual_seed(seed)
  model = CharGPT(d=size.get("d", 64), layers=size.get("layers", 2), ctx=ctx).to(dtype)
  opt = make_optimizer(kind, model, lr=3e-3)
  sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine(max(1, steps // 10), steps))
  gen = torch.Generator().manual_seed(seed + 1)
  frozen = model.pos.weight
  if unfreeze_at is not None:
    frozen.requires_grad_(False)  # its first gradient arrives at unfreeze_at
  losses: List[float] = []
  step = 0
  while step < steps:
    if resume_at is not None and step == resume_at:
      # Save everything, build a new run from the saved state, and go on with that one.
      saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                             "gen": gen.get_state(), "frozen": frozen.requires_grad})
      torch.manual_seed(seed + 99)
      model = CharGPT(d=size.get("d", 64), layers=size.get("layers", 2), ctx=ctx).to(dtype)
      model.load_state_dict(saved["model"])
      opt = make_optimizer(kind, model, lr=3e-3)
      # The schedule first: its constructor sets the lr, which the optimizer's state replaces.
      sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine(max(1, steps // 10), steps))
      opt.load_state_dict(saved["opt"])
      sched.load_state_dict(saved["sched"])
      gen.set_state(saved["gen"])
      frozen = model.pos.weight
      frozen.requires_grad_(saved["frozen"])
      resume_at = None
    if unfreeze_at is not None and step == unfreeze_at:
      frozen.requires_grad_(True)
    if reinit_at is not None and step == reinit_at:
      g = torch.Generator().manual_seed(seed + 7)
      model.head.weight.data = (torch.randn(model.head.weight.shape, generator=g) * 0.02).to(dtype)
    starts = torch.randint(0, len(data) - ctx - 1, (batch,), generator=gen)
    x = torch.stack([data[s:s + ctx] for s in starts])
    y = torch.stack([data[s + 1:s + ctx + 1] for s in starts])
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x).float().view(-1, 256), y.view(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    losses.append(float(loss.detach()))
    step += 1
  return {"losses": losses, "model": model, "opt": opt}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--steps", type=int, default=300)
  ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
  ap.add_argument("--png", help="write both loss curves to this PNG (needs matplotlib)")
  a = ap.parse_args(argv)
  dtype = getattr(torch, a.dtype)
  events = dict(resume_at=a.steps // 2, unfreeze_at=a.steps // 5, reinit_at=a.steps // 3)
  runs = {kind: train(kind, a.steps, dtype, **events) for kind in ("torch", "hostopt")}
  for kind, r in runs.items():
    print(f"{kind:8s} loss {r['losses'][0]:.4f} -> {sum(r['losses'][-10:]) / 10:.4f} (mean of the last 10 steps)")
  diff = max(abs(a_ - b_) for a_, b_ in zip(runs["torch"]["losses"], runs["hostopt"]["losses"]))
  print(f"largest loss difference over {a.steps} steps: {diff:.2e}")
  if a.png:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    for kind, r in runs.items():
      plt.plot(r["losses"], label=f"{kind} ({a.dtype})", alpha=0.8)
    plt.xlabel("step")
    plt.ylabel("loss")
    plt.legend()
    plt.savefig(a.png, dpi=120)
    print(f"wrote {a.png}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
