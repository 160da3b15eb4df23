"""hostopt._core through the package: zero-copy intake, errors naming the argument, the GIL."""
import os
import faulthandler
import sys
import threading
import time

import numpy as np
import pytest

import hostopt


def reference_adamw(p, m, v, g, t, lr, b1=0.9, b2=0.999, eps=1e-8, wd=0.0):
  p, m, v, g = (x.astype(np.float64) for x in (p, m, v, g))
  m = b1 * m + (1 - b1) * g
  v = b2 * v + (1 - b2) * g * g
  p = p * (1 - lr * wd) - lr / (1 - b1**t) * m / (np.sqrt(v / (1 - b2**t)) + eps)
  return p, m, v


def test_version_and_kernels():
  assert hostopt.__version__ == "0.1.0"
  names = [n for n, ok in hostopt.kernels() if ok]
  assert hostopt.active_kernel() in names and "scalar" in names


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 1000003])
def test_adam_step_matches_reference(rng, n):
  p = rng.standard_normal(n).astype(np.float32)
  m = (0.1 * rng.standard_normal(n)).astype(np.float32)
  v = (0.01 * np.abs(rng.standard_normal(n))).astype(np.float32)
  g = rng.standard_normal(n).astype(np.float32)
  rp, rm, rv = reference_adamw(p, m, v, g, 3, 1e-2, wd=0.1)
  hostopt.adam_step(p, m, v, g, step=3, lr=1e-2, weight_decay=0.1)
  np.testing.assert_allclose(p, rp, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(m, rm, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(v, rv, rtol=1e-5, atol=1e-9)


def test_bf16_from_ml_dtypes_torch_and_uint16_agree(rng):
  ml_dtypes = pytest.importorskip("ml_dtypes")
  torch = pytest.importorskip("torch")
  g32 = rng.standard_normal(100).astype(np.float32)
  g_ml = g32.astype(ml_dtypes.bfloat16)
  g_torch = torch.from_numpy(g32).to(torch.bfloat16)
  results = []
  for g in (g_ml, g_torch):
    p, m, v = np.ones(100, np.float32), np.zeros(100, np.float32), np.zeros(100, np.float32)
    out = np.zeros(100, ml_dtypes.bfloat16)
    hostopt.adam_step(p, m, v, g, step=1, lr=0.1, out=out)
    results.append((p.copy(), m.copy(), out.view(np.uint16).copy()))
  for a, b in zip(*results):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(results[0][1], 0.1 * g_ml.astype(np.float32))  # m = (1 - b1) g, exactly decoded


def test_torch_tensors_are_used_in_place():
  torch = pytest.importorskip("torch")
  p, m, v = torch.ones(8), torch.zeros(8), torch.zeros(8)
  hostopt.adam_step(p, m, v, torch.full((8,), 2.0), step=1, lr=0.5)
  assert torch.allclose(p, torch.full((8,), 0.5))


@pytest.mark.parametrize("case, exc, words", [
    ("non-contiguous grad", ValueError, ["grad", "not C-contiguous"]),
    ("read-only params", ValueError, ["params", "read-only"]),
    ("float64 grad", TypeError, ["grad", "float64"]),
    ("list instead of array", TypeError, ["grad", "list"]),
    ("short grad", ValueError, ["grad.size = 7", "expected 8"]),
    ("NaN lr", ValueError, ["lr = nan"]),
    ("step 0", ValueError, ["step = 0"]),
])
def test_bad_input_names_the_argument_and_changes_nothing(case, exc, words):
  p, m, v = np.ones(8, np.float32), np.zeros(8, np.float32), np.zeros(8, np.float32)
  g = np.full(8, 0.5, np.float32)
  kwargs = dict(step=1, lr=0.1)
  if case == "non-contiguous grad":
    g = np.full(16, 0.5, np.float32)[::2]
  elif case == "read-only params":
    p.setflags(write=False)
  elif case == "float64 grad":
    g = g.astype(np.float64)
  elif case == "list instead of array":
    g = [0.5] * 8
  elif case == "short grad":
    g = g[:7]
  elif case == "NaN lr":
    kwargs["lr"] = float("nan")
  elif case == "step 0":
    kwargs["step"] = 0
  before = (p.copy(), m.copy(), v.copy())
  with pytest.raises(exc) as info:
    hostopt.adam_step(p, m, v, g, **kwargs)
  for w in words:
    assert w in str(info.value)
  for a, b in zip(before, (p, m, v)):
    np.testing.assert_array_equal(a, b)


def test_optimizer_views_groups_and_skipped_tensors(rng):
  opt = hostopt.Optimizer([{"params": {"w": (3, 5), "b": (5,)}, "lr": 1e-2, "weight_decay": 0.1},
                           {"params": [("frozen", (4,))], "lr": 0.0}], threads=2)
  assert opt.names == ["w", "b", "frozen"]
  assert opt.arena_size % 16 == 0 and opt.num_params == 24 and opt.state_bytes == 12 * opt.arena_size
  w0 = rng.standard_normal((3, 5)).astype(np.float32)
  opt.params("w")[:] = w0
  opt.params("frozen")[:] = 7.0
  gw = rng.standard_normal((3, 5)).astype(np.float32)
  assert opt.step({"w": gw, "b": np.ones(5, np.float32)}).step == 1  # "frozen" has no gradient
  p, m, v = w0.copy().ravel(), np.zeros(15, np.float32), np.zeros(15, np.float32)
  hostopt.adam_step(p, m, v, gw.ravel(), step=1, lr=1e-2, weight_decay=0.1)
  np.testing.assert_array_equal(opt.params("w").ravel(), p)
  np.testing.assert_array_equal(opt.params("frozen"), 7.0)
  opt.set_group_config(0, lr=0.5)
  assert opt.group_config(0)["lr"] == 0.5
  with pytest.raises(ValueError, match="beta1 = 1"):
    opt.set_group_config(0, betas=(1.0, 0.9))
  with pytest.raises(KeyError, match="nope"):
    opt.step({"nope": gw})
  flat = np.zeros(opt.arena_size, np.float32)
  assert opt.step(flat).step == 2


def test_gil_is_released_during_a_step():
  # A worker steps again and again, publishing the number of the call it is about to make;
  # this thread looks for a call in progress: the same number read twice with the GIL given
  # up in between. The switch interval is raised so far that the GIL changes hands only
  # where a thread gives it up: this thread runs only while a step has released it, and a
  # step that held it would starve this thread for good (faulthandler then ends the run
  # with every thread's traceback — a safety net, not a time bound on the test).
  n = 1 << 20
  p, m, v, g = (np.zeros(n, np.float32) for _ in range(4))
  calling, completed, errors, seen = [0], [0], [], threading.Event()

  def worker():
    t = 0
    try:
      while not seen.is_set():
        t += 1
        calling[0] = t
        hostopt.adam_step(p, m, v, g, step=t, threads=1)
        completed[0] = t
        calling[0] = 0
    except BaseException as e:  # reported below
      errors.append(e)
      calling[0] = 0

  interval = sys.getswitchinterval()
  faulthandler.dump_traceback_later(600, exit=True)
  sys.setswitchinterval(1000.0)
  th = threading.Thread(target=worker)
  th.start()
  try:
    while True:
      c = calling[0]
      time.sleep(0)  # gives up the GIL
      if c and calling[0] == c or errors:
        break
  finally:
    seen.set()
    th.join()
    sys.setswitchinterval(interval)
    faulthandler.cancel_dump_traceback_later()
  assert not errors
  assert completed[0] >= c  # the call seen in progress ran to its end


def test_checkpoint_round_trip_and_safetensors_readable(tmp_path, rng):
  groups = [{"params": {"w": (4, 3), "b": (3,)}, "lr": 1e-2, "weight_decay": 0.1}]
  a, b = hostopt.Optimizer(groups), hostopt.Optimizer(groups)
  for _ in range(3):
    a.step({"w": rng.standard_normal((4, 3)).astype(np.float32), "b": np.ones(3, np.float32)})
  path = tmp_path / "opt.safetensors"
  a.save(path)
  b.load(path)
  assert b.step_count == 3
  np.testing.assert_array_equal(a.params(), b.params())
  np.testing.assert_array_equal(a.exp_avg_sq(), b.exp_avg_sq())
  safetensors = pytest.importorskip("safetensors.numpy")
  tensors = safetensors.load_file(str(path))
  np.testing.assert_array_equal(tensors["w.param"], a.params("w"))
  assert tensors["b.exp_avg"].shape == (3,)
  data = bytearray(path.read_bytes())
  data[-1] ^= 0xFF
  path.write_bytes(bytes(data))
  with pytest.raises(RuntimeError, match="checksum mismatch"):
    b.load(path)


def test_dtype_kind_is_checked_not_only_the_size():
  opt = hostopt.Optimizer([{"params": {"w": (16,)}}])
  # int32 has float32's size, float16 has bfloat16's: both refused by the core itself.
  with pytest.raises(TypeError, match="int32 does not hold f32"):
    opt._core.step_flat(np.ones(16, np.int32), "f32")
  with pytest.raises(TypeError, match="float16 does not hold bf16"):
    opt._core.step_flat(np.ones(16, np.float16), "bf16")
  with pytest.raises(TypeError, match="does not hold f16"):
    opt._core.step_flat(np.ones(16, np.int16), "f16")
  p, m, v = (np.zeros(16, np.float32) for _ in range(3))
  with pytest.raises(TypeError, match="int32"):
    hostopt._core.adam_step(p, m, v, np.ones(16, np.int32), "f32")
  # Byte order too: big-endian floats would be read as garbage.
  with pytest.raises(TypeError, match="native-endian"):
    hostopt._core.adam_step(p, m, v, np.ones(16, ">f4"), "f32")
  with pytest.raises(TypeError, match="native-endian"):
    hostopt._core.adam_step(np.zeros(16, ">f4"), m, v, np.ones(16, np.float32), "f32")
  assert opt.step_count == 0
  np.testing.assert_array_equal(opt.params(), 0.0)


def test_step_options_from_python_skip_and_clip(rng):
  groups = [{"params": {"w": (50,)}, "lr": 0.1}]
  opt, ref = hostopt.Optimizer(groups), hostopt.Optimizer(groups)
  g = rng.standard_normal(opt.arena_size).astype(np.float32)
  g[50:] = 0  # padding
  r = opt.step(g)
  assert r.applied and r.step == 1 and r.skipped_steps == 0
  ref.step(g)
  bad = g.copy()
  bad[3] = np.nan
  before = opt.params().copy()
  r = opt.step(bad, skip_nonfinite=True)
  assert not r.applied and r.step == 1 and r.skipped_steps == 1 and opt.skipped_steps == 1
  np.testing.assert_array_equal(opt.params(), before)
  # Clipping folds the factor into the scale: the same bits as stepping with that scale.
  norm = float(np.sqrt(np.sum(g[:50].astype(np.float64) ** 2)))
  r = opt.step(g, max_grad_norm=norm / 4)
  assert r.applied and r.applied_scale == pytest.approx(0.25, rel=1e-6)
  ref.step(g, grad_scale=r.applied_scale)
  np.testing.assert_array_equal(opt.params(), ref.params())
  r = opt.step({"w": g[:50]}, known_grad_norm=float("inf"), skip_nonfinite=True)
  assert not r.applied and r.skipped_steps == 2


def test_two_python_threads_stepping_one_optimizer_give_the_serial_result(rng):
  groups = [{"params": {"w": (300000,)}, "lr": 1e-2, "weight_decay": 0.1}]
  shared, serial = hostopt.Optimizer(groups, threads=1), hostopt.Optimizer(groups, threads=1)
  g = rng.standard_normal(shared.arena_size).astype(np.float32)
  for _ in range(20):
    serial.step(g)

  def worker():
    for _ in range(10):
      shared.step(g)

  threads = [threading.Thread(target=worker) for _ in range(2)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert shared.step_count == 20
  np.testing.assert_array_equal(shared.params(), serial.params())
  np.testing.assert_array_equal(shared.exp_avg_sq(), serial.exp_avg_sq())


def test_saves_refuse_special_files_and_nul_paths(tmp_path):
  import os
  opt = hostopt.Optimizer([{"params": {"w": (4,)}}])
  fifo = tmp_path / "fifo"
  os.mkfifo(fifo)
  with pytest.raises(RuntimeError, match="not a regular file"):
    opt.save(fifo)
  with pytest.raises(RuntimeError, match="not a regular file"):
    opt.load(fifo)  # refused at once, never blocks
  with pytest.raises(ValueError, match="NUL"):
    opt.save(str(tmp_path / "a") + "\0b")
  assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo"]


def test_sharded_optimizer_from_python(tmp_path, rng):
  groups = [{"config": {"lr": 1e-2}, "tensors": [("w", [100]), ("b", [7])]}]
  ranks = [hostopt._core.ShardedOptimizer(groups, 2, r, threads=1) for r in range(2)]
  n = ranks[0].arena_size
  g = rng.standard_normal(n).astype(np.float32)
  # A checked step needs the global norm: refused without one, fine with a reduction.
  b, e = ranks[0].shard
  with pytest.raises(ValueError, match="global gradient norm"):
    ranks[0].step(g[b:e].copy())
  total = sum(r.shard_sum_squares(g[r.shard[0]:r.shard[1]].copy()) for r in ranks)
  for r in ranks:
    # Stands in for an all-reduce: of the ranks' refusals (none), then of the sums of squares.
    r.set_norm_reduction(lambda local, sums=iter([0.0, total]): next(sums))
    assert r.step(g[r.shard[0]:r.shard[1]].copy(), max_grad_norm=1.0) == (True, 1)
  for r in ranks:
    r.save(str(tmp_path), "s1")
  ranks[0].commit_save(str(tmp_path), "s1")
  with pytest.raises(ValueError, match="committed save"):
    ranks[1].save(str(tmp_path), "s1")
  one = hostopt._core.ShardedOptimizer(groups, 1, 0, threads=1)
  one.load(str(tmp_path))
  assert one.step_count == 1


@pytest.mark.parametrize("known", [float("inf"), float("nan")])
def test_a_nonfinite_known_norm_with_clipping_skips_the_step_never_unclipped(rng, known):
  # A norm that overflowed where it was computed (a GPU reduction), with finite gradients:
  # there is no clip factor, so the step is skipped and counted, with or without the check.
  opt = hostopt.Optimizer([{"params": {"w": (100,)}, "lr": 0.1}])
  g = (1000 * rng.standard_normal(100)).astype(np.float32)
  opt.step({"w": g})
  before = (opt.params().copy(), opt.exp_avg().copy(), opt.exp_avg_sq().copy())
  for skipped, check in enumerate((False, True), start=1):
    r = opt.step({"w": g}, max_grad_norm=1.0, skip_nonfinite=check, known_grad_norm=known)
    assert not r.applied and r.step == 1 and r.skipped_steps == skipped and opt.skipped_steps == skipped
    for a, b in zip(before, (opt.params(), opt.exp_avg(), opt.exp_avg_sq())):
      assert a.tobytes() == b.tobytes()
  r = opt.step({"w": g}, max_grad_norm=1.0, known_grad_norm=8000.0)  # a finite norm clips as always
  assert r.applied and r.applied_scale == np.float32(1 / 8000)


def test_integer_arguments_are_never_truncated_and_errors_name_them(rng):
  def group(**extra):
    return [{"params": {"w": (2, 3)}, "moments": "bf16", **extra}]
  for seed in (-1, 2**64, 1.9, True, "3"):
    with pytest.raises(ValueError, match=r"groups\[0\]\['rounding_seed'\] = .*: expected an integer in \[0, 2\*\*64\)"):
      hostopt.Optimizer(group(rounding_seed=seed))
    with pytest.raises(ValueError, match=r"groups\[0\]\['rounding_seed'\] = .*: expected an integer in \[0, 2\*\*64\)"):
      hostopt._core.Optimizer([{"config": {}, "tensors": [("w", [2, 3])], "moments": "bf16", "rounding_seed": seed}])
  for seed in (np.uint64(2**64 - 1), np.int64(7), 2**64 - 1):  # numpy integers are integers
    assert hostopt.Optimizer(group(rounding_seed=seed)).group_rounding_seed(0) == int(seed)
  with pytest.raises(TypeError, match=r"tensor 'w'.*\(2\.5,\).*expected an integer"):
    hostopt.Optimizer([{"params": {"w": (2.5,)}}])
  with pytest.raises(TypeError, match=r"tensor 'w'.*expected an integer"):
    hostopt._core.Optimizer([{"config": {}, "tensors": [("w", [2.5])]}])
  assert hostopt.Optimizer([{"params": {"w": (np.int64(2), np.uint8(3))}}]).segment("w")[1] == [2, 3]

  opt = hostopt.Optimizer([{"params": {"w": (2, 3), "b": (3,)}}])
  for bad in (1.7, 2.0, True, "2"):
    with pytest.raises(TypeError, match=f"step_count = {bad!r}: expected an integer"):
      opt.step_count = bad
  assert opt.step_count == 0
  opt.step_count = np.int64(3)
  assert opt.step_count == 3
  p, m, v = np.ones(4, np.float32), np.zeros(4, np.float32), np.zeros(4, np.float32)
  with pytest.raises(TypeError, match="step = 1.5: expected an integer"):
    hostopt.adam_step(p, m, v, np.ones(4, np.float32), step=1.5)
  assert np.all(p == 1)

  # A gradient (or copy-out) of the tensor's size but another shape is refused, not reinterpreted.
  opt.step_count = 0
  before = opt.params().copy()
  gw, gb = np.ones((3, 2), np.float32), np.ones(3, np.float32)
  with pytest.raises(ValueError, match=r"grads\['w'\] has shape \(3, 2\): expected \(2, 3\)"):
    opt.step({"w": gw, "b": gb})
  with pytest.raises(ValueError, match=r"grads\['w'\] has shape \(3, 2\): expected \(2, 3\)"):
    opt.step([gw, gb])
  with pytest.raises(ValueError, match=r"grads\['b'\] has shape \(1, 3\): expected \(3,\)"):
    opt.step({"w": gw.reshape(2, 3), "b": gb.reshape(1, 3)})
  with pytest.raises(ValueError, match=r"out\['w'\] has shape \(6,\): expected \(2, 3\)"):
    opt.step({"w": gw.reshape(2, 3), "b": gb}, out={"w": np.zeros(6, np.float32), "b": np.zeros(3, np.float32)})
  # known_grad_norm: >= 0, or NaN/inf; a negative one is not "none given".
  for bad in (-2, -0.5, float("-inf")):
    with pytest.raises(ValueError, match=f"known_grad_norm = {bad!r}: a norm is >= 0"):
      opt.step({"w": gw.reshape(2, 3), "b": gb}, max_grad_norm=1.0, known_grad_norm=bad)
  assert opt.step_count == 0 and opt.params().tobytes() == before.tobytes()
  assert opt.step({"w": gw.reshape(2, 3), "b": gb}, max_grad_norm=1.0, known_grad_norm=np.float32(0.5)).applied


def test_group_indexes_threads_ranks_bools_and_numbers_are_checked_by_name():
  opt = hostopt.Optimizer([{"params": {"w": (2, 3)}, "lr": 0.5}, {"params": {"b": (3,)}, "lr": 0.25}])
  calls = {"group_config": lambda g: opt.group_config(g), "group_moments": lambda g: opt.group_moments(g),
           "set_group_config": lambda g: opt.set_group_config(g, lr=0.125),
           "group_rounding_seed": lambda g: opt.group_rounding_seed(g),
           "set_group_rounding_seed": lambda g: opt.set_group_rounding_seed(g, 1)}
  for name, call in calls.items():
    for bad in (1.9, True, np.bool_(True), "0", None, np.float32(1.0)):
      with pytest.raises(TypeError, match=r"group = .*: expected an integer"):
        call(bad)
    for bad in (-1, 2, 2**64, np.int64(-1)):
      with pytest.raises(ValueError, match=r"group = .*: expected an index in \[0, 2\)"):
        call(bad)
  assert opt.group_config(0)["lr"] == 0.5 and opt.group_config(1)["lr"] == 0.25  # nothing changed
  opt.set_group_config(np.int64(1), lr=0.125)  # numpy integers are integers
  assert opt.group_config(np.uint8(1))["lr"] == 0.125

  for bad in (2.9, "3", True, np.bool_(True), None):
    with pytest.raises(TypeError, match=r"threads = .*: expected an integer"):
      hostopt.Optimizer([{"params": {"w": (2, 3)}}], threads=bad)
    with pytest.raises(TypeError, match=r"threads = .*: expected an integer"):
      hostopt._core.Optimizer([{"config": {}, "tensors": [("w", [2, 3])]}], bad)
    with pytest.raises(TypeError, match=r"threads = .*: expected an integer"):
      hostopt._core.ShardedOptimizer([{"config": {}, "tensors": [("w", [100])]}], 1, 0, threads=bad)
  with pytest.raises(ValueError, match=r"threads = 18446744073709551616: expected an integer in \[-2\*\*31, 2\*\*31\)"):
    hostopt.Optimizer([{"params": {"w": (2, 3)}}], threads=2**64)
  assert hostopt.Optimizer([{"params": {"w": (2, 3)}}], threads=np.int32(1)).num_params == 6
  assert hostopt._core.Optimizer([{"config": {}, "tensors": [("w", [2, 3])]}], np.int32(1)).threads == 1

  groups = [{"config": {}, "tensors": [("w", [100])]}]
  for world, rank in ((np.float32(2.7), 0), (2, np.float32(1.9)), (True, 0), (2, False), ("2", 0), (2, None)):
    with pytest.raises(TypeError, match=r"(world_size|rank) = .*: expected an integer"):
      hostopt._core.ShardedOptimizer(groups, world, rank)
  with pytest.raises(ValueError, match=r"world_size = 18446744073709551616: expected an integer in"):
    hostopt._core.ShardedOptimizer(groups, 2**64, 0)
  assert hostopt._core.ShardedOptimizer(groups, np.int64(2), np.uint8(1)).shard == hostopt._core.ShardedOptimizer(groups, 2, 1).shard

  with pytest.raises(ValueError, match=r"step_count = 18446744073709551616: expected an integer in"):
    opt.step_count = 2**64
  p, m, v = np.ones(4, np.float32), np.zeros(4, np.float32), np.zeros(4, np.float32)
  with pytest.raises(ValueError, match=r"step = 18446744073709551616: expected an integer in"):
    hostopt.adam_step(p, m, v, np.ones(4, np.float32), step=2**64)

  # bools: True/False or numpy.bool_, never an int, float or string taken for one.
  for key in ("nesterov", "bias_correction", "maximize"):
    for bad in ("no", -1, 1.9, 0, None):
      with pytest.raises(TypeError, match=f"{key} = {bad!r}: expected a bool"):
        hostopt.Optimizer([{"params": {"w": (2, 3)}, key: bad}])
      with pytest.raises(TypeError, match=f"config\\['{key}'\\] = {bad!r}: expected a bool"):
        hostopt._core.Optimizer([{"config": {key: bad}, "tensors": [("w", [2, 3])]}])
    assert hostopt.Optimizer([{"params": {"w": (2, 3)}, key: np.bool_(True)}]).group_config(0)[key] is True
  with pytest.raises(TypeError, match="nesterov = 'no': expected a bool"):
    hostopt.adam_step(p, m, v, np.ones(4, np.float32), step=1, nesterov="no")
  # numbers: never a bool or a string parsed; an int beyond a double named.
  g = {"w": np.ones((2, 3), np.float32), "b": np.ones(3, np.float32)}
  for arg in ("grad_scale", "max_grad_norm", "known_grad_norm"):
    for bad in ("3", True, np.bool_(False), None if arg != "known_grad_norm" else "x"):
      with pytest.raises(TypeError, match=f"{arg} = .*: expected a real number"):
        opt.step(g, **{arg: bad})
    with pytest.raises(ValueError, match=f"{arg} = 1.*: expected a real number a double holds"):
      opt.step(g, **{arg: 2**2000})
  for bad in ("0.1", True):
    with pytest.raises(TypeError, match="lr = .*: expected a real number"):
      hostopt.Optimizer([{"params": {"w": (2, 3)}, "lr": bad}])
    with pytest.raises(TypeError, match=r"config\['lr'\] = .*: expected a real number"):
      hostopt._core.Optimizer([{"config": {"lr": bad}, "tensors": [("w", [2, 3])]}])
  with pytest.raises(TypeError, match="skip_nonfinite = 1: expected a bool"):
    opt.step(g, skip_nonfinite=1)
  assert opt.step_count == 0
  assert opt.step(g, grad_scale=np.float32(0.5), max_grad_norm=np.float64(1.0), skip_nonfinite=np.bool_(True),
                  known_grad_norm=np.array(2.0)).applied


def test_flat_steps_are_1d_and_adam_step_arrays_share_the_params_shape():
  opt = hostopt.Optimizer([{"params": {"w": (2, 3), "b": (3,)}}])
  n = opt.arena_size
  before = opt.params().copy()
  with pytest.raises(ValueError, match=rf"grads has shape \(1, {n}\): a flat grads is 1-D"):
    opt.step(np.ones((1, n), np.float32))
  with pytest.raises(ValueError, match=rf"out has shape \(1, {n}\): a flat out is 1-D"):
    opt.step(np.ones(n, np.float32), out=np.zeros((1, n), np.float32))
  assert opt.step_count == 0 and opt.params().tobytes() == before.tobytes()
  assert opt.step(np.ones(n, np.float32)).applied
  p, m, v = np.ones(4, np.float32), np.zeros(4, np.float32), np.zeros(4, np.float32)
  for kw in ({"grad": np.ones((2, 2), np.float32)}, {"exp_avg": np.zeros((2, 2), np.float32)},
             {"out": np.zeros((1, 4), np.float32)}):
    args = {**dict(params=p, exp_avg=m, exp_avg_sq=v, grad=np.ones(4, np.float32)), **kw}
    with pytest.raises(ValueError, match=r"has shape \(.*\): expected \(4,\), the params' shape"):
      hostopt.adam_step(args.pop("params"), args.pop("exp_avg"), args.pop("exp_avg_sq"), args.pop("grad"), step=1,
                        **args)
  assert np.all(p == 1) and np.all(m == 0)
  cm = hostopt.CompressedMoments(4, "bf16")
  with pytest.raises(ValueError, match=r"grad has shape \(2, 2\): expected \(4,\)"):
    hostopt.adam_step_compressed(p, cm, np.ones((2, 2), np.float32), step=1)


@pytest.mark.parametrize("front", ["torch", "jax", "optax"])
def test_the_fronts_refuse_a_bad_rounding_seed_like_the_core(front):
  # The same error as hostopt.Optimizer's groups[i]['rounding_seed']: ValueError, the rule.
  rule = r"rounding_seed = .*: expected an integer in \[0, 2\*\*64\)"
  if front == "torch":
    torch = pytest.importorskip("torch")
    import hostopt.torch
    make = lambda s: hostopt.torch.AdamW([torch.nn.Parameter(torch.ones(4))], moments="bf16", rounding_seed=s)
  else:
    jnp = pytest.importorskip("jax.numpy")
    if front == "jax":
      import hostopt.jax
      make = lambda s: hostopt.jax.adamw({"w": jnp.ones(4)}, 1e-3, moments="bf16", rounding_seed=s)
    else:
      import hostopt.optax
      make = lambda s: hostopt.optax.adamw(1e-3, moments="bf16", rounding_seed=s).init({"w": jnp.ones(4)})
  for seed in (-1, 2**64, 1.9):
    with pytest.raises(ValueError, match=rule):
      make(seed)
  make(np.uint64(2**64 - 1))


@pytest.mark.parametrize("name", ["adam_step", "Optimizer"])
def test_the_docstring_examples_run(name):
  import doctest
  runner = doctest.DocTestRunner()
  for t in doctest.DocTestFinder().find(getattr(hostopt, name), name, globs={}):
    runner.run(t)
  assert runner.tries > 0 and runner.failures == 0


@pytest.mark.parametrize("extra", [{"beta1": 0.5}, {"beta2": 0.5}])
def test_betas_and_beta1_or_beta2_together_are_refused(extra):
  with pytest.raises(ValueError, match="betas and beta"):
    hostopt.Optimizer([{"params": {"w": (3,)}, "betas": (0.9, 0.99), **extra}])


@pytest.mark.parametrize("omp, expected", [("3", 3), ("5,2", 5), ("0", None), ("", None), ("two", None),
                                           ("100000", hostopt._core.max_threads())])
def test_default_threads_honour_omp_num_threads(monkeypatch, omp, expected):
  """OMP_NUM_THREADS (its first entry, at most max_threads()) is every front's default when it
  is a positive count; unset, empty or invalid, the default is the physical cores of the CPU set."""
  monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
  cores = hostopt.default_threads()
  assert 1 <= cores <= len(os.sched_getaffinity(0))
  monkeypatch.setenv("OMP_NUM_THREADS", omp)
  assert hostopt.default_threads() == (cores if expected is None else expected)


def test_a_large_omp_num_threads_never_makes_a_step_refuse(monkeypatch):
  monkeypatch.setenv("OMP_NUM_THREADS", str(hostopt._core.max_threads() + 1))
  o = hostopt.Optimizer([{"params": {"w": (8,)}, "lr": 0.1}])
  assert o.step({"w": np.ones(8, np.float32)}).applied
