"""hostopt.torch with store=: the state on a drive steps to the in-RAM optimizer's bits (param
groups of every moment format, lr schedulers, skipped steps, channels_last, 16-bit
parameters), on the host and offloaded (offload="host": the offload pipeline streams the
store's chunks between flat device buffers), its state_dict loads into the in-RAM optimizer,
a restarted run resumes with the store's parameters, and what it cannot do is refused by
name, with nothing changed."""
import contextlib
import copy
import gc
import resource
import signal
import weakref

import pytest
import torch

import hostopt.torch as ht

STORE = {"sync": False, "chunk_elements": 256, "buffers": 3}  # many chunks, cut through the parameters
RESUMED = {"sync": False, "buffers": 4}  # (a store keeps its chunking)


def model(dtype=torch.float32, seed=0, channels_last=True):
  torch.manual_seed(seed)
  m = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(), torch.nn.Linear(8 * 4 * 4, 37),
                          torch.nn.Linear(37, 5))
  if channels_last:
    m[0].to(memory_format=torch.channels_last)  # a parameter whose memory order is not its index order
  return m.to(dtype)


def optimizer(m, store=None, resume=False, options=None, **kw):
  groups = [{"params": [m[0].weight, m[2].weight], "moments": "8bit", "rounding_seed": 5},
            {"params": [m[3].weight], "moments": "bf16", "lr": 2e-3},
            {"params": [m[0].bias, m[2].bias, m[3].bias], "weight_decay": 0.0}]
  opt = ht.AdamW(groups, lr=1e-2, weight_decay=0.1, store=store, resume=resume,
                 store_options=options or (None if store is None else RESUMED if resume else STORE), **kw)
  sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1 + t))
  return opt, sched


def backward(m, t):
  torch.manual_seed(100 + t)
  x = torch.randn(4, 3, 6, 6, dtype=next(m.parameters()).dtype)
  m.zero_grad(set_to_none=True)
  m(x).float().pow(2).mean().backward()


@contextlib.contextmanager
def writes_fail():
  """Writes past 40 KiB fail (EFBIG, SIGXFSZ ignored) while inside, reads do not: a store's
  step fails midway, after the pipeline copied its first chunks' new parameters out."""
  handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
  limits = resource.getrlimit(resource.RLIMIT_FSIZE)
  resource.setrlimit(resource.RLIMIT_FSIZE, (40 << 10, limits[1]))
  try:
    yield
  finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    signal.signal(signal.SIGXFSZ, handler)


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


def stepped_once(tmp_path):
  """A model, its stored optimizer after one step, the parameters then, and the next step's gradients."""
  m = model()
  opt, _ = optimizer(m, tmp_path)
  backward(m, 0)
  opt.step()
  before = [p.detach().clone() for p in m.parameters()]
  backward(m, 1)
  return m, opt, before


def test_refusals_name_the_problem_and_change_nothing(tmp_path):
  m, opt, before = stepped_once(tmp_path)
  m.zero_grad(set_to_none=True)
  opt.step()  # no gradient at all: nothing to do, as torch
  assert opt.store.step_count == 1 and opt.last_step.step == 1
  with pytest.raises(ValueError, match="add_param_group with store="):
    opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(3))]})
  sd = opt.state_dict()
  opt.load_state_dict(sd)  # its own state (accelerate's prepare does this): taken, with its param_groups
  opt.load_state_dict(copy.deepcopy(sd))  # equal values: taken too
  sd["state"][0]["exp_avg_sq_codes"][0, 0, 0, 0] += 1
  with pytest.raises(ValueError, match="load_state_dict with store=: the store is the checkpoint.*not the one it"):
    opt.load_state_dict(sd)
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
  with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\] is not contiguous: the offloaded"):
    ht.AdamW(params, store=empty, offload="host")  # (a channels_last conv)
  with pytest.raises(ValueError, match=r"offloaded with parameters of \['torch.bfloat16', 'torch.float32'\]"):
    ht.AdamW([torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))],
             store=empty, offload="host")
  with pytest.raises(TypeError, match="resume: expected a bool"):
    ht.AdamW(params, store=empty, resume=1)
  with pytest.raises(ValueError, match=r"parameters on \['meta'\]: hostopt.torch offloads the parameters of one CUDA"):
    ht.AdamW(torch.nn.Linear(8, 6, device="meta").parameters(), store=empty)
  assert not any(empty.iterdir())  # nothing made by the refusals
  with pytest.raises(RuntimeError):
    ht.AdamW(params[:2], store=tmp_path, store_options={"sync": False}, resume=True)  # another model's store


@pytest.mark.parametrize("where", ["cpu", "offloaded"])
def test_a_parameter_without_a_gradient_keeps_its_state_and_own_step_as_in_ram_and_resumed(tmp_path, where):
  # As torch: a parameter whose .grad is None is skipped, its own "step" stays (one that
  # never had a gradient has no state); the store keeps each count with every commit.
  kw = {"offload": "host", "offload_chunk": 300} if where == "offloaded" else {}
  a, b = model(channels_last=not kw), model(channels_last=not kw)
  ram, _ = optimizer(a, **kw)
  stored, _ = optimizer(b, tmp_path, options=dict(STORE, io="threads"), **kw)
  absent = [[3], [0, 5], [3, 4], [], [1]]  # indices into m.parameters(): 3 has none at the first step (no state yet)
  for t, gone in enumerate(absent):
    for m in (a, b):
      backward(m, t)
      for i, p in enumerate(m.parameters()):
        if i in gone:
          p.grad = None
    ram.step()
    stored.step()
    assert str(ram.last_step) == str(stored.last_step)
    same_params(a, b)
    assert [float(ram.state[p]["step"]) if p in ram.state else None for p in a.parameters()] == \
        [float(stored.state[p]["step"]) if p in stored.state else None for p in b.parameters()]
  assert [float(stored.state[p]["step"]) for p in b.parameters()] == [4, 4, 5, 3, 4, 4]
  same_state_dict(ram.state_dict(), stored.state_dict())
  stored.close()
  c = model(channels_last=not kw)
  resumed, _ = optimizer(c, tmp_path, resume=True, options=dict(RESUMED, io="threads"), **kw)
  same_params(a, c)
  assert [float(resumed.state[p]["step"]) for p in c.parameters()] == [4, 4, 5, 3, 4, 4]
  for m in (a, c):
    backward(m, 9)
    list(m.parameters())[3].grad = None
  ram.step()
  resumed.step()
  same_params(a, c)
  same_state_dict(ram.state_dict(), resumed.state_dict())
  resumed.close()


def test_parameters_the_user_writes_are_adopted_as_the_in_ram_optimizer_adopts_them(tmp_path):
  for dtype in (torch.float32, torch.bfloat16):
    a, b = model(dtype), model(dtype)
    ram, _ = optimizer(a)
    d = tmp_path / str(dtype)
    d.mkdir()
    stored, _ = optimizer(b, d)
    pretrained = model(dtype, seed=5).state_dict()
    for m in (a, b):
      m.load_state_dict(pretrained)  # after the optimizer was made: a fine-tuning run's order
    for t in range(3):
      for m in (a, b):
        backward(m, t)
      ram.step()
      stored.step()
      same_params(a, b)
      with torch.no_grad():
        for m in (a, b):
          if t == 0:
            m[2].weight.clamp_(-0.05, 0.05)  # an in-place edit
          if t == 1:
            m[3].bias.data = torch.full_like(m[3].bias, 0.25)  # a replaced .data of the same layout
    with torch.no_grad():
      for m in (a, b):
        m[3].weight.mul_(0.5)  # written, exported (the masters as the last step left them), then stepped
    same_state_dict(ram.state_dict(), stored.state_dict())
    for m in (a, b):
      backward(m, 3)
    ram.step()
    stored.step()
    same_params(a, b)


def test_a_changed_layout_or_another_model_is_refused_by_name(tmp_path):
  m, opt, before = stepped_once(tmp_path)
  m.to(memory_format=torch.channels_last)  # (the conv weight already was: this changes nothing there)
  w = m[2].weight
  saved = w.data
  base = torch.zeros(w.shape[0], w.shape[1] * 2)
  base[:, :w.shape[1]] = w.detach()
  w.data = base[:, :w.shape[1]]  # a view with gaps
  with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\] is now .* strides .*memory order are "
                     r"fixed"):
    opt.step()
  assert not base[:, w.shape[1]:].any()
  w.data = saved
  m[0].weight.data = m[0].weight.data.contiguous()  # another memory order
  with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\] is now"):
    opt.step()
  m[0].weight.data = m[0].weight.data.to(memory_format=torch.channels_last)
  for p, q in zip(before, m.parameters()):
    assert torch.equal(p, q.detach())
  opt.close()
  other = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(), torch.nn.Linear(8 * 4 * 4, 37),
                              torch.nn.Linear(37, 5))  # the same sizes, the conv weight in the default order
  with pytest.raises(RuntimeError):
    optimizer(other, tmp_path, resume=True)
  shuffled = model()
  shuffled[2].weight = torch.nn.Parameter(shuffled[2].weight.detach().reshape(37 * 8, 16))  # same size, other shape
  with pytest.raises(RuntimeError):
    optimizer(shuffled, tmp_path, resume=True)
  resumed, _ = optimizer(model(seed=3), tmp_path, resume=True)  # the same model: taken
  assert resumed.store.step_count == 1


def test_frozen_parameters_are_left_out_and_a_late_gradient_refused(tmp_path):
  a, b = model(), model()
  for m in (a, b):
    m[0].weight.requires_grad_(False)
  ram = ht.AdamW(a.parameters(), lr=1e-2)
  stored = ht.AdamW(b.parameters(), lr=1e-2, store=tmp_path, store_options=STORE)
  for t in range(2):
    for m in (a, b):
      backward(m, t)
    ram.step()
    stored.step()
    same_params(a, b)  # (f32 moments: the step's bits do not depend on where a tensor lies)
  assert b[0].weight not in stored.state
  same_state_dict(ram.state_dict(), stored.state_dict())
  b[0].weight.requires_grad_(True)
  backward(b, 2)
  with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\] has a gradient but was frozen"):
    stored.step()


def test_load_state_dict_takes_only_the_stores_own_state_its_hyper_parameters_checked(tmp_path):
  m, opt, _ = stepped_once(tmp_path)
  sd = opt.state_dict()
  sd["state"][0]["exp_avg_codes"].add_(1)  # changed in place after the export: not the store's
  with pytest.raises(ValueError, match="not the one it holds"):
    opt.load_state_dict(sd)
  sd = opt.state_dict()
  sd["state"][0], sd["state"][1] = sd["state"][1], sd["state"][0]  # two parameters' entries swapped
  with pytest.raises(ValueError, match="not the one it holds"):
    opt.load_state_dict(sd)
  for key, value, why in (("lr", -1.0, "lr"), ("amsgrad", True, "amsgrad"), ("rounding_seed", 99, "rounding_seed")):
    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][0][key] = value
    with pytest.raises(ValueError, match=why):
      opt.load_state_dict(sd)
  assert opt.param_groups[0]["lr"] == 1e-2 and not opt.param_groups[0]["amsgrad"]
  sd = copy.deepcopy(opt.state_dict())  # saved ids in another order name the parameters as torch maps them
  ids = sd["param_groups"][2]["params"]
  sd["param_groups"][2]["params"] = ids[::-1]
  sd["state"] = {ids[::-1][i]: sd["state"][ids[i]] for i in range(len(ids))} | {
      k: v for k, v in sd["state"].items() if k not in ids}
  opt.load_state_dict(sd)  # the same state, ids renamed: taken
  sd["param_groups"][0]["lr"] = 5e-3
  opt.load_state_dict(sd)
  assert opt.param_groups[0]["lr"] == 5e-3
  if hasattr(opt, "register_load_state_dict_post_hook"):  # torch 2: its load hooks run as in RAM
    seen = []
    opt.register_load_state_dict_pre_hook(lambda o, s: seen.append("pre"))
    opt.register_load_state_dict_post_hook(lambda o: seen.append("post"))
    opt.load_state_dict(opt.state_dict())
    assert seen == ["pre", "post"]


def test_a_dtype_change_is_refused_and_a_1x1_convs_strides_may_change(tmp_path):
  torch.manual_seed(0)
  m = torch.nn.Sequential(torch.nn.Conv2d(4, 4, 1), torch.nn.Flatten())
  opt = ht.AdamW(m.parameters(), lr=1e-2, store=tmp_path, store_options=STORE)
  x = torch.randn(2, 4, 3, 3)
  m(x).pow(2).mean().backward()
  opt.step()
  m.to(memory_format=torch.channels_last)  # a 1x1 kernel: other strides, the same memory order
  m(x).pow(2).mean().backward()
  opt.step()
  assert opt.store.step_count == 2
  m[0].bias.data = m[0].bias.data.to(torch.bfloat16)
  with pytest.raises(ValueError, match=r"\['params'\]\[1\] is now \(4,\) torch.bfloat16.*dtype, device and memory order are "
                     "fixed"):
    opt.step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_offloaded_the_pipeline_streams_the_store_to_the_in_ram_pipelines_bits(tmp_path, dtype):
  # offload="host": CPU tensors stand in for device buffers, the pipeline's chunks (300
  # elements) cut across the store's (256) as on a GPU.
  off = {"offload": "host", "offload_chunk": 300, "skip_nonfinite": True}
  a, b = model(dtype, channels_last=False), model(dtype, channels_last=False)
  ram, ram_sched = optimizer(a, **off)
  stored, stored_sched = optimizer(b, tmp_path, options=dict(STORE, io="threads"), **off)
  pretrained = model(dtype, seed=5, channels_last=False).state_dict()
  for m in (a, b):
    m.load_state_dict(pretrained)  # after the optimizer was made: adopted by both at the first step
  for t in range(5):
    for m in (a, b):
      backward(m, t)
      if t == 2:
        m[2].weight.grad[1, 1] = float("nan")  # skipped by both, counted, committed with the next
    ram.step()
    stored.step()
    ram_sched.step()
    stored_sched.step()
    assert str(ram.last_step) == str(stored.last_step)
    same_params(a, b)
    with torch.no_grad():
      for m in (a, b):
        if t == 0:
          m[2].weight.clamp_(-0.05, 0.05)  # an in-place edit through the parameter
        if t == 1:
          m[3].bias.data = torch.full_like(m[3].bias, 0.25)  # a replaced .data: back onto the device buffer
        if t == 3:
          m[3].weight.data.mul_(0.5)  # not seen (torch's version counter): adopt_params() says so
          opt = ram if m is a else stored
          opt.adopt_params()
    if t == 3:  # adopted: the masters are the parameters' values already (16-bit ones: rounded up to f32)
      same_state_dict(ram.state_dict(), stored.state_dict())
  assert stored.store.step_count == 4 and stored.store.skipped_steps == 1
  assert b[3].bias.data_ptr() != 0 and b[2].weight.data_ptr() - b[3].weight.data_ptr() > 0  # views of one buffer
  same_state_dict(ram.state_dict(), stored.state_dict())

  before = [p.detach().clone() for p in b.parameters()]
  backward(b, 5)
  # The step fails midway, and the store's step goes back in.
  with writes_fail():
    with pytest.raises(RuntimeError, match="put back to the store's last completed step .step 4.: nothing of this") \
        as failed:
      stored.step()
    assert "call push_params()" not in str(failed.value)
  for p, q in zip(before, b.parameters()):  # the parameters are the store's step again
    assert torch.equal(p, q.detach())
  chunks = [f for f in tmp_path.iterdir() if f.stat().st_size > 8192]
  saved = {f: f.read_bytes() for f in chunks}
  for f in chunks:
    f.write_bytes(b"")  # truncated: the step fails, and so does putting the parameters back
  with pytest.raises(RuntimeError, match="could not be put back .*: they hold no completed step.*resume=True"):
    stored.step()
  for f, data in saved.items():
    f.write_bytes(data)
  with pytest.raises(ValueError, match="the parameters hold no completed step"):
    stored.step()
  stored.close()
  with pytest.raises(ValueError, match="closed"):
    stored.step()

  # The same model, resumed: the store's last completed step goes back into its parameters.
  resumed, resumed_sched = optimizer(b, tmp_path, resume=True, **off)
  resumed_sched.load_state_dict(stored_sched.state_dict())
  for group, lr in zip(resumed.param_groups, resumed_sched.get_last_lr()):
    group["lr"] = lr
  for p, q in zip(before, b.parameters()):
    assert torch.equal(p, q.detach())
  for t in (5, 6):
    for m in (a, b):
      backward(m, t)
    for o, sched in ((ram, ram_sched), (resumed, resumed_sched)):
      o.step()
      sched.step()
    same_params(a, b)
  same_state_dict(ram.state_dict(), resumed.state_dict())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_offloaded_writes_wait_for_the_next_applied_step_in_host_ram_of_their_own(tmp_path, dtype):
  # A value written into an offloaded parameter is adopted by the store as the next applied
  # step reads its chunks; until then only that parameter's values wait in host RAM, and a
  # skipped step leaves them in the parameter, as the in-RAM optimizer adopts them at once.
  off = {"offload": "host", "skip_nonfinite": True}
  a, b = model(dtype, channels_last=False), model(dtype, channels_last=False)
  ram, _ = optimizer(a, **off)
  stored, _ = optimizer(b, tmp_path, **off)
  for t in range(3):
    for m in (a, b):
      backward(m, t)
      with torch.no_grad():
        if t == 1:
          m[2].weight.fill_(7.0)  # written, then a skipped step
          m[0].bias.grad[0] = float("nan")
        if t == 2:
          m[2].weight.copy_(saved)  # written back: its values differ from the adopted 7.0
    ram.step()
    stored.step()
    same_params(a, b)
    if t == 0:
      saved = b[2].weight.detach().clone()
    if t == 1:
      assert not stored.last_step.applied and torch.all(b[2].weight == 7.0)
      assert stored.store.pending_adoption == b[2].weight.numel() < stored.store.arena_size  # its own values
      same_state_dict(ram.state_dict(), stored.state_dict())  # (the master the in-RAM optimizer adopted)
  assert stored.store.pending_adoption == 0 and stored.store.step_count == 2
  same_state_dict(ram.state_dict(), stored.state_dict())
  # A replaced .data taken by adopt_params() goes back onto the device buffer and trains on.
  for m, o in ((a, ram), (b, stored)):
    m[3].bias.data = torch.full_like(m[3].bias, -1.5)
    o.adopt_params()
  for t in (3, 4):
    for m in (a, b):
      backward(m, t)
    ram.step()
    stored.step()
    same_params(a, b)
  assert not torch.all(a[3].bias == -1.5)


def test_offloaded_adopt_params_with_an_empty_parameter(tmp_path):
  lin = torch.nn.Linear(4, 2)
  empty = torch.nn.Parameter(torch.zeros(0))
  opt = ht.AdamW([lin.weight, lin.bias, empty], lr=1e-2, store=tmp_path, store_options=STORE, offload="host")
  for _ in range(2):
    opt.adopt_params()
    lin(torch.ones(3, 4)).sum().backward()
    empty.grad = torch.zeros(0)
    opt.step()
  assert opt.store.step_count == 2 and opt.store.pending_adoption == 0


@pytest.mark.parametrize("kw", [{}, {"offload": "host"}])
def test_a_dropped_optimizer_releases_its_store_at_once(tmp_path, kw):
  # No reference cycle keeps the store (and its lock) after the optimizer is dropped: a run
  # that makes its optimizer again in the same process opens the store, collection or not.
  m = model(channels_last=False)
  gc.disable()
  try:
    opt = ht.AdamW(m.parameters(), store=tmp_path, store_options=STORE, **kw)
    backward(m, 0)
    opt.step()
    del opt
    again = ht.AdamW(m.parameters(), store=tmp_path, store_options=RESUMED, resume=True, **kw)
    assert again.store.step_count == 1
    again.close()
  finally:
    gc.enable()



@pytest.mark.skipif(not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"),
                    reason="overlap_backward needs post-accumulate-grad hooks (torch >= 2.1)")
def test_overlap_backward_starts_the_stores_chunks_as_the_backward_completes_them(tmp_path):
  # overlap_backward=True over a store (offload="host"): each gradient lands in the flat
  # gradient buffer as the backward completes it and each pipeline chunk gets an event its
  # copy waits on, as in RAM. Gradients written after the backward (clipping), or chunks the
  # backward reached in part (a layer frozen for one backward), fall back to the whole stream;
  # the bits are the in-RAM offloaded optimizer's in every case.
  off = {"offload": "host", "offload_chunk": 300, "overlap_backward": True}
  a, b = model(channels_last=False), model(channels_last=False)
  ram, _ = optimizer(a, **off)
  stored, _ = optimizer(b, tmp_path, **off)
  chunks = stored._store._pipe.num_chunks
  assert chunks >= 4
  g = torch.Generator().manual_seed(7)

  def step(clip=False, micro=1, freeze=None, set_to_none=True):
    for m, o in ((a, ram), (b, stored)):
      o.zero_grad(set_to_none=set_to_none)
      if freeze is not None:
        m[freeze].weight.requires_grad_(False)
    for _ in range(micro):
      x = torch.randn(4, 3, 6, 6, generator=g)
      for m in (a, b):
        m(x).pow(2).mean().backward()
    for m, o in ((a, ram), (b, stored)):
      if freeze is not None:
        m[freeze].weight.requires_grad_(True)
      if clip:
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
      o.step()
    same_params(a, b)
    return stored._store._chunk_events

  assert step() == chunks  # (hooked when the store is made: the first backward reports)
  base, end = stored._store._dev_grads.data_ptr(), stored._store._dev_grads.data_ptr() + stored._store._size * 4
  assert all(base <= p.grad.data_ptr() < end for p in b.parameters())  # gradients are views of the flat buffer
  assert step(micro=2) == chunks  # accumulation: complete again in the last backward
  assert step(micro=3, set_to_none=False) == chunks
  assert step(clip=True) == 0  # written after the backward: the whole stream orders the copies
  assert 0 < step(freeze=3) < chunks  # the last layer gets no gradient in this backward
  assert step() == chunks
  for m, o in ((a, ram), (b, stored)):  # create_graph=True: torch's differentiable gradient, gathered by the step
    o.zero_grad(set_to_none=True)
    m(torch.ones(2, 3, 6, 6)).pow(2).sum().backward(create_graph=True)
    o.step()
  same_params(a, b)
  assert stored._store._chunk_events == 0
  same_state_dict(ram.state_dict(), stored.state_dict())
  # The hooks go with close(), and with a dropped optimizer (no collection needed).
  hooks = lambda m: sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in m.parameters())
  assert hooks(b) == 6
  stored.close()
  assert hooks(b) == 0
  gc.disable()
  try:
    again = optimizer(b, tmp_path, resume=True, **off)[0]  # (its scheduler dropped)
    assert hooks(b) == 6
    del again
    assert hooks(b) == 0
  finally:
    gc.enable()
  b(torch.ones(1, 3, 6, 6)).sum().backward()  # (no hook left to run)


def overlapped(opt):
  """overlap=True over opt's store, on the host engine. It is refused with offload="host" (a
  user's CPU ops are not ordered on a stream), so it is turned on here after the optimizer is
  made; the returned call does what a CUDA stream does before the next forward: it waits
  until the stand-in stream is past the step's "parameters ready". A store's calls wait for
  its step in flight to end, so none may come between step() and the next call that takes its
  result (else step() would wait for the drives after all): the store's core refuses them."""
  store = opt._store
  store._overlap = True
  flight = _Flight()
  store._core, store._pipe = _Guarded(store._core, flight), _Watched(store._pipe, flight)
  return lambda: store._engine.synchronize_stream(store._engine_stream)


class _Flight:
  """Whether a pipeline step is in flight: from step_async until its handle's wait()."""
  live = 0


class _Watched:
  """A pipeline whose steps tell _Flight when they start and end."""

  def __init__(self, pipe, flight):
    self.__dict__.update(_pipe=pipe, _flight=flight)

  def __getattr__(self, name):
    return getattr(self._pipe, name)

  def step_async(self, *args, **kwargs):
    h = self._pipe.step_async(*args, **kwargs)
    self._flight.live += 1
    return _Handle(h, self._flight)


class _Handle:
  def __init__(self, h, flight):
    self.__dict__.update(_h=h, _flight=flight)

  def __getattr__(self, name):
    return getattr(self._h, name)

  def wait(self):
    try:
      return self._h.wait()
    finally:
      self._flight.live -= 1


class _Guarded:
  """A store's core that refuses to be called while a pipeline step is in flight."""

  def __init__(self, core, flight):
    self.__dict__.update(_core=core, _flight=flight)

  def __getattr__(self, name):
    assert not self._flight.live, f"store.{name} called while its step is in flight: it waits for the step"
    return getattr(self._core, name)


def test_overlap_returns_before_the_step_commits_with_the_in_ram_bits(tmp_path):
  # overlap=True over a store: step() returns with the pipeline's step in flight; its result
  # (last_step), or its error, comes at the next step, state_dict, load_state_dict or close.
  # What the user writes into the parameters meanwhile is adopted at the next step, as by the
  # in-RAM optimizer, which steps synchronously beside it here.
  off = {"offload": "host", "offload_chunk": 300, "skip_nonfinite": True}
  a, b = model(channels_last=False), model(channels_last=False)
  ram, ram_sched = optimizer(a, **off)
  stored, stored_sched = optimizer(b, tmp_path, **off)
  device_waits = overlapped(stored)
  reported = None
  for t in range(7):
    for m in (a, b):
      backward(m, t)
      with torch.no_grad():
        if t == 2:
          m[2].weight.fill_(7.0)  # written, then a skipped step: ends at once (below)
          m[0].bias.grad[0] = float("nan")
        if t == 5:
          m[0].bias.grad[0] = float("nan")  # a skipped step with nothing to adopt: in flight
    ram.step()
    stored.step()
    assert (not stored._store._inflight) == (t == 2)
    # The step before's, taken by this call (the step that ended at once: its own).
    assert str(stored.last_step) == str(ram.last_step if t == 2 else reported)
    reported = ram.last_step
    ram_sched.step()
    stored_sched.step()
    device_waits()
    same_params(a, b)  # what the next forward reads
    with torch.no_grad():
      for m, o in ((a, ram), (b, stored)):  # while the store's step is in flight
        if t == 0:
          m[2].weight.clamp_(-0.05, 0.05)
        if t == 1:
          m[3].bias.data = torch.full_like(m[3].bias, 0.25)  # a replaced .data, off the device buffer
        if t == 3:
          m[3].weight.data.mul_(0.5)
          o.adopt_params()
        if t == 5:
          m[2].weight.fill_(3.0)
  same_state_dict(ram.state_dict(), stored.state_dict())  # (takes the step in flight)
  assert str(stored.last_step) == str(ram.last_step) and not stored._store._inflight
  assert stored.store.step_count == 5 and stored.store.skipped_steps == 2
  assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))

  # A step that fails midway (writes past 40 KiB fail): step() returns, and the error comes
  # with the next call, which steps nothing. The parameters are the store's last completed step
  # again, but for those written meanwhile (kept, for the next step to adopt); the gradients
  # of a backward run meanwhile (from the failed step's parameters) are refused.
  before = [p.detach().clone() for p in b.parameters()]
  backward(b, 7)
  with writes_fail():
    stored.step()
    assert stored._store._inflight
    device_waits()
    with torch.no_grad():
      for m in (a, b):
        m[2].weight.fill_(3.0)
        m[3].bias.data = torch.full_like(m[3].bias, 0.5)
    backward(b, 8)
    with pytest.raises(RuntimeError, match="put back to the store's last completed step .step 5.: nothing of this.*"
                                           "written while that step was in flight.*zero_grad, then the forward"):
      stored.step()
  with pytest.raises(ValueError, match="written while the step before was in flight.*nothing was stepped"):
    stored.step()
  for i, (p, q) in enumerate(zip(before, b.parameters())):
    assert torch.equal(p, q.detach()) or i in (2, 5)  # (2.weight and 3.bias: written)
  assert torch.all(b[2].weight == 3.0) and torch.all(b[3].bias == 0.5)
  for m in (a, b):
    backward(m, 8)
  ram.step()
  stored.step()
  device_waits()
  same_params(a, b)
  # A failed step reported by state_dict before another backward: its gradients step again.
  for m in (a, b):
    backward(m, 9)
  ram.step()
  with writes_fail():
    stored.step()
    with pytest.raises(RuntimeError, match="put back to the store's last completed step .step 6.") as failed:
      stored.state_dict()
    assert "again" not in str(failed.value)
  stored.step()
  device_waits()
  same_params(a, b)
  # A failure reported by adopt_params (which ends the step in flight first, as in RAM), the
  # gradients set to None meanwhile: none is refused, and nothing of the failed step stays.
  for m in (a, b):
    backward(m, 10)
  ram.step()
  before = [p.detach().clone() for p in b.parameters()]
  with writes_fail():
    stored.step()
    device_waits()
    stored.zero_grad(set_to_none=True)
    with pytest.raises(RuntimeError, match="put back to the store's last completed step .step 7.") as failed:
      stored.adopt_params()
    assert "written while" not in str(failed.value)
  for p, q in zip(before, b.parameters()):
    assert torch.equal(p, q.detach())
  backward(b, 10)
  stored.step()
  device_waits()
  same_params(a, b)
  # Steps on; close() ends the step in flight, which the resumed store holds.
  for m in (a, b):
    backward(m, 11)
  ram.step()
  stored.step()
  stored.close()
  assert not stored._store._inflight
  resumed = optimizer(b, tmp_path, resume=True, **off)[0]  # (its scheduler dropped)
  assert resumed.store.step_count == 9
  same_params(a, b)
  # A dropped optimizer with a step in flight releases its store, without a collection.
  overlapped(resumed)
  backward(b, 12)
  gc.disable()
  try:
    resumed.step()
    del resumed
    again = optimizer(b, tmp_path, resume=True, **off)[0]
    assert again.store.step_count == 10
  finally:
    gc.enable()


def test_load_state_dict_of_empty_parameters_state(tmp_path):
  # Empty parameters (a rank's empty shards): their exported moments may have any strides, and
  # a copy of the store's own state loads (compared bit for bit), resumed or not.
  ps = [torch.nn.Parameter(torch.zeros(0)), torch.nn.Parameter(torch.zeros(0, 4))]
  opt = ht.AdamW(ps, lr=1e-2, store=tmp_path, store_options=STORE)
  for p in ps:
    p.grad = torch.zeros_like(p)
  opt.step()
  opt.load_state_dict(copy.deepcopy(opt.state_dict()))
  opt.close()
  again = ht.AdamW(ps, lr=1e-2, store=tmp_path, store_options=RESUMED, resume=True)
  again.load_state_dict(copy.deepcopy(again.state_dict()))
  assert again.store.step_count == 1
