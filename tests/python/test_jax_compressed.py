"""hostopt.jax with compressed (bf16 and 8-bit) moments: the core optimizer's bits, per-label
formats, exact resume through state_dict and checkpoints, explicit conversions."""
import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402

import hostopt  # noqa: E402
import hostopt.jax as hj  # noqa: E402

jax.config.update("jax_platform_name", "cpu")

FORMATS = ["bf16", "8bit"]


def mlp(seed=1):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((64, 8)).astype(np.float32))
  y = jnp.asarray(rng.standard_normal((64, 1)).astype(np.float32))
  # 8 x 40 = 320 and 40 elements: tensors that end inside a 32-element block.
  params = {"l1": {"w": jnp.asarray(0.3 * rng.standard_normal((8, 40)).astype(np.float32)), "b": jnp.zeros(40)},
            "l2": {"w": jnp.asarray(0.3 * rng.standard_normal((40, 1)).astype(np.float32)), "b": jnp.zeros(1)}}

  def loss(p):
    h = jnp.tanh(x @ p["l1"]["w"].astype(jnp.float32) + p["l1"]["b"].astype(jnp.float32))
    return jnp.mean((h @ p["l2"]["w"].astype(jnp.float32) + p["l2"]["b"].astype(jnp.float32) - y) ** 2)
  return params, loss, jax.jit(jax.grad(loss))


def bits(tree):
  return [np.asarray(x).view(np.uint32 if np.asarray(x).dtype.itemsize == 4 else np.uint16).copy()
          for x in jax.tree_util.tree_leaves(tree)]


def train(opt, params, grad, steps):
  p = params
  for _ in range(steps):
    p = jax.tree_util.tree_map(jnp.copy, opt.step(grad(p)))
  return p


@pytest.mark.parametrize("fmt", FORMATS)
def test_steps_are_the_core_optimizers_bits_and_track_f32(fmt):
  # hostopt.jax adds nothing to the update: the same groups in hostopt.Optimizer (flat
  # gradients, leaf order) give the same bits; and training follows the f32 state.
  params, loss, grad = mlp()
  opt = hj.adamw(params, 1e-2, weight_decay=0.1, moments=fmt, rounding_seed=5)
  names = opt._names
  core = hostopt.Optimizer([{"params": [(n, s) for n, s in zip(names, opt._shapes)], "lr": 1e-2, "weight_decay": 0.1,
                             "moments": fmt, "rounding_seed": 5}])
  for n, x in zip(names, jax.tree_util.tree_leaves(params)):
    core.params(n)[...] = np.asarray(x)
  f32 = hj.adamw(params, 1e-2, weight_decay=0.1)
  p = q = params
  for _ in range(30):
    g = grad(p)
    core.step({n: np.asarray(x) for n, x in zip(names, jax.tree_util.tree_leaves(g))})
    p = opt.step(g)
    q = f32.step(grad(q))
  for n, x in zip(names, jax.tree_util.tree_leaves(p)):
    assert np.array_equal(np.asarray(x).view(np.uint32), core.params(n).view(np.uint32)), n
  assert abs(float(loss(p)) - float(loss(q))) < 0.02 * float(loss(q))
  assert float(loss(p)) < 0.7 * float(loss(params))
  per = opt.memory()["state_bytes_per_param"]
  assert per == pytest.approx({"bf16": 8.0, "8bit": 6.0625}[fmt], rel=0.25)  # + 64-byte alignment of small leaves
  assert per < f32.memory()["state_bytes_per_param"]


def test_formats_per_group_label_and_bad_names():
  params, _, grad = mlp()
  labels = {"l1": {"w": "matrices", "b": "vectors"}, "l2": {"w": "matrices", "b": "vectors"}}
  opt = hj.adamw(params, 1e-2, groups=labels, moments="8bit", group_options={"vectors": {"moments": "f32"}})
  assert opt.moment_formats() == {"l1": {"w": "8bit", "b": "f32"}, "l2": {"w": "8bit", "b": "f32"}}
  p = train(opt, params, grad, 3)
  st = opt.optax_state()  # f32 leaves as views, 8-bit ones decoded
  assert st.mu["l1"]["b"].dtype == st.mu["l1"]["w"].dtype == np.float32
  assert not st.nu["l1"]["w"].flags.writeable and np.all(st.nu["l1"]["w"] >= 0) and np.any(st.nu["l1"]["w"] > 0)
  assert np.all(np.isfinite(np.asarray(p["l1"]["w"])))
  with pytest.raises(ValueError, match="moments.*4bit"):
    hj.adamw(params, 1e-2, moments="4bit")
  with pytest.raises(ValueError, match=r"group_options\['vectors'\]\['moments'\]"):
    hj.adamw(params, 1e-2, groups=labels, group_options={"vectors": {"moments": "int8"}})
  with pytest.raises(ValueError, match="rounding_seed"):
    hj.adamw(params, 1e-2, moments="bf16", rounding_seed=-1)


@pytest.mark.parametrize("fmt", FORMATS)
def test_state_dict_and_checkpoint_resume_bit_exact(fmt, tmp_path):
  params, _, grad = mlp()
  kw = dict(weight_decay=0.1, moments=fmt, rounding_seed=3)
  opt = hj.adamw(params, 1e-2, **kw)
  p = train(opt, params, grad, 5)
  sd = opt.state_dict()
  if fmt == "bf16":
    assert sd["mu"]["['l1']['w']"].dtype == np.dtype(jnp.bfloat16)
  else:
    assert "['l1']['w']" not in sd["mu"] and sd["mu_codes"]["['l1']['w']"].dtype == np.uint8
    assert sd["moment_scales"]["['l1']['w']"].shape == (10, 2)  # 320 elements in 32-element blocks
  opt.save(str(tmp_path / "ckpt.safetensors"))
  want = bits(train(opt, p, grad, 4))
  for restore in ("state_dict", "checkpoint"):
    other = hj.adamw(params, 1e-2, **kw)
    if restore == "state_dict":
      other.load_state_dict(sd)
    else:
      other.load(str(tmp_path / "ckpt.safetensors"))
    got = bits(train(other, p, grad, 4))
    assert all(np.array_equal(a, b) for a, b in zip(got, want)), restore


@pytest.mark.parametrize("fmt", FORMATS)
def test_another_format_is_refused_unchanged_or_converted_when_asked(fmt):
  params, _, grad = mlp()
  f32 = hj.adamw(params, 1e-2)
  train(f32, params, grad, 4)
  sd32 = f32.state_dict()
  comp = hj.adamw(params, 1e-2, moments=fmt)
  train(comp, params, grad, 2)
  before = comp.state_dict()
  with pytest.raises(ValueError, match=f"holds f32 moments.*as {fmt}.*convert_moments=True"):
    comp.load_state_dict(sd32)
  after = comp.state_dict()
  assert after["step"] == before["step"] == 2
  assert all(np.array_equal(np.asarray(after[k][n]).view(np.uint8), np.asarray(before[k][n]).view(np.uint8))
             for k in before if isinstance(before[k], dict) for n in before[k])
  with pytest.raises(ValueError, match=f"holds {fmt} moments.*as f32"):
    hj.adamw(params, 1e-2).load_state_dict(before)
  # Converted when asked: within the format's grid of the f32 moments, both ways.
  comp.load_state_dict(sd32, convert_moments=True)
  st = comp.optax_state()
  for n, want_m, want_v in zip(comp._names, jax.tree_util.tree_leaves(f32.optax_state().mu),
                               jax.tree_util.tree_leaves(f32.optax_state().nu)):
    got_m = jax.tree_util.tree_leaves(st.mu)[comp._names.index(n)]
    rel = 2.0 ** -7 if fmt == "bf16" else 0.25
    assert np.allclose(got_m, want_m, rtol=rel, atol=rel * np.abs(want_m).max()), n
  assert comp.step_count == 4
  back = hj.adamw(params, 1e-2)
  back.load_state_dict(comp.state_dict(), convert_moments=True)  # decoded exactly
  for x, y in zip(jax.tree_util.tree_leaves(back.optax_state().nu), jax.tree_util.tree_leaves(comp.optax_state().nu)):
    assert np.array_equal(x, y)


def test_malformed_compressed_state_is_refused_naming_the_entry():
  params, _, grad = mlp()
  opt = hj.adamw(params, 1e-2, moments="8bit")
  train(opt, params, grad, 2)
  sd = opt.state_dict()
  leaf = "['l1']['w']"
  cases = [
      (dict(sd, moment_scales={**sd["moment_scales"], leaf: np.zeros((9, 2), np.uint8)}), "moment_scales.*expected uint8"),
      (dict(sd, mu_codes={**sd["mu_codes"], leaf: sd["mu_codes"][leaf].astype(np.int16)}), "mu_codes.*expected uint8"),
      (dict(sd, nu_codes={k: v for k, v in sd["nu_codes"].items() if k != leaf}), "8-bit moments are mu_codes, nu_codes"),
  ]
  before = opt.state_dict()
  for bad, msg in cases:
    with pytest.raises(ValueError, match=msg):
      opt.load_state_dict(bad)
  assert all(np.array_equal(before["mu_codes"][n], opt.state_dict()["mu_codes"][n]) for n in before["mu_codes"])
  bf = hj.adamw(params, 1e-2, moments="bf16")
  sdb = bf.state_dict()
  with pytest.raises(ValueError, match="both bfloat16"):
    bf.load_state_dict(dict(sdb, nu={**sdb["nu"], leaf: np.asarray(sdb["nu"][leaf], np.float32)}))


@pytest.mark.parametrize("fmt", FORMATS)
def test_offloaded_pipeline_gives_the_in_place_bits(fmt):
  # Chunks of 40 elements are rounded to whole 8-bit blocks by the pipeline.
  params, _, grad = mlp()
  a = hj.adamw(params, 1e-2, weight_decay=0.1, moments=fmt, offload="host", offload_chunk=40)
  b = hj.adamw(params, 1e-2, weight_decay=0.1, moments=fmt)
  p = q = params
  for _ in range(6):
    p, q = a.step(grad(p)), b.step(grad(q))
    assert all(np.array_equal(x, y) for x, y in zip(bits(p), bits(q)))


def test_load_state_dict_checks_step_seed_and_exponent_bytes_before_changing_anything():
  params, _, grad = mlp()
  opt = hj.adamw(params, 1e-2, moments="8bit", rounding_seed=4)
  train(opt, params, grad, 2)
  sd = opt.state_dict()
  assert sd["rounding_seed"] == 4
  before = opt.state_dict()
  leaf = "['l1']['w']"
  scales = sd["moment_scales"][leaf].copy()
  scales[3] = (245, 0)  # above m's largest exponent byte (239), not the poisoned 255
  cases = [(dict(sd, step=2 ** 53 + 1), "step"), (dict(sd, step=np.uint64(2 ** 63)), "step"),
           (dict(sd, step=2.9), "not an integer"),
           (dict(sd, step=True), "not an integer"), (dict(sd, rounding_seed=-1), "rounding_seed"),
           (dict(sd, moment_scales={**sd["moment_scales"], leaf: scales}), "block 3's exp_avg exponent byte is 245")]
  for bad, msg in cases:
    with pytest.raises(ValueError, match=msg):
      opt.load_state_dict(bad)
    after = opt.state_dict()
    assert after["step"] == 2 and all(np.array_equal(after[k][n], before[k][n])
                                      for k in ("params", "mu_codes", "nu_codes", "moment_scales") for n in before[k])
  # The state's seed becomes the optimizer's: one made with another seed resumes exactly.
  want = bits(train(opt, params, grad, 3))
  other = hj.adamw(params, 1e-2, moments="8bit", rounding_seed=99)
  other.load_state_dict(sd)
  assert all(np.array_equal(a, b) for a, b in zip(bits(train(other, params, grad, 3)), want))
