"""hostopt.optax side by side with real optax (jax CPU)."""
import re

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


# --- under jax.jit: the XLA FFI call (no Python callback), optax's full contract ---------

def _leaves_equal(a, b):
  la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
  return len(la) == len(lb) and all(np.asarray(x).dtype == np.asarray(y).dtype and
                                    np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


@pytest.mark.parametrize("name,kwargs", CASES)
def test_eager_jit_and_numpy_give_the_same_bits(name, kwargs):
  params, grad_fn = quadratic_problem()
  opt = getattr(hoptax, name)(**kwargs)
  step = jax.jit(opt.update)
  s_e = s_j = opt.init(params)
  np_params = jax.tree_util.tree_map(np.asarray, params)
  s_n = opt.init(np_params)
  for _ in range(3):
    g = grad_fn(params)
    u_e, s_e = opt.update(g, s_e, params)
    u_j, s_j = step(g, s_j, params)
    u_n, s_n = opt.update(jax.tree_util.tree_map(np.asarray, g), s_n, np_params)
    assert _leaves_equal((u_e, s_e), (u_j, s_j))
    assert _leaves_equal((u_n, s_n), (u_j, s_j))
    params = optax.apply_updates(params, u_j)
    np_params = jax.tree_util.tree_map(np.asarray, params)


def test_jit_has_no_python_callback_and_updates_moments_in_place_when_donated():
  params, grad_fn = mlp_problem()
  opt = hoptax.adamw(1e-2, weight_decay=0.1)
  state = opt.init(params)
  g = grad_fn(params)
  text = jax.jit(opt.update).lower(g, state, params).as_text()
  assert "hostopt_adam_update" in text and "callback" not in text

  def train_step(p, s):  # the usual shape: gradients computed inside, params and state donated
    u, s = opt.update(grad_fn(p), s, p)
    return optax.apply_updates(p, u), s
  hlo = jax.jit(train_step, donate_argnums=(0, 1)).lower(params, state).compile().as_text()
  # No copy of an argument (the state) or of the call's results in the entry computation (the
  # model's own transposes in the backward pass are not ours): mu, nu and the update (over the
  # gradient) are aliased through the call.
  def copies_of_arguments_or_results(hlo):
    entry = hlo[hlo.index("ENTRY"):]
    entry = entry[:entry.index("\n}")]
    args = set(re.findall(r"%([\w.\-]+) = [^ ]+ parameter\(", entry))
    found = []
    for line in entry.splitlines():
      m = re.search(r" copy\((?:[^%)]*)%([\w.\-]+)", line)
      if m and "s32[]" not in line and (m.group(1) in args or m.group(1).startswith("get-tuple-element")):
        found.append(line.strip())
    return found
  assert not copies_of_arguments_or_results(hlo)
  kept = jax.jit(train_step).lower(params, state).compile().as_text()
  assert copies_of_arguments_or_results(kept)  # undonated: XLA copies the state

  def apply_step(p, s, grads):  # gradients as an argument: the update gets its own buffer, no copy
    u, s = opt.update(grads, s, p)
    return optax.apply_updates(p, u), s
  hlo = jax.jit(apply_step, donate_argnums=(0, 1)).lower(params, state, g).compile().as_text()
  assert not copies_of_arguments_or_results(hlo)
  leaves = len(jax.tree_util.tree_leaves(params))
  aliases = lambda f, *a: jax.jit(f).lower(*a).as_text().count("output_operand_alias<")
  assert aliases(train_step, params, state) == 3 * leaves  # u over the (computed) gradient, mu, nu
  assert aliases(apply_step, params, state, g) == 2 * leaves  # mu and nu only
  q, r = jax.jit(train_step)(params, opt.init(params))
  fresh = jax.tree_util.tree_map(jnp.copy, params)
  p, s = jax.jit(train_step, donate_argnums=(0, 1))(fresh, opt.init(fresh))  # runs: the same as undonated
  assert _leaves_equal((p, s), (q, r))


def test_traced_hyperparameters_and_threads_under_inject_hyperparams():
  params, grad_fn = mlp_problem()
  opt = optax.inject_hyperparams(hoptax.adamw)(learning_rate=1e-2, b1=0.8, weight_decay=0.1, threads=2)
  ref = optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2, b1=0.8, weight_decay=0.1)
  s, r = opt.init(params), ref.init(params)
  assert set(s.hyperparams) == set(r.hyperparams)  # threads is not a hyper-parameter
  step = jax.jit(opt.update)
  p, q = params, params
  for _ in range(20):
    u, s = step(grad_fn(p), s, p)
    v, r = ref.update(grad_fn(q), r, q)
    p, q = optax.apply_updates(p, u), optax.apply_updates(q, v)
  assert_trees_close(p, q)
  u_eager, _ = opt.update(grad_fn(p), s, p)
  u_jit, _ = step(grad_fn(p), s, p)
  assert _leaves_equal(u_eager, u_jit)


def test_weight_decay_schedule_where_optax_accepts_one():
  import inspect
  if "Callable" not in str(inspect.signature(optax.adamw).parameters["weight_decay"].annotation):
    pytest.skip(f"optax {optax.__version__} takes no weight_decay schedule")
  params, grad_fn = mlp_problem()
  wd = optax.linear_schedule(0.2, 0.0, 30)
  got = run(hoptax.adamw(1e-2, weight_decay=wd), params, grad_fn, steps=30)
  want = run(optax.adamw(1e-2, weight_decay=wd), params, grad_fn, steps=30)
  assert jax.tree_util.tree_structure(got[1]) == jax.tree_util.tree_structure(want[1])
  assert_trees_close(got[0], want[0])


def test_masks_are_read_as_optax_reads_them():
  params, grad_fn = mlp_problem()
  seen = []

  def mask(tree):
    seen.append(tree)
    return jax.tree_util.tree_map(lambda x: x.ndim > 1, tree)

  g = grad_fn(params)
  opt = hoptax.adamw(1e-2, weight_decay=0.5, mask=mask)
  opt.update(g, opt.init(params), params)
  assert seen and all(_leaves_equal(t, g) for t in seen[-1:])  # optax.masked calls the mask with the updates
  prefix = {"l1": False, "l2": True}  # a prefix of the params' tree
  got = run(hoptax.adamw(1e-2, weight_decay=0.5, mask=prefix), params, grad_fn, steps=10)
  want = run(optax.adamw(1e-2, weight_decay=0.5, mask=prefix), params, grad_fn, steps=10)
  assert_trees_close(got[0], want[0])


@pytest.fixture
def x64():
  jax.config.update("jax_enable_x64", True)
  yield
  jax.config.update("jax_enable_x64", False)


@pytest.mark.parametrize("dtype", ["float64", "complex64"])
def test_float64_and_complex_leaves_get_optax_results_and_dtypes(dtype, x64):
  rng = np.random.default_rng(3)
  real = rng.standard_normal((6, 5))
  x = real + 1j * rng.standard_normal((6, 5)) if dtype.startswith("complex") else real
  params = {"z": jnp.asarray(x, dtype), "w": jnp.asarray(real, jnp.float32)}
  grads = jax.tree_util.tree_map(lambda p: 0.1 * p + 0.01, params)
  for name in ("adam", "adamw"):
    ours, ref = getattr(hoptax, name)(1e-2), getattr(optax, name)(1e-2)
    for update in (ours.update, jax.jit(ours.update)):
      u, s = update(grads, ours.init(params), params)
      v, r = ref.update(grads, ref.init(params), params)
      assert jax.tree_util.tree_map(lambda a: a.dtype, (u, s)) == jax.tree_util.tree_map(lambda a: a.dtype, (v, r))
      rtol = 1e-12 if dtype == "float64" else 1e-6  # optax's own arithmetic (complex64: single precision)
      np.testing.assert_allclose(np.asarray(u["z"]), np.asarray(v["z"]), rtol=rtol)
      assert_trees_close(u, v, rtol=1e-6, atol=1e-9)


def test_vmap_over_a_batch_of_states():
  params, grad_fn = mlp_problem()
  opt = hoptax.adam(1e-2)
  g = grad_fn(params)
  batch = lambda t: jax.tree_util.tree_map(lambda x: jnp.stack([x, 2 * x, -x]), t)
  state = opt.init(params)
  vm = jax.vmap(opt.update, in_axes=(0, None, None))(batch(g), state, params)
  for k, scale in enumerate((1.0, 2.0, -1.0)):
    one = opt.update(jax.tree_util.tree_map(lambda x: scale * x, g), state, params)
    assert _leaves_equal(jax.tree_util.tree_map(lambda x: x[k], vm[0]), one[0])
  # A batched count (a batch of states at different steps) runs one call per element.
  states = jax.vmap(opt.init)(batch(params))
  states = states._replace(**{}) if hasattr(states, "_replace") else states
  out = jax.jit(jax.vmap(opt.update))(batch(g), states, batch(params))
  assert jax.tree_util.tree_structure(out[1]) == jax.tree_util.tree_structure(states)


def test_grad_through_update_raises_saying_why():
  params, grad_fn = mlp_problem()
  opt = hoptax.adam(1e-2)
  state = opt.init(params)

  def meta(lr_scale):
    g = jax.tree_util.tree_map(lambda x: lr_scale * x, grad_fn(params))
    u, _ = opt.update(g, state, params)
    return sum(jnp.sum(x) for x in jax.tree_util.tree_leaves(u))
  with pytest.raises(TypeError, match="not differentiable"):
    jax.grad(meta)(1.0)


def test_hostopt_options_are_checked():
  with pytest.raises(TypeError, match="hostopt's own options"):
    hoptax.adam(1e-3, thread=2)
  with pytest.raises(ValueError, match="threads"):
    hoptax.adam(1e-3, threads=-1)


def test_state_memory_pinned_host_keeps_the_moments_there_and_gives_the_same_bits():
  device = jax.devices()[0]
  if not hasattr(jax, "memory") or "pinned_host" not in {m.kind for m in device.addressable_memories()}:
    pytest.skip(f"jax {jax.__version__} on {device.platform} has no pinned_host memory")
  params, grad_fn = mlp_problem()
  placed = hoptax.adamw(1e-2, weight_decay=0.1, state_memory="pinned_host")
  plain = hoptax.adamw(1e-2, weight_decay=0.1)
  s_a, s_b = placed.init(params), plain.init(params)
  kinds = lambda t: set(jax.tree_util.tree_leaves(jax.tree_util.tree_map(lambda x: x.sharding.memory_kind, t)))
  assert kinds((s_a[0].mu, s_a[0].nu)) == {"pinned_host"}
  step_a, step_b = jax.jit(placed.update), jax.jit(plain.update)
  p = params
  for _ in range(3):
    g = grad_fn(p)
    u_a, s_a = step_a(g, s_a, p)
    u_b, s_b = step_b(g, s_b, p)
    p = optax.apply_updates(p, u_b)
  assert kinds((s_a[0].mu, s_a[0].nu)) == {"pinned_host"}  # the moments never left host memory
  assert kinds(u_a) == {device.default_memory().kind}  # the updates come back to the params' memory
  assert _leaves_equal((u_a, s_a), (u_b, s_b))
  with pytest.raises(ValueError, match="state_memory"):
    hoptax.adamw(1e-2, state_memory="hbm")
  # A state in device memory (the plain transformation's) is refused by name, not run.
  for update in (placed.update, jax.jit(placed.update)):  # eager, and traced (the aval's memory space)
    with pytest.raises(ValueError, match=r"state_memory='pinned_host': mu\[0\] is in 'device' memory"):
      update(grad_fn(p), plain.init(p), p)
  # So is a numpy state beside jax gradients (it would go to device memory).
  with pytest.raises(ValueError, match=r"state_memory='pinned_host': mu\[0\] is a numpy array"):
    placed.update(grad_fn(p), jax.tree_util.tree_map(np.asarray, s_a), p)
  # Leaves the kernel does not take (bf16 mu by mu_dtype) stay where optax's arithmetic runs on
  # them: placing their f32 nu alone mixed memories in one add.
  mixed, ref = (hoptax.adamw(1e-2, mu_dtype=jnp.bfloat16, **kw) for kw in ({"state_memory": "pinned_host"}, {}))
  g = grad_fn(params)
  assert _leaves_equal(mixed.update(g, mixed.init(params), params), ref.update(g, ref.init(params), params))


SHARDING_SCRIPT = r"""
import jax, jax.numpy as jnp, numpy as np, optax
import hostopt.optax as hoptax
mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
sharding = jax.sharding.NamedSharding(mesh, jax.P(None, "x"))
types = lambda t: jax.tree_util.tree_map(jax.typeof, t)
with jax.sharding.use_mesh(mesh) if hasattr(jax.sharding, "use_mesh") else jax.set_mesh(mesh):
  params = jax.device_put(jnp.arange(2 * 16 * 4, dtype=jnp.float32).reshape(2, 16, 4) / 100, sharding)
  for name in ("adam", "adamw", "nadamw"):
    ours, ref = getattr(hoptax, name)(1e-2), getattr(optax, name)(1e-2)
    s0, r0 = ours.init(params), ref.init(params)
    assert types(s0) == types(r0), name
    eager = ours.update(params, s0, params)
    jitted = jax.jit(ours.update)(params, s0, params)
    expect = ref.update(params, r0, params)
    assert types(eager) == types(jitted) == types(expect), (name, types(jitted), types(expect))
    for a, b in zip(jax.tree_util.tree_leaves(eager), jax.tree_util.tree_leaves(jitted)):
      assert np.array_equal(np.asarray(a), np.asarray(b)), name
    unsharded = ours.update(*(jax.device_get(x) for x in (params, s0, params)))
    for a, b in zip(jax.tree_util.tree_leaves(jitted), jax.tree_util.tree_leaves(unsharded)):
      assert np.array_equal(np.asarray(a), np.asarray(b)), name
# Auto (GSPMD/Shardy-propagated) sharding under jit: each device updates its own shard.
auto = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
placed = jax.device_put(jnp.arange(64 * 4, dtype=jnp.float32).reshape(64, 4) / 100,
                        jax.sharding.NamedSharding(auto, jax.P("x")))
opt = hoptax.adamw(1e-2)
state = opt.init(placed)
step = jax.jit(opt.update)
hlo = step.lower(placed, state, placed).compile().as_text()
assert "all-gather" not in hlo and "f32[8,4]" in hlo, [l for l in hlo.splitlines() if "custom-call(" in l]
u, new = step(placed, state, placed)
assert u.sharding.spec == jax.P("x") and new[0].mu.sharding.spec == jax.P("x")
ref = opt.update(*(jax.device_get(x) for x in (placed, state, placed)))
for a, b in zip(jax.tree_util.tree_leaves((u, new)), jax.tree_util.tree_leaves(ref)):
  assert np.array_equal(np.asarray(a), np.asarray(b))
# vmap of the jitted update still works with several devices (one call over the batch).
batch = jnp.stack([jnp.ones((6,)), 2 * jnp.ones((6,))])
states = jax.vmap(opt.init)(batch)
vu, _ = jax.vmap(jax.jit(opt.update))(batch, states, batch)
one, _ = opt.update(batch[1], jax.tree_util.tree_map(lambda x: x[1], states), batch[1])
assert np.array_equal(np.asarray(vu[1]), np.asarray(one))
print("ok")
"""


def test_sharded_inputs_keep_their_shardings_and_values_and_run_per_shard():
  import os
  import subprocess
  import sys
  if not hasattr(jax.sharding, "AxisType") or not hasattr(jax, "make_mesh"):
    pytest.skip(f"jax {jax.__version__} has no explicit sharding")
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)
  run = subprocess.run([sys.executable, "-c", SHARDING_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
  assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


# Out of hostopt.optax's range: optax computes garbage or NaN with these without a word.
BAD_HYPERPARAMETERS = [("b1", 1.5), ("b2", 1.0), ("b1", -0.5), ("eps", -1.0), ("learning_rate", np.nan),
                       ("b2", np.nan), ("eps_root", -1.0), ("weight_decay", np.inf)]


def _hyperparameter_routes(opt, name, value, params, g):
  """(route, update, grads, state, params) for the numpy, eager and jitted routes, with
  hyperparams[name] = value injected as inject_hyperparams keeps it (a jax scalar)."""
  np_params, np_g = (jax.tree_util.tree_map(np.asarray, t) for t in (params, g))
  for route, p, gg, update in (("numpy", np_params, np_g, opt.update), ("eager", params, g, opt.update),
                               ("jit", params, g, jax.jit(opt.update))):
    state = opt.init(p)
    state.hyperparams[name] = jnp.asarray(value, state.hyperparams[name].dtype)
    yield route, update, gg, state, p


@pytest.mark.parametrize("moments", ["f32", "bf16", "8bit"])
def test_out_of_range_hyperparameters_are_refused_naming_them_on_every_route(moments):
  params, grad_fn = mlp_problem()
  g = grad_fn(params)
  for name, value in BAD_HYPERPARAMETERS:
    # optax side by side: its arithmetic takes the value and gives non-finite or garbage updates.
    ref = optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2, weight_decay=0.1)
    rstate = ref.init(params)
    rstate.hyperparams[name] = jnp.asarray(value)
    v, _ = ref.update(g, rstate, params)
    assert all(x.shape == y.shape for x, y in zip(jax.tree_util.tree_leaves(v), jax.tree_util.tree_leaves(g)))
    # hostopt.optax refuses it on every route, naming it; nothing changes.
    opt = optax.inject_hyperparams(hoptax.adamw)(learning_rate=1e-2, weight_decay=0.1, moments=moments)
    for route, update, gg, state, p in _hyperparameter_routes(opt, name, value, params, g):
      before = jax.tree_util.tree_map(np.array, state)
      # Under jit the value is traced: the XLA FFI handler refuses it when the call runs (jax raises
      # its runtime error, a RuntimeError or a ValueError by jax version and call path).
      with pytest.raises((RuntimeError, ValueError) if route == "jit" else ValueError,
                         match=rf"\b{name} = {re.escape(str(float(value)))}: expected"):
        jax.block_until_ready(update(gg, state, p))  # the error of a jitted call may come when it is read
      assert all(np.array_equal(x, y, equal_nan=True) for x, y in zip(jax.tree_util.tree_leaves(before),
                                                                       jax.tree_util.tree_leaves(state))), route
  # Given as numbers, they are refused when the transformation is made.
  for name, value in BAD_HYPERPARAMETERS:
    with pytest.raises(ValueError, match=rf"\b{name} = {re.escape(str(float(value)))}: expected"):
      hoptax.adamw(**{"learning_rate": 1e-2, name: value}, moments=moments)


@pytest.mark.parametrize("name", ["eps", "eps_root"])
def test_infinite_eps_gives_the_update_optax_gives_on_every_route(name):
  # eps or eps_root = +inf: Adam's term is 0 and the update is the decay term alone, in optax
  # as in hostopt (which gave NaN: its kernel's range stopped at finite values).
  params, grad_fn = mlp_problem()
  g = grad_fn(params)
  ref = optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2, weight_decay=0.1)
  rstate = ref.init(params)
  rstate.hyperparams[name] = jnp.asarray(np.inf)
  v, rnew = ref.update(g, rstate, params)
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree_util.tree_leaves(v))
  results = []
  for moments in ("f32", "bf16", "8bit"):
    opt = optax.inject_hyperparams(hoptax.adamw)(learning_rate=1e-2, weight_decay=0.1, moments=moments)
    for route, update, gg, state, p in _hyperparameter_routes(opt, name, np.inf, params, g):
      u, new = update(gg, state, p)
      # optax's -lr * (wd * p) against hostopt's -(lr * wd) * p: one rounding apart at most.
      jax.tree_util.tree_map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=3e-7, atol=0),
                             u, v)
      results.append(u)
      if moments == "f32":  # the moments step as optax's do
        assert_trees_close(new.inner_state[0].mu, rnew.inner_state[0].mu, rtol=1e-6, atol=0)
        assert_trees_close(new.inner_state[0].nu, rnew.inner_state[0].nu, rtol=1e-6, atol=0)
  # Every route and moment format gives the same bits (Adam's term is exactly 0 for all).
  assert all(_leaves_equal(results[0], r) for r in results[1:])
  # A number eps = inf is taken when the transformation is made, with optax's update too.
  opt = hoptax.adamw(1e-2, weight_decay=0.1, **{name: np.inf})
  u, _ = jax.jit(opt.update)(g, opt.init(params), params)
  jax.tree_util.tree_map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=3e-7, atol=0), u, v)


def test_update_runs_under_disable_jit():
  params, grad_fn = mlp_problem()
  opt = hoptax.adamw(1e-2)
  state = opt.init(params)
  g = grad_fn(params)
  with jax.disable_jit():
    u, _ = opt.update(g, state, params)
  v, _ = jax.jit(opt.update)(g, state, params)
  assert _leaves_equal(u, v)


def _run_doctests(obj, name: str) -> int:
  """Runs obj's docstring examples; returns how many ran (each must pass)."""
  import doctest
  runner = doctest.DocTestRunner()
  for t in doctest.DocTestFinder().find(obj, name, globs={}):
    runner.run(t)
  assert runner.failures == 0
  return runner.tries


@pytest.mark.parametrize("name", ["adam", "adamw", "nadam", "nadamw", "adamw_8bit"])
def test_each_factory_shows_optax_signature_and_documents_every_argument_and_option(name):
  import inspect
  import pydoc
  factory = getattr(hoptax, name)
  ours = inspect.signature(factory)
  theirs = inspect.signature(getattr(optax, "adamw" if name == "adamw_8bit" else name))
  # optax's parameters, as the installed optax has them, then hostopt's options apart.
  assert [(p.name, p.kind, p.default) for p in list(ours.parameters.values())[:-1]] == [
      (p.name, p.kind, p.default) for p in theirs.parameters.values() if p.kind is not p.VAR_KEYWORD]
  last = list(ours.parameters.values())[-1]
  assert last.kind is last.VAR_KEYWORD and last.name == "hostopt_options"
  text = pydoc.render_doc(factory, renderer=pydoc.plaintext)
  assert ".. math::" in text and "Example:" in text
  args = text.split("Args:")[1].split("Returns:")[0]
  documented = [p for p in list(ours.parameters)[:-1] + list(hoptax.HostoptOptions.__annotations__)
                if not re.search(rf"^\s+{p}( \(|:)", args, re.M)]
  assert documented == []
  assert _run_doctests(factory, name) > 0


@pytest.mark.parametrize("value", ["no", 1, 0, None, 1.0])
def test_reuse_state_is_a_bool_never_a_truthy_value(value):
  # bool("no") is True: a string (or an int) taken for a bool would consume the caller's state.
  with pytest.raises(TypeError, match="reuse_state"):
    hoptax.adamw(1e-3, reuse_state=value)
