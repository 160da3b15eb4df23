"""8-bit blocks that a NaN poisons or an outlier saturates: every front counts them in its
step statistics, warns once (CompressedMomentsWarning, pointing at the user's call) at the
first step that has poisoned blocks or the second applied step in a row that has saturated
ones, and checks for non-finite gradients by default when a group has 8-bit moments (README:
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


def test_an_outlier_that_passes_the_check_saturates_its_block_counted_and_warned_once_it_lasts():
  opt = core_optimizer()
  opt.step(grads())
  with warnings.catch_warnings():
    warnings.simplefilter("error", hostopt.CompressedMomentsWarning)  # one step of it: not yet
    r = opt.step(grads(1e19, where=40))  # finite, below sqrt(FLT_MAX): the default check lets it through
  assert r.applied and (r.poisoned_blocks, r.saturated_blocks) == (0, 1)
  with pytest.warns(hostopt.CompressedMomentsWarning, match="saturated .as did the step before") as record:
    r = opt.step(grads())  # the neighbours still sit at the block's floor: it lasts
  assert (r.poisoned_blocks, r.saturated_blocks) == (0, 1)
  assert len(blocks_warnings(record)) == 1 and record[0].filename == __file__
  with warnings.catch_warnings():
    warnings.simplefilter("error", hostopt.CompressedMomentsWarning)
    r = opt.step(grads())
    assert (r.poisoned_blocks, r.saturated_blocks) == (0, 1)
  # A poisoning later is another kind: warned once too.
  with pytest.warns(hostopt.CompressedMomentsWarning, match="poisoned"):
    opt.step(grads(np.inf, where=3), skip_nonfinite=False)


def test_saturation_warns_when_two_applied_steps_in_a_row_count_it():
  opt = hostopt.Optimizer([{"params": {"w": (N,)}, "lr": 1e-2, "moments": "8bit", "rounding_seed": 1}], threads=1)
  ones = np.ones(N, np.float32)
  with warnings.catch_warnings():
    warnings.simplefilter("error", hostopt.CompressedMomentsWarning)
    # A gradient of 1e-8 beside 1 (v 2^53 apart) saturates its block at step 1 only: the
    # next steps' v averages it away.
    g = ones.copy()
    g[7] = 1e-8
    assert opt.step({"w": g}).saturated_blocks == 1
    assert opt.step({"w": ones}).saturated_blocks == 0
    g = ones.copy()
    g[40] = 1e19  # an outlier: its block stays saturated
    assert opt.step({"w": g}).saturated_blocks == 1  # the step before counted none: not yet
    # A skipped step (counting nothing) does not break the run.
    assert not opt.step({"w": np.full(N, np.nan, np.float32)}).applied
  with pytest.warns(hostopt.CompressedMomentsWarning, match="step 4 left 1 8-bit moment block.s. saturated") as rec:
    assert opt.step({"w": ones}).saturated_blocks == 1
  assert len(blocks_warnings(rec)) == 1 and rec[0].filename == __file__


# Healthy training: Gaussian gradients over ~1M parameters. At step 1, v = (1 - b2) g^2 is
# not averaged yet, so a block whose largest and smallest gradients are more than 2^16.5
# apart is counted saturated (some 7e-4 of the blocks); from step 2 on, none is.
GAUSS_N = 1 << 20


def gaussian_grads(steps):
  rng = np.random.default_rng(0)
  return [(rng.standard_normal(GAUSS_N) * 1e-3).astype(np.float32) for _ in range(steps)]


def check_gaussian_counts(counts):
  assert counts[0] > 0 and counts[1:] == [0] * (len(counts) - 1), counts


def test_healthy_gaussian_gradients_saturate_blocks_at_step_1_only_and_do_not_warn():
  opt = hostopt.Optimizer([{"params": {"w": (GAUSS_N,)}, "lr": 1e-3, "moments": "8bit"}], threads=1)
  with warnings.catch_warnings():
    warnings.simplefilter("error", hostopt.CompressedMomentsWarning)
    check_gaussian_counts([opt.step({"w": g}).saturated_blocks for g in gaussian_grads(4)])


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
  with warnings.catch_warnings():
    warnings.simplefilter("error", hostopt.CompressedMomentsWarning)  # one step of it: not yet
    opt.step(jax_grads(1e19, where=40))
  assert (opt.last_step.poisoned_blocks, opt.last_step.saturated_blocks) == (0, 1)
  with pytest.warns(hostopt.CompressedMomentsWarning, match="hostopt.jax: .*saturated") as record:
    opt.step(jax_grads())
  assert len(blocks_warnings(record)) == 1 and record[0].filename == __file__
  assert opt.last_step.saturated_blocks == 1
  with warnings.catch_warnings():
    warnings.simplefilter("error", hostopt.CompressedMomentsWarning)
    opt.step(jax_grads())
  assert opt.last_step.saturated_blocks == 1

  unchecked = hj.adamw(jax_params(), learning_rate=1e-2, moments="8bit", offload=offload, skip_nonfinite=False)
  with pytest.warns(hostopt.CompressedMomentsWarning, match="poisoned") as record:
    unchecked.step(jax_grads(np.nan))
  assert len(blocks_warnings(record)) == 1 and record[0].filename == __file__
  assert unchecked.last_step.applied and unchecked.last_step.poisoned_blocks == 1
  with warnings.catch_warnings():
    warnings.simplefilter("error", hostopt.CompressedMomentsWarning)
    unchecked.step(jax_grads())
  assert unchecked.last_step.poisoned_blocks == 1
  # f32 moments only: unchecked by default, as before.
  f32 = hj.adamw(jax_params(), learning_rate=1e-2, offload=offload)
  f32.step(jax_grads(np.nan))
  assert f32.last_step.applied


@pytest.mark.parametrize("offload", [None, "host"])
def test_hostopt_jax_healthy_gaussian_gradients_do_not_warn(offload):
  hj = pytest.importorskip("hostopt.jax")
  jnp = pytest.importorskip("jax.numpy")
  opt = hj.adamw({"w": jnp.zeros(GAUSS_N, jnp.float32)}, learning_rate=1e-3, moments="8bit", offload=offload)
  counts = []
  with warnings.catch_warnings():
    warnings.simplefilter("error", hostopt.CompressedMomentsWarning)
    for g in gaussian_grads(4):
      opt.step({"w": jnp.asarray(g)})
      counts.append(opt.last_step.saturated_blocks)
  check_gaussian_counts(counts)


@pytest.mark.parametrize("offload", [None, "host"])
def test_hostopt_jax_grad_norm_is_none_when_not_computed_and_skip_nonfinite_is_a_bool(offload):
  hj = pytest.importorskip("hostopt.jax")
  g = {"w": jax_grads()["w"], "f": jax_grads()["f"]}
  unchecked = hj.adamw(jax_params(), learning_rate=1e-2, offload=offload)
  unchecked.step(g)
  assert unchecked.last_step.applied and unchecked.last_step.grad_norm is None
  checked = hj.adamw(jax_params(), learning_rate=1e-2, offload=offload, skip_nonfinite=np.bool_(True))
  checked.step(g)
  assert checked.last_step.grad_norm == pytest.approx(0.01 * np.sqrt(N + 32), rel=1e-6)
  for bad in ("no", 0, 1.0, "False"):
    with pytest.raises(TypeError, match="skip_nonfinite"):
      hj.adamw(jax_params(), learning_rate=1e-2, offload=offload, skip_nonfinite=bad)


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
  with warnings.catch_warnings():
    warnings.simplefilter("error", hostopt.CompressedMomentsWarning)  # one step of it: not yet
    opt.step()
  assert (opt.last_step.poisoned_blocks, opt.last_step.saturated_blocks) == (0, 1)
  set_grads(w, f)
  with pytest.warns(hostopt.CompressedMomentsWarning, match="hostopt.torch: .*saturated") as record:
    opt.step()
  assert len(blocks_warnings(record)) == 1 and record[0].filename == __file__
  assert opt.last_step.saturated_blocks == 1
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
  assert len(blocks_warnings(record)) == 1 and record[0].filename == __file__
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


@pytest.mark.parametrize("offload", [None, "host"])
def test_hostopt_torch_healthy_gaussian_gradients_do_not_warn(offload):
  torch = pytest.importorskip("torch")
  import hostopt.torch as ht
  p = torch.nn.Parameter(torch.zeros(GAUSS_N))
  opt = ht.AdamW([p], lr=1e-3, moments="8bit", threads=1, offload=offload)
  counts = []
  with warnings.catch_warnings():
    warnings.simplefilter("error", hostopt.CompressedMomentsWarning)
    for g in gaussian_grads(4):
      p.grad = torch.from_numpy(g)
      opt.step()
      counts.append(opt.last_step.saturated_blocks)
  check_gaussian_counts(counts)


@pytest.mark.parametrize("offload", [None, "host"])
def test_hostopt_torch_grad_norm_is_none_when_unchecked_and_skip_nonfinite_is_a_bool(offload):
  torch = pytest.importorskip("torch")
  import hostopt.torch as ht
  opt, w, f = torch_model(offload, skip_nonfinite=False)
  set_grads(w, f)
  opt.step()
  assert opt.last_step.applied and opt.last_step.grad_norm is None
  opt, w, f = torch_model(offload, skip_nonfinite=np.bool_(True))
  set_grads(w, f)
  opt.step()
  assert opt.last_step.grad_norm == pytest.approx(0.01 * np.sqrt(N + 32), rel=1e-6)
  p = torch.nn.Parameter(torch.zeros(4))
  for bad in ("no", 0, 1.0, "False"):
    with pytest.raises(TypeError, match="skip_nonfinite"):
      ht.AdamW([p], lr=1e-2, threads=1, offload=offload, skip_nonfinite=bad)


# --- hostopt.optax -------------------------------------------------------------------------
@pytest.fixture
def optax_untold(monkeypatch):
  """hostopt.optax warns once per process: each test starts with nothing told."""
  pytest.importorskip("jax")
  pytest.importorskip("optax")
  import hostopt.optax as ho
  monkeypatch.setattr(ho, "_BLOCKS_TOLD", type("_Told", (), {})(), raising=False)
  return ho


@pytest.mark.parametrize("route", ["numpy", "eager", "jit"])
def test_hostopt_optax_poisoned_blocks_counted_in_the_state_and_warned_once_outside_jit(route, optax_untold):
  jax = pytest.importorskip("jax")
  jnp = pytest.importorskip("jax.numpy")
  ho = optax_untold
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
  # Once per process, not per transformation: another one's poisoned update is not warned either.
  with warnings.catch_warnings():
    warnings.simplefilter("error", hostopt.CompressedMomentsWarning)
    other = ho.adamw_8bit(learning_rate=1e-2)
    (jax.jit(other.update) if route == "jit" else other.update)(bad, other.init(params), params)


def test_hostopt_optax_under_inject_hyperparams_warns_once_at_the_users_line(optax_untold):
  jnp = pytest.importorskip("jax.numpy")
  import optax
  ho = optax_untold
  tx = optax.inject_hyperparams(ho.adamw)(learning_rate=1e-2, moments="8bit")  # rebuilt at every update
  params = {"w": jnp.zeros(N, jnp.float32)}
  state = tx.init(params)
  bad = {"w": jnp.asarray(grads(np.nan)["w"])}
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    for _ in range(3):
      _, state = tx.update(bad, state, params)
  told = blocks_warnings(record)
  assert len(told) == 1 and told[0].filename == __file__, [(w.filename, str(w.message)[:60]) for w in told]
  assert ho.poisoned_blocks(state) == 1


def test_core_warning_points_at_the_step_call():
  opt = core_optimizer()
  with pytest.warns(hostopt.CompressedMomentsWarning, match="poisoned") as record:
    opt.step(grads(np.nan), skip_nonfinite=False)
  assert record[0].filename == __file__


# --- what the default check decides (README: "Non-finite steps are skipped by default") ------
def test_the_default_check_is_one_decision_over_every_group_and_judges_the_global_norm():
  # A NaN in the f32 group skips the whole step (the 8-bit group's default check), not warned.
  opt = core_optimizer()
  with warnings.catch_warnings():
    warnings.simplefilter("error", hostopt.CompressedMomentsWarning)
    r = opt.step({"w": np.full(N, 0.01, np.float32), "f": np.full(32, np.nan, np.float32)})
  assert not r.applied and r.skipped_steps == 1 and opt.step_count == 0
  # Finite gradients whose squares fit a float, but whose global norm (2e19, in double)
  # exceeds sqrt(FLT_MAX): skipped when checked; clipped and applied with max_grad_norm.
  big = {"w": np.full(10000, 2e17, np.float32)}
  make = lambda: hostopt.Optimizer([{"params": {"w": (10000,)}, "lr": 1e-3, "moments": "8bit"}], threads=1)
  r = make().step(big)
  assert not r.applied and r.skipped_steps == 1 and np.isfinite(r.grad_norm) and r.grad_norm > np.sqrt(3.4e38)
  assert make().step(big, max_grad_norm=1.0).applied
  assert make().step(big, skip_nonfinite=False).applied
