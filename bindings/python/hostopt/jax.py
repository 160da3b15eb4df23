r"""hostopt.jax: JAX training with the optimizer state resident in hostopt (host memory).

optax's contract hands the whole state back to JAX every step; this front does not. The
float32 master parameters and Adam moments live in a hostopt arena (12 bytes per parameter
of state; 8 with ``moments="bf16"``, 6.06 with ``moments="8bit"``), gradients come in zero-copy from JAX CPU arrays, one fused pass updates
everything, and the new parameters come out in ``param_dtype`` straight into buffers handed
to JAX without a copy (a sketch: adamw's docstring has a complete example)::

  import hostopt.jax as hj
  opt = hj.adamw(params, learning_rate=schedule, weight_decay=0.1, mask=decay_mask,
                 param_dtype=jnp.bfloat16)
  grads_fn = jax.jit(jax.grad(loss))
  for batch in data:
    params = opt.step(grads_fn(params, batch))      # same tree, new jax arrays

Also ``opt.accumulate(grads)`` (micro-batches summed in a host f32 accumulator; the next
``step`` averages them like optax.MultiSteps), ``step(grads, grad_norm=...)`` (a norm
computed on the device), ``max_grad_norm`` (clipping by global norm, optax's rule) and
``skip_nonfinite`` (a step with a non-finite gradient changes nothing and is reported in
``opt.last_step``; on by default when a group has 8-bit moments), schedules for ``learning_rate`` and ``weight_decay`` (called with the
step count, as optax), ``save``/``load`` (the library's atomic safetensors checkpoints),
``state_dict``/``load_state_dict`` and ``optax_state()``, an optax-shaped
``ScaleByAdamState`` of read-only views for inspection.

Compressed moments: ``moments="bf16"`` or ``"8bit"`` (stochastically rounded, keyed on
``rounding_seed``, the step and the element: reproducible), for the optimizer or per group
label (``group_options={"norms": {"moments": "f32"}}``); README: "Compressed moments".
``moment_formats()`` tells each leaf's. ``state_dict`` carries bf16 moments as bfloat16
``mu``/``nu`` and 8-bit ones as ``mu_codes``/``nu_codes`` (uint8) with ``moment_scales``
(uint8 [blocks, 2]), so a resume is exact; ``load_state_dict`` refuses moments of another
format, with nothing changed, unless ``convert_moments=True`` (lossy into bf16 or 8-bit).
``opt.last_step`` (a ``StepStats``: applied, step, grad_norm (None when the step was neither
checked nor clipped), applied_scale, skipped_steps, poisoned_blocks, saturated_blocks) counts
the step's ``poisoned_blocks`` (8-bit blocks whose moments are NaN) and ``saturated_blocks``
(blocks whose range an outlier exceeded). ``hostopt.CompressedMomentsWarning`` is issued once
per kind, pointing at the ``step()`` call: at the first step that counts poisoned blocks, and
at the second applied step in a row that counts saturated ones (a block can be saturated for
a step at the start of training, before v is averaged; the warning waits for saturation that
lasts). ``skip_nonfinite`` is None, True or False (anything else is a TypeError).

The update is the fused step of hostopt.Optimizer (docs/design.md's update rule: AdamW decays
the master by ``1 - lr*wd`` before the Adam step), bit for bit; against optax.adamw it
agrees to float rounding (optax adds a separately rounded update). Masters stay float32
whatever ``param_dtype`` is, unlike casting optax's result to bf16.

The arrays a step hands out are never written again: their buffers return to a small pool
only once nothing references them any more (no JAX array, no pending computation, no numpy
view), so old params, snapshots (``jax.device_get``) and work still in flight stay valid.
In a loop that drops the previous params, two sets of buffers serve every step.

Parameters on a GPU go through the offload pipeline (``offload="cuda"``, chosen by itself):
one jitted gather puts the gradients into one flat device buffer, the pipeline's CUDA engine
streams it to pinned host memory chunk by chunk while the CPU updates the chunks before it,
and the new parameters stream back into a flat device buffer that one jitted split hands out
as the tree's leaves — JAX-side memory is the parameters and gradients, the state stays in
host memory. The step is synchronous with the device (JAX does not lend its stream); clipping
and the non-finite check take the norm on the device; over accumulated micro-batches (summed
in the pipeline's host accumulator) they need ``grad_norm=``. ``offload="host"`` runs the same
path with CPU arrays standing in for device arrays (how it is tested without a GPU).
"""

import collections
import dataclasses
import math
import sys
import threading
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, cast

if TYPE_CHECKING:
  import concurrent.futures

import jax
import jax.numpy as jnp
import numpy as np

from . import Optimizer as _Optimizer
from . import StoredOptimizer as _StoredOptimizer
from . import _store_options, _threads
# The extension's functions by their own names: in this module `_core` is only HostAdam's
# core optimizer (self._core, a hostopt.Optimizer; its extension object is self._core._core;
# with store= there is none: self._store, a hostopt.StoredOptimizer, holds the state).
from ._core import CopyEngine as _CopyEngine, accumulate as _accumulate_into, convert as _convert, \
    moment_format as _moment_format
from ._arrays import as_buffer, check_optional_bool, check_seed
from ._block_checks import report as _report_blocks
from ._dtypes import EXPECTED as KERNEL_EXPECTED, kernel_tag, tag_of
from ._hyper import AdamHyperParameters
from ._jax_state import BF16, MOMENT_KEYS, leaf_moments, staged_moments, write_staged
from ._masks import mask_flags, per_leaf

__all__ = ["adam", "adamw", "HostAdam", "StepStats"]

# What the last step did: hostopt.StepResult's fields, with grad_norm None when the step did
# not need the norm (neither checked nor clipped; the core's StepResult says -1).
StepStats = collections.namedtuple(
    "StepStats", "applied step grad_norm applied_scale skipped_steps poisoned_blocks saturated_blocks")


def _stats(r) -> StepStats:
  return StepStats(r.applied, r.step, None if r.grad_norm < 0 else r.grad_norm, r.applied_scale, r.skipped_steps,
                   r.poisoned_blocks, r.saturated_blocks)




def _aligned(n: int, dtype) -> np.ndarray:
  """n elements of `dtype`, 64-byte aligned (JAX imports such memory without a copy)."""
  dtype = np.dtype(dtype)
  raw = np.empty(n * dtype.itemsize + 64, np.uint8)
  off = (-raw.ctypes.data) % 64
  return raw[off:off + n * dtype.itemsize].view(dtype)


def _to_jax(buf: np.ndarray) -> jax.Array:
  """A JAX array over `buf`'s memory (no copy; bfloat16 costs one copy: numpy cannot export
  bfloat16 through DLPack, so its bits go over as uint16 and are converted by XLA)."""
  if buf.dtype == np.dtype(jnp.bfloat16):
    return jax.lax.bitcast_convert_type(jax.dlpack.from_dlpack(buf.view(np.uint16)), jnp.bfloat16)
  return jax.dlpack.from_dlpack(buf)


class HostAdam:
  """Adam/AdamW whose state lives in a hostopt arena, made by :func:`adamw` or :func:`adam`.

  The constructor takes :func:`adamw`'s arguments by keyword, and ``decoupled`` (True:
  AdamW, False: Adam, without weight decay); the module docstring says how
  the state and the arrays are kept.

  Attributes:
    last_step (StepStats or None): what the last step did (applied, step, grad_norm,
      applied_scale, skipped_steps, poisoned_blocks, saturated_blocks); None before the
      first step.
  """

  last_step: Optional[StepStats]

  def __init__(self, params, *, learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
               eps_root: float = 0.0, weight_decay=0.0, mask=None, decoupled: bool = True, nesterov: bool = False,
               param_dtype=None, max_grad_norm: Optional[float] = None, skip_nonfinite: Optional[bool] = None,
               threads: int = 0, offload: Optional[str] = None, offload_chunk: int = 1 << 22, groups=None,
               group_options: Optional[dict] = None, moments: str = "f32", rounding_seed: int = 0,
               store=None, store_options: Optional[dict] = None, resume: bool = False):
    skip_nonfinite = check_optional_bool(skip_nonfinite, "skip_nonfinite")
    if offload not in (None, "host", "cuda"):
      raise ValueError(f"offload={offload!r}: expected None (parameters on a GPU go through the pipeline, CPU ones "
                       "are stepped in place), 'cuda', or 'host' (CPU arrays stand in for device arrays)")
    leaves_with_path, self._treedef = jax.tree_util.tree_flatten_with_path(params)
    if not leaves_with_path:
      raise ValueError("params: an empty tree (nothing to optimize)")
    self._names = [jax.tree_util.keystr(path) for path, _ in leaves_with_path]
    leaves = [x for _, x in leaves_with_path]
    for name, x in zip(self._names, leaves):
      if tag_of(x.dtype) is None:
        raise TypeError(f"params{name}: dtype {x.dtype} (expected {KERNEL_EXPECTED})")
    self._shapes = [tuple(np.shape(x)) for x in leaves]
    self._out_dtypes = [np.dtype(param_dtype) if param_dtype is not None else np.dtype(x.dtype) for x in leaves]
    if param_dtype is not None and tag_of(param_dtype) is None:
      raise TypeError(f"param_dtype {param_dtype}: expected {KERNEL_EXPECTED}")
    decays = mask_flags(mask, params, self._treedef) if decoupled else [False] * len(leaves)
    labels = self._labels(groups, params, leaves)
    defaults = dict(learning_rate=learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root, weight_decay=weight_decay,
                    moments=moments)
    seed = check_seed(rounding_seed, "rounding_seed")
    self._options = {}  # label -> its hyper-parameters (the defaults, overridden by group_options)
    for label in dict.fromkeys(labels):
      extra = (group_options or {}).get(label, {})
      unknown = set(extra) - set(defaults)
      if unknown:
        raise ValueError(f"group_options[{label!r}]: unknown {sorted(unknown)}; expected some of {sorted(defaults)}")
      if not decoupled and "weight_decay" in extra:
        raise ValueError(f"group_options[{label!r}]: weight_decay with adam (coupled L2 is not offered per group "
                         "here): use adamw")
      self._options[label] = {**defaults, **extra}
      try:  # an unknown format is named now, not at the first step
        self._options[label]["moments"] = _moment_format(str(self._options[label]["moments"]))
      except ValueError as e:
        where = f"group_options[{label!r}]['moments']" if "moments" in extra else "moments"
        raise ValueError(f"{where}: {e}") from None
    for label in set(group_options or {}) - set(self._options):
      raise ValueError(f"group_options[{label!r}]: no parameter has that group label (labels: {sorted(self._options)})")
    core_groups, self._group_of = [], []  # one core group per (label, decayed or not)
    # Each core group's hyper-parameters (schedules at 0 until a step sets them): this
    # optimizer's, not a checkpoint's, so re-applied after load().
    self._hypers: List[AdamHyperParameters] = []
    for label, o in self._options.items():
      for decay in (False, True):
        members = [(n, s) for n, s, lab, d in zip(self._names, self._shapes, labels, decays)
                   if lab == label and d == decay]
        if not members:
          continue
        lr, wd = o["learning_rate"], o["weight_decay"]
        hyper = AdamHyperParameters(lr=0.0 if callable(lr) else float(lr), beta1=float(o["b1"]), beta2=float(o["b2"]),
                                    eps=float(o["eps"]), eps_root=float(o["eps_root"]),
                                    weight_decay=(0.0 if callable(wd) else float(wd)) if decay else 0.0)
        core_groups.append({"params": members, **hyper.config(nesterov=bool(nesterov),
                                                              mode="adamw" if decoupled else "adam"),
                            "moments": o["moments"], "rounding_seed": seed})
        self._hypers.append(hyper)
        self._group_of.append((label, decay))
    self._formats = [self._options[lab]["moments"] for lab in labels]  # each leaf's moment format
    self._threads = _threads.resolve(int(threads))
    self._max_grad_norm = float(max_grad_norm or 0.0)
    if not (math.isfinite(self._max_grad_norm) and self._max_grad_norm >= 0):  # refused now, not at a step
      raise ValueError(f"max_grad_norm = {max_grad_norm!r}: expected None, 0 (no clipping) or a finite value > 0")
    # One copy-out dtype per step (the core's rule): float32 when the leaves' dtypes differ.
    kinds = {d for d in self._out_dtypes}
    self._copy_out = kinds.pop() if len(kinds) == 1 else np.dtype(np.float32)
    target = self._offload_target(leaves, offload, offload_chunk)
    # (Everything is checked before a store is made: a refused call leaves no store behind.)
    self._store: Optional[_StoredOptimizer] = None  # the state on drives (store=), else None
    if store is None:
      _store_options.check(store, store_options, resume)
      self._core = _Optimizer(core_groups, threads=self._threads)
      self._core._hostopt_front = "hostopt.jax"  # names this front in its CompressedMomentsWarning
      for name, x in zip(self._names, leaves):
        self._core.params(name)[...] = np.asarray(jax.device_get(x), dtype=np.float32)
    else:
      self._store = self._make_store(core_groups, store, store_options, resume, leaves)
      for g, hyper in enumerate(self._hypers):  # this optimizer's hyper-parameters, as load() keeps them
        self._store.set_group_config(g, **dataclasses.asdict(hyper))
    # None: checked when a group has 8-bit moments (a NaN would poison its whole block).
    self._skip_auto = skip_nonfinite is None
    self._skip_nonfinite = "8bit" in self._formats if skip_nonfinite is None else skip_nonfinite
    self._pool: List[List[np.ndarray]] = []  # sets of copy-out buffers, reused once unreferenced
    self._acc: Optional[List[np.ndarray]] = None
    self._micro_batches = 0
    self._lock = threading.RLock()
    self._executor: Optional["concurrent.futures.ThreadPoolExecutor"] = None
    self.last_step = None  # the StepStats of the last step (applied, grad_norm, skipped_steps, ...)
    self._device_step = None
    if target is not None:
      from ._jax_offload import DeviceStep
      # With store= the pipeline streams the store's chunks: each range it hands the CPU is
      # read from the drives, updated and written back, and the step commits at its end.
      core = self._store._live() if self._store is not None else self._core._core
      kind, device, grad_dtype = target
      self._device_step = DeviceStep(core, kind, device, grad_dtype, self._names, self._shapes, self._copy_out,
                                     int(offload_chunk))

  def _make_store(self, core_groups, store, store_options, resume, leaves) -> "_StoredOptimizer":
    """The StoredOptimizer of store=: a new one holding `leaves` as its parameters, or with
    resume=True the one in the directory at its last completed step."""
    options = _store_options.check(store, store_options, resume)
    if resume:
      opened = _StoredOptimizer.open(core_groups, store, threads=self._threads, **options)
    else:
      initial = {n: np.asarray(jax.device_get(x), dtype=np.float32) for n, x in zip(self._names, leaves)}
      try:
        opened = _StoredOptimizer.create(core_groups, store, initial_params=initial, threads=self._threads, **options)
      except RuntimeError as e:
        raise _store_options.exists_hint(e) from None
    opened._hostopt_front = "hostopt.jax"  # names this front in its CompressedMomentsWarning
    return opened

  def _labels(self, groups, params, leaves) -> List[str]:
    """Each leaf's group label: `groups` is a tree of labels like the params (or a prefix of
    one, or a callable of the params giving one), as optax.multi_transform's labels."""
    if groups is None:
      return ["default"] * len(leaves)
    try:
      labels = per_leaf(groups, params, self._treedef)
    except (ValueError, TypeError) as e:
      raise ValueError(f"groups: a tree of labels with the params' structure (or a prefix of it) expected: {e}") from None
    if len(labels) != len(leaves) or not all(isinstance(lab, str) for lab in labels):
      raise ValueError("groups: every leaf needs a string label")
    return labels

  def _offload_target(self, leaves, offload, chunk):
    """Where the offload pipeline runs for parameters on an accelerator (or offload='host'):
    (kind, device, gradient dtype); None for CPU parameters stepped in place. Checked before
    any core or store is made."""
    devices = set()
    for x in leaves:
      if isinstance(x, jax.Array):
        devices |= set(x.devices())
      elif isinstance(x, jax.ShapeDtypeStruct) and getattr(x, "sharding", None) is not None:
        devices |= set(x.sharding.device_set)  # (a resume from jax.eval_shape's structs)
    shapes_only = all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    if any(d.platform != "cpu" for d in devices):
      if len(devices) != 1:
        raise ValueError(f"params on {sorted(str(d) for d in devices)}: hostopt.jax offloads the parameters of one "
                         "device per optimizer")
      if offload == "host":
        raise ValueError("offload='host' stands CPU arrays in for device arrays; these params are on "
                         f"{next(iter(devices))}")
      offload = "cuda"
    elif offload == "cuda" and shapes_only and not devices:
      gpus = [d for d in jax.local_devices() if d.platform == "gpu"]  # structs say no device: the first GPU
      if not gpus:
        raise ValueError("offload='cuda' but JAX sees no GPU (the params are shapes only, jax.eval_shape's structs)")
      devices = {gpus[0]}
    elif offload == "cuda":
      raise ValueError("offload='cuda' but the params are on the CPU")
    if offload is None:
      return None
    if int(chunk) <= 0:
      raise ValueError(f"offload_chunk={chunk}: expected a positive number of elements per chunk")
    if offload == "cuda" and not _CopyEngine.cuda_available():
      raise RuntimeError("hostopt.jax: the parameters are on a GPU but this hostopt was built without CUDA (or no "
                         "CUDA device is visible): rebuild with CUDA, or keep the parameters on the CPU")
    device = next(iter(devices)) if devices else jax.devices("cpu")[0]
    # Gradients come as the params were (the first step) and as param_dtype (after): one
    # 16-bit dtype if that is all there is, else float32 (to which every one widens exactly).
    kinds = {np.dtype(x.dtype) for x in leaves} | set(self._out_dtypes)
    grad_dtype = kinds.pop() if len(kinds) == 1 else np.dtype(np.float32)
    return offload, device, grad_dtype

  # --- the step -----------------------------------------------------------------------

  def _grads(self, grads) -> List[Optional[np.ndarray]]:
    """The gradient leaves as numpy arrays (zero-copy for JAX CPU arrays); None: no gradient
    (that leaf is left as it is)."""
    leaves = self._treedef.flatten_up_to(grads)
    out: List[Optional[np.ndarray]] = []
    for name, shape, g in zip(self._names, self._shapes, leaves):
      if g is None:
        out.append(None)
        continue
      if tuple(np.shape(g)) != shape:
        raise ValueError(f"grads{name} has shape {tuple(np.shape(g))}: expected {shape} like the params")
      x = np.asarray(g)
      if tag_of(x.dtype) is None:
        raise TypeError(f"grads{name}: dtype {x.dtype} (expected {KERNEL_EXPECTED}; hostopt never "
                        "casts silently)")
      out.append(x)
    if len({x.dtype for x in out if x is not None}) > 1:  # one gradient dtype per step: widen (exact)
      out = [None if x is None else x.astype(np.float32) for x in out]
    return out

  def _buffers(self) -> List[np.ndarray]:
    """A set of copy-out buffers no one references any more (else a new one)."""
    for bufs in self._pool:
      # The pool's list, getrefcount's argument and the loop variable: nothing else holds it
      # (a JAX array over it, or work in flight on one, or a numpy view, would).
      if all(sys.getrefcount(b) <= 3 for b in bufs):
        return bufs
    bufs = [_aligned(int(np.prod(s)), self._copy_out).reshape(s) for s in self._shapes]
    self._pool = (self._pool + [bufs])[-2:]  # keep two sets for reuse; older ones live on with their users
    return bufs

  def _stepper(self) -> Any:
    """What steps: the in-RAM hostopt.Optimizer, or with store= the StoredOptimizer (both
    take step counts and hyper-parameters alike)."""
    return self._store if self._store is not None else self._core

  def _set_schedules(self) -> None:
    target = self._stepper()
    count = target.step_count
    for g, (label, decay) in enumerate(self._group_of):
      lr, wd = self._options[label]["learning_rate"], self._options[label]["weight_decay"]
      hyper = {}
      if callable(lr):
        hyper["lr"] = float(lr(count))
      if decay and callable(wd):
        hyper["weight_decay"] = float(wd(count))
      if hyper:
        target.set_group_config(g, **hyper)

  def step(self, grads=None, *, grad_norm: Optional[float] = None):
    """Applies one step and returns the new params.

    Args:
      grads: a tree like the params of float32, bfloat16 or float16 gradients (one dtype,
        or they are widened to float32 exactly); a leaf None has no gradient and is left
        as it is. None after :meth:`accumulate`: step on the accumulated micro-batches
        alone (averaged, as optax.MultiSteps); given after accumulate, it is the last
        micro-batch.
      grad_norm (float or None, default None): the gradients' global norm if already
        computed (e.g. on the device with optax.global_norm), used for clipping and the
        non-finite check instead of reading them; NaN or inf for non-finite gradients.

    Returns:
      The new parameters, a tree like the params of new jax arrays in param_dtype (the
      old ones are still valid). A skipped step (``last_step.applied`` False) returns the
      unchanged parameters.

    Raises:
      ValueError: a gradient of another shape, a negative grad_norm, or None with nothing
        accumulated.
      TypeError: a gradient dtype other than float32, bfloat16 or float16.
    """
    with self._lock:
      if grad_norm is not None:
        grad_norm = float(grad_norm)
        if grad_norm < 0:
          raise ValueError(f"grad_norm = {grad_norm}: a norm is >= 0")
        # NaN or inf: the core's one rule decides, as for a norm it computes (skipped and
        # counted when checked or clipped; with neither, the norm is not used).
      if self._device_step is not None:
        return self._offloaded_step(grads, grad_norm)
      if grads is None and self._acc is None:
        raise ValueError("step(None): nothing accumulated (call accumulate(grads) first, or pass grads)")
      glist: Optional[Sequence[Optional[np.ndarray]]] = self._grads(grads) if grads is not None else None
      self._set_schedules()  # everything that can fail before the accumulator changes
      if self._store is not None and glist is not None and self._acc is not None:
        # The last micro-batch summed into copies: a step that fails (an I/O error) leaves the
        # accumulator as it was, so a retry sums it once.
        glist, scale = self._summed(glist), 1.0 / (self._micro_batches + 1)
        return self._stored_step(glist, scale, grad_norm)
      if glist is not None and self._acc is not None:
        self._add_to_accumulator(glist)
        glist = None
      if glist is None:
        glist, scale = cast(List[np.ndarray], self._acc), 1.0 / self._micro_batches  # not None: checked above
      else:
        scale = 1.0
      if self._store is not None:
        return self._stored_step(glist, scale, grad_norm)
      out = self._buffers()
      present = {n: g for n, g in zip(self._names, glist) if g is not None}
      self.last_step = _stats(self._core.step(present, out=dict(zip(self._names, out)), grad_scale=scale,
                                              max_grad_norm=self._max_grad_norm,
                                              skip_nonfinite=self._skip_nonfinite, known_grad_norm=grad_norm))
      self._acc, self._micro_batches = None, 0  # a skipped step drops the micro-batches it was given too
      tag = kernel_tag(self._copy_out)
      for name, buf in zip(self._names, out):  # skipped, or a leaf without a gradient: copy it out here
        if not self.last_step.applied or name not in present:
          out_view, _ = as_buffer(buf, name, writable=True)
          _convert(self._core.params(name).reshape(-1), out_view.reshape(-1), tag, self._threads)
      arrays = [_to_jax(b) for b in out]
      arrays = [a if np.dtype(a.dtype) == d else a.astype(d) for a, d in zip(arrays, self._out_dtypes)]
      return self._treedef.unflatten(arrays)

  def _stored_step(self, glist, scale: float, grad_norm: Optional[float]):
    """One step streamed through the store (a leaf without a gradient keeps its state and its
    own step count, as in RAM); the new params come out into a fresh flat buffer whose slices JAX takes (a
    skipped step reads them from the store)."""
    store = cast(_StoredOptimizer, self._store)
    flat = _aligned(store.arena_size, self._copy_out)
    result = store.step(dict(zip(self._names, glist)), flat, grad_scale=scale, max_grad_norm=self._max_grad_norm,
                        skip_nonfinite=self._skip_nonfinite, known_grad_norm=grad_norm)
    self.last_step = _stats(result)
    self._acc, self._micro_batches = None, 0  # a skipped step drops the micro-batches it was given too
    if not self.last_step.applied:
      store.read_params(flat)
    return self._treedef.unflatten(self._leaves_of(flat))

  def _leaves_of(self, flat: np.ndarray) -> List[jax.Array]:
    """The leaves of a flat array in the store's layout, as jax arrays in param_dtype."""
    arrays = []
    for name, d in zip(self._names, self._out_dtypes):
      _, shape, offset, size, _ = cast(_StoredOptimizer, self._store).segment(name)
      a = _to_jax(flat[offset:offset + size].reshape(shape))
      arrays.append(a if np.dtype(a.dtype) == d else a.astype(d))
    return arrays

  def _device_grads(self, grads) -> List[Optional[jax.Array]]:
    """The gradient leaves as they are (device arrays; None: no gradient), checked."""
    leaves = self._treedef.flatten_up_to(grads)
    for name, shape, g in zip(self._names, self._shapes, leaves):
      if g is None:
        continue
      if tuple(np.shape(g)) != shape:
        raise ValueError(f"grads{name} has shape {tuple(np.shape(g))}: expected {shape} like the params")
      if tag_of(g.dtype) is None:
        raise TypeError(f"grads{name}: dtype {g.dtype} (expected {KERNEL_EXPECTED}; hostopt never "
                        "casts silently)")
    return leaves

  def _offloaded_step(self, grads, grad_norm):
    ds = self._device_step
    if grads is None and ds.micro_batches == 0:
      raise ValueError("step(None): nothing accumulated (call accumulate(grads) first, or pass grads)")
    leaves = None if grads is None else self._device_grads(grads)
    if self._store is not None:
      self._store._live()  # a closed store: ValueError, as the host path's step
    skip = self._skip_nonfinite
    if skip and self._skip_auto and grad_norm is None and ds.micro_batches and self._max_grad_norm == 0:
      skip = False  # the default check cannot take the norm of host-accumulated micro-batches: unchecked, as asked
    needs_norm = (self._max_grad_norm > 0 or skip) and grad_norm is None
    if needs_norm and ds.micro_batches:
      raise ValueError("max_grad_norm/skip_nonfinite over accumulated micro-batches on the offloaded path: the "
                       "accumulator is in host memory, so the norm of the averaged gradients cannot be taken on the "
                       "device; pass step(grads, grad_norm=...) (computed by the caller)")
    self._set_schedules()
    flat = None
    if leaves is not None:
      flat, norm = ds.gather(leaves, needs_norm)
      if needs_norm:
        grad_norm = norm
    without = [] if leaves is None else [i for i, g in enumerate(leaves) if g is None]
    result, out = ds.step(flat, without=without, max_grad_norm=self._max_grad_norm,
                          skip_nonfinite=skip, known_grad_norm=grad_norm)
    self.last_step = _stats(result)
    _report_blocks(self._stepper(), result, "hostopt.jax")
    out = [a if np.dtype(a.dtype) == d else a.astype(d) for a, d in zip(out, self._out_dtypes)]
    return self._treedef.unflatten(out)

  def step_async(self, grads=None, *, grad_norm: Optional[float] = None):
    """step() on a worker thread: returns a concurrent.futures.Future whose result() is the
    new params; the caller's thread (and JAX) go on meanwhile. Steps run in call order."""
    import concurrent.futures
    with self._lock:
      if self._executor is None:
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="hostopt-jax")
    return self._executor.submit(self.step, grads, grad_norm=grad_norm)

  def _summed(self, glist) -> List[np.ndarray]:
    """The accumulator plus `glist` (checked grads), in new arrays; the accumulator unchanged."""
    acc = cast(List[np.ndarray], self._acc)
    out = []
    for a, n, g in zip(acc, self._names, glist):
      total = _aligned(a.size, np.float32).reshape(a.shape)
      total[...] = a
      if g is not None:
        grad, tag = as_buffer(np.ascontiguousarray(g), f"grads{n}")
        _accumulate_into(total.reshape(-1), grad.reshape(-1), tag, False, self._threads)
      out.append(total)
    return out

  def _add_to_accumulator(self, glist) -> None:
    """acc += grads (checked grads; a leaf without a gradient adds nothing)."""
    bufs = [None if g is None else as_buffer(np.ascontiguousarray(g), f"grads{n}") for n, g in zip(self._names, glist)]
    acc = self._acc
    if acc is None:
      acc = [_aligned(int(np.prod(s)), np.float32).reshape(s) for s in self._shapes]
      for a in acc:
        a[...] = 0.0
    for a, b in zip(acc, bufs):
      if b is not None:
        grad, tag = b
        _accumulate_into(a.reshape(-1), grad.reshape(-1), tag, False, self._threads)
    self._acc = acc
    self._micro_batches += 1

  def _accumulate(self, grads) -> None:
    with self._lock:
      if self._store is not None:
        self._store._live()  # a closed store: ValueError, as step's
      if self._device_step is not None:  # summed in the pipeline's host accumulator
        flat, _ = self._device_step.gather(self._device_grads(grads), False)
        self._device_step.accumulate(flat)
        return
      self._add_to_accumulator(self._grads(grads))

  def accumulate(self, grads) -> None:
    """Adds one micro-batch's gradients to the host accumulator (float32); the next step
    averages the micro-batches (optax.MultiSteps' rule) and clears it. Runs after the
    step_async calls made before it."""
    if self._executor is not None:  # in call order with queued asynchronous steps
      self._executor.submit(self._accumulate, grads).result()
    else:
      self._accumulate(grads)

  def close(self) -> None:
    """Waits for queued asynchronous steps and stops their worker thread; with store=,
    then releases the store (another process may open it; later steps raise ValueError)."""
    if self._executor is not None:
      self._executor.shutdown(wait=True)
      self._executor = None
    if self._store is not None:
      with self._lock:
        self._store.close()

  # --- state -----------------------------------------------------------------------------

  @property
  def step_count(self) -> int:
    """Applied steps so far (skipped steps do not count)."""
    return self._stepper().step_count

  @property
  def state_bytes(self) -> int:
    """Bytes of host state (masters and moments: 12 per parameter with f32 moments, 8 with
    bf16, 6.0625 with 8-bit, plus alignment); with store=, its staging buffers (the state
    is on the drives)."""
    return self._store.staging_bytes if self._store is not None else self._core.state_bytes

  @property
  def store(self) -> Optional["_StoredOptimizer"]:
    """The hostopt.StoredOptimizer holding the state with store= (its chunks, stripes,
    io_backend, recovery, ...), else None."""
    return self._store

  def _ram(self) -> "_Optimizer":
    """The state in RAM: this optimizer's own, or with store= the store's exported into a
    new hostopt.Optimizer (the whole state in RAM, for as long as it is held)."""
    if self._store is None:
      return self._core
    ram = _Optimizer(self._store._groups, threads=self._threads)
    self._store.copy_to(ram)
    return ram

  def _refuse_store(self, what: str) -> None:
    if self._store is not None:
      raise ValueError(f"{what} with store=: the store is the checkpoint (every step commits there); to bring "
                       "another state into a store, load it into a hostopt.Optimizer of the same groups and make "
                       "the store with hostopt.StoredOptimizer.from_optimizer")

  def memory(self) -> dict:
    """Where this optimizer's bytes are (hostopt-bench model's accounting): host state
    (masters and moments, as state_bytes), host copy-out buffers
    (the sets the pool keeps, param_dtype), the host f32 accumulator (allocated by the first
    accumulate), the offload pipeline's pinned buffers and device buffers (offloaded path).
    With store=, the state's host bytes are the staging buffers, and the copy-out is the
    flat buffer each step makes (it lives as long as the arrays handed out over it).
    JAX holds the parameters and gradients besides."""
    with self._lock:
      n = sum(int(np.prod(s)) for s in self._shapes)
      copy_out = sum(b.nbytes for bufs in self._pool for b in bufs)
      if self._store is not None and self._device_step is None:  # each step's flat copy-out (new each step: JAX keeps the arrays over it)
        copy_out = self._store.arena_size * np.dtype(self._copy_out).itemsize
      acc = sum(a.nbytes for a in self._acc) if self._acc is not None else 0
      offloaded = {"pinned_bytes": 0, "device_buffer_bytes": 0, "device_step_bytes": 0}
      if self._device_step is not None:
        offloaded = self._device_step.memory()
        acc = offloaded.pop("accumulator_bytes")
      state = self.state_bytes
      host = state + copy_out + acc + offloaded["pinned_bytes"]
      per = (lambda b: b / n) if n else (lambda b: 0.0)
      return {"params": n, "state_bytes": state, "state_bytes_per_param": per(state),
              "copy_out_bytes": copy_out, "accumulator_bytes": acc, "host_bytes": host,
              "host_bytes_per_param": per(host), **offloaded}

  def params(self):
    """The float32 master parameters, as a tree of read-only numpy views (with store=, of
    a copy streamed from the drives)."""
    if self._store is not None:
      with self._lock:
        flat = self._store.read_params()
      return self._views(lambda name: flat[slice(*self._extent(name))].reshape(self._store.segment(name)[1]))
    return self._views(self._core.params)

  def _extent(self, name: str):
    _, _, offset, size, _ = cast(_StoredOptimizer, self._store).segment(name)
    return offset, offset + size

  def moment_formats(self):
    """Each leaf's moment format ("f32", "bf16" or "8bit"), as a tree like the params."""
    return self._treedef.unflatten(list(self._formats))

  def optax_state(self):
    """The state as optax.adam builds it — ScaleByAdamState(count, mu, nu) — for
    inspection: read-only numpy views of f32 moments, read-only float32 copies of the
    (exactly decoded) compressed ones."""
    import optax
    with self._lock:
      ram = self._ram()
      mu, nu = [], []
      for name, fmt in zip(self._names, self._formats):
        m, v = (ram.exp_avg(name), ram.exp_avg_sq(name)) if fmt == "f32" else ram.read_moments(name)
        for x, out in ((m, mu), (v, nu)):
          x.setflags(write=False)
          out.append(x)
      return optax.ScaleByAdamState(count=np.asarray(ram.step_count, np.int32),
                                    mu=self._treedef.unflatten(mu), nu=self._treedef.unflatten(nu))

  def _views(self, getter):
    views = []
    for name in self._names:
      v = getter(name)
      v.setflags(write=False)
      views.append(v)
    return self._treedef.unflatten(views)

  def state_dict(self) -> dict:
    """{'step': int, 'params'/'mu'/'nu': {leaf path: copy}}: params float32; mu and nu
    float32 (f32 moments) or bfloat16 (bf16 moments, their exact bits). A leaf with 8-bit
    moments has no mu/nu entry: its codes are under 'mu_codes'/'nu_codes' (uint8, the leaf's
    shape) with 'moment_scales' (uint8 [blocks of 32, 2]: the blocks' exponent bytes for mu
    and nu), and 'rounding_seed' (their stochastic rounding's). Every copy is exact: loading
    it resumes bit for bit."""
    with self._lock:
      ram = self._ram()
      sd: Dict[str, Any] = {"step": ram.step_count, "params": {}, "mu": {}, "nu": {}}
      if any(fmt != "f32" for fmt in self._formats):
        sd["rounding_seed"] = ram.group_rounding_seed(0)
      for name, fmt, shape in zip(self._names, self._formats, self._shapes):
        sd["params"][name] = np.array(ram.params(name))
        for key, x in leaf_moments(ram, name, fmt, shape).items():
          sd.setdefault(key, {})[name] = x
      return sd

  def load_state_dict(self, state: dict, convert_moments: bool = False) -> None:
    """Restores a state_dict() of the same tree; checked completely before anything
    changes. Moments of another format than a leaf's are refused unless convert_moments
    (then converted: exactly into f32, stochastically rounded into bf16 or 8-bit). A
    'rounding_seed' in it becomes this optimizer's (the same stream continues). Refused with
    store= (ValueError)."""
    self._refuse_store("load_state_dict")
    with self._lock:
      step = state.get("step")
      if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or not 0 <= int(step) < 1 << 63:
        raise ValueError(f"state_dict: 'step' missing, not an integer or negative ({step!r})")
      seed = state.get("rounding_seed")
      if seed is not None:
        seed = check_seed(seed, "state_dict['rounding_seed']")
      for key in ("params", "mu", "nu"):
        if key not in state:
          raise ValueError(f"state_dict: no {key!r}")
      if set(state["params"]) != set(self._names):
        raise ValueError(f"state_dict['params']: leaves {sorted(state['params'])[:5]}... differ from this "
                         f"optimizer's {self._names[:5]}...")
      foreign = {n for k in MOMENT_KEYS for n in state.get(k, {})}
      foreign -= set(self._names)
      if foreign:
        raise ValueError(f"state_dict: moments of leaves this optimizer does not have: {sorted(foreign)[:5]}")
      params, moments = {}, {}
      for n, shape, fmt in zip(self._names, self._shapes, self._formats):
        x = np.asarray(state["params"][n])
        if tuple(x.shape) != shape:
          raise ValueError(f"state_dict['params'][{n!r}] has shape {x.shape}: expected {shape}")
        if x.dtype.kind != "f" and x.dtype != BF16:
          raise TypeError(f"state_dict['params'][{n!r}]: dtype {x.dtype}, expected floating point")
        params[n] = x.astype(np.float32)
        moments[n] = staged_moments(state, n, shape, fmt, bool(convert_moments))
      self._core.step_count = int(step)  # refused above the largest count: before anything changes
      for n, fmt in zip(self._names, self._formats):
        self._core.params(n)[...] = params[n]
        write_staged(self._core, n, fmt, moments[n])
      if seed is not None:
        for g in range(len(self._group_of)):
          self._core.set_group_rounding_seed(g, seed)

  def save(self, path: str) -> None:
    """The whole state as a safetensors checkpoint, written atomically (hostopt.Optimizer.save);
    with store=, streamed from the drives (hostopt.StoredOptimizer.save: the same file)."""
    with self._lock:
      if self._store is not None:
        self._store.save(path)
      else:
        self._core.save(path)

  def load(self, path: str) -> None:
    """Loads a checkpoint of this tree and groups (verified before anything changes): the
    parameters, moments and counts; the hyper-parameters stay this optimizer's, as with
    load_state_dict (a checkpoint of other groups: use state_dict/load_state_dict). Refused
    with store= (ValueError)."""
    self._refuse_store("load")
    with self._lock:
      self._core.load(path)
      for g, hyper in enumerate(self._hypers):
        self._core.set_group_config(g, **dataclasses.asdict(hyper))

  def current_params(self):
    """The current parameters as new jax arrays in param_dtype (a copy of the masters; with
    store=, streamed from the drives: what a resumed run puts back into its model)."""
    with self._lock:
      if self._store is not None:
        return self._treedef.unflatten([jax.device_put(np.array(x, dtype=d)) for x, d in
                                        zip(jax.tree_util.tree_leaves(self.params()), self._out_dtypes)])
      return self._treedef.unflatten([jax.device_put(np.array(self._core.params(n), dtype=d, copy=True))
                                      for n, d in zip(self._names, self._out_dtypes)])


_RULES = {
    True: r"""
  .. math::
    g_t = \text{clip}(\nabla_t), \qquad m_t = \beta_1 m_{t-1} + (1-\beta_1)\,g_t, \qquad
    v_t = \beta_2 v_{t-1} + (1-\beta_2)\,g_t^2,

    \theta_t = (1 - \eta_t\lambda)\,\theta_{t-1} - \frac{\eta_t}{1-\beta_1^t}\,
    \frac{m_t}{\sqrt{v_t/(1-\beta_2^t) + \epsilon_{root}} + \epsilon}
""",
    False: r"""
  .. math::
    g_t = \text{clip}(\nabla_t), \qquad m_t = \beta_1 m_{t-1} + (1-\beta_1)\,g_t, \qquad
    v_t = \beta_2 v_{t-1} + (1-\beta_2)\,g_t^2,

    \theta_t = \theta_{t-1} - \frac{\eta_t}{1-\beta_1^t}\,
    \frac{m_t}{\sqrt{v_t/(1-\beta_2^t) + \epsilon_{root}} + \epsilon}
""",
}

_DECAY_ARGS = """    weight_decay (float, default 1e-4): :math:`\\lambda`, optax.adamw's decoupled weight decay
      (the master decays by ``1 - lr * weight_decay`` before the Adam step), or a schedule
      of the step count.
    mask: which leaves decay, as optax's: a tree of bools like the params, a prefix of
      one, or a callable of the params giving one (None: every leaf).
"""


def _doc(decoupled: bool) -> str:
  """The docstring of adamw or adam: one argument list, each one's own rule."""
  name = "adamw" if decoupled else "adam"
  summary = ("AdamW (decoupled weight decay) with its state in host memory: a :class:`HostAdam`." if decoupled
             else "Adam with its state in host memory: a :class:`HostAdam`.")
  return f"""{summary}

  optax.{name}'s hyper-parameters and defaults; the float32 masters and moments live in a
  hostopt arena and one fused pass updates every leaf (the module docstring says how the
  arrays come and go). Each step, with :math:`t` the step count from 1 and
  :math:`\\text{{clip}}` the optional clipping by global norm (``max_grad_norm``):
{_RULES[decoupled]}
  bit for bit hostopt.Optimizer's step (``nesterov``: optax's NAdam estimate of
  :math:`m_t`). Against optax.{name} it agrees to float rounding.

  Args:
    params: the parameters, a pytree of float32, bfloat16 or float16 arrays (jax arrays on
      the CPU or on one accelerator, or numpy arrays). Copied into the float32 masters.
    learning_rate: :math:`\\eta_t`: a number, or a schedule called with the step count as
      optax calls it.
    b1 (float, default 0.9): :math:`\\beta_1`, in ``[0, 1)``.
    b2 (float, default 0.999): :math:`\\beta_2`, in ``[0, 1)``.
    eps (float, default 1e-8): :math:`\\epsilon`, added outside the square root.
    eps_root (float, default 0.0): :math:`\\epsilon_{{root}}`, added inside it.
{_DECAY_ARGS if decoupled else ""}    nesterov (bool, default False): optax's NAdam (nadam{"w" if decoupled else ""}).
    param_dtype (numpy.dtype or None, default None): the dtype of the params ``step`` returns
      (float32, bfloat16 or float16; None: each leaf's own). The masters stay float32.
    max_grad_norm (float or None, default None): > 0 (finite) clips the gradients by global norm
      (optax.clip_by_global_norm's rule), folded into the step; None or 0: no clipping.
      Negative, NaN or infinite: ValueError.
    skip_nonfinite (bool or None, default None): True checks the gradients first: a
      non-finite one skips the step, changing nothing (``last_step.applied`` False). None:
      checked when a group has 8-bit moments (on the offloaded path, not over
      host-accumulated micro-batches without ``grad_norm=``); False: never. Anything else:
      TypeError.
    threads (int, default 0): worker threads of the step (0: hostopt's default,
      ``hostopt.default_threads()``, OMP_NUM_THREADS when set, else the physical cores of the process's CPU set).
    offload (str or None, default None): None: params on an accelerator go through the
      offload pipeline, CPU ones are stepped in place. ``"cuda"``: the pipeline, required;
      ``"host"``: the pipeline with CPU arrays standing in for device arrays. Anything
      else: ValueError.
    offload_chunk (int, default 1 << 22): elements per pipeline chunk.
    groups: each leaf's group label, a tree of strings like the params (or a prefix of
      one, or a callable of the params giving one): optax.multi_transform's labels.
    group_options (dict or None, default None): ``{{label: {{...}}}}`` overriding, for that
      group's leaves, any of learning_rate (or a schedule), b1, b2, eps, eps_root,
      {"weight_decay, " if decoupled else ""}moments.
    moments (str, default "f32"): how the moments are stored: ``"f32"`` (12 bytes of state
      per parameter), ``"bf16"`` (8) or ``"8bit"`` (6.06), stochastically rounded.
    rounding_seed (int, default 0): the key of that rounding, in ``[0, 2**64)``: the same
      seed gives the same bits.
    store (str or None, default None): a directory (a path; a list of them stripes the state,
      one directory per drive) to keep the state on local drives, not in RAM
      (:class:`hostopt.StoredOptimizer`): each step streams it through staging buffers and
      commits, so what is on the drives is always a verified checkpoint of the last
      completed step.
      The same bits as in RAM (a leaf without a gradient too); parameters on a GPU
      (or ``offload="host"``) go through the offload pipeline, which streams the store's
      chunks; ``load``/``load_state_dict`` are refused, ``save`` streams
      a checkpoint from the drives, ``state_dict`` and ``optax_state`` export through RAM.
    store_options (dict or None, default None): hostopt.StoredOptimizer's keywords
      (staging_bytes, buffers, chunk_elements, sync, io, kernel).
    resume (bool, default False): open the store at its last completed step instead of
      making a new one (refused where there is none, as making one is where one exists).
      ``params`` then give only the tree, shapes and dtypes (``jax.eval_shape``'s structs
      will do; with no device, pass ``offload="cuda"`` to offload them to the first GPU):
      take the parameters from :meth:`HostAdam.current_params`. The
      hyper-parameters are this call's, as ``load`` keeps them.

  Returns:
    A :class:`HostAdam`: ``step(grads)`` applies one step and returns the new params.

  Raises:
    ValueError: an empty tree, an unknown offload, moments or group label, params on more
      than one device, or a hyper-parameter outside its range; store= with params on an
      accelerator.
    RuntimeError: store= naming a directory that holds a store (without resume) or, with
      resume, none; a store of other groups, or open elsewhere.
    TypeError: a leaf or param_dtype that is not float32, bfloat16 or float16.

  Example:
    >>> import jax, jax.numpy as jnp, hostopt.jax
    >>> params = {{"w": jnp.ones((4, 3)), "b": jnp.zeros(3)}}
    >>> opt = hostopt.jax.{name}(params, learning_rate=1e-2{", weight_decay=0.1" if decoupled else ""})
    >>> grads = jax.tree_util.tree_map(jnp.ones_like, params)
    >>> params = opt.step(grads)      # the same tree, new jax arrays
    >>> opt.step_count, opt.last_step.applied
    (1, True)
  """


def adamw(params, learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, eps_root: float = 0.0,
          weight_decay=1e-4, mask=None, *, nesterov: bool = False, param_dtype=None,
          max_grad_norm: Optional[float] = None, skip_nonfinite: Optional[bool] = None, threads: int = 0,
          offload: Optional[str] = None, offload_chunk: int = 1 << 22, groups=None,
          group_options: Optional[dict] = None, moments: str = "f32", rounding_seed: int = 0, store=None,
          store_options: Optional[dict] = None, resume: bool = False) -> HostAdam:
  return HostAdam(params, learning_rate=learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root,
                  weight_decay=weight_decay, mask=mask, decoupled=True, nesterov=nesterov, param_dtype=param_dtype,
                  max_grad_norm=max_grad_norm, skip_nonfinite=skip_nonfinite, threads=threads, offload=offload,
                  offload_chunk=offload_chunk, groups=groups, group_options=group_options, moments=moments,
                  rounding_seed=rounding_seed, store=store, store_options=store_options, resume=resume)


def adam(params, learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, eps_root: float = 0.0, *,
         nesterov: bool = False, param_dtype=None, max_grad_norm: Optional[float] = None,
         skip_nonfinite: Optional[bool] = None, threads: int = 0, offload: Optional[str] = None,
         offload_chunk: int = 1 << 22, groups=None, group_options: Optional[dict] = None, moments: str = "f32",
         rounding_seed: int = 0, store=None, store_options: Optional[dict] = None, resume: bool = False) -> HostAdam:
  return HostAdam(params, learning_rate=learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root, weight_decay=0.0,
                  decoupled=False, nesterov=nesterov, param_dtype=param_dtype, max_grad_norm=max_grad_norm,
                  skip_nonfinite=skip_nonfinite, threads=threads, offload=offload, offload_chunk=offload_chunk,
                  groups=groups, group_options=group_options, moments=moments, rounding_seed=rounding_seed,
                  store=store, store_options=store_options, resume=resume)


adamw.__doc__ = _doc(decoupled=True)
adam.__doc__ = _doc(decoupled=False)
