"""The dtypes hostopt's kernels take, one table for every front.

The kernels read and write float32, bfloat16 and float16, which the core names "f32", "bf16"
and "f16". A dtype is looked up by its name, so one table serves numpy's dtypes (bfloat16
being ml_dtypes', as jax and torch's numpy views have it), jax's and torch's: no front
imports another's framework to ask.
"""

from typing import Any, Optional

import numpy as np

# dtype name -> the core's tag.
KERNEL_DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
EXPECTED = "float32, bfloat16 or float16"  # how an error names them


def name_of(dtype: Any) -> Optional[str]:
  """The name of a numpy, jax or torch dtype (or of a type numpy takes as one): "float32",
  "bfloat16", "uint8", ...; None for what is no dtype."""
  if type(dtype).__module__.startswith("torch"):
    return str(dtype).rpartition(".")[2]  # torch.bfloat16 -> bfloat16
  try:
    return np.dtype(dtype).name
  except TypeError:
    return None


def tag_of(dtype: Any) -> Optional[str]:
  """The core's tag ("f32", "bf16", "f16") of a numpy, jax or torch dtype (or a type numpy
  takes as one); None for any other dtype."""
  name = name_of(dtype)
  return None if name is None else KERNEL_DTYPES.get(name)


def kernel_tag(dtype: Any) -> str:
  """tag_of a dtype already checked to be one of the kernels' (TypeError otherwise)."""
  tag = tag_of(dtype)
  if tag is None:
    raise TypeError(f"dtype {dtype}: expected {EXPECTED}")
  return tag
