"""hostopt.torch over DTensor parameters (FSDP2's ``fully_shard``, tensor parallelism): each
rank steps its own local shards, and opt.state shows DTensors, so torch.distributed.checkpoint
saves and loads the state sharded, as it does torch.optim's.

A DTensor parameter's values are its local shard, and the engine reads that storage (FSDP2
all-gathers from it), so hostopt cannot make the parameter a view of its arena as it does a
plain CPU parameter. Each DTensor parameter gets a stand-in instead: a plain parameter of the
local shard's shape, which an inner hostopt optimizer (the same class, the same groups) trains
as any other (its f32 master is the arena); after each step the result is copied into the local
shard, in place. That costs one copy per step and the shard's own storage beside the arena (16
bytes per f32 parameter with f32 moments, where a plain CPU parameter takes 12). Plain
parameters in the same optimizer are the inner's own, stepped in place as always.

Before each step the stand-ins take what the caller did: new local values (a checkpoint loaded
into the model, FSDP2 re-padding its shards), the gradients' local shards (redistributed to the
parameter's placements first where they differ), the param groups' hyper-parameters and
parameter lists, and entries written to opt.state.
"""

import math
from typing import Any, Dict, List, Optional

import torch

from . import _moments
from ._torch_state import SCALES


def dtensor_type() -> Optional[type]:
  """torch's DTensor class, or None where this torch has none (torch 1.x)."""
  try:
    from torch.distributed.tensor import DTensor  # torch >= 2.4
    return DTensor
  except ImportError:
    try:
      from torch.distributed._tensor import DTensor  # torch 2.0 - 2.3
      return DTensor
    except ImportError:
      return None


def any_dtensor(groups: List[dict]) -> bool:
  cls = dtensor_type()
  return cls is not None and any(isinstance(p, cls) for g in groups for p in g["params"])


def _shard_type():
  try:
    from torch.distributed.tensor import Shard
  except ImportError:
    from torch.distributed._tensor import Shard  # (torch 2.0 - 2.3)
  return Shard


def _largest_local_numel(p) -> int:
  """An upper bound of the local shard's size on every rank (torch.chunk's split: the first
  chunks are the largest)."""
  shape = list(p.shape)
  shard = _shard_type()
  for i, placement in enumerate(p.placements):
    if isinstance(placement, shard):
      shape[placement.dim] = -(-shape[placement.dim] // p.device_mesh.size(i))
  return math.prod(shape)


class _StandIn:
  """One DTensor parameter's stand-in, and its opt.state entries as last shown."""
  __slots__ = ("param", "local", "shown")

  def __init__(self, param, local: torch.Tensor):
    self.param, self.local = param, local
    self.shown: Dict[str, Any] = {}  # opt.state[param] entries as last shown (to notice the user's writes)


class LocalShards:
  """The outer optimizer's DTensor parameters, stepped by an inner optimizer over stand-ins."""

  def __init__(self, outer, make_inner):
    self._outer = outer
    self._stand_ins: Dict[int, _StandIn] = {}  # id(DTensor parameter) -> its stand-in
    self._cls = dtensor_type()
    self.inner = make_inner([self._inner_group(g, f"param_groups[{gi}]") for gi, g in enumerate(outer.param_groups)])

  # --- stand-ins ---------------------------------------------------------------------------
  def _is_dtensor(self, p) -> bool:
    return self._cls is not None and isinstance(p, self._cls)

  def _local_of(self, p, where: str):
    """p's stand-in (made at its first sight), or p itself where it is a plain tensor."""
    if not self._is_dtensor(p):
      return p
    s = self._stand_ins.get(id(p))
    if s is None:
      with torch.no_grad():
        shard = p.to_local()
        if shard.layout != torch.strided:
          raise ValueError(f"{where} is a DTensor whose local shard is {shard.layout}: hostopt steps dense shards")
        local = torch.nn.Parameter(shard.detach().clone(), requires_grad=p.requires_grad)
      s = _StandIn(p, local)
      self._stand_ins[id(p)] = s
    return s.local

  def _inner_group(self, group: dict, where: str) -> dict:
    inner = {key: value for key, value in group.items() if key != "params"}
    inner["params"] = [self._local_of(p, f"{where}['params'][{k}]") for k, p in enumerate(group["params"])]
    return inner

  def add_group(self, group: dict) -> None:
    self.inner.add_param_group(self._inner_group(group, f"param_groups[{len(self.inner.param_groups)}]"))

  # --- the step ----------------------------------------------------------------------------
  def step(self) -> None:
    outer, inner = self._outer, self.inner
    with inner._lock:
      inner._drain()
      self._take_groups()
      self._take_written_state()
      stepped = self._take_params_and_grads()
      try:
        inner._step()
      finally:
        for s in stepped:
          s.local.grad = None  # (the caller's gradient shards are not kept alive:
        inner._views = {}  # its view cache too, which never hits here: to_local() is a new tensor each step)
      with torch.no_grad():
        for s in stepped:  # the result into the shards the engine reads, in place
          shard = s.param.to_local()
          shard.copy_(s.local)
      self._show_state()
      outer.last_step = inner.last_step

  def _take_groups(self) -> None:
    """The outer param groups' hyper-parameters and parameter lists, as the caller left them."""
    outer, inner = self._outer.param_groups, self.inner.param_groups
    if len(outer) != len(inner):
      raise ValueError(f"param_groups has {len(outer)} groups, the optimizer was given {len(inner)}: add groups "
                       "with add_param_group (hostopt steps the local shards of the groups it was given)")
    for gi, (og, ig) in enumerate(zip(outer, inner)):
      for key, value in og.items():
        if key != "params":
          ig[key] = value
      params = og["params"]
      if len(params) != len(ig["params"]) or any(
          self._local_of(p, "") is not q for p, q in zip(params, ig["params"])):
        ig["params"] = [self._local_of(p, f"param_groups[{gi}]['params'][{k}]") for k, p in enumerate(params)]

  def _stand_ins_of(self) -> List[_StandIn]:
    return [self._stand_ins[id(p)] for g in self._outer.param_groups for p in g["params"] if self._is_dtensor(p)]

  def _take_params_and_grads(self) -> List[_StandIn]:
    """Every check first (nothing is changed by a refused step), then each stand-in takes its
    shard's new values and its gradient's local shard. Returns the stand-ins with a gradient."""
    found = []
    for gi, group in enumerate(self._outer.param_groups):
      for k, p in enumerate(group["params"]):
        if not self._is_dtensor(p):
          continue
        where = f"param_groups[{gi}]['params'][{k}]"
        s = self._stand_ins[id(p)]
        shard = p.to_local()
        if tuple(shard.shape) != tuple(s.local.shape) or shard.dtype != s.local.dtype:
          raise ValueError(f"{where}: its local shard changed from {tuple(s.local.shape)} {s.local.dtype} to "
                           f"{tuple(shard.shape)} {shard.dtype} after it was given to the optimizer (resharded): "
                           "make a new optimizer, or load a state into one")
        g = p.grad
        if g is not None:
          if not self._is_dtensor(g):
            raise ValueError(f"{where} is a DTensor but its gradient is a plain {type(g).__name__}: expected a "
                             "DTensor on the parameter's mesh; nothing was stepped")
          if g.device_mesh != p.device_mesh or tuple(g.shape) != tuple(p.shape):
            raise ValueError(f"{where} has a gradient of shape {tuple(g.shape)} on {g.device_mesh}: expected the "
                             f"parameter's, {tuple(p.shape)} on {p.device_mesh}; nothing was stepped")
        found.append((s, shard, g))
    stepped = []
    with torch.no_grad():
      for s, shard, g in found:
        # Written by the caller since the last step (a checkpoint loaded, a re-init)? Compared, not
        # told by the version counter: torch.distributed.checkpoint loads into the shard unseen.
        if not torch.equal(shard, s.local):
          s.local.copy_(shard)
        if g is not None and tuple(g.placements) != tuple(s.param.placements):
          g = g.redistribute(s.param.device_mesh, s.param.placements)
        s.local.grad = None if g is None else g.to_local()
        if g is not None:
          stepped.append(s)
    return stepped

  # --- opt.state, as DTensors --------------------------------------------------------------
  def _wrap(self, key: str, value, s: _StandIn):
    """An inner state entry of a stand-in as the outer shows it: a DTensor laid out as the
    parameter (8-bit blocks' scales: sharded by rows, padded to the largest shard's count)."""
    if not torch.is_tensor(value) or key == "step":
      return value
    old = s.shown.get(key)
    if old is not None and self._is_dtensor(old) and old._local_tensor is value:
      return old
    p = s.param
    with torch.no_grad():
      if key == SCALES:
        rows = _moments.q8_blocks(_largest_local_numel(p))
        local = value.reshape(-1, 2)
        if local.shape[0] < rows:
          local = torch.cat([local, local.new_zeros(rows - local.shape[0], 2)])
        shard = _shard_type()
        placements = [shard(0) if isinstance(pl, shard) else pl for pl in p.placements]
        ranks = math.prod(p.device_mesh.size(i) for i, pl in enumerate(p.placements) if isinstance(pl, shard))
        return self._cls.from_local(local, p.device_mesh, placements, run_check=False, shape=(rows * ranks, 2),
                                    stride=(2, 1))
      if tuple(value.shape) != tuple(s.local.shape):
        return value
      return self._cls.from_local(value, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                  stride=p.stride())

  def _unwrap(self, key: str, value, s: _StandIn):
    """An outer state entry (a DTensor, or a plain tensor) as the stand-in's local one."""
    if not self._is_dtensor(value):
      return value
    with torch.no_grad():
      if key == SCALES:  # (sharded by rows as _wrap shows them: the first rows are this rank's blocks)
        return value.to_local().reshape(-1, 2)[:_moments.q8_blocks(s.local.numel())]
      if tuple(value.placements) != tuple(s.param.placements):
        value = value.redistribute(s.param.device_mesh, s.param.placements)
      local = value.to_local()
    return local

  def _show_state(self) -> None:
    """opt.state[p] of each parameter from the inner's: the same dict for a plain parameter,
    DTensor views of the stand-in's entries for a DTensor one."""
    outer_state, inner_state = self._outer.state, self.inner.state
    for group in self._outer.param_groups:
      for p in group["params"]:
        if not self._is_dtensor(p):
          if p in inner_state:
            outer_state[p] = inner_state[p]
          continue
        s = self._stand_ins[id(p)]
        st = inner_state.get(s.local)
        if not st:
          if s.shown:
            outer_state.pop(p, None)
            s.shown = {}
          continue
        shown = {key: self._wrap(key, value, s) for key, value in st.items()}
        outer_state[p] = dict(shown)
        s.shown = shown

  def _take_written_state(self) -> None:
    """Entries the caller replaced, added or deleted in opt.state[p] since they were shown go
    to the inner's state (checked and taken by its step, as any written state)."""
    outer_state, inner_state = self._outer.state, self.inner.state
    for group in self._outer.param_groups:
      for p in group["params"]:
        if not self._is_dtensor(p):
          st = outer_state.get(p)
          if st is not None and st is not inner_state.get(p):
            inner_state[p] = st
          continue
        s = self._stand_ins[id(p)]
        st = outer_state.get(p)
        if st is None:
          st = {}
        if st.keys() == s.shown.keys() and all(st[key] is s.shown[key] for key in st):
          continue
        inner = inner_state[s.local]
        for key in [key for key in inner if key not in st]:
          del inner[key]
        for key, value in st.items():
          if s.shown.get(key) is not value:
            inner[key] = self._unwrap(key, value, s)
        s.shown = dict(st)

  # --- state_dict ------------------------------------------------------------------------
  def refresh(self) -> None:
    with self.inner._lock:
      self.inner._drain()
      self._take_written_state()
      self._show_state()

  def load_state_dict(self, state_dict: dict, convert_moments: bool) -> None:
    """Loads through the inner optimizer (every check before anything changes), with each
    DTensor entry taken as its local shard."""
    params = [p for g in self._outer.param_groups for p in g["params"]]
    ids = [i for g in state_dict["param_groups"] for i in g["params"]]
    local_state = {}
    by_index = dict(zip(ids, params))
    for index, st in state_dict["state"].items():
      p = by_index.get(index)
      if p is None or not self._is_dtensor(p):
        local_state[index] = st
        continue
      s = self._stand_ins[id(p)]
      local_state[index] = {key: self._unwrap(key, value, s) for key, value in st.items()}
    with self.inner._lock:
      self.inner._drain()
      self._take_groups()
      self.inner.load_state_dict(dict(state_dict, state=local_state), convert_moments=convert_moments)
      for og, ig in zip(self._outer.param_groups, self.inner.param_groups):
        og.update({key: value for key, value in ig.items() if key != "params"})
      for p in params:
        self._outer.state.pop(p, None)
      for s in self._stand_ins.values():
        s.shown = {}
      self._show_state()

