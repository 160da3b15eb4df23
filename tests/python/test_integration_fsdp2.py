"""hostopt.torch under torch FSDP2 (fully_shard with CPUOffloadPolicy over gloo): 2 and 3 ranks
(tests/python/fsdp2_worker.py is one rank) train one model whose parameters are DTensors, their
local shards on the CPU, each rank's stepped by hostopt on that rank.

- The global losses of 200 steps (two param groups, weight decay on one, clipping by the global
  norm) equal one process training the whole model with hostopt.torch.AdamW, and FSDP2 with
  torch.optim.AdamW, within 4x the float noise floor (the one-process run against itself with
  the learning rate moved by 2e-7 relative, both ways). Over 3 ranks one layer's shards are
  uneven and one rank's shard of the last layer is empty.
- torch.distributed.checkpoint (get_state_dict, dcp.save / dcp.load, set_state_dict) saves the
  state sharded (opt.state's tensors are DTensors) and a fresh job resumed from it at step 100
  continues bit for bit: f32 moments on 2 and 3 ranks, 8-bit on 2 (its blocks' scales sharded
  by rows), bf16 on 3.
- The ranks agree before they step: an inf in one rank's gradient shard makes every rank skip
  the step (8-bit moments check non-finite gradients: the global norm decides), and a bad
  input on one rank (a NaN learning rate) is refused on every rank with one error naming that
  rank, nothing stepped anywhere, no hang; the job goes on once it is put right.
- FSDP2 over tensor parallelism (4 ranks, a (2, 2) mesh) with 8-bit moments resumes from DCP
  bit for bit.
- 8-bit moments saved by 2 ranks are refused by name when 3 ranks load them (their blocks are
  the shards'), on every rank; f32 moments saved by 2 ranks reshard onto 3, whose run goes on
  as the 2-rank run did, within the noise floor.

Each rank is given a 120 s gloo timeout: a safety net that turns a hang into a failure, never
a bound on speed."""
import gc
import json
import math
import os
import sys

import pytest

torch = pytest.importorskip("torch")
try:
  from torch.distributed.fsdp import fully_shard  # noqa: F401
except ImportError:
  pytest.skip(f"torch {torch.__version__}: FSDP2 (torch.distributed.fsdp.fully_shard) needs torch >= 2.6",
              allow_module_level=True)

import fsdp2_worker as worker  # noqa: E402
import hostopt.torch  # noqa: E402
from integration_support import assert_within_floor, free_port, noise_floor, run_ranks  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fsdp2_worker.py")
HANG_NET_S = 600


def launch(out, world, mode):
  """Runs `world` ranks; returns each one's (exit code, log)."""
  port = str(free_port())
  env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
  logs = [open(out / f"{mode}-{world}-rank{r}.log", "w+") for r in range(world)]
  codes = run_ranks([[sys.executable, WORKER, str(out), str(r), str(world), port, mode] for r in range(world)],
                    env, logs, HANG_NET_S)
  results = []
  for code, log in zip(codes, logs):
    log.seek(0)
    results.append((code, log.read()))
    log.close()
  return results


def one_process(lr=worker.LR):
  """The whole model in one process, no FSDP: hostopt.torch.AdamW on the global batch."""
  model = worker.make_model(0)
  opt = worker.make_optimizer(model, "hostopt", "f32", lr)
  losses = []
  for step in range(worker.STEPS):
    loss = worker.local_loss(model, step, 0, 1)
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    losses.append(float(loss))
  return losses


@pytest.fixture(scope="module")
def reference():
  losses = one_process()
  return losses, noise_floor(one_process, worker.LR, losses)


@pytest.fixture(scope="module", params=[2, 3])
def trained(request, tmp_path_factory):
  world = request.param
  out = tmp_path_factory.mktemp(f"fsdp2-{world}")
  ranks = launch(out, world, "train")
  failed = [(r, code, log) for r, (code, log) in enumerate(ranks) if code != 0]
  if failed:  # the rank that failed first: the others' error is its exit ("Connection closed")
    r, code, log = next((f for f in failed if "Connection closed" not in f[2]), failed[0])
    pytest.fail(f"rank {r} of {world} failed (exit {code}):\n{log[-6000:]}")
  with open(out / f"train-{world}.json") as f:
    return world, json.load(f), out


def test_sharded_losses_equal_one_process(trained, reference):
  world, results, _ = trained
  losses, floor = reference
  ours = results["hostopt-f32"]["losses"]
  assert_within_floor(ours, losses, floor, f"FSDP2 on {world} ranks vs one process")
  if "torch-f32" in results:  # the engine's own AdamW, sharded the same way
    assert_within_floor(ours, results["torch-f32"]["losses"], floor, f"FSDP2 on {world} ranks vs torch.optim")
  assert ours[-1] < 0.5 * ours[0], (ours[0], ours[-1])  # (it learns: the comparisons are not of two flat lines)


def test_dcp_resume_is_exact(trained):
  world, results, _ = trained
  for name, result in results.items():
    if "resumed" not in result:
      continue
    assert result["dtensor_state"], f"{name} on {world} ranks: opt.state_dict() holds plain tensors, not DTensors"
    assert result["resumed"] == result["losses"][worker.SAVE_AT:], (
        f"{name} on {world} ranks: the run resumed from the checkpoint differs from the one that went on")
    assert result["bitwise"], f"{name} on {world} ranks: the resumed run's shards or state differ bitwise"
    assert result["losses"][-1] < 0.5 * result["losses"][0], (name, result["losses"][0], result["losses"][-1])
  formats = {name for name in results if "resumed" in results[name]}
  assert formats == ({"hostopt-f32", "hostopt-8bit"} if world == 2 else {"hostopt-f32", "hostopt-bf16"})
  if world == 2:
    assert "moment_scales" in results["hostopt-8bit"]["state_keys"]


def lines(log, prefix):
  return [line[len(prefix):] for line in log.splitlines() if line.startswith(prefix)]


def test_bad_input_on_one_rank_fails_every_rank(tmp_path):
  ranks = launch(tmp_path, 2, "bad")
  for r, (code, log) in enumerate(ranks):
    assert code == 0, f"rank {r}:\n{log[-6000:]}"
  (_, log0), (_, log1) = ranks
  # Step 3: rank 1's gradient shard holds an inf. Every rank skips it (one decision, from the
  # global norm), and every rank reports the same steps, norms included.
  steps0, steps1 = json.loads(lines(log0, "steps: ")[0]), json.loads(lines(log1, "steps: ")[0])
  assert steps0 == steps1, (steps0, steps1)
  assert [s[0] for s in steps0 if not s[1]] == [3], steps0
  assert steps0[3][2] == 1 and steps0[-1][2] == 1 and not math.isfinite(steps0[3][3]), steps0
  assert all(math.isfinite(s[3]) for s in steps0 if s[0] != 3), steps0
  # Step 5: rank 1's NaN learning rate, refused on both ranks (rank 0 names rank 1), nothing
  # stepped on either; the job goes on.
  assert len(lines(log1, "refused at step 5: ValueError: ")) == 1 and "lr" in log1, log1[-4000:]
  told = lines(log0, "refused at step 5: ValueError: ")
  assert len(told) == 1 and "refused on rank 1" in told[0] and "lr" in told[0], log0[-4000:]
  assert lines(log0, "untouched: ") == ["true"] and lines(log1, "untouched: ") == ["true"]
  # A load refused on rank 1 alone: refused on both, rank 0 (which had loaded) put back.
  assert "lr" in lines(log1, "load refused: ")[0], log1[-4000:]
  assert "refused on rank 1" in lines(log0, "load refused: ")[0], log0[-4000:]
  assert lines(log0, "load untouched: ") == ["true"] and lines(log1, "load untouched: ") == ["true"]
  # Tensor-parallel DTensors (a Partial gradient redistributed): rank 0's plain gradient and its
  # missing one refused on both ranks, no rank left in a collective; then the step goes on alike.
  tp0, tp1 = json.loads(lines(log0, "tp: ")[0]), json.loads(lines(log1, "tp: ")[0])
  assert "gradient is a plain Tensor" in tp0[0][1] and "refused on rank 0" in tp1[0][1], (tp0, tp1)
  assert "has a gradient on 1 of the 2 ranks" in tp0[1][1] and tp0[1] == tp1[1], (tp0, tp1)
  assert tp0[2][1] == tp1[2][1] and tp0[2][1] == [pytest.approx(-0.1)] * 6, (tp0, tp1)  # one Adam step of the sum
  # 8-bit state of a Shard(0) weight into a Shard(1) one (the same shapes, other boxes): refused.
  for log in (log0, log1):
    assert "another sharding" in lines(log, "resharded 8-bit: ")[0], log[-4000:]


def test_checkpoint_of_another_world_size(trained, reference, tmp_path):
  """The 2-rank run's checkpoints loaded by 3 ranks: 8-bit moments refused by name on every
  rank (their blocks are the shards'); f32 moments resharded, the run going on as the 2-rank
  run did within the noise floor."""
  world, results, out = trained
  if world != 2:
    pytest.skip("loads the 2-rank run's checkpoints")
  import shutil
  for name in ("ckpt-2-hostopt-8bit", "ckpt-2-hostopt-f32"):
    shutil.copytree(out / name, tmp_path / name)
  ranks = launch(tmp_path, 3, "reshard")
  for r, (code, log) in enumerate(ranks):
    assert code == 0, f"rank {r}:\n{log[-6000:]}"
    refused = lines(log, "refused: ")
    told = log.split("refused: ", 1)[-1]  # (DCP's error: every rank's tracebacks, then the message)
    assert refused and "moment_scales" in told and "loaded" not in log.splitlines(), f"rank {r}:\n{log[-4000:]}"
  resumed = json.loads(lines(ranks[0][1], "resumed: ")[0])
  assert_within_floor(resumed, results["hostopt-f32"]["losses"][worker.SAVE_AT:], reference[1],
                      "f32 state of 2 ranks resumed on 3")


def test_fsdp2_with_tensor_parallel_8bit_resume_is_exact(tmp_path):
  """FSDP2 over tensor parallelism (a (2, 2) mesh, 4 ranks: FSDP2's _StridedShard placements)
  with 8-bit moments: a DCP resume gives the same state bit for bit and the same next steps."""
  ranks = launch(tmp_path, 4, "fsdp_tp")
  for r, (code, log) in enumerate(ranks):
    assert code == 0, f"rank {r}:\n{log[-6000:]}"
    told = json.loads(lines(log, "fsdp_tp: ")[0])
    assert told["state"] and told["after"], (r, told)
    assert any("Strided" in p for p in told["placements"]), told  # (the case this test is for)


def test_store_per_rank_resumes_where_every_rank_committed(tmp_path):
  """FSDP2 on 2 ranks, 8-bit moments in a store per rank: the steps equal the in-RAM
  optimizer's bit for bit, DCP saves the store's state as DTensors and loads it back, and a
  job killed between the ranks' commits (rank 1 one step behind) resumes on both ranks at
  the step both committed, the shards that step's bits, and steps on to the in-RAM run's bits;
  ranks two steps apart are refused on both ranks. A store refused on one rank is made on
  none (the others' taken back)."""
  ranks = launch(tmp_path, 2, "store")
  for r, (code, log) in enumerate(ranks):
    assert code == 0, f"rank {r}:\n{log[-6000:]}"
    told = json.loads(lines(log, "store: ")[0])
    assert told["left"] == ["rank1-of-2"], (r, told)  # (rank 1's file: rank 0's store was taken back)
    assert ("FileExistsError" if r == 1 else "RuntimeError: making the store was refused on rank 1 "
            "(FileExistsError") in told["refused"], (r, told)
    assert told["stepped"] and told["dtensor_state"], (r, told)
    assert "steps [4, 6], more than one step apart" in told["apart"], (r, told)
    assert told["resumed"] == 5 and told["same_at_resume"] and told["same_after"], (r, told)
    # A gradient on rank 0 alone (a plain parameter's): refused on both ranks, nothing committed.
    assert "hold no parameter with a gradient" in told["one_rank_gradient"], (r, told)
    assert told["count_after_refusal"] == 1, (r, told)
    # Rank 1's drive gone after the ranks agreed: both ranks told, later steps refused on both;
    # rank 0 committed step 3, so the resume opens both at step 2, with the stores' parameters.
    assert told["drive_failed"].startswith("RuntimeError") and "stepped" not in told["drive_failed"], (r, told)
    assert "resume=True" in told["after_failure"] and "step a" in told["after_failure"], (r, told)
    assert told["counts_after_failure"] == [3.0, 2.0], (r, told)
    assert told["state_dict_after_failure"].startswith("state_dict: a step failed"), (r, told)
    assert "close() this optimizer" in told["after_failure"], (r, told)
    assert told["resume_refused"] and told["resumed_faults_at"] == 2, (r, told)
    assert told["plain_after_refusal"] == [-7.0] * 3, (r, told)  # (a refused resume writes nothing)
    assert told["plain_resumed"] != [-7.0] * 3, (r, told)  # (the store's values, not the new model's)


def one_rank_dtensor():
  """A function making a DTensor sharded over a one-rank mesh of this process (its process
  group made once)."""
  if not torch.distributed.is_initialized():
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
  from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh
  mesh = init_device_mesh("cpu", (1,))
  return lambda t: distribute_tensor(t.clone(), mesh, [Shard(0)])


def test_plain_and_dtensor_parameters_in_one_optimizer():
  """A DTensor parameter beside a plain one, on a one-rank mesh, against the same optimizer over
  two plain parameters: the DTensor's local shard gets the same bits (8-bit moments round by
  arena position: the layouts match), opt.state shows DTensors, writes through opt.state take
  effect at the next step, and a refused step changes nothing."""
  from torch.distributed.tensor import DTensor
  dt = one_rank_dtensor()

  torch.manual_seed(0)
  w, b = torch.randn(7, 5), torch.randn(40)
  for moments in ("f32", "bf16", "8bit"):
    ref_b, ref_w = torch.nn.Parameter(b.clone()), torch.nn.Parameter(w.clone())
    our_b, our_w = torch.nn.Parameter(b.clone()), torch.nn.Parameter(dt(w))
    ref = hostopt.torch.AdamW([ref_b, ref_w], lr=1e-2, moments=moments)
    ours = hostopt.torch.AdamW([our_b, our_w], lr=1e-2, moments=moments)

    def step(g=None, h=None):
      g = torch.randn(7, 5) if g is None else g
      h = torch.randn(40) if h is None else h
      ref_w.grad, ref_b.grad = g.clone(), h.clone()
      our_w.grad, our_b.grad = dt(g), h.clone()
      ref.step()
      ours.step()
      assert torch.equal(our_w.to_local(), ref_w.detach()) and torch.equal(our_b, ref_b), moments

    for _ in range(3):
      step()
    st = ours.state[our_w]
    assert all(isinstance(v, DTensor) for k, v in st.items() if k != "step"), {k: type(v) for k, v in st.items()}
    assert ours.state[our_b] is ours.state[our_b] and not isinstance(ours.state[our_b]["step"], DTensor)
    sd_ref, sd_ours = ref.state_dict(), ours.state_dict()
    for key, v in sd_ref["state"][1].items():
      got = sd_ours["state"][1][key]  # (8-bit scales: one row of blocks per shard, (1, blocks, 2) here)
      assert torch.equal(got.to_local().reshape(v.shape) if isinstance(got, DTensor) else got, v), (moments, key)
    if moments == "f32":  # a written entry, taken at the next step
      ours.state[our_w]["exp_avg"] = dt(torch.ones(7, 5))
      ref.state[ref_w]["exp_avg"] = torch.ones(7, 5)
      step()
    with torch.no_grad():  # the model written in place (a load): adopted at the next step
      our_w.to_local().mul_(0.5)
      ref_w.mul_(0.5)
    step()
    ours.load_state_dict(sd_ours)
    ref.load_state_dict(sd_ref)
    step()
    # A group added later, and an lr schedule's edit of the groups: taken at the next step.
    extra = torch.randn(3, 33)
    ref_x, our_x = torch.nn.Parameter(extra.clone()), torch.nn.Parameter(dt(extra))
    ref.add_param_group({"params": [ref_x], "weight_decay": 0.3})
    ours.add_param_group({"params": [our_x], "weight_decay": 0.3})
    for opt in (ref, ours):
      opt.param_groups[0]["lr"] = 3e-3
    g = torch.randn(3, 33)
    ref_x.grad, our_x.grad = g.clone(), dt(g)
    step()
    assert torch.equal(our_x.to_local(), ref_x.detach())
    before = our_w.to_local().clone()
    ours.param_groups[0]["lr"] = float("nan")
    our_w.grad = dt(torch.randn(7, 5))
    with pytest.raises(ValueError, match="lr"):
      ours.step()
    assert torch.equal(our_w.to_local(), before)
    with pytest.raises(TypeError, match="DTensor"):
      import copy
      copy.deepcopy(ours)


def test_dtensor_edges_on_one_rank():
  """What a user of torch.optim does with an optimizer over DTensors, against the same optimizer
  over plain tensors: adopt_params after writing a plain parameter, a DTensor appended to a
  group and loaded into before its first step, load_state_dict hooks, opt.state[p] kept as one
  dict, a bf16 parameter holding a NaN (its f32 master kept, not re-read every step), and a
  DTensor given to an optimizer made over plain tensors (refused by name, nothing changed)."""
  dt = one_rank_dtensor()

  torch.manual_seed(1)
  w = torch.randn(6, 4).bfloat16()
  w[2, 1] = float("nan")
  b = torch.randn(9).bfloat16()
  ref_w, ref_b = torch.nn.Parameter(w.clone()), torch.nn.Parameter(b.clone())
  our_w, our_b = torch.nn.Parameter(dt(w)), torch.nn.Parameter(b.clone())
  ref = hostopt.torch.AdamW([ref_w, ref_b], lr=1e-2)
  ours = hostopt.torch.AdamW([our_w, our_b], lr=1e-2)

  def step():
    g, h = torch.randn(6, 4).bfloat16(), torch.randn(9).bfloat16()
    ref_w.grad, ref_b.grad = g.clone(), h.clone()
    our_w.grad, our_b.grad = dt(g), h.clone()
    ref.step()
    ours.step()
    bits = torch.int16
    assert torch.equal(our_w.to_local().view(bits), ref_w.detach().view(bits))
    assert torch.equal(our_b.detach().view(bits), ref_b.detach().view(bits))
    assert torch.equal(ours.state[our_w]["master_param"].to_local().view(torch.int32),
                       ref.state[ref_w]["master_param"].view(torch.int32))

  step()
  entry = ours.state[our_w]
  for _ in range(3):  # (the NaN's shard: its master stays f32, as the plain parameter's)
    step()
  assert ours.state[our_w] is entry  # one dict, updated in place, as torch.optim's
  with torch.no_grad():  # a 16-bit plain parameter written where hostopt cannot see it, then adopted
    our_b.data.add_(1.0)
    ref_b.data.add_(1.0)
  ours.adopt_params()
  ref.adopt_params()
  step()
  # A DTensor appended to a group, then a load before its first step.
  x = torch.randn(5, 3).bfloat16()
  ref_x, our_x = torch.nn.Parameter(x.clone()), torch.nn.Parameter(dt(x))
  sd_ref, sd_ours = ref.state_dict(), ours.state_dict()
  ref.param_groups[0]["params"].append(ref_x)
  ours.param_groups[0]["params"].append(our_x)
  sd_ref["param_groups"][0]["params"].append(2)
  sd_ours["param_groups"][0]["params"].append(2)
  # Its state_dict before its first step: listed, with no state (as torch).
  shown_ref, shown_ours = ref.state_dict(), ours.state_dict()
  assert shown_ours["param_groups"] == shown_ref["param_groups"] and shown_ours["state"].keys() == {0, 1}
  called = []
  ours.register_load_state_dict_pre_hook(lambda opt, sd: called.append("pre"))
  ours.register_load_state_dict_post_hook(lambda opt: called.append("post"))
  ours.load_state_dict(sd_ours)
  ref.load_state_dict(sd_ref)
  assert called == ["pre", "post"]
  g = torch.randn(5, 3).bfloat16()
  ref_x.grad, our_x.grad = g.clone(), dt(g)
  step()
  assert torch.equal(our_x.to_local().view(torch.int16), ref_x.detach().view(torch.int16))
  # DTensors given to an optimizer made over plain tensors: refused by name, at once or at the step.
  plain = hostopt.torch.AdamW([torch.nn.Parameter(torch.randn(4))], lr=1e-2)
  with pytest.raises(ValueError, match="made over plain tensors"):
    plain.add_param_group({"params": [torch.nn.Parameter(dt(torch.randn(4)))]})
  assert len(plain.param_groups) == 1
  plain.param_groups[0]["params"].append(torch.nn.Parameter(dt(torch.randn(4))))
  plain.param_groups[0]["params"][0].grad = torch.ones(4)
  with pytest.raises(ValueError, match="made over plain tensors"):
    plain.step()
  # 8-bit moments' block scales laid out for another sharding (a full state dict from 2 ranks):
  # refused by name, nothing loaded.
  q = hostopt.torch.AdamW([torch.nn.Parameter(dt(torch.randn(8, 4)))], lr=1e-2, moments="8bit")
  q.param_groups[0]["params"][0].grad = dt(torch.randn(8, 4))
  q.step()
  sd = q.state_dict()
  scales = sd["state"][0]["moment_scales"].full_tensor()
  sd["state"][0]["moment_scales"] = torch.cat([scales, scales])
  kept = {key: (v.to_local().clone() if hasattr(v, "to_local") else v) for key, v in q.state_dict()["state"][0].items()}
  with pytest.raises(ValueError, match="moment_scales.*world size"):
    q.load_state_dict(sd)
  after = q.state_dict()["state"][0]
  assert all(torch.equal(after[key].to_local() if hasattr(after[key], "to_local") else torch.as_tensor(after[key]),
                         torch.as_tensor(v)) for key, v in kept.items())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dtensor_store_on_one_rank(tmp_path, dtype):
  """store= over a DTensor parameter beside a plain one (one-rank mesh), against the in-RAM
  optimizer over two plain parameters, for every moment format: the same bits each step (one
  where the plain parameter has no gradient: its own step count), state_dict's entries as
  DTensors equal to the in-RAM ones, its own state loaded back and another refused, the
  rank's store in rank0-of-1, and a resumed optimizer that puts the store's parameters into a
  new model's shard and steps on to the same bits (bf16 parameters: with their f32 masters,
  not re-read from the parameters); add_param_group refused, nothing added."""
  from torch.distributed.tensor import DTensor
  dt = one_rank_dtensor()
  torch.manual_seed(2)
  w, b = torch.randn(7, 5).to(dtype), torch.randn(40).to(dtype)
  grads = [(torch.randn(7, 5).to(dtype), torch.randn(40).to(dtype) if k != 2 else None) for k in range(6)]

  def run(opt, our_w, our_b, steps):
    for g, h in steps:
      our_w.grad = dt(g) if isinstance(our_w, DTensor) else g.clone()
      our_b.grad = None if h is None else h.clone()
      opt.step()

  for moments in ("f32", "bf16", "8bit"):
    ref_b, ref_w = torch.nn.Parameter(b.clone()), torch.nn.Parameter(w.clone())
    ref = hostopt.torch.AdamW([ref_b, ref_w], lr=1e-2, moments=moments)
    our_b, our_w = torch.nn.Parameter(b.clone()), torch.nn.Parameter(dt(w))
    where = tmp_path / moments
    where.mkdir()
    ours = hostopt.torch.AdamW([our_b, our_w], lr=1e-2, moments=moments, store=where)
    assert (where / "rank0-of-1").is_dir() and ours.store is not None and ours.store.step_count == 0
    for k in range(4):
      run(ref, ref_w, ref_b, grads[k:k + 1])
      run(ours, our_w, our_b, grads[k:k + 1])
      assert torch.equal(our_w.to_local(), ref_w.detach()) and torch.equal(our_b, ref_b), (moments, k)
    assert float(ours.state[our_b]["step"]) == 3 and float(ours.state[our_w]["step"]) == 4
    sd_ref, sd_ours = ref.state_dict(), ours.state_dict()
    assert sd_ours["state"].keys() == sd_ref["state"].keys()
    for i, st in sd_ref["state"].items():
      assert sd_ours["state"][i].keys() - {"moment_shards"} == st.keys(), (moments, i)
      for key, v in st.items():
        got = sd_ours["state"][i][key]
        if i == 1 and key != "step":
          assert isinstance(got, DTensor), (moments, key)
          got = got.to_local().reshape(v.shape)
        assert torch.equal(torch.as_tensor(got), torch.as_tensor(v)), (moments, i, key)
    assert ours.state[our_w].keys() == {"step"}  # (opt.state itself holds no moments: the store does)
    ours.load_state_dict(sd_ours)  # its own state (what DCP's set_state_dict hands back): taken
    other = ours.state_dict()
    other["state"][0]["exp_avg_sq" if moments == "f32" else "step"] = torch.zeros_like(
        torch.as_tensor(other["state"][0]["exp_avg_sq" if moments == "f32" else "step"]))
    with pytest.raises(ValueError, match="the store is the checkpoint"):
      ours.load_state_dict(other)
    with pytest.raises(ValueError, match="add_param_group with store="):
      ours.add_param_group({"params": [torch.nn.Parameter(dt(torch.randn(3)))]})
    assert len(ours.param_groups) == 1
    ours.close()
    # A new model (other values) resumed: the store's parameters, then the same next steps.
    new_b, new_w = torch.nn.Parameter(torch.zeros(40, dtype=dtype)), torch.nn.Parameter(dt(torch.zeros(7, 5, dtype=dtype)))
    again = hostopt.torch.AdamW([new_b, new_w], lr=1e-2, moments=moments, store=where, resume=True)
    assert torch.equal(new_w.to_local(), ref_w.detach()) and torch.equal(new_b, ref_b), moments
    assert float(again.state[new_w]["step"]) == 4
    run(ref, ref_w, ref_b, grads[4:])
    run(again, new_w, new_b, grads[4:])
    assert torch.equal(new_w.to_local(), ref_w.detach()) and torch.equal(new_b, ref_b), moments
    again.close()
  # A store that exists is not made again (resume=True continues it), and nothing of it is lost.
  with pytest.raises(RuntimeError, match="resume=True"):
    hostopt.torch.AdamW([torch.nn.Parameter(dt(w))], lr=1e-2, store=tmp_path / "f32")
  assert hostopt.torch.AdamW([torch.nn.Parameter(torch.zeros(40, dtype=dtype)), torch.nn.Parameter(dt(w))], lr=1e-2,
                             store=tmp_path / "f32", resume=True).store.step_count == 6
  # A missing directory is named, and nothing is made; so is one named twice.
  with pytest.raises(FileNotFoundError, match="nowhere"):
    hostopt.torch.AdamW([torch.nn.Parameter(dt(w))], lr=1e-2, store=tmp_path / "nowhere" / "deeper")
  assert not (tmp_path / "nowhere").exists()
  twice = tmp_path / "twice"
  twice.mkdir()
  with pytest.raises(ValueError, match="same directory"):
    hostopt.torch.AdamW([torch.nn.Parameter(dt(w))], lr=1e-2, store=[twice, str(twice) + "/"])
  assert list(twice.iterdir()) == []
  with pytest.raises(ValueError, match="overlap=True over DTensor parameters: not yet"):
    hostopt.torch.AdamW([torch.nn.Parameter(dt(w))], lr=1e-2, store=twice, overlap=True)
  assert list(twice.iterdir()) == []
  # Stores of a job of another world size: named.
  (tmp_path / "other" / "rank0-of-2").mkdir(parents=True)
  with pytest.raises(ValueError, match="a job of 2 ranks .*this one has 1"):
    hostopt.torch.AdamW([torch.nn.Parameter(dt(w))], lr=1e-2, store=tmp_path / "other", resume=True)


def test_dtensor_store_refuses_a_changed_layout_and_is_released_when_dropped(tmp_path):
  """A parameter list changed under a store over DTensors: refused with nothing changed, and
  the optimizer steps on once the list is put back. A dropped optimizer releases its store at
  once (no reference cycle: resumed in the same process with the collector off)."""
  dt = one_rank_dtensor()
  torch.manual_seed(3)
  w, v = torch.nn.Parameter(dt(torch.randn(6, 4))), torch.nn.Parameter(dt(torch.randn(8)))
  opt = hostopt.torch.AdamW([w, v], lr=1e-2, store=tmp_path)

  def step():
    w.grad, v.grad = dt(torch.randn(6, 4)), dt(torch.randn(8))
    opt.step()

  step()
  entry, before = opt.state[v], (w.to_local().clone(), v.to_local().clone())
  saved = list(opt.param_groups[0]["params"])
  opt.param_groups[0]["params"] = [w]
  with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\] changed .*nothing was changed"):
    step()
  with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\] changed .*nothing was changed"):
    opt.state_dict()
  assert opt.state[v] is entry and torch.equal(w.to_local(), before[0]) and torch.equal(v.to_local(), before[1])
  opt.param_groups[0]["params"] = saved
  step()
  assert opt.store.step_count == 2 and float(opt.state[v]["step"]) == 2
  gc.disable()
  try:
    del opt
    again = hostopt.torch.AdamW([w, v], lr=1e-2, store=tmp_path, resume=True)
    assert again.store.step_count == 2
    again.close()
  finally:
    gc.enable()
