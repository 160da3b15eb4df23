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

import functools
import math
import os
import re
import shutil
import traceback
import weakref
from typing import Any, Dict, List, Optional

import torch

from . import StoredOptimizer, _moments
from ._torch_agreement import Agreement
from ._torch_state import SCALES
from ._torch_store import TorchStore


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


def _scale_layout(p):
  """How opt.state shows a DTensor parameter's 8-bit block scales: one row of blocks per shard
  (the blocks are the shard's, so they cannot be resharded), (shards, blocks, 2) sharded over
  dim 0 where the parameter is sharded; its global shape differs at another world size, so a
  checkpoint of another one is refused, not loaded misaligned. Returns (shards, blocks per
  shard, placements, this rank's shard index)."""
  shard = _shard_type()
  sharded = [i for i, pl in enumerate(p.placements) if _is_sharded(pl)]
  mesh = p.device_mesh
  placements = [shard(0) if i in sharded else pl for i, pl in enumerate(p.placements)]
  coordinate = mesh.get_coordinate() or [0] * mesh.ndim
  index = 0
  for i in sharded:
    index = index * mesh.size(i) + coordinate[i]
  shards = math.prod(mesh.size(i) for i in sharded)
  return shards, _moments.q8_blocks(_largest_local_numel(p)), placements, index


def _shard_box(p) -> List[int]:
  """This rank's shard of DTensor p as a box in the whole tensor: its local shape, then its
  offset (8-bit moments' blocks are 32 consecutive elements of the local shard, so state saved
  from another box is not this shard's)."""
  try:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
  except ImportError:  # (older torch: the local shape alone)
    shape, offset = p.to_local().shape, [0] * p.dim()
  return [int(n) for n in shape] + [int(o) for o in offset]


def _is_sharded(placement) -> bool:
  """Whether a mesh dimension splits the tensor: Shard, and FSDP2's _StridedShard (under tensor
  parallelism), which is not a Shard subclass in every torch."""
  return not placement.is_replicate() and not placement.is_partial()


def _largest_local_numel(p) -> int:
  """An upper bound of the local shard's size on every rank, the same on every rank
  (torch.chunk's split: the first chunks are the largest; a strided shard's pieces are not
  bounded so simply: its dimension counts whole, a few more rows of scales)."""
  shape = list(p.shape)
  shard = _shard_type()
  for i, placement in enumerate(p.placements):
    if type(placement) is shard:
      shape[placement.dim] = -(-shape[placement.dim] // p.device_mesh.size(i))
  return math.prod(shape)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
  """Bit for bit (torch.equal is False where both hold the same NaN)."""
  if a.is_floating_point() and a.element_size() in _BITS:
    bits = _BITS[a.element_size()]
    return torch.equal(a.view(bits), b.view(bits))
  return torch.equal(a, b)


_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}

SHARDS = "moment_shards"  # opt.state key of an 8-bit DTensor parameter's shard boxes (LocalShards._box_of)
_RESHARD = ("8-bit moments resume only at the world size and sharding they were saved with (their blocks are the "
            "shards'); to reshard, load them where they were saved into an optimizer with f32 moments "
            "(convert_moments=True), save that, and load it here")


def _releasing(method):
  """`method`'s errors leave no reference cycle: the finished frames they passed hold them
  (the agreement's `refusal` locals), and a cycle would keep the optimizer, and a store's
  lock, alive after the caller dropped it, until a collection."""

  @functools.wraps(method)
  def wrapper(self, *args, **kwargs):
    try:
      return method(self, *args, **kwargs)
    except BaseException as e:
      traceback.clear_frames(e.__traceback__)
      raise

  return wrapper


class _StandIn:
  """One DTensor parameter's stand-in, and its opt.state entries as last shown."""
  __slots__ = ("param", "local", "shown", "box", "sources")

  def __init__(self, param, local: torch.Tensor):
    self.param, self.local = param, local
    self.sources: Dict[str, Any] = {}  # the inner tensor each shown DTensor was made from (_wrap's cache)
    self.box = None  # opt.state[param][SHARDS] as shown (8-bit moments only)
    self.shown: Dict[str, Any] = {}  # opt.state[param] entries as last shown (to notice the user's writes)


class LocalShards:
  """The outer optimizer's DTensor parameters, stepped by an inner optimizer over stand-ins."""

  def __init__(self, outer, make_inner):
    # A weak reference: the outer optimizer holds this, and a cycle would keep the inner's store
    # (and its lock) open after the optimizer is dropped, until a collection.
    self._outer = weakref.proxy(outer)
    self._stand_ins: Dict[int, _StandIn] = {}  # id(DTensor parameter) -> its stand-in
    self._stand_in_of: Dict[int, _StandIn] = {}  # id(stand-in) -> it
    self._agreement_of: Optional[Agreement] = None  # over the DTensors' ranks (_agreement)
    self._agreement_key: Any = None  # (their meshes, when it was made)
    self._cls = dtensor_type()
    self._diverged: Optional[str] = None  # store=: why the ranks' stores may be a step apart (steps refused)
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
      self._stand_in_of[id(local)] = s
    return s.local

  def _inner_group(self, group: dict, where: str) -> dict:
    inner = {key: value for key, value in group.items() if key != "params"}
    inner["params"] = [self._local_of(p, f"{where}['params'][{k}]") for k, p in enumerate(group["params"])]
    return inner

  def add_group(self, group: dict) -> None:
    self.inner.add_param_group(self._inner_group(group, f"param_groups[{len(self.inner.param_groups)}]"))

  def _drop_removed(self) -> None:
    """Forgets the stand-ins of DTensor parameters no longer in any group (as the inner
    optimizer forgets their state when it rebuilds), so they do not keep a shard's copy alive."""
    present = {id(p) for g in self._outer.param_groups for p in g["params"]}
    for key in [key for key in self._stand_ins if key not in present]:
      s = self._stand_ins.pop(key)
      self._stand_in_of.pop(id(s.local), None)
      self._outer.state.pop(s.param, None)

  # --- the step ----------------------------------------------------------------------------
  @_releasing
  def step(self) -> None:
    """Every rank checks what it was given, then the ranks agree (Agreement) before anything
    changes: a step refused on any rank is refused on every rank, and a parameter has a
    gradient on every rank or on none. Then, alike on every rank, the gradients are
    redistributed to their parameters' placements where they differ (a collective), the step
    is checked again (written state, hyper-parameters), and the ranks agree once more, on that
    and on the global gradient norm for the non-finite check, so every rank skips or applies
    the same step. Then each rank steps its shards."""
    outer, inner = self._outer, self.inner
    if self._diverged is not None:
      raise RuntimeError(f"step: {self._diverged}")
    with inner._lock:
      inner._drain()
      try:
        stepped = self._agreed_step()
      finally:
        for s in self._stand_ins.values():
          s.local.grad = None  # (the caller's gradient shards are not kept alive:
        inner._views = {}  # its view cache too, which never hits here: to_local() is a new tensor each step)
      with torch.no_grad():
        for s in stepped:  # the result into the shards the engine reads, in place
          shard = s.param.to_local()
          shard.copy_(s.local)
      self._show_state()
      outer.last_step = inner.last_step

  def _dtensors(self) -> list:
    """(where, parameter) of each DTensor parameter, in param_groups' order."""
    return [(f"param_groups[{gi}]['params'][{k}]", p) for gi, g in enumerate(self._outer.param_groups)
            for k, p in enumerate(g["params"]) if self._is_dtensor(p)]

  def _agreement(self, dtensors: Optional[list] = None) -> Optional[Agreement]:
    """The agreement over the DTensor parameters' ranks (found again when they change), or None
    where there is none. `dtensors`: _dtensors(), where the caller has it."""
    meshes: list = []
    for _, p in self._dtensors() if dtensors is None else dtensors:
      if not any(p.device_mesh is m for m in meshes):
        meshes.append(p.device_mesh)
    if not meshes:
      return None
    key = tuple(id(m) for m in meshes)
    if self._agreement_key != key:
      self._agreement_of, self._agreement_key = Agreement(meshes), key
    return self._agreement_of

  def _agreed_step(self) -> List[_StandIn]:
    inner = self.inner
    dtensors = self._dtensors()  # (one walk of param_groups per step: _take_groups changes no list)
    agreement = self._agreement(dtensors)
    refusal, found = None, []
    try:  # this rank's checks: nothing changed, no collective
      self._take_groups()
      found = self._check_params_and_grads(dtensors)
      self._check_written_state()
    except BaseException as e:  # (told to every rank, then raised)
      refusal = e
    if agreement is None:
      if refusal is not None:
        raise refusal
    else:
      counts = agreement.reduce(refusal, [float(p.grad is not None) for _, p in dtensors], "the step")
      some = [(where, int(c)) for (where, _), c in zip(dtensors, counts.tolist()) if 0 < c < agreement.size]
      if some:
        where, c = some[0]
        raise ValueError(f"{where} has a gradient on {c} of the {agreement.size} ranks and none on the others (each "
                         "rank needs its shard's gradient, or none does): nothing was stepped on any rank")
    refusal, plan, sum_sq, stepped = None, None, 0.0, []
    store = inner._store  # (store=: this rank's store steps; None where no held tensor has a gradient)
    try:  # alike on every rank
      stepped = self._take_params_and_grads(found)
      self._take_written_state()
      plan = inner._prepare_step() if store is None else store.prepare(inner._skip_nonfinite)
      if plan is not None and plan.skip:
        sum_sq = self._local_sum_of_squares(agreement)
    except BaseException as e:
      refusal = e
    if agreement is None:
      if refusal is not None:
        raise refusal
      self._run(plan, math.sqrt(sum_sq) if plan is not None and plan.skip else None)
      return stepped
    skip, total, planned = agreement.reduce(
        refusal, [float(plan is not None and plan.skip), sum_sq, float(plan is not None)], "the step").tolist()
    if store is not None and 0 < planned < agreement.size:  # (alike on every rank: told the count)
      raise ValueError(f"with store= every rank commits every step, and {agreement.size - int(planned)} of the "
                       f"{agreement.size} ranks hold no parameter with a gradient in this one (a plain parameter's "
                       "gradient on some ranks only?): nothing was stepped on any rank")
    failure = None
    try:
      self._run(None if plan is None else plan._replace(skip=skip > 0), math.sqrt(total) if skip > 0 else None)
    except BaseException as e:
      if store is None:
        raise
      failure = e
    if store is not None:  # a store's step that failed on one rank (a drive error) is told to every rank
      try:
        agreement.reduce(failure, [], "the step on the drives")
      except BaseException as e:
        self._diverged = (f"a step failed on {'this rank' if failure is not None else 'another rank'} after the "
                          f"ranks agreed ({e}), so the ranks' stores may be a step apart: close() this optimizer and "
                          "make it again with resume=True (it opens every rank's store at the step all of them "
                          "committed)")
        if failure is not None:
          raise
        raise RuntimeError(self._diverged) from None
    return stepped

  def _run(self, plan, norm: Optional[float]) -> None:
    """The agreed step on this rank: the in-RAM one, or its store's (nothing where no held
    tensor has a gradient here)."""
    inner = self.inner
    if inner._store is None:
      inner._run_step(plan, norm)
    elif plan is not None:
      inner._stored(inner._store.run(plan, norm))

  def _local_sum_of_squares(self, agreement: Optional[Agreement]) -> float:
    """This rank's share of the squared global gradient norm: each local gradient's squared
    norm (float32 per tensor, as the kernel checks them) over the number of ranks holding the
    same shard (replicated mesh dimensions); a plain parameter beside the DTensors is taken
    as replicated on every rank."""
    ranks = agreement.size if agreement is not None else 1
    total = 0.0
    for g in self.inner.param_groups:
      for q in g["params"]:
        if q.grad is None:
          continue
        s = self._stand_in_of.get(id(q))
        if s is None:
          copies = ranks
        else:  # (replicated within its mesh, and over the agreed ranks its mesh does not span)
          mesh = s.param.device_mesh
          copies = math.prod(mesh.size(i) for i, pl in enumerate(s.param.placements) if pl.is_replicate())
          copies *= ranks / mesh.size()
        norm = float(torch.linalg.vector_norm(q.grad, dtype=torch.float32))
        total += norm * norm / copies
    return total

  def _take_groups(self) -> None:
    """The outer param groups' hyper-parameters and parameter lists, as the caller left them."""
    outer, inner = self._outer.param_groups, self.inner.param_groups
    if len(outer) != len(inner):
      raise ValueError(f"param_groups has {len(outer)} groups, the optimizer was given {len(inner)}: add groups "
                       "with add_param_group (hostopt steps the local shards of the groups it was given)")
    if self.inner._store is not None:  # the layout on the drives is fixed: refused before anything changes
      for gi, (og, ig) in enumerate(zip(outer, inner)):
        given = [self._stand_ins[id(p)].local if id(p) in self._stand_ins else p for p in og["params"]]
        if len(given) != len(ig["params"]) or any(a is not b for a, b in zip(given, ig["params"])):
          raise ValueError(f"param_groups[{gi}]['params'] changed (parameters added, replaced or removed): with "
                           "store= the layout on the drives is fixed when the store is made; nothing was changed")
    changed = False
    for gi, (og, ig) in enumerate(zip(outer, inner)):
      for key, value in og.items():
        if key != "params":
          ig[key] = value
      params = og["params"]
      if len(params) != len(ig["params"]) or any(
          self._local_of(p, "") is not q for p, q in zip(params, ig["params"])):
        ig["params"] = [self._local_of(p, f"param_groups[{gi}]['params'][{k}]") for k, p in enumerate(params)]
        changed = True
    if changed:
      self._drop_removed()

  def _check_params_and_grads(self, dtensors: list) -> list:
    """Every DTensor parameter's shard and gradient checked (nothing changed, no collective):
    (stand-in, local shard, gradient or None) of each of `dtensors` (_dtensors())."""
    found = []
    for where, p in dtensors:
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
    return found

  def _take_params_and_grads(self, found: list) -> List[_StandIn]:
    """Each stand-in takes its shard's new values and its gradient's local shard (redistributed
    to the parameter's placements first where they differ: a collective, reached alike by every
    rank once they agree). Returns the stand-ins with a gradient."""
    stepped = []
    with torch.no_grad():
      for s, shard, g in found:
        # Written by the caller since the last step (a checkpoint loaded, a re-init)? Compared, not
        # told by the version counter: torch.distributed.checkpoint loads into the shard unseen.
        if not _same_bits(shard, s.local):
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
    if old is not None and s.sources.get(key) is value:
      return old  # (from_local keeps a view of `value`, not `value`: the source is remembered)
    shown, viewed = self._as_dtensor(key, value, s)
    if viewed:
      s.sources[key] = value
    else:  # (a copy, made afresh each time: never a stale one)
      s.sources.pop(key, None)
    return shown

  def _as_dtensor(self, key: str, value: torch.Tensor, s: _StandIn):
    """(a stand-in's state tensor as a DTensor laid out as the parameter (8-bit blocks'
    scales: sharded by rows, padded to the largest shard's count), whether it views `value`)."""
    p = s.param
    with torch.no_grad():
      if key == SCALES:
        shards, rows, placements, _ = _scale_layout(p)
        local = value.reshape(-1, 2)
        padded = local.shape[0] < rows
        if padded:
          local = torch.cat([local, local.new_zeros(rows - local.shape[0], 2)])
        return self._cls.from_local(local.reshape(1, rows, 2), p.device_mesh, placements, run_check=False,
                                    shape=(shards, rows, 2), stride=(rows * 2, 2, 1)), not padded
      if tuple(value.shape) != tuple(s.local.shape):
        return value, True
      return self._cls.from_local(value, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                  stride=p.stride()), True

  def _check_entry(self, key: str, value, s: _StandIn, where: str) -> None:
    """What can be checked of an outer state entry with no collective (so a refusal on one rank
    never leaves another in one): the global shape of 8-bit block scales and shard boxes."""
    if key not in (SCALES, SHARDS) or not torch.is_tensor(value):
      if key == SHARDS:
        raise ValueError(f"{where}['{SHARDS}'] is a {type(value).__name__}: expected a tensor ({_RESHARD}); "
                         "nothing was loaded")
      return
    shards, rows, _, _ = _scale_layout(s.param)
    if key == SCALES and (self._is_dtensor(value) or value.dim() == 3) and tuple(value.shape) != (shards, rows, 2):
      raise ValueError(f"{where}['{SCALES}'] has shape {tuple(value.shape)}: 8-bit moments of this parameter, "
                       f"sharded as it is now, have ({shards}, {rows}, 2) (shards, blocks per shard, 2): {_RESHARD}; "
                       "nothing was loaded")
    dims = 2 * s.param.dim()
    if key == SHARDS and tuple(value.shape) != (shards, dims):
      raise ValueError(f"{where}['{SHARDS}'] has shape {tuple(value.shape)}: expected ({shards}, {dims}) for this "
                       f"parameter's {shards} shards ({_RESHARD}); nothing was loaded")

  def _localize(self, key: str, value, s: _StandIn):
    """An outer state entry (a DTensor, or a plain tensor) as the stand-in's local one: DTensors
    redistributed to the layout _wrap shows (a collective, reached alike by every rank: nothing
    here refuses). 8-bit block scales: this rank's row; shard boxes: this rank's, as a list."""
    if not torch.is_tensor(value):
      return value
    with torch.no_grad():
      if key in (SCALES, SHARDS):
        _, _, placements, index = _scale_layout(s.param)
        if self._is_dtensor(value):
          if tuple(value.placements) != tuple(placements):
            value = value.redistribute(s.param.device_mesh, placements)
          local = value.to_local()
        elif value.dim() == (3 if key == SCALES else 2):
          local = value[index]
        else:
          local = value  # (a plain local tensor: the inner optimizer checks it)
        if key == SHARDS:
          return [int(n) for n in local.reshape(-1).tolist()]
        return local.reshape(-1, 2)[:_moments.q8_blocks(s.local.numel())]
      if not self._is_dtensor(value):
        return value
      if tuple(value.placements) != tuple(s.param.placements):
        value = value.redistribute(s.param.device_mesh, s.param.placements)
      return value.to_local()

  def _box_of(self, s: _StandIn):
    """opt.state[p][SHARDS] of an 8-bit DTensor parameter: each shard's box (_shard_box), a
    (shards, 2 x dims) int64 DTensor sharded as the block scales, so a checkpoint says which
    elements its 8-bit blocks cover and a load into another sharding is refused by name."""
    if s.box is None:
      shards, _, placements, _ = _scale_layout(s.param)
      box = torch.tensor([_shard_box(s.param)], dtype=torch.int64)
      s.box = self._cls.from_local(box, s.param.device_mesh, placements, run_check=False,
                                   shape=(shards, box.shape[1]), stride=(box.shape[1], 1))
    return s.box

  @staticmethod
  def _check_box(saved: List[int], s: _StandIn, where: str) -> None:
    """A saved shard box (this rank's, localized) against this rank's shard, or a ValueError."""
    mine = _shard_box(s.param)
    dims = len(mine) // 2
    if saved != mine:
      raise ValueError(f"{where}: these 8-bit moments were saved from a shard of shape {tuple(saved[:dims])} at offset "
                       f"{tuple(saved[dims:])}, this rank's shard is {tuple(mine[:dims])} at {tuple(mine[dims:])} "
                       f"(another sharding): {_RESHARD}; nothing was loaded")

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
        if SCALES in shown:
          shown[SHARDS] = self._box_of(s)
        entry = outer_state.get(p)
        if entry is None:
          outer_state[p] = entry = {}
        if entry.keys() != shown.keys() or any(entry[key] is not value for key, value in shown.items()):
          entry.clear()  # (the same dict, as torch.optim's: a reference the caller holds stays live)
          entry.update(shown)
        s.shown = shown

  def _written(self) -> list:
    """(stand-in or None, the parameter or stand-in to write, its entries as written, where) of
    each parameter whose opt.state the caller replaced, added to or deleted from since shown."""
    outer_state, inner_state = self._outer.state, self.inner.state
    found: List[Any] = []
    for gi, group in enumerate(self._outer.param_groups):
      for k, p in enumerate(group["params"]):
        st = outer_state.get(p)
        if not self._is_dtensor(p):
          if st is not None and st is not inner_state.get(p):
            found.append((None, p, st, ""))
          continue
        s = self._stand_ins[id(p)]
        st = {} if st is None else st
        if st.keys() == s.shown.keys() and all(st[key] is s.shown[key] for key in st):
          continue
        found.append((s, s.local, st, f"opt.state[param_groups[{gi}]['params'][{k}]]"))
    return found

  def _check_written_state(self) -> None:
    """The caller's writes checked with no collective (before the ranks agree)."""
    for s, _, st, where in self._written():
      if s is not None:
        for key, value in st.items():
          if s.shown.get(key) is not value:
            self._check_entry(key, value, s, where)

  def _take_written_state(self) -> None:
    """Entries the caller replaced, added or deleted in opt.state[p] since they were shown go
    to the inner's state (checked and taken by its step, as any written state): every one
    localized first (collectives), then checked, then taken."""
    outer_state, inner_state = self._outer.state, self.inner.state
    writes: List[Any] = []
    for s, q, st, where in self._written():
      if s is None:
        writes.append((s, q, st, where))
        continue
      writes.append((s, q, {key: value if s.shown.get(key) is value else self._localize(key, value, s)
                            for key, value in st.items()}, where))
    for s, q, st, where in writes:
      if s is not None and SHARDS in st and st[SHARDS] is not s.shown.get(SHARDS):
        self._check_box(st[SHARDS], s, where)
    for s, q, st, where in writes:
      if s is None:
        inner_state[q] = st
        continue
      inner = inner_state[q]
      for key in [key for key in inner if key not in st]:
        del inner[key]
      for key, value in st.items():
        if key != SHARDS and s.shown.get(key) is not value:
          inner[key] = value
      s.shown = dict(outer_state.get(s.param) or {})

  # --- store= ----------------------------------------------------------------------------
  @_releasing
  def attach_store(self, store, options: dict, resume: bool) -> None:
    """store= over DTensor parameters: this rank's local shards (and any plain parameters) in
    a store of its own, the inner optimizer's, in ``rank{r}-of-{world}`` under each of the
    store's directories (made by each rank; the directories themselves must exist). The ranks
    agree, as for a step: made or opened everywhere, or refused everywhere with what any rank
    made taken back. resume=True opens every rank's store at the same step, the last one every
    rank committed: a job killed between two ranks' commits has ranks one step apart, and the
    rank ahead goes back to its previous commit, for good (more than one apart: refused).
    Each local shard then takes its store's parameters."""
    import torch.distributed as dist
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    dirs = [os.path.join(d, f"rank{rank}-of-{world}") for d in StoredOptimizer._dirs(store)]
    agreement = self._agreement()
    assert agreement is not None  # (made over DTensor parameters: their mesh's ranks)
    what = "opening the store (resume=True)" if resume else "making the store"
    made: Optional[TorchStore] = None
    fresh: List[tuple] = []  # (directory, whether this rank made it, its entries before) when making
    refusal: Optional[BaseException] = None
    try:
      for d in dirs:
        if resume:
          self._check_world(d, world)
          continue
        existed = os.path.isdir(d)
        if not existed:
          os.mkdir(d)  # (its parent is the user's: a missing one is named, not made)
        fresh.append((d, not existed, set(os.listdir(d))))
      made = TorchStore(self.inner, dirs, dict(options), resume, put=False)
    except BaseException as e:
      refusal = e
    steps = [0.0] * agreement.size  # (each rank's count in its own place: the sum tells every count)
    steps[agreement.index] = float(made.core.step_count) if made is not None else 0.0
    try:
      counts = [int(c) for c in agreement.reduce(refusal, steps, what).tolist()]
      assert made is not None  # (reduce raised where any rank refused)
      if resume and max(counts) > min(counts):  # alike on every rank: told every rank's count
        if max(counts) - min(counts) > 1:
          raise ValueError(f"resume=True: the ranks' stores are at steps {sorted(set(counts))}, more than one step "
                           "apart (a job killed mid-step leaves them at most one apart): they hold no common "
                           "step; nothing was opened")
        refusal = None
        if made.core.step_count > min(counts):
          try:
            made.close()
            made = None
            self.inner.state.clear()  # (the steps it showed: the previous commit's are shown afresh)
            made = TorchStore(self.inner, dirs, dict(options), True, previous=True, put=False)
          except BaseException as e:
            refusal = e
        agreement.reduce(refusal, [], what)
    except BaseException:
      if made is not None:  # opened or made here, refused elsewhere: taken back
        made.close()
      for d, mine, before in fresh:  # (a store made, or half made, by this rank)
        self._remove_new(d, mine, before)
      raise
    assert made is not None  # (a rank whose reopening failed raised in the agreement above)
    self.inner._store = made
    if resume:
      made.put_params()  # (agreed: only now the parameters take the store's)
      with torch.no_grad():
        for st in self._stand_ins.values():  # each shard takes its store's parameters
          st.param.to_local().copy_(st.local)
    self._show_state()

  @staticmethod
  def _remove_new(d: str, mine: bool, before: set) -> None:
    """What making a store added to directory `d` (all of it, where this rank made `d`); a
    failure here never hides the error that called it (a directory named twice: gone already)."""
    try:
      if mine:
        shutil.rmtree(d, ignore_errors=True)
        return
      for name in set(os.listdir(d)) - before:
        path = os.path.join(d, name)
        if os.path.isdir(path) and not os.path.islink(path):
          shutil.rmtree(path, ignore_errors=True)
        else:
          os.unlink(path)
    except OSError:
      pass

  @staticmethod
  def _check_world(mine: str, world: int) -> None:
    """resume=True where this rank's store is missing but stores of another world size are
    beside it: a ValueError saying so (the core's "no store" would not)."""
    parent = os.path.dirname(mine)
    if os.path.isdir(mine) or not os.path.isdir(parent):
      return
    worlds = sorted({int(m.group(1)) for name in os.listdir(parent)
                     for m in [re.fullmatch(r"rank\d+-of-(\d+)", name)] if m})
    if worlds and world not in worlds:
      raise ValueError(f"resume=True: {parent} holds the stores of a job of {' or '.join(map(str, worlds))} ranks "
                       f"(rank*-of-N), this one has {world}: a store per rank resumes at the world size it was made "
                       "with; nothing was opened")

  def exported(self) -> Optional[Dict[Any, dict]]:
    """With store=: each parameter's state exported from this rank's store, a DTensor
    parameter's entries as DTensors laid out as opt.state shows them; None without a store."""
    store = self.inner._store
    if store is None:
      return None
    if self._diverged is not None:  # (the ranks' stores may be at different steps: no consistent checkpoint)
      raise RuntimeError(f"state_dict: {self._diverged}")
    out: Dict[Any, dict] = {}
    for q, st in store.export_state().items():
      s = self._stand_in_of.get(id(q))
      if s is None:
        out[q] = st
        continue
      shown = {key: self._as_dtensor(key, value, s)[0] if torch.is_tensor(value) and key != "step" else value
               for key, value in st.items()}
      if SCALES in shown:
        shown[SHARDS] = self._box_of(s)
      out[s.param] = shown
    return out

  # --- state_dict ------------------------------------------------------------------------
  def refresh(self) -> None:
    with self.inner._lock:
      self.inner._drain()
      self._take_groups()  # (stand-ins for DTensors appended since the last step, as load_state_dict)
      self._take_written_state()
      self._show_state()

  @_releasing
  def load_state_dict(self, state_dict: dict, convert_moments: bool) -> None:
    """Loads through the inner optimizer (every check before anything changes), with each
    DTensor entry taken as its local shard. As a step: each rank checks what needs no
    collective, the ranks agree, every rank localizes the DTensor entries alike (collectives),
    then checks and loads, and the ranks agree again: a load refused on any rank is refused on
    every rank, and a rank that had loaded puts its state back (from a copy taken first, so a
    load holds one more copy of this rank's state while it runs)."""
    inner = self.inner
    with inner._lock:
      inner._drain()
      agreement = self._agreement()
      refusal, entries = None, []
      try:
        self._take_groups()  # (stand-ins for DTensors appended since the last step)
        params = [p for g in self._outer.param_groups for p in g["params"]]
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        by_index = dict(zip(ids, params))
        for index, st in state_dict["state"].items():
          p = by_index.get(index)
          s = self._stand_ins[id(p)] if p is not None and self._is_dtensor(p) else None
          where = f"state_dict['state'][{index!r}]"
          if s is not None:
            for key, value in st.items():
              self._check_entry(key, value, s, where)
          entries.append((index, s, st, where))
      except BaseException as e:  # (told to every rank, then raised)
        refusal = e
      if agreement is not None:
        agreement.reduce(refusal, [], "the load")
      elif refusal is not None:
        raise refusal
      refusal, before = None, None
      try:
        local_state = {}
        for index, s, st, where in entries:  # every DTensor entry localized (alike on every rank)
          local_state[index] = st if s is None else {key: self._localize(key, value, s) for key, value in st.items()}
        for index, s, st, where in entries:
          if s is not None and SHARDS in local_state[index]:
            self._check_box(local_state[index].pop(SHARDS), s, where)
        if agreement is not None:  # (a store's load takes only hyper-parameters: those are what it puts back)
          before = ([{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]
                    if inner._store is not None else inner.state_dict())
        inner.load_state_dict(dict(state_dict, state=local_state), convert_moments=convert_moments)
      except BaseException as e:
        refusal = e
      try:
        if agreement is not None:
          agreement.reduce(refusal, [], "the load")
        elif refusal is not None:
          raise refusal
      except BaseException:
        if refusal is None and before is not None:  # loaded here, refused elsewhere: this rank's state as it was
          if isinstance(before, list):
            for g, kept in zip(inner.param_groups, before):
              g.update(kept)
          else:
            inner.load_state_dict(before)
          self._reshow()
        raise
      for og, ig in zip(self._outer.param_groups, inner.param_groups):
        og.update({key: value for key, value in ig.items() if key != "params"})
      self._reshow()

  def _reshow(self) -> None:
    """opt.state shown afresh from the inner's (after a load: its tensors are new)."""
    for p in [p for g in self._outer.param_groups for p in g["params"]]:
      self._outer.state.pop(p, None)
    for s in self._stand_ins.values():
      s.shown, s.sources = {}, {}
    self._show_state()
