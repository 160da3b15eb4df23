"""hostopt.torch side by side with torch.optim (Debian's torch)."""
import copy

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
