"""hostopt.torch's state as torch sees it, apart from the optimizer: opt.state's keys per
moment format, the checks of a parameter's state entries and of a param group's
hyper-parameters (torch's keys, the core's rules), the conversion of a state's moments
between formats (through _moments), tensors as the arena lays them out, and the layout's
records (Tracked per parameter, Layout per parameter dtype).
"""

import dataclasses
import math
from typing import Any, List, Optional, Tuple

import numpy as np
import torch

from . import _core, _moments
from ._arrays import power_text
from ._hyper import AdamHyperParameters
from ._torch_offload import DeviceBuffers

MOMENTS = ("exp_avg", "exp_avg_sq")
MASTER = "master_param"  # f32 master weights of a 16-bit parameter, in state_dict
# Compressed moments (a group's ``moments="bf16"`` or ``"8bit"``; the format is the
# group's, in param_groups, which torch keeps as given). bf16 moments are values: bfloat16
# tensors under torch's keys. 8-bit ones are codes, under keys of their own (so torch.optim,
# loading such a state, fails loudly instead of taking codes for moments), with the blocks'
# exponent bytes; a block is 32 elements of the parameter's memory order.
CODES = ("exp_avg_codes", "exp_avg_sq_codes")
SCALES = "moment_scales"
MOMENT_ENTRIES = MOMENTS + CODES + (SCALES,)  # every key a format may hold its moments under
MAX_STEP = _core.MAX_STEP_COUNT


def moment_keys(fmt: str) -> Tuple[str, str]:
  """The keys of a format's moments (values, or 8-bit codes) in opt.state[p]."""
  return CODES if fmt == "8bit" else MOMENTS


# --- tensors as the arena lays them out ----------------------------------------------------

def dense_order(t: torch.Tensor) -> bool:
  """Whether t's elements fill its memory without gaps or overlaps (any dim order)."""
  if t.numel() == 0:
    return True
  expected = 1
  for size, stride in sorted(zip(t.shape, t.stride()), key=lambda x: x[1]):
    if size == 1:
      continue
    if stride != expected:
      return False
    expected *= size
  return True


def flat(t: torch.Tensor) -> torch.Tensor:
  """A 1-D view of a dense tensor's elements in memory order (no copy)."""
  if t.is_contiguous():
    return t.reshape(-1)
  return t.as_strided((t.numel(),), (1,), t.storage_offset())


def arena_view(flat_slice, like: torch.Tensor) -> torch.Tensor:
  """The arena slice `flat_slice` (numpy, or a flat tensor) viewed with `like`'s shape and
  memory layout."""
  t = flat_slice if torch.is_tensor(flat_slice) else torch.from_numpy(flat_slice)
  if like.is_contiguous() or not dense_order(like):
    return t.view(like.shape)
  return t.as_strided(like.shape, like.stride())


def same_memory_order(a: torch.Tensor, b: torch.Tensor) -> bool:
  """Whether element k of a's memory is the same logical element as b's (8-bit blocks follow memory)."""
  if a.numel() != b.numel():
    return False
  return (a.is_contiguous() and b.is_contiguous()) or (tuple(a.shape) == tuple(b.shape) and a.stride() == b.stride())


def rounds_to(master: torch.Tensor, p: torch.Tensor) -> bool:
  """Whether the f32 master still stands for the 16-bit parameter (rounds to its values)."""
  return tuple(master.shape) == tuple(p.shape) and torch.equal(master.detach().to(p.dtype), p.detach())


# --- checks of state entries and hyper-parameters ------------------------------------------

def check_moment_state(st: dict, fmt: str, like: torch.Tensor, where: str) -> bool:
  """Checks that the moments in a parameter's state are `fmt` moments fitting `like` (a
  missing moment is zeros, as a deleted one in torch's optimizers restarts). Refused with the
  reason otherwise, before anything changes. Returns whether 8-bit codes are laid out in
  another memory order than `like` (their blocks are not its blocks)."""
  own = moment_keys(fmt) + ((SCALES,) if fmt == "8bit" else ())
  foreign = [key for key in MOMENT_ENTRIES if key in st and key not in own]
  if foreign:
    held = "8-bit codes" if any(key in st for key in CODES) else "moment values"
    raise ValueError(f"{where}: {', '.join(foreign)} in the state: it holds {held}, but its moments are {fmt} "
                     f"(keys {', '.join(own)})")
  numel = like.numel()
  for key in moment_keys(fmt):
    value = st.get(key)
    if value is None:
      continue
    if not torch.is_tensor(value) or value.numel() != numel:
      raise ValueError(f"{where}: {key} has {value.numel() if torch.is_tensor(value) else 'no'} elements, the "
                       f"parameter {numel}")
    if value.layout != torch.strided:
      raise ValueError(f"{where}: {key} is a {value.layout} tensor: moments are dense (strided) tensors")
    if fmt == "8bit" and value.dtype != torch.uint8:
      raise ValueError(f"{where}: {key} has dtype {value.dtype}: 8bit moments are torch.uint8 codes")
    if fmt != "8bit" and not value.is_floating_point():
      raise ValueError(f"{where}: {key} has dtype {value.dtype}: {fmt} moments are floating-point values")
    if fmt == "8bit" and not dense_order(value):
      raise ValueError(f"{where}: {key} is not dense: 8-bit codes are blocks of memory order")
    if tuple(value.shape) != tuple(like.shape):
      raise ValueError(f"{where}: {key} has shape {tuple(value.shape)}, the parameter {tuple(like.shape)}")
    if key == "exp_avg_sq" and bool((value.detach() < 0).any()):
      raise ValueError(f"{where}: exp_avg_sq has negative entries: a second moment is never negative")
  codes = [st[key] for key in CODES if fmt == "8bit" and st.get(key) is not None]
  if codes:
    scales: Any = st.get(SCALES)
    blocks = _moments.q8_blocks(numel)
    if not torch.is_tensor(scales) or scales.layout != torch.strided or scales.dtype != torch.uint8 or (
        scales.numel() != 2 * blocks):
      raise ValueError(f"{where}: 8-bit moments need {SCALES!r}, uint8 with {2 * blocks} elements (2 per block "
                       f"of 32), got " + (f"{scales.dtype} with {scales.numel()}" if torch.is_tensor(scales)
                                          else "none"))
    _moments.check_q8_scales(scales.detach().cpu().numpy(), f"{where}: {SCALES}")
    first, *others = codes
    if any(not same_memory_order(first, c) for c in others):
      raise ValueError(f"{where}: {' and '.join(CODES)} are laid out differently")
  return any(not same_memory_order(c, like) for c in codes)


def check_step(value, where: str) -> int:
  """A saved per-parameter step: a count in [0, 2^53] (the core's largest), as an int, an
  integral float or a one-element real tensor holding one. Refused otherwise (2.5 is not
  truncated, NaN or -1 not taken for 0)."""
  x = value
  if torch.is_tensor(value) and value.numel() == 1 and not value.is_complex() and value.dtype != torch.bool:
    x = value.item()
  if isinstance(x, bool) or not isinstance(x, (int, float, np.integer, np.floating)) or (
      isinstance(x, (float, np.floating)) and not (math.isfinite(x) and float(x).is_integer())) or not (
      0 <= x <= MAX_STEP):
    shown = f"tensor({value.tolist()})" if torch.is_tensor(value) else repr(value)
    raise ValueError(f"{where} = {shown}: a step count is an integer in [0, {power_text(MAX_STEP)}] (an int, or a "
                     "one-element tensor holding one)")
  return int(x)


def check_master(value, like: torch.Tensor, where: str) -> None:
  """A parameter's saved f32 master weights: float32 (or the parameter's own dtype, as
  torch.optim casts them) with the parameter's shape. Refused otherwise, never ignored."""
  if not torch.is_tensor(value) or value.layout != torch.strided or value.dtype not in (torch.float32, like.dtype) or (
      tuple(value.shape) != tuple(like.shape)):
    got = (f"{value.dtype} {tuple(value.shape)}" + ("" if value.layout == torch.strided else f" {value.layout}")
           if torch.is_tensor(value) else type(value).__name__)
    raise ValueError(f"{where}: {MASTER} is {got}: expected the master weights, float32 with the parameter's shape "
                     f"{tuple(like.shape)}")


def hyper_parameters(group: dict, where: str) -> AdamHyperParameters:
  """A param group's hyper-parameters as a step uses them, checked by the core's rule: lr,
  eps and weight_decay finite and >= 0, betas two values in [0, 1). Refused by torch's key
  otherwise (no step could use them)."""
  def number(key, value):
    try:
      return float(value)
    except (TypeError, ValueError):
      raise ValueError(f"{where}['{key}'] = {value!r}: expected a number") from None

  values = {}
  for key in ("lr", "eps", "weight_decay"):
    if key not in group:
      raise ValueError(f"{where} has no {key!r}")
    values[key] = number(key, group[key])
  betas: Any = group.get("betas")
  try:
    b = [number("betas", x) for x in betas]
  except TypeError:
    b = []
  two_betas = f"{where}['betas'] = {betas!r}: expected two values in [0, 1)"
  if len(b) != 2:
    raise ValueError(two_betas)
  beta1, beta2 = b
  hyper = AdamHyperParameters(beta1=beta1, beta2=beta2, **values)
  refused = hyper.refused()
  for key in ("lr", "eps", "weight_decay"):
    if key in refused:
      raise ValueError(f"{where}['{key}'] = {group[key]!r}: expected a finite value >= 0")
  if "beta1" in refused or "beta2" in refused:
    raise ValueError(two_betas)
  return hyper


# --- conversions between formats -------------------------------------------------------------

def moments_as_f32(st: dict, fmt: str, like: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
  """A (checked) state's `fmt` moments as float32 tensors of like's shape (zeros where one
  is missing; 8-bit codes decode in their memory order, the order of their blocks)."""
  m, v = (st.get(key) for key in moment_keys(fmt))
  if m is None and v is None:
    return torch.zeros(like.shape), torch.zeros(like.shape)
  if fmt != "8bit":  # values: widened (or cast) by torch
    as_f32 = lambda x: x.detach().cpu().float().reshape(like.shape) if x is not None else torch.zeros(like.shape)
    return as_f32(m), as_f32(v)
  layout = next(x for x in (m, v) if x is not None).detach().cpu()
  codes = lambda x: (flat(x.detach().cpu()).numpy() if x is not None
                     else np.zeros(like.numel(), _moments.CODE_DTYPES["8bit"]))
  m32, v32 = _moments.as_f32("8bit", codes(m), codes(v), st[SCALES].detach().cpu().numpy())
  back = lambda x: torch.from_numpy(x).as_strided(layout.shape, layout.stride()).reshape(like.shape)
  return back(m32), back(v32)


def encoded(m32: torch.Tensor, v32: torch.Tensor, fmt: str, like: torch.Tensor, seed: int) -> dict:
  """f32 moments (like's shape) as `fmt` state entries laid out like `like` (stochastically
  rounded with `seed`: the lossy direction of a conversion)."""
  if fmt == "f32":
    return {"exp_avg": m32.clone(), "exp_avg_sq": v32.clone()}
  tm = torch.empty_like(like, dtype=torch.float32, device="cpu").copy_(m32)
  tv = torch.empty_like(like, dtype=torch.float32, device="cpu").copy_(v32)
  cm, cv, scales = _moments.encode(flat(tm).numpy(), flat(tv).numpy(), fmt, seed)
  if fmt == "bf16":  # (torch 1 has no uint16)
    return {key: arena_view(torch.from_numpy(c.view(np.int16)).view(torch.bfloat16), like)
            for key, c in zip(MOMENTS, (cm, cv))}
  out = {key: arena_view(c, like) for key, c in zip(CODES, (cm, cv))}
  out[SCALES] = torch.from_numpy(scales).view(-1, 2)
  return out


# --- the layout's records --------------------------------------------------------------------

class Tracked:
  """What hostopt knows of one parameter: its arena slices, the tensors it handed out (the
  master, the moments, the step) and what the parameter's storage looked like after
  hostopt last wrote it (to notice the user's replacements)."""
  __slots__ = ("param", "flat", "master", "m", "v", "step", "ptr", "version", "dtype", "shape", "stride",
               "device_view", "grad_view", "where", "scales", "format", "name", "group")

  def __init__(self, param, flat, master, m, v, step, device_view=None, grad_view=None, scales=None, format="f32"):
    self.param, self.flat, self.master, self.m, self.v, self.step = param, flat, master, m, v, step
    self.scales, self.format = scales, format  # compressed moments: m, v are code views
    # Offloaded: the parameter is a view of the flat device buffer the pipeline writes,
    # its gradient is gathered into the flat device gradient buffer.
    self.device_view, self.grad_view = device_view, grad_view
    self.where = self.name = ""  # its place in param_groups, and its tensor's name in the core
    self.group = 0  # its param group (torch's index)
    self.remember()

  def remember(self) -> None:
    p = self.param
    self.ptr, self.version, self.dtype = p.data_ptr(), p._version, p.dtype
    self.shape, self.stride = tuple(p.shape), tuple(p.stride())


@dataclasses.dataclass
class Layout:
  """One dtype's parameters as built: their core, what hostopt knows of each, and torch's
  per-parameter step counts (views of `steps`, one per parameter)."""
  core: Any  # the _core.Optimizer of these parameters
  tracked: List[Tracked]  # one per parameter, in param_groups order (k below)
  steps: np.ndarray  # float32 [len(tracked)]: torch's "step" of each (opt.state[p]["step"] views)
  seg_of: List[int]  # the core's segment of tracked[k]
  known: List[float]  # steps as hostopt last wrote them: a difference is the user's write
  dev: Optional[DeviceBuffers]  # the offloaded path's buffers (None: stepped in place)
