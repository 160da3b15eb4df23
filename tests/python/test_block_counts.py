"""8-bit blocks that a NaN poisons or an outlier saturates: every front counts them in its
step statistics, warns once (CompressedMomentsWarning) the first time a step has some, and
checks for non-finite gradients by default when a group has 8-bit moments (README:
"Compressed moments", 8-bit)."""
import warnings

import numpy as np
import pytest

import hostopt

# 4 blocks of w (one poisoned or saturated below), f32 and bf16 tensors beside it.
N = 128


def core_optimizer(**extra):
  return hostopt.Optimizer([{"params": {"w": (N,)}, "lr": 1e-2, "moments": "8bit", "rounding_seed": 1, **extra},
                            {"params": {"f": (32,)}, "lr": 1e-2}], threads=1)


def grads(bad=None, where=5):
  g = {"w": np.full(N, 0.01, np.float32), "f": np.full(32, 0.01, np.float32)}
  if bad is not None:
    g["w"][where] = bad
  return g


def blocks_warnings(record):
  return [w for w in record if issubclass(w.category, hostopt.CompressedMomentsWarning)]


def test_a_nan_gradient_is_skipped_by_default_when_a_group_has_8bit_moments():
  opt = core_optimizer()
  opt.step(grads())
  before = [np.array(x) for x in opt.read_moments("w")] + [np.array(opt.params("w"))]
  with warnings.catch_warnings():
    warnings.simplefilter("error", hostopt.CompressedMomentsWarning)
    r = opt.step(grads(np.nan))
  assert not r.applied and r.skipped_steps == 1 and opt.step_count == 1
  assert (r.poisoned_blocks, r.saturated_blocks) == (0, 0)
  after = [np.array(x) for x in opt.read_moments("w")] + [np.array(opt.params("w"))]
  for a, b in zip(before, after):
    assert a.tobytes() == b.tobytes()
  # Only f32 groups: the default stays off (torch.optim's behaviour), NaN and all.
  f32 = hostopt.Optimizer([{"params": {"f": (32,)}, "lr": 1e-2}], threads=1)
  assert f32.step({"f": np.full(32, np.nan, np.float32)}).applied


def test_a_poisoned_block_is_counted_every_step_and_warned_once():
  opt = core_optimizer()
  with pytest.warns(hostopt.CompressedMomentsWarning, match="1 8-bit moment block.* poisoned") as record:
    r = opt.step(grads(np.nan), skip_nonfinite=False)
  assert r.applied and (r.poisoned_blocks, r.saturated_blocks) == (1, 0)
  assert len(blocks_warnings(record)) == 1
  m, v = opt.read_moments("w")
  assert np.isnan(m[:32]).all() and np.isfinite(m[32:]).all()  # the whole block, the others not
  with warnings.catch_warnings():
    warnings.simplefilter("error", hostopt.CompressedMomentsWarning)  # not again
    for _ in range(3):
      r = opt.step(grads())
      assert (r.poisoned_blocks, r.saturated_blocks) == (1, 0)
  assert np.isnan(opt.params("w")[:32]).all()


def test_an_outlier_that_passes_the_check_saturates_its_block_counted_and_warned_once():
  opt = core_optimizer()
  opt.step(grads())
  with pytest.warns(hostopt.CompressedMomentsWarning, match="saturated") as record:
    r = opt.step(grads(1e19, where=40))  # finite, below sqrt(FLT_MAX): the default check lets it through
  assert r.applied and (r.poisoned_blocks, r.saturated_blocks) == (0, 1)
  assert len(blocks_warnings(record)) == 1
  with warnings.catch_warnings():
    warnings.simplefilter("error", hostopt.CompressedMomentsWarning)
    r = opt.step(grads())  # the neighbours still sit at the block's floor
    assert (r.poisoned_blocks, r.saturated_blocks) == (0, 1)
  # A poisoning later is another kind: warned once too.
  with pytest.warns(hostopt.CompressedMomentsWarning, match="poisoned"):
    opt.step(grads(np.inf, where=3), skip_nonfinite=False)


def test_ordinary_steps_count_nothing_and_stay_silent():
  opt = core_optimizer()
  rng = np.random.default_rng(0)
  with warnings.catch_warnings():
    warnings.simplefilter("error", hostopt.CompressedMomentsWarning)
    for _ in range(5):
      g = {"w": rng.standard_normal(N).astype(np.float32), "f": rng.standard_normal(32).astype(np.float32)}
      r = opt.step(g)
      assert r.applied and (r.poisoned_blocks, r.saturated_blocks) == (0, 0)


# --- hostopt.jax ---------------------------------------------------------------------------
def jax_params():
  jnp = pytest.importorskip("jax.numpy")
  return {"w": jnp.zeros(N, jnp.float32), "f": jnp.zeros(32, jnp.float32)}


def jax_grads(bad=None, where=5):
  jnp = pytest.importorskip("jax.numpy")
  g = grads(bad, where)
  return {k: jnp.asarray(v) for k, v in g.items()}


@pytest.mark.parametrize("offload", [None, "host"])
def test_hostopt_jax_checks_8bit_groups_by_default_and_warns_once(offload):
  hj = pytest.importorskip("hostopt.jax")
  opt = hj.adamw(jax_params(), learning_rate=1e-2, moments="8bit", offload=offload)
  opt.step(jax_grads())
  with warnings.catch_warnings():
    warnings.simplefilter("error", hostopt.CompressedMomentsWarning)
    opt.step(jax_grads(np.nan))
  assert not opt.last_step.applied and opt.last_step.skipped_steps == 1 and opt.step_count == 1
  with pytest.warns(hostopt.CompressedMomentsWarning, match="hostopt.jax: .*saturated") as record:
    opt.step(jax_grads(1e19, where=40))
  assert len(blocks_warnings(record)) == 1
  assert (opt.last_step.poisoned_blocks, opt.last_step.saturated_blocks) == (0, 1)
  with warnings.catch_warnings():
    warnings.simplefilter("error", hostopt.CompressedMomentsWarning)
    opt.step(jax_grads())
  assert opt.last_step.saturated_blocks == 1

  unchecked = hj.adamw(jax_params(), learning_rate=1e-2, moments="8bit", offload=offload, skip_nonfinite=False)
  with pytest.warns(hostopt.CompressedMomentsWarning, match="poisoned") as record:
    unchecked.step(jax_grads(np.nan))
  assert len(blocks_warnings(record)) == 1
  assert unchecked.last_step.applied and unchecked.last_step.poisoned_blocks == 1
  with warnings.catch_warnings():
    warnings.simplefilter("error", hostopt.CompressedMomentsWarning)
    unchecked.step(jax_grads())
  assert unchecked.last_step.poisoned_blocks == 1
  # f32 moments only: unchecked by default, as before.
  f32 = hj.adamw(jax_params(), learning_rate=1e-2, offload=offload)
  f32.step(jax_grads(np.nan))
  assert f32.last_step.applied


# --- hostopt.torch -------------------------------------------------------------------------
def torch_model(offload=None, **kw):
  torch = pytest.importorskip("torch")
  import hostopt.torch as ht
  w = torch.nn.Parameter(torch.zeros(N))
  f = torch.nn.Parameter(torch.zeros(32))
  opt = ht.AdamW([{"params": [w], "moments": "8bit"}, {"params": [f]}], lr=1e-2, threads=1, offload=offload, **kw)
  return opt, w, f


def set_grads(w, f, bad=None, where=5):
  torch = pytest.importorskip("torch")
  g = grads(bad, where)
  w.grad, f.grad = torch.from_numpy(g["w"]), torch.from_numpy(g["f"])


def test_hostopt_torch_checks_8bit_groups_by_default_counts_and_warns_once():
  opt, w, f = torch_model()
  assert opt.last_step is None
  set_grads(w, f)
  opt.step()
  assert opt.last_step.applied and opt.last_step.step == 1
  before = (w.detach().clone(), f.detach().clone(), opt.state[w]["exp_avg_codes"].clone())
  set_grads(w, f, np.nan)
  with warnings.catch_warnings():
    warnings.simplefilter("error", hostopt.CompressedMomentsWarning)
    opt.step()
  # Skipped for every parameter, the f32 one too: one decision over all gradients.
  assert not opt.last_step.applied and opt.last_step.skipped_steps == 1
  assert opt.state[w]["step"] == 1 and opt.state[f]["step"] == 1
  assert all(a.numpy().tobytes() == b.numpy().tobytes()
             for a, b in zip(before, (w.detach(), f.detach(), opt.state[w]["exp_avg_codes"])))
  set_grads(w, f, 1e19, where=40)
  with pytest.warns(hostopt.CompressedMomentsWarning, match="hostopt.torch: .*saturated") as record:
    opt.step()
  assert len(blocks_warnings(record)) == 1
  assert (opt.last_step.poisoned_blocks, opt.last_step.saturated_blocks) == (0, 1)
  set_grads(w, f)
  with warnings.catch_warnings():
    warnings.simplefilter("error", hostopt.CompressedMomentsWarning)
    opt.step()
  assert opt.last_step.saturated_blocks == 1


@pytest.mark.parametrize("offload", [None, "host"])
def test_hostopt_torch_unchecked_8bit_poisoning_is_counted_and_warned_once(offload):
  # Unchecked: asked for (skip_nonfinite=False), or the offloaded path's default (a check
  # there needs a host sync).
  opt, w, f = torch_model(offload, **({} if offload else {"skip_nonfinite": False}))
  set_grads(w, f, np.nan)
  with pytest.warns(hostopt.CompressedMomentsWarning, match="poisoned") as record:
    opt.step()
  assert len(blocks_warnings(record)) == 1
  assert opt.last_step.applied and (opt.last_step.poisoned_blocks, opt.last_step.saturated_blocks) == (1, 0)
  set_grads(w, f)
  with warnings.catch_warnings():
    warnings.simplefilter("error", hostopt.CompressedMomentsWarning)
    opt.step()
  assert opt.last_step.poisoned_blocks == 1
  assert bool(w.detach()[:32].isnan().all()) and not bool(w.detach()[32:].isnan().any())


def test_hostopt_torch_offloaded_check_when_asked_and_f32_default_unchecked():
  opt, w, f = torch_model("host", skip_nonfinite=True)
  set_grads(w, f, np.nan)
  opt.step()
  assert not opt.last_step.applied and opt.last_step.skipped_steps == 1
  torch = pytest.importorskip("torch")
  import hostopt.torch as ht
  p = torch.nn.Parameter(torch.zeros(32))
  plain = ht.AdamW([p], lr=1e-2, threads=1)
  p.grad = torch.full((32,), float("nan"))
  plain.step()  # f32 moments: unchecked, as torch.optim
  assert plain.last_step.applied and bool(p.detach().isnan().all())


# --- hostopt.optax -------------------------------------------------------------------------
@pytest.mark.parametrize("route", ["numpy", "eager", "jit"])
def test_hostopt_optax_poisoned_blocks_counted_in_the_state_and_warned_once_outside_jit(route):
  jax = pytest.importorskip("jax")
  jnp = pytest.importorskip("jax.numpy")
  pytest.importorskip("optax")
  import hostopt.optax as ho
  tx = ho.adamw_8bit(learning_rate=1e-2)
  as_input = (lambda x: x) if route == "numpy" else jnp.asarray
  params = {"w": as_input(np.zeros(N, np.float32))}
  state = tx.init(params)
  update = jax.jit(tx.update) if route == "jit" else tx.update
  bad = {"w": as_input(grads(np.nan)["w"])}
  ctx = warnings.catch_warnings() if route == "jit" else pytest.warns(hostopt.CompressedMomentsWarning,
                                                                      match="hostopt.optax: .*poisoned")
  with ctx as record:
    if route == "jit":
      warnings.simplefilter("error", hostopt.CompressedMomentsWarning)  # nothing can warn under jit
    _, state = update(bad, state, params)
  if route != "jit":
    assert len(blocks_warnings(record)) == 1
  assert ho.poisoned_blocks(state) == 1
  assert int(jax.jit(ho.poisoned_blocks)(state)) == 1
  with warnings.catch_warnings():
    warnings.simplefilter("error", hostopt.CompressedMomentsWarning)  # once
    _, state = update({"w": as_input(grads()["w"])}, state, params)
  assert ho.poisoned_blocks(state) == 1
  assert ho.poisoned_blocks(tx.init(params)) == 0
