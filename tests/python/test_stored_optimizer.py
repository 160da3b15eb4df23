"""hostopt.StoredOptimizer: the state on a drive steps to hostopt.Optimizer's bits (every
moment format, a chunking that cuts tensors), reopens where it was, imports and exports an
Optimizer's state, and refuses what is not its own by name."""
import os

import numpy as np
import pytest

import hostopt

GROUPS = [
    {"params": {"emb": (37, 29), "norm": (17,)}, "lr": 1e-3, "weight_decay": 0.01},
    {"params": {"attn": (61, 40), "bias": (5,)}, "lr": 2e-3, "moments": "bf16", "rounding_seed": 11},
    {"params": {"mlp": (97, 33), "head": (1,)}, "lr": 5e-4, "weight_decay": 0.1, "moments": "8bit",
     "rounding_seed": 7},
]


def grads_of(opt, t):
  rng = np.random.default_rng(100 + t)
  return {name: rng.standard_normal(tuple(opt.segment(name)[1])).astype(np.float32) for name in opt.names}


def same_state(a: hostopt.Optimizer, b: hostopt.Optimizer):
  assert a.step_count == b.step_count and a.skipped_steps == b.skipped_steps
  for name in a.names:
    np.testing.assert_array_equal(a.params(name), b.params(name), err_msg=name)
    for x, y in zip(a.read_moments(name), b.read_moments(name)):
      np.testing.assert_array_equal(x, y, err_msg=name)
    if a.group_moments(a.segment(name)[4]) != "f32":
      for x, y in zip(a.moment_codes(name), b.moment_codes(name)):
        if x is not None:
          np.testing.assert_array_equal(x, y, err_msg=name)


def exported(stored):
  ram = hostopt.Optimizer(GROUPS)
  stored.copy_to(ram)
  return ram


@pytest.mark.parametrize("io", ["threads", "auto"])
def test_steps_give_the_optimizers_bits_and_reopen_where_they_were(tmp_path, io):
  ram = hostopt.Optimizer(GROUPS)
  init = {n: np.linspace(-1, 1, ram.params(n).size, dtype=np.float32).reshape(ram.params(n).shape) for n in ram.names}
  for n, p in init.items():
    ram.params(n)[...] = p
  stored = hostopt.StoredOptimizer.create(GROUPS, tmp_path, initial_params=init, chunk_elements=256, buffers=3,
                                          sync=False, io=io)
  assert stored.chunks > 10 and stored.step_count == 0 and stored.cached_pages == 0
  same_state(exported(stored), ram)
  for t in range(3):
    g = grads_of(ram, t)
    if t == 1:
      g["mlp"][3, 4] = np.nan  # skipped by both (8-bit groups check by default)
    out = np.zeros(stored.arena_size, np.float32)
    a, b = ram.step(g, max_grad_norm=2.0), stored.step(g, out, max_grad_norm=2.0)
    assert (a.applied, a.step, a.skipped_steps, a.applied_scale) == (b.applied, b.step, b.skipped_steps,
                                                                      b.applied_scale)
    if a.applied:
      for n in ram.names:
        _, shape, offset, size, _ = stored.segment(n)
        np.testing.assert_array_equal(out[offset:offset + size].reshape(shape), ram.params(n))
  same_state(exported(stored), ram)
  del stored
  stored = hostopt.StoredOptimizer.open(GROUPS, tmp_path, sync=False, io=io)
  assert stored.step_count == 2 and stored.skipped_steps == 1
  flat = stored.read_params()  # a resumed run's parameters: the master copy's bits
  half = stored.read_params(np.full(stored.arena_size, 7, np.float16))  # rounded as a step's out
  for n in ram.names:
    _, shape, offset, size, _ = stored.segment(n)
    np.testing.assert_array_equal(flat[offset:offset + size].reshape(shape), ram.params(n))
    np.testing.assert_array_equal(half[offset:offset + size], ram.params(n).reshape(-1).astype(np.float16))
  with pytest.raises(ValueError, match="out"):
    stored.read_params(np.zeros(stored.arena_size - 1, np.float32))
  stored.set_group_config(2, lr=1e-2)
  ram.set_group_config(2, lr=1e-2)
  g = grads_of(ram, 9)
  ram.step(g)
  stored.step(g)
  same_state(exported(stored), ram)


def test_an_optimizers_state_imports_and_exports(tmp_path):
  ram = hostopt.Optimizer(GROUPS)
  for t in range(2):
    ram.step(grads_of(ram, t))
  stored = hostopt.StoredOptimizer.from_optimizer(ram, GROUPS, tmp_path, sync=False)
  assert stored.step_count == 2
  same_state(exported(stored), ram)
  g = grads_of(ram, 5)
  flat = np.zeros(stored.arena_size, np.float32)
  for n in stored.names:
    _, shape, offset, size, _ = stored.segment(n)
    flat[offset:offset + size] = g[n].reshape(-1)
  stored.step(flat)  # a flat gradient, as a mapping
  ram.step(g)
  copy = exported(stored)
  same_state(copy, ram)
  path = tmp_path / "exported.safetensors"  # the export: today's checkpoint format
  copy.save(str(path))
  back = hostopt.Optimizer(GROUPS)
  back.load(str(path))
  same_state(back, ram)
  streamed = tmp_path / "streamed.safetensors"  # the same file, streamed from the drive
  stored.save(streamed)
  assert streamed.read_bytes() == path.read_bytes()


def test_refusals_name_the_problem_and_change_nothing(tmp_path):
  d = tmp_path / "store"
  os.mkdir(d)
  with pytest.raises(ValueError, match="buffers"):
    hostopt.StoredOptimizer.create(GROUPS, d, buffers=2)
  with pytest.raises(ValueError, match="staging_bytes"):
    hostopt.StoredOptimizer.create(GROUPS, d, staging_bytes=1000)
  with pytest.raises(ValueError, match="io"):
    hostopt.StoredOptimizer.create(GROUPS, d, io="aio")
  with pytest.raises(RuntimeError, match="no store"):
    hostopt.StoredOptimizer.open(GROUPS, d)
  stored = hostopt.StoredOptimizer.create(GROUPS, d, sync=False)
  with pytest.raises(RuntimeError, match="open elsewhere"):
    hostopt.StoredOptimizer.open(GROUPS, d)
  g = grads_of(stored, 0)
  with pytest.raises(KeyError, match="unknown tensor name.*'embx'"):
    stored.step({**g, "embx": g["emb"]})
  with pytest.raises(ValueError, match="shape"):
    stored.step({**g, "norm": np.zeros(16, np.float32)})
  with pytest.raises(ValueError, match="flat_grad|grad"):
    stored.step(np.zeros(stored.arena_size - 1, np.float32))
  assert stored.step_count == 0
  same_state(exported(stored), hostopt.Optimizer(GROUPS))
  del stored
  other = [dict(g) for g in GROUPS]
  other[1] = {**other[1], "rounding_seed": 12}
  with pytest.raises(RuntimeError, match="rounding seeds"):
    hostopt.StoredOptimizer.open(other, d)
  other = [dict(g) for g in GROUPS]
  other[0] = {**other[0], "params": {"emb": (37, 30), "norm": (17,)}}
  with pytest.raises(RuntimeError, match="another"):
    hostopt.StoredOptimizer.open(other, d)
  with pytest.raises(ValueError, match="another layout"):
    hostopt.StoredOptimizer.open(GROUPS, d).copy_to(hostopt.Optimizer(GROUPS[:1]))


def test_striped_over_directories_closed_and_reopened_with_torch_gradients(tmp_path):
  dirs = [tmp_path / "a", tmp_path / "b"]
  for d in dirs:
    os.mkdir(d)
  ram = hostopt.Optimizer(GROUPS)
  with hostopt.StoredOptimizer.create(GROUPS, dirs, chunk_elements=512, sync=False) as stored:
    assert stored.stripes == 2 and stored.recovery == ""
    g = grads_of(ram, 0)
    stored.step(g)
    ram.step(g)
  with pytest.raises(ValueError, match="closed"):
    stored.step(g)
  with pytest.raises(RuntimeError, match="stripe 1 of 2"):
    hostopt.StoredOptimizer.open(GROUPS, dirs[::-1], sync=False)
  stored = hostopt.StoredOptimizer.open(GROUPS, [str(d) for d in dirs], sync=False)
  same_state(exported(stored), ram)
  torch = pytest.importorskip("torch")
  tg = {n: torch.from_numpy(v).to(torch.bfloat16) for n, v in grads_of(ram, 1).items()}
  stored.step(tg)  # bfloat16 tensors, as Optimizer takes them
  ram.step(tg)
  same_state(exported(stored), ram)
  with pytest.raises(TypeError, match="mixed dtypes"):
    stored.step({**tg, "norm": torch.zeros(17)})
  stored.close()


def test_a_store_whose_newest_chunk_is_bad_opens_at_the_step_before(tmp_path):
  ram = hostopt.Optimizer(GROUPS)
  stored = hostopt.StoredOptimizer.create(GROUPS, tmp_path, sync=False)
  stored.step(grads_of(ram, 0))
  slot = 4096 + stored.chunk_bytes
  stored.close()
  with open(tmp_path / "chunks", "r+b") as f:  # chunk 0's slot of step 1: its bytes after the stamp
    f.seek(slot + 4096 + 10)
    b = f.read(1)
    f.seek(slot + 4096 + 10)
    f.write(bytes([b[0] ^ 1]))
  with hostopt.StoredOptimizer.open(GROUPS, tmp_path, sync=False) as stored:
    assert stored.step_count == 0
    assert "commit 1 could not be opened" in stored.recovery and "chunk 0" in stored.recovery
    same_state(exported(stored), ram)


def test_previous_goes_back_one_applied_step_for_good(tmp_path):
  ram = hostopt.Optimizer(GROUPS)
  with hostopt.StoredOptimizer.create(GROUPS, tmp_path, sync=False) as stored:
    for t in range(2):
      stored.step(grads_of(ram, t))
      ram.step(grads_of(ram, t))
    stored.step(grads_of(ram, 2))  # the step to undo
  with pytest.raises(TypeError, match="previous: expected a bool"):
    hostopt.StoredOptimizer.open(GROUPS, tmp_path, sync=False, previous=1)
  with hostopt.StoredOptimizer.open(GROUPS, tmp_path, sync=False, previous=True) as stored:
    assert stored.step_count == 2 and stored.recovery == ""
    same_state(exported(stored), ram)
  with pytest.raises(RuntimeError, match="cannot go back from step_count 2.*record is gone"):  # one step back at most
    hostopt.StoredOptimizer.open(GROUPS, tmp_path, sync=False, previous=True)
  with hostopt.StoredOptimizer.open(GROUPS, tmp_path, sync=False) as stored:  # for good
    assert stored.step_count == 2
    stored.step(grads_of(ram, 5))
    ram.step(grads_of(ram, 5))
    same_state(exported(stored), ram)


def test_a_tensor_without_a_gradient_keeps_its_state_and_own_count_as_in_ram_and_reopened(tmp_path):
  ram = hostopt.Optimizer(GROUPS)
  with hostopt.StoredOptimizer.create(GROUPS, tmp_path, chunk_elements=256, buffers=3, sync=False) as stored:
    for t, absent in enumerate([(), ("norm", "mlp"), ("emb",), ("head", "attn"), ()]):
      g = {k: (None if k == "bias" and t == 2 else v) for k, v in grads_of(ram, t).items() if k not in absent}
      out = np.full(stored.arena_size, np.nan, np.float32)
      a, b = ram.step(g), stored.step(g, out)
      assert a.applied and b.applied and a.step == b.step
      for name in ram.names:  # a tensor without a gradient is copied out as it is
        _, _, offset, size, _ = stored.segment(name)
        np.testing.assert_array_equal(out[offset:offset + size], ram.params(name).reshape(-1), err_msg=name)
    assert stored.tensor_steps == ram.tensor_steps == [4, 4, 4, 4, 4, 4]  # (each missed one step)
    same_state(exported(stored), ram)
  with hostopt.StoredOptimizer.open(GROUPS, tmp_path, sync=False) as stored:
    assert stored.tensor_steps == ram.tensor_steps
    g = {k: v for k, v in grads_of(ram, 9).items() if k != "head"}
    ram.step(g)
    stored.step(g)
    same_state(exported(stored), ram)
    assert exported(stored).tensor_steps == ram.tensor_steps == [5, 5, 5, 5, 5, 4]


def test_each_step_keeps_its_hyper_parameters_and_open_restores_them(tmp_path):
  ram = hostopt.Optimizer(GROUPS)
  with hostopt.StoredOptimizer.create(GROUPS, tmp_path, sync=False) as stored:
    stored.set_group_config(0, lr=4e-3, weight_decay=0.5)
    ram.set_group_config(0, lr=4e-3, weight_decay=0.5)
    stored.step(grads_of(ram, 0))
    ram.step(grads_of(ram, 0))
  with hostopt.StoredOptimizer.open(GROUPS, tmp_path, sync=False) as stored:  # GROUPS say lr 1e-3, decay 0.01
    c = stored.group_config(0)
    assert c["lr"] == 4e-3 and c["weight_decay"] == 0.5 and stored.recovery == ""
    stored.step(grads_of(ram, 1))
    ram.step(grads_of(ram, 1))
    same_state(exported(stored), ram)


def test_a_store_per_rank_holds_its_shard_and_steps_to_the_single_process_bits(tmp_path):
  ram = hostopt.Optimizer(GROUPS)
  n = ram.arena_size
  flats, outs = [], []
  for t in range(3):  # the summed gradients of 3 steps, flat (padding zero), and the new parameters
    flat = np.zeros(n, np.float32)
    for name, g in grads_of(ram, t).items():
      _, _, off, size, _ = ram.segment(name)
      flat[off:off + size] = g.reshape(-1)
    out = np.zeros(n, np.float32)
    ram.step(flat, out, max_grad_norm=2.0, known_grad_norm=3.0)  # the norm every rank is given (all-reduced)
    flats.append(flat)
    outs.append(out)
  world = 2
  ranges = []
  for rank in range(world):
    d = tmp_path / f"rank{rank}"
    d.mkdir()
    stored = hostopt.StoredOptimizer.create(GROUPS, d, chunk_elements=256, buffers=3, sync=False,
                                            shard=(world, rank))
    b, e = stored.range
    ranges.append((b, e))
    assert stored.arena_size == e - b and 0 < e - b < n
    with pytest.raises(ValueError, match="max_grad_norm clips.*known_grad_norm"):  # no rank decides a clip alone
      stored.step(flats[0][b:e], max_grad_norm=2.0)
    with pytest.raises(ValueError, match=r"skip_nonfinite is on \(the default with 8-bit groups\)"):  # nor a skip
      stored.step(flats[0][b:e])
    with pytest.raises(ValueError, match="export a shard into a hostopt._core.ShardedOptimizer"):
      stored.copy_to(hostopt.Optimizer(GROUPS))
    with pytest.raises(ValueError, match="save: this store holds a shard"):
      stored.save(tmp_path / f"rank{rank}.safetensors")
    assert not (tmp_path / f"rank{rank}.safetensors").exists()
    assert stored.step_count == 0
    out = np.zeros(e - b, np.float32)
    stored.step(flats[0][b:e], out, max_grad_norm=2.0, known_grad_norm=3.0)
    np.testing.assert_array_equal(out, outs[0][b:e])
    # A mapping of whole tensors is cut to the shard: only the tensors it overlaps are needed.
    whole = {name: flats[1][off:off + size].reshape(shape)
             for name, shape, off, size, _ in (ram.segment(m) for m in ram.names) if off < e and off + size > b}
    assert len(whole) < len(ram.names)
    first = next(iter(whole))
    with pytest.raises(KeyError, match=f"{first}.*the tensors of this shard"):
      stored.step({k: v for k, v in whole.items() if k != first}, out, max_grad_norm=2.0, known_grad_norm=3.0)
    stored.step(whole, out, max_grad_norm=2.0, known_grad_norm=3.0)
    np.testing.assert_array_equal(out, outs[1][b:e])
    stored.close()
    with pytest.raises(RuntimeError, match="range"):
      hostopt.StoredOptimizer.open(GROUPS, d, sync=False, shard=(world, 1 - rank))
    with hostopt.StoredOptimizer.open(GROUPS, d, sync=False, shard=(world, rank)) as again:
      assert again.step_count == 2 and again.range == (b, e)
      again.step(flats[2][b:e], out, max_grad_norm=2.0, known_grad_norm=3.0)
      np.testing.assert_array_equal(out, outs[2][b:e])
  assert ranges[0][0] == 0 and ranges[0][1] == ranges[1][0] and ranges[1][1] == n
  for bad, err in (((2,), TypeError), ((0, 0), ValueError), ((2, 2), ValueError), ((2, 1.0), TypeError)):
    with pytest.raises(err, match="shard"):
      hostopt.StoredOptimizer.create(GROUPS, tmp_path, sync=False, shard=bad)
  assert not any(p.is_file() for p in tmp_path.iterdir())


def test_a_shards_store_exports_to_and_imports_from_a_sharded_optimizer(tmp_path):
  """Each rank's store exports into a ShardedOptimizer of its shard, whose save and commit_save
  write a sharded checkpoint that one process loads; a ShardedOptimizer's state imports into a
  new store. All step on to the single process's bits."""
  from hostopt import _core
  spec = hostopt._group_spec(GROUPS)
  ram = hostopt.Optimizer(GROUPS)
  n = ram.arena_size
  flats, outs = [], []
  for t in range(3):
    flat = np.zeros(n, np.float32)
    for name, g in grads_of(ram, t).items():
      _, _, off, size, _ = ram.segment(name)
      flat[off:off + size] = g.reshape(-1)
    out = np.zeros(n, np.float32)
    ram.step(flat, out, max_grad_norm=2.0, known_grad_norm=3.0)
    flats.append(flat)
    outs.append(out)
  world, ckpt, shards = 2, tmp_path / "ckpt", []
  ckpt.mkdir()
  for rank in range(world):
    (tmp_path / f"rank{rank}").mkdir()
    (tmp_path / f"again{rank}").mkdir()
    with hostopt.StoredOptimizer.create(GROUPS, tmp_path / f"rank{rank}", chunk_elements=256, buffers=3, sync=False,
                                        shard=(world, rank)) as stored:
      b, e = stored.range
      for t in range(2):
        stored.step(flats[t][b:e], max_grad_norm=2.0, known_grad_norm=3.0)
      with pytest.raises(TypeError, match="copy_to: expected a hostopt.Optimizer.*got str"):
        stored.copy_to("ram")
      with pytest.raises(ValueError, match="range"):  # another rank's shard
        stored.copy_to(_core.ShardedOptimizer(spec, world, 1 - rank, threads=1))
      shard = _core.ShardedOptimizer(spec, world, rank, threads=1)
      stored.set_group_config(0, lr=2e-3)  # (the same on every rank)
      stored.copy_to(shard)
      assert shard.shard == (b, e) and shard.step_count == 2
      assert shard.group_config(0)["lr"] == 2e-3  # the store's hyper-parameters come with its state
      stored.set_group_config(0, lr=GROUPS[0]["lr"])
      shard.set_group_config(0, {"lr": GROUPS[0]["lr"]})
      shard.save(str(ckpt), "step2")
      shards.append(shard)
      with hostopt.StoredOptimizer.from_optimizer(shard, GROUPS, tmp_path / f"again{rank}", sync=False) as again:
        assert again.range == (b, e) and again.step_count == 2
        got = [np.zeros(e - b, np.float32) for _ in range(3)]
        stored.step(flats[2][b:e], got[0], max_grad_norm=2.0, known_grad_norm=3.0)
        again.step(flats[2][b:e], got[1], max_grad_norm=2.0, known_grad_norm=3.0)
        shard.step(flats[2][b:e], "f32", got[2], "f32", max_grad_norm=2.0, known_grad_norm=3.0)
        for out in got:
          np.testing.assert_array_equal(out, outs[2][b:e])
  shards[0].commit_save(str(ckpt), "step2")  # (on rank 0, after every rank saved)
  one = _core.ShardedOptimizer(spec, 1, 0, threads=1)  # the two shards' save, loaded by one process
  one.load(str(ckpt))
  assert one.step_count == 2
  out = np.zeros(n, np.float32)
  one.step(flats[2], "f32", out, "f32", max_grad_norm=2.0, known_grad_norm=3.0)
  np.testing.assert_array_equal(out, outs[2])


def test_each_ranks_store_saves_its_part_of_a_sharded_checkpoint_streamed(tmp_path):
  """save_shard writes the file ShardedOptimizer.save writes of the same state (the very
  bytes), commit_shard_save commits the save as commit_save does, and a ShardedOptimizer of
  another world size loads it and steps on to the single process's bits."""
  from hostopt import _core
  spec = hostopt._group_spec(GROUPS)
  ram = hostopt.Optimizer(GROUPS)
  n = ram.arena_size
  flats = []
  for t in range(3):
    flat = np.zeros(n, np.float32)
    for name, g in grads_of(ram, t).items():
      _, _, off, size, _ = ram.segment(name)
      flat[off:off + size] = g.reshape(-1)
    flats.append(flat)
    if t < 2:
      ram.step(flat, max_grad_norm=2.0, known_grad_norm=3.0)
  world = 2
  ckpt, via_ram = tmp_path / "ckpt", tmp_path / "via_ram"
  ckpt.mkdir()
  via_ram.mkdir()
  stores = []
  for rank in range(world):
    (tmp_path / f"rank{rank}").mkdir()
    stored = hostopt.StoredOptimizer.create(GROUPS, tmp_path / f"rank{rank}", chunk_elements=256, buffers=3,
                                            sync=False, shard=(world, rank))
    b, e = stored.range
    for t in range(2):
      stored.step(flats[t][b:e], max_grad_norm=2.0, known_grad_norm=3.0)
    with pytest.raises(ValueError, match=f"where rank {1 - rank} of 2 holds"):
      stored.save_shard(ckpt, "s2", world, 1 - rank)
    with pytest.raises(ValueError, match="save_shard"):
      stored.save(tmp_path / "whole.safetensors")
    stored.save_shard(ckpt, "s2", world, rank)
    shard = _core.ShardedOptimizer(spec, world, rank, threads=1)
    stored.copy_to(shard)
    shard.save(str(via_ram), "s2")
    stores.append(stored)
  with pytest.raises(RuntimeError, match="rank 0 of 2 holds"):
    stores[1].commit_shard_save(ckpt, "s2", world)
  with pytest.raises(TypeError, match="save_id: expected a str.*NoneType"):
    stores[0].save_shard(ckpt, None, world, 0)
  stores[0].commit_shard_save(ckpt, "s2", world)
  for name in ("shard-0-of-2.s2.safetensors", "shard-1-of-2.s2.safetensors"):
    assert (ckpt / name).read_bytes() == (via_ram / name).read_bytes(), name
  for s in stores:
    s.close()
  one = _core.ShardedOptimizer(spec, 1, 0, threads=1)
  one.load(str(ckpt))
  assert one.step_count == 2
  out, expected = np.zeros(n, np.float32), np.zeros(n, np.float32)
  one.step(flats[2], "f32", out, "f32", max_grad_norm=2.0, known_grad_norm=3.0)
  ram.step(flats[2], expected, max_grad_norm=2.0, known_grad_norm=3.0)
  np.testing.assert_array_equal(out, expected)


def test_a_shard_needs_no_gradient_for_an_empty_tensor_inside_its_range(tmp_path):
  groups = [{"params": {"a": (64,), "z": (0,), "b": (64,), "c": (64,)}, "lr": 1e-2}]
  with hostopt.StoredOptimizer.create(groups, tmp_path, sync=False, shard=(2, 0)) as stored:
    b, e = stored.range
    assert stored.segment("z")[2] > b  # the empty tensor's offset lies inside the shard
    g = {"a": np.ones(64, np.float32), "b": np.ones(64, np.float32)}
    stored.step(g, skip_nonfinite=False)
    assert stored.step_count == 1


def test_an_offload_pipeline_drives_a_stored_optimizer_to_the_in_ram_pipelines_bits(tmp_path):
  # The pipeline (here over the host copy engine: "device" buffers are host memory) streams
  # gradients in and parameters out a chunk at a time; a StoredOptimizer streams its state
  # from the drive around those chunks (224-element chunks cut its 256-element ones).
  ram = hostopt.Optimizer(GROUPS)
  stored = hostopt.StoredOptimizer.create(GROUPS, tmp_path, chunk_elements=256, buffers=3, sync=False)
  n = stored.arena_size
  pipes, bufs = [], []
  for opt in (stored._core, ram._core):
    engine = hostopt._core.CopyEngine.host()
    pipes.append((hostopt._core.OffloadPipeline(opt, engine, 200, 2, "f32", "bf16"), engine))
    bufs.append((np.zeros(n, np.float32), np.zeros(n, np.uint16)))
  for t in range(3):
    g = np.random.default_rng(t).standard_normal(n).astype(np.float32)
    results = []
    for (pipe, engine), (grads, params) in zip(pipes, bufs):
      grads[:] = g
      stream = engine.create_stream()
      results.append(pipe.step_async(grads.ctypes.data, "f32", params.ctypes.data, "bf16", n,
                                     grads_stream=stream).wait())
      engine.destroy_stream(stream)
    assert results[0].step == results[1].step == t + 1
    np.testing.assert_array_equal(bufs[0][1], bufs[1][1])
  same_state(exported(stored), ram)
  stored.close()
  with pytest.raises(RuntimeError, match="closed"):  # a closed store: the pipeline refuses
    grads, params = bufs[0]
    stream = pipes[0][1].create_stream()
    pipes[0][0].step_async(grads.ctypes.data, "f32", params.ctypes.data, "bf16", n, grads_stream=stream).wait()
