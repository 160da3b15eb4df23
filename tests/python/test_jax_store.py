"""hostopt.jax with store=: the state on a drive steps to the in-RAM front's bits (schedules,
masks, every moment format, clipping, skipped steps, micro-batches, 16-bit params), on the
host and through the offload pipeline (offload="host": the pipeline streams the store's
chunks), resumes where it was from jax.eval_shape's structs, exports through state_dict and
save, and refuses what it cannot do by name, with nothing changed."""
import gc

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402

import hostopt.jax as hj  # noqa: E402

jax.config.update("jax_platform_name", "cpu")

SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 3, 50)
STORE = {"sync": False, "chunk_elements": 128, "buffers": 3}  # many chunks, cut through the leaves
RESUMED = {"sync": False, "buffers": 4}  # (a store keeps its chunking)


def model(seed=1, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  return {"emb": jnp.asarray(0.3 * rng.standard_normal((37, 9)), dtype),
          "dense": {"w": jnp.asarray(0.3 * rng.standard_normal((9, 33)), dtype), "b": jnp.zeros(33, dtype)},
          "norm": jnp.ones(5, dtype)}


def grads_of(params, t):
  rng = np.random.default_rng(1000 + t)
  return jax.tree_util.tree_map(lambda p: jnp.asarray(rng.standard_normal(p.shape), p.dtype), params)


def make(params, store=None, resume=False, options=None, **kw):
  mask = jax.tree_util.tree_map(lambda p: p.ndim > 1, params)
  groups = {"emb": "compressed", "dense": {"w": "half", "b": "plain"}, "norm": "plain"}
  return hj.adamw(params, SCHEDULE, weight_decay=0.1, mask=mask, max_grad_norm=5.0, groups=groups,
                  group_options={"compressed": {"moments": "8bit"}, "half": {"moments": "bf16"}}, rounding_seed=3,
                  store=store, store_options=options or (None if store is None else RESUMED if resume else STORE),
                  resume=resume, **kw)


def same(a, b):
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))


def same_state_dict(a, b):
  assert a.keys() == b.keys() and a["step"] == b["step"]
  for key in set(a) - {"step", "rounding_seed"}:
    assert a[key].keys() == b[key].keys(), key
    for name in a[key]:
      np.testing.assert_array_equal(a[key][name], b[key][name], err_msg=f"{key}{name}")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_steps_resume_and_export_with_the_in_ram_fronts_bits(tmp_path, dtype):
  params = model(dtype=dtype)
  ram, stored = make(params), make(params, tmp_path)
  assert stored.store is not None and stored.store.chunks > 5 and stored.state_bytes == stored.store.staging_bytes
  p = q = params
  for t in range(4):
    g = grads_of(params, t)
    if t == 1:
      g["dense"]["b"] = None  # no gradient: its state and own step count stay, in both (and in the files below)
    if t == 2:
      g["norm"] = g["norm"].at[1].set(jnp.nan)  # skipped by both (8-bit groups check by default)
    p, q = ram.step(g), stored.step(g)
    assert str(ram.last_step) == str(stored.last_step)  # (nan == nan as text)
    same(p, q)
  assert stored.last_step.applied and stored.step_count == 3
  ram.accumulate(grads_of(params, 7))  # micro-batches: averaged by both
  stored.accumulate(grads_of(params, 7))
  same(ram.step(grads_of(params, 8)), stored.step(grads_of(params, 8)))
  same(ram.params(), stored.params())
  same_state_dict(ram.state_dict(), stored.state_dict())
  stored.save(str(tmp_path / "export.safetensors"))  # streamed from the drive: today's checkpoint format
  ram.save(str(tmp_path / "ram.safetensors"))
  assert (tmp_path / "export.safetensors").read_bytes() == (tmp_path / "ram.safetensors").read_bytes()
  back = make(params)
  back.load(str(tmp_path / "export.safetensors"))
  same_state_dict(back.state_dict(), ram.state_dict())
  stored.close()

  shapes = jax.eval_shape(lambda: params)  # a resumed run needs no parameters, only their tree
  resumed = make(shapes, tmp_path, resume=True)
  assert resumed.step_count == 4
  p, q = ram.current_params(), resumed.current_params()
  same(p, q)
  for t in range(9, 11):  # the schedule goes on from the step count
    same(ram.step(grads_of(params, t)), resumed.step(grads_of(params, t)))
  same_state_dict(ram.state_dict(), resumed.state_dict())


def test_refusals_name_the_problem_and_change_nothing(tmp_path):
  params = model()
  stored = make(params, tmp_path)
  stored.step(grads_of(params, 0))
  with pytest.raises(RuntimeError, match="open elsewhere"):
    make(params, tmp_path, resume=True, options=RESUMED)  # one optimizer per store
  for call, what in ((lambda: stored.load(str(tmp_path / "x")), "load"),
                     (lambda: stored.load_state_dict(stored.state_dict()), "load_state_dict")):
    with pytest.raises(ValueError, match=f"{what} with store=: the store is the checkpoint"):
      call()
  assert stored.step_count == 1
  stored.close()
  with pytest.raises(ValueError, match="closed"):
    stored.step(grads_of(params, 1))
  with pytest.raises(RuntimeError, match=r"a store exists .* \(resume=True continues it\)"):
    make(params, tmp_path)
  empty = tmp_path / "empty"
  empty.mkdir()
  with pytest.raises(RuntimeError, match="no store"):
    make(params, empty, resume=True)
  with pytest.raises(ValueError, match="unknown .'staging'.*StoredOptimizer's keywords"):
    hj.adamw(params, 1e-3, store=empty, store_options={"staging": 1 << 20})
  with pytest.raises(ValueError, match="store_options without store="):
    hj.adamw(params, 1e-3, store_options={"sync": False})
  with pytest.raises(ValueError, match="resume=True without store="):
    hj.adamw(params, 1e-3, resume=True)
  with pytest.raises(ValueError, match="chunking it was created with"):
    make(params, tmp_path, resume=True, options=STORE)
  with pytest.raises(TypeError, match="resume: expected a bool"):
    hj.adamw(params, 1e-3, store=empty, resume="yes")
  with pytest.raises(ValueError, match="offload='cuda' but the params are on the CPU"):
    hj.adamw(params, 1e-3, store=empty, offload="cuda")
  with pytest.raises(ValueError, match="offload_chunk=0: expected a positive"):
    hj.adamw(params, 1e-3, store=empty, offload="host", offload_chunk=0)
  with pytest.raises(ValueError, match="offload='cuda' but JAX sees no GPU .the params are shapes only"):
    hj.adamw(jax.eval_shape(lambda: params), 1e-3, store=empty, offload="cuda")
  assert not any(empty.iterdir())  # nothing made by the refusals
  other = dict(params, extra=jnp.zeros(3))
  with pytest.raises(RuntimeError):
    hj.adamw(other, SCHEDULE, store=tmp_path, store_options={"sync": False}, resume=True)  # another model's store


def test_a_refused_call_leaves_no_store_and_a_failed_step_keeps_the_micro_batches(tmp_path):
  params = model()
  with pytest.raises(ValueError, match="max_grad_norm"):
    hj.adamw(params, 1e-3, store=tmp_path, max_grad_norm=-1.0)
  assert not any(tmp_path.iterdir())
  ram, stored = make(params), make(params, tmp_path)
  for o in (ram, stored):
    o.accumulate(grads_of(params, 0))
  chunks = [f for f in tmp_path.iterdir() if f.stat().st_size > 8192]
  saved = {f: f.read_bytes() for f in chunks}
  for f in chunks:
    f.write_bytes(b"")  # the store's chunk files truncated: the step fails while streaming
  with pytest.raises(RuntimeError):
    stored.step(grads_of(params, 1))
  for f, data in saved.items():
    f.write_bytes(data)
  same(ram.step(grads_of(params, 1)), stored.step(grads_of(params, 1)))  # the retry averages two micro-batches
  same_state_dict(ram.state_dict(), stored.state_dict())


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_offload_pipeline_streams_the_store_to_the_in_ram_pipelines_bits(tmp_path, dtype):
  # offload="host": CPU arrays stand in for device arrays, the pipeline's copies and its
  # chunks (cut across the store's: 200 elements against 128) are the GPU path's.
  params = model(dtype=dtype)
  ram = make(params, offload="host", offload_chunk=200)
  stored = make(params, tmp_path, offload="host", offload_chunk=200)
  assert stored.memory()["pinned_bytes"] > 0 and stored.memory()["copy_out_bytes"] == 0
  for t in range(4):
    g = grads_of(params, t)
    if t == 2:
      g["norm"] = g["norm"].at[1].set(jnp.nan)  # skipped by both, counted, committed with the next
    p, q = ram.step(g), stored.step(g)
    assert str(ram.last_step) == str(stored.last_step)
    same(p, q)
  assert stored.store.step_count == 3 and stored.store.skipped_steps == 1
  for o in (ram, stored):  # micro-batches, summed in the pipeline's accumulator (the norm: the caller's)
    o.accumulate(grads_of(params, 7))
  same(ram.step(grads_of(params, 8), grad_norm=2.5), stored.step(grads_of(params, 8), grad_norm=2.5))
  same(ram.params(), stored.params())
  same_state_dict(ram.state_dict(), stored.state_dict())

  g = grads_of(params, 9)
  g["norm"] = None  # no gradient: the pipeline's step leaves its state and own count, in both
  same(ram.step(g), stored.step(g))
  for o in (ram, stored):
    o.accumulate(grads_of(params, 11))
  chunks = [f for f in tmp_path.iterdir() if f.stat().st_size > 8192]
  saved = {f: f.read_bytes() for f in chunks}
  for f in chunks:
    f.write_bytes(b"")  # truncated under the pipeline: its step fails, the store keeps step 5
  with pytest.raises(RuntimeError, match=r"the 1 micro-batch\(es\) accumulated for it are kept") as failed:
    stored.step(grads_of(params, 9), grad_norm=1.5)
  assert "push_params" not in str(failed.value)  # (the pipeline's advice to its C++ callers)
  for f, data in saved.items():
    f.write_bytes(data)
  assert stored.step_count == 5
  # The pipeline goes on, and the retry averages the kept micro-batch with its gradients.
  same(ram.step(grads_of(params, 9), grad_norm=1.5), stored.step(grads_of(params, 9), grad_norm=1.5))
  same_state_dict(ram.state_dict(), stored.state_dict())
  stored.save(str(tmp_path / "export.safetensors"))  # the leaf's own count: in both files
  ram.save(str(tmp_path / "ram.safetensors"))
  assert (tmp_path / "export.safetensors").read_bytes() == (tmp_path / "ram.safetensors").read_bytes()
  stored.close()
  with pytest.raises(ValueError, match="closed"):
    stored.step(grads_of(params, 10))
  with pytest.raises(ValueError, match="closed"):
    stored.accumulate(grads_of(params, 10))

  resumed = make(jax.eval_shape(lambda: params), tmp_path, resume=True, offload="host", offload_chunk=200)
  assert resumed.step_count == 6
  same(ram.current_params(), resumed.current_params())
  same(ram.step(grads_of(params, 10)), resumed.step(grads_of(params, 10)))
  same_state_dict(ram.state_dict(), resumed.state_dict())


@pytest.mark.parametrize("kw", [{}, {"offload": "host"}])
def test_a_dropped_optimizer_releases_its_store_at_once(tmp_path, kw):
  # No reference cycle keeps the store (and its lock) after the optimizer is dropped.
  params = model()
  gc.disable()
  try:
    opt = make(params, tmp_path, **kw)
    opt.step(grads_of(params, 0))
    del opt
    again = make(jax.eval_shape(lambda: params), tmp_path, resume=True, **kw)
    assert again.step_count == 1
    again.close()
  finally:
    gc.enable()

