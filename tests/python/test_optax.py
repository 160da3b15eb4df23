"""hostopt.optax side by side with real optax (jax CPU)."""
import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402

import hostopt.optax as hoptax  # noqa: E402
from hostopt import _core  # noqa: E402

jax.config.update("jax_platform_name", "cpu")


def quadratic_problem(seed=0):
  rng = np.random.default_rng(seed)
  target = {"w": rng.standard_normal((17, 5)).astype(np.float32), "b": rng.standard_normal(5).astype(np.float32)}
  params = {"w": jnp.zeros((17, 5)), "b": jnp.ones(5)}

  def loss(p):
    return 0.5 * sum(jnp.sum((p[k] - target[k]) ** 2 * (1 + i)) for i, k in enumerate(sorted(p)))
  return params, jax.grad(loss)


def mlp_problem(seed=1):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((64, 8)).astype(np.float32))
  y = jnp.asarray(rng.standard_normal((64, 1)).astype(np.float32))
  params = {"l1": {"w": jnp.asarray(0.3 * rng.standard_normal((8, 16)).astype(np.float32)), "b": jnp.zeros(16)},
            "l2": {"w": jnp.asarray(0.3 * rng.standard_normal((16, 1)).astype(np.float32)), "b": jnp.zeros(1)}}

  def loss(p):
    h = jnp.tanh(x @ p["l1"]["w"] + p["l1"]["b"])
    return jnp.mean((h @ p["l2"]["w"] + p["l2"]["b"] - y) ** 2)
  return params, jax.grad(loss)


def run(opt, params, grad_fn, steps=100):
  state = opt.init(params)
  for _ in range(steps):
    updates, state = opt.update(grad_fn(params), state, params)
    params = optax.apply_updates(params, updates)
  return params, state


def assert_trees_close(a, b, rtol=2e-4, atol=2e-5):
  jax.tree_util.tree_map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol),
                         a, b)


SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 3e-2, 10, 100)
MASK = {"b": False, "w": True}

CASES = [
    ("adam", dict(learning_rate=1e-2)),
    ("adam", dict(learning_rate=SCHEDULE, eps_root=1e-8)),
    ("adamw", dict(learning_rate=1e-2, weight_decay=0.1)),
    ("adamw", dict(learning_rate=SCHEDULE, weight_decay=0.05, mask=MASK)),
    ("adamw", dict(learning_rate=1e-2, weight_decay=0.05, mask=lambda p: jax.tree_util.tree_map(lambda x: x.ndim > 1, p))),
    ("nadam", dict(learning_rate=3e-3, b1=0.85)),
    ("nadamw", dict(learning_rate=SCHEDULE, weight_decay=0.1, eps_root=1e-6)),
]


@pytest.mark.parametrize("name, kwargs", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
@pytest.mark.parametrize("problem", [quadratic_problem, mlp_problem])
def test_trajectory_matches_optax(name, kwargs, problem):
  if problem is mlp_problem and isinstance(kwargs.get("mask"), dict):
    kwargs = dict(kwargs, mask=jax.tree_util.tree_map(lambda x: x.ndim > 1, problem()[0]))
  params, grad_fn = problem()
  ours, our_state = run(getattr(hoptax, name)(**kwargs), params, grad_fn)
  theirs, their_state = run(getattr(optax, name)(**kwargs), params, grad_fn)
  assert jax.tree_util.tree_structure(our_state) == jax.tree_util.tree_structure(their_state)
  assert int(our_state[0].count) == int(their_state[0].count) == 100
  assert_trees_close(ours, theirs)
  assert_trees_close(our_state[0].mu, their_state[0].mu)
  assert_trees_close(our_state[0].nu, their_state[0].nu, rtol=1e-3, atol=1e-7)


def test_mu_dtype_bfloat16_keeps_optax_dtypes():
  params, grad_fn = quadratic_problem()
  ours, s1 = run(hoptax.adam(1e-2, mu_dtype=jnp.bfloat16), params, grad_fn, steps=20)
  theirs, s2 = run(optax.adam(1e-2, mu_dtype=jnp.bfloat16), params, grad_fn, steps=20)
  assert jax.tree_util.tree_map(lambda x: x.dtype, s1[0].mu) == jax.tree_util.tree_map(lambda x: x.dtype, s2[0].mu)
  assert_trees_close(ours, theirs, rtol=2e-2, atol=2e-3)


def test_composes_after_clip_by_global_norm():
  params, grad_fn = mlp_problem()
  ours, _ = run(optax.chain(optax.clip_by_global_norm(0.1), hoptax.adamw(1e-2)), params, grad_fn, steps=50)
  theirs, _ = run(optax.chain(optax.clip_by_global_norm(0.1), optax.adamw(1e-2)), params, grad_fn, steps=50)
  assert_trees_close(ours, theirs)


def test_inject_hyperparams_changes_lr_between_steps():
  params, grad_fn = quadratic_problem()
  results = []
  for mod in (hoptax, optax):
    opt = optax.inject_hyperparams(mod.adamw)(learning_rate=1e-2, weight_decay=0.01)
    state = opt.init(params)
    p = params
    for step in range(30):
      state.hyperparams["learning_rate"] = jnp.asarray(1e-2 if step < 15 else 1e-3)
      updates, state = opt.update(grad_fn(p), state, p)
      p = optax.apply_updates(p, updates)
    results.append(p)
  assert_trees_close(*results)


def test_apply_if_finite_leaves_the_state_untouched_on_nan():
  params, grad_fn = quadratic_problem()
  opt = optax.apply_if_finite(hoptax.adam(1e-2), max_consecutive_errors=5)
  state = opt.init(params)
  updates, state = opt.update(grad_fn(params), state, params)
  params = optax.apply_updates(params, updates)
  bad = jax.tree_util.tree_map(lambda g: g.at[0].set(jnp.nan), grad_fn(params))
  updates, new_state = opt.update(bad, state, params)
  assert int(new_state.notfinite_count) == 1
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                         new_state.inner_state, state.inner_state)
  jax.tree_util.tree_map(lambda u: np.testing.assert_array_equal(np.asarray(u), 0.0), updates)


def test_multisteps_accumulates_like_optax():
  params, grad_fn = mlp_problem()
  ours, _ = run(optax.MultiSteps(hoptax.adam(1e-2), every_k_schedule=3), params, grad_fn, steps=30)
  theirs, _ = run(optax.MultiSteps(optax.adam(1e-2), every_k_schedule=3), params, grad_fn, steps=30)
  assert_trees_close(ours, theirs)


def test_update_under_jit():
  params, grad_fn = quadratic_problem()
  opt = hoptax.adamw(SCHEDULE, weight_decay=0.1)
  ref = optax.adamw(SCHEDULE, weight_decay=0.1)
  update = jax.jit(opt.update)
  s1, s2 = opt.init(params), ref.init(params)
  p1 = p2 = params
  for _ in range(10):
    u1, s1 = update(grad_fn(p1), s1, p1)
    u2, s2 = ref.update(grad_fn(p2), s2, p2)
    p1, p2 = optax.apply_updates(p1, u1), optax.apply_updates(p2, u2)
  assert_trees_close(p1, p2)


def test_given_state_is_not_mutated_and_extra_args_are_ignored():
  rng = np.random.default_rng(0)
  params = {"a": rng.standard_normal(10).astype(np.float32)}
  opt = hoptax.adamw(1e-2)
  state = opt.init(params)
  assert isinstance(state[0].mu["a"], np.ndarray)  # numpy in, numpy out
  _, state = opt.update({"a": np.ones(10, np.float32)}, state, params)
  snapshot = jax.tree_util.tree_map(np.copy, state)
  updates, new_state = opt.update({"a": np.ones(10, np.float32)}, state, params, some_extra_arg=3)
  jax.tree_util.tree_map(np.testing.assert_array_equal, state, snapshot)
  assert isinstance(updates["a"], np.ndarray) and updates["a"].dtype == np.float32
  assert not np.array_equal(new_state[0].mu["a"], state[0].mu["a"])


def test_reuse_state_updates_numpy_moments_in_place():
  params = {"a": np.ones(10, np.float32)}
  opt = hoptax.adam(1e-2, reuse_state=True)
  state = opt.init(params)
  mu = state[0].mu["a"]
  _, new_state = opt.update({"a": np.ones(10, np.float32)}, state, params)
  assert new_state[0].mu["a"] is mu and mu[0] != 0


def test_bad_hyperparameters_are_refused():
  with pytest.raises(ValueError, match="b1 = 1.0"):
    hoptax.adam(1e-3, b1=1.0)
  with pytest.raises(ValueError, match="eps = -1.0"):
    hoptax.adamw(1e-3, eps=-1.0)
  opt = hoptax.adamw(1e-3, weight_decay=0.1)
  params = {"a": np.ones(3, np.float32)}
  with pytest.raises(ValueError, match="params"):
    opt.update({"a": np.ones(3, np.float32)}, opt.init(params))


@pytest.mark.parametrize("leaf,size", [("mu", 7), ("nu", 7), ("mu", 12), ("params", 5)])
def test_mismatched_state_leaves_are_refused_naming_the_leaf(leaf, size):
  # A smaller mu/nu corrupted the heap, a smaller params leaf read out of bounds, a larger
  # mu was silently accepted.
  opt = hoptax.adamw(1e-2, weight_decay=0.1)
  params = {"a": np.ones(3, np.float32), "b": np.ones(10, np.float32)}
  state = opt.init(params)
  grads = {"a": np.ones(3, np.float32), "b": np.ones(10, np.float32)}
  if leaf == "params":
    params = {"a": params["a"], "b": np.ones(size, np.float32)}
  else:
    adam = state[0]
    moments = dict(getattr(adam, leaf), b=np.zeros(size, np.float32))
    state = (adam._replace(**{leaf: moments}),) + tuple(state[1:])
  snapshot = jax.tree_util.tree_map(np.copy, state)
  with pytest.raises(ValueError, match=rf"{leaf}\[1\] has shape \({size},\): expected \(10,\) like updates\[1\]"):
    opt.update(grads, state, params)
  jax.tree_util.tree_map(np.testing.assert_array_equal, state, snapshot)


def test_same_size_but_another_shape_is_refused():
  opt = hoptax.adam(1e-2)
  params = {"w": np.ones((2, 3), np.float32)}
  state = opt.init(params)
  state = (state[0]._replace(mu={"w": np.zeros((3, 2), np.float32)}),) + tuple(state[1:])
  with pytest.raises(ValueError, match=r"mu\[0\] has shape \(3, 2\): expected \(2, 3\)"):
    opt.update({"w": np.ones((2, 3), np.float32)}, state, params)


def test_core_leaf_call_checks_every_array():
  g = np.ones(8, np.float32)
  ok = lambda n: np.zeros(n, np.float32)
  cfg = [_core.AdamConfig(lr=1e-2, weight_decay=0.0)]
  with pytest.raises(ValueError, match=r"out\[0\] has 4 elements"):
    _core.optax_update_leaves([None], [ok(8)], [ok(8)], [g], "f32", [ok(4)], cfg, [0], 1)
  with pytest.raises(TypeError, match="int32 does not hold f32"):
    _core.optax_update_leaves([None], [np.zeros(8, np.int32)], [ok(8)], [g], "f32", [ok(8)], cfg, [0], 1)
  with pytest.raises(ValueError, match="config = 3"):
    _core.optax_update_leaves([None], [ok(8)], [ok(8)], [g], "f32", [ok(8)], cfg, [3], 1)
