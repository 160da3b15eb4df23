"""torch.optim optimizers whose state and update live in hostopt.

``hostopt.torch.Adam`` and ``hostopt.torch.AdamW`` are drop-ins for torch.optim.Adam and
torch.optim.AdamW over CPU parameters, with torch's semantics: param groups with their own
hyper-parameters (``maximize`` included), lr schedulers, ``zero_grad``, closures, a step
count per parameter (a parameter whose first gradient arrives late, or one added with
``add_param_group``, starts at step 1), and ``state_dict``/``load_state_dict`` in torch's
format (``step``, ``exp_avg``, ``exp_avg_sq``), so checkpoints move both ways. As in torch,
``opt.state`` has an entry for a parameter from its first step on: a parameter never stepped
(frozen, no gradient yet) has none (its zero moments wait in the arena), ``p in opt.state``
is False and ``len(opt.state)`` counts the stepped ones (with ``overlap=True``, from when the
step is waited for); reading ``opt.state[p]`` makes an empty entry, as torch's defaultdict does.

Memory: float32 parameters become views into hostopt's arena (the master weights are the
parameters: 12 bytes per parameter in all); bfloat16/float16 parameters keep float32
master weights in the arena (``state[p]["master_param"]``, saved and loaded exactly by
``state_dict``) and receive the rounded result in the same fused pass.

Parameters stay correct whatever the user does to them: before each step, a parameter whose
``.data`` was replaced (re-initialised, EMA swap, ``model.to(...)``, ``share_memory_()``) or,
for 16-bit parameters, written in place through the parameter (``model.load_state_dict``,
``copy_`` under ``no_grad``) is adopted — its values become the master weights, unless the
f32 master already rounds to them (so a resume that loads the model after the optimizer
stays exact). Writes through ``p.data`` to a 16-bit parameter (to any offloaded parameter)
bypass torch's version counter and are not seen: write through ``p`` itself, or call
``adopt_params()``. A parameter moved to
shared memory is adopted back into the arena (sharing is not kept). Writes to
``opt.state`` (replacing or deleting ``exp_avg``, ``exp_avg_sq``, ``step``, ``master_param``)
take effect at the next step, as in torch. Gradients and parameters in any dense layout
(``channels_last`` included) are read in their memory order; a gradient whose layout differs
from its parameter's is copied once into the parameter's layout. Duplicate parameters are
refused (torch warns and applies them twice). Parameters appended to or replaced in
``param_groups[i]["params"]`` after a step are trained from the next one, as torch.optim does
(the layout is rebuilt as after ``add_param_group``, the state kept). ``param_groups`` set to
some of its groups around a ``step()`` (DeepSpeed's ZeRO steps one group at a time) steps just
those, on the layout as built: nothing is rebuilt, the groups left out keep their state (and
the user's writes, taken at their own step), ``skip_nonfinite``'s norm covers the groups
present, and ``opt.last_step`` reports the last call. ``load_state_dict``
checks the whole state (moments, steps, masters) before anything changes, and ``step`` every
gradient before any dtype is stepped: a refused call changes nothing (a rebuilt layout is
built aside and swapped in whole). ``step``, ``state_dict``, ``load_state_dict``,
``zero_grad`` and ``copy.deepcopy``/pickle hold one lock, so a state_dict or copy taken
while another thread steps is one step's state. A parameter's moment format is fixed,
however its group changes (a replaced group dict, a parameter moved between groups).

CUDA parameters (or ``offload="host"``) go through the offload pipeline: parameters become
views of one flat device buffer, laid out in reverse order (the order the backward produces
gradients). Parameters without a gradient are left alone, as torch does. With
``overlap_backward=True`` (torch >= 2.1) backward hooks move each gradient into the flat
gradient buffer as it completes (``p.grad`` becomes a view of it, as DeepSpeed's contiguous
gradients: clone a gradient to keep it past the next backward) and mark pipeline chunks
complete, so the step copies and updates early chunks while the device still runs the rest
of the backward. Its contract: between the backward and ``step()``, write gradients only
through torch ops on ``p.grad`` (clipping, scaling: seen, the step then waits for the whole
stream); writes through ``.data``, numpy or collectives (``all_reduce`` on the gradients) are
not seen — do not combine them with ``overlap_backward``.

Compressed moments: ``moments="bf16"`` or ``"8bit"`` (and ``rounding_seed=``), for the
optimizer or per param group, store Adam's moments in 8 or 6.06 bytes per parameter with the
f32 master (README: "Compressed moments"). The state then holds ``exp_avg``/``exp_avg_sq``
as bfloat16 tensors, or 8-bit codes as ``exp_avg_codes``/``exp_avg_sq_codes`` (uint8, in the
parameter's memory order) with ``moment_scales`` (the 32-element blocks' exponent bytes);
the format is the param group's ``moments``, and ``state_dict`` carries all of it. A group's
format is fixed; ``load_state_dict`` refuses moments of another format, with nothing changed,
unless ``convert_moments=True`` (converted then: lossy into bf16 or 8-bit).

Non-finite gradients: ``skip_nonfinite=True`` checks every gradient first (one norm over all
of them, taken with torch); a non-finite one (or a norm above sqrt(FLT_MAX), which the float
kernel would square to inf) skips the step for every parameter, changing nothing, as
``opt.last_step`` reports. None (the default) checks when a param group has 8-bit moments and
the parameters are stepped in place (a NaN there would poison its whole 32-element block, for
good), and leaves other optimizers unchecked, like torch.optim; on the offloaded path the check
takes a host sync, so only ``True`` asks for it (``skip_nonfinite`` is None, True or False:
anything else is a TypeError). ``opt.last_step`` (``StepStats``: applied, step,
skipped_steps, grad_norm, poisoned_blocks, saturated_blocks; None before the first step; an
offloaded step's once it is waited for; ``grad_norm`` is None when the step was not checked)
counts the 8-bit blocks a step left NaN (poisoned) or whose range an outlier exceeded
(saturated). ``hostopt.CompressedMomentsWarning`` is issued once per kind, pointing at the
``step()`` call: at the first step that counts poisoned blocks, and at the second applied step
in a row that counts saturated ones (a block can be saturated for a step at the start of
training, before v is averaged; the warning waits for saturation that lasts).

DTensor parameters (FSDP2's ``fully_shard``, tensor parallelism): each rank steps its local
shards (an f32 master in the arena beside each shard, the result copied into the shard each
step), and ``opt.state`` shows DTensors, so torch.distributed.checkpoint saves and loads the
state sharded (``_torch_dtensor``; docs/integrations.md, "FSDP2"). With ``store=``, each
rank's shards are in a store of its own (docs/drive.md).

``foreach`` and ``fused`` are accepted for compatibility and change nothing: hostopt's step is
always one fused pass. ``amsgrad``, ``capturable`` and ``differentiable`` are refused.
State on drives: ``store=dir`` (``store_options=``, ``resume=``) keeps the state in a
hostopt.StoredOptimizer on local drives, streamed through each step and committed (a
checkpoint after every step); the argument list says what it keeps of the above
(``_torch_store``; docs/drive.md).

Threads: OMP_NUM_THREADS when set, else all physical cores of the process's CPU set, unless ``threads=`` says otherwise
(``default_threads()``, hostopt's default on every front).
"""

import collections
import copy
import functools
import math
import threading
import warnings
import weakref
from typing import Any, Callable, Dict, List, NamedTuple, Optional, cast

import numpy as np
import torch

from . import _core, _store_options, _threads
from ._arena import segments
from ._arrays import as_buffer, check_optional_bool, check_seed as _check_seed, integer, power_text
from ._block_checks import report as _report_blocks
from ._dtypes import kernel_tag, tag_of
from ._threads import default_threads
from ._torch_dtensor import LocalShards, any_dtensor
from ._torch_offload import ChunkEvents, DeviceBuffers, grad_hook, remove_handles
from ._torch_store import TorchStore
from ._torch_state import (CODES, MASTER, MAX_STEP, MOMENT_ENTRIES, MOMENTS, SCALES, Layout, Tracked, arena_view,
                           check_master, check_moment_state, check_step, dense_order, encoded, flat, hyper_parameters,
                           moment_keys, moments_as_f32, rounds_to)

__all__ = ["Adam", "AdamW", "StepStats", "default_threads"]

# What the last step did, over every parameter dtype's core (each steps its own dtype).
StepStats = collections.namedtuple("StepStats", "applied step skipped_steps grad_norm poisoned_blocks saturated_blocks")
# A checked step, not yet taken: the groups stepped (None: all), their configs, whether
# non-finite gradients are checked (see _prepare_step).
_StepPlan = collections.namedtuple("_StepPlan", "only configs skip")


def _holds_step_view(st: Optional[dict], t: Tracked) -> bool:
  """Whether opt.state[p] (or None) still holds t's step view (so a changed count was written in place)."""
  return st is not None and st.get("step") is t.step


def _merged(results) -> StepStats:
  return StepStats(applied=all(r.applied for r in results), step=max(r.step for r in results),
                   skipped_steps=max(r.skipped_steps for r in results),
                   grad_norm=None if results[0].grad_norm < 0 else results[0].grad_norm,  # -1: not computed
                   poisoned_blocks=sum(r.poisoned_blocks for r in results),
                   saturated_blocks=sum(r.saturated_blocks for r in results))


class _GradView(NamedTuple):
  """A gradient as the last step read it: the tensor, its storage and its numpy view."""
  grad: torch.Tensor
  ptr: int
  view: np.ndarray


def _moment_format(name, where: str) -> str:
  """The canonical name of a moment format; ValueError naming `where` for any other value."""
  try:
    return _core.moment_format(str(name))
  except ValueError as e:
    raise ValueError(f"{where} = {name!r}: {e}") from None


def _serialized(method):
  """Runs the method under the optimizer's lock: a state_dict taken while another thread
  steps is one step's state, never a mix of two (a step is several core calls)."""

  @functools.wraps(method)
  def run(self, *args, **kwargs):
    with self._lock:
      return method(self, *args, **kwargs)

  return run


# Under torch.compile, what builds the layout (numpy views, the core) runs eagerly: Dynamo
# traces torch ops only, and a layout traced with fake tensors would be no layout.
_eager = getattr(torch, "_disable_dynamo", None) or (lambda fn: fn)


class _HostAdam(torch.optim.Optimizer):
  _mode = "adamw"
  # Made at the first step that needs them: the offloaded path's copy engine, and the
  # Layout of each dtype tag (None: built at the next step).
  _engine: Any
  _layout: Optional[Dict[str, Layout]]
  param_groups: List[Dict[str, Any]]  # torch.optim's (assigned here too: see _build_for)

  def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
               amsgrad: bool = False, *, foreach: Optional[bool] = None, maximize: bool = False,
               capturable: bool = False, differentiable: bool = False, fused: Optional[bool] = None,
               decoupled_weight_decay: Optional[bool] = None, threads: Optional[int] = None,
               offload: Optional[str] = None, offload_chunk: int = 1 << 22, overlap: bool = False,
               overlap_backward: bool = False, moments: str = "f32", rounding_seed: int = 0,
               skip_nonfinite: Optional[bool] = None, store=None, store_options: Optional[dict] = None,
               resume: bool = False):
    # torch's own checks and messages.
    if not 0.0 <= lr:
      raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
      raise ValueError(f"Invalid epsilon value: {eps}")
    if not 0.0 <= betas[0] < 1.0:
      raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
    if not 0.0 <= betas[1] < 1.0:
      raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
    if not 0.0 <= weight_decay:
      raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    if amsgrad:
      raise ValueError("amsgrad=True is not supported by hostopt (its max(v) state breaks the single pass)")
    if capturable or differentiable:
      raise ValueError("capturable/differentiable are CUDA-graph/autograd features hostopt does not offer")
    if decoupled_weight_decay is None:
      decoupled_weight_decay = self._mode == "adamw"
    defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=False, foreach=foreach,
                    maximize=bool(maximize), capturable=False, differentiable=False, fused=fused,
                    decoupled_weight_decay=bool(decoupled_weight_decay), moments=_moment_format(moments, "moments"),
                    rounding_seed=_check_seed(rounding_seed, "rounding_seed"))
    self._threads = _threads.resolve(0 if threads is None else integer(
        threads, "threads", (0, _core.max_threads() + 1), f"an int in [0, {_core.max_threads()}] (0 = hostopt's "
        "default), or None (default_threads())"))
    if offload not in (None, "host", "cuda"):
      raise ValueError(f"offload={offload!r}: expected None (CUDA parameters go through the pipeline, CPU ones are "
                       "stepped in place), 'cuda', or 'host' (CPU tensors stand in for device tensors)")
    if overlap and offload == "host":
      raise ValueError("overlap=True needs CUDA parameters: the device waits for the new parameters on its stream; "
                       "with offload='host' torch's CPU ops are not stream-ordered, so step() must wait")
    offload_chunk = integer(offload_chunk, "offload_chunk", (1, 1 << 62), "a positive number of elements per chunk")
    if overlap_backward and not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"):
      raise ValueError(f"overlap_backward=True needs post-accumulate-grad hooks (torch >= 2.1); this is torch "
                       f"{torch.__version__}")
    store_opts = _store_options.check(store, store_options, resume)
    self._store: Optional[TorchStore] = None  # the state on drives (store=), made below
    self._offload, self._offload_chunk, self._overlap = offload, int(offload_chunk), bool(overlap)
    self._overlap_backward = bool(overlap_backward)
    self._engine, self._engine_stream = None, 0
    self._pending: List[Any] = []  # overlapped steps still to wait for
    self._layout = None  # set by _build
    self._hidden: Dict[str, Dict[int, Tracked]] = {}  # set by _build: see _fresh
    self._hook_handles: List[Any] = []
    self._last_chunk_events = 0
    weakref.finalize(self, remove_handles, self._hook_handles)  # a dropped optimizer's hooks go too
    self._lock = threading.RLock()  # step, state_dict, load_state_dict, ... one at a time
    self._skip_nonfinite = check_optional_bool(skip_nonfinite, "skip_nonfinite")
    self.last_step: Optional[StepStats] = None
    self._shards: Optional[LocalShards] = None  # DTensor parameters: see _torch_dtensor
    super().__init__(params, defaults)
    if offload == "cuda":  # refused now, not at the first step: nothing could ever run it
      off_gpu = [(gi, k, p.device) for gi, g in enumerate(self.param_groups) for k, p in enumerate(g["params"])
                 if p.device.type != "cuda"]
      if off_gpu:
        gi, k, device = off_gpu[0]
        raise ValueError(f"offload='cuda' but the parameters are on the CPU (param_groups[{gi}]['params'][{k}] is on "
                         f"{device}): move the model to its GPU before making the optimizer, or leave offload=None "
                         "(CPU parameters are stepped in place)")
      if not _core.CopyEngine.cuda_available():
        raise RuntimeError("offload='cuda' needs a hostopt built with CUDA (the CUDA toolkit at build time) and a "
                           "visible CUDA device; this one has none")
    if self._overlap_backward and offload != "host" and all(
        p.device.type == "cpu" for g in self.param_groups for p in g["params"]):
      raise ValueError("overlap_backward=True applies to offloaded parameters (CUDA ones, or offload='host'): "
                       "CPU parameters are stepped in place")
    if any_dtensor(self.param_groups):  # FSDP2, tensor parallel: each rank steps its local shards
      if self._overlap_backward:
        raise ValueError("overlap_backward=True with DTensor parameters: their gradients are the engine's (FSDP2 "
                         "reduce-scatters them); leave it False")
      if store is not None and overlap:
        raise ValueError("store= with overlap=True over DTensor parameters: not yet (the ranks agree on every step's "
                         "commit before step() returns); leave overlap False")
      self._shards = LocalShards(self, lambda groups: type(self)(
          groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=foreach, maximize=maximize,
          fused=fused, decoupled_weight_decay=decoupled_weight_decay, threads=threads, offload=offload,
          offload_chunk=offload_chunk, overlap=overlap, moments=moments, rounding_seed=rounding_seed,
          skip_nonfinite=skip_nonfinite))
    if store is not None:
      if self._shards is not None:  # each rank's local shards in a store of its own (the inner optimizer's)
        self._shards.attach_store(store, store_opts, resume)
      else:
        self._store = TorchStore(self, store, store_opts, resume)
    self._made = True  # (add_param_group: torch's __init__ adds the first groups before this)

  def _refuse_copy(self) -> None:
    if self.__dict__.get("_store") is not None:
      raise TypeError("a hostopt.torch optimizer with store= cannot be pickled or deep-copied (it holds its store's "
                      "lock): the store is the checkpoint; state_dict() exports it")
    if self.__dict__.get("_shards") is not None:
      raise TypeError("a hostopt.torch optimizer over DTensor parameters cannot be pickled or deep-copied (its "
                      "parameters belong to a process group): save its state_dict, with torch.distributed.checkpoint")

  def __getstate__(self) -> dict:  # pickle (torch.save(opt)): one step's state, taken under the lock
    self._refuse_copy()
    with self._lock:
      state = self._plain_state()
      state["state"] = collections.defaultdict(dict, {
          p: {key: (v.clone() if torch.is_tensor(v) else v) for key, v in st.items()}
          for p, st in state["state"].items()})
      return state

  def _plain_state(self) -> dict:
    state = super().__getstate__()
    state.update(_threads=self._threads, _offload=self._offload, _offload_chunk=self._offload_chunk,
                 _overlap=self._overlap, _overlap_backward=self._overlap_backward,
                 _skip_nonfinite=self._skip_nonfinite)
    return state

  def __deepcopy__(self, memo: dict):
    """copy.deepcopy: copied under the lock (parameters and state of one step, never torn by
    another thread's step), with the caller's memo (a model copied alongside shares them)."""
    self._refuse_copy()
    with self._lock:
      self._drain()
      new = type(self).__new__(type(self))
      memo[id(self)] = new
      new.__setstate__(copy.deepcopy(self._plain_state(), memo))
      return new

  def __setstate__(self, state: dict) -> None:  # copy.deepcopy, pickle (and torch's load_state_dict)
    if "_lock" in self.__dict__:  # torch's load_state_dict, on this live optimizer: its lock, hooks, engine stay
      super().__setstate__(state)
      return
    self._lock = threading.RLock()
    super().__setstate__(state)
    self.__dict__.setdefault("_threads", default_threads())
    for key, value in (("_offload", None), ("_offload_chunk", 1 << 22), ("_overlap", False),
                       ("_overlap_backward", False), ("_skip_nonfinite", None), ("last_step", None),
                       ("_shards", None), ("_made", True), ("_store", None)):
      self.__dict__.setdefault(key, value)
    self._engine, self._engine_stream, self._pending = None, 0, []
    self._layout, self._hidden = None, {}
    self._given_groups = list(self.param_groups)  # (torch's state carries no attribute of ours: see _whole_list)
    self._hook_handles, self._last_chunk_events = [], 0
    weakref.finalize(self, remove_handles, self._hook_handles)

  @staticmethod
  def _refuse_unsupported(group: dict, where: str) -> None:
    for key in ("amsgrad", "capturable", "differentiable"):
      if group.get(key):
        raise ValueError(f"{where} has {key}=True: not supported by hostopt (amsgrad's max(v) state breaks the "
                         "single pass; capturable/differentiable are CUDA-graph/autograd features)")

  # --- layout -------------------------------------------------------------------------
  @_serialized
  def add_param_group(self, param_group: dict) -> None:
    """Adds a parameter group, as torch.optim: its own hyper-parameters (and ``moments``,
    ``rounding_seed``), the others from the constructor's defaults. Its parameters are
    trained from the next step, starting at step 1; an unknown format or a bad seed is
    refused now (ValueError)."""
    self._refuse_unsupported(param_group, "param group")
    if "moments" in param_group:  # an unknown format is named now, not at the first step
      param_group["moments"] = _moment_format(param_group["moments"], "param group moments")
    if "rounding_seed" in param_group:
      param_group["rounding_seed"] = _check_seed(param_group["rounding_seed"], "param group rounding_seed")
    shards = self.__dict__.get("_shards")  # (None while torch's __init__ adds the first groups)
    if self.__dict__.get("_store") is not None or (shards is not None and shards.inner._store is not None):
      raise ValueError("add_param_group with store=: the layout on the drives is fixed when the store is made; "
                       "nothing was changed")
    if self.__dict__.get("_made") and self._shards is None:
      params = param_group["params"]
      self._refuse_dtensors([{"params": [params] if torch.is_tensor(params) else list(params)}])
    super().add_param_group(param_group)
    self._given_groups = list(self.param_groups)  # (see _whole_list)
    if shards is not None:
      shards.add_group(self.param_groups[-1])
    # Rebuilt, with the state kept, at the next step (_params_changed), after the check that
    # every built parameter's group still stores its format (_check_formats).

  @staticmethod
  def _refuse_dtensors(groups: list) -> None:
    """DTensors reaching an optimizer made over plain tensors (stepped in place, as views of the
    arena, which a DTensor cannot be): refused, by name, with nothing changed."""
    if any_dtensor(groups):
      raise ValueError("a DTensor parameter (FSDP2's fully_shard, tensor parallel) was given to a hostopt.torch "
                       "optimizer made over plain tensors: make the optimizer after fully_shard, over the DTensor "
                       "parameters (it can hold plain ones beside them); nothing was changed")

  def _group_format(self, group: dict) -> str:
    return group.get("moments", "f32")

  def _config(self, group: dict, where: str) -> dict:
    """The core's config of a param group, its hyper-parameters checked (named by torch's index)."""
    # torch 2's Adam(decoupled_weight_decay=True) is AdamW; a group says which it is.
    decoupled = bool(group.get("decoupled_weight_decay", self._mode == "adamw"))
    return hyper_parameters(group, where).config(mode="adamw" if decoupled else "adam",
                                                 maximize=bool(group.get("maximize", False)))

  def _check_formats(self) -> None:
    """A parameter's moment format is fixed: its group (the same dict or a replaced one, or
    another group it was moved to) must still store the format it was built with."""
    built = {id(g): fmt for g, fmt in self._built_groups}
    had = self._built_formats
    for gi, group in enumerate(self.param_groups):
      fmt = self._group_format(group)
      if built.get(id(group), fmt) != fmt:
        raise ValueError(f"param_groups[{gi}]['moments'] changed from {built[id(group)]!r} to {fmt!r}: a group's "
                         "moment format is fixed (convert through state_dict and load_state_dict(..., "
                         "convert_moments=True) into a new optimizer)")
      for pi, p in enumerate(group["params"]):
        if had.get(id(p), fmt) != fmt:
          raise ValueError(f"param_groups[{gi}]['params'][{pi}] has {had[id(p)]} moments, but param_groups[{gi}] "
                           f"stores {fmt!r}: a parameter's moment format is fixed (a replaced group dict or a "
                           "parameter moved between groups keeps it; convert through state_dict and "
                           "load_state_dict(..., convert_moments=True) into a new optimizer)")

  @_eager
  def _build(self, overrides: Optional[dict] = None) -> None:
    """One hostopt optimizer per parameter dtype (stepped together), holding the master
    weights, moments and each parameter's own step count.

    Built aside, then swapped in: every check (and every core, arena and copy) comes first,
    and only then are opt.state, the parameters and the hooks pointed at the new layout, so a
    refused build leaves the optimizer as it was (the earlier layout, its step counts).
    `overrides`: id(p) -> state entries read instead of opt.state[p]'s (8-bit codes
    re-encoded for a new memory order, written to opt.state only when the build stands)."""
    self._refuse_dtensors(self.param_groups)
    overrides = overrides or {}
    by_dtype: Dict[str, list] = {}
    seen, where_of, source = set(), {}, {}
    for gi, group in enumerate(self.param_groups):
      fmt = self._group_format(group)
      for pi, p in enumerate(group["params"]):
        where = f"param_groups[{gi}]['params'][{pi}]"
        if id(p) in seen:
          raise ValueError(f"{where} appears twice in the optimizer: duplicate parameters are refused (torch.optim "
                           "warns and applies them twice)")
        seen.add(id(p))
        where_of[id(p)] = where
        if tag_of(p.dtype) is None:
          raise TypeError(f"{where} has dtype {p.dtype}: expected float32, bfloat16 or float16")
        if not dense_order(p):
          raise ValueError(f"{where} is a strided view with gaps or overlaps (strides {tuple(p.stride())}): "
                           "hostopt keeps each parameter in one dense slice")
        # (written by the user, or loaded): checked before anything moves; read, not changed
        st = dict(self.state[p]) if p in self.state else {}
        st.update(overrides.get(id(p), {}))
        source[id(p)] = st
        if "step" in st:  # (None is refused: it is no count)
          check_step(st["step"], f"opt.state[p]['step'] of {where}")
        if st.get(MASTER) is not None:
          check_master(st[MASTER], p, f"opt.state[p] of {where}")
        if check_moment_state(st, fmt, p, f"the state of {where}"):
          raise ValueError(f"the state of {where}: its 8-bit codes are laid out in another memory order than the "
                           "parameter (load the state_dict with convert_moments=True to re-encode them)")
        by_dtype.setdefault(kernel_tag(p.dtype), []).append((gi, p))
    configs = [self._config(g, f"param_groups[{gi}]") for gi, g in enumerate(self.param_groups)]
    devices = {p.device for entries in by_dtype.values() for _, p in entries}
    offload = self._offload
    if any(d.type != "cpu" for d in devices):
      if len(devices) != 1 or next(iter(devices)).type != "cuda" or offload == "host":
        raise ValueError(f"parameters on {sorted(str(d) for d in devices)}: hostopt.torch offloads the parameters "
                         "of one CUDA device per optimizer (or steps CPU parameters in place)")
      offload = "cuda"
    elif offload == "cuda":
      raise ValueError("offload='cuda' but the parameters are on the CPU")
    if offload:
      for entries in by_dtype.values():
        for gi, p in entries:
          if not p.is_contiguous():
            raise ValueError(f"{where_of[id(p)]} is not contiguous: the offloaded path keeps parameters in the flat "
                             "device buffer's layout")
    device = next(iter(devices)) if devices else torch.device("cpu")
    if offload and self._engine is None:
      self._engine = (_core.CopyEngine.cuda(device.index or 0) if offload == "cuda" else _core.CopyEngine.host())
      if offload == "host":
        self._engine_stream = self._engine.create_stream()  # stands in for torch's (synchronous) CPU stream
    built: Dict[str, Layout] = {}
    group_of_all = {}
    for tag, entries in by_dtype.items():
      # The backward produces the last parameters' gradients first, so they lead the arena
      # and an offloaded step's first chunks are complete first (see grad_hook). CPU
      # parameters get the same layout: compressed moments round by arena position, and
      # both paths give the same bits (and resume from each other's state_dict).
      order = list(range(len(self.param_groups)))[::-1]
      group_of = {gi: j for j, gi in enumerate(order)}  # torch's group -> the core's
      groups: List[Dict[str, Any]] = [{"config": configs[gi], "tensors": [], "moments": self._group_format(self.param_groups[gi]),
                 "rounding_seed": int(self.param_groups[gi].get("rounding_seed", 0))} for gi in order]
      for k, (gi, p) in reversed(list(enumerate(entries))):
        groups[group_of[gi]]["tensors"].append((f"{gi}.{k}", [p.numel()]))
      core = _core.Optimizer(groups, self._threads, "")
      arena = segments(core)
      index_of = {seg.name: si for si, seg in enumerate(arena)}
      compressed = any(g["moments"] != "f32" for g in groups)
      flat_p = core.params()
      flat_m, flat_v = (None, None) if compressed else (core.exp_avg(), core.exp_avg_sq())
      dev = None
      if offload:  # flat device buffers in the arena's layout: the pipeline's two ends
        n = core.arena_size
        pipe = _core.OffloadPipeline(core, self._engine, self._offload_chunk, 2, tag, tag)
        dtype = next(p.dtype for _, p in entries)
        dev = DeviceBuffers(params=torch.zeros(n, dtype=dtype, device=device),
                            grads=torch.zeros(n, dtype=dtype, device=device), n=n, pipe=pipe,
                            # Per-chunk events only where backward hooks report (overlap_backward).
                            chunks=ChunkEvents(self._engine, pipe.num_chunks, pipe.chunk_elems)
                            if self._overlap_backward else None)
      steps = np.zeros(len(entries), dtype=np.float32)  # torch's per-parameter "step", one view each
      seg_steps = [0] * len(arena)
      tracked: List[Tracked] = []
      seg_of = []
      for k, (gi, p) in enumerate(entries):
        name = f"{gi}.{k}"
        si = index_of[name]
        off, size = arena[si].offset, arena[si].size
        st = source[id(p)]
        mp = flat_p[off:off + size]
        master = arena_view(mp, p) if dev is None else torch.from_numpy(mp).view(p.shape)
        saved: Any = st.get(MASTER)
        if p.dtype != torch.float32 and torch.is_tensor(saved) and rounds_to(saved.to(p.device), p):
          master.copy_(saved)  # exact f32 masters (a checkpoint, an earlier layout) that still fit p
        else:
          master.copy_(p.detach())
        fmt = self._group_format(self.param_groups[gi])
        m, v, scales = self._moment_views(core, name, fmt, p, flat_m, flat_v, off, size)
        self._fill_moments(fmt, m, v, scales, st)
        seg_steps[si] = int(check_step(st["step"], "")) if "step" in st else 0
        device_view = grad_view = None
        if dev is not None:
          device_view, grad_view = dev.params[off:off + size], dev.grads[off:off + size]
          device_view.copy_(p.detach().reshape(-1))
        step = torch.from_numpy(steps[k:k + 1]).reshape(())  # a view: it follows steps
        t = Tracked(p, mp, master, m, v, step, device_view, grad_view, scales, fmt)
        t.where, t.name, t.group = where_of[id(p)], name, gi
        tracked.append(t)
        seg_of.append(si)
      core.tensor_steps = seg_steps
      steps[:] = [seg_steps[si] for si in seg_of]
      group_of_all[tag] = group_of
      built[tag] = Layout(core, tracked, steps, seg_of, steps.tolist(), dev)
    # Everything stands: the swap (nothing below refuses).
    if self._layout and any(layout.dev is not None for layout in self._layout.values()) and device.type == "cuda":
      torch.cuda.synchronize(device)  # old flat buffers go back to the allocator: no stream may still use them
    self._remove_grad_hooks()
    hidden: Dict[str, Dict[int, Tracked]] = {}
    for tag, layout in built.items():
      for k, t in enumerate(layout.tracked):
        p = t.param
        if t.device_view is not None:
          p.data = t.device_view.view(p.shape)
        elif p.dtype == torch.float32:
          p.data = t.master  # the parameter is the master weight
        t.remember()
        if self._fresh(t, layout.steps[k], source[id(p)]):
          hidden.setdefault(tag, {})[k] = t
          if self.state.get(p):  # (an empty entry, made by reading opt.state[p], stays: torch's)
            del self.state[p]
        else:
          self._show(t)
      if layout.dev is not None:
        if layout.dev.chunks is not None:
          layout.dev.chunks.cover([(seg.offset, seg.size) for seg in segments(layout.core)], layout.seg_of)
        self._add_grad_hooks(tag, layout.tracked, layout.dev)
    self._layout, self._hidden = built, hidden
    self._group_of = group_of_all
    # Each parameter's format is fixed while this layout stands (_check_formats).
    self._built_groups = [(g, self._group_format(g)) for g in self.param_groups]
    self._built_params = [list(g["params"]) for g in self.param_groups]
    self._built_formats = {id(t.param): t.format for entry in built.values() for t in entry.tracked}
    self._applied: Dict[Any, Any] = {}  # (dtype, group) -> config last given to the core
    self._views: Dict[Any, _GradView] = {}  # (dtype, index) -> its gradient's view, reused while unchanged

  # A parameter that was never stepped has no entry in opt.state, as in torch.optim (which
  # makes it at the parameter's first step with a gradient): its arena slices are what a
  # build from no state gives it (zero moments, step 0, the parameter as master), so
  # nothing is lost by leaving them out, and an absent (or empty) entry means "untouched".
  # self._hidden[tag][k] are those parameters; _show_stepped gives them their entry once
  # they are stepped, and an entry the user writes for one is taken as any written state.
  @staticmethod
  def _fresh(t: Tracked, step, st: dict) -> bool:
    """Whether t (just built from the state entries `st`) holds what a build from no state
    gives it: step 0, zero moments (scales), and for a 16-bit parameter its own values as
    master. Read only where `st` supplied them (a build from nothing is fresh)."""
    if float(step) != 0:
      return False
    views = [x for x, key in zip((t.m, t.v, t.scales), moment_keys(t.format) + (SCALES,)) if x is not None]
    if any(key in st for key in MOMENT_ENTRIES) and any(bool(torch.count_nonzero(x)) for x in views):
      return False
    p = t.param
    return p.dtype == torch.float32 or st.get(MASTER) is None or torch.equal(
        t.master, p.detach().to(device="cpu", dtype=torch.float32))

  def _show(self, t: Tracked) -> None:
    """Points opt.state[p] at t's arena views (the moments, the step, a 16-bit master)."""
    st = self.state[t.param]
    for key in MOMENT_ENTRIES:
      st.pop(key, None)
    st.update(zip(moment_keys(t.format), (t.m, t.v)))
    if t.scales is not None:
      st[SCALES] = t.scales
    st["step"] = t.step
    if t.param.dtype == torch.float32:
      st.pop(MASTER, None)  # the parameter (on the device: its copy) holds the master's values
    else:
      st[MASTER] = t.master

  def _show_stepped(self, tag: str) -> None:
    """Gives the never-stepped parameters of `tag` that a step just counted their entry."""
    hidden = self._hidden.get(tag)
    if hidden:
      steps = self._layouts()[tag].steps
      for k in [k for k in hidden if steps[k] != 0]:
        self._show(hidden.pop(k))

  @staticmethod
  def _moment_views(core, name: str, fmt: str, p, flat_m, flat_v, off: int, size: int):
    """A parameter's moments in the arena: f32 views, bfloat16 views of bf16 moments, or
    uint8 codes and their blocks' (n, 2) exponent bytes (8-bit)."""
    if flat_m is not None:
      return arena_view(flat_m[off:off + size], p), arena_view(flat_v[off:off + size], p), None
    if fmt == "f32":  # an f32 group beside compressed ones: its own storage
      m32, v32 = core.moment_views(name)
      return arena_view(m32, p), arena_view(v32, p), None
    m_codes, v_codes, scales = core.moment_codes(name)
    if fmt == "bf16":
      return (arena_view(torch.from_numpy(m_codes.view(np.int16)).view(torch.bfloat16), p),  # (torch 1 has no uint16)
              arena_view(torch.from_numpy(v_codes.view(np.int16)).view(torch.bfloat16), p), None)
    return arena_view(m_codes, p), arena_view(v_codes, p), torch.from_numpy(scales)

  @staticmethod
  def _fill_moments(fmt: str, m, v, scales, st: dict) -> None:
    """Writes the moments of `st` (checked: `fmt` moments in the parameter's memory order)
    into the views m, v (and scales), zeros where one is missing; `st` is not changed."""
    for key, view in zip(moment_keys(fmt), (m, v)):
      value = st.get(key)
      if value is None:
        view.zero_()
      elif fmt == "8bit":  # codes by memory order: the order of their blocks
        flat(view).copy_(flat(value))
      else:  # values (torch's dtype casts, as when torch takes a replaced state)
        view.copy_(value.reshape(view.shape))
    if scales is not None:
      if st.get(SCALES) is None or all(st.get(key) is None for key in CODES):
        scales.zero_()
      else:
        scales.copy_(st[SCALES].reshape(scales.shape))

  @classmethod
  def _move_moments(cls, fmt: str, m, v, scales, st: dict) -> None:
    """Puts the moments of `st` into the views (_fill_moments) and points the state at them."""
    cls._fill_moments(fmt, m, v, scales, st)
    for key in MOMENT_ENTRIES:
      st.pop(key, None)
    st.update(zip(moment_keys(fmt), (m, v)))
    if scales is not None:
      st[SCALES] = scales

  # --- gradients as the backward produces them (offloaded, torch >= 2.1) ---------------
  def _layouts(self) -> Dict[str, Layout]:
    """The built layout, for the methods that run after _build."""
    assert self._layout is not None, "hostopt.torch: the layout is built before it is read"
    return self._layout

  def _add_grad_hooks(self, tag: str, tracked: list, dev: DeviceBuffers) -> None:
    """Hooks on the parameters that require a gradient now (frozen ones cannot have one:
    they get it at a later step, once unfrozen)."""
    if not self._overlap_backward:
      return
    me = weakref.ref(self)  # the hooks must not keep the optimizer alive
    hooked = dev.hooked
    for k, t in enumerate(tracked):
      if k not in hooked and t.param.requires_grad:
        self._hook_handles.append(t.param.register_post_accumulate_grad_hook(grad_hook(me, tag, k)))
        hooked.add(k)

  def _remove_grad_hooks(self) -> None:
    remove_handles(self._hook_handles)
    for layout in (self._layout or {}).values():
      if layout.dev is not None:
        layout.dev.hooked.clear()

  @_serialized
  def adopt_params(self) -> None:
    """Takes every parameter's current values as the master weights (after writes the
    optimizer cannot see, e.g. through ``p.data`` of a 16-bit parameter)."""
    if self._shards is not None:  # (each stand-in takes its shard's values at every step anyway)
      return self._shards.inner.adopt_params()
    if self._store is not None:
      self._drain()  # (as below: a step in flight ends first)
      return self._store.adopt_params()
    if self._layout is None:
      return
    self._drain()
    for layout in self._layout.values():
      for t in layout.tracked:
        p = t.param
        if p.dtype != t.dtype or tuple(p.shape) != t.shape or (
            t.device_view is not None and (p.device != t.device_view.device or not p.is_contiguous())):
          continue  # another layout: the next step takes it (rebuilt, or refused by name)
        if p.data_ptr() != t.ptr and t.device_view is None and p.dtype == torch.float32 and \
            tuple(p.stride()) != t.stride:
          continue  # another memory order: the next step rebuilds around it
        if p.data_ptr() != t.ptr:
          self._reattach(t)
        t.master.copy_(p.detach())
        t.remember()

  @staticmethod
  def _reattach(t: Tracked) -> None:
    """A parameter whose .data the user replaced, back onto hostopt's storage with the values
    it was given: its view of the flat device buffer (offloaded), or its arena slice (a CPU
    float32 parameter is its master). A CPU 16-bit parameter keeps its own storage."""
    p = t.param
    if t.device_view is not None:
      if p.data_ptr() != t.device_view.data_ptr():
        t.device_view.copy_(p.detach().reshape(-1))
        p.data = t.device_view.view(p.shape)
    elif p.dtype == torch.float32:
      fresh = arena_view(t.flat, p)
      fresh.copy_(p.detach())
      p.data = fresh
      t.master = fresh

  def _adopt_user_changes(self, present: Optional[set], every: Optional[list] = None):
    """Parameters and state the user replaced or wrote since the last step take effect (for
    the parameters still in param_groups, `present`: their ids, None when all are; `every`: the
    whole list param_groups selects from, see _whole_list). Everything is checked before
    anything is taken, so a refusal changes nothing. Returns whether the layout must be
    rebuilt, and the state entries the rebuild reads instead of opt.state's (_build)."""
    groups = self.param_groups if every is None else every  # what a Tracked's group indexes
    for tag, layout in self._layouts().items():
      tracked, steps, known = layout.tracked, layout.steps, layout.known
      written = steps.tolist() != known
      for k, t in enumerate(tracked):
        p = t.param
        if present is not None and id(p) not in present:
          if written and _holds_step_view(self.state.get(p), t) and not float(steps[k]) == known[k]:
            check_step(t.step, f"opt.state[p]['step'] of {t.where}")  # written in place: taken below
          continue  # no longer the optimizer's (torch.optim keeps its state, and leaves it alone)
        if tuple(p.shape) != t.shape:
          raise ValueError(f"a parameter changed shape from {t.shape} to {tuple(p.shape)} after it was given to "
                           "the optimizer: its moments no longer fit (make a new optimizer, or load a state)")
        if p.dtype == t.dtype and t.device_view is not None and (
            p.device != t.device_view.device or not p.is_contiguous()):
          raise ValueError(f"{t.where} moved to {p.device} (or to a non-contiguous layout) after it was offloaded "
                           f"on {t.device_view.device}: make a new optimizer for the moved model")
        if p.dtype == t.dtype and t.device_view is None and tuple(p.stride()) != t.stride:
          continue  # rebuilt around the new memory order: _build checks the state
        st = self.state.get(p)
        if not st and k in self._hidden.get(tag, ()):
          continue  # never stepped, no entry written: untouched
        st = self.state[p]
        self._check_taken(t, st)
        if written and st.get("step") is t.step and not float(steps[k]) == known[k]:
          check_step(t.step, f"opt.state[p]['step'] of {t.where}")  # written in place
    rebuild, overrides = False, {}
    for tag, layout in self._layouts().items():
      core, tracked, steps, seg_of, known = layout.core, layout.tracked, layout.steps, layout.seg_of, layout.known
      hidden = self._hidden.get(tag, {})
      for k, t in enumerate(tracked):
        p = t.param
        if present is not None and id(p) not in present:
          continue
        if p.dtype != t.dtype:
          rebuild = True  # another dtype: _build keeps the masters only if they still fit
        elif t.device_view is not None and (p.data_ptr() != t.ptr or p._version != t.version):
          # Offloaded: the host master is the truth, so any write the user made to the device
          # parameter (replaced or in place, any dtype) is adopted unless the master fits it.
          if not rounds_to(t.master.to(p.device), p):
            t.master.copy_(p.detach())
          self._reattach(t)
          t.remember()
        elif t.device_view is None and tuple(p.stride()) != t.stride:
          # Another memory layout (model.to(memory_format=...)): the arena follows the
          # parameter's memory order, so the layout is rebuilt around it, the moments moved
          # by logical element (8-bit codes re-encoded in the new order: their blocks change).
          st = self.state.get(p, {})
          m_key, v_key = CODES
          if t.format == "8bit" and st.get(m_key) is t.m and st.get(v_key) is t.v:
            seed = int(groups[t.group].get("rounding_seed", 0))
            overrides[id(p)] = encoded(*moments_as_f32(st, "8bit", p), "8bit", p, seed)
          rebuild = True
          continue  # the rebuild takes the state as it is
        elif p.data_ptr() != t.ptr:
          if p.dtype == torch.float32:
            if p.is_shared():
              warnings.warn("hostopt.torch: a parameter was moved to shared memory; its values are adopted back "
                            "into hostopt's arena, so it is no longer shared", stacklevel=4)
            self._reattach(t)
          elif not rounds_to(t.master, p):
            t.master.copy_(p.detach())
          t.remember()
        elif p.dtype != torch.float32 and p._version != t.version:
          if not rounds_to(t.master, p):  # the same values (a resume) keep the exact master
            t.master.copy_(p.detach())
          t.remember()
        if k in hidden:
          if not self.state.get(p):
            continue  # never stepped and untouched: no entry to take
          del hidden[k]  # an entry the user wrote: the state, from now on shown
        st = self.state[p]
        keys = moment_keys(t.format)
        m_key, v_key = keys
        if st.get(m_key) is not t.m or st.get(v_key) is not t.v or st.get("step") is not t.step or (
            p.dtype != torch.float32 and st.get(MASTER) is not t.master) or (
            t.scales is not None and st.get(SCALES) is not t.scales) or any(
            key in st for key in MOMENTS + CODES if key not in keys):
          self._take_state(t, st, steps, k)
      if steps.tolist() != known:  # a step count written in place or replaced
        counts = core.tensor_steps
        for k, si in enumerate(seg_of):
          counts[si] = int(steps[k])
        core.tensor_steps = counts
        layout.known = steps.tolist()
    return rebuild, overrides

  def _check_taken(self, t: Tracked, st: dict) -> None:
    """Checks the entries of opt.state[p] the user replaced (_take_state takes them)."""
    keys = moment_keys(t.format)
    if "step" in st and st["step"] is not t.step:
      check_step(st["step"], f"opt.state[p]['step'] of {t.where}")  # (None is no count: refused)
    if t.param.dtype != torch.float32 and st.get(MASTER) is not t.master and st.get(MASTER) is not None:
      check_master(st[MASTER], t.param, f"opt.state[p] of {t.where}")
    if any(st.get(key) is not view for key, view in zip(keys + (SCALES,), (t.m, t.v, t.scales))
           if view is not None) or any(key in st for key in MOMENTS + CODES if key not in keys):
      where = f"opt.state[p] of {t.where}"
      if check_moment_state(st, t.format, t.param, where):
        raise ValueError(f"{where}: 8-bit codes laid out in another memory order than the parameter (their "
                         "blocks are not its blocks)")

  def _take_state(self, t: Tracked, st: dict, steps: np.ndarray, k: int) -> None:
    """The user replaced or deleted entries of opt.state[p] (checked: _check_taken): as
    torch, they are the state (moments in the group's format; deleted ones are zeros)."""
    keys = moment_keys(t.format)
    if any(st.get(key) is not view for key, view in zip(keys + (SCALES,), (t.m, t.v, t.scales))
           if view is not None) or any(key in st for key in MOMENTS + CODES if key not in keys):
      self._move_moments(t.format, t.m, t.v, t.scales, st)
    if st.get("step") is not t.step:
      steps[k] = check_step(st["step"], "") if "step" in st else 0  # a deleted step restarts
      st["step"] = t.step
    if t.param.dtype != torch.float32 and st.get(MASTER) is not t.master:
      value = st.get(MASTER)
      if value is not None:  # (checked; a deleted master keeps the arena's)
        t.master.copy_(value)
      st[MASTER] = t.master

  def _stream(self) -> int:
    """Where the gradients are produced and the parameters read: torch's current CUDA stream
    (the legacy default stream is cudaStreamLegacy, handle 1), or the host engine's stand-in."""
    if self._offload == "host" or self._engine.name == "host":
      return self._engine_stream
    handle = torch.cuda.current_stream(self._engine_device()).cuda_stream
    return handle or 1

  def _engine_device(self):
    return next(p.device for g in self.param_groups for p in g["params"])

  def _offloaded_step(self, tag: str, tracked: list, dev: DeviceBuffers, skip: bool, norm: Optional[float]) -> None:
    """Gradients gathered into the flat device buffer, then one pipeline step ordered after
    the current stream; the stream waits (on the device) for the gradients to be consumed
    and the parameters to be ready, so the next forward and backward need no host wait."""
    without = []
    for k, t in enumerate(tracked):
      g = t.param.grad
      if g is not None and g.is_sparse:
        raise RuntimeError("hostopt.torch does not support sparse gradients")
      if g is None:  # as torch: left alone, its own step count stays
        without.append(self._layouts()[tag].seg_of[k])
      elif g.data_ptr() != t.grad_view.data_ptr():
        t.grad_view.copy_(g.reshape(-1))  # on the device, on the current stream
    chunks = dev.chunks
    if len(without) == len(tracked):
      if chunks is not None:
        chunks.forget()
      return  # no gradient at all: nothing to step (torch does nothing either)
    stream = self._stream()
    # Chunks whose gradients the backward hooks saw complete (and nobody wrote since) are
    # copied as soon as the device is past them; the rest wait for the whole stream.
    events = chunks.ready_events(dev.grads) if chunks is not None else []
    h = dev.pipe.step_async(dev.grads.data_ptr(), tag, dev.params.data_ptr(), tag, dev.n,
                               grads_stream=stream, chunk_grads_events=events, tensors_without_grad=without,
                               skip_nonfinite=skip, known_grad_norm=-1.0 if norm is None else norm)
    self._last_chunk_events += sum(1 for e in events if e)
    self._engine.stream_wait_event(stream, h.grads_consumed)
    self._engine.stream_wait_event(stream, h.params_ready)
    self._pending.append((h, tag))
    if not self._overlap:
      self._drain()

  def _drain(self) -> None:
    """Waits for offloaded steps in flight (their errors surface here) and updates the
    per-parameter step counts."""
    if self._store is not None:  # (overlap: its one step in flight)
      self._stored(self._store.finish())
      return
    pending, self._pending = self._pending, []
    results = []
    for h, tag in pending:
      results.append(h.wait())
      layout = self._layouts()[tag]
      counts = layout.core.tensor_steps
      layout.steps[:] = [counts[si] for si in layout.seg_of]
      layout.known = layout.steps.tolist()
      self._show_stepped(tag)
      # No remember(): the pipeline's copies do not touch the parameters' version or storage,
      # so whatever the user did since the call is still seen by _adopt_user_changes.
    if results:
      self.last_step = _merged(results)
      _report_blocks(self, self.last_step, "hostopt.torch")

  def _load_own_state(self, state_dict: dict) -> None:
    """load_state_dict with store=: only of the state the store holds (accelerate's prepare
    loads what state_dict gave it), whose param_groups' hyper-parameters are then taken, as
    torch takes them, checked first; any other state is refused, nothing changed."""
    store = cast(TorchStore, self._store)
    saved = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
    if not isinstance(saved, list) or len(saved) != len(self.param_groups) or any(
        not isinstance(s, dict) or len(s.get("params", ())) != len(g["params"]) for s, g in zip(saved, self.param_groups)):
      raise ValueError("load_state_dict with store=: param_groups of another shape than this optimizer's; nothing "
                       "was changed")
    merged = []
    for gi, (group, s) in enumerate(zip(self.param_groups, saved)):
      where = f"state_dict['param_groups'][{gi}]"
      candidate = {**group, **{k: v for k, v in s.items() if k != "params"}}
      self._refuse_unsupported(candidate, where)
      self._config(candidate, where)  # the hyper-parameters a step takes, checked now
      for key, held in (("moments", self._group_format(group)), ("rounding_seed", group.get("rounding_seed", 0))):
        if candidate.get(key, held) != held:
          raise ValueError(f"load_state_dict with store=: {where}[{key!r}] = {candidate.get(key)!r}, the store "
                           f"holds {held!r} (fixed when it was made); nothing was changed")
      merged.append({k: v for k, v in s.items() if k != "params"})
    # torch's mapping: the saved parameter ids, in param_groups order, name the parameters in order.
    position = {saved_id: k for k, saved_id in enumerate(i for s in saved for i in s["params"])}
    state = state_dict.get("state", {})
    if not isinstance(state, dict) or not (store.is_own_export(state, position) or store.same_state(state, position)):
      raise ValueError("load_state_dict with store=: the store is the checkpoint (every step commits there), and "
                       "this state is not the one it holds; to bring another state into a store, load it into an "
                       "optimizer without store= and make the store with hostopt.StoredOptimizer.from_optimizer, or "
                       "start a new store from the model; nothing was changed")
    for group, values in zip(self.param_groups, merged):  # (in place: the store's groups stay these dicts)
      group.update(values)

  @property
  def store(self) -> Any:
    """With ``store=``, the store (its ``chunks``, ``stripes``, ``io_backend``,
    ``recovery``, ``step_io_bytes``, ``cached_pages``, ``step_count``); else None."""
    if self._shards is not None:  # (DTensor parameters: this rank's store, held by the inner optimizer)
      return self._shards.inner.store
    return None if self._store is None else self._store.core

  @_serialized
  def close(self) -> None:
    """With ``store=``: releases the store (its lock and staging memory; every completed
    step is on the drives already), so another optimizer may open it; later steps raise.
    Without: nothing to release."""
    if self._shards is not None:
      self._shards.inner.close()
    if self._store is not None:
      try:
        self._drain()  # (an overlapped step in flight ends first; its error raises once the store is closed)
      finally:
        self._store.close()

  @_serialized
  def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
    """Resets the gradients, as torch.optim.Optimizer.zero_grad: ``set_to_none`` None is the
    installed torch's default (True since torch 2.0), True sets each ``p.grad`` to None,
    False zeroes it in place (a zero gradient is a gradient: the parameter is stepped)."""
    self._views = {}  # the cached views must not keep freed gradients alive
    if set_to_none is None:
      return super().zero_grad()
    return super().zero_grad(set_to_none)

  # --- the step -----------------------------------------------------------------------
  @torch.no_grad()
  def step(self, closure: Optional[Callable[[], float]] = None):
    """Performs a single optimization step (one fused pass per parameter dtype)."""
    loss = None
    if closure is not None:
      with torch.enable_grad():
        loss = closure()
    self._step()
    return loss

  @_serialized
  def _step(self) -> None:
    if self._shards is not None:
      return self._shards.step()
    if self._store is not None:
      self._drain()  # (overlap: the step in flight; its error raises here, nothing of this one stepped)
      self._stored(self._store.step(self._skip_nonfinite))
      return None
    plan = self._prepare_step()
    self._run_step(plan, self._grad_norm() if plan.skip else None)

  def _stored(self, result: Any) -> None:
    """A store's step result (None: nothing had a gradient) as last_step, its blocks reported."""
    if result is not None:
      self.last_step = _merged([result])
      _report_blocks(self, self.last_step, "hostopt.torch")

  def _prepare_step(self) -> _StepPlan:
    """Everything a step takes and checks before any parameter or moment changes: the user's
    changes adopted, the layout (re)built, every group's hyper-parameters and every gradient
    checked. A refused step raises here (nothing stepped); the DTensor path agrees across
    ranks between this and _run_step."""
    self._drain()
    every = self._whole_list()
    if self._layout is None:
      self._build_for(every)
    else:
      self._check_formats()
      # Appended to or replaced in param_groups[i]["params"]: as add_param_group.
      changed = self._params_changed(every if every is not None else self.param_groups)
      present = {id(p) for g in self.param_groups for p in g["params"]} if changed or every is not None else None
      rebuild, overrides = self._adopt_user_changes(present, every)
      if rebuild or changed:
        self._build_for(every, overrides)
    # The built groups stepped (None: all of them), and each given group's place among them.
    only, places = None, list(range(len(self.param_groups)))
    if every is not None:  # (built for `every`: its positions are the layout's groups)
      index = {id(g): i for i, g in enumerate(every)}
      places = [index[id(g)] for g in self.param_groups]
      only = set(places)
    configs = {places[gi]: self._config(g, f"param_groups[{gi}]")  # lr schedulers and edits take effect here
               for gi, g in enumerate(self.param_groups)}
    self._check_grads(only)  # every dtype's, before any is stepped
    # One decision for every dtype's core: the norm of all gradients, when checked.
    skip = self._skip_nonfinite
    if skip is None:
      skip = (any(self._group_format(g) == "8bit" for g in self.param_groups)
              and all(entry.dev is None for entry in self._layouts().values()))
    return _StepPlan(only, configs, bool(skip))

  def _run_step(self, plan: _StepPlan, norm: Optional[float]) -> None:
    """The step _prepare_step checked; `norm` is the gradients' global norm where plan.skip
    (the non-finite check), else None."""
    only, configs, skip = plan
    results = []
    self._last_chunk_events = 0
    for tag, layout in self._layouts().items():
      for gi, cfg in configs.items():
        if self._applied.get((tag, gi)) != cfg:
          layout.core.set_group_config(self._group_of[tag][gi], cfg)
          self._applied[(tag, gi)] = cfg
    for tag, layout in self._layouts().items():
      core, tracked, steps, seg_of, dev = layout.core, layout.tracked, layout.steps, layout.seg_of, layout.dev
      if dev is not None:
        self._offloaded_step(tag, tracked, dev, skip, norm)
        self._add_grad_hooks(tag, tracked, dev)  # parameters unfrozen since
        continue
      grads: List = [None] * len(seg_of)
      outs: List = [None] * len(seg_of)
      any_grad = False
      for i, t in enumerate(tracked):
        p = t.param
        g = p.grad if only is None or t.group in only else None
        cached = self._views.get((tag, i))
        if g is None:
          view = None
        elif cached is not None and cached.grad is g and cached.ptr == g.data_ptr():
          view = cached.view  # the same gradient tensor as last step (zero_grad keeps it)
        else:
          if g.is_sparse:
            raise RuntimeError("hostopt.torch does not support sparse gradients")
          convert = g.dtype != p.dtype or g.stride() != p.stride() or not dense_order(g)
          if convert:  # another dtype or layout than its parameter: one copy, every step
            g = torch.empty_like(p).copy_(g)
          view, _ = as_buffer(flat(g), f"grad of parameter {i}")
          if not convert:
            self._views[(tag, i)] = _GradView(p.grad, p.grad.data_ptr(), view)
        any_grad = any_grad or view is not None
        grads[seg_of[i]] = view
        if tag != "f32":
          outs[seg_of[i]], _ = as_buffer(flat(p.data), "param", writable=True)
      if not any_grad:
        continue
      results.append(core.step_tensors(grads, tag, outs if tag != "f32" else [], tag, 1.0, 0.0, skip,
                                       -1.0 if norm is None else norm))
      counts = core.tensor_steps
      steps[:] = [counts[si] for si in seg_of]
      layout.known = steps.tolist()
      self._show_stepped(tag)
      if tag != "f32":
        for t in tracked:
          if only is None or t.group in only:  # (a group left out keeps the user's writes to adopt)
            t.remember()  # hostopt's own write (through numpy) is not the user's
    if results:
      self.last_step = _merged(results)
      _report_blocks(self, self.last_step, "hostopt.torch")

  def _whole_list(self) -> Optional[list]:
    """DeepSpeed's ZeRO optimizer steps one group at a time: it sets param_groups to a list of
    just its group i, calls step() and puts the list back. Where param_groups holds only some of
    the groups this optimizer was last given (the same dicts), returns that whole list: the
    layout stays built for all of it (rebuilt per call, it would copy the whole state twice per
    DeepSpeed step, and compressed moments, rounded by arena position, would change bits), and
    only the groups present are stepped; the others keep their state untouched, as torch.optim
    leaves them. Otherwise None, and param_groups is the list from now on (torch.optim steps
    whatever the lists hold). Offloaded parameters take the general path (their gradients
    arrive through hooks on every group)."""
    known = self.__dict__.get("_given_groups")
    given = self.param_groups
    # (Only while the layout is built for that list, or before the first build: a group removed
    # after the build is gone, as add_param_group's was never there until built.)
    if known is not None and len(given) < len(known) and self._offload is None and (
        self._layout is None or not self._params_changed(known)):
      index = {id(g): i for i, g in enumerate(known)}
      places = {index.get(id(g)) for g in given}
      if None not in places and len(places) == len(given) and all(
          p.device.type == "cpu" for g in known for p in g["params"]):
        return known
    self._given_groups = list(given)
    return None

  def _build_for(self, every: Optional[list], overrides: Optional[dict] = None) -> None:
    """_build for param_groups, or for the whole list `every` some of whose groups it holds."""
    if every is None:
      return self._build(overrides)
    given = self.param_groups
    self.param_groups = every
    try:
      self._build(overrides)
    finally:
      self.param_groups = given

  def _grad_norm(self) -> float:
    """The global norm of every gradient of param_groups (float32 per tensor, as the kernel
    squares them: inf past sqrt(FLT_MAX); NaN with a NaN), one device sync per device."""
    by_device: Dict = {}
    for group in self.param_groups:
      for p in group["params"]:
        if p.grad is not None:
          by_device.setdefault(p.grad.device, []).append(torch.linalg.vector_norm(p.grad, dtype=torch.float32))
    total = 0.0
    for norms in by_device.values():
      total += float(torch.linalg.vector_norm(torch.stack(norms).double())) ** 2
    return math.sqrt(total)

  def _params_changed(self, groups: list) -> bool:
    """Whether `groups` (param_groups, or the whole list it selects from) holds other
    parameters than the layout was built for (torch.optim steps whatever the lists hold)."""
    built = self._built_params
    return len(built) != len(groups) or any(
        len(old) != len(group["params"]) or any(a is not b for a, b in zip(old, group["params"]))
        for old, group in zip(built, groups))

  def _check_grads(self, only: Optional[set] = None) -> None:
    """Refuses gradients no step can take, for every parameter of every dtype (of the groups
    `only` where given) before any is stepped (a refused step changes nothing, as in torch.optim)."""
    for tag, layout in self._layouts().items():
      steps = layout.steps
      for i, t in enumerate(layout.tracked):
        g = t.param.grad
        if g is None or (only is not None and t.group not in only):
          continue
        if g.layout != torch.strided:
          raise RuntimeError(f"{t.where} has a sparse gradient ({g.layout}): hostopt.torch does not support sparse "
                             "gradients; nothing was stepped")
        if tuple(g.shape) != tuple(t.param.shape) or (t.device_view is None and g.device != t.param.device):
          raise ValueError(f"{t.where} has a gradient of shape {tuple(g.shape)} on {g.device}: expected the "
                           f"parameter's, {tuple(t.param.shape)} on {t.param.device}; nothing was stepped")
        if not float(steps[i]) < MAX_STEP:
          raise ValueError(f"{t.where} is at step {int(steps[i])}, the largest step count ({power_text(MAX_STEP)}, "
                           "the core's max_step_count): no further step can be taken; nothing was stepped")

  # --- state_dict -----------------------------------------------------------------------
  @_serialized
  def state_dict(self) -> dict:
    """torch's format, as copies: the tensors handed out are not the arena, so an
    optimizer that loads them (torch 2 does not copy) never shares hostopt's state. 16-bit
    parameters add their f32 masters as "master_param". The entries are opt.state's, as in
    torch: a parameter that never received a gradient has none."""
    self._drain()
    exported = None
    if self._shards is not None:
      self._shards.refresh()  # opt.state as DTensors (torch.distributed.checkpoint saves them sharded)
      exported = self._shards.exported()  # (store=: this rank's store's state, as DTensors)
    elif self._store is not None:
      exported = self._store.export_state()
    if exported is not None:  # exported (the whole state through RAM once), torch's hooks run on it
      shown = {p: self.state.get(p) for p in exported}
      try:
        for p, st in exported.items():
          self.state[p] = st
        return super().state_dict()
      finally:
        for p, st in shown.items():
          if st is None:
            self.state.pop(p, None)
          else:
            self.state[p] = st
    sd = super().state_dict()
    sd["state"] = {k: {key: (v.clone() if torch.is_tensor(v) else v) for key, v in st.items()}
                   for k, st in sd["state"].items()}
    return sd

  @_serialized
  def load_state_dict(self, state_dict: dict, convert_moments: bool = False) -> None:
    """Loads torch's format (from hostopt or torch.optim.Adam/AdamW) into the arena, with
    each parameter's own step; f32 moments and masters are kept exact (torch would cast
    them to a 16-bit parameter's dtype).

    Each group keeps the moment format it was built with; the saved one is the saved
    group's ``moments`` (f32 for torch.optim's). Moments of another format (or 8-bit codes
    of a parameter laid out in another memory order) are refused, with nothing changed,
    unless ``convert_moments=True``: they are then converted here (decoded exactly, then
    encoded: lossy into bf16 or 8-bit). With ``store=``, only the state the store holds is
    taken (accelerate's prepare loads what ``state_dict`` gave it): its param_groups'
    hyper-parameters; any other state is refused (ValueError)."""
    self._drain()
    # torch 2's load pre-hooks, as torch.optim runs them: on a shallow copy, and what they
    # return is what is checked and loaded (torch's own load below runs without them).
    pre_hooks = self.__dict__.get("_optimizer_load_state_dict_pre_hooks")
    post_hooks = self.__dict__.get("_optimizer_load_state_dict_post_hooks")
    state_dict = state_dict.copy()
    for hook in list((pre_hooks or {}).values()):
      result = hook(self, state_dict)
      if result is not None:
        state_dict = result
    if self._store is not None:
      self._load_own_state(state_dict)
      for hook in list((post_hooks or {}).values()):
        hook(self)
      return
    if self._shards is not None:  # DTensor entries: their local shards, loaded by the inner optimizer
      self._shards.load_state_dict(state_dict, convert_moments)
      for hook in list((post_hooks or {}).values()):
        hook(self)
      return
    saved_groups = state_dict["param_groups"]
    for gi, group in enumerate(saved_groups):
      self._refuse_unsupported(group, f"state_dict['param_groups'][{gi}]")
      hyper_parameters(group, f"state_dict['param_groups'][{gi}]")
    indices = {index for group in saved_groups for index in group["params"]}
    for index in state_dict["state"]:
      if index not in indices:
        raise ValueError(f"state_dict['state'][{index!r}] belongs to no parameter: no saved param group lists index "
                         f"{index!r}; nothing was loaded")
    formats = [self._group_format(g) for g in self.param_groups]
    seeds = [g.get("rounding_seed", 0) for g in self.param_groups]
    # Every saved state is checked before anything changes: its moments' format against its
    # group's, its tensors, step and master against the parameter (torch names count
    # mismatches itself, also before it changes anything).
    todo = {}  # saved index -> its moments converted into the group's format (state entries)
    haves = {}  # saved index -> its format
    if len(saved_groups) == len(formats) and all(
        len(a["params"]) == len(b["params"]) for a, b in zip(saved_groups, self.param_groups)):
      for gi, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
        have = _core.moment_format(str(saved.get("moments", "f32")))
        seed = _check_seed(saved.get("rounding_seed", seeds[gi]), f"state_dict['param_groups'][{gi}]['rounding_seed']")
        for index, p in zip(saved["params"], group["params"]):
          st = state_dict["state"].get(index)
          if st is None:
            continue
          where = f"state_dict['state'][{index}]"
          relaid = check_moment_state(st, have, p, where)
          if "step" in st:
            check_step(st["step"], f"{where}['step']")
          if MASTER in st:
            check_master(st[MASTER], p, where)
          haves[index] = have
          if have == formats[gi] and not relaid:
            continue
          if not convert_moments:
            why = (f"holds {have} moments, param_groups[{gi}] stores {formats[gi]}" if have != formats[gi] else
                   "holds 8-bit codes of a parameter laid out in another memory order (their blocks are not this "
                   "parameter's)")
            raise ValueError(f"{where} {why}: pass convert_moments=True to convert them (lossy into bf16 or 8-bit); "
                             "nothing was loaded")
          # Converted now, from the saved tensors: a conversion that fails changes nothing.
          todo[index] = encoded(*moments_as_f32(st, have, p), formats[gi], p, seed)
    # Moments, codes and masters as saved (torch casts every state tensor to a floating
    # parameter's dtype, 8-bit codes too): f32 moments and masters exact, others their own dtype.
    exact = {k: {key: v for key, v in st.items()
                 if key in MOMENTS + CODES + (MASTER, SCALES) and torch.is_tensor(v)}
             for k, st in state_dict["state"].items()}
    hooks: Dict[str, Any] = {key: self.__dict__[key] for key in ("_optimizer_load_state_dict_pre_hooks",
                                                 "_optimizer_load_state_dict_post_hooks") if key in self.__dict__}
    try:
      self.__dict__.update({key: collections.OrderedDict() for key in hooks})  # run here, not in torch's load
      super().load_state_dict(state_dict)
    finally:
      self.__dict__.update(hooks)
    for gi, group in enumerate(self.param_groups):  # the formats stay; the seeds are the saved ones
      group["moments"] = formats[gi]
      group.setdefault("rounding_seed", seeds[gi])
    params = [p for g in self.param_groups for p in g["params"]]
    ids = [i for g in state_dict["param_groups"] for i in g["params"]]
    for index, p in zip(ids, params):
      st = self.state.get(p)
      if st is None:
        continue
      for key, v in list(st.items()):
        # Copies: the loaded dict's tensors may be another optimizer's live state (torch 2
        # does not copy), and 16-bit parameters' moments and masters stay f32 (torch casts).
        if key in exact.get(index, {}):
          keep = exact[index][key].detach()
          own_dtype = key in CODES + (SCALES,) or (haves.get(index) == "bf16" and key in MOMENTS)
          st[key] = (keep.to(device="cpu") if own_dtype else keep.to(dtype=torch.float32, device="cpu")).clone()
        elif torch.is_tensor(v):
          st[key] = v.detach().clone()
      if index in todo:  # the explicit conversion, applied now: state_dict and copies see its result
        for key in MOMENT_ENTRIES:
          st.pop(key, None)
        st.update(todo[index])
    # Built at the next step, when the parameters hold what the caller loaded into the model
    # (before or after this call): the f32 masters are kept exactly when they still fit.
    self._layout, self._hidden = None, {}
    self._given_groups = list(self.param_groups)  # torch's load made new group dicts (see _whole_list)
    for hook in list((post_hooks or {}).values()):  # torch 2's: they see (and may edit) the loaded state
      hook(self)


# The update rules, as the kernel computes them (README: "What the step does"); t is the
# parameter's own step count, which starts at its first gradient.
_RULES = {
    "adam": r"""
  .. math::

    \begin{aligned}
      g_t &\leftarrow \pm\nabla_\theta f_t(\theta_{t-1}) + \lambda\,\theta_{t-1}
          && \text{(minus with maximize; coupled L2 decay)} \\
      m_t &\leftarrow \beta_1 m_{t-1} + (1 - \beta_1)\, g_t \\
      v_t &\leftarrow \beta_2 v_{t-1} + (1 - \beta_2)\, g_t^2 \\
      \theta_t &\leftarrow \theta_{t-1}
          - \eta\,\frac{m_t / (1 - \beta_1^t)}{\sqrt{v_t / (1 - \beta_2^t)} + \epsilon}
    \end{aligned}
""",
    "adamw": r"""
  .. math::

    \begin{aligned}
      g_t &\leftarrow \pm\nabla_\theta f_t(\theta_{t-1}) && \text{(minus with maximize)} \\
      m_t &\leftarrow \beta_1 m_{t-1} + (1 - \beta_1)\, g_t \\
      v_t &\leftarrow \beta_2 v_{t-1} + (1 - \beta_2)\, g_t^2 \\
      \theta_t &\leftarrow \theta_{t-1}\,(1 - \eta\lambda)
          - \eta\,\frac{m_t / (1 - \beta_1^t)}{\sqrt{v_t / (1 - \beta_2^t)} + \epsilon}
          && \text{(decoupled decay)}
    \end{aligned}
""",
}

_DECAY = {
    "adam": """weight_decay (float, default 0.0): :math:`\\lambda`, L2 decay added to the gradient
      (``g += weight_decay * p``, before the moments), as torch.optim.Adam; decoupled instead
      with ``decoupled_weight_decay=True``. ``>= 0``, else ValueError.""",
    "adamw": """weight_decay (float, default 1e-2): :math:`\\lambda`, decoupled decay: each step
      scales the parameter by ``1 - lr * weight_decay`` before Adam's update (the moments
      never see it), as torch.optim.AdamW. ``>= 0``, else ValueError.""",
}


def _doc(mode: str) -> str:
  """The class docstring of Adam or AdamW: one argument list, each one's own rule."""
  name, torch_name = ("Adam", "torch.optim.Adam") if mode == "adam" else ("AdamW", "torch.optim.AdamW")
  summary = ("Adam with coupled L2 weight decay, as torch.optim.Adam, its state in host RAM." if mode == "adam" else
             "AdamW (decoupled weight decay), as torch.optim.AdamW, its state in host RAM.")
  decoupled = "False" if mode == "adam" else "True"
  return f"""{summary}

  A drop-in for {torch_name} (the module's docstring says what it keeps of torch's
  semantics): the master weights and moments live in one flat arena of host memory, updated
  by hostopt's SIMD kernel in one fused pass per parameter dtype. Per parameter, with
  :math:`t` its own step count (it starts at the parameter's first gradient):
{_RULES[mode]}
  float32 parameters are the master weights (views into the arena from the first step on);
  bfloat16/float16 ones keep float32 masters (``state[p]["master_param"]``) and receive the
  rounded :math:`\\theta_t`. ``opt.state[p]`` holds ``step``, ``exp_avg`` and ``exp_avg_sq``
  (8-bit moments: ``exp_avg_codes``, ``exp_avg_sq_codes`` and ``moment_scales``), as views
  into the arena, for the parameters that have been stepped; ``state_dict`` is torch's format.

  Args:
    params (iterable): tensors, or dicts defining param groups (``params`` and any of lr,
      betas, eps, weight_decay, maximize, decoupled_weight_decay, moments, rounding_seed),
      as torch.optim takes them. float32, bfloat16 or float16, dense in any dimension order
      (``channels_last``), all on the CPU or all on one CUDA device. An empty list is
      refused (ValueError, as torch); another dtype (TypeError), a strided view with gaps
      and a parameter listed twice (ValueError) are refused at the first step.
    lr (float, default 1e-3): the learning rate :math:`\\eta`. ``>= 0``, else ValueError;
      a group's lr is read at every step (lr schedulers), where it must also be finite.
    betas (tuple[float, float], default (0.9, 0.999)): :math:`(\\beta_1, \\beta_2)`, the
      decay rates of the first and second moment, each in ``[0, 1)``, else ValueError.
    eps (float, default 1e-8): :math:`\\epsilon`, added to the bias-corrected
      :math:`\\sqrt{{v}}` in the denominator. ``>= 0`` (finite at the step), else ValueError.
    {_DECAY[mode]}
    amsgrad (bool, default False): refused when True (ValueError): its running max of
      :math:`v` does not fit the single pass.
    foreach (bool or None, default None): accepted for compatibility; changes nothing (the
      step is always one fused pass).
    maximize (bool, default False): ascend instead of descend (the gradient's sign flipped),
      as torch; per group.
    capturable (bool, default False): refused when True (ValueError): a CUDA-graph feature
      hostopt does not offer.
    differentiable (bool, default False): refused when True (ValueError): autograd through
      the step is not offered.
    fused (bool or None, default None): accepted for compatibility; changes nothing.
    decoupled_weight_decay (bool or None, default None): None means {decoupled} here.
      True decays as AdamW (``p *= 1 - lr * weight_decay``), False as Adam (L2 added to
      the gradient), as torch 2's ``Adam(decoupled_weight_decay=...)``; per group.
    threads (int or None, default None): CPU threads of the step. None or 0: hostopt's
      default for every front, OMP_NUM_THREADS when set, else every physical core of the process's CPU set
      (``hostopt.default_threads()``). An integer (a float, bool or string: TypeError, never truncated);
      more than 4 times the hardware threads (``hostopt._core.max_threads()``, at most
      1024), or a negative count: ValueError.
    offload (str or None, default None): where the parameters live. None: CUDA parameters
      go through the offload pipeline (they become views of one flat device buffer; the
      gradients are copied to host memory and the new parameters back, chunk by chunk,
      while the CPU updates), CPU parameters are stepped in place. ``"cuda"``: the
      pipeline, required: refused at construction if a parameter is on the CPU
      (ValueError) or hostopt was built without CUDA or sees no device (RuntimeError).
      ``"host"``: the pipeline with CPU tensors standing in for device ones (how it is
      tested without a GPU). Anything else: ValueError. Offloaded parameters must be
      contiguous (refused at the first step otherwise).
    offload_chunk (int, default 1 << 22): elements per pipeline chunk (the unit copied and
      updated while the next one is in flight; cut on whole 32-element blocks with 8-bit
      moments). An integer ``> 0``: ValueError otherwise (TypeError for a float or bool).
    overlap (bool, default False): offloaded: ``step()`` returns without waiting for the
      CPU update; the device stream waits for the new parameters on its own, and an error
      surfaces at the next ``step``/``state_dict`` (with ``store=``: ``close`` too, and
      ``last_step`` is that step's from then on). Refused with ``offload="host"``
      (ValueError): torch's CPU ops are not ordered on a stream.
    overlap_backward (bool, default False): offloaded, torch >= 2.1: post-accumulate-grad
      hooks move each gradient into the flat gradient buffer as the backward completes it
      (``p.grad`` becomes a view of it) so that the pipeline starts on early chunks during
      the backward. Between the backward and ``step()``, write gradients only through torch
      ops on ``p.grad`` (writes through ``.data``, numpy or collectives are not seen).
      Refused (ValueError) on torch < 2.1 and when every parameter is on the CPU without
      ``offload="host"``.
    moments (str, default "f32"): the moments' format, for every group that does not set
      its own: ``"f32"`` (12 bytes per parameter with the f32 master), ``"bf16"``
      (stochastically rounded bfloat16, 8 bytes) or ``"8bit"`` (block floating point over
      32 elements, 6.06 bytes). A group's format is fixed once built (convert through
      ``load_state_dict(..., convert_moments=True)`` into a new optimizer). Another name:
      ValueError.
    rounding_seed (int, default 0): the seed of the compressed moments' stochastic
      rounding (the same seed gives the same bits); per group. An integer in
      ``[0, 2**64)``, else ValueError (bools included).
    skip_nonfinite (bool or None, default None): True: every gradient is checked first
      (one norm over all of them); a non-finite one, or a norm above sqrt(FLT_MAX), skips
      the step for every parameter, changing nothing. None: checked when a group has 8-bit
      moments and the parameters are stepped in place (a NaN would poison its block for
      good). False: never. ``opt.last_step`` tells what a step did. Anything but None,
      True or False: TypeError.
    store (str or None, default None): a directory (a path; a list of them stripes the state,
      one directory per drive) to keep the state on local drives, not in RAM
      (hostopt.StoredOptimizer): each step streams it through staging buffers and commits,
      so what is on the drives is always a verified checkpoint of the last completed step.
      The in-RAM
      optimizer's bits where the parameters share one dtype (its layout), and its
      ``state_dict`` format (an export through RAM, which the in-RAM optimizer loads).
      A parameter without a gradient keeps its state and its own step count, as in RAM
      (parameters frozen when it is made are left out). It needs a fixed ``param_groups`` and fixed
      shapes and memory orders: ``add_param_group`` and the ``load_state_dict`` of another
      state are refused (ValueError); ``overlap_backward`` (offloaded) starts each chunk as in
      RAM; ``overlap`` (CUDA) returns before the step commits, its result (``last_step``)
      or error coming with the next ``step``/``state_dict``/``close``. DTensor parameters
      (FSDP2, ``overlap`` refused): each rank's
      shards in a store of its own, ``rank{{r}}-of-{{world}}`` under the directory;
      ``resume=True`` opens every rank's at the last step all of them committed
      (``state_dict`` shows DTensors). CUDA parameters (or ``offload="host"``; one dtype) go through the
      offload pipeline, which streams the store. Values the user writes into a parameter
      become its master at the next applied step, as in RAM (offloaded: kept through a
      skipped or failed step, in the parameter and in ``state_dict``).
      ``opt.state[p]`` holds only ``step``. ``close()`` releases the store; ``opt.store``
      tells its chunks and ``recovery``.
    store_options (dict or None, default None): hostopt.StoredOptimizer's keywords
      (staging_bytes, buffers, chunk_elements, sync, io, kernel).
    resume (bool, default False): open the store at its last completed step instead of
      making a new one (refused where there is none, as making one is where one exists):
      the parameters' values become the store's. The hyper-parameters stay param_groups':
      after loading an lr scheduler's state_dict, set each group's ``lr`` from its
      ``get_last_lr()``, which a fresh optimizer's ``load_state_dict`` would have restored.

  Attributes:
    last_step (StepStats or None): what the last step did (applied, step, skipped_steps,
      grad_norm, poisoned_blocks, saturated_blocks); None before the first step.

  Example:
    >>> import torch, hostopt.torch
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = hostopt.torch.{name}(model.parameters(), lr=1e-3)
    >>> model(torch.ones(8, 4)).pow(2).mean().backward()
    >>> opt.step()
    >>> float(opt.state[model.weight]["step"])
    1.0
    >>> sorted(opt.state_dict()["state"][0])
    ['exp_avg', 'exp_avg_sq', 'step']

    8-bit moments for the matrix, f32 for the bias:

    >>> opt = hostopt.torch.{name}([{{"params": [model.weight], "moments": "8bit"}},
    ...                            {{"params": [model.bias]}}], lr=1e-3)
  """


class Adam(_HostAdam):
  __doc__ = _doc("adam")
  _mode = "adam"


class AdamW(_HostAdam):
  __doc__ = _doc("adamw")
  _mode = "adamw"

  # The whole signature (help() and inspect.signature show every option; an unknown
  # keyword is Python's own TypeError); only weight_decay's default differs from Adam's.
  def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
               amsgrad: bool = False, *, foreach: Optional[bool] = None, maximize: bool = False,
               capturable: bool = False, differentiable: bool = False, fused: Optional[bool] = None,
               decoupled_weight_decay: Optional[bool] = None, threads: Optional[int] = None,
               offload: Optional[str] = None, offload_chunk: int = 1 << 22, overlap: bool = False,
               overlap_backward: bool = False, moments: str = "f32", rounding_seed: int = 0,
               skip_nonfinite: Optional[bool] = None, store=None, store_options: Optional[dict] = None,
               resume: bool = False):
    super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach, maximize=maximize,
                     capturable=capturable, differentiable=differentiable, fused=fused,
                     decoupled_weight_decay=decoupled_weight_decay, threads=threads, offload=offload,
                     offload_chunk=offload_chunk, overlap=overlap, overlap_backward=overlap_backward,
                     moments=moments, rounding_seed=rounding_seed, skip_nonfinite=skip_nonfinite, store=store,
                     store_options=store_options, resume=resume)
