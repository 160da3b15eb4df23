"""Zero-copy intake of numpy arrays, torch CPU tensors and jax CPU arrays."""

from typing import Any, List, Optional, Sequence, Set, Tuple

import operator

import numpy as np


def _is_torch(x: Any) -> bool:
  return type(x).__module__.startswith("torch")


def _is_jax(x: Any) -> bool:
  return type(x).__module__.startswith(("jax", "jaxlib"))


def as_buffer(x: Any, name: str, writable: bool = False) -> Tuple[np.ndarray, str]:
  """A numpy view of `x` sharing its memory, and its hostopt dtype ("f32", "bf16", "f16").

  bfloat16 comes back as a uint16 view. Raises TypeError for an unsupported type or dtype
  and ValueError for a non-contiguous, read-only (when `writable`) or off-CPU array, naming
  `name`: hostopt works in place and never copies silently.
  """
  if isinstance(x, np.ndarray):
    arr = x
  elif _is_torch(x):
    import torch
    if not isinstance(x, torch.Tensor):
      raise TypeError(f"{name}: expected a tensor, got {type(x).__name__}")
    if x.device.type != "cpu":
      raise ValueError(f"{name}: tensor is on {x.device}; hostopt steps host memory (move it with .cpu(), or use "
                       "the offload pipeline for device tensors)")
    if not x.is_contiguous():
      raise ValueError(f"{name}: tensor is not contiguous (strides {tuple(x.stride())}); hostopt works in place "
                       "and never copies silently (call .contiguous() if a copy is what you want)")
    t = x.detach()
    if t.dtype == torch.bfloat16:
      return t.view(torch.int16).numpy().view(np.uint16), "bf16"
    if t.dtype not in (torch.float32, torch.float16):
      raise TypeError(f"{name}: dtype {t.dtype} is not supported (expected float32, bfloat16 or float16)")
    arr = t.numpy()
  elif _is_jax(x) and hasattr(x, "__array__"):
    if writable:
      raise ValueError(f"{name}: jax arrays are immutable; hostopt needs a writable buffer here")
    arr = np.asarray(x)  # zero-copy for arrays on the CPU backend
  elif hasattr(x, "__dlpack__"):
    arr = np.from_dlpack(x)
  else:
    raise TypeError(f"{name}: expected a numpy array, torch tensor or jax array, got {type(x).__name__}")
  dt = arr.dtype
  if dt == np.float32:
    tag = "f32"
  elif dt == np.float16:
    tag = "f16"
  elif dt.name == "bfloat16" and dt.itemsize == 2:
    arr, tag = arr.view(np.uint16), "bf16"
  else:
    raise TypeError(f"{name}: dtype {dt} is not supported (expected float32, bfloat16 or float16; pass bfloat16 as "
                    "ml_dtypes.bfloat16, a torch.bfloat16 tensor or a jax bfloat16 array)")
  if not arr.flags.c_contiguous:
    raise ValueError(f"{name}: array is not C-contiguous (strides {arr.strides}); hostopt works in place and never "
                     "copies silently (pass numpy.ascontiguousarray(x) if a copy is what you want)")
  if writable and not arr.flags.writeable:
    raise ValueError(f"{name}: array is read-only but hostopt writes it in place")
  return arr, tag


def as_buffers(items: Sequence[Any], what: str) -> Tuple[List[Optional[np.ndarray]], Set[str]]:
  """as_buffer of each item, read-only (None passes: a tensor without a gradient), named
  what[i]: their numpy views, and the set of their dtypes."""
  arrays: List[Optional[np.ndarray]] = []
  tags: Set[str] = set()
  for i, x in enumerate(items):
    if x is None:
      arrays.append(None)
      continue
    array, tag = as_buffer(x, f"{what}[{i}]")
    arrays.append(array)
    tags.add(tag)
  return arrays, tags


def check_seed(seed: Any, where: str) -> int:
  """A rounding seed of compressed moments: an integer in [0, 2^64) (bool refused)."""
  if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= int(seed) < 1 << 64:
    raise ValueError(f"{where} = {seed!r}: expected an integer in [0, 2**64)")
  return int(seed)


def check_optional_bool(value: Any, where: str) -> Any:
  """None, or a bool (True/False, numpy.bool_): never a string, int or float taken for one
  (bool("no") is True). TypeError naming `where` otherwise."""
  if value is None or isinstance(value, (bool, np.bool_)):
    return None if value is None else bool(value)
  raise TypeError(f"{where} = {value!r}: expected None, True or False")


INT64 = (-(1 << 63), 1 << 63)
INT32 = (-(1 << 31), 1 << 31)


def integer(value, what: str, bounds: Tuple[int, int] = INT64, rule: str = "") -> int:
  """An integer argument: a Python or numpy integer (anything with __index__), never a
  float, bool or string truncated or parsed silently. TypeError naming `what` otherwise;
  ValueError outside [bounds[0], bounds[1]) (`rule` says the range, default the bounds)."""
  if isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{what} = {value!r}: expected an integer, not a bool")
  try:
    v = operator.index(value)
  except TypeError:
    raise TypeError(f"{what} = {value!r}: expected an integer (a {type(value).__name__} is never truncated "
                    "silently)") from None
  low, high = bounds
  if not low <= v < high:
    rng = rule or f"an integer in [{power_text(low)}, {power_text(high)})"
    raise ValueError(f"{what} = {v}: expected {rng}")
  return v


def power_text(x: int) -> str:
  """-2**63, 2**31, 0, 5 as written."""
  if x and abs(x) & (abs(x) - 1) == 0 and abs(x) > 1024:
    return ("-" if x < 0 else "") + f"2**{abs(x).bit_length() - 1}"
  return str(x)
