"""hostopt.jax: the optimizer state in a hostopt arena, gradients in from JAX, params out."""
import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402

import hostopt.jax as hj  # noqa: E402

jax.config.update("jax_platform_name", "cpu")


def mlp(seed=1):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((64, 8)).astype(np.float32))
  y = jnp.asarray(rng.standard_normal((64, 1)).astype(np.float32))
  params = {"l1": {"w": jnp.asarray(0.3 * rng.standard_normal((8, 16)).astype(np.float32)), "b": jnp.zeros(16)},
            "l2": {"w": jnp.asarray(0.3 * rng.standard_normal((16, 1)).astype(np.float32)), "b": jnp.zeros(1)}}

  def loss(p):
    h = jnp.tanh(x @ p["l1"]["w"].astype(jnp.float32) + p["l1"]["b"].astype(jnp.float32))
    return jnp.mean((h @ p["l2"]["w"].astype(jnp.float32) + p["l2"]["b"].astype(jnp.float32) - y) ** 2)
  return params, loss, jax.jit(jax.grad(loss))


SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 10, 100)


def leaves(t):
  return [np.asarray(x) for x in jax.tree_util.tree_leaves(t)]


def test_100_steps_agree_with_optax_adamw_with_schedule_and_mask():
  params, loss, grad = mlp()
  mask = jax.tree_util.tree_map(lambda a: a.ndim > 1, params)
  opt = hj.adamw(params, SCHEDULE, weight_decay=0.1, mask=mask)
  ref = optax.adamw(SCHEDULE, weight_decay=0.1, mask=mask)
  state = ref.init(params)
  p = q = params
  for _ in range(100):
    p = opt.step(grad(p))
    u, state = ref.update(grad(q), state, q)
    q = optax.apply_updates(q, u)
  assert jax.tree_util.tree_structure(p) == jax.tree_util.tree_structure(params)
  for a, b in zip(leaves(p), leaves(q)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)  # optax rounds p + u separately: float noise
  assert float(loss(p)) < 0.6 * float(loss(params))
  assert opt.step_count == 100 and opt.last_step.applied
  view = opt.optax_state()
  for a, b in zip(leaves(view.mu), leaves(state[0].mu)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  with pytest.raises(ValueError):
    jax.tree_util.tree_leaves(view.mu)[0][...] = 0  # read-only views


def test_bf16_params_keep_float32_masters():
  params, loss, grad = mlp()
  p16 = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), params)
  opt = hj.adamw(p16, 1e-2, param_dtype=jnp.bfloat16)
  p = p16
  for _ in range(5):
    p = opt.step(grad(p))
  masters = opt.params()
  for got, master in zip(jax.tree_util.tree_leaves(p), jax.tree_util.tree_leaves(masters)):
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(jnp.asarray(master).astype(jnp.bfloat16),
                                                                          np.float32))
  # The masters moved by less than bf16 can show: casting optax's result would lose that.
  assert any(not np.array_equal(np.asarray(m), np.asarray(jnp.asarray(m).astype(jnp.bfloat16), np.float32))
             for m in jax.tree_util.tree_leaves(masters))


def test_params_handed_out_never_change_whatever_still_reads_them():
  params, _, grad = mlp()
  opt = hj.adam(params, 1e-2)
  p1 = opt.step(grad(params))
  leaf = jax.tree_util.tree_leaves(p1)[0]
  keep = np.array(leaf)
  snapshot = jax.device_get(p1)  # a numpy view on CPU: the usual checkpoint snapshot
  pending = jax.jit(lambda x: jnp.sum(jnp.tanh(x[None] * jnp.arange(1, 200.0)[:, None, None])))(leaf)  # in flight
  expect = float(jnp.sum(jnp.tanh(jnp.asarray(keep)[None] * jnp.arange(1, 200.0)[:, None, None])))
  p = p1
  for _ in range(4):  # buffers are reused only once nothing references them
    p = opt.step(grad(p))
  np.testing.assert_array_equal(np.asarray(leaf), keep)
  np.testing.assert_array_equal(jax.tree_util.tree_leaves(snapshot)[0], keep)
  np.testing.assert_allclose(float(pending), expect, rtol=1e-6)
  assert not leaf.is_deleted()
  current = opt.current_params()  # a copy: the next step leaves it alone
  before = np.array(jax.tree_util.tree_leaves(current)[0])
  opt.step(grad(p))
  np.testing.assert_array_equal(np.asarray(jax.tree_util.tree_leaves(current)[0]), before)


def test_a_loop_that_drops_old_params_reuses_two_buffer_sets():
  params, _, grad = mlp()
  opt = hj.adam(params, 1e-2)
  # One fixed gradient, computed and finished before the loop: no work in flight holds the
  # params a step hands out, and each old set is deleted explicitly (delete() releases its
  # buffers now), so what the pool sees never depends on when JAX gets to free them.
  g = jax.block_until_ready(grad(params))
  p, seen = None, []
  for _ in range(6):
    old, p = p, opt.step(g)
    if old is not None:
      for x in jax.tree_util.tree_leaves(old):
        x.delete()
    del old
    seen.append(jax.tree_util.tree_leaves(p)[0].unsafe_buffer_pointer())
  assert len(set(seen)) == 2 and seen[0::2] == [seen[0]] * 3, seen  # two sets, in turn
  # Params still held keep their buffers: a step never writes an array it handed out.
  kept = opt.step(g)
  before = [np.array(x, copy=True) for x in jax.tree_util.tree_leaves(kept)]  # copies, not views
  opt.step(g)
  opt.step(g)
  for x, y in zip(before, leaves(kept)):
    np.testing.assert_array_equal(x, y)


def test_accumulated_micro_batches_average_like_multisteps():
  params, _, grad = mlp()
  g1 = grad(params)
  g2 = jax.tree_util.tree_map(lambda a: -0.5 * a + 0.01, g1)
  a = hj.adamw(params, 1e-2, weight_decay=0.1)
  b = hj.adamw(params, 1e-2, weight_decay=0.1)
  a.accumulate(g1)
  pa = a.step(g2)
  pb = b.step(jax.tree_util.tree_map(lambda x, y: (x + y) * 0.5, g1, g2))
  for x, y in zip(leaves(pa), leaves(pb)):
    np.testing.assert_array_equal(x, y)
  with pytest.raises(ValueError, match="nothing accumulated"):
    a.step()


def test_nonfinite_gradients_skip_the_step_and_clipping_follows_optax():
  params, _, grad = mlp()
  opt = hj.adamw(params, 1e-2, skip_nonfinite=True, max_grad_norm=0.5)
  bad = jax.tree_util.tree_map(lambda a: a.at[(0,) * a.ndim].set(jnp.nan), grad(params))
  before = leaves(opt.params())
  p = opt.step(bad)
  assert not opt.last_step.applied and opt.last_step.skipped_steps == 1 and opt.step_count == 0
  for x, y in zip(before, leaves(opt.params())):
    np.testing.assert_array_equal(x, y)
  for x, y in zip(leaves(p), before):
    np.testing.assert_array_equal(x, y)
  ref = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2))
  state = ref.init(params)
  q = params
  for _ in range(20):
    p = opt.step(grad(p))
    u, state = ref.update(grad(q), state, q)
    q = optax.apply_updates(q, u)
  for x, y in zip(leaves(p), leaves(q)):
    np.testing.assert_allclose(x, y, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("offload", [None, "host"])
def test_a_nonfinite_norm_with_clipping_skips_the_step_given_or_computed(offload):
  # max_grad_norm without skip_nonfinite: a NaN or inf norm has no clip factor, so the step
  # is skipped and counted, whether the norm was computed (a NaN gradient) or given.
  params = {"w": jnp.ones((4, 3), jnp.float32)}
  kw = {} if offload is None else {"offload": offload}
  opt = hj.adamw(params, 1e-2, max_grad_norm=1.0, skip_nonfinite=False, **kw)
  before = leaves(opt.params())
  big = {"w": jnp.full((4, 3), 1000.0, jnp.float32)}
  steps = [(big["w"].at[0, 0].set(jnp.nan), None), (big["w"], float("inf")), (big["w"], float("nan")),
           (big["w"], np.float32("inf"))]
  for k, (g, norm) in enumerate(steps, 1):
    p = opt.step({"w": g}, grad_norm=norm)
    assert not opt.last_step.applied and opt.last_step.skipped_steps == k and opt.step_count == 0
    for x, y in zip(leaves(p), before):
      np.testing.assert_array_equal(x, y)
    for x, y in zip(leaves(opt.params()), before):
      np.testing.assert_array_equal(x, y)
  opt.step(big, grad_norm=float(np.sqrt(12) * 1000.0))
  assert opt.last_step.applied and opt.step_count == 1


def test_state_dict_and_checkpoint_resume_bit_exact(tmp_path):
  params, _, grad = mlp()
  opt = hj.adamw(params, SCHEDULE, weight_decay=0.1)
  p = params
  for _ in range(7):
    p = opt.step(grad(p))
  sd = opt.state_dict()
  opt.save(tmp_path / "ckpt.safetensors")
  p = jax.tree_util.tree_map(jnp.copy, p)  # kept past the next two steps: a copy (their buffers are reused)
  cont = [p]
  for _ in range(3):
    cont.append(jax.tree_util.tree_map(jnp.copy, opt.step(grad(cont[-1]))))
  for restore in ("state_dict", "checkpoint"):
    other = hj.adamw(params, SCHEDULE, weight_decay=0.1)
    if restore == "state_dict":
      other.load_state_dict(sd)
    else:
      other.load(str(tmp_path / "ckpt.safetensors"))
    q = p
    for k in range(3):
      q = other.step(grad(q))
      for x, y in zip(leaves(q), leaves(cont[k + 1])):
        np.testing.assert_array_equal(x, y)
  with pytest.raises(ValueError, match="shape"):
    bad = dict(sd, mu={**sd["mu"], "['l1']['w']": np.zeros((3, 3), np.float32)})
    hj.adamw(params, 1e-2).load_state_dict(bad)


def test_step_async_matches_step():
  params, _, grad = mlp()
  a, b = hj.adamw(params, 1e-2), hj.adamw(params, 1e-2)
  pa = pb = params
  for _ in range(3):
    fut = a.step_async(grad(pa))
    pb = b.step(grad(pb))
    pa = fut.result()
    for x, y in zip(leaves(pa), leaves(pb)):
      np.testing.assert_array_equal(x, y)


def test_bad_input_is_refused_naming_the_leaf():
  params, _, grad = mlp()
  opt = hj.adamw(params, 1e-2)
  g = grad(params)
  with pytest.raises(ValueError, match=r"\['l1'\]\['w'\]"):
    opt.step({**g, "l1": {**g["l1"], "w": jnp.zeros((3, 3))}})
  with pytest.raises(TypeError, match="int32"):
    hj.adamw({"a": jnp.zeros(3, jnp.int32)}, 1e-2)
  with pytest.raises(ValueError, match="empty"):
    hj.adamw({}, 1e-2)
  assert opt.step_count == 0


def test_failed_calls_change_nothing_and_accumulate_keeps_order_with_async_steps():
  params, _, grad = mlp()
  g = grad(params)
  opt = hj.adamw(params, 1e-2)
  with pytest.raises(TypeError, match="int32"):
    opt.accumulate(jax.tree_util.tree_map(lambda x: x.astype(jnp.int32), g))
  with pytest.raises(ValueError, match="nothing accumulated"):
    opt.step()  # the failed accumulate left no accumulator behind
  opt.accumulate(g)
  with pytest.raises(ValueError, match="grad_norm"):
    opt.step(g, grad_norm=-1.0)
  p = opt.step(g)  # the failed step did not add g a second time: the mean of two micro-batches of g
  ref = hj.adamw(params, 1e-2).step(g)
  for x, y in zip(leaves(p), leaves(ref)):
    np.testing.assert_array_equal(x, y)
  sd = opt.state_dict()
  changed = {key: {n: v + 1 for n, v in sd[key].items()} for key in ("params", "mu")}
  for bad in ({**changed, "nu": sd["nu"]},  # no step
              dict(sd, **changed, nu={**sd["nu"], "['l1']['w']": -np.ones((8, 16), np.float32)})):
    with pytest.raises(ValueError):
      opt.load_state_dict(bad)
  after = opt.state_dict()  # nothing was half-loaded
  for key in ("params", "mu", "nu"):
    for n in sd[key]:
      np.testing.assert_array_equal(after[key][n], sd[key][n])
  # accumulate waits for the asynchronous steps queued before it.
  a, b = hj.adamw(params, 1e-2), hj.adamw(params, 1e-2)
  f0, f1 = a.step_async(g), a.step_async(g)
  a.accumulate(jax.tree_util.tree_map(lambda x: 2 * x, g))
  pa = a.step(g)
  b.step(g), b.step(g)
  b.accumulate(jax.tree_util.tree_map(lambda x: 2 * x, g))
  pb = b.step(g)
  f0.result(), f1.result()
  for x, y in zip(leaves(pa), leaves(pb)):
    np.testing.assert_array_equal(x, y)
  a.close()
  with pytest.raises(TypeError, match="float64"):
    opt.step(jax.tree_util.tree_map(lambda x: np.asarray(x, np.float64), g))


def _norm(tree):
  return float(jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree_util.tree_leaves(tree))))


def _bits(x):
  a = np.asarray(x)
  return a.view(np.uint16) if a.dtype.itemsize == 2 else a.view(np.uint32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_offloaded_parameters_through_the_pipeline_match_the_in_place_step(dtype):
  # CPU arrays stand in for device arrays through the host engine (offload="host"): the
  # code path of parameters on a GPU — gradients gathered into one flat device buffer,
  # streamed to the host chunk by chunk (16 chunks here), new params streamed back and
  # split on the device. Bit for bit the in-place step, with leaves without gradient,
  # accumulation, a schedule, a mask, and clipping by a norm the caller computed.
  params, loss, grad = mlp()
  params = jax.tree_util.tree_map(lambda a: a.astype(dtype), params)
  mask = jax.tree_util.tree_map(lambda a: a.ndim > 1, params)
  kw = dict(weight_decay=0.1, mask=mask, max_grad_norm=0.5)
  a = hj.adamw(params, SCHEDULE, offload="host", offload_chunk=16, **kw)
  b = hj.adamw(params, SCHEDULE, **kw)
  assert a._device_step.pipe.num_chunks >= 10
  p = q = params
  for step in range(12):
    g = jax.tree_util.tree_map(lambda x: x.astype(dtype), grad(p))
    norm = _norm(g)
    if step == 3:
      g["l1"]["b"] = None  # left alone, as torch leaves a parameter without .grad
    if step in (5, 6):
      a.accumulate(g)
      b.accumulate(g)
      continue
    p, q = a.step(g, grad_norm=norm), b.step(g, grad_norm=norm)
    for x, y in zip(jax.tree_util.tree_leaves(p), jax.tree_util.tree_leaves(q)):
      assert x.dtype == y.dtype == dtype
      assert np.array_equal(_bits(x), _bits(y)), step
  for x, y in zip(leaves(a.params()), leaves(b.params())):
    assert np.array_equal(_bits(x), _bits(y))
  assert a.step_count == b.step_count == 10


def test_offloaded_step_checks_on_the_device_and_refuses_what_it_cannot_do():
  params, loss, grad = mlp()
  opt = hj.adamw(params, 1e-2, offload="host", offload_chunk=64, max_grad_norm=1.0, skip_nonfinite=True)
  ref = hj.adamw(params, 1e-2, max_grad_norm=1.0, skip_nonfinite=True)
  g = grad(params)
  p, q = opt.step(g), ref.step(g)  # the norm taken on the device (f32) vs the host's: equal to rounding
  for x, y in zip(leaves(p), leaves(q)):
    np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)
  bad = jax.tree_util.tree_map(lambda x: x.at[0].set(jnp.nan) if x.ndim == 1 else x, g)
  before = leaves(opt.params())
  p2 = opt.step(bad)
  assert not opt.last_step.applied and opt.last_step.skipped_steps == 1
  assert all(np.array_equal(x, y) for x, y in zip(leaves(opt.params()), before))
  assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(leaves(p2), leaves(p)))
  opt.accumulate(g)
  with pytest.raises(ValueError, match="accumulated micro-batches on the offloaded path"):
    opt.step(g)
  opt.step(g, grad_norm=_norm(g))  # the caller's norm: fine
  with pytest.raises(TypeError, match="never converts gradients inexactly"):
    hj.adamw(jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), params), 1e-2, offload="host").step(g)
  for path in (opt, ref):
    with pytest.raises(ValueError, match="a norm is >= 0"):
      path.step(g, grad_norm=-1.0)
  with pytest.raises(ValueError, match="offload='cuda' but the params are on the CPU"):
    hj.adamw(params, 1e-2, offload="cuda")
  with pytest.raises(ValueError, match="offload="):
    hj.adamw(params, 1e-2, offload="gpu")


def test_memory_accounting_names_every_host_buffer():
  params, loss, grad = mlp()
  n = sum(x.size for x in jax.tree_util.tree_leaves(params))
  opt = hj.adamw(params, 1e-2, param_dtype=jnp.bfloat16)
  m = opt.memory()
  assert m["params"] == n and m["copy_out_bytes"] == 0 and m["accumulator_bytes"] == 0
  assert m["state_bytes"] == opt.state_bytes and 12.0 <= m["state_bytes_per_param"] < 12.0 + 4 * 12 * 16 / n
  p = opt.step(grad(params))
  opt.accumulate(grad(params))
  m = opt.memory()
  assert m["copy_out_bytes"] == 2 * n  # one set of bfloat16 buffers
  assert m["accumulator_bytes"] == 4 * n
  assert m["host_bytes"] == m["state_bytes"] + m["copy_out_bytes"] + m["accumulator_bytes"]
  off = hj.adamw(params, 1e-2, offload="host", offload_chunk=32)
  off.step(grad(params))
  m = off.memory()
  arena = off._core.arena_size
  assert m["pinned_bytes"] == 2 * 32 * (4 + 4) and m["device_buffer_bytes"] == arena * 4
  assert m["device_step_bytes"] == arena * 4 and m["accumulator_bytes"] == 0
  assert hj.adamw(params, 1e-2, offload="host").memory()["device_buffer_bytes"] == 0  # nothing before a step
  assert hj.adamw({"e": jnp.zeros((0,))}, 1e-2).memory()["host_bytes_per_param"] == 0.0
  del p


def test_groups_follow_optax_multi_transform(tmp_path):
  # Per-group hyper-parameters (a schedule in one group), labels as optax.multi_transform's.
  params, loss, grad = mlp()
  labels = jax.tree_util.tree_map(lambda a: "matrix" if a.ndim > 1 else "vector", params)
  opt = hj.adamw(params, SCHEDULE, weight_decay=0.1, groups=labels,
                 group_options={"vector": {"learning_rate": 3e-3, "b2": 0.95, "weight_decay": 0.0}})
  ref = optax.multi_transform({"matrix": optax.adamw(SCHEDULE, weight_decay=0.1),
                               "vector": optax.adamw(3e-3, b2=0.95, weight_decay=0.0)}, labels)
  state = ref.init(params)
  p = q = params
  for _ in range(60):
    p = opt.step(grad(p))
    u, state = ref.update(grad(q), state, q)
    q = optax.apply_updates(q, u)
  for x, y in zip(leaves(p), leaves(q)):
    np.testing.assert_allclose(x, y, rtol=2e-5, atol=2e-6)
  assert float(loss(p)) < 0.5 * float(loss(params))
  # A prefix of the params' tree (or a callable giving one), as optax.multi_transform takes.
  prefix = {"l1": "matrix", "l2": "vector"}
  for g in (prefix, lambda p: prefix):
    pre = hj.adamw(params, 1e-2, groups=g, group_options={"vector": {"learning_rate": 0.0}})
    after = pre.step(grad(params))
    assert np.array_equal(np.asarray(after["l2"]["w"]), np.asarray(params["l2"]["w"]))  # lr 0 for l2
    assert not np.array_equal(np.asarray(after["l1"]["w"]), np.asarray(params["l1"]["w"]))
  # load() keeps this optimizer's hyper-parameters (as load_state_dict): only the state comes back.
  path = str(tmp_path / "groups.safetensors")
  opt.save(path)
  other = hj.adamw(params, SCHEDULE, weight_decay=0.1, groups=labels,
                   group_options={"vector": {"learning_rate": 1e-4, "b2": 0.9, "weight_decay": 0.0}})
  other.load(path)
  assert other.step_count == opt.step_count
  configs = [other._core.group_config(g) for g in range(len(other._group_of))]
  assert {round(c["lr"], 12) for c in configs if abs(c["beta2"] - 0.9) < 1e-9} == {1e-4}
  with pytest.raises(ValueError, match="unknown \\['lr'\\]"):
    hj.adamw(params, 1e-2, groups=labels, group_options={"vector": {"lr": 1.0}})
  with pytest.raises(ValueError, match="no parameter has that group label"):
    hj.adamw(params, 1e-2, groups=labels, group_options={"bias": {"learning_rate": 1.0}})
  with pytest.raises(ValueError, match="string label"):
    hj.adamw(params, 1e-2, groups=jax.tree_util.tree_map(lambda a: a.ndim, params))
  with pytest.raises(ValueError, match="use adamw"):
    hj.adam(params, 1e-2, groups=labels, group_options={"vector": {"weight_decay": 0.1}})


@pytest.mark.parametrize("kinds", [(jnp.float16, jnp.bfloat16), (jnp.bfloat16, jnp.float32), (jnp.float32, jnp.bfloat16)])
def test_offloaded_gradients_of_the_params_and_of_param_dtype_widen_exactly(kinds):
  # The first gradients come in the params' dtype, the later ones in param_dtype: the
  # pipeline takes float32 gradients when these differ (every one widens exactly), so the
  # offloaded step stays the in-place step's bits; 16-bit values far from 1 included.
  dtype, param_dtype = kinds
  params = {"w": jnp.asarray([[1.0, -2.0], [0.5, 3.0]], dtype), "b": jnp.asarray([0.25, -0.75], dtype)}
  a = hj.adamw(params, 1e-2, param_dtype=param_dtype, offload="host", offload_chunk=16)
  b = hj.adamw(params, 1e-2, param_dtype=param_dtype)
  p = q = params
  for step in range(4):
    g = jax.tree_util.tree_map(lambda x: (x * 1e3 + 3e-6).astype(x.dtype), p)
    p, q = a.step(g), b.step(g)
    for x, y in zip(leaves(p), leaves(q)):
      assert x.dtype == y.dtype == np.dtype(param_dtype)
      assert np.array_equal(_bits(x), _bits(y)), step
  for x, y in zip(leaves(a.params()), leaves(b.params())):
    assert np.array_equal(x, y)


def test_offloaded_norm_is_taken_without_overflow_and_step_none_uses_the_accumulator():
  # Finite gradients whose squares overflow f32, up to the largest f32: the norm the
  # in-place step takes (float64), so clipping applies and nothing is skipped.
  for value in (1e19, 9e37, 3e38):
    big = {"w": jnp.full((8, 8), value, jnp.float32), "b": jnp.ones((4,))}
    for skip in (False, True):
      a = hj.adamw({"w": jnp.ones((8, 8)), "b": jnp.ones((4,))}, 1e-2, max_grad_norm=1.0, skip_nonfinite=skip,
                   offload="host")
      b = hj.adamw({"w": jnp.ones((8, 8)), "b": jnp.ones((4,))}, 1e-2, max_grad_norm=1.0, skip_nonfinite=skip)
      a.step(big)
      b.step(big)
      assert a.last_step.applied and b.last_step.applied, value
      np.testing.assert_allclose(a.last_step.grad_norm, b.last_step.grad_norm, rtol=1e-6)
      np.testing.assert_allclose(a.optax_state().nu["w"], b.optax_state().nu["w"], rtol=1e-5)
      assert np.all(np.isfinite(a.optax_state().nu["w"]))
  a = hj.adamw({"w": jnp.ones((4,))}, 1e-2, skip_nonfinite=True, offload="host")
  a.step({"w": jnp.asarray([1.0, jnp.inf, 0.0, 2.0])})
  assert not a.last_step.applied and a.last_step.grad_norm == np.inf
  # Accumulated micro-batches, then step(None): the in-place step's bits.
  params, loss, grad = mlp()
  a = hj.adamw(params, 1e-2, offload="host", offload_chunk=32)
  b = hj.adamw(params, 1e-2)
  for opt in (a, b):
    opt.accumulate(grad(params))
    opt.accumulate(jax.tree_util.tree_map(lambda x: 0.5 * x, grad(params)))
  p, q = a.step(), b.step()
  for x, y in zip(leaves(p), leaves(q)):
    assert np.array_equal(x, y)
  assert not hasattr(a._device_step, "_zeros")  # no device buffer kept for it


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_each_factory_documents_every_argument_and_its_example_runs(name):
  import doctest
  import inspect
  import pydoc
  import re
  factory = getattr(hj, name)
  text = pydoc.render_doc(factory, renderer=pydoc.plaintext)
  assert ".. math::" in text and "Example:" in text
  args = text.split("Args:")[1].split("Returns:")[0]
  assert [p for p in inspect.signature(factory).parameters if not re.search(rf"^\s+{p}( \(|:)", args, re.M)] == []
  runner = doctest.DocTestRunner()
  for t in doctest.DocTestFinder().find(factory, name, globs={}):
    runner.run(t)
  assert runner.tries > 0 and runner.failures == 0


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_a_max_grad_norm_no_step_can_use_is_refused_at_construction(bad):
  with pytest.raises(ValueError, match="max_grad_norm"):
    hj.adamw({"w": jnp.ones(4)}, learning_rate=1e-3, max_grad_norm=bad)
