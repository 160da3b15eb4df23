"""hostopt.jax's state_dict as its users see it: each leaf's params, and its moments under
keys by format (mu/nu: float32 values, or bfloat16 ones; 8-bit: mu_codes, nu_codes and
moment_scales), read from the core's arena and checked and staged on their way back
(through _moments: which format moments are held in, and their conversions)."""

from typing import Dict, NamedTuple, Optional

import jax.numpy as jnp
import numpy as np

from . import _moments

BF16 = np.dtype(jnp.bfloat16)
CODE_KEYS = ("mu_codes", "nu_codes", "moment_scales")  # an 8-bit leaf's
MOMENT_KEYS = ("mu", "nu") + CODE_KEYS  # every key a leaf's moments may be under


def leaf_moments(core, name: str, fmt: str, shape) -> Dict[str, np.ndarray]:
  """A leaf's moments as its state_dict entries (exact copies of the arena's), by key."""
  if fmt == "f32":
    return {"mu": np.array(core.exp_avg(name)), "nu": np.array(core.exp_avg_sq(name))}
  m, v, scales = core.moment_codes(name)
  if fmt == "bf16":
    return {"mu": np.array(m).view(BF16).reshape(shape), "nu": np.array(v).view(BF16).reshape(shape)}
  return {"mu_codes": np.array(m).reshape(shape), "nu_codes": np.array(v).reshape(shape),
          "moment_scales": np.array(scales)}


class Staged(NamedTuple):
  """One leaf's checked moments from a state_dict, staged until every leaf is checked."""
  codes: bool  # True: the leaf's own bf16 values or 8-bit codes, copied as they are; False: float32 values
  m: np.ndarray
  v: np.ndarray
  scales: Optional[np.ndarray] = None  # 8-bit codes' exponent bytes


def staged_moments(state: dict, name: str, shape, fmt: str, convert: bool) -> Staged:
  """One leaf's moments of a state_dict, checked: its own format's codes (bf16 values or
  8-bit codes) to copy as they are, or float32 values to write (an f32 leaf, or a
  conversion)."""
  held = [k for k in CODE_KEYS if name in state.get(k, {})]
  scales = None
  if held:
    if len(held) != 3 or name in state["mu"] or name in state["nu"]:
      raise ValueError(f"state_dict: leaf {name!r} has {held}{' and mu/nu' if name in state['mu'] else ''}: 8-bit "
                       "moments are mu_codes, nu_codes and moment_scales, and no mu/nu")
    m, v, scales = (np.asarray(state[k][name]) for k in CODE_KEYS)
    blocks = _moments.q8_blocks(int(np.prod(shape)))
    for what, x, want in (("mu_codes", m, shape), ("nu_codes", v, shape), ("moment_scales", scales, (blocks, 2))):
      if _moments.held_format(x.dtype) != "8bit" or tuple(x.shape) != tuple(want):
        raise ValueError(f"state_dict[{what!r}][{name!r}]: {x.dtype} {tuple(x.shape)}, expected uint8 {tuple(want)}")
    _moments.check_q8_scales(scales, f"state_dict['moment_scales'][{name!r}]")
    held_fmt = "8bit"
  else:
    for key in ("mu", "nu"):
      if name not in state[key]:
        raise ValueError(f"state_dict[{key!r}]: leaf {name!r} missing (and no 8-bit mu_codes for it)")
    m, v = np.asarray(state["mu"][name]), np.asarray(state["nu"][name])
    for key, x in (("mu", m), ("nu", v)):
      if tuple(x.shape) != tuple(shape):
        raise ValueError(f"state_dict[{key!r}][{name!r}] has shape {x.shape}: expected {shape}")
      if _moments.held_format(x.dtype) not in ("f32", "bf16"):
        raise TypeError(f"state_dict[{key!r}][{name!r}]: dtype {x.dtype}, expected floating point")
    held_fmt = "bf16" if _moments.held_format(m.dtype) == "bf16" else "f32"
    if _moments.held_format(v.dtype) != held_fmt:
      raise ValueError(f"state_dict: leaf {name!r} has mu {m.dtype} and nu {v.dtype}: bf16 moments are both bfloat16")
    if np.any(v.astype(np.float32) < 0):
      raise ValueError(f"state_dict['nu'][{name!r}] has negative entries (a second moment is >= 0)")
  if held_fmt != fmt and not convert:
    raise ValueError(f"state_dict: leaf {name!r} holds {held_fmt} moments, this optimizer stores its moments as "
                     f"{fmt}: load_state_dict(..., convert_moments=True) converts them (lossy into bf16 or 8-bit)")
  if held_fmt == fmt and fmt != "f32":
    return Staged(codes=True, m=m, v=v, scales=scales)
  # Exactly as float32 (8-bit codes decoded), then written in this leaf's format.
  m32, v32 = _moments.as_f32(held_fmt, m, v, scales)
  return Staged(codes=False, m=m32.reshape(shape), v=v32.reshape(shape))


def write_staged(core, name: str, fmt: str, staged: Staged) -> None:
  """Writes a leaf's staged moments into the core: codes as they are, f32 values into the
  views, values for a compressed leaf encoded by the core (its rounding stream)."""
  if staged.codes:
    for view, codes in zip(core.moment_codes(name), (staged.m, staged.v, staged.scales)):
      if view is not None and codes is not None:  # (bf16: no exponent bytes)
        view[...] = (codes.view(np.uint16) if codes.dtype == BF16 else codes).reshape(view.shape)
  elif fmt == "f32":
    core.exp_avg(name)[...] = staged.m
    core.exp_avg_sq(name)[...] = staged.v
  else:
    core.write_moments(name, staged.m, staged.v)
