"""hostopt.torch side by side with torch.optim (Debian's torch)."""
import copy
import gc
import weakref

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import hostopt.torch as htorch  # noqa: E402


def make_model(seed=0):
  torch.manual_seed(seed)
  return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def groups_of(model, lr=1e-2, wd=0.0):
  decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
  no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
  return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0, "lr": lr / 2}]


def train(model, opt, steps=100, seed=3, scheduler=None):
  g = torch.Generator().manual_seed(seed)
  for _ in range(steps):
    x = torch.randn(32, 8, generator=g)
    y = torch.randn(32, 4, generator=g)

    def closure():
      opt.zero_grad()
      loss = ((model(x) - y) ** 2).mean()
      loss.backward()
      return loss
    opt.step(closure)
    if scheduler is not None:
      scheduler.step()
  return model


@pytest.mark.parametrize("name", ["Adam", "AdamW"])
@pytest.mark.parametrize("wd", [0.0, 0.05])
def test_matches_torch_optim_over_100_steps(name, wd):
  ours, theirs = make_model(), make_model()
  opt_ours = getattr(htorch, name)(groups_of(ours, wd=wd), lr=1e-2)
  opt_theirs = getattr(torch.optim, name)(groups_of(theirs, wd=wd), lr=1e-2)
  train(ours, opt_ours)
  train(theirs, opt_theirs)
  for a, b in zip(ours.parameters(), theirs.parameters()):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
  for a, b in zip(ours.parameters(), theirs.parameters()):
    sa, sb = opt_ours.state[a], opt_theirs.state[b]
    assert float(sa["step"]) == float(sb["step"]) == 100
    torch.testing.assert_close(sa["exp_avg"], sb["exp_avg"], rtol=1e-4, atol=1e-6)


def test_lr_scheduler_drives_the_learning_rate():
  ours, theirs = make_model(), make_model()
  oo = htorch.AdamW(ours.parameters(), lr=1e-2)
  ot = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
  train(ours, oo, 30, scheduler=torch.optim.lr_scheduler.StepLR(oo, 10, gamma=0.3))
  train(theirs, ot, 30, scheduler=torch.optim.lr_scheduler.StepLR(ot, 10, gamma=0.3))
  for a, b in zip(ours.parameters(), theirs.parameters()):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_state_dict_moves_both_ways_between_hostopt_and_torch():
  base = make_model()
  a, b = copy.deepcopy(base), copy.deepcopy(base)
  opt_a = htorch.AdamW(a.parameters(), lr=1e-2, weight_decay=0.1)
  train(a, opt_a, 10)
  # hostopt -> torch: torch continues where hostopt stopped.
  b.load_state_dict(a.state_dict())
  opt_b = torch.optim.AdamW(b.parameters(), lr=1e-2, weight_decay=0.1)
  opt_b.load_state_dict(opt_a.state_dict())
  train(a, opt_a, 10, seed=9)
  train(b, opt_b, 10, seed=9)
  for x, y in zip(a.parameters(), b.parameters()):
    torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)
  # torch -> hostopt.
  c = copy.deepcopy(b)
  opt_c = htorch.AdamW(c.parameters(), lr=1e-2, weight_decay=0.1)
  opt_c.load_state_dict(opt_b.state_dict())
  assert float(opt_c.state[next(c.parameters())]["step"]) == 20
  train(b, opt_b, 5, seed=11)
  train(c, opt_c, 5, seed=11)
  for x, y in zip(b.parameters(), c.parameters()):
    torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)
  sd = opt_c.state_dict()
  assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
  assert sd["param_groups"][0]["betas"] == (0.9, 0.999)


def test_bf16_parameters_keep_f32_master_weights():
  # The reference keeps f32 masters too: torch.optim.AdamW on an f32 copy of the bf16
  # parameters, fed the bf16 gradients hostopt reads, rounded to bf16 after each step.
  torch.manual_seed(0)
  init = torch.randn(1000).to(torch.bfloat16)
  master = torch.nn.Parameter(init.float())
  p16 = torch.nn.Parameter(init.clone())
  ref = torch.optim.AdamW([master], lr=1e-2)
  o16 = htorch.AdamW([p16], lr=1e-2)
  for _ in range(20):
    g = torch.randn(1000).to(torch.bfloat16)
    master.grad, p16.grad = g.float(), g.clone()
    ref.step()
    o16.step()
  assert p16.dtype == torch.bfloat16
  st, rst = o16.state[p16], ref.state[master]
  torch.testing.assert_close(st["exp_avg"], rst["exp_avg"], rtol=1e-5, atol=1e-7)
  torch.testing.assert_close(st["exp_avg_sq"], rst["exp_avg_sq"], rtol=1e-5, atol=1e-9)
  # The parameters moved ~25 bf16 ulps; they equal the reference master rounded to bf16
  # (an element may sit on the other side of a rounding boundary: never more than 1 ulp).
  want = master.detach().to(torch.bfloat16)
  assert not torch.equal(p16.detach(), init)
  ulps = (p16.detach().view(torch.int16).int() - want.view(torch.int16).int()).abs()
  assert int(ulps.max()) <= 1
  assert float((ulps == 0).float().mean()) >= 0.99


def test_parameters_without_grad_are_skipped_and_unsupported_options_refused():
  a, b = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
  opt = htorch.Adam([a, b], lr=0.1)
  a.grad = torch.ones(4)
  opt.step()
  assert torch.all(a < 1) and torch.all(b == 1)
  with pytest.raises(ValueError, match="amsgrad"):
    htorch.AdamW([a], amsgrad=True)
  with pytest.raises(ValueError, match="Invalid learning rate"):
    htorch.Adam([a], lr=-1)


def test_a_parameter_whose_first_gradient_arrives_late_starts_at_step_1_like_torch():
  # Unfreezing (or add_param_group): torch counts steps per parameter.
  ours = [torch.nn.Parameter(torch.full((6,), 0.9)), torch.nn.Parameter(torch.full((3,), 0.9))]
  theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
  oo, ot = htorch.AdamW(ours, lr=0.1), torch.optim.AdamW(theirs, lr=0.1)
  g = torch.Generator().manual_seed(1)
  for step in range(8):
    grads = [torch.randn(6, generator=g), torch.randn(3, generator=g)]
    for params in (ours, theirs):
      params[0].grad = grads[0].clone()
      params[1].grad = grads[1].clone() if step >= 5 else None
    oo.step()
    ot.step()
  for a, b in zip(ours, theirs):
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
  assert [float(oo.state[p]["step"]) for p in ours] == [8.0, 3.0]
  assert [float(ot.state[p]["step"]) for p in theirs] == [8.0, 3.0]


def test_per_parameter_steps_load_from_torch_and_back():
  ours = [torch.nn.Parameter(torch.ones(5)), torch.nn.Parameter(torch.ones(4))]
  theirs = [torch.nn.Parameter(torch.ones(5)), torch.nn.Parameter(torch.ones(4))]
  ot = torch.optim.Adam(theirs, lr=0.05)
  g = torch.Generator().manual_seed(2)
  for step in range(5):
    theirs[0].grad = torch.randn(5, generator=g)
    theirs[1].grad = torch.randn(4, generator=g) if step >= 3 else None
    ot.step()
  assert [float(ot.state[p]["step"]) for p in theirs] == [5.0, 2.0]
  for a, b in zip(ours, theirs):
    a.data.copy_(b.detach())
  oo = htorch.Adam(ours, lr=0.05)
  oo.load_state_dict(ot.state_dict())
  assert [float(oo.state[p]["step"]) for p in ours] == [5.0, 2.0]
  for _ in range(3):
    grads = [torch.randn(5, generator=g), torch.randn(4, generator=g)]
    for params in (ours, theirs):
      for p, gr in zip(params, grads):
        p.grad = gr.clone()
    oo.step()
    ot.step()
  for a, b in zip(ours, theirs):
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
  back = torch.optim.Adam([torch.nn.Parameter(p.detach().clone()) for p in ours], lr=0.05)
  back.load_state_dict(oo.state_dict())
  assert [float(s["step"]) for s in back.state_dict()["state"].values()] == [8.0, 5.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replaced_or_rewritten_parameters_are_adopted_like_torch(dtype):
  # torch.optim reads p each step; hostopt must notice p.data replaced (re-init, EMA swap,
  # load_state_dict(assign=True)) and in-place writes to 16-bit parameters (load_state_dict).
  ours, theirs = torch.nn.Linear(4, 3).to(dtype), torch.nn.Linear(4, 3).to(dtype)
  theirs.load_state_dict(ours.state_dict())
  master = torch.nn.Linear(4, 3)  # torch's reference keeps f32 masters of 16-bit params by hand
  master.load_state_dict({k: v.float() for k, v in ours.state_dict().items()})
  oo = htorch.AdamW(ours.parameters(), lr=0.05)
  ot = torch.optim.AdamW(master.parameters(), lr=0.05)
  g = torch.Generator().manual_seed(4)

  def step():
    x = torch.randn(8, 4, generator=g)
    for model in (ours, master):
      model.zero_grad()
      xin = x.to(dtype) if model is ours else x.to(dtype).float()
      model(xin).float().pow(2).mean().backward()
    for po, pm in zip(ours.parameters(), master.parameters()):
      pm.grad = po.grad.float()  # the same gradients (hostopt reads them in the param's dtype)
    oo.step()
    ot.step()

  step()
  # Replace .data of the weight, write the bias in place (as model.load_state_dict does).
  new_w = torch.full((3, 4), 0.25, dtype=dtype)
  ours.weight.data = new_w.clone()
  master.weight.data = new_w.float()
  with torch.no_grad():
    ours.bias.copy_(torch.full((3,), -0.5, dtype=dtype))
    master.bias.copy_(torch.full((3,), -0.5))
  step()
  step()
  for po, pm in zip(ours.parameters(), master.parameters()):
    torch.testing.assert_close(po.float(), pm.to(dtype).float(), rtol=0, atol=float(torch.finfo(dtype).eps) * 4)
  assert ours.weight.dtype == dtype


def test_model_to_dtype_round_trips_keep_training():
  model = torch.nn.Linear(3, 2)
  opt = htorch.AdamW(model.parameters(), lr=0.1)
  for dt in (torch.float32, torch.bfloat16, torch.float32):
    model.to(dt)
    before = [p.detach().clone() for p in model.parameters()]
    model.zero_grad()
    model(torch.ones(4, 3, dtype=dt)).float().sum().backward()
    opt.step()
    for b, p in zip(before, model.parameters()):
      assert p.dtype == dt
      assert not torch.equal(b, p.detach()), "a parameter stopped training after model.to()"


def test_bf16_master_weights_are_in_the_state_dict_and_resume_is_bit_exact():
  torch.manual_seed(0)
  init = torch.randn(500).to(torch.bfloat16)
  a = torch.nn.Parameter(init.clone())
  oa = htorch.AdamW([a], lr=1e-2)
  g = torch.Generator().manual_seed(5)
  grads = [torch.randn(500, generator=g).to(torch.bfloat16) for _ in range(20)]
  for gr in grads[:10]:
    a.grad = gr.clone()
    oa.step()
  sd = oa.state_dict()
  assert sd["state"][0]["master_param"].dtype == torch.float32
  saved_param = a.detach().clone()
  b = torch.nn.Parameter(saved_param.clone())
  ob = htorch.AdamW([b], lr=1e-2)
  ob.load_state_dict(sd)
  for gr in grads[10:]:
    a.grad, b.grad = gr.clone(), gr.clone()
    oa.step()
    ob.step()
  assert torch.equal(a.detach(), b.detach())
  assert torch.equal(oa.state[a]["master_param"], ob.state[b]["master_param"])
  assert torch.equal(oa.state[a]["exp_avg_sq"], ob.state[b]["exp_avg_sq"])


def test_state_dict_hands_out_copies_so_loading_optimizers_never_share_the_arena():
  p = torch.nn.Parameter(torch.ones(6))
  opt = htorch.AdamW([p], lr=0.1)
  p.grad = torch.ones(6)
  opt.step()
  sd = opt.state_dict()
  sd["state"][0]["exp_avg"].fill_(123.0)
  assert float(opt.state[p]["exp_avg"][0]) != 123.0
  q = torch.nn.Parameter(p.detach().clone())
  other = torch.optim.AdamW([q], lr=0.1)
  other.load_state_dict(opt.state_dict())
  q.grad = torch.ones(6)
  before = opt.state[p]["exp_avg"].clone()
  other.step()
  assert torch.equal(opt.state[p]["exp_avg"], before)


def test_maximize_matches_torch_and_foreach_fused_are_accepted():
  ours, theirs = make_model(), make_model()
  oo = htorch.Adam(groups_of(ours, wd=0.05), lr=1e-2, maximize=True, foreach=True, fused=False)
  ot = torch.optim.Adam(groups_of(theirs, wd=0.05), lr=1e-2, maximize=True)
  train(ours, oo, 20)
  train(theirs, ot, 20)
  for a, b in zip(ours.parameters(), theirs.parameters()):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
  with pytest.raises(ValueError, match="capturable"):
    htorch.AdamW(ours.parameters(), capturable=True)


def test_default_threads_are_the_physical_cores(monkeypatch):
  import os
  monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # which would be the default instead
  n = htorch.default_threads()
  assert 1 <= n <= len(os.sched_getaffinity(0))
  assert htorch.AdamW([torch.nn.Parameter(torch.ones(2))])._threads == n
  assert htorch.AdamW([torch.nn.Parameter(torch.ones(2))], threads=1)._threads == 1


def _reference_pair(make, lr=0.1, **kw):
  a, b = make(), make()
  b.data.copy_(a.detach())
  return a, b, htorch.AdamW([a], lr=lr, **kw), torch.optim.AdamW([b], lr=lr, **kw)


def test_writes_to_opt_state_take_effect_as_in_torch():
  for edit in ("replace", "delete", "clear", "step"):
    a, b, oa, ob = _reference_pair(lambda: torch.nn.Parameter(torch.ones(5)))
    for _ in range(2):
      a.grad, b.grad = torch.ones(5), torch.ones(5)
      oa.step()
      ob.step()
    for opt, p in ((oa, a), (ob, b)):
      if edit == "replace":
        opt.state[p]["exp_avg"] = torch.zeros(5)
      elif edit == "delete":
        del opt.state[p]
      elif edit == "clear":
        opt.state.clear()
      else:
        opt.state[p]["step"] = torch.tensor(0.0)
    for _ in range(2):
      a.grad, b.grad = torch.full((5,), -0.5), torch.full((5,), -0.5)
      oa.step()
      ob.step()
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=edit)
    assert float(oa.state[a]["step"]) == float(ob.state[b]["step"]), edit


def test_shared_memory_and_channels_last_parameters_keep_training():
  a, b, oa, ob = _reference_pair(lambda: torch.nn.Parameter(torch.ones(5)))
  a.grad, b.grad = torch.ones(5), torch.ones(5)
  oa.step()
  ob.step()
  a.share_memory_()
  with pytest.warns(UserWarning, match="shared memory"):
    for _ in range(3):
      a.grad, b.grad = torch.ones(5), torch.ones(5)
      oa.step()
      ob.step()
  torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
  for dtype in (torch.float32, torch.bfloat16):
    conv = torch.nn.Conv2d(3, 4, 3).to(dtype=dtype, memory_format=torch.channels_last)
    ref = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    ref.load_state_dict({k: v.float() for k, v in conv.state_dict().items()})
    ours, theirs = htorch.AdamW(conv.parameters(), lr=0.01), torch.optim.AdamW(ref.parameters(), lr=0.01)
    x = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
    for _ in range(3):
      conv.zero_grad()
      ref.zero_grad()
      conv(x.to(dtype)).float().sum().backward()
      for pc, pr in zip(conv.parameters(), ref.parameters()):
        pr.grad = pc.grad.float()
      ours.step()
      theirs.step()
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(conv.weight.float(), ref.weight.to(dtype).float(), rtol=0,
                               atol=float(torch.finfo(dtype).eps) * 4)


def test_resume_is_exact_whichever_is_loaded_first_model_or_optimizer():
  torch.manual_seed(1)
  init = torch.randn(300).to(torch.bfloat16)
  a = torch.nn.Parameter(init.clone())
  oa = htorch.AdamW([a], lr=1e-2)
  g = torch.Generator().manual_seed(6)
  grads = [torch.randn(300, generator=g).to(torch.bfloat16) for _ in range(8)]
  for gr in grads[:4]:
    a.grad = gr.clone()
    oa.step()
  sd, saved = oa.state_dict(), a.detach().clone()
  b = torch.nn.Parameter(torch.zeros(300, dtype=torch.bfloat16))
  ob = htorch.AdamW([b], lr=1e-2)
  ob.load_state_dict(sd)  # the optimizer first, then the model (copy_ into the parameter)
  with torch.no_grad():
    b.copy_(saved)
  for gr in grads[4:]:
    a.grad, b.grad = gr.clone(), gr.clone()
    oa.step()
    ob.step()
  assert torch.equal(a.detach(), b.detach())


def test_unsupported_saved_groups_duplicates_and_copies():
  p = torch.nn.Parameter(torch.ones(3))
  theirs = torch.optim.Adam([torch.nn.Parameter(torch.ones(3))], amsgrad=True)
  with pytest.raises(ValueError, match="amsgrad=True"):
    htorch.Adam([p]).load_state_dict(theirs.state_dict())
  with pytest.raises(ValueError, match="appears twice"), pytest.warns(UserWarning, match="duplicate"):
    o = htorch.Adam([p, p])  # torch itself only warns
    p.grad = torch.ones(3)
    o.step()
  o = htorch.Adam([p], lr=0.1)
  p.grad = torch.ones(3)
  o.step()
  clone = copy.deepcopy(o)  # a working optimizer of its own (torch's deepcopy semantics)
  clone.step()
  assert float(o.state[p]["step"]) == 1.0


def test_decoupled_weight_decay_groups_follow_torch():
  if "decoupled_weight_decay" not in torch.optim.Adam.__init__.__code__.co_varnames:
    pytest.skip("this torch has no decoupled_weight_decay")
  a, b = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
  oa = htorch.Adam([{"params": [a], "decoupled_weight_decay": True}], lr=0.1, weight_decay=0.5)
  ob = torch.optim.Adam([{"params": [b], "decoupled_weight_decay": True}], lr=0.1, weight_decay=0.5)
  for _ in range(3):
    a.grad, b.grad = torch.ones(4), torch.ones(4)
    oa.step()
    ob.step()
  torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def _twin_models(dtype):
  torch.manual_seed(0)
  a = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).to(dtype)
  return a, copy.deepcopy(a)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_offloaded_parameters_through_the_pipeline_match_the_in_place_step(dtype):
  # CPU tensors stand in for device tensors through the host engine: the same code path as
  # CUDA parameters (flat device buffers, gradients gathered, a stream-ordered pipeline step).
  a, b = _twin_models(dtype)
  oa = htorch.AdamW(a.parameters(), lr=1e-2, offload="host", offload_chunk=64)
  ob = htorch.AdamW(b.parameters(), lr=1e-2)
  g = torch.Generator().manual_seed(1)

  def steps(n):
    for _ in range(n):
      x = torch.randn(4, 8, generator=g).to(dtype)
      for m, o in ((a, oa), (b, ob)):
        o.zero_grad()
        m(x).float().pow(2).mean().backward()
        o.step()

  steps(4)
  # The user replaces one parameter and writes another in place, as torch users do.
  for m in (a, b):
    m[0].weight.data = torch.full((16, 8), 0.05, dtype=dtype)
    with torch.no_grad():
      m[2].bias.copy_(torch.full((4,), -0.25, dtype=dtype))
  steps(3)
  for p, q in zip(a.parameters(), b.parameters()):
    assert torch.equal(p, q)
  # Their state_dicts are interchangeable: resume the in-place one from the offloaded one.
  c = copy.deepcopy(a)
  oc = htorch.AdamW(c.parameters(), lr=1e-2)
  oc.load_state_dict(oa.state_dict())
  for key in ("exp_avg", "exp_avg_sq", "step"):
    assert torch.equal(oc.state[next(c.parameters())][key], ob.state[next(b.parameters())][key])


def test_offloaded_step_skips_parameters_without_gradient_like_torch():
  # torch leaves a parameter whose .grad is None alone (its moments and its own step); the
  # offloaded step does too, bit for bit with the in-place step, and unfreezes at t = 1.
  a, b = _twin_models(torch.float32)
  c = copy.deepcopy(a)
  oa = htorch.AdamW(a.parameters(), lr=1e-2, offload="host", offload_chunk=64)
  ob = htorch.AdamW(b.parameters(), lr=1e-2)
  oc = torch.optim.AdamW(c.parameters(), lr=1e-2)
  g = torch.Generator().manual_seed(3)
  for step in range(6):
    x = torch.randn(4, 8, generator=g)
    for m, o in ((a, oa), (b, ob), (c, oc)):
      o.zero_grad()
      m(x).pow(2).mean().backward()
      if step < 3:
        m[2].bias.grad = None  # frozen for three steps, then trained from its step 1
      if step == 4:
        m[0].weight.grad = None
      o.step()
    for p, q, r in zip(a.parameters(), b.parameters(), c.parameters()):
      assert torch.equal(p, q)
      torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
  steps = [float(oa.state[p]["step"]) for p in a.parameters()]
  assert steps == [float(oc.state[p]["step"]) for p in c.parameters()] == [5.0, 6.0, 6.0, 3.0]
  # No gradient at all: nothing happens, as in torch.
  before = [p.detach().clone() for p in a.parameters()]
  oa.zero_grad(set_to_none=True)
  oa.step()
  assert all(torch.equal(p, q) for p, q in zip(a.parameters(), before))
  assert [float(oa.state[p]["step"]) for p in a.parameters()] == steps


def test_offload_options_are_checked():
  a, _ = _twin_models(torch.float32)
  with pytest.raises(ValueError, match="offload="):
    htorch.AdamW(a.parameters(), offload="gpu")
  with pytest.raises(ValueError, match="overlap=True needs CUDA"):
    htorch.AdamW(a.parameters(), offload="host", overlap=True)


def test_offload_cuda_on_cpu_parameters_is_refused_at_construction():
  # It was accepted here and refused only at the first step(), after the training loop began.
  a, _ = _twin_models(torch.float32)
  with pytest.raises(ValueError, match=r"offload='cuda' but the parameters are on the CPU \(param_groups\[0\]"
                                       r"\['params'\]\[0\] is on cpu\)"):
    htorch.AdamW(a.parameters(), offload="cuda")
  with pytest.raises(ValueError, match=r"param_groups\[1\]\['params'\]\[0\] is on cpu"):
    htorch.Adam([{"params": []}, {"params": list(a.parameters())}], offload="cuda")


_HOOKS = hasattr(torch.Tensor, "register_post_accumulate_grad_hook")


@pytest.mark.skipif(not _HOOKS, reason="post-accumulate-grad hooks need torch >= 2.1")
@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_overlap_backward_moves_gradients_into_the_pipeline_as_they_complete():
  # Each gradient lands in the flat device gradient buffer as the backward completes it,
  # and each chunk gets an event the pipeline's copy of it waits on (so copies and CPU
  # updates overlap the rest of the backward on a GPU). Gradients written after the
  # backward (clipping in place), or chunks the backward reached in part (a frozen layer),
  # fall back to the whole stream; the results are the in-place step's bits in every case.
  torch.manual_seed(0)
  a = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                          torch.nn.Linear(32, 4))
  a[2].bias.requires_grad_(False)  # frozen when the optimizer is made: no hook can be put on it yet
  b = copy.deepcopy(a)
  oa = htorch.AdamW(a.parameters(), lr=1e-2, offload="host", offload_chunk=256, overlap_backward=True)
  ob = htorch.AdamW(b.parameters(), lr=1e-2)
  g = torch.Generator().manual_seed(5)

  def step(clip=False, micro=1, freeze=None, set_to_none=True):
    for m, o in ((a, oa), (b, ob)):
      o.zero_grad(set_to_none=set_to_none)
      if freeze is not None:  # no gradient in this backward, so no report: its chunks are not complete
        m[freeze].weight.requires_grad_(False)
    for _ in range(micro):
      x = torch.randn(4, 8, generator=g)
      for m in (a, b):
        m(x).pow(2).mean().backward()
    for m, o in ((a, oa), (b, ob)):
      if freeze is not None:
        m[freeze].weight.requires_grad_(True)
      if clip:
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
      o.step()
    for p, q in zip(a.parameters(), b.parameters()):
      assert torch.equal(p, q)
    return oa._last_chunk_events

  assert step() == 0  # the first step builds the layout: no hooks ran yet
  dev = oa._layout["f32"].dev
  chunks = dev.pipe.num_chunks
  assert chunks >= 4
  frozen = step()  # the chunk of the frozen bias never completes
  assert 0 < frozen < chunks
  for m in (a, b):
    m[2].bias.requires_grad_(True)  # unfrozen: hooked at the next step
  step()
  assert step() == chunks  # every chunk completed by the backward
  base, end = dev.grads.data_ptr(), dev.grads.data_ptr() + dev.grads.numel() * 4
  assert all(base <= p.grad.data_ptr() < end for p in a.parameters())  # gradients are views of the flat buffer
  assert step(micro=2) == chunks  # accumulation: complete again in the last backward
  assert step(micro=3, set_to_none=False) == chunks
  assert step(clip=True) == 0  # written after the backward: the whole stream orders the copies
  partial = step(freeze=0)  # the first layer (last in the arena) gets no gradient
  assert 0 < partial < chunks
  # create_graph=True: the differentiable gradient stays torch's; the step gathers it.
  for m, o in ((a, oa), (b, ob)):
    o.zero_grad(set_to_none=True)
    m(torch.ones(2, 8)).pow(2).sum().backward(create_graph=True)
    assert all(p.grad.requires_grad for p in m.parameters())
    o.step()
  for p, q in zip(a.parameters(), b.parameters()):
    assert torch.equal(p, q)
  # The hooks do not keep the optimizer alive, and go with it.
  hooks = lambda: sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in a.parameters())
  assert hooks() == 6
  ref = weakref.ref(oa)
  del oa, dev
  gc.collect()
  assert ref() is None and hooks() == 0
  a(torch.ones(1, 8)).sum().backward()


def test_overlap_backward_is_refused_where_it_cannot_apply():
  a, _ = _twin_models(torch.float32)
  if not _HOOKS:
    with pytest.raises(ValueError, match="torch >= 2.1"):
      htorch.AdamW(a.parameters(), offload="host", overlap_backward=True)
    return
  with pytest.raises(ValueError, match="applies to offloaded parameters"):
    htorch.AdamW(a.parameters(), overlap_backward=True)
  # Without it, no hooks: gradients stay the user's tensors.
  oa = htorch.AdamW(a.parameters(), offload="host")
  a(torch.ones(2, 8)).sum().backward()
  oa.step()
  kept = [p.grad for p in a.parameters()]
  oa.zero_grad(set_to_none=True)
  a(torch.ones(2, 8)).sum().backward()
  assert all(p.grad is not k for p, k in zip(a.parameters(), kept)) and oa._last_chunk_events == 0


class _RecordingEngine:
  """Stands in for a copy engine: logs which events are recorded when."""

  def __init__(self):
    self.log, self.count = [], 0

  def create_event(self):
    self.count += 1
    return self.count

  def record_event(self, event, stream):
    self.log.append(event)

  def destroy_event(self, event):
    pass


def test_a_chunk_event_is_recorded_only_once_all_its_parameters_reported():
  # A chunk's event recorded before its last gradient would let the copy read gradients
  # the backward has not written yet (on a GPU): check the rule itself. Chunks of 16
  # elements; tensors at (offset, size): t0 [0, 20) spans chunks 0-1, t1 [32, 8) chunk 2,
  # t2 [48, 40) chunks 3-5, t3 [96, 0) none.
  from hostopt._torch_offload import ChunkEvents as _ChunkEvents
  engine = _RecordingEngine()
  ev = _ChunkEvents(engine, 6, 16)
  ev.cover([(0, 20), (32, 8), (48, 40), (96, 0)], [0, 1, 2, 3])
  ev.callback_queued = ev2_queued = True  # outside a backward: no end-of-backward callback to queue
  grads = torch.zeros(96)
  ev.hooked(2, 0, grads)  # chunks 3-5 (only t2 in them)
  assert engine.log == [4, 5, 6]
  ev.hooked(1, 0, grads)
  assert engine.log[3:] == [3]
  ev.hooked(0, 0, grads)
  assert engine.log[4:] == [1, 2] and ev.recorded == [True] * 6
  # A second backward (accumulation) reaching only t0: chunks 0-1 are recorded again; a
  # chunk shared by a tensor that reported again and one that did not is cancelled.
  ev2 = _ChunkEvents(engine, 2, 16)
  ev2.cover([(0, 20), (20, 12)], [0, 1])  # chunk 1 holds both
  ev2.callback_queued = ev2_queued
  ev2.hooked(0, 0, grads)
  assert ev2.recorded == [True, False]
  ev2.hooked(1, 0, grads)
  assert ev2.recorded == [True, True]
  ev2.hooked(0, 0, grads)  # t0 again: chunk 1's event predates this write
  assert ev2.recorded == [True, False]
  ev2.hooked(1, 0, grads)
  assert ev2.recorded == [True, True]


def test_state_dict_has_entries_only_for_parameters_that_were_stepped_like_torch():
  ours = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
  theirs = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
  oo, ot = htorch.AdamW(ours, lr=0.1), torch.optim.AdamW(theirs, lr=0.1)
  ours[0].grad, theirs[0].grad = torch.ones(3), torch.ones(3)
  oo.step()
  ot.step()
  assert set(oo.state_dict()["state"]) == set(ot.state_dict()["state"]) == {0}
  # Loaded back, the never-stepped parameter starts at step 1 either way.
  again = htorch.AdamW([torch.nn.Parameter(p.detach().clone()) for p in ours], lr=0.1)
  again.load_state_dict(oo.state_dict())
  ot.load_state_dict(oo.state_dict())
  for params, opt in ((list(again.param_groups[0]["params"]), again), (theirs, ot)):
    for p in params:
      p.grad = torch.ones(p.shape)
    opt.step()
  assert [float(again.state[p]["step"]) for p in again.param_groups[0]["params"]] == [2.0, 1.0]
  assert [float(ot.state[p]["step"]) for p in theirs] == [2.0, 1.0]


def _stepped_pair(dtype, steps=3, **kw):
  """Two identical optimizers over one (6, 5) parameter, stepped alike; and their gradients."""
  g = torch.Generator().manual_seed(7)
  init = torch.randn(6, 5, generator=g).to(dtype)
  grads = [torch.randn(6, 5, generator=g).to(dtype) for _ in range(steps + 2)]
  pairs = []
  for _ in range(2):
    p = torch.nn.Parameter(init.clone())
    opt = htorch.AdamW([p], lr=1e-2, **kw)
    for gr in grads[:steps]:
      p.grad = gr.clone()
      opt.step()
    pairs.append((p, opt))
  return pairs, grads[steps:]


def _same_state(a: dict, b: dict) -> bool:
  return a["state"].keys() == b["state"].keys() and all(
      sa.keys() == sb.keys() and all(torch.equal(x, sb[k]) if torch.is_tensor(x) else x == sb[k] for k, x in sa.items())
      for sa, sb in ((a["state"][i], b["state"][i]) for i in a["state"]))


def _refused_load_changes_nothing(pairs, grads, bad, words, convert=False):
  """The load is refused naming the rule; the state and the next steps are exactly those of
  the twin that never saw it."""
  (p, opt), (twin_p, twin) = pairs
  before, param_before = copy.deepcopy(opt.state_dict()), p.detach().clone()
  with pytest.raises((ValueError, TypeError), match=words):
    opt.load_state_dict(bad, convert_moments=convert)
  assert torch.equal(p.detach(), param_before)
  assert _same_state(opt.state_dict(), before)
  for gr in grads:
    p.grad, twin_p.grad = gr.clone(), gr.clone()
    opt.step()
    twin.step()
  assert torch.equal(p.detach(), twin_p.detach())
  assert _same_state(opt.state_dict(), twin.state_dict())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["negative exp_avg_sq", "step", "master_param", "shape"])
def test_a_refused_load_changes_nothing_and_the_next_steps_are_as_before(dtype, case):
  # Everything in the state_dict is checked before anything changes: a second moment is never
  # negative (it would be NaN a step later), a step is an integer count (2.5 is not truncated,
  # -1 or NaN not taken for 0), a master fits its parameter (never silently ignored).
  bads = []
  pairs, grads = _stepped_pair(dtype)
  good = pairs[0][1].state_dict()
  if case == "negative exp_avg_sq":
    bad = copy.deepcopy(good)
    bad["state"][0]["exp_avg_sq"][2, 3] = -1.0
    bads.append((bad, "exp_avg_sq has negative entries: a second moment is never negative"))
  elif case == "step":
    for step in (-1, float("nan"), float("inf"), None, 1e20, 2**53 + 1, "abc", 2.5, True, torch.tensor(2.5),
                 torch.tensor([1.0, 2.0]), torch.tensor(-3)):
      bad = copy.deepcopy(good)
      bad["state"][0]["step"] = step
      bads.append((bad, r"\['step'\] = .*: a step count is an integer in \[0, 2\*\*53\]"))
  elif case == "master_param":
    for master in (torch.zeros(29), torch.zeros(5, 6), torch.zeros(6, 5, dtype=torch.float64),
                   torch.zeros(6, 5, dtype=torch.int32), [0.0] * 30):
      bad = copy.deepcopy(good)
      bad["state"][0]["master_param"] = master
      bads.append((bad, "master_param is .*: expected the master weights, float32 with the parameter's shape"))
  else:
    for key in ("exp_avg", "exp_avg_sq"):
      bad = copy.deepcopy(good)
      bad["state"][0][key] = bad["state"][0][key].reshape(5, 6)
      bads.append((bad, rf"{key} has shape \(5, 6\), the parameter \(6, 5\)"))
  for bad, words in bads:
    pairs, grads = _stepped_pair(dtype)
    _refused_load_changes_nothing(pairs, grads, bad, words)


def test_loaded_steps_may_be_ints_integral_floats_or_one_element_tensors():
  for step in (3, 3.0, np.int64(3), torch.tensor(3.0), torch.tensor(3), torch.tensor([3.0])):
    (p, opt), (twin_p, twin) = _stepped_pair(torch.float32)[0]
    sd = opt.state_dict()
    sd["state"][0]["step"] = step
    opt.load_state_dict(sd)
    for q, o in ((p, opt), (twin_p, twin)):
      q.grad = torch.ones(6, 5)
      o.step()
    assert torch.equal(p.detach(), twin_p.detach()), repr(step)
    assert float(opt.state[p]["step"]) == 4.0


def test_a_refused_step_across_dtypes_changes_nothing():
  # One f32 and one bf16 parameter, the bf16 one with a sparse gradient: torch.optim raises
  # with nothing changed; so does hostopt (every dtype's gradients are checked before any
  # dtype is stepped). A retry with a dense gradient is the step torch.optim takes.
  g = torch.Generator().manual_seed(3)
  a = torch.nn.Parameter(torch.randn(7, generator=g))
  b = torch.nn.Parameter(torch.randn(9, generator=g).to(torch.bfloat16))
  ref_a, ref_b = torch.nn.Parameter(a.detach().clone()), torch.nn.Parameter(b.detach().float())  # b's f32 master
  ours, theirs = htorch.AdamW([a, b], lr=0.05), torch.optim.AdamW([ref_a, ref_b], lr=0.05)
  grads = [(torch.randn(7, generator=g), torch.randn(9, generator=g).to(torch.bfloat16)) for _ in range(3)]
  a.grad, b.grad = grads[0][0].clone(), grads[0][1].clone()
  ref_a.grad, ref_b.grad = grads[0][0].clone(), grads[0][1].float()
  ours.step()
  theirs.step()
  sparse = grads[1][1].to_sparse()
  a.grad, b.grad = grads[1][0].clone(), sparse
  ref_a.grad, ref_b.grad = grads[1][0].clone(), sparse.float()
  before = (a.detach().clone(), b.detach().clone(), copy.deepcopy(ours.state_dict()))
  with pytest.raises(RuntimeError, match="sparse gradient"):
    ours.step()
  with pytest.raises(RuntimeError, match="sparse"):
    theirs.step()
  assert torch.equal(a.detach(), before[0]) and torch.equal(b.detach(), before[1])
  assert _same_state(ours.state_dict(), before[2])
  assert [float(ours.state[p]["step"]) for p in (a, b)] == [1.0, 1.0]
  for gr in grads[1:]:
    a.grad, b.grad = gr[0].clone(), gr[1].clone()
    ref_a.grad, ref_b.grad = gr[0].clone(), gr[1].float()
    ours.step()
    theirs.step()
  assert [float(ours.state[p]["step"]) for p in (a, b)] == [3.0, 3.0]
  torch.testing.assert_close(a, ref_a, rtol=1e-6, atol=1e-7)
  torch.testing.assert_close(ours.state[b]["master_param"], ref_b.detach(), rtol=1e-6, atol=1e-7)


def test_parameters_appended_to_or_replaced_in_param_groups_are_trained_like_torch():
  # torch.optim steps whatever param_groups[i]["params"] holds at each step: hostopt adopts
  # parameters appended or replaced there after the first step, as add_param_group would.
  def params():
    g = torch.Generator().manual_seed(5)
    return [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (5, 3, 4, 6, 2)]

  ours, theirs = params(), params()
  oo = htorch.AdamW([{"params": ours[:2]}, {"params": [ours[2]], "lr": 0.02}], lr=0.05)
  ot = torch.optim.AdamW([{"params": theirs[:2]}, {"params": [theirs[2]], "lr": 0.02}], lr=0.05)
  g = torch.Generator().manual_seed(6)
  for step in range(6):
    if step == 2:
      for opt, ps in ((oo, ours), (ot, theirs)):
        opt.param_groups[0]["params"].append(ps[3])
        opt.param_groups[1]["params"][0] = ps[4]  # ps[2] leaves the optimizer: no longer stepped
    grads = [torch.randn(p.shape, generator=g) for p in ours]
    for ps in (ours, theirs):
      for p, gr in zip(ps, grads):
        p.grad = gr.clone()
    oo.step()
    ot.step()
  for a, b in zip(ours, theirs):
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
  for k in (0, 1, 3, 4):
    assert float(oo.state[ours[k]]["step"]) == float(ot.state[theirs[k]]["step"]) == (6 if k < 2 else 4)
  assert float(oo.state[ours[2]]["step"]) == float(ot.state[theirs[2]]["step"]) == 2


def _mixed_dtype_optimizer():
  """Six f32 and two bf16 parameters with fixed gradients: every step is alike, so replaying
  k steps from scratch gives the state after step k."""
  g = torch.Generator().manual_seed(8)
  ps = [torch.nn.Parameter(torch.randn(20000, generator=g)) for _ in range(6)]
  ps += [torch.nn.Parameter(torch.randn(20000, generator=g).to(torch.bfloat16)) for _ in range(2)]
  for p in ps:
    p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
  return ps, htorch.AdamW(ps, lr=1e-3, threads=1)


def _copies_while_stepping(opt, take, copies=30):
  """`take()` results while another thread steps `opt` in a loop, each taken after at least
  one more step than the one before (or after the stepper ended): ordered by the steps'
  own signals, never by time."""
  import threading
  done, errors, cond = [0, False], [], threading.Condition()

  def stepper():
    try:
      while not done[1]:  # until the last copy is taken: each is taken while stepping goes on
        opt.step()
        with cond:
          done[0] += 1
          cond.notify_all()
    except Exception as e:  # reported below
      errors.append(e)
    with cond:
      done[1] = True
      cond.notify_all()

  thread = threading.Thread(target=stepper)
  thread.start()
  out = []
  try:
    for _ in range(copies):
      with cond:
        seen = done[0]
        cond.wait_for(lambda: done[0] > seen or done[1])
      out.append(take())
  finally:
    with cond:
      done[1] = True
    thread.join()
  assert not errors
  return out


def test_state_dict_while_another_thread_steps_is_one_steps_state():
  # A step is several core calls (one per parameter dtype, then the step counts): a
  # state_dict taken meanwhile must be the state after some step k, never a mix of two.
  _, opt = _mixed_dtype_optimizer()
  snaps = _copies_while_stepping(opt, opt.state_dict)
  counts = [sorted({int(st["step"]) for st in sd["state"].values()}) for sd in snaps]
  assert all(len(c) == 1 for c in counts), f"copies mixing steps: {counts}"
  _, replay = _mixed_dtype_optimizer()
  for k in range(max(c[0] for c in counts) + 1):
    if k:
      replay.step()
    if [k] in counts:
      want = replay.state_dict()
      for i, (sd, c) in enumerate(zip(snaps, counts)):
        if c == [k]:
          assert _same_state(sd, want), f"copy {i} is not the state after step {k}"


def _twins(dtypes=(torch.float32,), n=6, lr=0.05, steps=3, **kw):
  """Two identical optimizers over one parameter per dtype, stepped alike with ones."""
  out = []
  for _ in range(2):
    g = torch.Generator().manual_seed(4)
    ps = [torch.nn.Parameter(torch.randn(n, generator=g).to(dt)) for dt in dtypes]
    opt = htorch.AdamW(ps, lr=lr, **kw)
    for k in range(steps):
      for p in ps:
        p.grad = torch.full((n,), 0.5 + k).to(p.dtype)
      opt.step()
    out.append((ps, opt))
  return out


def _step_both(pairs, grad=1.5):
  for ps, opt in pairs:
    for p in ps:
      p.grad = torch.full(p.shape, grad).to(p.dtype)
    opt.step()


def _same_as_twin(pairs):
  (a, oa), (b, ob) = pairs
  assert all(torch.equal(x.detach(), y.detach()) for x, y in zip(a, b))
  assert _same_state(oa.state_dict(), ob.state_dict())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rebuild_refused_part_way_leaves_every_parameter_as_it_was(dtype):
  # A parameter appended with a state that does not fit it makes the rebuild refuse: the
  # parameters built before it keep their layout and step counts (they used to point at the
  # abandoned layout, at step 0: bias correction restarted silently).
  pairs = _twins((dtype, dtype))
  (ps, opt), _ = pairs
  before = copy.deepcopy(opt.state_dict())
  q = torch.nn.Parameter(torch.zeros(3).to(dtype))
  opt.state[q] = {"exp_avg": torch.zeros(5)}
  opt.param_groups[0]["params"].append(q)
  for p in ps:
    p.grad = torch.full(p.shape, 1.5).to(dtype)
  q.grad = torch.ones(3).to(dtype)
  with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[2\]: exp_avg has 5 elements"):
    opt.step()
  assert [float(opt.state[p]["step"]) for p in ps] == [3.0, 3.0]
  opt.param_groups[0]["params"].pop()
  del opt.state[q]
  assert _same_state(opt.state_dict(), before)
  for _ in range(3):
    _step_both(pairs)
  _same_as_twin(pairs)


def test_a_sparse_moment_is_refused_at_load():
  pairs, grads = _stepped_pair(torch.float32)
  bad = copy.deepcopy(pairs[0][1].state_dict())
  bad["state"][0]["exp_avg"] = bad["state"][0]["exp_avg"].to_sparse()
  _refused_load_changes_nothing(pairs, grads, bad, "exp_avg is a torch.sparse_coo tensor: moments are dense")


def test_a_parameter_removed_from_param_groups_is_left_alone():
  # torch.optim no longer looks at a parameter taken out of param_groups: hostopt used to
  # check it at every step (another shape then refused every step).
  for cls in (torch.optim.AdamW, htorch.AdamW):
    p, q = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(3))
    opt = cls([p], lr=0.1)
    p.grad = torch.ones(4)
    opt.step()
    opt.param_groups[0]["params"][0] = q
    p.data = torch.zeros(10)
    q.grad = torch.ones(3)
    opt.step()
    assert float(opt.state[q]["step"]) == 1.0, cls


def test_a_step_at_the_largest_count_is_refused_before_any_dtype_moves():
  # A step count of 2**53 loads (the largest count); the next step cannot be taken: refused
  # before any dtype is stepped (the f32 parameter used to move before the core refused).
  (ps, opt), _ = _twins((torch.float32, torch.bfloat16), steps=1)
  sd = opt.state_dict()
  sd["state"][1]["step"] = 2**53
  opt.load_state_dict(sd)
  for p in ps:
    p.grad = torch.ones(p.shape).to(p.dtype)
  before = [p.detach().clone() for p in ps]
  for _ in range(2):
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\] is at step 9007199254740992, the "
                                         r"largest step count"):
      opt.step()
    assert all(torch.equal(p.detach(), b) for p, b in zip(ps, before))
    assert [float(opt.state[p]["step"]) for p in ps] == [1.0, 2.0**53]


@pytest.mark.parametrize("value", [2.5, -1.0, float("nan"), 1e20, None])
def test_a_step_written_into_opt_state_is_checked_as_a_loaded_one(value):
  # The step handed out is a view of hostopt's step counts: written in place (fill_) or
  # replaced, it is checked at the next step with load's rule, before anything moves (2.5
  # was truncated, -1 reached the core as '0.0', None became 0).
  pairs = _twins((torch.float32, torch.bfloat16), steps=2)
  (ps, opt), _ = pairs
  if value is None:
    opt.state[ps[1]]["step"] = None
  else:
    opt.state[ps[1]]["step"].fill_(value)
  before = [p.detach().clone() for p in ps]
  for p in ps:
    p.grad = torch.ones(p.shape).to(p.dtype)
  with pytest.raises(ValueError, match=r"opt.state\[p\]\['step'\] of param_groups\[0\]\['params'\]\[1\] = .*: a "
                                       r"step count is an integer in \[0, 2\*\*53\]"):
    opt.step()
  assert all(torch.equal(p.detach(), b) for p, b in zip(ps, before))
  assert float(opt.state[ps[0]]["step"]) == 2.0
  if value is None:
    opt.state[ps[1]]["step"] = torch.tensor(2.0)
  else:
    opt.state[ps[1]]["step"].fill_(2)
  for _ in range(2):
    _step_both(pairs)
  _same_as_twin(pairs)


def test_a_gradient_of_another_shape_is_refused_before_any_dtype_moves():
  a = torch.nn.Parameter(torch.randn(2, 3))
  b = torch.nn.Parameter(torch.randn(4).to(torch.bfloat16))
  opt = htorch.AdamW([a, b], lr=0.1)
  a.grad, b.grad = torch.ones(2, 3), torch.ones(4).to(torch.bfloat16)
  opt.step()
  b.grad.data = torch.ones(2, 2).to(torch.bfloat16)  # the same gradient tensor, another shape
  before = (a.detach().clone(), b.detach().clone())
  with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\] has a gradient of shape \(2, 2\) on "
                                       r"cpu: expected the parameter's, \(4,\)"):
    opt.step()
  assert torch.equal(a.detach(), before[0]) and torch.equal(b.detach(), before[1])
  assert [float(opt.state[p]["step"]) for p in (a, b)] == [1.0, 1.0]


@pytest.mark.parametrize("key,value", [("lr", -1.0), ("lr", float("nan")), ("lr", "abc"), ("betas", (1.0, 0.999)),
                                       ("betas", (0.9, 1.5)), ("betas", 0.9), ("eps", -1e-8),
                                       ("weight_decay", float("inf"))])
def test_saved_hyper_parameters_no_step_can_use_are_refused_at_load(key, value):
  pairs, grads = _stepped_pair(torch.float32)
  bad = copy.deepcopy(pairs[0][1].state_dict())
  bad["param_groups"][0][key] = value
  _refused_load_changes_nothing(pairs, grads, bad, rf"state_dict\['param_groups'\]\[0\]\['{key}'\] = ")


def test_a_bad_hyper_parameter_is_named_by_torchs_group_index():
  a, b = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(4))
  opt = htorch.AdamW([{"params": [a]}, {"params": [b]}], lr=0.1)
  a.grad = b.grad = torch.ones(4)
  opt.step()
  opt.param_groups[0]["lr"] = -0.1  # (the core's groups are in reverse order: it said groups[1])
  with pytest.raises(ValueError, match=r"^param_groups\[0\]\['lr'\] = -0.1: expected a finite value >= 0"):
    opt.step()
  opt.param_groups[1]["betas"] = (0.9, 1.0)
  opt.param_groups[0]["lr"] = 0.1
  with pytest.raises(ValueError, match=r"^param_groups\[1\]\['betas'\] = \(0.9, 1.0\): expected two values"):
    opt.step()


def test_a_state_entry_of_no_parameter_is_refused_at_load():
  pairs, grads = _stepped_pair(torch.float32)
  bad = copy.deepcopy(pairs[0][1].state_dict())
  bad["state"][7] = {"step": "abc", "exp_avg": torch.full((4,), -1.0)}
  _refused_load_changes_nothing(pairs, grads, bad, r"state_dict\['state'\]\[7\] belongs to no parameter")


def test_a_deepcopy_while_another_thread_steps_is_one_steps_state():
  # copy.deepcopy (and pickle) copy under the step's lock: never parameters at two steps.
  _, opt = _mixed_dtype_optimizer()
  copies = _copies_while_stepping(opt, lambda: copy.deepcopy(opt))
  counts = [sorted({float(st["step"]) for st in c.state.values()}) for c in copies]
  assert all(len(c) == 1 for c in counts), f"copies mixing steps: {counts}"


_LOAD_HOOKS = hasattr(torch.optim.Optimizer, "register_load_state_dict_pre_hook")


@pytest.mark.skipif(not _LOAD_HOOKS, reason="load_state_dict hooks need torch >= 2")
def test_load_state_dict_pre_and_post_hooks_are_honoured_as_torch_does():
  # A pre-hook's returned dict is what is checked and loaded; post-hooks run once hostopt's
  # state is in place, and their edits are the state.
  for dtype in (torch.float32, torch.bfloat16):
    results = {}
    for cls in (torch.optim.AdamW, htorch.AdamW):
      p = torch.nn.Parameter(torch.linspace(-1, 1, 4).to(dtype))
      opt = cls([p], lr=0.1)
      for _ in range(3):
        p.grad = torch.ones(4).to(dtype)
        opt.step()

      def pre(o, sd):
        sd = copy.deepcopy(sd)
        sd["state"][0]["step"] = torch.tensor(1.0)
        sd["state"][0]["exp_avg"] = torch.zeros(4)
        return sd

      def post(o):
        o.state[p]["exp_avg_sq"] = torch.zeros_like(o.state[p]["exp_avg_sq"])

      handles = [opt.register_load_state_dict_pre_hook(pre), opt.register_load_state_dict_post_hook(post)]
      opt.load_state_dict(copy.deepcopy(opt.state_dict()))
      st = opt.state[p]
      results[cls] = (float(st["step"]), st["exp_avg"].float().tolist(), st["exp_avg_sq"].float().tolist())
      for h in handles:
        h.remove()

      def bad(o, sd):
        sd = copy.deepcopy(sd)
        sd["state"][0]["exp_avg_sq"][0] = -1.0
        return sd

      if cls is htorch.AdamW:
        opt.register_load_state_dict_pre_hook(bad)
        with pytest.raises(ValueError, match="a second moment is never negative"):
          opt.load_state_dict(opt.state_dict())
    assert results[htorch.AdamW] == results[torch.optim.AdamW] == (1.0, [0.0] * 4, [0.0] * 4), results


@pytest.mark.skipif(not _HOOKS, reason="post-accumulate-grad hooks need torch >= 2.1")
def test_backward_hooks_do_not_pile_up_with_each_load():
  m = torch.nn.Linear(8, 8)
  x = torch.randn(4, 8)
  calls = []
  opt = htorch.AdamW(m.parameters(), lr=1e-2, offload="host", overlap_backward=True)
  for _ in range(3):
    opt.zero_grad()
    m(x).pow(2).mean().backward()
    opt.step()
    calls.append(len(m.weight._post_accumulate_grad_hooks))
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
  assert calls == [1, 1, 1]


@pytest.mark.skipif(not hasattr(torch, "compile"), reason="torch.compile needs torch >= 2")
def test_a_compiled_step_builds_the_layout_eagerly_and_steps_as_eager():
  pytest.importorskip("torch._dynamo")
  x = torch.randn(16, 8)
  models = []
  for compiled in (True, False):
    torch.manual_seed(0)
    m = torch.nn.Linear(8, 8)
    opt = htorch.AdamW(m.parameters(), lr=1e-2)
    for k in range(3):
      opt.zero_grad()
      m(x).pow(2).mean().backward()
      (torch.compile(opt.step) if compiled and k == 0 else opt.step)()
    models.append((m, opt))
  (a, oa), (b, ob) = models
  assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
  assert _same_state(oa.state_dict(), ob.state_dict())


_OPTIONS = ("params", "lr", "betas", "eps", "weight_decay", "amsgrad", "foreach", "maximize", "capturable",
            "differentiable", "fused", "decoupled_weight_decay", "threads", "offload", "offload_chunk", "overlap",
            "overlap_backward", "moments", "rounding_seed", "skip_nonfinite", "store", "store_options", "resume")


@pytest.mark.parametrize("name", ["Adam", "AdamW"])
def test_the_signature_and_the_docstring_show_every_option(name):
  import doctest
  import inspect
  import pydoc
  cls = getattr(htorch, name)
  sig = inspect.signature(cls)
  assert tuple(sig.parameters) == _OPTIONS
  assert not any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values())
  assert sig.parameters["weight_decay"].default == (1e-2 if name == "AdamW" else 0.0)
  # AdamW's own signature stays Adam's but for weight_decay's default.
  other = inspect.signature(htorch.Adam if name == "AdamW" else htorch.AdamW)
  assert [(p.name, p.kind, p.default) for p in sig.parameters.values() if p.name != "weight_decay"] == [
      (p.name, p.kind, p.default) for p in other.parameters.values() if p.name != "weight_decay"]
  text = pydoc.render_doc(cls, renderer=pydoc.plaintext)
  assert ".. math::" in text and "Example:" in text
  args = text.split("Args:")[1].split("Attributes:")[0]
  assert [o for o in _OPTIONS if f"  {o} (" not in args] == []
  tests = doctest.DocTestFinder().find(cls, name, globs={})
  runner = doctest.DocTestRunner()
  for t in tests:
    runner.run(t)
  assert runner.tries > 0 and runner.failures == 0
  p = torch.nn.Parameter(torch.ones(3))
  with pytest.raises(TypeError, match="bogus"):
    cls([p], bogus=1)


def test_adamw_takes_every_option_by_name_and_keeps_them_through_copies():
  import pickle
  opts = dict(lr=0.1, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.5, amsgrad=False, foreach=False, maximize=True,
              capturable=False, differentiable=False, fused=False, decoupled_weight_decay=False, threads=1,
              offload="host", offload_chunk=64, overlap=False, overlap_backward=False, moments="bf16",
              rounding_seed=5, skip_nonfinite=True)
  p = torch.nn.Parameter(torch.linspace(-1, 1, 40))
  opt = htorch.AdamW([p], **opts)
  own = dict(_threads=1, _offload="host", _offload_chunk=64, _overlap=False, _overlap_backward=False,
             _skip_nonfinite=True)
  assert {k: getattr(opt, k) for k in own} == own
  assert opt.defaults["decoupled_weight_decay"] is False and opt.defaults["maximize"] is True
  assert (opt.defaults["moments"], opt.defaults["rounding_seed"]) == ("bf16", 5)
  # Rebuilt from its defaults (as ZeroRedundancyOptimizer does, with the optimizer-wide options
  # beside them: they are no param group's), pickled, deep-copied: the same optimizer, stepping alike.
  p.grad = torch.linspace(1, -1, 40)
  opt.step()
  wide = {k: opts[k] for k in ("threads", "offload", "offload_chunk", "overlap", "overlap_backward", "skip_nonfinite")}
  again = htorch.AdamW([torch.nn.Parameter(p.detach().clone())], **opt.defaults, **wide)
  again.load_state_dict(opt.state_dict())
  pickled = pickle.loads(pickle.dumps(opt))
  copied = copy.deepcopy(opt)
  for o in (again, pickled, copied):
    assert o.defaults == opt.defaults
    assert {k: getattr(o, k) for k in own} == own
  for o in (opt, again, pickled, copied):
    q = o.param_groups[0]["params"][0]
    q.grad = torch.linspace(1, -1, 40)
    o.step()
  assert all(torch.equal(o.param_groups[0]["params"][0].detach(), p.detach()) for o in (again, pickled, copied))


def _entries(opt, params) -> tuple:
  """What opt.state and state_dict show of each parameter: len(opt.state), membership, the
  state_dict's indices, and each member's step."""
  return (len(opt.state), [p in opt.state for p in params], sorted(opt.state_dict()["state"]),
          [float(opt.state[p]["step"]) if "step" in opt.state[p] else None for p in params if p in opt.state])


_ENTRY_CASES = {"f32": {}, "offload": {"offload": "host"}, "8bit": {"moments": "8bit"}, "bf16": {"moments": "bf16"},
                "bf16 params": {"dtype": torch.bfloat16}, "bf16 params offload": {"dtype": torch.bfloat16,
                                                                                  "offload": "host"}}


@pytest.mark.parametrize("case", list(_ENTRY_CASES))
def test_opt_state_has_entries_only_for_stepped_parameters_like_torch(case):
  # torch.optim creates a parameter's state at its first step with a gradient: a frozen
  # parameter (grad None) has no entry in opt.state, nor in state_dict, until it is stepped.
  kw = dict(_ENTRY_CASES[case])
  dtype = kw.pop("dtype", torch.float32)
  shapes = [(5, 8), (8,), (6,)]
  ours = [torch.nn.Parameter(torch.linspace(-1, 1, int(np.prod(s))).reshape(s).to(dtype)) for s in shapes]
  theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
  oo, ot = htorch.AdamW(ours, lr=0.1, **kw), torch.optim.AdamW(theirs, lr=0.1)
  assert _entries(oo, ours) == _entries(ot, theirs) == (0, [False] * 3, [], [])
  g = torch.Generator().manual_seed(4)
  for have in ((), (0,), (0,), (0, 2), (), (0, 1, 2), (1,)):  # which parameters have a gradient
    grads = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    for params in (ours, theirs):
      for i, p in enumerate(params):
        p.grad = grads[i].clone() if i in have else None
    oo.step()
    ot.step()
    assert _entries(oo, ours) == _entries(ot, theirs), have
    if kw.get("moments") is None and dtype == torch.float32:  # (torch steps bf16 values, hostopt f32 masters)
      for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
  assert _entries(oo, ours)[3] == [4.0, 2.0, 2.0]


def test_a_frozen_parameters_entry_appears_at_its_first_step_through_copies_and_loads():
  def make(cls, **kw):
    params = [torch.nn.Parameter(torch.linspace(-1, 1, 12)), torch.nn.Parameter(torch.linspace(0, 1, 4))]
    return params, cls(params, lr=0.1, **kw)

  ours, oo = make(htorch.AdamW)
  theirs, ot = make(torch.optim.AdamW)
  for params, o in ((ours, oo), (theirs, ot)):
    params[0].grad = torch.ones(12)
    o.step()
  assert _entries(oo, ours) == _entries(ot, theirs) == (1, [True, False], [0], [1.0])
  # Reading opt.state[p] of a frozen parameter makes an empty entry, as in torch's defaultdict:
  # an untouched one, kept as torch keeps it.
  assert dict(oo.state[ours[1]]) == dict(ot.state[theirs[1]]) == {}
  for params, o in ((ours, oo), (theirs, ot)):
    o.step()
  assert _entries(oo, ours)[:3] == _entries(ot, theirs)[:3] == (2, [True, True], [0, 1])
  assert dict(oo.state[ours[1]]) == {}
  # deepcopy and pickle copy what is there; the frozen parameter still starts at step 1.
  import pickle
  copies = [copy.deepcopy(oo), pickle.loads(pickle.dumps(oo))]
  for c in copies:
    assert len(c.state) == 2 and [dict(st) for p, st in c.state.items() if not st] == [{}]
  # A torch.optim state_dict without the frozen parameter's entry loads as in torch.
  fresh_ours, fresh = make(htorch.AdamW)
  del ot.state[theirs[1]]
  fresh.load_state_dict(ot.state_dict())
  assert _entries(fresh, fresh_ours) == (1, [True, False], [0], [2.0])
  fresh_ours[0].grad = torch.ones(12)
  fresh.step()
  assert _entries(fresh, fresh_ours) == (1, [True, False], [0], [3.0])
  for o, params in [(fresh, fresh_ours)] + [(c, c.param_groups[0]["params"]) for c in copies] + [(ot, theirs)]:
    for p in params:
      p.grad = torch.ones(p.shape)
    o.step()
    steps = [float(o.state[p]["step"]) for p in params]
    assert steps in ([4.0, 1.0], [3.0, 1.0]), steps
  # Written by the user, the entry is the state, as in torch (stepped at the next step).
  ours2, o2 = make(htorch.AdamW)
  ours2[0].grad = torch.ones(12)
  o2.step()
  o2.state[ours2[1]]["exp_avg"] = torch.full((4,), 0.5)
  assert ours2[1] in o2.state
  o2.step()
  assert ours2[1] in o2.state and float(o2.state[ours2[1]]["step"]) == 0.0
  assert torch.equal(o2.state[ours2[1]]["exp_avg"], torch.full((4,), 0.5))
  ours2[1].grad = torch.ones(4)
  o2.step()
  assert float(o2.state[ours2[1]]["step"]) == 1.0
  torch.testing.assert_close(o2.state[ours2[1]]["exp_avg"], torch.full((4,), 0.55))


@pytest.mark.parametrize("kw, error", [({"threads": 1.7}, TypeError), ({"threads": "2"}, TypeError),
                                        ({"threads": True}, TypeError), ({"threads": -1}, ValueError),
                                        ({"threads": 1 << 20}, ValueError), ({"offload_chunk": 1.5}, TypeError),
                                        ({"offload_chunk": 0}, ValueError), ({"moments": 8}, ValueError),
                                        ({"moments": "4bit"}, ValueError)])
def test_counts_and_formats_are_checked_at_construction_never_truncated(kw, error):
  p = torch.nn.Parameter(torch.ones(3))
  with pytest.raises(error, match=next(iter(kw))):
    htorch.AdamW([p], **kw)


def test_a_stepped_parameters_state_reset_in_place_stays_in_state_dict_as_torch():
  def make(cls):
    params = [torch.nn.Parameter(torch.linspace(-1, 1, 12)), torch.nn.Parameter(torch.linspace(0, 1, 4))]
    opt = cls(params, lr=0.1)
    for p in params:
      p.grad = torch.ones(p.shape)
    opt.step()
    st = opt.state[params[0]]  # reset in place: still the stepped parameter's entry
    st["step"].zero_()
    st["exp_avg"].zero_()
    st["exp_avg_sq"].zero_()
    return opt
  ours, theirs = make(htorch.AdamW), make(torch.optim.AdamW)
  assert sorted(ours.state_dict()["state"]) == sorted(theirs.state_dict()["state"]) == [0, 1]
  assert float(ours.state_dict()["state"][0]["step"]) == 0.0


@pytest.mark.parametrize("moments", ["f32", "bf16", "8bit"])
def test_one_group_at_a_time_as_deepspeed_steps_is_the_whole_step_without_a_rebuild(moments):
  """DeepSpeed's ZeRO sets param_groups to [its group i], calls step() and restores the list,
  for each group in turn: the same bits as one step of every group, and the layout (the arena,
  opt.state's tensors) stays: a rebuild would copy the whole state at every call."""
  whole, split = make_model(), make_model()
  opt_whole = htorch.AdamW(groups_of(whole, wd=0.1), lr=1e-2, moments=moments)
  opt_split = htorch.AdamW(groups_of(split, wd=0.1), lr=1e-2, moments=moments)
  g = torch.Generator().manual_seed(5)
  arena = None
  for step in range(12):
    if step == 6:  # a resume, as DeepSpeed's load_checkpoint: torch's load makes new group dicts
      saved = opt_split.state_dict()
      opt_split = htorch.AdamW(groups_of(split, wd=0.1), lr=1e-2, moments=moments)
      opt_split.load_state_dict(saved)
      arena = None
    x, y = torch.randn(32, 8, generator=g), torch.randn(32, 4, generator=g)
    for model, opt in ((whole, opt_whole), (split, opt_split)):
      opt.zero_grad()
      ((model(x) - y) ** 2).mean().backward()
    opt_whole.step()
    every = opt_split.param_groups
    for group in (every[1], every[0]) if step % 2 else every:
      opt_split.param_groups = [group]
      opt_split.step()
      opt_split.param_groups = every
    now = [p.data_ptr() for p in split.parameters()] + [
        t.data_ptr() for st in opt_split.state.values() for t in st.values() if torch.is_tensor(t)]
    assert arena is None or now == arena, "the layout was rebuilt"
    arena = now
    assert all(torch.equal(a, b) for a, b in zip(whole.parameters(), split.parameters())), step
  a, b = opt_whole.state_dict(), opt_split.state_dict()
  for k, st in a["state"].items():
    for key, value in st.items():
      assert torch.equal(value, b["state"][k][key]) if torch.is_tensor(value) else value == b["state"][k][key]


def test_a_group_left_out_of_param_groups_is_not_stepped():
  """As torch.optim: param_groups holding one group steps that group only, the other's
  parameters and state stay as they were, and they are stepped again once the list holds them."""
  ours, theirs = make_model(), make_model()
  opt_ours, opt_theirs = htorch.AdamW(groups_of(ours), lr=1e-2), torch.optim.AdamW(groups_of(theirs), lr=1e-2)
  train(ours, opt_ours, steps=3)
  train(theirs, opt_theirs, steps=3)
  for opt in (opt_ours, opt_theirs):
    opt.param_groups = [opt.param_groups[0]] + [opt.param_groups[1]][:0]
  frozen = [p.detach().clone() for p in list(ours.parameters())[1::2]]  # the biases: group 1
  train(ours, opt_ours, steps=3, seed=4)
  train(theirs, opt_theirs, steps=3, seed=4)
  assert all(torch.equal(p, q) for p, q in zip(list(ours.parameters())[1::2], frozen))
  for p, q in zip(ours.parameters(), theirs.parameters()):
    torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
  assert [int(opt_ours.state[p]["step"]) for p in ours.parameters()] == [6, 3, 6, 3]


def _one_group_at_a_time(opt):
  every = opt.param_groups
  for group in every:
    opt.param_groups = [group]
    opt.step()
  opt.param_groups = every


def _step_grads(model, seed):
  g = torch.Generator().manual_seed(seed)
  for p in model.parameters():
    p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def test_one_group_at_a_time_after_the_group_dicts_were_replaced_and_after_a_copy():
  """Replaced group dicts (the same parameters) and a deepcopy keep stepping one group at a
  time on one layout, with the bits of whole steps."""
  whole, split = make_model(), make_model()
  opt_whole = htorch.AdamW(groups_of(whole, wd=0.1), lr=1e-2, moments="8bit")
  opt_split = htorch.AdamW(groups_of(split, wd=0.1), lr=1e-2, moments="8bit")
  for step in range(6):
    if step == 2:
      opt_split.param_groups = [dict(g) for g in opt_split.param_groups]
    if step == 4:
      split, opt_split = copy.deepcopy((split, opt_split))
    for model in (whole, split):
      _step_grads(model, step)
    opt_whole.step()
    if step in (2, 4):
      opt_split.step()  # a whole step first, then per group from the next one
    else:
      _one_group_at_a_time(opt_split)
    if step == 5:
      arena = [p.data_ptr() for p in split.parameters()]
      _step_grads(split, 9)
      _one_group_at_a_time(opt_split)
      assert [p.data_ptr() for p in split.parameters()] == arena, "rebuilt"
      _step_grads(whole, 9)
      opt_whole.step()
  assert all(torch.equal(a, b) for a, b in zip(whole.parameters(), split.parameters()))


def test_a_group_left_out_keeps_the_users_writes_to_its_16bit_parameters_and_step_counts():
  model = make_model().to(torch.bfloat16)
  opt = htorch.AdamW(groups_of(model), lr=1e-2)
  _step_grads(model, 0)
  opt.step()
  every = opt.param_groups
  bias = model[0].bias  # group 1
  with torch.no_grad():
    bias.copy_(torch.full_like(bias, 5.0))
  opt.param_groups = [every[0]]
  _step_grads(model, 1)
  opt.step()
  opt.param_groups = every
  _step_grads(model, 2)
  opt.step()
  assert float(bias.detach().float().min()) > 4.9  # stepped from 5, not from the master before the write
  opt.state[bias]["step"].fill_(2.5)  # written in place while its group is left out: refused
  opt.param_groups = [every[0]]
  with pytest.raises(ValueError, match="step"):
    opt.step()
