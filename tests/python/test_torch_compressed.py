"""hostopt.torch with compressed moments per param group (moments="bf16" / "8bit"): the
step against the f32 one and torch.optim, state_dict round trips (exact resume, through
torch.save), formats refused or converted on load, and bad input."""
import copy
import io

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import hostopt  # noqa: E402
import hostopt.torch as ht  # noqa: E402

FORMATS = ["bf16", "8bit"]


def model(seed=0):
  torch.manual_seed(seed)
  return torch.nn.Sequential(torch.nn.Linear(20, 48), torch.nn.ReLU(), torch.nn.LayerNorm(48), torch.nn.Linear(48, 3))


def batch(seed=1):
  g = torch.Generator().manual_seed(seed)
  x = torch.randn(64, 20, generator=g)
  return x, torch.sin(x[:, :3])


def train_steps(m, opt, steps, seed=1):
  x, y = batch(seed)
  for _ in range(steps):
    opt.zero_grad()
    loss = ((m(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
  return float(loss.detach())


def decoded(st):
  """A parameter state's moments as float32 arrays (exact decode)."""
  m, v = st["exp_avg"], st["exp_avg_sq"]
  if st.get("moment_format") == "8bit":
    mo = hostopt.CompressedMoments(m.numel(), "8bit")
    mo.exp_avg[:] = m.reshape(-1).numpy()
    mo.exp_avg_sq[:] = v.reshape(-1).numpy()
    mo.scales[:] = st["moment_scales"].reshape(-1).numpy()
    return mo.decode()
  return m.float().reshape(-1).numpy(), v.float().reshape(-1).numpy()


@pytest.mark.parametrize("fmt", FORMATS)
def test_state_holds_codes_and_the_first_step_is_the_f32_step(fmt):
  ours, plain, ref = model(), model(), model()
  opt = ht.AdamW(ours.parameters(), lr=1e-2, moments=fmt)
  f32 = ht.AdamW(plain.parameters(), lr=1e-2)
  torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
  for m, o in ((ours, opt), (plain, f32), (ref, torch_opt)):
    train_steps(m, o, 1)
  # Step 1 updates with the moments before they are rounded: the f32 step's bits.
  for a, b in zip(ours.parameters(), plain.parameters()):
    assert torch.equal(a, b)
  w = ours[0].weight
  st = opt.state[w]
  assert st["moment_format"] == fmt
  assert st["exp_avg"].shape == w.shape
  if fmt == "bf16":
    assert st["exp_avg"].dtype == torch.bfloat16 and "moment_scales" not in st
  else:
    assert st["exp_avg"].dtype == torch.uint8
    assert st["moment_scales"].shape == ((w.numel() + 31) // 32, 2)
  # The stored moments are torch's, rounded to the format's grid.
  m, v = decoded(st)
  tm = torch_opt.state[ref[0].weight]["exp_avg"].reshape(-1).numpy()
  tv = torch_opt.state[ref[0].weight]["exp_avg_sq"].reshape(-1).numpy()
  tol = 2.0**-7 if fmt == "bf16" else 2.0**-3
  block_m = np.repeat(np.abs(np.pad(tm, (0, -tm.size % 32))).reshape(-1, 32).max(1), 32)[:tm.size]
  assert np.all(np.abs(m - tm) <= np.maximum(tol * np.abs(tm), 2.0**-16 * block_m) + 1e-12)
  assert np.all(np.abs(v - tv) <= tol * tv + 1e-20)
  assert np.any(m != 0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_training_tracks_f32_moments(fmt):
  ours, plain = model(), model()
  loss = train_steps(ours, ht.AdamW(ours.parameters(), lr=5e-3, moments=fmt), 150)
  loss32 = train_steps(plain, ht.AdamW(plain.parameters(), lr=5e-3), 150)
  assert loss < 1.1 * loss32 + 1e-4, (loss, loss32)


def mixed(m, seed=4):
  """8-bit matrices, bf16 last layer, f32 norm and biases: a typical split."""
  return ht.AdamW([{"params": [m[0].weight], "moments": "8bit"},
                   {"params": [m[3].weight], "moments": "bf16", "lr": 3e-3},
                   {"params": [m[0].bias, m[2].weight, m[2].bias, m[3].bias]}], lr=1e-2, rounding_seed=seed)


def test_state_dict_resumes_bit_for_bit_through_torch_save():
  a = model()
  opt_a = mixed(a)
  train_steps(a, opt_a, 5)
  buf = io.BytesIO()
  torch.save({"model": a.state_dict(), "opt": opt_a.state_dict()}, buf)
  buf.seek(0)
  saved = torch.load(buf)
  b = model(seed=9)  # other values: the load must bring them back
  b.load_state_dict(saved["model"])
  opt_b = mixed(b, seed=77)  # the saved seeds are restored
  opt_b.load_state_dict(saved["opt"])
  assert opt_b.param_groups[0]["rounding_seed"] == 4
  for step in range(4):
    train_steps(a, opt_a, 1, seed=10 + step)
    train_steps(b, opt_b, 1, seed=10 + step)
  for p, q in zip(a.parameters(), b.parameters()):
    assert torch.equal(p, q)
  for p, q in zip(a.parameters(), b.parameters()):
    sa, sb = opt_a.state[p], opt_b.state[q]
    assert sa.get("moment_format") == sb.get("moment_format")
    for key in ("exp_avg", "exp_avg_sq", "moment_scales"):
      if key in sa:
        assert torch.equal(sa[key], sb[key]), key


def test_other_formats_are_refused_on_load_unless_converted():
  a = model()
  opt_f32 = ht.AdamW(a.parameters(), lr=1e-2)
  train_steps(a, opt_f32, 3)
  sd = copy.deepcopy(opt_f32.state_dict())
  b = copy.deepcopy(a)
  opt8 = ht.AdamW(b.parameters(), lr=1e-2, moments="8bit")
  train_steps(b, opt8, 1)
  before = {k: v.clone() for k, v in opt8.state[b[0].weight].items() if torch.is_tensor(v)}
  with pytest.raises(ValueError, match=r"holds f32 moments, param_groups\[0\] stores 8bit: pass convert_moments"):
    opt8.load_state_dict(sd)
  after = opt8.state[b[0].weight]
  assert all(torch.equal(before[k], after[k]) for k in before)  # nothing changed
  assert after["moment_format"] == "8bit"
  # The explicit conversion: the f32 moments, encoded.
  opt8.load_state_dict(sd, convert_moments=True)
  assert opt8.param_groups[0]["moments"] == "8bit"
  opt8.zero_grad(set_to_none=True)
  opt8.step()  # no gradients: builds and converts, nothing steps
  m, v = decoded(opt8.state[b[0].weight])
  tm = sd["state"][0]["exp_avg"].reshape(-1).numpy()
  tv = sd["state"][0]["exp_avg_sq"].reshape(-1).numpy()
  block_m = np.repeat(np.abs(np.pad(tm, (0, -tm.size % 32))).reshape(-1, 32).max(1), 32)[:tm.size]
  assert np.all(np.abs(m - tm) <= np.maximum(2.0**-3 * np.abs(tm), 2.0**-16 * block_m))
  assert np.all(np.abs(v - tv) <= 2.0**-3 * tv)
  # And back: 8-bit state into an f32 optimizer decodes exactly.
  c = copy.deepcopy(b)
  opt_c = ht.AdamW(c.parameters(), lr=1e-2)
  with pytest.raises(ValueError, match="holds 8bit moments"):
    opt_c.load_state_dict(opt8.state_dict())
  opt_c.load_state_dict(opt8.state_dict(), convert_moments=True)
  opt_c.zero_grad(set_to_none=True)
  opt_c.step()
  assert np.array_equal(opt_c.state[c[0].weight]["exp_avg"].reshape(-1).numpy(), m)


def test_bad_formats_and_state_are_refused():
  m = model()
  with pytest.raises(ValueError, match="unknown name '4bit'"):
    ht.AdamW(m.parameters(), moments="4bit")
  opt = ht.AdamW([{"params": [m[0].weight]}], lr=1e-2)
  with pytest.raises(ValueError, match="unknown name 'q4'"):
    opt.add_param_group({"params": [m[3].weight], "moments": "q4"})
  opt = ht.AdamW(m.parameters(), lr=1e-2, moments="8bit")
  train_steps(m, opt, 1)
  opt.param_groups[0]["moments"] = "bf16"
  with pytest.raises(ValueError, match=r"param_groups\[0\]\['moments'\] changed from '8bit' to 'bf16'"):
    opt.step()
  opt.param_groups[0]["moments"] = "8bit"
  st = opt.state[m[0].weight]
  st["exp_avg"] = torch.zeros(m[0].weight.shape)  # float values where codes belong
  with pytest.raises(ValueError, match="dtype torch.float32: the group stores 8bit moments"):
    opt.step()
  # Codes of the right dtype are taken, as torch takes replaced state.
  st["exp_avg"] = torch.zeros(m[0].weight.shape, dtype=torch.uint8)
  opt.step()
  assert opt.state[m[0].weight]["exp_avg"].dtype == torch.uint8


def test_bytes_per_parameter_follow_the_format():
  sizes = {}
  for fmt in ("f32", "bf16", "8bit"):
    m = torch.nn.Linear(1024, 256, bias=False)
    opt = ht.AdamW(m.parameters(), moments=fmt)
    m(torch.randn(2, 1024)).sum().backward()
    opt.step()
    core = opt._layout["f32"][0]
    sizes[fmt] = core.state_bytes / core.num_params
  assert sizes == {"f32": 12.0, "bf16": 8.0, "8bit": 6.0625}
