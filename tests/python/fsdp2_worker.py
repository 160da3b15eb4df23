"""One rank of test_integration_fsdp2.py: a small model under torch FSDP2 (fully_shard per
layer and at the root, CPUOffloadPolicy: the sharded parameters, their gradients and the
optimizer on the CPU) over gloo, trained by hostopt.torch.AdamW on each rank's local shards.

usage: fsdp2_worker.py OUT RANK WORLD PORT MODE
  MODE "train": for each experiment, 200 steps recording the global loss (the ranks' mean),
      with a torch.distributed.checkpoint save of the model and optimizer at step 100; then a
      fresh model (another init), fresh fully_shard and optimizer load that checkpoint and run
      steps 100-200 again. Rank 0 writes OUT/train-WORLD.json: each experiment's losses, the
      resumed run's, and whether every rank's final shards and state equal bitwise.
  MODE "bad": 8-bit moments (non-finite gradients skipped), 10 steps: at step 3 rank 1 alone
      has an inf in its gradient shard, at step 5 rank 1 alone a NaN learning rate (then put
      back, and the step taken again). Each rank prints what its optimizer did at each step as
      one JSON line "steps: [...]", and whether its shards were untouched by the refused step.
  MODE "fsdp_tp": 4 ranks, a (2, 2) mesh: tensor parallelism (colwise, rowwise) inside, FSDP2
      over the other dimension (its _StridedShard placements), 8-bit moments: 3 steps, a DCP
      save, a fresh model and optimizer loading it, then 2 more steps on both; prints
      "fsdp_tp: {...}": whether the loaded state and the final shards equal bitwise.
  MODE "store": 8-bit moments in a store per rank (store=OUT/store): first refused where rank 1's
      directory is a file (what rank 0 made taken back); then 6 steps against the in-RAM
      optimizer's, DCP's get_state_dict / save / load / set_state_dict of its own state, then
      rank 1's store put back to step 4 (two behind rank 0's), then to step 5 (one behind, as
      a kill between the ranks' commits leaves them): resume=True in a fresh model; prints
      "store: {...}": the refusal, the step resumed at, and whether the shards equal the
      in-RAM run's at that step and after 4 more.
  MODE "reshard": loads OUT/ckpt-2-hostopt-8bit (saved by 2 ranks) into 3 ranks' fresh model
      and optimizer, and prints "refused: ERROR" where the load is refused; then loads
      OUT/ckpt-2-hostopt-f32 (f32 moments reshard) and trains steps 100-200, rank 0 printing
      the losses as one JSON line "resumed: [...]".
"""
import gc
import json
import math
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

import hostopt.torch

IN, HIDDEN, OUT = 16, 40, 2  # dim 0 of 40 and 2 over 3 ranks: uneven shards, and an empty one
BATCH = 24  # split evenly over 1, 2 and 3 ranks
STEPS, SAVE_AT = 200, 100
LR = 3e-3


class Model(torch.nn.Module):
  def __init__(self):
    super().__init__()
    self.inp = torch.nn.Linear(IN, HIDDEN)
    self.norm = torch.nn.LayerNorm(HIDDEN)
    self.hidden = torch.nn.Linear(HIDDEN, HIDDEN)
    self.out = torch.nn.Linear(HIDDEN, OUT)

  def forward(self, x):
    h = torch.tanh(self.norm(self.inp(x)))
    return self.out(torch.tanh(self.hidden(h)) + h)


def make_model(seed: int) -> Model:
  torch.manual_seed(seed)
  return Model()


def batch(step: int):
  """The global batch of a step (every rank, and the one-process run, make the same)."""
  g = torch.Generator().manual_seed(1000 + step)
  x = torch.randn(BATCH, IN, generator=g)
  y = torch.stack([x[:, :8].sum(1).sin(), x[:, 8:].prod(1).tanh()], 1)
  return x, y


def local_loss(model, step: int, rank: int, world: int):
  x, y = batch(step)
  rows = BATCH // world
  x, y = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
  return torch.nn.functional.mse_loss(model(x), y)


def make_optimizer(model, kind: str, moments: str, lr: float = LR, **store):
  decay = [p for n, p in model.named_parameters() if n.endswith("weight") and "norm" not in n]
  rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and "norm" not in n)]
  groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
  if kind == "torch":
    return torch.optim.AdamW(groups, lr=lr)
  return hostopt.torch.AdamW(groups, lr=lr, moments=moments, threads=1, **store)


def sharded(model):
  policy = CPUOffloadPolicy(pin_memory=False)  # (pinning needs CUDA)
  for layer in (model.inp, model.hidden, model.out):
    fully_shard(layer, offload_policy=policy)
  fully_shard(model, offload_policy=policy)
  return model


def train(model, opt, rank, world, start, stop, clip=1.0):
  losses = []
  for step in range(start, stop):
    loss = local_loss(model, step, rank, world)
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)  # (the norm of DTensor gradients: global)
    opt.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    losses.append(float(mean) / world)
  return losses


def shards_and_state(model, opt) -> list:
  """This rank's local shards of every parameter and optimizer state tensor, in a fixed order."""
  out = [p.to_local().clone() for p in model.parameters()]
  sd = opt.state_dict()
  for index in sorted(sd["state"]):
    for key in sorted(sd["state"][index]):
      v = sd["state"][index][key]
      out.append(v.to_local().clone() if hasattr(v, "to_local") else torch.as_tensor(v).clone())
  return out


def run_experiment(out, rank, world, kind, moments):
  model = sharded(make_model(0))
  opt = make_optimizer(model, kind, moments)
  losses = train(model, opt, rank, world, 0, SAVE_AT)
  where = os.path.join(out, f"ckpt-{world}-{kind}-{moments}")
  msd, osd = get_state_dict(model, opt)
  dcp.save({"model": msd, "optim": osd}, checkpoint_id=where)
  losses += train(model, opt, rank, world, SAVE_AT, STEPS)
  result = {"losses": losses}
  if kind == "hostopt":
    # Resumed by a fresh job's objects: another init, so only the checkpoint carries the state.
    model2 = sharded(make_model(1))
    opt2 = make_optimizer(model2, kind, moments)
    msd2, osd2 = get_state_dict(model2, opt2)
    state = {"model": msd2, "optim": osd2}
    dcp.load(state, checkpoint_id=where)
    set_state_dict(model2, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    result["resumed"] = train(model2, opt2, rank, world, SAVE_AT, STEPS)
    mine, theirs = shards_and_state(model, opt), shards_and_state(model2, opt2)
    same = len(mine) == len(theirs) and all(a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))
                                            for a, b in zip(mine, theirs))
    flag = torch.tensor([1.0 if same else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    result["bitwise"] = bool(flag.item() == 1.0)
    result["state_keys"] = sorted({key for st in opt.state_dict()["state"].values() for key in st})
    result["dtensor_state"] = all(hasattr(v, "to_local") for st in opt.state_dict()["state"].values()
                                  for key, v in st.items() if key != "step")
  return result


def main():
  out, rank, world, port, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
  os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
  # The timeout is a safety net that turns a hang into a failure, never a bound on speed.
  dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
  torch.use_deterministic_algorithms(True)
  if mode == "bad":
    bad_inputs(rank, world)
  elif mode == "reshard":
    reshard(out, rank, world)
  elif mode == "fsdp_tp":
    fsdp_with_tensor_parallel(out, rank)
  elif mode == "store":
    stored(out, rank, world)
  else:
    experiments = {2: [("torch", "f32"), ("hostopt", "f32"), ("hostopt", "8bit")],
                   3: [("hostopt", "f32"), ("hostopt", "bf16")]}[world]
    results = {f"{kind}-{moments}": run_experiment(out, rank, world, kind, moments) for kind, moments in experiments}
    if rank == 0:
      with open(os.path.join(out, f"train-{world}.json"), "w") as f:
        json.dump(results, f)
  gc.collect()  # (what the teardown below would have finalised, finalised while all is alive)
  dist.barrier()
  dist.destroy_process_group()
  # Leave without the interpreter's teardown. FSDP2's device meshes keep the gloo group alive
  # past destroy_process_group, and its worker thread can drop a finished collective (here the
  # barrier, holding the all-reduces before it) a moment after the caller returned from it; if
  # this interpreter is finalizing by then, that thread's GIL acquire for the collective's
  # tensors ends the process in std::terminate ("terminate called without an active
  # exception"; the race pytorch/pytorch#179291 describes). 2 in 30 runs of mode "bad" aborted
  # so. Everything this rank reports is written and flushed by now.
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(0)


def bad_inputs(rank, world):
  model = sharded(make_model(0))
  opt = make_optimizer(model, "hostopt", "8bit")
  told = []
  for step in range(10):
    loss = local_loss(model, step, rank, world)
    opt.zero_grad()
    loss.backward()
    if step == 3 and rank == 1:  # this rank's gradient shard alone is not finite
      model.hidden.weight.grad.to_local()[0, 0] = math.inf
    if step == 5 and rank == 1:
      opt.param_groups[0]["lr"] = math.nan
    before = [p.to_local().clone() for p in model.parameters()]
    try:
      opt.step()
    except (ValueError, RuntimeError) as e:
      untouched = all(torch.equal(a, p.to_local()) for a, p in zip(before, model.parameters()))
      print(f"refused at step {step}: {type(e).__name__}: {e}", flush=True)
      print("untouched: " + json.dumps(untouched), flush=True)
      opt.param_groups[0]["lr"] = LR
      opt.step()  # the same gradients, stepped on every rank
    s = opt.last_step
    told.append([step, s.applied, s.skipped_steps, s.grad_norm])
  print("steps: " + json.dumps(told), flush=True)
  # A load refused on rank 1 alone (a NaN lr in its copy): refused on both, each rank's state as it
  # was (rank 0's copy is a valid other state, which it loads first and then puts back).
  before = shards_and_state(model, opt)
  sd = opt.state_dict()
  if rank == 0:
    sd["state"][0]["step"] = sd["state"][0]["step"] + 5
  if rank == 1:
    sd["param_groups"][0]["lr"] = math.nan
  try:
    opt.load_state_dict(sd)
  except ValueError as e:
    print(f"load refused: {e}", flush=True)
  after = shards_and_state(model, opt)
  print("load untouched: " + json.dumps(all(torch.equal(bits(a), bits(b)) for a, b in zip(before, after))), flush=True)
  tensor_parallel(rank, world)


def tensor_parallel(rank, world):
  """DTensors as tensor parallelism makes them, outside FSDP2: a sharded weight, and a replicated
  one whose gradient is Partial (hostopt redistributes it, a collective every rank must reach)."""
  from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
  mesh = init_device_mesh("cpu", (world,))
  a = torch.nn.Parameter(distribute_tensor(torch.ones(4, 6), mesh, [Shard(0)]))
  b = torch.nn.Parameter(distribute_tensor(torch.zeros(6), mesh, [Replicate()]))
  opt = hostopt.torch.AdamW([a, b], lr=0.1, threads=1)

  def grads(a_plain=False, b_none=False):
    a.grad = torch.ones(4, 6) if a_plain else DTensor.from_local(torch.ones(2, 6), mesh, [Shard(0)], run_check=False)
    b.grad = None if b_none else DTensor.from_local(torch.full((6,), rank + 1.0), mesh, [Partial()], run_check=False)

  told = []
  for label, bad in (("plain gradient", dict(a_plain=True)), ("missing gradient", dict(b_none=True))):
    grads(**(bad if rank == 0 else {}))
    try:
      opt.step()
      told.append([label, "stepped"])
    except ValueError as e:
      told.append([label, str(e)])
  grads()
  opt.step()
  told.append(["then", b.to_local().tolist(), a.to_local().tolist()])
  print("tp: " + json.dumps(told), flush=True)
  # 8-bit state of a Shard(0) weight loaded into a Shard(1) one: another box per rank, refused.
  w0 = torch.nn.Parameter(distribute_tensor(torch.ones(4, 64), mesh, [Shard(0)]))
  q0 = hostopt.torch.AdamW([w0], lr=0.1, moments="8bit", threads=1)
  w0.grad = distribute_tensor(torch.ones(4, 64), mesh, [Shard(0)])
  q0.step()
  w1 = torch.nn.Parameter(distribute_tensor(torch.ones(4, 64), mesh, [Shard(1)]))
  q1 = hostopt.torch.AdamW([w1], lr=0.1, moments="8bit", threads=1)
  try:
    q1.load_state_dict(q0.state_dict())
    print("resharded 8-bit: loaded", flush=True)
  except ValueError as e:
    print(f"resharded 8-bit: {e}", flush=True)


def fsdp_with_tensor_parallel(out, rank):
  from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                       set_model_state_dict, set_optimizer_state_dict)
  from torch.distributed.device_mesh import init_device_mesh
  from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
  mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

  class Net(torch.nn.Module):
    def __init__(self):
      super().__init__()
      self.up, self.down, self.norm = torch.nn.Linear(16, 36), torch.nn.Linear(36, 16), torch.nn.LayerNorm(16)

    def forward(self, x):
      return self.norm(self.down(torch.relu(self.up(x))))

  torch.manual_seed(0)
  init = Net().state_dict()
  xs = [torch.randn(8, 16, generator=torch.Generator().manual_seed(i)) for i in range(5)]

  def build():
    m = Net()
    m.load_state_dict(init)
    parallelize_module(m, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(m, mesh=mesh["dp"])
    return m, hostopt.torch.AdamW(m.parameters(), lr=0.01, moments="8bit", threads=1)

  def train(m, o, i):
    m(xs[i]).pow(2).mean().backward()
    o.step()
    o.zero_grad()

  m, o = build()
  for i in range(3):
    train(m, o, i)
  where = os.path.join(out, "ckpt-fsdp-tp")
  dcp.save({"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, o)}, checkpoint_id=where)
  m2, o2 = build()
  sd = {"model": get_model_state_dict(m2), "optim": get_optimizer_state_dict(m2, o2)}
  dcp.load(sd, checkpoint_id=where)
  set_model_state_dict(m2, sd["model"])
  set_optimizer_state_dict(m2, o2, sd["optim"])
  same = lambda a, b: len(a) == len(b) and all(torch.equal(bits(x), bits(y)) for x, y in zip(a, b))
  state_equal = same(shards_and_state(m, o), shards_and_state(m2, o2))
  for i in (3, 4):
    train(m, o, i)
    train(m2, o2, i)
  placements = sorted({str(p.placements) for p in m.parameters()})
  print("fsdp_tp: " + json.dumps({"state": state_equal, "after": same(shards_and_state(m, o), shards_and_state(m2, o2)),
                                  "placements": placements}), flush=True)


def stored(out, rank, world):
  import shutil
  ref_model = sharded(make_model(0))
  ref = make_optimizer(ref_model, "hostopt", "8bit")
  after = {}
  for step in range(10):
    train(ref_model, ref, rank, world, step, step + 1)
    after[step + 1] = [p.to_local().clone() for p in ref_model.parameters()]
  root = os.path.join(out, "store")
  os.makedirs(root, exist_ok=True)
  mine = os.path.join(root, f"rank{rank}-of-{world}")
  told = {}
  if rank == 1:  # a file where rank 1's store goes: refused there, so on every rank, rank 0's store taken back
    open(mine, "w").close()
  dist.barrier()
  try:
    make_optimizer(sharded(make_model(0)), "hostopt", "8bit", store=root)
  except (OSError, RuntimeError) as e:
    told["refused"] = f"{type(e).__name__}: {e}"
  dist.barrier()  # (rank 0 has taken its store back by now)
  told["left"] = sorted(os.listdir(root))
  dist.barrier()
  if rank == 1:
    os.unlink(mine)
  model = sharded(make_model(0))
  opt = make_optimizer(model, "hostopt", "8bit", store=root)
  same = lambda ps, at: all(torch.equal(bits(p.to_local()), bits(a)) for p, a in zip(ps, after[at]))
  told["stepped"] = True
  for step in range(6):
    train(model, opt, rank, world, step, step + 1)
    told["stepped"] &= same(model.parameters(), step + 1)
    if rank == 1 and step + 1 in (4, 5):  # (each step committed: a copy of the store at it)
      shutil.copytree(mine, os.path.join(out, f"rank1-at-{step + 1}"))
  msd, osd = get_state_dict(model, opt)
  told["dtensor_state"] = all(hasattr(v, "to_local") for st in osd["state"].values() for key, v in st.items()
                              if key != "step")
  where = os.path.join(out, "ckpt-store")
  dcp.save({"model": msd, "optim": osd}, checkpoint_id=where)
  msd, osd = get_state_dict(model, opt)
  state = {"model": msd, "optim": osd}
  dcp.load(state, checkpoint_id=where)
  set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])  # its own: taken
  opt.close()
  for back, name in ((4, "apart"), (5, "resumed")):
    dist.barrier()
    if rank == 1:
      shutil.rmtree(mine)
      shutil.copytree(os.path.join(out, f"rank1-at-{back}"), mine)
    dist.barrier()
    model = sharded(make_model(1))  # (another init: only the store carries the state)
    try:
      opt = make_optimizer(model, "hostopt", "8bit", store=root, resume=True)
    except ValueError as e:
      told[name] = str(e)
      continue
    told[name] = opt.store.step_count
    told["same_at_resume"] = same(model.parameters(), opt.store.step_count)
    train(model, opt, rank, world, 5, 10)
    told["same_after"] = same(model.parameters(), 10)
    opt.close()
  told.update(stored_faults(out, rank, world))
  print("store: " + json.dumps(told), flush=True)


def stored_faults(out, rank, world):
  """A DTensor beside a plain parameter, in a store per rank: a step where only rank 0 has a
  gradient (its plain one) is refused on every rank; a step that fails on rank 1's drive after
  the ranks agreed is told to rank 0 (which committed it) and later steps are refused on both;
  the resume then opens both at the step both committed, and a refused resume leaves the plain
  parameter as it was."""
  import shutil
  from torch.distributed.tensor import DTensor, Shard, distribute_tensor, init_device_mesh
  mesh = init_device_mesh("cpu", (world,))
  root = os.path.join(out, "faults")
  os.makedirs(root, exist_ok=True)
  mine = os.path.join(root, f"rank{rank}-of-{world}")
  told = {}

  def params():
    return (torch.nn.Parameter(distribute_tensor(torch.ones(4, 6), mesh, [Shard(0)])),
            torch.nn.Parameter(torch.full((3,), -7.0)))

  def make(resume=False):
    a, c = params()
    return a, c, hostopt.torch.AdamW([a, c], lr=0.1, threads=1, store=root, resume=resume)

  def grads(a, c, a_grad=True, c_grad=True):
    a.grad = DTensor.from_local(torch.ones(2, 6), mesh, [Shard(0)], run_check=False) if a_grad else None
    c.grad = torch.ones(3) if c_grad else None

  def attempt(opt, name):
    try:
      opt.step()
      told[name] = "stepped"
    except (ValueError, RuntimeError) as e:
      told[name] = f"{type(e).__name__}: {e}"

  a, c, opt = make()
  grads(a, c)
  opt.step()
  grads(a, c, a_grad=False, c_grad=rank == 0)
  attempt(opt, "one_rank_gradient")
  told["count_after_refusal"] = opt.store.step_count
  grads(a, c)
  opt.step()  # step 2 on both
  dist.barrier()
  if rank == 1:
    shutil.move(mine, mine + ".away")  # rank 1's drive gone: its next step fails after the ranks agreed
  grads(a, c)
  attempt(opt, "drive_failed")
  grads(a, c)
  attempt(opt, "after_failure")
  try:  # (no checkpoint of stores that may be a step apart)
    opt.state_dict()
    told["state_dict_after_failure"] = "exported"
  except RuntimeError as e:
    told["state_dict_after_failure"] = str(e)
  counts = torch.zeros(world)
  counts[rank] = opt.store.step_count if rank == 0 else 2
  dist.all_reduce(counts)
  told["counts_after_failure"] = counts.tolist()
  opt.close()
  dist.barrier()
  a, c = params()
  try:  # rank 1's store is still away: refused on both, the plain parameter left as it was
    hostopt.torch.AdamW([a, c], lr=0.1, threads=1, store=root, resume=True)
  except (ValueError, RuntimeError) as e:
    told["resume_refused"] = type(e).__name__
  told["plain_after_refusal"] = c.tolist()
  dist.barrier()
  if rank == 1:
    shutil.move(mine + ".away", mine)
  dist.barrier()
  a, c, opt = make(resume=True)
  told["resumed_faults_at"] = opt.store.step_count
  told["plain_resumed"] = c.tolist()
  opt.close()
  return told


def bits(t):  # (NaN-safe, and -0.0 is not 0.0)
  return t.reshape(-1).contiguous().view(torch.uint8) if t.numel() else torch.zeros(0, dtype=torch.uint8)


def reshard(out, rank, world):
  model = sharded(make_model(1))
  opt = make_optimizer(model, "hostopt", "8bit")
  train(model, opt, rank, world, 0, 1)  # (a state to load into)
  msd, osd = get_state_dict(model, opt)
  state = {"model": msd, "optim": osd}
  try:
    dcp.load(state, checkpoint_id=os.path.join(out, "ckpt-2-hostopt-8bit"))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
  except BaseException as e:  # (DCP's CheckpointException is one; every rank must get here, none may hang)
    print(f"refused: {type(e).__name__}: {e}", flush=True)
  else:
    print("loaded", flush=True)
  model = sharded(make_model(1))
  opt = make_optimizer(model, "hostopt", "f32")
  msd, osd = get_state_dict(model, opt)
  state = {"model": msd, "optim": osd}
  dcp.load(state, checkpoint_id=os.path.join(out, "ckpt-2-hostopt-f32"))
  set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
  losses = train(model, opt, rank, world, SAVE_AT, STEPS)
  if rank == 0:
    print("resumed: " + json.dumps(losses), flush=True)


if __name__ == "__main__":
  main()
