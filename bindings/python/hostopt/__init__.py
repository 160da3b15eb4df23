"""hostopt: the Adam/AdamW optimizer in host RAM, with fused SIMD kernels.

``hostopt.Optimizer`` and ``hostopt.adam_step`` are the C++ library's optimizer state and
one-buffer step; ``hostopt.optax`` and ``hostopt.torch`` wrap them as optax gradient
transformations and torch.optim optimizers. Arrays are taken zero-copy (numpy, torch CPU
tensors, jax CPU arrays; bf16 through ml_dtypes, torch or a uint16 view): an array that
cannot be used in place is an error, never a silent copy. Steps release the GIL.
"""

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import os

import numpy as np

from . import _core, _moments, _threads
from ._arena import Segment, segments as _segments
from ._arrays import INT32 as _INT32, as_buffer, as_buffers, check_seed, integer as _integer
from ._block_checks import CompressedMomentsWarning, report as _report_blocks
from ._threads import default_threads

__version__ = _core.__version__

__all__ = ["Optimizer", "StoredOptimizer", "StepResult", "CompressedMomentsWarning", "adam_step", "CompressedMoments", "adam_step_compressed", "active_kernel", "kernels", "as_buffer", "default_threads", "__version__"]

StepResult = _core.StepResult


def active_kernel() -> str:
  """Name of the SIMD kernel steps use by default ("avx512", "avx2", "sse2", "neon", "scalar")."""
  return _core.active_kernel()


def kernels() -> List[Tuple[str, bool]]:
  """(name, supported on this CPU) for every kernel compiled in, best first."""
  return list(_core.kernels())


_CONFIG_KEYS = tuple(_core.AdamConfig().as_dict())  # the C++ field list: lr, beta1, ..., nesterov


def _bool(value, what: str) -> bool:
  """A bool argument: True/False or numpy.bool_, never an int, float or string taken for one."""
  if isinstance(value, (bool, np.bool_)):
    return bool(value)
  raise TypeError(f"{what} = {value!r}: expected a bool (True or False)")


def _real(value, what: str) -> float:
  """A real-number argument: a Python or numpy int or float, or a one-element array of one
  (a 0-d numpy, torch or jax scalar), never a bool or a string parsed silently. TypeError
  naming `what` otherwise; ValueError for an integer beyond a double's range."""
  if isinstance(value, (bool, np.bool_, str, bytes)) or getattr(getattr(value, "dtype", None), "kind", "") == "b":
    raise TypeError(f"{what} = {value!r}: expected a real number (int or float)")
  try:
    return float(value)
  except OverflowError:
    raise ValueError(f"{what} = {str(value)[:40]}...: expected a real number a double holds") from None
  except (TypeError, ValueError):
    raise TypeError(f"{what} = {value!r}: expected a real number (int or float)") from None


def _config(d: Mapping) -> dict:
  unknown = set(d) - set(_CONFIG_KEYS) - {"params", "betas"}
  if unknown:
    raise ValueError(f"unknown hyper-parameter(s) {sorted(unknown)}; expected some of {_CONFIG_KEYS} (or betas)")
  c = {k: d[k] for k in _CONFIG_KEYS if k in d}
  if "betas" in d and ("beta1" in d or "beta2" in d):  # two values for one hyper-parameter
    raise ValueError(f"betas and {'beta1' if 'beta1' in d else 'beta2'} both given: pass betas=(beta1, beta2) "
                     "or beta1/beta2, not both")
  if "betas" in d:
    c["beta1"], c["beta2"] = (_real(b, f"betas[{i}]") for i, b in enumerate(d["betas"]))
  for k in ("lr", "beta1", "beta2", "eps", "eps_root", "weight_decay"):
    if k in c:
      c[k] = _real(c[k], k)
  for k in ("bias_correction", "nesterov", "maximize"):
    if k in c:
      c[k] = _bool(c[k], k)
  return c


def _same_shape(params: np.ndarray, others) -> None:
  """Arrays stepped together have the params' shape: one of the same size but another shape
  is refused, not reinterpreted."""
  for what, a in others:
    if a is not None and a.size == params.size and a.shape != params.shape:  # sizes: the core names them
      raise ValueError(f"{what} has shape {a.shape}: expected {params.shape}, the params' shape")


def adam_step(params: np.ndarray, exp_avg: np.ndarray, exp_avg_sq: np.ndarray, grad, *, step: int,
              lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
              eps_root: float = 0.0, weight_decay: float = 0.0, mode: str = "adamw",
              bias_correction: bool = True, nesterov: bool = False, out=None, grad_scale: float = 1.0,
              threads: int = 0, kernel: str = "") -> None:
  r"""One fused Adam/AdamW step, in place, over float32 arrays.

  .. math::
    g = s\,\nabla,\quad m \leftarrow \beta_1 m + (1-\beta_1) g,\quad
    v \leftarrow \beta_2 v + (1-\beta_2) g^2,\quad
    p \leftarrow p - \frac{\eta}{1-\beta_1^t}\,\frac{m}{\sqrt{v/(1-\beta_2^t) + \epsilon_{root}} + \epsilon}

  with coupled L2 (``mode="adam"``) or decoupled (``mode="adamw"``) weight decay.

  Args:
    params, exp_avg, exp_avg_sq: float32, C-contiguous, writable, same size.
    grad: float32, bfloat16 or float16 gradient of the same size.
    step: 1-based step number t.
    out: optional array (float32/bfloat16/float16) that receives the new parameters.

  Example:
    >>> import numpy as np, hostopt
    >>> p = np.ones(4, np.float32); m = np.zeros(4, np.float32); v = np.zeros(4, np.float32)
    >>> hostopt.adam_step(p, m, v, np.full(4, 0.5, np.float32), step=1, lr=0.1)
    >>> p  # the first step moves every element by lr (bias-corrected m / sqrt(v) is 1)
    array([0.9, 0.9, 0.9, 0.9], dtype=float32)
  """
  p, _ = as_buffer(params, "params", writable=True)
  m, _ = as_buffer(exp_avg, "exp_avg", writable=True)
  v, _ = as_buffer(exp_avg_sq, "exp_avg_sq", writable=True)
  g, gt = as_buffer(grad, "grad")
  o, ot = (None, "f32") if out is None else as_buffer(out, "out", writable=True)
  _same_shape(p, (("exp_avg", m), ("exp_avg_sq", v), ("grad", g), ("out", o)))
  cfg = _config(dict(lr=lr, betas=betas, eps=eps, eps_root=eps_root, weight_decay=weight_decay, mode=mode,
                     bias_correction=bias_correction, nesterov=nesterov))
  _core.adam_step(p, m, v, g, gt, o, ot, cfg, _integer(step, "step"), _real(grad_scale, "grad_scale"),
                  _threads.resolve(_integer(threads, "threads", _INT32)), kernel)


class CompressedMoments:
  """Adam moments of ``n`` elements stored compressed: ``"bf16"`` (4 bytes per element,
  stochastically rounded) or ``"8bit"`` (8-bit block floating point over 32-element blocks:
  2 + 2/32 bytes per element). README: "Compressed moments". Zero moments to start;
  :meth:`encode` converts f32 moments (lossy), :meth:`decode` reads them back (exact).

  Attributes: ``format``, ``exp_avg`` and ``exp_avg_sq`` (uint16 or uint8 codes),
  ``scales`` (uint8 block exponents; empty for bf16).
  """

  def __init__(self, n: int, format: str = "8bit"):
    n = _integer(n, "n", (0, 1 << 63))
    if format not in ("bf16", "bfloat16", "8bit", "q8"):
      raise ValueError(f"format {format!r}: expected 'bf16' or '8bit'")
    self.format = "bf16" if format in ("bf16", "bfloat16") else "8bit"
    code = np.uint16 if self.format == "bf16" else np.uint8
    self.exp_avg = np.zeros(n, code)
    self.exp_avg_sq = np.zeros(n, code)
    self.scales = np.zeros(_core.moment_scale_bytes(self.format, n), np.uint8)

  def __len__(self) -> int:
    return self.exp_avg.size

  @property
  def nbytes(self) -> int:
    return self.exp_avg.nbytes + self.exp_avg_sq.nbytes + self.scales.nbytes

  @classmethod
  def encode(cls, exp_avg: np.ndarray, exp_avg_sq: np.ndarray, format: str = "8bit",
             seed: int = 0) -> "CompressedMoments":
    """Compressed copies of float32 moments (lossy: stochastic rounding keyed on ``seed``,
    an integer in [0, 2**64)). Other dtypes are refused (TypeError), never cast silently."""
    seed = check_seed(seed, "seed")
    m, v = np.asarray(exp_avg), np.asarray(exp_avg_sq)
    for what, x in (("exp_avg", m), ("exp_avg_sq", v)):
      if x.dtype != np.float32:
        raise TypeError(f"encode: {what} has dtype {x.dtype}, expected float32 (never cast silently: pass "
                        f"{what}.astype(np.float32) if that is what you want)")
    if m.shape != v.shape:
      raise ValueError(f"exp_avg and exp_avg_sq shapes differ: {m.shape} vs {v.shape}")
    out = cls(m.size, format)
    out.exp_avg, out.exp_avg_sq, out.scales = _moments.encode(m, v, out.format, seed)
    return out

  def decode(self) -> Tuple[np.ndarray, np.ndarray]:
    """The moments as float32 arrays (every code is a float32 value: exact)."""
    return _moments.decode(self.exp_avg, self.exp_avg_sq, self.scales, self.format)


def adam_step_compressed(params: np.ndarray, moments: CompressedMoments, grad, *, step: int, seed: int = 0,
                         first_index: int = 0, state_size: int = 0, lr: float = 1e-3,
                         betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, eps_root: float = 0.0,
                         weight_decay: float = 0.0, mode: str = "adamw", bias_correction: bool = True,
                         nesterov: bool = False, out=None, grad_scale: float = 1.0, threads: int = 0,
                         kernel: str = "") -> None:
  """:func:`adam_step` with the moments in a :class:`CompressedMoments`: decoded, updated and
  re-encoded (stochastic rounding from (seed, step, first_index + i)) in the same pass.
  ``params`` is the float32 master (updated in place)."""
  seed, first_index, state_size = (check_seed(value, name) for name, value in
                                   (("seed", seed), ("first_index", first_index), ("state_size", state_size)))
  step = _integer(step, "step")
  p, _ = as_buffer(params, "params", writable=True)
  g, gt = as_buffer(grad, "grad")
  o, ot = (None, "f32") if out is None else as_buffer(out, "out", writable=True)
  _same_shape(p, (("grad", g), ("out", o)))
  cfg = _config(dict(lr=lr, betas=betas, eps=eps, eps_root=eps_root, weight_decay=weight_decay, mode=mode,
                     bias_correction=bias_correction, nesterov=nesterov))
  _core.adam_step_compressed(p, moments.exp_avg, moments.exp_avg_sq, moments.scales, moments.format, g, gt, o, ot,
                             cfg, step, _real(grad_scale, "grad_scale"), seed, first_index, state_size,
                             _threads.resolve(_integer(threads, "threads", _INT32)), kernel)


def _step_options(grad_scale, max_grad_norm, skip_nonfinite, known_grad_norm,
                  has_8bit: bool) -> Tuple[float, float, bool, float]:
  """A step's checked options as _core's steps take them: (grad_scale, max_grad_norm,
  skip_nonfinite, known_grad_norm), with skip_nonfinite None meaning "on with 8-bit groups"
  and known_grad_norm None meaning not known (-1)."""
  if known_grad_norm is None:
    known = -1.0
  else:
    known = _real(known_grad_norm, "known_grad_norm")
    if known < 0:
      raise ValueError(f"known_grad_norm = {known_grad_norm!r}: a norm is >= 0 (NaN or inf for non-finite "
                       "gradients; None when not known)")
  if skip_nonfinite is None:
    skip_nonfinite = has_8bit
  return (_real(grad_scale, "grad_scale"), _real(max_grad_norm, "max_grad_norm"),
          _bool(skip_nonfinite, "skip_nonfinite"), known)


def _group_spec(groups: Sequence[Mapping]) -> List[Dict[str, Any]]:
  """The groups as _core takes them (Optimizer's and StoredOptimizer's argument)."""
  spec = []
  for i, g in enumerate(groups):
    if "params" not in g:
      raise ValueError(f"groups[{i}] has no 'params' (a mapping name -> shape)")
    tensors = g["params"].items() if isinstance(g["params"], Mapping) else g["params"]
    own = ("params", "moments", "rounding_seed")
    entry: Dict[str, Any] = {"config": _config({k: v for k, v in g.items() if k not in own}),
             "tensors": [(str(n), [_integer(d, f"groups[{i}]: tensor {str(n)!r}'s shape {tuple(shape)!r}: extent")
                                   for d in shape]) for n, shape in tensors]}
    if "moments" in g:
      entry["moments"] = str(g["moments"])
    if "rounding_seed" in g:
      entry["rounding_seed"] = check_seed(g["rounding_seed"], f"groups[{i}]['rounding_seed']")
    spec.append(entry)
  return spec


class Optimizer:
  r"""Adam/AdamW state of many tensors in one flat, 64-byte aligned arena of host memory.

  The float32 master parameters and both moments of every tensor live in one arena (12
  bytes per parameter; 8 or 6.06 with compressed moments); :meth:`step` updates all of it
  in one fused pass over the SIMD kernel :func:`active_kernel` names, the GIL released.
  For step :math:`t`, per group (hyper-parameters :math:`\eta` = lr, :math:`\lambda` =
  weight_decay) and gradient scale :math:`s`:

  .. math::
    g = s\,\nabla \;(+\,\lambda p \text{ with mode "adam"}), \qquad
    m \leftarrow \beta_1 m + (1-\beta_1)\,g, \qquad v \leftarrow \beta_2 v + (1-\beta_2)\,g^2,

    p \leftarrow (1 - \eta\lambda)\,p \text{ (mode "adamw")}, \qquad
    p \leftarrow p - \frac{\eta}{1-\beta_1^t}\,\frac{m}{\sqrt{v/(1-\beta_2^t) + \epsilon_{root}} + \epsilon}

  (``bias_correction=False`` drops both :math:`1-\beta^t`; ``nesterov`` is optax's NAdam;
  ``maximize`` flips the gradient's sign). The result is the same bits on every kernel and
  thread count.

  Args:
    groups (list): parameter groups, each a dict with ``"params"`` — a mapping name ->
      shape, or a list of (name, shape) — and any of the hyper-parameters ``lr``,
      ``betas`` (or ``beta1``/``beta2``), ``eps``, ``eps_root``, ``weight_decay``, ``mode``
      (``"adam"`` or ``"adamw"``), ``bias_correction``, ``nesterov``, ``maximize``; and how
      the group stores its moments: ``"moments"`` = ``"f32"`` (the default), ``"bf16"`` or
      ``"8bit"`` (stochastically rounded, keyed on ``"rounding_seed"``, an integer in
      ``[0, 2**64)``). With a compressed group the flat moment views do not exist: use
      :meth:`read_moments` / :meth:`write_moments` (float32 copies, the explicit
      conversions) or :meth:`moment_codes`.
    threads (int, default 0): worker threads of each step (0: hostopt's default,
      :func:`default_threads`, OMP_NUM_THREADS when set, else the physical cores of the process's CPU set).
    kernel (str, default ""): force a kernel by name (:func:`kernels` lists them; "": the
      active one).

  Raises:
    ValueError: a group without ``"params"``, an unknown hyper-parameter or moment format,
      a hyper-parameter outside its range, a negative extent or a tensor name given twice.
    TypeError: a hyper-parameter, extent or count of the wrong type (a float for an
      integer, a string or int for a bool: never converted silently).

  Example:
    >>> import numpy as np, hostopt
    >>> opt = hostopt.Optimizer([{"params": {"w": (4, 3), "b": (3,)}, "lr": 1e-2, "weight_decay": 0.1}])
    >>> opt.params("w")[:] = 1.0               # numpy views into the arena
    >>> grads = {"w": np.full((4, 3), 0.5, np.float32), "b": np.ones(3, np.float32)}
    >>> opt.step(grads).applied                # one fused step over every tensor
    True
    >>> round(float(opt.params("w")[0, 0]), 6)  # (1 - 1e-2 * 0.1) * 1 - 1e-2
    0.989
    >>> opt.step_count, opt.num_params
    (1, 15)
  """

  _hostopt_front: str  # set by a front (hostopt.jax) to name itself in CompressedMomentsWarning

  def __init__(self, groups: Sequence[Mapping], threads: int = 0, kernel: str = ""):
    spec = _group_spec(groups)
    self._core = _core.Optimizer(spec, _threads.resolve(_integer(threads, "threads", _INT32)), kernel)
    self._has_8bit = any(self._core.group_moments(g) == "8bit" for g in range(len(spec)))
    self._segments = _segments(self._core)
    self._index = {s.name: i for i, s in enumerate(self._segments)}

  # layout
  @property
  def arena_size(self) -> int:
    """Elements of the flat arena: the tensors' sizes, each padded to the chunk unit."""
    return self._core.arena_size

  @property
  def num_params(self) -> int:
    """Parameters of all the tensors (without padding)."""
    return self._core.num_params

  @property
  def state_bytes(self) -> int:
    """Bytes of host state: master parameters and moments (12 per arena element with f32
    moments, 8 with bf16, 6.0625 with 8-bit), alignment included."""
    return self._core.state_bytes

  @property
  def names(self) -> List[str]:
    """The tensors' names, in arena order (the order of a list of gradients)."""
    return [s.name for s in self._segments]

  def segment(self, name: str) -> Tuple[str, List[int], int, int, int]:
    """(name, shape, offset, size, group) of a tensor (a named tuple with those fields)."""
    return self._segment(name)

  def _segment(self, name: str) -> Segment:
    if name not in self._index:
      raise KeyError(f"tensor name {name!r}: unknown, expected one of the {len(self._segments)} registered tensors")
    return self._segments[self._index[name]]

  # state views
  def _view(self, flat: np.ndarray, name: Optional[str]) -> np.ndarray:
    if name is None:
      return flat
    s = self._segment(name)
    return flat[s.offset:s.offset + s.size].reshape(s.shape)

  def params(self, name: Optional[str] = None) -> np.ndarray:
    """Master parameters (float32 view into the arena; a tensor's when `name` is given)."""
    return self._view(self._core.params(), name)

  def exp_avg(self, name: Optional[str] = None) -> np.ndarray:
    """First moments (float32 view; a tensor's when `name` is given). The flat view exists
    when every group is f32; a tensor's, when its group is (else read_moments)."""
    if name is None:
      return self._core.exp_avg()
    m, _ = self._core.moment_views(name)
    return m.reshape(self._segment(name).shape)

  def exp_avg_sq(self, name: Optional[str] = None) -> np.ndarray:
    """Second moments, as exp_avg."""
    if name is None:
      return self._core.exp_avg_sq()
    _, v = self._core.moment_views(name)
    return v.reshape(self._segment(name).shape)

  def _group(self, group) -> int:
    """A group index: an integer in [0, num_groups) (never a float, bool or string)."""
    n = self._core.num_groups
    return _integer(group, "group", (0, n), f"an index in [0, {n})")

  def group_moments(self, group: int) -> str:
    """How a group stores its moments: "f32", "bf16" or "8bit"."""
    return self._core.group_moments(self._group(group))

  def group_rounding_seed(self, group: int) -> int:
    """The seed of a group's stochastic rounding (compressed moments)."""
    return self._core.group_rounding_seed(self._group(group))

  def set_group_rounding_seed(self, group: int, seed: int) -> None:
    """Sets it: a resumed state continues the same rounding stream with the same seed."""
    self._core.set_group_rounding_seed(self._group(group), check_seed(seed, "seed"))

  def read_moments(self, name: str) -> Tuple[np.ndarray, np.ndarray]:
    """(exp_avg, exp_avg_sq) of one tensor as new float32 arrays, whatever its format (exact)."""
    shape = self._segment(name).shape
    m, v = self._core.read_moments(name)
    return m.reshape(shape), v.reshape(shape)

  def write_moments(self, name: str, exp_avg, exp_avg_sq) -> None:
    """Sets one tensor's moments from float32 values: copied for an f32 group, encoded for
    a compressed one (lossy: the explicit conversion between formats)."""
    shape = tuple(self._segment(name).shape)
    flat = []
    for what, x in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
      a = np.asarray(x)
      if a.dtype != np.float32:  # never a silent cast
        raise TypeError(f"write_moments({name!r}): {what} has dtype {a.dtype}, expected float32")
      if a.shape != shape:
        raise ValueError(f"write_moments({name!r}): {what} has shape {a.shape}, the tensor {shape}")
      flat.append(np.ascontiguousarray(a).reshape(-1))
    self._core.write_moments(name, *flat)

  def moment_codes(self, name: str) -> Tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
    """Views of a compressed tensor's storage: (exp_avg, exp_avg_sq, scales) — uint16 bf16
    bits, or uint8 8-bit codes with (blocks, 2) exponent bytes (None for bf16)."""
    return self._core.moment_codes(name)

  # hyper-parameters
  @property
  def step_count(self) -> int:
    """Applied steps so far (t of the next step is step_count + 1); settable (an integer,
    e.g. to resume), skipped steps do not count."""
    return self._core.step_count

  @step_count.setter
  def step_count(self, value: int) -> None:
    self._core.step_count = _integer(value, "step_count")

  @property
  def tensor_steps(self) -> List[int]:
    """Each tensor's own step count, in arena order: the applied steps that gave it a
    gradient (a step whose mapping lacks a tensor leaves its count, as torch's per-parameter
    ``step``). Setting :attr:`step_count` sets every one."""
    return self._core.tensor_steps

  def group_config(self, group: int) -> Dict[str, Any]:
    """A group's hyper-parameters as a dict (lr, beta1, beta2, eps, eps_root, weight_decay,
    mode, bias_correction, nesterov, maximize)."""
    return self._core.group_config(self._group(group))

  def set_group_config(self, group: int, **hyper) -> None:
    """Changes some hyper-parameters of a group (validated; nothing changes on error)."""
    self._core.set_group_config(self._group(group), _config(hyper))

  # checkpoints
  def save(self, path: str) -> None:
    """Writes the whole state as a safetensors file, atomically (temp file, fsync, rename)."""
    self._core.save(str(path))

  def load(self, path: str) -> None:
    """Loads a checkpoint of the same tensors; verified completely (checksum included)
    before anything changes. Raises RuntimeError naming the problem."""
    self._core.load(str(path))

  @property
  def skipped_steps(self) -> int:
    """Steps skipped because of non-finite gradients (``skip_nonfinite``), or of a non-finite
    norm with clipping (``max_grad_norm``)."""
    return self._core.skipped_steps

  # failures
  @property
  def usable(self) -> bool:
    """False after a step failed midway (the state is half-updated); every operation on
    the state then raises RuntimeError until ``load`` restores it (or ``reset_failure``)."""
    return self._core.usable

  @property
  def failure_reason(self) -> str:
    """Why the state became unusable ("" while it is usable)."""
    return self._core.failure_reason

  def reset_failure(self) -> None:
    """Declares the state whole again (after restoring it yourself through the views)."""
    self._core.reset_failure()

  # the step
  def step(self, grads, out=None, grad_scale: float = 1.0, *, max_grad_norm: float = 0.0,
           skip_nonfinite: Optional[bool] = None, known_grad_norm: Optional[float] = None) -> StepResult:
    """One step; returns a StepResult (applied, step, grad_norm, applied_scale, skipped_steps,
    and for 8-bit groups poisoned_blocks and saturated_blocks). A CompressedMomentsWarning
    is issued once per kind: at the first step that counts poisoned blocks, and at the
    second applied step in a row that counts saturated ones (a block can be saturated for a
    step at the start of training, before v is averaged; the warning waits for saturation
    that lasts).

    Args:
      grads: a mapping name -> gradient (a missing name or None: that tensor has no
        gradient and is left untouched), a list in arena order, or one flat array of
        arena_size elements. One dtype for all: float32, bfloat16 or float16.
      out: optional copy-out of the new parameters, shaped like grads.
      grad_scale: multiplies every gradient (1/loss_scale times a clip coefficient).
      max_grad_norm: > 0 clips by global norm (optax's rule), folded into the step.
      skip_nonfinite: check the gradients first; a non-finite one (or one that overflows
        float once scaled) skips the step with params, moments and step count untouched
        (``applied`` is False, ``skipped_steps`` counts it). None (the default): on when a
        group has 8-bit moments (a NaN there would poison its whole 32-element block, for
        good), else off, like torch.optim: the check costs one read of the gradients.
      known_grad_norm: the gradients' norm computed by the caller (e.g. on the GPU),
        used instead of reading them for the check and the clip: >= 0, or NaN/inf for a
        non-finite one (None: not known; a negative norm is refused).

    A non-finite norm (NaN or inf, given or computed) with ``max_grad_norm`` skips the step
    like ``skip_nonfinite`` does (``applied`` False, counted in ``skipped_steps``): there is
    no clip factor, and the step is never applied unclipped.
    """
    opts = _step_options(grad_scale, max_grad_norm, skip_nonfinite, known_grad_norm, self._has_8bit)
    if isinstance(grads, Mapping) or isinstance(grads, (list, tuple)):
      if isinstance(grads, Mapping):
        unknown = set(grads) - set(self._index)
        if unknown:
          raise KeyError(f"grads: unknown tensor name(s) {sorted(unknown)}")
        glist = [grads.get(n) for n in self.names]
        olist = [out[n] for n in self.names] if out is not None else []
      else:
        glist, olist = list(grads), list(out) if out is not None else []
      grad_arrays, types = as_buffers(glist, "grads")
      outs = [as_buffer(o, f"out[{i}]", writable=True) for i, o in enumerate(olist)]
      out_arrays, otypes = [a for a, _ in outs], {tag for _, tag in outs}
      for what, arrays in (("grads", grad_arrays), ("out", out_arrays)):  # the tensor's own shape, not only its size
        for a, seg in zip(arrays, self._segments):
          if a is not None and a.shape != tuple(seg.shape):
            raise ValueError(f"{what}[{seg.name!r}] has shape {a.shape}: expected {tuple(seg.shape)}, the tensor's "
                             "shape (an array of the same size but another shape is refused, not reinterpreted)")
      if len(types) > 1:
        raise TypeError(f"grads: mixed dtypes {sorted(types)}; one gradient dtype per step")
      if len(otypes) > 1:
        raise TypeError(f"out: mixed dtypes {sorted(otypes)}; one copy-out dtype per step")
      result = self._core.step_tensors(grad_arrays, types.pop() if types else "f32", out_arrays,
                                       otypes.pop() if otypes else "f32", *opts)
    else:
      g, gt = as_buffer(grads, "grads")
      o, ot = (None, "f32") if out is None else as_buffer(out, "out", writable=True)
      for what, a in (("grads", g), ("out", o)):  # flat means 1-D: another shape is not reinterpreted
        if a is not None and a.ndim != 1:
          raise ValueError(f"{what} has shape {a.shape}: a flat {what} is 1-D, arena_size = {self.arena_size} "
                           "elements (a mapping or a list gives each tensor its own shape)")
      result = self._core.step_flat(g, gt, o, ot, *opts)
    _report_blocks(self, result, "hostopt.Optimizer")
    return result


class _LayoutOnly:
  """An arena layout without any state (what _flat_of reads of a core)."""

  def __init__(self, segments: list, arena_size: int):
    self._segments, self.arena_size = segments, arena_size

  def segments(self) -> list:
    return self._segments


def _optimizer_core(opt: Any, what: str) -> "_core.Optimizer":
  if not isinstance(opt, Optimizer):
    raise TypeError(f"{what}: expected a hostopt.Optimizer (or a hostopt._core.ShardedOptimizer for a shard), got "
                    f"{type(opt).__name__}")
  return opt._core


def _save_id(save_id: Any) -> str:
  """A sharded save's id: a str, never another object turned into one (None, a number)."""
  if not isinstance(save_id, str):
    raise TypeError(f"save_id: expected a str (1 to 64 letters, digits, '.', '_' or '-'), got "
                    f"{type(save_id).__name__} {save_id!r}")
  return save_id


class StoredOptimizer:
  """Adam/AdamW state kept on a local drive, not in RAM: every step streams it through a few
  staging buffers (read chunk k+d ahead, update chunk k with Optimizer's own fused kernels,
  write chunk k-1 back), and once a step returns, what is on the drive is that step,
  verified: a killed process reopens at its last completed step. The results are
  :class:`Optimizer`'s bits, for every moment format and kernel.

  Make one with :meth:`create` (a new store), :meth:`open` (an existing one) or
  :meth:`from_optimizer` (an Optimizer's state imported); :meth:`save` writes today's
  checkpoint format streamed from the drive, :meth:`copy_to` exports the state into an
  Optimizer. Every method takes ``groups`` as :class:`Optimizer` does.

  Keyword Args:
    staging_bytes (int): RAM for the staging buffers (default 256 MiB).
    buffers (int): staging buffers, buffers - 2 chunks read ahead and 2 written back
      (default 8).
    chunk_elements (int): chunk size in elements (default 0: from the budget); a store
      keeps the chunking it was created with.
    sync (bool): make each step durable with fdatasync, so a power loss keeps it too
      (default True); with False a killed process still keeps every completed step.
    io (str): "io_uring" (refused where the kernel refuses it), "threads" (pread/pwrite
      on a small pool), or "auto" (the default: io_uring, else threads).

  These are keywords of create, open and from_optimizer. The directory must be on a
  filesystem with O_DIRECT (not tmpfs); the store takes about
  twice the state's bytes there (two slots per chunk). `dir` may be a list of directories,
  one per drive: chunk k goes to dir[k % n] (open names them in the same order).
  hostopt.jax's and hostopt.torch's ``store=`` keep their state in one (their parameters on a
  GPU through the offload pipeline, which drives a store as it drives an Optimizer; also
  ``hostopt._core.OffloadPipeline``). Per-tensor steps as :class:`Optimizer`'s: a tensor
  without a gradient in a step keeps its state and its own step count (:attr:`tensor_steps`),
  which every commit keeps.

  ``shard=(world_size, rank)`` (a keyword of create and open only) keeps one rank's shard of
  the layout, each rank its own store: the range ``hostopt._core.shard_of`` gives
  (:attr:`range`), whose slice of the flat layout every step's gradient and ``out`` are (what
  a reduce-scatter gives and an all-gather takes; a mapping of whole tensors is cut to it, and
  needs only the tensors the shard overlaps). A
  checked or clipping step needs ``known_grad_norm`` (the global norm, all-reduced) so no
  rank decides alone: skip_nonfinite is on by default with 8-bit groups. A shard's store
  imports from and exports into a ``hostopt._core.ShardedOptimizer`` of the same shard
  (:meth:`from_optimizer`, :meth:`copy_to`), and writes its part of a sharded checkpoint
  streamed (:meth:`save_shard`, rank 0's :meth:`commit_shard_save`), which loads at any
  world size.

  Example:
    >>> import numpy as np, hostopt, tempfile
    >>> groups = [{"params": {"w": (1000,)}, "lr": 1e-2, "moments": "8bit"}]
    >>> d = tempfile.mkdtemp()  # a directory on a local drive (not tmpfs: O_DIRECT)
    >>> opt = hostopt.StoredOptimizer.create(groups, d, sync=False)
    >>> opt.step({"w": np.ones(1000, np.float32)}).step
    1
    >>> del opt; hostopt.StoredOptimizer.open(groups, d, sync=False).step_count
    1
  """

  _hostopt_front: str  # set by a front (hostopt.jax) to name itself in CompressedMomentsWarning

  def __init__(self, core: Any, groups: List[Mapping]) -> None:  # (made by create, open and from_optimizer)
    self._core: Optional[_core.StoredOptimizer] = core
    self._groups = groups
    self._range = tuple(core.range)
    self._whole = _LayoutOnly(*_core.arena_layout(_group_spec(groups)))
    self._sharded = self._range != (0, self._whole.arena_size)
    self._has_8bit = any(str(g.get("moments", "f32")) in ("8bit", "q8") for g in groups)
    self._segments = _segments(self._core)
    self._index = {s.name: i for i, s in enumerate(self._segments)}

  @staticmethod
  def _dirs(dir) -> List[str]:
    if isinstance(dir, (str, bytes, os.PathLike)):
      return [os.fsdecode(dir)]
    dirs = [os.fsdecode(d) for d in dir]
    if not dirs:
      raise ValueError("dir: an empty list; name a directory (several: one per drive, striped)")
    return dirs

  @staticmethod
  def _options(staging_bytes, buffers, chunk_elements, sync, io) -> Tuple[int, int, int, bool, str]:
    return (_integer(staging_bytes, "staging_bytes", (1, 2**63), "a positive byte count"),
            _integer(buffers, "buffers", (3, 1025), "an integer in [3, 1024]"),
            _integer(chunk_elements, "chunk_elements", (0, 2**63), "an element count >= 0"),
            _bool(sync, "sync"), str(io))

  @staticmethod
  def _shard_range(spec: List[Dict[str, Any]], shard) -> Optional[Tuple[int, int]]:
    """[begin, end) of the layout that shard=(world_size, rank) holds, or None (the whole)."""
    if shard is None:
      return None
    if isinstance(shard, (str, bytes)) or not isinstance(shard, Sequence) or len(shard) != 2:
      raise TypeError(f"shard={shard!r}: expected (world_size, rank)")
    world = _integer(shard[0], "shard's world_size", (1, 2**31), "an int >= 1")
    rank = _integer(shard[1], "shard's rank", (0, world), f"an int in [0, {world}) (world_size {world})")
    return _core.shard_of_groups(spec, world, rank)

  @classmethod
  def create(cls, groups: Sequence[Mapping], dir: Union[str, os.PathLike, Sequence[str]], *, initial_params=None, staging_bytes: int = 256 << 20,
             buffers: int = 8, chunk_elements: int = 0, sync: bool = True, io: str = "auto", threads: int = 0,
             kernel: str = "", shard: Optional[Tuple[int, int]] = None) -> "StoredOptimizer":
    """A new store in the existing directory `dir` (refused where one is; a list of
    directories, one per drive, stripes the chunks over them): zero moments,
    step 0, and the master parameters from `initial_params` (a mapping name -> array of
    every tensor, or one flat float32 array in the arena layout: of the shard's range
    with `shard`) or zeros."""
    spec = _group_spec(groups)
    th = _threads.resolve(_integer(threads, "threads", _INT32))
    held = cls._shard_range(spec, shard)
    flat = None
    if initial_params is not None:
      if isinstance(initial_params, Mapping):
        flat, tag = cls._flat_of(_LayoutOnly(*_core.arena_layout(spec)), initial_params, "initial_params", held)
      else:
        flat, tag = as_buffer(initial_params, "initial_params")
        if flat.ndim != 1:
          raise ValueError(f"initial_params has shape {flat.shape}: a flat array is 1-D (arena_size elements; a "
                           "mapping gives each tensor its own shape)")
      if tag != "f32":
        raise TypeError(f"initial_params: dtype {tag}, expected float32 (the master parameters)")
    core = _core.StoredOptimizer.create(spec, cls._dirs(dir), *cls._options(staging_bytes, buffers, chunk_elements, sync, io),
                                        th, kernel, flat, held)
    return cls(core, list(groups))

  @classmethod
  def open(cls, groups: Sequence[Mapping], dir: Union[str, os.PathLike, Sequence[str]], *, staging_bytes: int = 256 << 20, buffers: int = 8,
           sync: bool = True, io: str = "auto", threads: int = 0, kernel: str = "",
           shard: Optional[Tuple[int, int]] = None, previous: bool = False) -> "StoredOptimizer":
    """The store in `dir` at its last completed step, every chunk verified first. Raises
    RuntimeError naming the problem: no store, other groups (names, shapes, moment formats,
    rounding seeds) or another shard, a store open elsewhere, a corrupt or truncated chunk.

    The hyper-parameters are those of the step it opens at (each step keeps them), as
    Optimizer.load restores a checkpoint's; `groups` gives them only where the store keeps
    none (made before hostopt kept them) or their record cannot be read (:attr:`recovery`
    says so). :meth:`set_group_config` changes them for later steps.

    ``previous=True`` goes back to the applied step before the last, for good (its state and
    step counts; skipped steps since then are undone too), e.g. to undo a step found bad after
    it completed. Every directory's copy of that step is verified before any is let go of.
    Where the last step cannot be opened, it stands where open falls back to
    (:attr:`recovery` says so). RuntimeError naming why, nothing rolled back, where that step
    is gone: a step that failed or was killed midway began writing over it, the store went
    back already, or it stands at the step it was created with."""
    spec = _group_spec(groups)
    th = _threads.resolve(_integer(threads, "threads", _INT32))
    held = cls._shard_range(spec, shard)
    if not isinstance(previous, bool):
      raise TypeError(f"previous: expected a bool, got {type(previous).__name__}")
    core = _core.StoredOptimizer.open(spec, cls._dirs(dir), *cls._options(staging_bytes, buffers, 0, sync, io), th, kernel,
                                      held, previous)
    return cls(core, list(groups))

  @classmethod
  def from_optimizer(cls, opt: Union["Optimizer", "_core.ShardedOptimizer"], groups: Sequence[Mapping],
                     dir: Union[str, os.PathLike, Sequence[str]], *, staging_bytes: int = 256 << 20,
                     buffers: int = 8, chunk_elements: int = 0, sync: bool = True,
                     io: str = "auto") -> "StoredOptimizer":
    """A new store holding `opt`'s whole state (params, moments, step counts): an Optimizer
    built from the same `groups` (rounding seeds included: a store reopens only with them).
    The store keeps `opt`'s hyper-parameters with each step, as it does the state.

    `opt` may be one rank's ``hostopt._core.ShardedOptimizer`` of the same groups: the store
    then holds that rank's shard (open it with ``shard=(world_size, rank)``), e.g. a sharded
    checkpoint loaded by ShardedOptimizer.load, at any world size it was saved with."""
    ram = opt if isinstance(opt, _core.ShardedOptimizer) else _optimizer_core(opt, "from_optimizer")
    core = _core.StoredOptimizer.import_state(ram, _group_spec(groups), cls._dirs(dir),
                                              *cls._options(staging_bytes, buffers, chunk_elements, sync, io))
    return cls(core, list(groups))

  def copy_to(self, opt: Union["Optimizer", "_core.ShardedOptimizer"]) -> None:
    """Reads the whole state into `opt` (an Optimizer of the same groups): an export. On an
    I/O error midway `opt` is left unusable (its failure_reason says why) until it is loaded.

    A shard's store exports into a ``hostopt._core.ShardedOptimizer`` of the same groups,
    world size and rank, whose ``save`` and ``commit_save`` then write a sharded checkpoint
    that ``load`` reads at any world size."""
    core = self._live()
    if isinstance(opt, _core.ShardedOptimizer):
      core.copy_state_to(opt)
      return
    ram = _optimizer_core(opt, "copy_to")
    if self._sharded:
      raise ValueError(f"copy_to: this store holds a shard {self._range}, and an Optimizer holds the whole layout: "
                       "export a shard into a hostopt._core.ShardedOptimizer of the same groups, world size and rank")
    core.copy_state_to(ram)

  def save(self, path: Union[str, os.PathLike]) -> None:
    """Writes the last completed step as a checkpoint file in :meth:`Optimizer.save`'s format
    (the very bytes an Optimizer filled by :meth:`copy_to` would save; ``Optimizer.load``
    and the fronts read it), streamed: each chunk read once and verified, its pieces written
    where the file holds them, the file read back once for its checksum, no RAM beyond the
    staging buffers. Atomic (temp file, fsync, rename). A shard's store is refused
    (ValueError): :meth:`save_shard` writes its part of a sharded checkpoint."""
    core = self._live()
    if self._sharded:
      raise ValueError(f"save: this store holds a shard {self._range}: save_shard(dir, save_id, world_size, rank) "
                       "writes its part of a sharded checkpoint")
    core.save(os.fspath(path))

  def save_shard(self, dir: Union[str, os.PathLike], save_id: str, world_size: int, rank: int) -> None:
    """A shard's store: writes rank `rank`'s part of sharded checkpoint `save_id` in `dir`
    (``hostopt._core.ShardedOptimizer.save``'s file, the very bytes), streamed as :meth:`save`
    streams, without the state in RAM. The store must hold that rank's shard of
    `world_size` (``shard=(world_size, rank)`` at its creation), else ValueError naming both
    ranges. After every rank's save returned (a barrier), rank 0 calls
    :meth:`commit_shard_save`; a ``ShardedOptimizer`` of any world size then loads it."""
    core = self._live()
    core.save_shard(os.fspath(dir), _save_id(save_id), _integer(world_size, "world_size", (1, 2**31), "an int >= 1"),
                    _integer(rank, "rank", (0, 2**31), "an int >= 0"))

  def commit_shard_save(self, dir: Union[str, os.PathLike], save_id: str, world_size: int) -> None:
    """Rank 0's commit of sharded checkpoint `save_id` (``ShardedOptimizer.commit_save``'s):
    every rank's shard file verified, ``index.json`` written atomically, other saves' shard
    files removed. The store must hold rank 0's shard of `world_size`."""
    core = self._live()
    core.commit_shard_save(os.fspath(dir), _save_id(save_id),
                           _integer(world_size, "world_size", (1, 2**31), "an int >= 1"))

  def read_params(self, out=None) -> np.ndarray:
    """The master parameters of the last completed step, streamed from the drive (every chunk
    verified, the state unchanged, no RAM beyond the staging buffers): what a resumed run
    puts back into its model. A flat array of :attr:`arena_size` elements: `out` (float32,
    or bfloat16 / float16 rounded as a step's ``out`` rounds) or a new float32 array. The
    padding between tensors is zero in a new array and left as it is in `out`; tensor
    `name` is ``p[offset:offset + size].reshape(shape)`` of :meth:`segment`. An I/O error
    or a bad chunk raises with `out` partly written."""
    core = self._live()
    if out is None:
      out = np.zeros(core.arena_size, np.float32)
    o, ot = as_buffer(out, "out", writable=True)
    if o.ndim != 1:
      raise ValueError(f"out has shape {o.shape}: a flat out is 1-D, arena_size = {core.arena_size} elements")
    core.copy_params_to(o, ot)
    return out

  @staticmethod
  def _flat_of(layout, arrays: Mapping, what: str, held: Optional[Tuple[int, int]] = None,
               missing_ok: bool = False) -> Tuple[np.ndarray, str]:
    """A mapping name -> array of every tensor as one flat array in the arena layout (a copy),
    and its dtype tag. With `held` = [begin, end) (a shard), the flat array of that range:
    only the tensors it overlaps are needed (others may be absent), and only their part in it
    is copied. With `missing_ok`, a tensor may be absent (or None): its elements are zeros."""
    segs = _segments(layout)
    b, e = held if held is not None else (0, layout.arena_size)
    needed = [s for s in segs if held is None or max(s.offset, b) < min(s.offset + s.size, e)]
    missing = [s.name for s in needed if arrays.get(s.name) is None]
    if missing and not missing_ok:
      whose = "a stored optimizer steps every tensor" if held is None else f"the tensors of this shard {held}"
      raise KeyError(f"{what}: no array for tensor(s) {missing}: {whose}")
    unknown = set(arrays) - {s.name for s in segs}
    if unknown:
      raise KeyError(f"{what}: unknown tensor name(s) {sorted(unknown)}")
    views = {s.name: as_buffer(arrays[s.name], f"{what}[{s.name!r}]") for s in segs if arrays.get(s.name) is not None}
    tags = {tag for _, tag in views.values()}
    if len(tags) > 1:
      raise TypeError(f"{what}: mixed dtypes {sorted(tags)}; one dtype for all")
    tag = tags.pop() if tags else "f32"
    flat = np.zeros(e - b, next(iter(views.values()))[0].dtype if views else np.float32)
    for s in segs:
      if s.name not in views:
        continue
      a = views[s.name][0]
      if a.shape != tuple(s.shape):
        raise ValueError(f"{what}[{s.name!r}] has shape {a.shape}: expected {tuple(s.shape)}, the tensor's shape")
      lo, hi = max(s.offset, b), min(s.offset + s.size, e)
      if lo < hi:
        flat[lo - b:hi - b] = a.reshape(-1)[lo - s.offset:hi - s.offset]
    return flat, tag

  def _live(self) -> "_core.StoredOptimizer":
    if self._core is None:
      raise ValueError("this StoredOptimizer is closed (open the store again)")
    return self._core

  def close(self) -> None:
    """Releases the store (its lock and staging memory): another process may open it. Every
    completed step is on the drive already. Later calls raise ValueError."""
    if self._core is not None:
      self._core.close()  # (now, whatever still refers to the core object: a traceback's frame)
    self._core = None

  def __enter__(self) -> "StoredOptimizer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def step(self, grads, out=None, grad_scale: float = 1.0, *, max_grad_norm: float = 0.0,
           skip_nonfinite: Optional[bool] = None, known_grad_norm: Optional[float] = None) -> StepResult:
    """One step, streamed from and back to the drive and committed before it returns, as
    :meth:`Optimizer.step` (the same arguments and result): a mapping name -> gradient
    (copied into one flat array first: pass a flat array to save that copy; a missing name
    or None: that tensor has no gradient, keeps its state and its own step count), or one
    flat array of arena_size elements. A store of a shard needs the gradient of every tensor
    it overlaps (its tensors share one step count).
    ``out`` (flat) receives the new parameters (a tensor without a gradient: its parameters
    as they are). A step that raises while streaming (an I/O
    error, a bad chunk) leaves the store at the previous step, ``out`` partly written; one
    that raises while committing refuses every later step until the store is reopened. A
    skipped step touches no drive."""
    opts = _step_options(grad_scale, max_grad_norm, skip_nonfinite, known_grad_norm, self._has_8bit)
    core = self._live()
    if self._sharded and opts[3] < 0 and (opts[2] or opts[1] != 0):
      why = ("max_grad_norm clips" if opts[1] != 0 else
             "skip_nonfinite is on" + (" (the default with 8-bit groups)" if skip_nonfinite is None else ""))
      raise ValueError(f"this store holds a shard {self._range}, and {why}: the decision needs the global gradient "
                       "norm, or each rank would decide alone. Pass known_grad_norm (the ranks' sums of squares, "
                       "all-reduced, square-rooted), or skip_nonfinite=False and no max_grad_norm")
    without: List[int] = []
    if isinstance(grads, Mapping):
      g, gt = self._flat_of(self._whole, grads, "grads", self._range if self._sharded else None,
                            missing_ok=not self._sharded)
      if not self._sharded:
        without = [i for i, s in enumerate(self._segments) if grads.get(s.name) is None]
    else:
      g, gt = as_buffer(grads, "grads")
    o, ot = (None, "f32") if out is None else as_buffer(out, "out", writable=True)
    for what, a in (("grads", g), ("out", o)):
      if a is not None and a.ndim != 1:
        raise ValueError(f"{what} has shape {a.shape}: a flat {what} is 1-D, arena_size = {self.arena_size} elements")
    if without:
      result = core.step_flat_adopting(g, gt, o, ot, *opts, None, [], without)
    else:
      result = core.step_flat(g, gt, o, ot, *opts)
    _report_blocks(self, result, "hostopt.StoredOptimizer")
    return result

  @property
  def step_count(self) -> int:
    """Applied steps (committed on the drive)."""
    return self._live().step_count

  @property
  def skipped_steps(self) -> int:
    """Steps skipped for non-finite gradients (committed with the next applied step)."""
    return self._live().skipped_steps

  @property
  def tensor_steps(self) -> List[int]:
    """Each tensor's own step count, in arena order (:attr:`Optimizer.tensor_steps`): the applied
    steps that gave it a gradient."""
    return self._live().tensor_steps

  @property
  def arena_size(self) -> int:
    """Elements of a flat gradient or ``out``: the range held (the whole layout, each tensor padded to
    the chunk unit, unless made with ``shard``)."""
    return self._live().arena_size

  @property
  def range(self) -> Tuple[int, int]:
    """[begin, end) of the layout held: (0, the layout's end) unless made with ``shard``."""
    return self._range

  @property
  def names(self) -> List[str]:
    """The tensors' names, in arena order."""
    return [s.name for s in self._segments]

  def segment(self, name: str) -> Tuple[str, List[int], int, int, int]:
    """(name, shape, offset, size, group) of a tensor."""
    if name not in self._index:
      raise KeyError(f"tensor name {name!r}: unknown, expected one of the {len(self._segments)} registered tensors")
    return self._segments[self._index[name]]

  @property
  def chunks(self) -> int:
    """Chunks the arena is streamed in."""
    return self._live().chunks

  @property
  def chunk_bytes(self) -> int:
    """Bytes of one chunk on the drive (a multiple of 4 KiB)."""
    return self._live().chunk_bytes

  @property
  def staging_bytes(self) -> int:
    """RAM of the staging buffers in use."""
    return self._live().staging_bytes

  @property
  def recovery(self) -> str:
    """What open did where the last step could not be opened whole ("" when it opened
    there): a bad chunk of it (a power loss without sync, corruption) opened the step before;
    striped stores killed between their stripes' commits opened at the step all of them hold;
    a hyper-parameter record that could not be read left the groups' in use."""
    return self._live().recovery

  @property
  def stripes(self) -> int:
    """Directories the chunks are striped over."""
    return self._live().stripes

  @property
  def step_io_bytes(self) -> int:
    """Bytes read plus written by one applied step."""
    return self._live().step_io_bytes

  @property
  def io_backend(self) -> str:
    """"io_uring" or "threads": the I/O in use."""
    return self._live().io_backend

  @property
  def cached_pages(self) -> int:
    """Pages of the store's chunks in the page cache: 0 when its I/O bypassed it (O_DIRECT)."""
    return self._live().cached_pages

  def group_config(self, group: int) -> Dict[str, Any]:
    """A group's hyper-parameters as a dict."""
    core = self._live()
    n = core.num_groups
    return core.group_config(_integer(group, "group", (0, n), f"an index in [0, {n})"))

  def set_group_config(self, group: int, **hyper) -> None:
    """Changes some hyper-parameters of a group for later steps (validated; nothing changes on error)."""
    core = self._live()
    n = core.num_groups
    core.set_group_config(_integer(group, "group", (0, n), f"an index in [0, {n})"), _config(hyper))
