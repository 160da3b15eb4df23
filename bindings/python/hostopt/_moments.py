"""The moment formats as the Python fronts see them: the 8-bit format's constants (read
from the core, never copied), block counts, the check of exponent bytes, which format
moments are held in, and the numpy conversions between float32 moments and a format's
storage.

Each front keeps its own state layout (torch's state entries, hostopt.jax's state_dict,
optax's states) and adapts its arrays to numpy; what a format is lives here, once. A
format's moments are held as values (f32: floating point, bf16: bfloat16) or as codes
(8-bit: uint8, beside one [blocks, 2] uint8 array of exponent bytes); numpy code arrays
hold bf16 as its uint16 bits.
"""

from typing import Any, Dict, Optional, Tuple

import numpy as np

from . import _core
from ._dtypes import name_of

Q8_BLOCK: int = _core.Q8_BLOCK  # elements per 8-bit block (one exponent byte per moment)
# The largest exponent byte the 8-bit encoder writes for exp_avg (mu) and exp_avg_sq (nu),
# and the byte of a poisoned block (its moments NaN): any other byte is corrupt input.
Q8_MAX_EXPONENT: Tuple[int, int] = _core.Q8_MAX_EXPONENT_BYTES
Q8_POISONED: int = _core.Q8_POISONED_EXPONENT_BYTE

# The numpy dtype of a format's codes.
CODE_DTYPES: Dict[str, Any] = {"bf16": np.uint16, "8bit": np.uint8}
# The dtype a format's moments are held in, by name (numpy, jax and torch name theirs alike).
HELD_DTYPES: Dict[str, str] = {"f32": "float32", "bf16": "bfloat16", "8bit": "uint8"}


def held_format(dtype: Any) -> Optional[str]:
  """The format whose moments are held in `dtype` (numpy, jax or torch): "8bit" for uint8
  codes, "bf16" for bfloat16 values, "f32" for any other floating-point values; None for
  anything else."""
  name = name_of(dtype)
  if name is None:
    return None
  for fmt in ("8bit", "bf16"):
    if name == HELD_DTYPES[fmt]:
      return fmt
  try:
    return "f32" if np.dtype(name).kind == "f" else None
  except TypeError:  # a torch dtype numpy does not know
    return None


def q8_blocks(n: int) -> int:
  """8-bit blocks of a tensor of n elements (its exponent bytes: [blocks, 2])."""
  return -(-int(n) // Q8_BLOCK)


def check_q8_scales(scales: np.ndarray, where: str) -> None:
  """Refuses 8-bit exponent bytes ([blocks, 2] uint8: m's, v's) that the encoder never
  writes (corrupt or foreign input, which would decode as NaN), naming the first bad block."""
  pairs = np.asarray(scales).reshape(-1, 2)
  for k, name in enumerate(("exp_avg", "exp_avg_sq")):
    col = pairs[:, k]
    bad = np.flatnonzero((col > Q8_MAX_EXPONENT[k]) & (col != Q8_POISONED))
    if bad.size:
      raise ValueError(f"{where}: block {int(bad[0])}'s {name} exponent byte is {int(col[bad[0]])}: the 8-bit "
                       f"encoder writes at most {Q8_MAX_EXPONENT[k]} (or {Q8_POISONED} for a non-finite block)")


def encode(m32: np.ndarray, v32: np.ndarray, fmt: str, seed: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
  """float32 moments (any shape, read in C order) as `fmt` codes: flat (exp_avg, exp_avg_sq)
  codes and the flat exponent bytes (empty for bf16), stochastically rounded with `seed`."""
  m = np.ascontiguousarray(m32, np.float32).reshape(-1)
  v = np.ascontiguousarray(v32, np.float32).reshape(-1)
  cm, cv = np.zeros(m.size, CODE_DTYPES[fmt]), np.zeros(m.size, CODE_DTYPES[fmt])
  scales = np.zeros(_core.moment_scale_bytes(fmt, m.size), np.uint8)
  _core.encode_moments(m, v, cm, cv, scales, fmt, seed)
  return cm, cv, scales


def decode(cm: np.ndarray, cv: np.ndarray, scales: Optional[np.ndarray], fmt: str) -> Tuple[np.ndarray, np.ndarray]:
  """`fmt` codes (any shape, read in C order; scales None or empty for bf16) as flat float32
  moments: exact, every code is a float32 value."""
  cm = np.ascontiguousarray(cm).reshape(-1)
  cv = np.ascontiguousarray(cv).reshape(-1)
  sc = np.ascontiguousarray(scales if scales is not None else np.zeros(0, np.uint8)).reshape(-1)
  m32, v32 = np.empty(cm.size, np.float32), np.empty(cm.size, np.float32)
  _core.decode_moments(cm, cv, sc, fmt, m32, v32)
  return m32, v32


def as_f32(fmt: str, m: np.ndarray, v: np.ndarray, scales: Optional[np.ndarray] = None) -> Tuple[np.ndarray, np.ndarray]:
  """Moments held in `fmt` (numpy, any shape, read in C order) as flat float32 arrays: 8-bit
  codes decoded with their exponent bytes (exact), values of any floating dtype widened
  (exact from bfloat16 and float16) or cast."""
  if fmt == "8bit":
    return decode(m, v, scales, "8bit")
  return np.asarray(m, np.float32).reshape(-1), np.asarray(v, np.float32).reshape(-1)
