"""Sharded steps over torch.distributed (gloo on CPU, one process per rank): a step refused
on one rank is refused on every rank with ShardedStepRefused, nothing applied, instead of
the other ranks waiting in the norm's all-reduce for good. The processes' join timeout
(120 s) is only a safety net that turns a hang into a failure, never a bound on speed."""
import json
import os
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():
  pytest.skip("torch.distributed is not available", allow_module_level=True)

from hostopt import _core  # noqa: E402

HANG_NET_S = 120

# One rank: steps once with its fault (or none), then once more with valid inputs; prints
# what happened as one JSON line.
RANK = r"""
import json, sys
import numpy as np
import torch
import torch.distributed as dist
from hostopt import _core

rank, world, bad, fault, store = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world)
groups = [{"config": {"lr": 1e-2}, "tensors": [("w", [100, 3]), ("b", [7])]}]
opt = _core.ShardedOptimizer(groups, world, rank, threads=1)

def all_sum(local):
  t = torch.tensor([local], dtype=torch.float64)
  dist.all_reduce(t, op=dist.ReduceOp.SUM)
  return t.item()

b, e = opt.shard
grad = np.linspace(-1.0, 1.0, opt.arena_size, dtype=np.float32)[b:e].copy()
out = np.full(e - b, -1.0, np.float32)
mine = grad
if rank == bad and fault.endswith("size"):
  mine = grad[:-1].copy()
if rank == bad and fault.endswith("dtype"):
  mine = grad.astype(np.float64)
# Arguments that fail to convert (before the binding's code, once) and invalid options.
gdt, kw = "f32", dict(max_grad_norm=5.0)
if fault == "unchecked_nan_max_norm":
  kw["skip_nonfinite"] = False
if rank == bad:
  if fault == "dtype_name_none": gdt = None
  if fault == "known_norm_none": kw["known_grad_norm"] = None
  if fault == "grad_scale_str": kw["grad_scale"] = "1.0"
  if fault == "skip_nonfinite_none": kw["skip_nonfinite"] = None
  if fault == "unchecked_nan_max_norm": kw["max_grad_norm"] = float("nan")
result = {"rank": rank}
try:
  if fault.startswith("agree_step"):  # a step given the norm: the caller agrees first
    opt.agree_step(mine, "f32", out, "f32", known_grad_norm=2.0, max_grad_norm=5.0, sum_across_ranks=all_sum)
    opt.step(mine, "f32", out, "f32", known_grad_norm=2.0, max_grad_norm=5.0)
  else:
    opt.set_norm_reduction(all_sum)
    opt.step(mine, gdt, out, "f32", **kw)
  result["refused"] = None
except Exception as ex:
  result["refused"] = [type(ex).__name__, str(ex), isinstance(ex, _core.ShardedStepRefused),
                       isinstance(ex, RuntimeError)]
result["step_count"] = opt.step_count
result["out_untouched"] = bool((out == -1.0).all())
# The same step, valid on every rank: the ranks' collectives are still in step.
if fault.startswith("agree_step"):
  opt.agree_step(grad, "f32", out, "f32", known_grad_norm=2.0, max_grad_norm=5.0, sum_across_ranks=all_sum)
  result["again"] = list(opt.step(grad, "f32", out, "f32", known_grad_norm=2.0, max_grad_norm=5.0))
else:
  result["again"] = list(opt.step(grad, "f32", out, "f32", max_grad_norm=5.0))
dist.destroy_process_group()
print(json.dumps(result))
"""


def run_world(tmp_path, world, bad, fault):
  env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
  store = str(tmp_path / f"store-{world}-{bad}-{fault}")
  procs = [subprocess.Popen([sys.executable, "-c", RANK, str(r), str(world), str(bad), fault, store], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
  deadline = time.monotonic() + HANG_NET_S
  outputs, hung = [], []
  for r, p in enumerate(procs):
    try:
      outputs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic())))
    except subprocess.TimeoutExpired:
      hung.append(r)
      outputs.append(("", ""))
  for r in hung:
    procs[r].kill()
    procs[r].communicate()
  assert not hung, f"ranks {hung} still running after {HANG_NET_S} s: left waiting in a collective"
  results = []
  for r, (p, (out, err)) in enumerate(zip(procs, outputs)):
    assert p.returncode == 0, f"rank {r} exited with {p.returncode}:\n{err}"
    results.append(json.loads(out.strip().splitlines()[-1]))
  return results


@pytest.mark.parametrize("world,bad,fault,reason", [
    (2, 0, "size", "shard_grad.size = "),
    (2, 1, "dtype", "shard_grad: numpy dtype float64 does not hold f32"),
    (3, 1, "dtype", "shard_grad: numpy dtype float64 does not hold f32"),
    (3, 2, "size", "shard_grad.size = "),
    (3, 0, "agree_step size", "shard_grad.size = "),
    (3, 2, "agree_step dtype", "shard_grad: numpy dtype float64 does not hold f32"),
    (3, 2, "dtype_name_none", "grad_dtype = None: expected a string"),
    (2, 0, "dtype_name_none", "grad_dtype = None: expected a string"),
    (2, 1, "known_norm_none", "known_grad_norm = None: expected a real number"),
    (2, 1, "grad_scale_str", "grad_scale = '1.0': expected a real number"),
    (2, 0, "skip_nonfinite_none", "skip_nonfinite = None: expected a bool"),
    (2, 1, "unchecked_nan_max_norm", "max_grad_norm = nan: expected a finite value"),
])
def test_a_step_refused_on_one_rank_is_refused_on_every_rank(tmp_path, world, bad, fault, reason):
  results = run_world(tmp_path, world, bad, fault)
  for r, res in enumerate(results):
    assert res["refused"] is not None, f"rank {r} applied a step that rank {bad} refused"
    kind, message, is_refused, is_runtime_error = res["refused"]
    assert (kind, is_refused, is_runtime_error) == ("ShardedStepRefused", True, True), message
    assert message.startswith(f"sharded step refused by 1 of {world} ranks (rank {bad})"), message
    assert message.endswith("nothing was applied on any rank"), message
    if r == bad:
      assert f"rank {bad} refused it: {reason}" in message
    else:
      assert "see that rank's error" in message and reason not in message
    assert res["step_count"] == 0 and res["out_untouched"]
    assert res["again"] == [True, 1]


def test_sharded_step_refused_is_a_runtime_error():
  assert issubclass(_core.ShardedStepRefused, RuntimeError)
