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
  mo = hostopt.CompressedMoments.encode(0.1 * rng.standard_normal(n), 0.01 * rng.random(n), fmt, seed=1)
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
  m, v = rng.standard_normal(n), rng.random(n)
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
  mo = hostopt.CompressedMoments.encode(np.full(n, 0.5), np.full(n, 0.25), "8bit")
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
  mo = hostopt.CompressedMoments.encode(np.full(64, 0.5), np.full(64, 0.25), "8bit")
  for a in (mo.exp_avg, mo.exp_avg_sq, mo.scales):
    a.setflags(write=False)
  m, v = mo.decode()
  assert np.all(m == 0.5) and np.all(v == 0.25)


def test_encode_and_step_arguments_are_checked():
  with pytest.raises(ValueError, match="never negative"):
    hostopt.CompressedMoments.encode(np.ones(8), -np.ones(8), "8bit")
  with pytest.raises(ValueError, match="shapes differ"):
    hostopt.CompressedMoments.encode(np.ones((3, 40)), np.ones((40, 3)), "8bit")
  with pytest.raises(TypeError):
    hostopt.CompressedMoments(2.7)
  mo = hostopt.CompressedMoments(8, "bf16")
  with pytest.raises(ValueError, match="seed = -1"):
    hostopt.adam_step_compressed(np.ones(8, np.float32), mo, np.ones(8, np.float32), step=1, seed=-1)


def test_unknown_format_name():
  with pytest.raises(ValueError, match="'bf16' or '8bit'"):
    hostopt.CompressedMoments(10, "fp8")
