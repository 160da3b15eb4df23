"""A small character-level transformer in plain JAX trained on Python's own standard-library
sources, with optax.adamw and with hostopt.jax (state in host memory) side by side: the same
seed and batches, a cosine schedule with warm-up, gradient clipping by global norm and
weight decay on matrices only. Prints both loss curves, the largest parameter difference at
the end, and with --png draws the two curves (matplotlib).

  python examples/jax_lm.py [--steps 300] [--png curves.png]

tests/python/test_jax_lm.py runs a short version of it in CI.
"""

import argparse
import math
import os
import sys
from typing import Dict, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax


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


def init_params(key, vocab=256, d=64, layers=2, ctx=64) -> Dict:
  keys = iter(jax.random.split(key, 4 + 4 * layers))
  dense = lambda k, i, o: jax.random.normal(k, (i, o), jnp.float32) * (0.02 if i < 4 * d else 0.02 / math.sqrt(2))
  params = {"tok": jax.random.normal(next(keys), (vocab, d)) * 0.02, "pos": jax.random.normal(next(keys), (ctx, d)) * 0.02,
            "ln": {"g": jnp.ones(d), "b": jnp.zeros(d)}, "head": {"w": dense(next(keys), d, vocab), "b": jnp.zeros(vocab)},
            "blocks": []}
  for _ in range(layers):
    params["blocks"].append({
        "ln1": {"g": jnp.ones(d), "b": jnp.zeros(d)}, "ln2": {"g": jnp.ones(d), "b": jnp.zeros(d)},
        "qkv": {"w": dense(next(keys), d, 3 * d), "b": jnp.zeros(3 * d)},
        "proj": {"w": dense(next(keys), d, d), "b": jnp.zeros(d)},
        "fc": {"w": dense(next(keys), d, 4 * d), "b": jnp.zeros(4 * d)},
        "out": {"w": dense(next(keys), 4 * d, d), "b": jnp.zeros(d)}})
  return params


def layer_norm(x, p):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) / jnp.sqrt(var + 1e-5) * p["g"] + p["b"]


def forward(params, idx, heads=4):
  b, t = idx.shape
  x = params["tok"][idx] + params["pos"][:t]
  d = x.shape[-1]
  mask = jnp.tril(jnp.ones((t, t), bool))
  for blk in params["blocks"]:
    qkv = layer_norm(x, blk["ln1"]) @ blk["qkv"]["w"] + blk["qkv"]["b"]
    q, k, v = (z.reshape(b, t, heads, d // heads).transpose(0, 2, 1, 3) for z in jnp.split(qkv, 3, axis=-1))
    att = jnp.where(mask, q @ k.transpose(0, 1, 3, 2) / math.sqrt(d // heads), -jnp.inf)
    y = (jax.nn.softmax(att, axis=-1) @ v).transpose(0, 2, 1, 3).reshape(b, t, d)
    x = x + y @ blk["proj"]["w"] + blk["proj"]["b"]
    h = jax.nn.gelu(layer_norm(x, blk["ln2"]) @ blk["fc"]["w"] + blk["fc"]["b"])
    x = x + h @ blk["out"]["w"] + blk["out"]["b"]
  return layer_norm(x, params["ln"]) @ params["head"]["w"] + params["head"]["b"]


def loss_fn(params, batch):
  logits = forward(params, batch[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def batches(data: np.ndarray, steps: int, batch: int, ctx: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  for _ in range(steps):
    starts = rng.integers(0, len(data) - ctx - 1, batch)
    yield jnp.asarray(np.stack([data[s:s + ctx + 1] for s in starts]).astype(np.int32))


def train(kind: str, steps: int, size: Optional[Dict] = None, lr: float = 3e-3, clip: float = 1.0, seed: int = 0):
  size = dict(dict(batch=16, ctx=64, d=64, layers=2), **(size or {}))
  data = np.frombuffer(stdlib_text(), np.uint8)
  params = init_params(jax.random.PRNGKey(seed), d=size["d"], layers=size["layers"], ctx=size["ctx"])
  schedule = optax.warmup_cosine_decay_schedule(0.0, lr, max(1, steps // 10), steps, lr * 0.1)
  decay = jax.tree_util.tree_map(lambda x: x.ndim >= 2, params)  # matrices only
  grad_fn = jax.jit(jax.value_and_grad(loss_fn))
  losses = []
  if kind == "optax":
    opt = optax.chain(optax.clip_by_global_norm(clip),
                      optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1, mask=decay))
    state = opt.init(params)

    @jax.jit
    def apply(p, s, g):
      u, s = opt.update(g, s, p)
      return optax.apply_updates(p, u), s
    for batch in batches(data, steps, size["batch"], size["ctx"], seed):
      loss, g = grad_fn(params, batch)
      params, state = apply(params, state, g)
      losses.append(float(loss))
    return {"losses": losses, "params": params}
  import hostopt.jax as hj
  opt = hj.adamw(params, schedule, b1=0.9, b2=0.95, weight_decay=0.1, mask=decay, max_grad_norm=clip)
  for batch in batches(data, steps, size["batch"], size["ctx"], seed):
    loss, g = grad_fn(params, batch)
    params = opt.step(g)
    losses.append(float(loss))
  return {"losses": losses, "params": jax.tree_util.tree_map(jnp.copy, params), "opt": opt}


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--steps", type=int, default=300)
  ap.add_argument("--png", help="write both loss curves to this PNG (needs matplotlib)")
  args = ap.parse_args()
  jax.config.update("jax_platform_name", "cpu")
  runs = {kind: train(kind, args.steps) for kind in ("optax", "hostopt")}
  a, b = runs["optax"], runs["hostopt"]
  for i in range(0, args.steps, max(1, args.steps // 10)):
    print(f"step {i:4d}  optax {a['losses'][i]:.4f}  hostopt.jax {b['losses'][i]:.4f}")
  diff = max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree_util.tree_leaves(a["params"]),
                                                            jax.tree_util.tree_leaves(b["params"])))
  print(f"final loss: optax {a['losses'][-1]:.4f}, hostopt.jax {b['losses'][-1]:.4f}; "
        f"largest final parameter difference {diff:.2e}")
  mem = b["opt"].memory()
  print(f"hostopt.jax host memory: state {mem['state_bytes'] / 2**20:.1f} MiB "
        f"({mem['state_bytes_per_param']:.2f} bytes/param), copy-out buffers {mem['copy_out_bytes'] / 2**20:.1f} MiB; "
        f"{mem['host_bytes_per_param']:.2f} bytes/param in all")
  if args.png:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.figure(figsize=(7, 4))
    plt.plot(a["losses"], label="optax.adamw")
    plt.plot(b["losses"], "--", label="hostopt.jax.adamw (state in host memory)")
    plt.xlabel("step")
    plt.ylabel("training loss (cross-entropy)")
    plt.title("char transformer on Python's stdlib sources")
    plt.legend()
    plt.tight_layout()
    plt.savefig(args.png, dpi=120)
    print(f"wrote {args.png}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
