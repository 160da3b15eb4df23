#!/usr/bin/env python3
"""ZeRO-2 with offload on torch.distributed (gloo on CPU) and hostopt.

Each rank keeps only its shard of the optimizer state (hostopt._core.ShardedOptimizer).
Each step the ranks' gradients, flattened into the optimizer's arena layout, are summed
(gloo has no reduce_scatter on CPU, so all_reduce, and each rank keeps its slice — NCCL
would use reduce_scatter), the global norm is the all_reduce of the shards' sums of
squares (with each rank's check_step verdict: a step refused on one rank is refused on
all), every rank steps its shard, and all_gather brings back the parameters.

Rank 0 then replays the summed gradients through a single-process hostopt optimizer and
checks the parameters bit for bit.

  PYTHONPATH=build/release/python .venv/bin/python examples/torch_distributed.py --world 2
"""
import argparse
import os
import socket
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import hostopt
from hostopt import _core

GROUPS = [{"config": {"lr": 1e-2, "weight_decay": 0.1, "mode": "adamw"},
           "tensors": [("embed", [500, 16]), ("w1", [16, 64]), ("w2", [64, 16])]},
          {"config": {"lr": 1e-2}, "tensors": [("b1", [64]), ("b2", [16])]}]


def grad_of(step, rank, n):
  # Multiples of 2^-12: sums over ranks are exact in f32, whatever order gloo adds them in.
  i = np.arange(n, dtype=np.uint64)
  h = (i * np.uint64(2654435761)) ^ np.uint64(step * 40503 + rank * 977)
  return (((h % np.uint64(4001)).astype(np.int64) - 2000) / 4096.0).astype(np.float32)


def run(rank, world, port, steps, result_file):
  os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
  dist.init_process_group("gloo", rank=rank, world_size=world)
  opt = _core.ShardedOptimizer(GROUPS, world, rank, threads=1)
  n = opt.arena_size
  begin, end = opt.shard
  init = np.sin(0.01 * np.arange(n, dtype=np.float32)).astype(np.float32)
  for name, shape, off, size, group in opt.segments():
    opt.set_params(name, init[off:off + size].copy())
  ranges = [_core.shard_of(n, world, r) for r in range(world)]
  widest = max(e - b for b, e in ranges)
  params = np.zeros(n, np.float32)
  norms = []
  for t in range(steps):
    grad = torch.from_numpy(grad_of(t, rank, n))
    dist.all_reduce(grad, op=dist.ReduceOp.SUM)
    shard_grad = grad.numpy()[begin:end].copy()
    shard_params = np.zeros(end - begin, np.float32)
    # A step given known_grad_norm makes no collective of its own: this rank's verdict on
    # its step (check_step) rides with its sum of squares in the norm's all_reduce, so a
    # step refused on one rank is refused on all, none left waiting in the next collective.
    try:
      opt.check_step(shard_grad, "f32", shard_params, "f32", 1.0, -1.0, 50.0)
      refused, reason = 0.0, ""
    except Exception as e:  # any local failure joins the agreement: never raised alone while others wait
      refused, reason = 1.0, f": rank {rank} refused it: {e}"
    local = torch.tensor([0.0 if refused else opt.shard_sum_squares(shard_grad), refused], dtype=torch.float64)
    dist.all_reduce(local, op=dist.ReduceOp.SUM)
    if local[1].item() > 0:
      raise RuntimeError(f"step {t} refused by {int(local[1].item())} of {world} ranks{reason}")
    norm = float(np.sqrt(local[0].item()))
    norms.append(norm)
    opt.step(shard_grad, "f32", shard_params, "f32", 1.0, norm, 50.0)
    padded = torch.zeros(widest)
    padded[:end - begin] = torch.from_numpy(shard_params)
    gathered = [torch.zeros(widest) for _ in range(world)]
    dist.all_gather(gathered, padded)
    for (lo, hi), g in zip(ranges, gathered):
      params[lo:hi] = g.numpy()[:hi - lo]
  if rank == 0:
    single = hostopt.Optimizer([{"params": dict((n_, s) for n_, s in g["tensors"]), **g["config"]} for g in GROUPS],
                               threads=1)
    single.params()[:] = 0
    for name, shape, off, size, group in opt.segments():
      single.params(name)[:] = init[off:off + size].reshape(shape)
    for t in range(steps):
      summed = sum(grad_of(t, r, n) for r in range(world)).astype(np.float32)
      step_single(single, summed, norms[t])
    ok = all(np.array_equal(params[off:off + size], single.params()[off:off + size])
             for name, shape, off, size, group in opt.segments())
    with open(result_file, "w") as f:
      f.write("bit-identical" if ok else "MISMATCH")
    print(f"torch_distributed: {world} ranks, {steps} steps, {n} arena elements, "
          f"{opt.state_bytes} bytes of state on rank 0: {'bit-identical to' if ok else 'MISMATCH with'} the single process")
  dist.destroy_process_group()


def step_single(single, summed, norm):
  # Same clipping as the shards: the norm all-reduced by the ranks, max norm 50.
  scale = 1.0 if norm < 50.0 else 50.0 / norm
  single._core.step_flat(summed, "f32", None, "f32", float(np.float32(scale)))


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--world", type=int, default=2)
  ap.add_argument("--steps", type=int, default=10)
  args = ap.parse_args()
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  result = f"/tmp/hostopt_torch_distributed_{os.getpid()}.txt"
  mp.spawn(run, args=(args.world, port, args.steps, result), nprocs=args.world, join=True)
  with open(result) as f:
    ok = f.read() == "bit-identical"
  os.remove(result)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
