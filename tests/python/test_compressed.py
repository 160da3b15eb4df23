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
  m2, v2 = mo.decode()  # re-encoded: within one step of the format's grid of the f32 step's
  rel = 2.0**-7 if fmt == "bf16" else 2.0**-2
  assert np.all(np.abs(m2 - m) <= rel * np.abs(m) + 1e-6)
  assert np.all(np.abs(v2 - v) <= rel * v + 1e-9)


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
    (lambda mo: setattr(mo, "exp_avg", mo.exp_avg.astype(np.uint16)), TypeError, "expected uint8"),
    (lambda mo: setattr(mo, "exp_avg_sq", mo.exp_avg_sq[:-1].copy()), ValueError, "expected 100"),
    (lambda mo: mo.scales.setflags(write=False), ValueError, "read-only"),
    (lambda mo: setattr(mo, "format", "f32"), ValueError, "bf16 or 8bit"),
    (lambda mo: setattr(mo, "format", "int4"), ValueError, "unknown name 'int4'"),
])
def test_bad_moments_are_refused_and_nothing_changes(change, error, words):
  n = 100
  p = np.ones(n, np.float32)
  mo = hostopt.CompressedMoments(n, "8bit")
  change(mo)
  with pytest.raises(error, match=words):
    hostopt.adam_step_compressed(p, mo, np.ones(n, np.float32), step=1)
  assert np.all(p == 1)


def test_unknown_format_name():
  with pytest.raises(ValueError, match="'bf16' or '8bit'"):
    hostopt.CompressedMoments(10, "fp8")
