"""hostopt.torch's ``store=``: Adam/AdamW with the state on local drives (a
hostopt.StoredOptimizer), not in RAM.

The arena is laid out as the in-RAM path lays out one dtype's (groups and parameters in
reverse order), so where every parameter trains and all share one dtype they step to the
in-RAM optimizer's bits, compressed moments included, and its state_dict loads into either.
Each step gathers the gradients into one flat buffer in that layout, streams the store
through the fused step, and copies the new parameters back into each ``p`` (in its dtype).

The masters are on the drives, so a parameter is not its master as in RAM: each step
compares every parameter with what the last step wrote into it (that copy-out is kept), and
one the user wrote since (a loaded checkpoint, an in-place edit, a replaced ``.data``) has
its values adopted as masters by the step, as the in-RAM optimizer adopts them. A
parameter whose shape or memory order changed is refused: the layout on the drives is fixed.
Parameters frozen when the store is made (``requires_grad=False``) are left out of it. A held
parameter without a gradient keeps its state and its own step count (the store commits each
one's), as torch skips it.

Offloaded (CUDA parameters, or ``offload="host"``): the held parameters become views of one
flat device buffer in the store's layout, their gradients are gathered into another, and the
offload pipeline streams the store's chunks between them (each range it hands the CPU is read
from the drives, updated, written back; the step commits at its end), as the in-RAM offloaded
path streams its arena (with overlap_backward, each chunk once the backward completed its
gradients, as in RAM: ChunkEvents). Writes the user makes through a parameter (its version counter) or a
replaced ``.data`` are adopted as in RAM (the master kept where it rounds to the values): the
store takes their values as masters at the next applied step, as it reads their chunks
(adopt_at_next_step), so host RAM holds the written parameters' values only. A step that
fails midway puts the last completed step back into the device buffer, so parameters and
store agree. With overlap (CUDA), step() returns with the pipeline's step in flight and
finish() (at the next step, state_dict, load_state_dict or close) takes its result or error;
what the user writes into a parameter meanwhile stays written, for the next step to adopt.
"""
import math
import weakref
from typing import AbstractSet, Any, Dict, List, NamedTuple, Optional, Tuple, cast

import numpy as np
import torch

from . import StoredOptimizer as _StoredOptimizer
from . import _core, _store_options
from ._arena import Segment
from ._arrays import as_buffer
from ._dtypes import kernel_tag, tag_of
from ._torch_offload import ChunkEvents, remove_handles, take_grad
from ._torch_state import MASTER, SCALES, arena_view, dense_order, flat, moment_keys, rounds_to

_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _grad_hook(store_ref: Any, i: int):
  """The post-accumulate-grad hook of held parameter i (overlap_backward): TorchStore._hooked."""

  @torch.no_grad()
  def hook(p: torch.Tensor) -> None:
    store = store_ref()
    if store is not None:
      store._hooked(i, p)

  return hook


def _wait_quietly(inflight: List[Tuple[Any, int, list]]) -> None:
  """A dropped store's step in flight ends before its buffers go (its error has nobody to go to)."""
  for h, _, _ in inflight:
    try:
      h.wait()
    except Exception:
      pass
  inflight.clear()


def _bytes(t: torch.Tensor) -> torch.Tensor:
  """t's bits as bytes (NaNs and -0.0 compared as bits), whatever its strides (an empty
  tensor's may be 0)."""
  return t.reshape(-1).contiguous().view(torch.uint8) if t.numel() else torch.zeros(0, dtype=torch.uint8)


def _memory_order(p: torch.Tensor) -> Tuple[int, ...]:
  """The dimensions of extent > 1 from the outermost in memory to the innermost: what orders
  a dense tensor's elements in memory (a dimension of extent 1 may have any stride)."""
  return tuple(d for d in sorted(range(p.dim()), key=lambda d: (-p.stride(d), d)) if p.shape[d] != 1)


class StorePlan(NamedTuple):
  """A step TorchStore.prepare checked: the held parameters' gradients (None: none, the
  tensor keeps its state), the store's indices of those without, the groups' configs by
  the store's group, and whether non-finite gradients skip the step."""
  grads: List[Optional[torch.Tensor]]
  without: List[int]
  configs: Dict[int, Any]
  skip: bool


class TorchStore:
  """The store of one hostopt.torch optimizer and the layout of its parameters in it."""

  def __init__(self, opt: Any, store, options: dict, resume: bool, previous: bool = False, put: bool = True) -> None:
    """`previous` (with resume): open at the applied step before the last, for good (the
    DTensor path's ranks resuming at the step all of them committed). `put` False (with
    resume): the parameters keep their values until put_params() (the DTensor path's ranks
    agree first)."""
    # A weak reference: the optimizer holds this store, and a cycle would keep the store (and
    # its lock) open after the optimizer is dropped, until a collection.
    self._opt = weakref.proxy(opt)
    groups = opt.param_groups
    entries: List[Tuple[int, int, torch.Tensor]] = []  # (group, index over every parameter, p) of those held
    seen = set()
    self._where: Dict[int, str] = {}  # index over every parameter -> its name in param_groups
    self._all: List[torch.Tensor] = []
    k = 0
    for gi, group in enumerate(groups):
      for pi, p in enumerate(group["params"]):
        where = f"param_groups[{gi}]['params'][{pi}]"
        if id(p) in seen:
          raise ValueError(f"{where} appears twice in the optimizer: duplicate parameters are refused")
        seen.add(id(p))
        if tag_of(p.dtype) is None:
          raise TypeError(f"{where} has dtype {p.dtype}: expected float32, bfloat16 or float16")
        if not dense_order(p):
          raise ValueError(f"{where} is a strided view with gaps or overlaps (strides {tuple(p.stride())}): "
                           "hostopt keeps each parameter in one dense slice")
        self._where[k] = where
        self._all.append(p)
        if p.requires_grad:  # (a frozen one needs no state: it is left out of the store)
          entries.append((gi, k, p))
        k += 1
    if not entries:
      raise ValueError("store=: every parameter is frozen (requires_grad=False): nothing to keep")
    self._params = [p for _, _, p in entries]
    self._index = [k for _, k, _ in entries]
    self._shapes = [(tuple(p.shape), _memory_order(p), p.dtype) for p in self._params]
    self._group_ids = [id(g) for g in groups]
    self._formats = [opt._group_format(g) for g in groups]
    self._group_of = [gi for gi, _, _ in entries]
    # The in-RAM path's layout of one dtype (see _HostAdam._build): groups and parameters
    # reversed. The names carry a non-default memory order and the shapes are the real ones,
    # so a store opens only for parameters of the same shapes and memory orders.
    order = list(range(len(groups)))[::-1]
    self._core_group = {gi: j for j, gi in enumerate(order)}
    self._spec: List[Dict[str, Any]] = [
        {"config": opt._config(groups[gi], f"param_groups[{gi}]"), "tensors": [],
         "moments": self._formats[gi], "rounding_seed": int(groups[gi].get("rounding_seed", 0))} for gi in order]
    names = []
    for gi, k, p in entries:
      mem = _memory_order(p)
      default = tuple(d for d in range(p.dim()) if p.shape[d] != 1)
      names.append(f"{gi}.{k}" if mem == default else f"{gi}.{k}:" + ",".join(map(str, mem)))
    for name, (gi, _, p) in reversed(list(zip(names, entries))):
      self._spec[self._core_group[gi]]["tensors"].append((name, list(p.shape)))
    segs, size = _core.arena_layout(self._spec)
    arena = [Segment(*s) for s in segs]
    position = {x.name: j for j, x in enumerate(arena)}
    self._seg_index = [position[name] for name in names]  # each held parameter's tensor in the store
    self._segs = [arena[j] for j in self._seg_index]
    self._size = size
    kinds = {p.dtype for p in self._params}
    self._dtype = next(iter(kinds)) if len(kinds) == 1 else torch.float32  # gradients and copy-out: one dtype per step
    self._device = self._offload_device(opt, entries, kinds)  # None: CPU parameters, stepped in place
    self._applied: Dict[int, dict] = {}  # core group -> the config last given to the store
    # The last state_dict's tensors: (step count, {(parameter index, key): (weakref, version)}).
    self._export: Optional[Tuple[int, Dict[Tuple[int, str], Tuple[Any, int]]]] = None
    dirs = _StoredOptimizer._dirs(store)
    kernel = str(options.pop("kernel", ""))
    args = _StoredOptimizer._options(options.get("staging_bytes", 256 << 20), options.get("buffers", 8),
                                     options.get("chunk_elements", 0), options.get("sync", True),
                                     options.get("io", "auto"))
    if resume:
      self._core = _core.StoredOptimizer.open(self._spec, dirs, *args, opt._threads, kernel, None, previous)
      # The hyper-parameters stay param_groups' (each step gives them to the store): an lr
      # scheduler's state, loaded, sets the next lr (the docstring says how), and a scheduler
      # made now takes the constructor's lr as its initial_lr, as in a fresh run.
    else:
      initial = np.zeros(size, np.float32)
      for s, p in zip(self._segs, self._params):
        initial[s.offset:s.offset + s.size] = flat(p.detach()).float().cpu().numpy()
      try:
        self._core = _core.StoredOptimizer.create(self._spec, dirs, *args, opt._threads, kernel, initial, None)
      except RuntimeError as e:
        raise _store_options.exists_hint(e) from None
    self._pipe: Any = None
    self._chunks: Optional[ChunkEvents] = None  # overlap_backward: the chunks as the backward completes them
    self._hooks: List[Any] = []  # (their post-accumulate-grad hooks)
    self._chunk_events = 0  # the last step's chunks that started on the backward's event, not the whole stream
    # overlap=True (offloaded): step() returns before the pipeline's step ends; the step in
    # flight (its handle, the store's step count before it, the gradients it took) until finish().
    self._overlap = bool(opt._overlap) and self._device is not None
    # (A list the finalizer holds: a dropped store waits for its step in flight before its
    # buffers go.)
    self._inflight: List[Tuple[Any, int, list]] = []
    # After an overlapped step failed: the gradients written while it was in flight (a backward
    # over its parameters), refused by the next step until they are written again.
    self._tainted: Optional[list] = None
    weakref.finalize(self, _wait_quietly, self._inflight)
    weakref.finalize(self, remove_handles, self._hooks)  # (a dropped store's hooks go too)
    if self._device is not None:
      self._offload(opt)
    else:
      self._keep_last()
    self._steps = np.zeros(len(self._params), np.float32)  # torch's per-parameter "step", one view each
    self._shown: set = set()  # the held parameters whose opt.state shows their step
    self._closed = False
    if resume and put:  # the store's parameters: its last completed step
      self.put_params()
    self._show()

  @property
  def core(self) -> Any:
    return self._core

  def _offload_device(self, opt: Any, entries: list, kinds: set) -> Optional[torch.device]:
    """The device of the offloaded parameters (CUDA ones, or offload='host': the CPU), checked
    before the store is made; None where they are stepped in place."""
    devices = {p.device for _, _, p in entries}
    if all(d.type == "cpu" for d in devices) and opt._offload != "host":
      return None
    device = next(iter(devices))
    if len(devices) != 1 or device.type != ("cpu" if opt._offload == "host" else "cuda"):
      raise ValueError(f"parameters on {sorted(str(d) for d in devices)}: hostopt.torch offloads the parameters of "
                       "one CUDA device per optimizer (offload='host': CPU ones)")
    if device.type == "cuda" and not _core.CopyEngine.cuda_available():
      raise RuntimeError("CUDA parameters need a hostopt built with CUDA (the CUDA toolkit at build time) and a "
                         "visible CUDA device; this one has none")
    if len(kinds) != 1:
      raise ValueError(f"store= offloaded with parameters of {sorted(str(k) for k in kinds)}: the device buffer "
                       "holds one dtype (make one optimizer per dtype)")
    for _, k, p in entries:
      if not p.is_contiguous():
        raise ValueError(f"{self._where[k]} is not contiguous: the offloaded path keeps parameters in the flat "
                         "device buffer's layout")
    return device

  def _offload(self, opt: Any) -> None:
    """The device side: flat parameter and gradient buffers in the store's layout (each held
    parameter a view of the first), and the pipeline between them and the store."""
    device = cast(torch.device, self._device)
    self._engine = (_core.CopyEngine.cuda(device.index or 0) if device.type == "cuda" else _core.CopyEngine.host())
    self._engine_stream = self._engine.create_stream() if device.type == "cpu" else 0  # (host: stands in for torch's)
    self._tag = kernel_tag(self._dtype)
    self._dev_params = torch.zeros(self._size, dtype=self._dtype, device=device)
    self._dev_grads = torch.zeros(self._size, dtype=self._dtype, device=device)
    self._pipe = _core.OffloadPipeline(self._core, self._engine, opt._offload_chunk, 2, self._tag, self._tag)
    self._views = [self._dev_params[s.offset:s.offset + s.size] for s in self._segs]
    self._grad_views = [self._dev_grads[s.offset:s.offset + s.size] for s in self._segs]
    for view, p in zip(self._views, self._params):
      view.copy_(p.detach().reshape(-1))
      p.data = view.view(p.shape)
    self._pending: Dict[int, torch.Tensor] = {}  # parameter -> its values (f32) the next applied step adopts
    self._stale = False  # the device buffer holds no completed step (a failed step, then a failed push)
    self._remember()
    if opt._overlap_backward:  # as in RAM (_torch_offload): each gradient into the flat buffer as it completes
      self._chunks = ChunkEvents(self._engine, self._pipe.num_chunks, self._pipe.chunk_elems)
      self._chunks.cover([(s.offset, s.size) for s in self._segs], list(range(len(self._params))))
      me = weakref.ref(self)  # (the hooks must not keep the store, and its lock, alive)
      for i, p in enumerate(self._params):
        self._hooks.append(p.register_post_accumulate_grad_hook(_grad_hook(me, i)))

  def _hooked(self, i: int, p: torch.Tensor) -> None:
    """Held parameter i's gradient is complete in a backward: moved into the flat gradient
    buffer (later backwards accumulate there) and reported, so its chunks may start early."""
    if not self._closed:
      take_grad(p, self._grad_views[i], cast(ChunkEvents, self._chunks), i, self._stream(), self._dev_grads)

  def put_params(self) -> None:
    """The store's last completed step into the parameters (what resume does unless put=False)."""
    if self._device is None:
      self._put_params()
      self._keep_last()  # (the store wrote them: not the user's writes, nothing to adopt)
    else:
      self._push()  # (rounded by the pipeline's own copy-out)

  def _keep_last(self) -> None:
    """What each parameter holds now, kept as what the store last wrote into it (the step's
    copy-out): a parameter that differs from it later was written by the user (CPU path)."""
    self._last = torch.zeros(self._size, dtype=self._dtype)
    for s, p in zip(self._segs, self._params):
      self._last[s.offset:s.offset + s.size].copy_(flat(p.detach()))

  def _push(self) -> None:
    """The store's last completed step into the device buffer (every held parameter)."""
    self._stale = True
    device = cast(torch.device, self._device)
    if device.type == "cuda":  # torch's writes to the buffer (its zeros, the model's values) land first
      torch.cuda.synchronize(device)
    self._pipe.push_params(self._dev_params.data_ptr(), self._tag, self._size)
    self._point_all()
    self._stale = False
    self._remember()

  def _remember(self) -> None:
    """What each offloaded parameter is now (its storage and version): a later change is the user's."""
    self._seen = [(p.data_ptr(), p._version) for p in self._params]

  def _stream(self) -> int:
    """Where the gradients are produced and the parameters read: torch's current CUDA stream, or
    the host engine's stand-in."""
    device = cast(torch.device, self._device)
    if device.type == "cpu":
      return self._engine_stream
    return torch.cuda.current_stream(device).cuda_stream or 1  # (the legacy default stream: cudaStreamLegacy)

  def adopt_params(self) -> None:
    """Every held parameter's values, taken now, become its master at the next applied step,
    as in RAM (writes the version counter does not see: through ``.data``, numpy, a
    collective)."""
    if self._device is None or self._closed:
      return  # (stepped in place: every write is seen, bit for bit)
    # Taken now, as the in-RAM optimizer takes them into its masters (what state_dict shows
    # until the step, and what a later write replaces).
    self._take_written(list(range(len(self._params))), every=True)
    self._remember()

  def close(self) -> None:
    """Releases the store (an overlapped step in flight ends first: the caller finish()es it)."""
    self._core.close()
    remove_handles(self._hooks)
    self._chunks = None
    self._pipe = None  # (its threads stop; the parameters keep the device buffer)
    if self._device is not None:
      self._pending.clear()  # (lost with the store's, as its docs say)
    self._closed = True

  def _check_open(self, what: str) -> None:
    if self._closed:
      raise ValueError(f"{what}: this optimizer's store is closed (close() was called); make the optimizer again "
                       "with resume=True to go on")

  def _show(self) -> None:
    """opt.state[p]["step"] of every held parameter once it stepped (torch makes a parameter's
    state at its first gradient): its own count in the store, in a view of one array."""
    counts = self._core.tensor_steps
    for k, p in enumerate(self._params):
      self._steps[k] = counts[self._seg_index[k]]
      if self._steps[k] and k not in self._shown:
        self._opt.state[p]["step"] = torch.from_numpy(self._steps[k:k + 1]).reshape(())
        self._shown.add(k)

  def _put_params(self) -> None:
    """The store's parameters into each p (rounded to its dtype, as a step's copy-out)."""
    flat32 = np.zeros(self._size, np.float32)
    self._core.copy_params_to(flat32, "f32")
    for s, p in zip(self._segs, self._params):
      flat(p.data).copy_(torch.from_numpy(flat32[s.offset:s.offset + s.size]))

  def _check_unchanged(self, what: str) -> None:
    """The store's layout is fixed: the same groups, parameters, shapes, memory orders and formats."""
    groups = self._opt.param_groups
    now = [p for g in groups for p in g["params"]]
    if len(now) != len(self._all) or any(a is not b for a, b in zip(now, self._all)) or \
        [id(g) for g in groups] != self._group_ids:
      raise ValueError(f"{what}: param_groups changed (add_param_group, parameters added, replaced or removed, or "
                       "some groups stepped alone as DeepSpeed's ZeRO does): with store= the layout on the drives is "
                       "fixed, every step takes every group; nothing was changed")
    for gi, g in enumerate(groups):
      if self._opt._group_format(g) != self._formats[gi]:
        raise ValueError(f"{what}: param_groups[{gi}] stores {self._opt._group_format(g)!r}, its parameters hold "
                         f"{self._formats[gi]!r} moments: a parameter's moment format is fixed; nothing was changed")
    device = self._device or torch.device("cpu")
    for k, p, (shape, order, dtype) in zip(self._index, self._params, self._shapes):
      if tuple(p.shape) != shape or p.dtype != dtype or p.device != device or not dense_order(p) or \
          _memory_order(p) != order or (self._device is not None and not p.is_contiguous()):
        raise ValueError(f"{what}: {self._where[k]} is now {tuple(p.shape)} {p.dtype} with strides "
                         f"{tuple(p.stride())} on {p.device}; the store holds it as {shape} {dtype} in the memory "
                         f"order {order} on {device}: with store= a parameter's shape, dtype, device and memory "
                         "order are fixed (model.to(memory_format=...), .to(dtype) and a .data of another layout "
                         "are refused); nothing was changed")

  def _written(self) -> List[int]:
    """The held parameters the user wrote since the store last wrote them (bit for bit;
    offloaded: a replaced storage, or a write through the parameter)."""
    if self._device is not None:
      return [i for i, (p, seen) in enumerate(zip(self._params, self._seen))
              if (p.data_ptr(), p._version) != seen]
    out = []
    for i, (s, p) in enumerate(zip(self._segs, self._params)):
      last = self._last[s.offset:s.offset + s.size]
      if last.dtype != p.dtype:
        last = last.to(p.dtype)  # (mixed dtypes: the copy-out was float32, p its rounding)
      if not torch.equal(flat(p.detach()).view(_BITS[p.dtype]), last.view(_BITS[p.dtype])):
        out.append(i)
    return out

  def step(self, skip: Optional[bool]) -> Optional[Any]:
    """One step over every held parameter; None where none has a gradient (as torch)."""
    plan = self.prepare(skip)
    return None if plan is None else self.run(plan, None)

  def prepare(self, skip: Optional[bool]) -> Optional[StorePlan]:
    """Everything a step checks before the store changes: None where no held parameter has a
    gradient (nothing to step). `skip`: the optimizer's skip_nonfinite (None: its default)."""
    self._check_open("step")
    if self._inflight:
      raise RuntimeError("step: an overlapped step is still in flight (finish() it first)")
    if self._device is not None and self._stale:  # (their gradients came from no step's parameters)
      raise ValueError("step: the parameters hold no completed step (a step failed, and so did putting the store's "
                       "last one back into them); close() and make the optimizer again with resume=True")
    self._check_unchanged("step")
    held = set(map(id, self._params))
    late = [k for k, p in enumerate(self._all) if id(p) not in held and p.grad is not None]
    if late:
      raise ValueError(f"{self._where[late[0]]} has a gradient but was frozen (requires_grad=False) when the store "
                       "was made, so the store holds no state for it: make a new store to train it; nothing was "
                       "stepped")
    if self._tainted is not None:
      if self._grads_are(self._tainted):
        raise ValueError("step: these gradients were written while the step before was in flight (a backward "
                         "over the parameters it had copied out before it failed): zero_grad, then run the forward "
                         "and backward again; nothing was stepped")
      self._tainted = None
    grads = [p.grad for p in self._params]
    if all(g is None for g in grads):
      if self._chunks is not None:
        self._chunks.forget()  # (as in RAM: nothing stepped, a new window)
      return None
    # As torch: a parameter without a gradient keeps its state and its own step count.
    without = [self._seg_index[i] for i, g in enumerate(grads) if g is None]
    for k, p, g in zip(self._index, self._params, grads):
      if g is None:
        continue
      if g.layout != torch.strided:
        raise RuntimeError(f"{self._where[k]} has a sparse gradient ({g.layout}): hostopt.torch does not support "
                           "sparse gradients; nothing was stepped")
      if tuple(g.shape) != tuple(p.shape) or g.device != p.device:
        raise ValueError(f"{self._where[k]} has a gradient of shape {tuple(g.shape)} on {g.device}: expected the "
                         f"parameter's, {tuple(p.shape)} on {p.device}; nothing was stepped")
    configs = {self._core_group[gi]: self._opt._config(g, f"param_groups[{gi}]")
               for gi, g in enumerate(self._opt.param_groups)}  # lr schedulers take effect here
    if skip is None:  # (as in RAM: checked by default where 8-bit parameters are stepped in place)
      skip = "8bit" in self._formats and self._device is None
    return StorePlan(grads, without, configs, bool(skip))

  def run(self, plan: StorePlan, norm: Optional[float]) -> Any:
    """The step `plan` checked; `norm`: the gradients' global norm where plan.skip (None: this
    optimizer's, computed here; the DTensor path gives the ranks' agreed one)."""
    grads, without, configs, skip = plan
    norm = (self._opt._grad_norm() if norm is None else norm) if skip else -1.0
    for j, cfg in configs.items():
      if self._applied.get(j) != cfg:
        self._core.set_group_config(j, cfg)
        self._applied[j] = cfg
    if self._device is not None:
      result = self._offloaded_step(grads, bool(skip), float(norm), without)
      if not self._inflight:  # (in flight: finish() shows it; reading the store now would wait for the step)
        self._show()
      return result
    flat_g = torch.empty(self._size, dtype=self._dtype)  # (the padding, and a missing gradient's place, are never read)
    for s, p, g in zip(self._segs, self._params, grads):
      if g is None:
        continue
      if g.stride() != p.stride() or not dense_order(g):
        g = torch.empty_like(p).copy_(g)  # the parameter's memory order
      flat_g[s.offset:s.offset + s.size].copy_(flat(g))
    out = torch.empty(self._size, dtype=self._dtype)
    tag = kernel_tag(self._dtype)
    g_view, o_view = as_buffer(flat_g, "grads")[0], as_buffer(out, "out", writable=True)[0]
    written = self._written()
    if written or without:  # adopted as masters by the step (the in-RAM optimizer's parameters are its masters)
      values = np.zeros(self._size if written else 0, np.float32)
      adopt = []
      for i in written:
        s, p = self._segs[i], self._params[i]
        values[s.offset:s.offset + s.size] = flat(p.detach()).float().numpy()
        adopt.append((s.offset, s.offset + s.size))
      result = self._core.step_flat_adopting(g_view, tag, o_view, tag, 1.0, 0.0, bool(skip), float(norm),
                                             values if written else None, sorted(adopt), without)
    else:
      result = self._core.step_flat(g_view, tag, o_view, tag, 1.0, 0.0, bool(skip), float(norm))
    if result.applied:  # (a skipped one wrote nothing: a parameter written meanwhile is adopted at the next)
      for s, p in zip(self._segs, self._params):
        flat(p.data).copy_(out[s.offset:s.offset + s.size])
      self._last = out
    self._show()
    return result

  def _offloaded_step(self, grads: list, skip: bool, norm: float, without: List[int]) -> Any:
    """One pipeline step from the flat device gradients into the flat device parameters; the
    values the user wrote since are adopted as masters by the store as the step reads them.
    The tensors in `without` (the store's indices) have no gradient: never read."""
    for view, g in zip(self._grad_views, grads):
      if g is not None and g.data_ptr() != view.data_ptr():
        view.copy_(g.reshape(-1))  # on the current stream (a non-contiguous one: gathered in order)
    written = self._written()
    if written:
      self._take_written(written)
    stream = self._stream()
    # Chunks the backward completed (and nobody wrote since) are copied once the device is past
    # them; the rest wait for the whole stream.
    events = self._chunks.ready_events(self._dev_grads) if self._chunks is not None else []
    self._chunk_events = sum(1 for e in events if e)
    before = self._core.step_count  # (before the step starts: once it has, the store's calls wait for its end)
    h = self._pipe.step_async(self._dev_grads.data_ptr(), self._tag, self._dev_params.data_ptr(), self._tag,
                              self._size, grads_stream=stream, chunk_grads_events=events, skip_nonfinite=skip,
                              known_grad_norm=norm, tensors_without_grad=without)
    self._engine.stream_wait_event(stream, h.grads_consumed)
    self._engine.stream_wait_event(stream, h.params_ready)
    # A step skipped for non-finite gradients while the user's writes wait for adoption ends
    # here: its copy-out writes the store's parameters, and only _settle puts the user's back.
    if self._overlap and not (self._pending and skip and not math.isfinite(norm)):
      # The device waits for the new parameters on its own stream: the parameters go back onto
      # their views now (the next forward reads what the pipeline copies out), and finish()
      # takes the result, or the error, at the next step, state_dict, load_state_dict or close.
      # Nothing here reads the store from now on: its calls wait for the step's end.
      self._inflight.append((h, before, self._grads_now()))
      self._point_all()
      self._remember()
      return None
    return self._finished(h, before, set())

  def finish(self) -> Optional[Any]:
    """Waits for the overlapped step in flight and returns its result (None: none in flight).
    Its error raises here, as the step's would have (the parameters put back to the store's
    last completed step). What the user wrote into a parameter since that step returned
    stays, and is adopted at the next step."""
    if not self._inflight:
      return None
    h, before, taken = self._inflight.pop()
    since = set(self._written())  # (before _settle's copies, which move every parameter's version)
    try:
      return self._finished(h, before, since)
    except Exception as e:
      # Gradients written while the failed step was in flight (a backward over the parameters
      # it had copied out) are refused by the next step (unless none is held, or none can step).
      if not self._stale and not self._grads_are(taken) and any(p.grad is not None for p in self._params):
        self._tainted = self._grads_now()
        raise type(e)(f"{e}. The gradients held now were written while that step was in flight (a backward "
                      "over the parameters it had copied out): the next step refuses them until they are "
                      "written again (zero_grad, then the forward and backward)") from e
      raise
    finally:
      self._show()

  def _grads_now(self) -> list:
    """Each held parameter's gradient as it is now (the tensor, weakly, and its version):
    another backward, or a write, changes it."""
    return [None if p.grad is None else (weakref.ref(p.grad), p.grad._version) for p in self._params]

  def _grads_are(self, seen: list) -> bool:
    """Whether every held parameter's gradient is still the one _grads_now saw (the same
    tensor, unchanged)."""
    return all((p.grad is None) if s is None else (p.grad is not None and s[0]() is p.grad and
                                                   p.grad._version == s[1]) for p, s in zip(self._params, seen))

  def _finished(self, h: Any, before: int, since: AbstractSet[int]) -> Any:
    """The end of the pipeline step `h` (the store at step `before` when it started); `since`:
    the parameters the user wrote after it started (overlap: left as they are, still written)."""
    try:
      result = h.wait()
    except Exception as e:
      if not self._core.pending_adoption:  # (the step committed before its error: its adoptions with it)
        self._pending.clear()
      raise self._restored(e, before, since) from e
    if result.applied:
      self._pending.clear()  # (committed with the step)
    self._settle(since)
    return result

  def _take_written(self, written: List[int], every: bool = False) -> None:
    """The parameters the user wrote: each one's values become its pending master (adopted
    by the store at the next applied step) unless its master, pending or committed, rounds to
    them (as in RAM: a resume that loads the same model keeps the exact masters; `every`,
    adopt_params, takes every one). Host RAM for the written parameters only: each one's committed masters
    are read alone, its values kept in float32 until the step that adopts them commits."""
    for i in written:
      s, p = self._segs[i], self._params[i]
      host = p.detach().reshape(-1).cpu()
      master = self._pending.get(i)
      if master is None and not every:
        master = torch.empty(s.size, dtype=torch.float32)
        self._core.read_params_range(s.offset, s.offset + s.size, as_buffer(master, "masters", writable=True)[0],
                                     "f32")
      if s.size and (every or master is None or not rounds_to(master, host)):
        self._pending[i] = host.to(torch.float32, copy=True)  # (a CPU f32 parameter: not a view of the buffer)
    order = sorted(self._pending, key=lambda i: self._segs[i].offset)
    ranges = [(self._segs[i].offset, self._segs[i].offset + self._segs[i].size) for i in order]
    values = np.concatenate([self._pending[i].numpy() for i in order]) if order else np.zeros(0, np.float32)
    self._core.adopt_at_next_step(ranges, values)

  def _settle(self, since: AbstractSet[int] = frozenset()) -> None:
    """After a step (applied, skipped or failed): every parameter on its view again, those
    whose adoption is still pending holding the values the user gave them (a skipped or failed
    step's copy-out wrote the store's), and that state remembered. The parameters in `since`
    (written by the user while an overlapped step was in flight) keep what the user gave them
    and stay written: the next step takes them."""
    for i, values in self._pending.items():
      if i not in since:
        self._views[i].copy_(values)
    self._point_all(since)
    self._remember()
    for i in since:
      self._seen[i] = (-1, -1)

  def _restored(self, e: Exception, before: int, since: AbstractSet[int] = frozenset()) -> Exception:
    """After a step that failed midway (the store at the step before, some device chunks
    ahead): the store's parameters pushed back into the device buffer, so both agree (the
    values waiting for adoption go back in with them, and those the user wrote while an
    overlapped step was in flight, `since`, stay written)."""
    kept = {}  # (a replaced .data is kept as the tensor the user gave, in-place writes as their values)
    for i in since:
      p = self._params[i]
      replaced = p.data_ptr() != self._views[i].data_ptr()
      kept[i] = (p.data if replaced else p.detach().reshape(-1).clone(), replaced)
    put = "hostopt.torch puts them back (push_params)"
    try:
      self._push()
      for i, (values, replaced) in kept.items():
        self._pending.pop(i, None)  # (the user's newer values: taken at the next step)
        if replaced:
          self._params[i].data = values
        else:
          self._views[i].copy_(values)
      self._settle(since)
      now = self._core.step_count
      told = (f"the parameters were put back to the store's last completed step (step {now}): " +
              ("nothing of this step was applied" if now == before else "this step was applied and committed"))
    except Exception as again:
      put = "hostopt.torch tried to put them back (push_params)"
      told = (f"and the parameters could not be put back to the store's last completed step ({again}): they hold "
              "no completed step, so later steps are refused; close() and make the optimizer again with "
              "resume=True (it puts the store's last completed step into them)")
    kind = type(e) if isinstance(e, (RuntimeError, ValueError, OSError)) else RuntimeError
    said = str(e).replace("call push_params()", put)
    return kind(f"{said}; {told}")

  def _point_all(self, but: AbstractSet[int] = frozenset()) -> None:
    """Every parameter (but those in `but`) back onto its view of the device buffer (a
    replaced .data)."""
    for p, view in (pv for i, pv in enumerate(zip(self._params, self._views)) if i not in but):
      if p.data_ptr() != view.data_ptr():
        p.data = view.view(p.shape)

  def export_state(self) -> Dict[torch.Tensor, dict]:
    """Each held parameter's state in the in-RAM path's entries (moments by format, 16-bit
    parameters' masters: the store's, as the in-RAM path's until a step adopts what the user
    wrote; offloaded, the values a skipped or failed step left pending, as the in-RAM path
    adopted them at that step), exported through an in-RAM optimizer; empty before the first
    step (as torch)."""
    self._check_open("state_dict")
    self._check_unchanged("state_dict")
    if not self._core.step_count:
      return {}
    ram = _core.Optimizer(self._spec, self._opt._threads, "")
    self._core.copy_state_to(ram)
    compressed = any(f != "f32" for f in self._formats)
    flat_m, flat_v = (None, None) if compressed else (ram.exp_avg(), ram.exp_avg_sq())
    flat_p = ram.params()
    state: Dict[torch.Tensor, dict] = {}
    counts = self._core.tensor_steps
    for i, (s, p) in enumerate(zip(self._segs, self._params)):
      if not counts[self._seg_index[i]]:
        continue  # (never given a gradient: torch has no state for it)
      fmt = self._formats[self._group_of[i]]
      m, v, scales = self._opt._moment_views(ram, s.name, fmt, p, flat_m, flat_v, s.offset, s.size)
      st: Dict[str, Any] = {"step": torch.tensor(float(counts[self._seg_index[i]]))}
      st.update(zip(moment_keys(fmt), (m.clone(), v.clone())))
      if scales is not None:
        st[SCALES] = scales.clone()
      if p.dtype != torch.float32:
        pending = self._pending.get(i) if self._device is not None else None  # (adopted at a skipped step, in RAM)
        st[MASTER] = (arena_view(flat_p[s.offset:s.offset + s.size], p) if pending is None else
                      pending.view(p.shape)).clone()
      state[p] = st
    index = {id(p): k for k, p in enumerate(self._all)}
    self._export = (self._core.step_count, {(index[id(p)], key): (weakref.ref(t), t._version)
                                            for p, st in state.items() for key, t in st.items()})
    return state

  def is_own_export(self, state: dict, position: Dict[Any, int]) -> bool:
    """Whether a state_dict's "state" is the last export's tensors, in their places and
    unchanged since (no in-place write: their version counters as exported), and the store
    unchanged too (what accelerate's prepare hands back: load_state_dict(state_dict())).
    `position`: a saved parameter id -> its parameter's index (torch's mapping)."""
    if self._export is None or self._export[0] != self._core.step_count or self._written():
      return False
    given = {}
    for saved_id, st in state.items():
      if saved_id not in position or not isinstance(st, dict):
        return False
      for key, t in st.items():
        given[(position[saved_id], key)] = t
    exported = self._export[1]
    if set(given) != set(exported):
      return False
    return all(ref() is given[place] and given[place]._version == version for place, (ref, version) in exported.items())

  def same_state(self, state: dict, position: Dict[Any, int]) -> bool:
    """Whether a state_dict's "state" equals this store's, value for value (an export through
    RAM). `position`: a saved parameter id -> its parameter's index (torch's mapping)."""
    mine = self.export_state()
    index = {id(p): k for k, p in enumerate(self._all)}
    want = {index[id(p)]: st for p, st in mine.items()}
    if any(saved_id not in position for saved_id in state):
      return False
    placed = {position[saved_id]: st for saved_id, st in state.items()}
    if set(placed) != set(want) or len(placed) != len(state):
      return False
    for k, st in want.items():
      other = placed[k]
      if not isinstance(other, dict):
        return False
      if set(other) != set(st):
        return False
      for key, x in st.items():
        y = other[key]
        if not (torch.is_tensor(y) and y.dtype == x.dtype and y.shape == x.shape and torch.equal(_bytes(y), _bytes(x))):
          return False
    return True
