"""hostopt.CompressedMoments and adam_step_compressed: the C++ step's contract through Python."""
import numpy as np
import pytest

import hostopt

KERNELS = [name for name, ok in hostopt.kernels() if ok]


@pytest.mark.parametrize("fmt", ["bf16", "8bit"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_step_is_the_f32_step_of_the_decoded_moments(fmt, kernel):
  rng = np.random.default_rng(0)
  n = 1000
  p = rng.standard_normal(n).astype(np.float32)
  mo = hostopt.CompressedMoments.encode((0.1 * rng.standard_normal(n)).astype(np.float32),
                                       (0.01 * rng.random(n)).astype(np.float32), fmt, seed=1)
  g = rng.standard_normal(n).astype(np.float32)
  m, v = mo.decode()
  p32 = p.copy()
  hostopt.adam_step(p32, m, v, g, step=3, lr=1e-2, weight_decay=0.1, kernel=kernel)
  hostopt.adam_step_compressed(p, mo, g, step=3, lr=1e-2, weight_decay=0.1, seed=5, kernel=kernel)
  assert p.tobytes() == p32.tobytes()
  # Re-encoded: within one step of the format's grid of the f32 step's moments, which the
  # f32 step just computed (m, v updated in place). 8-bit: 1/8 of the binade, or the
  # block's smallest step (2^-17 of its largest m, 2^-33 of its largest v).
  m2, v2 = mo.decode()
  if fmt == "bf16":
    assert np.all(np.abs(m2 - m) <= 2.0**-7 * np.abs(m))
    assert np.all(np.abs(v2 - v) <= 2.0**-7 * v)
  else:
    block_m = np.repeat(np.abs(np.pad(m, (0, -n % 32))).reshape(-1, 32).max(1), 32)[:n]
    block_v = np.repeat(np.pad(v, (0, -n % 32)).reshape(-1, 32).max(1), 32)[:n]
    assert np.all(np.abs(m2 - m) <= np.maximum(2.0**-3 * np.abs(m), 2.0**-16 * block_m))
    assert np.all(np.abs(v2 - v) <= np.maximum(2.0**-3 * v, 2.0**-32 * block_v))


def test_bytes_and_seeded_rounding():
  rng = np.random.default_rng(1)
  n = 4096
  m, v = rng.standard_normal(n).astype(np.float32), rng.random(n).astype(np.float32)
  a = hostopt.CompressedMoments.encode(m, v, "8bit", seed=3)
  b = hostopt.CompressedMoments.encode(m, v, "8bit", seed=3)
  c = hostopt.CompressedMoments.encode(m, v, "8bit", seed=4)
  assert a.nbytes / n == 2.0625 and hostopt.CompressedMoments(n, "bf16").nbytes / n == 4
  assert a.exp_avg.tobytes() == b.exp_avg.tobytes() and a.scales.tobytes() == b.scales.tobytes()
  assert a.exp_avg.tobytes() != c.exp_avg.tobytes()


@pytest.mark.parametrize("change, error, words", [
    (lambda mo: setattr(mo, "exp_avg", mo.exp_avg.astype(np.uint16)), TypeError, "expected native-endian uint8"),
    (lambda mo: setattr(mo, "exp_avg", mo.exp_avg.astype(">u1").view(">u2")), TypeError, "uint8"),
    (lambda mo: setattr(mo, "exp_avg_sq", mo.exp_avg), ValueError, "overlap"),
    (lambda mo: setattr(mo, "exp_avg_sq", mo.exp_avg_sq[:-1].copy()), ValueError, "expected 100"),
    (lambda mo: mo.scales.setflags(write=False), ValueError, "read-only"),
    (lambda mo: setattr(mo, "format", "f32"), ValueError, "bf16 or 8bit"),
    (lambda mo: setattr(mo, "format", "int4"), ValueError, "unknown name 'int4'"),
])
def test_bad_moments_are_refused_and_nothing_changes(change, error, words):
  n = 100
  p = np.ones(n, np.float32)
  mo = hostopt.CompressedMoments.encode(np.full(n, 0.5, np.float32), np.full(n, 0.25, np.float32), "8bit")
  change(mo)
  before = [mo.exp_avg.tobytes(), mo.exp_avg_sq.tobytes(), mo.scales.tobytes()]
  with pytest.raises(error, match=words):
    hostopt.adam_step_compressed(p, mo, np.ones(n, np.float32), step=1)
  assert np.all(p == 1)
  assert [mo.exp_avg.tobytes(), mo.exp_avg_sq.tobytes(), mo.scales.tobytes()] == before


def test_big_endian_codes_are_refused_not_misread():
  mo = hostopt.CompressedMoments(64, "bf16")
  mo.exp_avg = mo.exp_avg.astype(">u2")
  with pytest.raises(TypeError, match="native-endian uint16"):
    mo.decode()


def test_decode_reads_read_only_codes():
  mo = hostopt.CompressedMoments.encode(np.full(64, 0.5, np.float32), np.full(64, 0.25, np.float32), "8bit")
  for a in (mo.exp_avg, mo.exp_avg_sq, mo.scales):
    a.setflags(write=False)
  m, v = mo.decode()
  assert np.all(m == 0.5) and np.all(v == 0.25)


def test_encode_and_step_arguments_are_checked():
  with pytest.raises(ValueError, match="never negative"):
    hostopt.CompressedMoments.encode(np.ones(8, np.float32), -np.ones(8, np.float32), "8bit")
  with pytest.raises(ValueError, match="shapes differ"):
    hostopt.CompressedMoments.encode(np.ones((3, 40), np.float32), np.ones((40, 3), np.float32), "8bit")
  # Seeds are integers in [0, 2**64) and inputs float32: named errors, never a silent cast.
  ones = np.ones(8, np.float32)
  for seed in (-1, 2**64, 1.9, True):
    with pytest.raises(ValueError, match=r"seed = .*: expected an integer in \[0, 2\*\*64\)"):
      hostopt.CompressedMoments.encode(ones, ones, "8bit", seed=seed)
  a = hostopt.CompressedMoments.encode(ones, ones, "8bit", seed=np.uint64(2**64 - 1))
  assert a.exp_avg.tobytes() == hostopt.CompressedMoments.encode(ones, ones, "8bit", seed=2**64 - 1).exp_avg.tobytes()
  with pytest.raises(TypeError, match="exp_avg has dtype float64, expected float32"):
    hostopt.CompressedMoments.encode(np.ones(8), ones, "8bit")
  with pytest.raises(TypeError, match="exp_avg_sq has dtype float16, expected float32"):
    hostopt.CompressedMoments.encode(ones, np.ones(8, np.float16), "bf16")
  with pytest.raises(TypeError, match="step = 1.5: expected an integer"):
    hostopt.adam_step_compressed(np.ones(8, np.float32), hostopt.CompressedMoments(8, "bf16"), ones, step=1.5)
  with pytest.raises(ValueError, match=r"first_index = 0.5: expected an integer"):
    hostopt.adam_step_compressed(np.ones(8, np.float32), hostopt.CompressedMoments(8, "bf16"), ones, step=1,
                                 first_index=0.5)
  with pytest.raises(TypeError):
    hostopt.CompressedMoments(2.7)
  mo = hostopt.CompressedMoments(8, "bf16")
  with pytest.raises(ValueError, match="seed = -1"):
    hostopt.adam_step_compressed(np.ones(8, np.float32), mo, np.ones(8, np.float32), step=1, seed=-1)


def test_unknown_format_name():
  with pytest.raises(ValueError, match="'bf16' or '8bit'"):
    hostopt.CompressedMoments(10, "fp8")


def test_optimizer_groups_choose_their_moment_format(tmp_path):
  groups = [{"params": {"embed": (10, 7), "norm": (5,)}, "lr": 1e-2},
            {"params": {"w": (8, 9), "empty": (0,)}, "moments": "8bit", "rounding_seed": 3, "lr": 1e-2},
            {"params": {"b": (33,)}, "moments": "bf16"}]
  opt = hostopt.Optimizer(groups)
  assert [opt.group_moments(g) for g in range(3)] == ["f32", "8bit", "bf16"]
  assert opt.segment("w")[2] % 32 == 0
  rng = np.random.default_rng(2)
  for name in opt.names:
    opt.params(name)[...] = rng.standard_normal(opt.segment(name)[1])
  for _ in range(3):
    opt.step({n: rng.standard_normal(opt.segment(n)[1]).astype(np.float32) for n in opt.names})
  # f32 groups keep their views; compressed ones are read and written as f32 copies.
  assert opt.exp_avg("embed").shape == (10, 7) and np.any(opt.exp_avg("embed") != 0)
  with pytest.raises(RuntimeError, match="group 1 stores its moments as 8bit"):
    opt.exp_avg()
  with pytest.raises(ValueError, match=r"exp_avg\('w'\).*8bit"):
    opt.exp_avg("w")
  m, v = opt.read_moments("w")
  codes_m, codes_v, scales = opt.moment_codes("w")
  assert codes_m.dtype == np.uint8 and scales.shape == (3, 2)
  mo = hostopt.CompressedMoments(72, "8bit")
  mo.exp_avg[:], mo.exp_avg_sq[:], mo.scales[:] = codes_m, codes_v, scales.reshape(-1)
  assert all(np.array_equal(a.reshape(-1), b) for a, b in zip((m, v), mo.decode()))
  # A checkpoint resumes the compressed state bit for bit.
  opt.save(tmp_path / "s.safetensors")
  other = hostopt.Optimizer(groups)
  other.load(tmp_path / "s.safetensors")
  assert all(np.array_equal(a, b) for a, b in zip(other.read_moments("w"), (m, v)))
  assert np.array_equal(other.params(), opt.params())
  mixed = [dict(g) for g in groups]
  mixed[1]["moments"] = "bf16"
  with pytest.raises(RuntimeError, match="group 1 stores its moments as 8bit, the optimizer's as bf16"):
    hostopt.Optimizer(mixed).load(tmp_path / "s.safetensors")
  # Writes are checked: float32 of the tensor's shape, non-negative exp_avg_sq when encoded.
  with pytest.raises(TypeError, match="float64"):
    opt.write_moments("w", np.zeros((8, 9)), np.zeros((8, 9), np.float32))
  with pytest.raises(ValueError, match="negative"):
    opt.write_moments("w", np.zeros((8, 9), np.float32), -np.ones((8, 9), np.float32))
  assert all(np.array_equal(a, b) for a, b in zip(opt.read_moments("w"), (m, v)))
  with pytest.raises(ValueError, match="unknown name 'int4'"):
    hostopt.Optimizer([{"params": {"x": (3,)}, "moments": "int4"}])
  # Shards of a layout with 8-bit blocks are cut on 32.
  assert opt._core.chunk_unit == 32
  n = opt.arena_size
  assert hostopt._core.shard_of(n, 3, 1, 32)[0] % 32 == 0


def test_a_checkpoint_from_the_hashed_rounding_loads_and_steps_as_it_did(tmp_path):
  """tests/data/compressed_checkpoint_hashed_rounding.safetensors was written by 70680ac,
  whose rounding bits came from a hash (lowbias32): the groups below, params from
  default_rng(7)'s standard normals, five steps of grads(1..5), save. The digests are what
  that build printed. The encodings did not change with the generator, so the file loads to
  the same moments and saves to the same bytes, and the next step gives the parameters that
  build gave (a step's p comes from the decoded moments; only its new codes differ)."""
  import hashlib
  import os
  groups = [{"params": {"a": (1000,), "b": (37,)}, "moments": "bf16", "rounding_seed": 5, "lr": 1e-2},
            {"params": {"c": (100,)}, "moments": "8bit", "rounding_seed": 6, "lr": 1e-2, "weight_decay": 0.1}]

  def grads(t):
    rng = np.random.default_rng(100 + t)
    return {"a": rng.standard_normal(1000).astype(np.float32), "b": rng.standard_normal(37).astype(np.float32),
            "c": (rng.standard_normal(100) * 1e-3).astype(np.float32)}

  def digest(arrays):
    h = hashlib.sha256()
    for a in arrays:
      h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]

  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data",
                      "compressed_checkpoint_hashed_rounding.safetensors")
  opt = hostopt.Optimizer(groups)
  opt.load(path)
  assert opt.step_count == 5
  assert digest(a for n in ("a", "b", "c") for a in opt.read_moments(n)) == "97e2c1fc80a5e45b"
  opt.save(str(tmp_path / "again.safetensors"))
  assert (tmp_path / "again.safetensors").read_bytes() == open(path, "rb").read()
  opt.step(grads(6))
  assert digest(opt.params(n) for n in ("a", "b", "c")) == "462622af9e644c63"
