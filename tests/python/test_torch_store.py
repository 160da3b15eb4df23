"""hostopt.torch with store=: the state on a drive steps to the in-RAM optimizer's bits (param
groups of every moment format, lr schedulers, skipped steps, channels_last, 16-bit
parameters), its state_dict loads into the in-RAM optimizer, a restarted run resumes with
the store's parameters, and what it cannot do is refused by name, with nothing changed."""
import copy

import pytest
import torch

import hostopt.torch as ht

STORE = {"sync": False, "chunk_elements": 256, "buffers": 3}  # many chunks, cut through the parameters
RESUMED = {"sync": False, "buffers": 4}  # (a store keeps its chunking)


def model(dtype=torch.float32, seed=0):
  torch.manual_seed(seed)
  m = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(), torch.nn.Linear(8 * 4 * 4, 37),
                          torch.nn.Linear(37, 5))
  m[0].to(memory_format=torch.channels_last)  # a parameter whose memory order is not its index order
  return m.to(dtype)


def optimizer(m, store=None, resume=False, options=None):
  groups = [{"params": [m[0].weight, m[2].weight], "moments": "8bit", "rounding_seed": 5},
            {"params": [m[3].weight], "moments": "bf16", "lr": 2e-3},
            {"params": [m[0].bias, m[2].bias, m[3].bias], "weight_decay": 0.0}]
  opt = ht.AdamW(groups, lr=1e-2, weight_decay=0.1, store=store, resume=resume,
                 store_options=options or (None if store is None else RESUMED if resume else STORE))
  sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1 + t))
  return opt, sched


def backward(m, t):
  torch.manual_seed(100 + t)
  x = torch.randn(4, 3, 6, 6, dtype=next(m.parameters()).dtype)
  m.zero_grad(set_to_none=True)
  m(x).float().pow(2).mean().backward()


def same_params(a, b):
  for (name, x), y in zip(a.named_parameters(), b.parameters()):
    assert x.dtype == y.dtype and x.stride() == y.stride(), name
    assert torch.equal(x.detach().view(torch.int16 if x.dtype != torch.float32 else torch.int32),
                       y.detach().view(torch.int16 if y.dtype != torch.float32 else torch.int32)), name


def same_state_dict(a, b):
  assert a["param_groups"] == b["param_groups"]
  assert a["state"].keys() == b["state"].keys()
  for k in a["state"]:
    assert a["state"][k].keys() == b["state"][k].keys(), k
    for key, x in a["state"][k].items():
      assert torch.equal(x, b["state"][k][key]), (k, key)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_steps_export_and_resume_with_the_in_ram_optimizers_bits(tmp_path, dtype):
  a, b = model(dtype), model(dtype)
  ram, ram_sched = optimizer(a)
  stored, stored_sched = optimizer(b, tmp_path)
  assert stored.store.chunks > 5 and stored.store.step_count == 0 and len(stored.state) == 0
  for t in range(4):
    for m in (a, b):
      backward(m, t)
      if t == 2:
        m[2].weight.grad[1, 1] = float("nan")  # skipped by both (8-bit groups check by default)
    ram.step()
    stored.step()
    ram_sched.step()
    stored_sched.step()
    assert str(ram.last_step) == str(stored.last_step)  # (nan == nan as text)
    same_params(a, b)
  assert stored.last_step.applied and float(stored.state[b[3].weight]["step"]) == 3
  sd = stored.state_dict()
  same_state_dict(ram.state_dict(), sd)

  c = copy.deepcopy(a)  # the export loads into the in-RAM optimizer, and it goes on with the same bits
  loaded, loaded_sched = optimizer(c)
  loaded.load_state_dict(sd)
  loaded_sched.load_state_dict(ram_sched.state_dict())
  stored.close()
  backward(b, 7)
  with pytest.raises(ValueError, match="closed"):
    stored.step()

  d = model(dtype, seed=9)  # a restarted run: the store's parameters replace the model's own
  resumed, resumed_sched = optimizer(d, tmp_path, resume=True)
  # The hyper-parameters are param_groups': the restored scheduler's next lr.
  assert [g["lr"] for g in resumed.param_groups] == [1e-2, 2e-3, 1e-2]
  resumed_sched.load_state_dict(stored_sched.state_dict())
  for group, lr in zip(resumed.param_groups, resumed_sched.get_last_lr()):
    group["lr"] = lr
  same_params(b, d)
  for t in range(7, 10):
    for m in (a, c, d):
      backward(m, t)
    for o, s in ((ram, ram_sched), (loaded, loaded_sched), (resumed, resumed_sched)):
      o.step()
      s.step()
    same_params(a, c)
    same_params(a, d)
  same_state_dict(ram.state_dict(), resumed.state_dict())


def test_refusals_name_the_problem_and_change_nothing(tmp_path):
  m = model()
  opt, _ = optimizer(m, tmp_path)
  backward(m, 0)
  opt.step()
  before = [p.detach().clone() for p in m.parameters()]
  backward(m, 1)
  m[3].bias.grad = None
  with pytest.raises(ValueError, match=r"param_groups\[2\]\['params'\]\[2\] has no gradient: with store= every step"):
    opt.step()
  m.zero_grad(set_to_none=True)
  opt.step()  # no gradient at all: nothing to do, as torch
  assert opt.store.step_count == 1 and opt.last_step.step == 1
  with pytest.raises(ValueError, match="add_param_group with store="):
    opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(3))]})
  with pytest.raises(ValueError, match="load_state_dict with store=: the store is the checkpoint"):
    opt.load_state_dict(opt.state_dict())
  with pytest.raises(TypeError, match="with store= cannot be pickled or deep-copied"):
    copy.deepcopy(opt)
  opt.param_groups[1]["moments"] = "f32"
  backward(m, 2)
  with pytest.raises(ValueError, match=r"param_groups\[1\] stores 'f32'.*moment format is fixed"):
    opt.step()
  opt.param_groups[1]["moments"] = "bf16"
  opt.param_groups[2]["params"].append(torch.nn.Parameter(torch.ones(3)))
  with pytest.raises(ValueError, match="param_groups changed"):
    opt.step()
  opt.param_groups[2]["params"].pop()
  for p, q in zip(before, m.parameters()):
    assert torch.equal(p, q.detach())
  assert opt.store.step_count == 1
  with pytest.raises(RuntimeError, match="open elsewhere"):
    optimizer(model(), tmp_path, resume=True)
  opt.close()
  with pytest.raises(RuntimeError, match=r"a store exists .* \(resume=True continues it\)"):
    optimizer(model(), tmp_path)
  with pytest.raises(ValueError, match="chunking it was created with"):
    optimizer(model(), tmp_path, resume=True, options=STORE)
  empty = tmp_path / "empty"
  empty.mkdir()
  with pytest.raises(RuntimeError, match="no store"):
    optimizer(model(), empty, resume=True)
  params = list(model().parameters())
  with pytest.raises(ValueError, match=r"unknown \['staging'\].*StoredOptimizer's keywords"):
    ht.AdamW(params, store=empty, store_options={"staging": 1 << 20})
  with pytest.raises(ValueError, match="store_options without store="):
    ht.AdamW(params, store_options={"sync": False})
  with pytest.raises(ValueError, match="resume=True without store="):
    ht.Adam(params, resume=True)
  with pytest.raises(ValueError, match="store= with offload="):
    ht.AdamW(params, store=empty, offload="host")
  with pytest.raises(TypeError, match="resume: expected a bool"):
    ht.AdamW(params, store=empty, resume=1)
  assert not any(empty.iterdir())  # nothing made by the refusals
  with pytest.raises(RuntimeError):
    ht.AdamW(params[:2], store=tmp_path, store_options={"sync": False}, resume=True)  # another model's store
