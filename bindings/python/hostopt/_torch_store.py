"""hostopt.torch's ``store=``: Adam/AdamW with the state on local drives (a
hostopt.StoredOptimizer), not in RAM.

The arena is laid out as the in-RAM path lays out one dtype's (groups and parameters in
reverse order, named "group.index"), so parameters of one dtype step to the in-RAM
optimizer's bits, compressed moments included, and its state_dict loads into either. Each
step gathers the gradients into one flat buffer in that layout, streams the store through the
fused step, and copies the new parameters back into each ``p`` (in its dtype). The store has
one step count: every step takes every parameter's gradient.
"""
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from . import StoredOptimizer as _StoredOptimizer
from . import _core
from ._arena import Segment
from ._arrays import as_buffer
from ._dtypes import kernel_tag, tag_of
from ._torch_state import MASTER, SCALES, arena_view, dense_order, flat, moment_keys

OPTION_KEYS = ("staging_bytes", "buffers", "chunk_elements", "sync", "io", "kernel")


def check_options(store, store_options: Optional[dict], resume: bool, offload, overlap: bool,
                  overlap_backward: bool) -> dict:
  """store=, store_options= and resume= checked before torch's __init__ (nothing made yet)."""
  if not isinstance(resume, bool):
    raise TypeError(f"resume: expected a bool, got {type(resume).__name__}")
  if store is None:
    if store_options is not None or resume:
      raise ValueError(f"{'store_options' if store_options is not None else 'resume=True'} without store=: name "
                       "the store's directory (or directories, one per drive)")
    return {}
  if offload is not None or overlap or overlap_backward:
    raise ValueError("store= with offload=, overlap= or overlap_backward=: not yet; the state on drives steps CPU "
                     "parameters (the offload pipeline does not stream from a store)")
  options = dict(store_options or {})
  unknown = set(options) - set(OPTION_KEYS)
  if unknown:
    raise ValueError(f"store_options: unknown {sorted(unknown)}; expected some of {sorted(OPTION_KEYS)} "
                     "(hostopt.StoredOptimizer's keywords)")
  if resume and "chunk_elements" in options:
    raise ValueError("store_options['chunk_elements'] with resume=True: a store keeps the chunking it was created "
                     "with")
  return options


class TorchStore:
  """The store of one hostopt.torch optimizer and the layout of its parameters in it."""

  def __init__(self, opt: Any, store, options: dict, resume: bool) -> None:
    self._opt = opt
    groups = opt.param_groups
    entries: List[Tuple[int, torch.Tensor]] = []
    seen = set()
    self._where: List[str] = []
    for gi, group in enumerate(groups):
      for pi, p in enumerate(group["params"]):
        where = f"param_groups[{gi}]['params'][{pi}]"
        if id(p) in seen:
          raise ValueError(f"{where} appears twice in the optimizer: duplicate parameters are refused")
        seen.add(id(p))
        if tag_of(p.dtype) is None:
          raise TypeError(f"{where} has dtype {p.dtype}: expected float32, bfloat16 or float16")
        if p.device.type != "cpu":
          raise ValueError(f"{where} is on {p.device}: store= steps CPU parameters (the offload pipeline does not "
                           "stream from a store yet)")
        if not dense_order(p):
          raise ValueError(f"{where} is a strided view with gaps or overlaps (strides {tuple(p.stride())}): "
                           "hostopt keeps each parameter in one dense slice")
        entries.append((gi, p))
        self._where.append(where)
    self._params = [p for _, p in entries]
    self._group_ids = [id(g) for g in groups]
    self._formats = [opt._group_format(g) for g in groups]
    # The in-RAM path's layout of one dtype (see _HostAdam._build): groups and parameters reversed.
    order = list(range(len(groups)))[::-1]
    self._core_group = {gi: j for j, gi in enumerate(order)}
    self._spec: List[Dict[str, Any]] = [
        {"config": opt._config(groups[gi], f"param_groups[{gi}]"), "tensors": [],
         "moments": self._formats[gi], "rounding_seed": int(groups[gi].get("rounding_seed", 0))} for gi in order]
    for k, (gi, p) in reversed(list(enumerate(entries))):
      self._spec[self._core_group[gi]]["tensors"].append((f"{gi}.{k}", [p.numel()]))
    segs, size = _core.arena_layout(self._spec)
    by_name = {x.name: x for x in (Segment(*s) for s in segs)}
    self._segs = [by_name[f"{gi}.{k}"] for k, (gi, _) in enumerate(entries)]
    self._size = size
    self._applied: Dict[int, dict] = {}  # core group -> the config last given to the store
    dirs = _StoredOptimizer._dirs(store)
    kernel = str(options.pop("kernel", ""))
    args = _StoredOptimizer._options(options.get("staging_bytes", 256 << 20), options.get("buffers", 8),
                                     options.get("chunk_elements", 0), options.get("sync", True),
                                     options.get("io", "auto"))
    if resume:
      self._core = _core.StoredOptimizer.open(self._spec, dirs, *args, opt._threads, kernel, None, False)
      self._put_params()  # the store's parameters: the last completed step
      # The hyper-parameters stay param_groups' (each step gives them to the store): an lr
      # scheduler's state, loaded, sets the next lr (the docstring says how), and a scheduler
      # made now takes the constructor's lr as its initial_lr, as in a fresh run.
    else:
      initial = np.zeros(size, np.float32)
      for s, p in zip(self._segs, self._params):
        initial[s.offset:s.offset + s.size] = flat(p.detach()).float().numpy()
      try:
        self._core = _core.StoredOptimizer.create(self._spec, dirs, *args, opt._threads, kernel, initial, None)
      except RuntimeError as e:
        if "a store exists" not in str(e):
          raise
        raise RuntimeError(f"{e} (resume=True continues it)") from None
    self._steps = np.zeros(len(self._params), np.float32)  # torch's per-parameter "step", one view each
    self._shown = False
    self._closed = False
    self._show()

  @property
  def core(self) -> Any:
    return self._core

  def close(self) -> None:
    self._core.close()
    self._closed = True

  def _check_open(self, what: str) -> None:
    if self._closed:
      raise ValueError(f"{what}: this optimizer's store is closed (close() was called); make the optimizer again "
                       "with resume=True to go on")

  def _show(self) -> None:
    """opt.state[p]["step"] of every parameter once stepped (views of one count: the store has one)."""
    count = self._core.step_count
    self._steps[:] = count
    if count and not self._shown:
      for k, p in enumerate(self._params):
        self._opt.state[p]["step"] = torch.from_numpy(self._steps[k:k + 1]).reshape(())
      self._shown = True

  def _put_params(self) -> None:
    """The store's parameters into each p (rounded to its dtype, as a step's copy-out)."""
    flat32 = np.zeros(self._size, np.float32)
    self._core.copy_params_to(flat32, "f32")
    for s, p in zip(self._segs, self._params):
      flat(p.data).copy_(torch.from_numpy(flat32[s.offset:s.offset + s.size]))

  def _check_unchanged(self) -> None:
    """The store's layout is fixed: the same groups, parameters and formats at every step."""
    groups = self._opt.param_groups
    now = [p for g in groups for p in g["params"]]
    if len(now) != len(self._params) or any(a is not b for a, b in zip(now, self._params)) or \
        [id(g) for g in groups] != self._group_ids:
      raise ValueError("param_groups changed (add_param_group, parameters added, replaced or removed, or some groups "
                       "stepped alone as DeepSpeed's ZeRO does): with store= the layout on the drives is fixed, every "
                       "step takes every group; nothing was stepped")
    for gi, g in enumerate(groups):
      if self._opt._group_format(g) != self._formats[gi]:
        raise ValueError(f"param_groups[{gi}] stores {self._opt._group_format(g)!r}, its parameters hold "
                         f"{self._formats[gi]!r} moments: a parameter's moment format is fixed; nothing was stepped")

  def step(self, skip: Optional[bool], grad_norm) -> Optional[Any]:
    """One step over every parameter; None where no parameter has a gradient (as torch)."""
    self._check_open("step")
    self._check_unchanged()
    grads = [p.grad for p in self._params]
    if all(g is None for g in grads):
      return None
    missing = [w for w, g in zip(self._where, grads) if g is None]
    if missing:
      raise ValueError(f"{missing[0]} has no gradient: with store= every step takes every parameter's gradient "
                       f"(the state streams through whole; {len(missing)} without one); nothing was stepped")
    for w, p, g in zip(self._where, self._params, grads):
      if g.layout != torch.strided:
        raise RuntimeError(f"{w} has a sparse gradient ({g.layout}): hostopt.torch does not support sparse "
                           "gradients; nothing was stepped")
      if tuple(g.shape) != tuple(p.shape) or g.device != p.device:
        raise ValueError(f"{w} has a gradient of shape {tuple(g.shape)} on {g.device}: expected the parameter's, "
                         f"{tuple(p.shape)} on {p.device}; nothing was stepped")
    configs = {self._core_group[gi]: self._opt._config(g, f"param_groups[{gi}]")
               for gi, g in enumerate(self._opt.param_groups)}  # lr schedulers take effect here
    if skip is None:
      skip = "8bit" in self._formats
    norm = self._opt._grad_norm() if skip else -1.0
    for j, cfg in configs.items():
      if self._applied.get(j) != cfg:
        self._core.set_group_config(j, cfg)
        self._applied[j] = cfg
    # One gradient dtype and one copy-out dtype per step: the parameters' own where they all
    # share one, else float32 (exact widening of each).
    kinds = {g.dtype for g in grads} | {p.dtype for p in self._params}
    dtype = kinds.pop() if len(kinds) == 1 else torch.float32
    flat_g = torch.zeros(self._size, dtype=dtype)
    for s, p, g in zip(self._segs, self._params, grads):
      if g.stride() != p.stride() or not dense_order(g):
        g = torch.empty_like(p).copy_(g)  # the parameter's memory order
      flat_g[s.offset:s.offset + s.size].copy_(flat(g))
    out = torch.empty(self._size, dtype=dtype)
    tag = kernel_tag(dtype)
    result = self._core.step_flat(as_buffer(flat_g, "grads")[0], tag, as_buffer(out, "out", writable=True)[0], tag,
                                  1.0, 0.0, bool(skip), float(norm))
    if result.applied:
      for s, p in zip(self._segs, self._params):
        flat(p.data).copy_(out[s.offset:s.offset + s.size])
    self._show()
    return result

  def state_dict_state(self) -> Dict[int, dict]:
    """torch's state_dict()["state"], exported through an in-RAM optimizer: the in-RAM path's
    entries (moments by format, 16-bit parameters' masters), so either path loads it."""
    self._check_open("state_dict")
    if not self._core.step_count:
      return {}  # (as torch: no entry for a parameter never stepped)
    ram = _core.Optimizer(self._spec, self._opt._threads, "")
    self._core.copy_state_to(ram)
    compressed = any(f != "f32" for f in self._formats)
    flat_m, flat_v = (None, None) if compressed else (ram.exp_avg(), ram.exp_avg_sq())
    flat_p = ram.params()
    state: Dict[int, dict] = {}
    gi_of = [gi for gi, g in enumerate(self._opt.param_groups) for _ in g["params"]]
    for k, (s, p) in enumerate(zip(self._segs, self._params)):
      fmt = self._formats[gi_of[k]]
      m, v, scales = self._opt._moment_views(ram, s.name, fmt, p, flat_m, flat_v, s.offset, s.size)
      st: Dict[str, Any] = {"step": torch.tensor(float(self._core.step_count))}
      st.update(zip(moment_keys(fmt), (m.clone(), v.clone())))
      if scales is not None:
        st[SCALES] = scales.clone()
      if p.dtype != torch.float32:
        st[MASTER] = arena_view(flat_p[s.offset:s.offset + s.size], p).clone()
      state[k] = st
    return state
