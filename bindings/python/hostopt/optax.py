r"""optax-compatible Adam family whose update runs on hostopt's fused CPU kernels.

``hostopt.optax.adam``, ``adamw``, ``nadam`` and ``nadamw`` take the installed optax's
arguments and defaults (their signatures are optax's, read at import) and return
``optax.GradientTransformationExtraArgs``; their states are exactly the trees optax builds
for the same call (``ScaleByAdamState(count, mu, nu)``, the weight-decay state, the
learning-rate state), so code that inspects, checkpoints or wraps optax states keeps
working. They compose with ``optax.chain``, ``optax.inject_hyperparams``,
``optax.apply_if_finite`` and ``optax.MultiSteps``.

.. math::
  m_t = \beta_1 m_{t-1} + (1-\beta_1) g_t,\quad v_t = \beta_2 v_{t-1} + (1-\beta_2) g_t^2,\quad
  u_t = -\eta_t\left(\frac{\hat m_t}{\sqrt{\hat v_t + \epsilon_{root}} + \epsilon} + \lambda p_{t-1}\right)

with :math:`\hat m_t = m_t/(1-\beta_1^t)` (Nesterov: :math:`\beta_1 m_t/(1-\beta_1^{t+1}) +
(1-\beta_1) g_t/(1-\beta_1^t)`), :math:`\hat v_t = v_t/(1-\beta_2^t)` and decoupled weight
decay :math:`\lambda` (``adamw``/``nadamw``; masked like optax).

Where the update runs, leaf by leaf:

- a leaf whose mu and nu are float32 (the default for float32 params) and whose gradient and
  params are float32, bfloat16 or float16 runs on hostopt's fused kernel, all such leaves in
  one call and one parallel region. Under ``jax.jit`` (and for eager jax arrays, which run
  the same jitted call) that call is an XLA FFI custom call — no Python callback — with mu
  and nu updated in place and the update written over the gradient: in a training step that
  returns ``(params, state)`` with both donated (``jax.jit(step, donate_argnums=(0, 1))``), no
  full-size copy is made. (Donating the state of a function that returns ``(updates,
  state)`` does not do it: JAX pairs a donated buffer with the first output of its shape,
  the updates, and XLA then copies the moments.) 16-bit gradients are widened to float32
  exactly before any arithmetic and the update is float32, as optax's is; optax instead
  rounds ``(1 - b1) g`` and ``g**2`` to the 16-bit type first (and float16 ``g**2`` underflows
  below 6e-8), so with 16-bit gradients the two differ by that rounding — hostopt's is the
  more accurate;
- every other leaf — float64 (under ``jax_enable_x64``), complex (nu from :math:`|g|^2`),
  16-bit moments (``mu_dtype`` or 16-bit params) — runs optax's own ``scale_by_adam``,
  ``add_decayed_weights`` and ``scale_by_learning_rate`` on it: optax's results and dtypes
  exactly, never a cast.

Hyper-parameters may be Python or numpy numbers (passed to the kernel as float64
attributes), arrays or schedules (evaluated by XLA and passed as traced scalars;
``weight_decay`` may be a schedule where optax accepts one; any callable will do); numpy,
eager and jitted calls give the same bits. As in optax, the learning rate and weight decay
may be negative. Outside hostopt's range (b1, b2 in [0, 1); eps, eps_root >= 0, +inf
included: Adam's term is then 0, as in optax; learning_rate, weight_decay finite) a
hyper-parameter is refused, naming it, on every route and moment format: a known value with
a ValueError before anything changes, a traced one by the FFI handler (jax's runtime error
when the call runs; buffers donated to it are gone, as with any failed XLA call). ``vmap`` works;
differentiating through ``update`` raises (the kernel has no derivative rule: use optax
itself for meta-gradients).

Compressed moments: ``moments="bf16"`` or ``"8bit"`` (hostopt's options; ``adamw_8bit`` is
``adamw`` with ``moments="8bit"``) keep Adam's moments in 4 or 2.06 bytes per parameter
instead of optax's 8, stochastically rounded by a generator keyed on ``rounding_seed``, the
step and the element (README: "Compressed moments"). The state is then documented and
typed, so optax's own update fails loudly on it instead of reading codes as moments:

- ``bf16``: optax's ``ScaleByAdamState(count, mu, nu)`` with bfloat16 mu and nu (values);
- ``8bit``: ``ScaleByAdam8bitState(count, mu_codes, nu_codes, scales)``: uint8 codes of each
  leaf's shape, and ``scales`` one uint8 ``[blocks, 2]`` array of exponent bytes (mu's and
  nu's per 32-element block): leaf after leaf in the params' leaf order, each leaf's
  ``ceil(size / 32)`` blocks (one array, not a tree like the params, so
  ``optax.tree_utils.tree_map_params`` maps the codes only).

A NaN or infinite gradient poisons its whole 32-element 8-bit block (NaN for good), and a
transformation returns only updates and state: there are no step statistics, and under jit
nothing can warn. Eagerly (numpy or jax arrays outside jit) the first update that leaves
poisoned blocks warns, once per process (``hostopt.CompressedMomentsWarning``: wrappers such as
``optax.inject_hyperparams`` build the transformation again at every update);
``poisoned_blocks(state)`` counts them in any state, under jit too. Saturated blocks (an
outlier exceeding a block's range) are counted by the kernels of the other fronts only. As
optax, non-finite gradients are not skipped by default: wrap the transformation in
``optax.apply_if_finite`` (recommended for 8-bit moments) to skip them.

Exponent bytes the 8-bit encoder never writes (a corrupt or foreign state) are refused
naming the leaf and block: eagerly for a known state, by the FFI handler for a traced one.
The update is the f32 kernel's for the decoded moments, in the gradient's dtype (the
kernel's: bfloat16 gradients give bfloat16 updates), the same bits eager, jitted and on
numpy (the moments re-encoded in the same pass, in place under jit). Every leaf runs on the
kernel, so gradients and params must be float32, bfloat16 or float16 and the arrays on the
CPU, or the codes in pinned host memory (``state_memory="pinned_host"``, as for float
moments: the scales too); ``mu_dtype`` and ``reuse_state`` are refused with compressed moments.
``init`` keeps the params' shardings on the codes; under vmap the call runs per batch
element; under jit with several devices it runs per shard on each leaf cut along dim 0 alone
(8-bit: into whole 32-element blocks), the same bits as on whole arrays, and gathers any
other sharded leaf around the call.

hostopt's own options are keyword arguments collected apart from optax's, so that
``optax.inject_hyperparams`` never mistakes them for hyper-parameters:
``threads`` (worker threads, 0 = the runtime's default), ``reuse_state`` (numpy states
only: mu and nu are updated in place, saving two copies per step) and ``state_memory``
(``"pinned_host"``: on an accelerator, ``init`` puts the float32 mu and nu in the devices'
pinned host memory, where they take no HBM, and ``update`` sends the gradients (and params
for weight decay) there, runs the kernel on the host (``compute_on("device_host")``) and
returns the updates in device memory; needs a jax with memory spaces). Inputs may be numpy or
jax pytrees; outputs are of the same kind.

A sketch of a training step (each factory's docstring has a complete example)::

  import optax, hostopt.optax
  opt = optax.chain(optax.clip_by_global_norm(1.0), hostopt.optax.adamw(1e-3, weight_decay=0.1))
  state = opt.init(params)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def train_step(params, state, batch):
    updates, state = opt.update(jax.grad(loss)(params, batch), state, params)
    return optax.apply_updates(params, updates), state
"""

import dataclasses
import functools
import inspect
import warnings
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple, TypedDict

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax.experimental.compute_on import compute_on

from . import _core, _moments, _xla
from ._arrays import check_seed
from ._block_checks import report as _report_blocks
from ._dtypes import tag_of
from ._masks import mask_flags
from ._xla import is_static_number

__all__ = ["adam", "adamw", "nadam", "nadamw", "adamw_8bit", "HostoptOptions", "ScaleByAdam8bitState", "poisoned_blocks"]

_HOSTOPT_OPTIONS = {"threads": 0, "reuse_state": False, "state_memory": None, "moments": "f32", "rounding_seed": 0}
_KNOWN = ("learning_rate", "b1", "b2", "eps", "eps_root", "mu_dtype", "weight_decay", "mask", "nesterov")
# optax's own functions, taken at import (a test may put hostopt's in their place).
_OPTAX = {name: getattr(optax, name) for name in ("adam", "adamw")}
_increment = getattr(optax, "safe_increment", None) or optax.safe_int32_increment


class ScaleByAdam8bitState(NamedTuple):
  """The Adam state of hostopt.optax with moments="8bit": optax's count, each leaf's mu and
  nu as uint8 codes of its shape, and `scales`, one uint8 [blocks, 2] array of exponent
  bytes (mu's, nu's per 32-element block): each leaf's ceil(size / 32) blocks, leaf after
  leaf in leaf order. Zero bytes everywhere are zero moments."""
  count: Any
  mu_codes: Any
  nu_codes: Any
  scales: Any


# The warn-once record of every transformation of this process (CompressedMomentsWarning):
# optax.inject_hyperparams and friends build the transformation again at every update, so a
# record per transformation would warn at every update.
_BLOCKS_TOLD = type("_Told", (), {})()


def poisoned_blocks(state):
  """How many 8-bit blocks of the ScaleByAdam8bitStates in `state` (any optax state tree)
  are poisoned: an exponent byte 255, their 32 moments NaN (for good). An int for a known
  state, a traced int32 under jit."""
  found = [x for x in jax.tree_util.tree_leaves(state, is_leaf=lambda x: isinstance(x, ScaleByAdam8bitState))
           if isinstance(x, ScaleByAdam8bitState)]
  if any(_is_traced(x.scales) for x in found):
    return sum((jnp.any(jnp.asarray(x.scales) == 255, axis=1).sum(dtype=jnp.int32) for x in found), jnp.int32(0))
  return int(sum(np.count_nonzero(np.any(np.asarray(x.scales) == 255, axis=1)) for x in found))


def _is_traced(x) -> bool:
  return isinstance(x, jax.core.Tracer)


class _Hyper(NamedTuple):
  """Adam's six hyper-parameters, in the order the kernel and the FFI handlers take them.
  Each is a number, an array (traced or not), a schedule's value, or None where unknown."""
  lr: Any
  b1: Any
  b2: Any
  eps: Any
  eps_root: Any
  wd: Any


# How optax's signatures (and the errors) name them.
_HP_NAMES = _Hyper("learning_rate", "b1", "b2", "eps", "eps_root", "weight_decay")


def _static_and_dynamic(hp: _Hyper, lr_schedule, wd_schedule, evaluated: bool) -> Tuple[_Hyper, List[Any]]:
  """Which hyper-parameters a jitted update is specialised on, and which are its operands.

  Static: the ones known now as Python numbers (floats, attributes of the FFI call); a
  scheduled one is None (evaluated inside the call at its count) unless `evaluated`, the
  numpy route, which evaluates the schedules first. Dynamic: the others (arrays, traced or
  not) in field order, the scheduled ones excepted."""
  scheduled = {"lr": lr_schedule is not None, "wd": wd_schedule is not None}
  static = _Hyper(*(None if scheduled.get(f) and not evaluated else float(v) if is_static_number(v) else None
                    for f, v in zip(_Hyper._fields, hp)))
  dynamic = [v for f, v, known in zip(_Hyper._fields, hp, static) if known is None and not scheduled.get(f)]
  return static, dynamic


def _hp_rule(name: str) -> Tuple[Callable[[np.ndarray], np.ndarray], str]:
  """The range hostopt.optax takes for a hyper-parameter (the XLA FFI handlers' rule too)."""
  if name in ("b1", "b2"):
    return (lambda x: (x >= 0.0) & (x < 1.0)), "a value in [0, 1)"
  if name in ("eps", "eps_root"):  # +inf too: Adam's term is then 0, as optax's arithmetic gives
    return (lambda x: x >= 0.0), "a value >= 0 (+inf included)"
  return np.isfinite, "a finite value"  # learning_rate and weight_decay: either sign, as optax


def _check_hyperparameters(hp) -> None:
  """Refuses, naming it, a known hyper-parameter (a number, numpy array or jax array not
  being traced) outside its range, before anything changes; traced ones are refused by the
  FFI handler that reads them, by the same rule. Schedules (callables) pass: they are
  checked where they are evaluated."""
  for name, v in zip(_HP_NAMES, hp):
    if v is None or callable(v) or _is_traced(v):
      continue
    x = np.asarray(v, dtype=np.float64).reshape(-1)
    ok, rule = _hp_rule(name)
    bad = np.flatnonzero(~ok(x))
    if bad.size:
      raise ValueError(f"{name} = {float(x[bad[0]])}: expected {rule} (hostopt.optax refuses a hyper-parameter "
                       "outside its range, traced or not)")


class _ByIdentity:
  """A schedule as a jit static argument: hashed by identity, so any callable will do."""
  __slots__ = ("fn",)

  def __init__(self, fn):
    self.fn = fn

  def __hash__(self):
    return id(self.fn)

  def __eq__(self, other):
    return isinstance(other, _ByIdentity) and other.fn is self.fn

  def __call__(self, count):
    return self.fn(count)


@dataclasses.dataclass(frozen=True)
class _Static:
  """What a jitted update is specialised on (hashable): everything but the arrays."""
  decays: Tuple[bool, ...]
  kernel: Tuple[bool, ...]
  hp: _Hyper  # per hyper-parameter: its Python float, or None when it is an operand
  lr_schedule: Optional[Callable]  # evaluated inside the jitted call, so eager and jit agree
  wd_schedule: Optional[Callable]
  nesterov: bool
  mu_dtype: Any
  threads: int
  state_memory: Optional[str] = None  # "pinned_host": kernel leaves' mu/nu live in host memory
  moments: str = "f32"  # "bf16" or "8bit": compressed moments (every leaf on the kernel)
  seed: int = 0  # of their stochastic rounding


def _on_kernel(g, mu, nu, p, decays: bool) -> bool:
  """Whether a leaf runs on the fused kernel (else on optax's own transformations)."""
  f32 = np.dtype(np.float32)
  return (np.dtype(mu.dtype) == f32 and np.dtype(nu.dtype) == f32 and tag_of(g.dtype) is not None
          and (not decays or tag_of(p.dtype) is not None))


def _optax_leaves(s: _Static, hp, gs, mus, nus, ps, decays, count):
  """optax's own arithmetic for the leaves the kernel does not take (exactly optax.adam/adamw)."""
  lr, b1, b2, eps, eps_root, wd = hp
  adam = optax.scale_by_adam(b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=s.mu_dtype, nesterov=s.nesterov)
  u, st = adam.update(list(gs), optax.ScaleByAdamState(count=count, mu=list(mus), nu=list(nus)))
  idx = [i for i, d in enumerate(decays) if d]
  if idx and not (is_static_number(wd) and wd == 0.0):
    dw = optax.add_decayed_weights(wd)
    sub, _ = dw.update([u[i] for i in idx], dw.init(None), [ps[i] for i in idx])
    for i, x in zip(idx, sub):
      u[i] = x
  scale = optax.scale_by_learning_rate((lambda _count: lr) if s.lr_schedule is not None else lr)
  u, _ = scale.update(u, scale.init(None))
  return u, st.mu, st.nu


def _resolve_hp(s: _Static, dynamic, lr_count, wd_count) -> _Hyper:
  """The six hyper-parameters: static floats, schedules evaluated at their counts, the rest
  from `dynamic` in field order."""
  it = iter(dynamic)
  schedules = {"lr": (s.lr_schedule, lr_count), "wd": (s.wd_schedule, wd_count)}
  hp = []
  for field, v in zip(_Hyper._fields, s.hp):
    fn, at = schedules.get(field, (None, None))
    hp.append(v if v is not None else fn(at) if fn is not None else next(it))
  return _Hyper(*hp)


def _f32(x):
  """Exact widening to float32 (None passes)."""
  return x if x is None or x.dtype == jnp.float32 else x.astype(jnp.float32)


def _to_host(leaves):
  """state_memory's route in: each kernel leaf's gradient and param (g, mu, nu, p) go to host
  memory, where the moments stay; 16-bit ones cross in 16 bits (the kernel call widens them)."""
  put = lambda x: None if x is None else jax.device_put(x, jax.memory.Space.Host)
  return [(put(g), m, v, put(p)) for g, m, v, p in leaves]


def _updates_to_device(outs):
  """state_memory's route out: each leaf's update (u, mu, nu) back to device memory."""
  return [(jax.device_put(u, jax.memory.Space.Device), m, v) for u, m, v in outs]


def _flat_update(s: _Static, gs, mus, nus, ps, count, dynamic, lr_count, wd_count):
  """The update of flat leaf lists; jax-traceable (runs under jit)."""
  hp = _resolve_hp(s, dynamic, lr_count, wd_count)
  n = len(gs)
  u, new_mu, new_nu = [None] * n, list(mus), list(nus)
  k_idx = [i for i in range(n) if s.kernel[i]]
  if k_idx:
    leaves = [(gs[i], mus[i], nus[i], ps[i] if s.decays[i] else None) for i in k_idx]
    hp_kernel = hp if any(s.decays) else hp._replace(wd=0.0)
    call = lambda count, hp_kernel, leaves, per_shard=True: _xla.adam_update(
        count, hp_kernel, [(_f32(g), m, v, _f32(p)) for g, m, v, p in leaves], nesterov=s.nesterov,
        threads=s.threads, per_shard=per_shard)
    if s.state_memory is None:
      outs = call(count, hp_kernel, leaves)
    else:  # the moments stay in host memory: the gradients come to them, the updates go back
      # hp_kernel is closed over: its Python floats stay static attributes (as jit arguments they
      # would become float32 operands and change the bits).
      outs = compute_on("device_host")(jax.jit(lambda c, lv: call(c, hp_kernel, lv, False)))(count, _to_host(leaves))
      outs = _updates_to_device(outs)
    for i, (ui, mi, vi) in zip(k_idx, outs):
      u[i], new_mu[i], new_nu[i] = ui, mi, vi
  o_idx = [i for i in range(n) if not s.kernel[i]]
  if o_idx:
    pick = lambda xs: [xs[i] for i in o_idx] if xs is not None else None
    ou, om, on = _optax_leaves(s, hp, pick(gs), pick(mus), pick(nus), [ps[i] if ps is not None else None for i in o_idx],
                               [s.decays[i] for i in o_idx], count)
    for j, i in enumerate(o_idx):
      u[i], new_mu[i], new_nu[i] = ou[j], om[j], on[j]
  return u, new_mu, new_nu


_flat_update_jit = jax.jit(_flat_update, static_argnums=0)


def _blocks(x) -> int:
  """A leaf's 32-element blocks of 8-bit moments."""
  return _moments.q8_blocks(np.size(x))


def _check_exponents(scales, g_leaves) -> None:
  """A known 8-bit state's exponent bytes against those the encoder writes (as core load and
  the jax/torch load_state_dict check them): any other byte (a corrupt or foreign state)
  would decode as NaN forever after. Refused naming the leaf and its block; a traced state
  is checked by the FFI handler, by the same rule."""
  pairs = np.asarray(scales)
  try:
    _moments.check_q8_scales(pairs, "state[0].scales")
  except ValueError:
    at = 0
    for i, g in enumerate(g_leaves):  # the first bad byte, named by its leaf
      b = _blocks(g)
      _moments.check_q8_scales(pairs[at:at + b], f"state[0].scales, leaf {i} (updates[{i}]; its rows {at}..{at + b - 1})")
      at += b
    raise


def _compressed_flat_update(s: _Static, gs, mus, nus, scales, ps, count, dynamic, lr_count, wd_count):
  """The update over compressed moments (every leaf on the kernel); jax-traceable."""
  hp = _resolve_hp(s, dynamic, lr_count, wd_count)
  # Gradients as they are (the update takes their dtype); params widened for the decay term.
  leaves = [(g, m, v, p if d else None) for g, m, v, p, d in zip(gs, mus, nus, ps, s.decays)]
  hp_kernel = hp if any(s.decays) else hp._replace(wd=0.0)
  call = lambda count, leaves, scales, per_shard=True: _xla.adam_update_compressed(
      count, hp_kernel, [(g, m, v, _f32(p)) for g, m, v, p in leaves], scales, moments=s.moments, seed=s.seed,
      nesterov=s.nesterov, threads=s.threads, per_shard=per_shard)
  if s.state_memory is None:
    outs, new_scales = call(count, leaves, scales)
  else:  # as _flat_update: the codes stay in host memory, the gradients come, the updates go back
    outs, new_scales = compute_on("device_host")(jax.jit(lambda c, lv, sc: call(c, lv, sc, False)))(
        count, _to_host(leaves), scales)
    outs = _updates_to_device(outs)
  u, m, v = (list(col) for col in zip(*outs)) if outs else ([], [], [])
  return u, m, v, new_scales


_compressed_flat_update_jit = jax.jit(_compressed_flat_update, static_argnums=0)
_call_jit = jax.jit(lambda f, x: f(x), static_argnums=0)


def _numpy_update(s: _Static, hp, gs, mus, nus, ps, count, reuse: bool, dynamic, lr_count, wd_count):
  """The update on numpy leaves: kernel leaves through hostopt._core (mu/nu in place with
  reuse_state), the others through optax's arithmetic, converted back to numpy."""
  t = int(count) + 1 if int(count) < np.iinfo(np.int32).max else int(count)
  n = len(gs)
  u: List[Any] = [None] * n
  new_mu: List[Any] = [None] * n
  new_nu: List[Any] = [None] * n
  k_idx = [i for i in range(n) if s.kernel[i]]
  if k_idx:
    lr, b1, b2, eps, eps_root, wd = (float(np.asarray(v)) for v in hp)
    common: Dict[str, Any] = dict(lr=lr, beta1=b1, beta2=b2, eps=eps, eps_root=eps_root, mode="adamw",
                                  nesterov=s.nesterov)
    configs = [_core.AdamConfig(**common, weight_decay=0.0), _core.AdamConfig(**common, weight_decay=wd)]
    cols: Tuple[List[Any], List[Any], List[Any], List[Any], List[Any], List[Any]] = ([], [], [], [], [], [])
    def work(x):  # the moments, updated in place: the caller's arrays with reuse_state
      x = np.asarray(x)
      if reuse and x.flags.c_contiguous and x.flags.writeable:
        return x, x.reshape(-1)
      w = np.array(x, dtype=np.float32, copy=True)
      return w, w.reshape(-1)
    for i in k_idx:
      g = np.ascontiguousarray(gs[i], dtype=np.float32).reshape(-1)  # exact widening of 16-bit gradients
      new_mu[i], m = work(mus[i])
      new_nu[i], v = work(nus[i])
      p = np.ascontiguousarray(ps[i], dtype=np.float32).reshape(-1) if s.decays[i] else None
      out = np.empty(np.shape(gs[i]), np.float32)
      u[i] = out
      for col, x in zip(cols, (p, m, v, g, out.reshape(-1), 1 if s.decays[i] else 0)):
        col.append(x)
    _core.optax_update_leaves(*cols[:4], "f32", cols[4], configs, cols[5], t, 1.0, s.threads)
  o_idx = [i for i in range(n) if not s.kernel[i]]
  if o_idx:  # optax's arithmetic, through the same jitted call as the jax route (the same bits)
    sub = dataclasses.replace(s, decays=tuple(s.decays[i] for i in o_idx), kernel=(False,) * len(o_idx))
    pick = lambda xs: [jnp.asarray(xs[i]) for i in o_idx]
    ou, om, on = _flat_update_jit(sub, pick(gs), pick(mus), pick(nus),
                                  [jnp.asarray(ps[i]) if s.decays[i] else None for i in o_idx], jnp.asarray(count),
                                  dynamic, lr_count, wd_count)
    for j, i in enumerate(o_idx):
      u[i], new_mu[i], new_nu[i] = np.asarray(ou[j]), np.asarray(om[j]), np.asarray(on[j])
  return u, new_mu, new_nu


def _schedule_counts(state, lr_schedule, wd_schedule):
  """The counts optax's state keeps for the learning-rate and weight-decay schedules (None
  for a number): the last element's count, and WeightDecaySchedule's (masked or not)."""
  lr_count = state[-1].count if lr_schedule is not None else None
  wd_count = None
  if wd_schedule is not None:
    wd_leaves = jax.tree_util.tree_leaves(state[1])
    if not wd_leaves:
      raise TypeError(f"weight_decay is a schedule, but optax {optax.__version__}'s adamw keeps no count for it "
                      "(this optax takes a number)")
    wd_count = wd_leaves[0]
  return lr_count, wd_count


def _place(x, kind: str, uncommitted_to=None):
  """A jax array in memory `kind` of its devices (traced arrays, placed by the caller's
  jit(init) out_shardings, and numpy arrays as they are). An uncommitted array (from numpy
  or scalar params) goes to `uncommitted_to` (_replicated_like), where it cannot clash with
  the other leaves' devices under jit."""
  if isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array):
    return x
  if not x.committed and uncommitted_to is not None:
    x = jax.device_put(x, uncommitted_to)
  kinds = {m.kind for d in x.sharding.device_set for m in d.addressable_memories()}
  if kind not in kinds:
    raise ValueError(f"state_memory={kind!r}: the params' devices have memories {sorted(kinds)}")
  return jax.device_put(x, x.sharding.with_memory_kind(kind))


def _place_moments(adam_state, params, kind: str):
  """mu and nu of the leaves the kernel takes (both float32, params of a kernel dtype), in
  memory `kind` of their devices; the others stay where optax's arithmetic runs on them."""
  leaves, treedef = jax.tree_util.tree_flatten(params)
  mus, nus = treedef.flatten_up_to(adam_state.mu), treedef.flatten_up_to(adam_state.nu)
  target = _replicated_like(leaves)
  f32 = np.dtype(np.float32)
  for i, p in enumerate(leaves):
    if (np.dtype(mus[i].dtype) == f32 and np.dtype(nus[i].dtype) == f32 and hasattr(p, "dtype")
        and tag_of(p.dtype) is not None):
      mus[i], nus[i] = _place(mus[i], kind, target), _place(nus[i], kind, target)
  return adam_state._replace(mu=treedef.unflatten(mus), nu=treedef.unflatten(nus))


def _replicated_like(leaves):
  """A replicated sharding over the devices of the concrete jax leaf on the most devices, in
  its own device order (jit compares device assignments in order); None without one."""
  concrete = [x for x in leaves if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)]
  if not concrete:
    return None
  sharding = max(concrete, key=lambda x: len(x.sharding.device_set)).sharding
  if isinstance(sharding, jax.sharding.NamedSharding):
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
  if len(sharding.device_set) == 1:
    return jax.sharding.SingleDeviceSharding(next(iter(sharding.device_set)))
  # Other multi-device shardings: their own device order where jax exposes it.
  devices = getattr(sharding, "_device_assignment", None) or sorted(sharding.device_set, key=lambda d: d.id)
  return jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(devices), ("devices",)), jax.sharding.PartitionSpec())


def _check_in_memory(arrays, names, kind: str):
  """state_memory: the state's arrays must be in memory `kind` (a state made by jit(init)
  without out_shardings there, or moved since, would run the host kernel on device memory).
  Traced arrays carry their memory space in their aval."""
  host = getattr(getattr(jax, "memory", None), "Space", None)
  for name, x in zip(names, arrays):
    got = None
    if isinstance(x, jax.core.Tracer):
      space = getattr(getattr(x, "aval", None), "memory_space", None)
      if host is not None and space == host.Device:
        got = "device"
    elif isinstance(x, jax.Array):
      got = x.sharding.memory_kind
    elif isinstance(x, np.ndarray):  # beside jax arrays it would go to device memory
      got = "numpy"
    if got is not None and got != kind:
      where = "a numpy array" if got == "numpy" else f"in {got!r} memory"
      raise ValueError(f"state_memory={kind!r}: {name} is {where}; make the state with this "
                       f"transformation's init (outside jit, or jit(init) with out_shardings in {kind!r})")


def _not_tracing() -> bool:
  try:
    from jax._src import core as jax_core
    return bool(jax_core.trace_state_clean())
  except (ImportError, AttributeError):  # pragma: no cover - a jax without it: decide by the inputs alone
    return True


def _backend_is_cpu() -> bool:
  if jax.default_backend() == "cpu":
    return True
  global _warned_backend
  if not _warned_backend:
    _warned_backend = True
    warnings.warn(f"hostopt.optax: the arrays are on {jax.default_backend()}; hostopt's kernel runs on the host, so "
                  "this update runs optax's arithmetic there. Make the transformation with "
                  "state_memory='pinned_host' to keep mu/nu in host memory and update them on the host.")
  return False


_warned_backend = False


def _make(args: dict, decoupled: bool) -> optax.GradientTransformationExtraArgs:
  options = dict(_HOSTOPT_OPTIONS)
  extra = args.pop("hostopt_options")
  unknown = set(extra) - set(options)
  if unknown:
    raise TypeError(f"unexpected keyword argument(s) {sorted(unknown)}: hostopt's own options are "
                    f"{sorted(options)}, the others are optax's")
  options.update(extra)
  threads, reuse_state, state_memory = options["threads"], options["reuse_state"], options["state_memory"]
  try:
    moments = _core.moment_format(str(options["moments"]))
  except ValueError as e:
    raise ValueError(f"moments: {e}") from None
  seed = check_seed(options["rounding_seed"], "rounding_seed")
  if not isinstance(reuse_state, (bool, np.bool_)):  # (bool("no") is True: never taken for one)
    raise TypeError(f"reuse_state = {reuse_state!r}: expected True or False")
  reuse_state = bool(reuse_state)
  if state_memory not in (None, "pinned_host"):
    raise ValueError(f"state_memory = {state_memory!r}: expected None (the params' memory, as optax) or "
                     "'pinned_host'")
  if state_memory is not None and not hasattr(jax, "memory"):
    raise ValueError(f"state_memory='pinned_host' needs a jax with memory spaces (jax.memory); this is "
                     f"jax {jax.__version__}")
  if (not isinstance(threads, (int, np.integer)) or isinstance(threads, bool) or not
      0 <= threads <= _core.max_threads()):
    raise ValueError(f"threads = {threads!r}: expected an int in [0, {_core.max_threads()}] (0 = the threading "
                     "runtime's default)")
  name = "adamw" if decoupled else "adam"
  reference_fn = _OPTAX[name]
  reference = reference_fn(**args)
  learning_rate, b1, b2, eps, eps_root = (args[k] for k in ("learning_rate", "b1", "b2", "eps", "eps_root"))
  weight_decay = args.get("weight_decay", 0.0) if decoupled else 0.0
  mask = args.get("mask") if decoupled else None
  mu_dtype, nesterov = args.get("mu_dtype"), bool(args.get("nesterov", False))
  lr_schedule = _ByIdentity(learning_rate) if callable(learning_rate) else None
  wd_schedule = _ByIdentity(weight_decay) if callable(weight_decay) else None
  for key, value in args.items():  # arguments of a newer optax that this front does not implement
    if key not in _KNOWN and value is not inspect.signature(reference_fn).parameters[key].default:
      raise NotImplementedError(f"hostopt.optax.{name}: argument {key}={value!r} of optax {optax.__version__} is "
                                "not supported")
  _check_hyperparameters((learning_rate, b1, b2, eps, eps_root, weight_decay))  # the known ones, at once

  if moments != "f32":
    clash = [k for k, v in (("mu_dtype", mu_dtype), ("reuse_state", reuse_state)) if v not in (None, False)]
    if clash:
      raise ValueError(f"moments={moments!r} with {clash[0]}: compressed moments live on the host kernel in their "
                       "own format (mu_dtype and reuse_state apply to optax's float moments)")
    return _compressed_transformation(reference, moments, seed, decoupled, learning_rate, b1, b2, eps, eps_root,
                                      weight_decay, mask, nesterov, lr_schedule, wd_schedule, int(threads),
                                      state_memory)

  def init_fn(params):
    state = reference.init(params)
    leaves = jax.tree_util.tree_leaves(params)
    if leaves and all(isinstance(x, np.ndarray) for x in leaves):  # numpy in, numpy out
      state = jax.tree_util.tree_map(lambda x: np.asarray(x).copy(), state)
    elif state_memory is not None:
      state = (_place_moments(state[0], params, state_memory),) + tuple(state[1:])
    return state

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args  # optax's extra-args protocol: unused here
    adam_state = state[0]
    if isinstance(adam_state, ScaleByAdam8bitState):
      raise TypeError("state[0] is a ScaleByAdam8bitState (8-bit moments): this transformation keeps float moments "
                      "(optax's ScaleByAdamState); make it with moments='8bit', or start from its own init")
    count = adam_state.count
    g_leaves, treedef = jax.tree_util.tree_flatten(updates)
    g_leaves = [x if hasattr(x, "dtype") else jnp.asarray(x) for x in g_leaves]  # Python scalars, as optax
    mu_leaves = treedef.flatten_up_to(adam_state.mu)
    nu_leaves = treedef.flatten_up_to(adam_state.nu)
    p_leaves = treedef.flatten_up_to(params) if params is not None else None
    if p_leaves is not None:  # Python scalars, as optax takes them
      p_leaves = [x if x is None or hasattr(x, "dtype") else jnp.asarray(x) for x in p_leaves]
    n = len(g_leaves)
    for i, g in enumerate(g_leaves):  # optax's contract: mu, nu (and params) have the update's shape
      for nm, leaves in (("mu", mu_leaves), ("nu", nu_leaves), ("params", p_leaves)):
        if leaves is not None and leaves[i] is not None and tuple(np.shape(leaves[i])) != tuple(np.shape(g)):
          raise ValueError(f"{nm}[{i}] has shape {tuple(np.shape(leaves[i]))}: expected {tuple(np.shape(g))} like "
                           f"updates[{i}] (mu, nu and params must have the shape of the updates)")
    lr_count, wd_count = _schedule_counts(state, lr_schedule, wd_schedule)
    # numpy in, numpy out — unless a jax transformation is tracing us (lax.cond inside
    # optax.apply_if_finite, a jit): then the work must be staged, not run at trace time.
    numpy_route = (_not_tracing() and isinstance(count, np.ndarray) and
                   all(isinstance(x, np.ndarray) for x in list(g_leaves) + list(mu_leaves) + list(nu_leaves)) and
                   not any(_is_traced(v) for v in (learning_rate, b1, b2, eps, eps_root, weight_decay)))
    lr, wd = learning_rate, weight_decay
    if numpy_route:  # schedules evaluated by XLA, as inside the jitted call of the jax route
      lr = _call_jit(lr_schedule, jnp.asarray(lr_count)) if lr_schedule is not None else lr
      wd = _call_jit(wd_schedule, jnp.asarray(wd_count)) if wd_schedule is not None else wd
    no_decay = is_static_number(wd) and float(wd) == 0.0 and wd_schedule is None
    decays = [False] * n if (not decoupled or no_decay) else mask_flags(mask, updates, treedef)
    if any(decays) and (p_leaves is None or any(p_leaves[i] is None for i in range(n) if decays[i])):
      raise ValueError("You are using a transformation that requires the current value of parameters, but you are "
                       "not passing `params` when calling `update`.")
    hp = _Hyper(lr, b1, b2, eps, eps_root, wd)
    _check_hyperparameters(hp)
    # The kernel runs on the host: on another backend the moments must be in host memory
    # (state_memory), or optax's arithmetic runs where the arrays are.
    on_host = numpy_route or state_memory is not None or _backend_is_cpu()
    kernel = tuple(on_host and _on_kernel(g_leaves[i], mu_leaves[i], nu_leaves[i], p_leaves[i] if decays[i] else None,
                                          decays[i]) for i in range(n))
    if not numpy_route and state_memory is not None:
      k_idx = [i for i in range(n) if kernel[i]]
      _check_in_memory([mu_leaves[i] for i in k_idx] + [nu_leaves[i] for i in k_idx],
                       [f"mu[{i}]" for i in k_idx] + [f"nu[{i}]" for i in k_idx], state_memory)
    # Off the numpy route the schedules' slots are evaluated inside the jitted call.
    static_hp, dynamic = _static_and_dynamic(hp, lr_schedule, wd_schedule, evaluated=numpy_route)
    s = _Static(tuple(decays), kernel, static_hp, lr_schedule, wd_schedule, nesterov, mu_dtype, int(threads),
                state_memory)
    if numpy_route:
      u, new_mu, new_nu = _numpy_update(s, hp, g_leaves, mu_leaves, nu_leaves, p_leaves, count, reuse_state,
                                        dynamic, lr_count, wd_count)
    else:
      if any(kernel) and _xla.available() is not None:
        raise RuntimeError(f"hostopt.optax cannot run on jax arrays: {_xla.available()}")
      ps = [p_leaves[i] if decays[i] else None for i in range(n)]
      # Inside the caller's trace, inline (the FFI call then sees whether its gradients are
      # temporaries of the caller's computation); eager calls run the same code jitted.
      flat_update = _flat_update_jit if _not_tracing() else functools.partial(_flat_update)
      u, new_mu, new_nu = flat_update(s, list(g_leaves), list(mu_leaves), list(nu_leaves), ps, count, dynamic,
                                      lr_count, wd_count)

    keep_numpy = lambda x: np.asarray(x) if numpy_route else x
    new_adam = adam_state._replace(count=keep_numpy(_increment(count)), mu=treedef.unflatten(new_mu),
                                   nu=treedef.unflatten(new_nu))
    # Every other leaf of optax's state (schedule counts, masked or not) is a count.
    rest = jax.tree_util.tree_map(lambda c: keep_numpy(_increment(c)), tuple(state[1:]))
    return treedef.unflatten(u), (new_adam,) + rest

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _compressed_transformation(reference, moments, seed, decoupled, learning_rate, b1, b2, eps, eps_root,
                               weight_decay, mask, nesterov, lr_schedule, wd_schedule, threads,
                               state_memory) -> optax.GradientTransformationExtraArgs:
  """The transformation with compressed moments (see the module docstring)."""
  q8 = moments == "8bit"

  def init_fn(params):
    leaves, treedef = jax.tree_util.tree_flatten(params)
    numpy_in = bool(leaves) and all(isinstance(x, np.ndarray) for x in leaves)
    zeros = np.zeros if numpy_in else jnp.zeros
    # optax's other state (the weight decay's and the schedule's) without building its f32
    # moments: every leaf of it is a count starting at 0 (else, optax's own init).
    shapes = jax.eval_shape(reference.init, params)
    rest = shapes[1:]
    if all(np.shape(x) == () and np.issubdtype(x.dtype, np.integer) for x in jax.tree_util.tree_leaves(rest)):
      rest = jax.tree_util.tree_map(lambda x: zeros((), x.dtype), rest)
    else:  # pragma: no cover - an optax whose other state is not counts
      rest = reference.init(params)[1:]
    count = zeros((), np.int32)
    # Codes like the params (jnp.zeros_like keeps a jax array's sharding, as optax's init).
    like = (lambda x, dt: np.zeros(np.shape(x), dt)) if numpy_in else (lambda x, dt: jnp.zeros_like(x, dtype=dt))
    codes = lambda dt: treedef.unflatten([like(x, dt) for x in leaves])
    if q8:
      scales = zeros((sum(_blocks(x) for x in leaves), 2), np.uint8)
      adam = ScaleByAdam8bitState(count=count, mu_codes=codes(np.uint8), nu_codes=codes(np.uint8), scales=scales)
    else:
      adam = optax.ScaleByAdamState(count=count, mu=codes(jnp.bfloat16), nu=codes(jnp.bfloat16))
    if state_memory is not None and not numpy_in:  # the codes (and scales) in host memory; the count stays
      # Uncommitted codes (of numpy or scalar params) and the one scales array go replicated over
      # the params' devices: committed to one device they would clash with sharded params.
      target = _replicated_like(leaves)
      place = lambda t: jax.tree_util.tree_map(lambda x: _place(x, state_memory, target), t)
      if q8:
        adam = adam._replace(mu_codes=place(adam.mu_codes), nu_codes=place(adam.nu_codes),
                             scales=_place(adam.scales, state_memory, target))
      else:
        adam = adam._replace(mu=place(adam.mu), nu=place(adam.nu))
    return (adam,) + tuple(rest)

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    adam_state = state[0]
    if q8 != isinstance(adam_state, ScaleByAdam8bitState):
      raise TypeError(f"state[0] is a {type(adam_state).__name__}: this transformation keeps its {moments} moments in "
                      f"{'ScaleByAdam8bitState' if q8 else 'ScaleByAdamState with bfloat16 mu and nu'} (made by its "
                      "init); a state of another format is not converted")
    count = adam_state.count
    g_leaves, treedef = jax.tree_util.tree_flatten(updates)
    g_leaves = [x if hasattr(x, "dtype") else jnp.asarray(x) for x in g_leaves]
    if q8:
      mu_leaves, nu_leaves = treedef.flatten_up_to(adam_state.mu_codes), treedef.flatten_up_to(adam_state.nu_codes)
      scales = adam_state.scales
      want = (sum(_blocks(g) for g in g_leaves), 2)
      if not hasattr(scales, "dtype") or np.dtype(scales.dtype) != np.uint8 or tuple(np.shape(scales)) != want:
        raise ValueError(f"scales: " + (f"{scales.dtype} {tuple(np.shape(scales))}" if hasattr(scales, "dtype")
                                        else type(scales).__name__) +
                         f", expected uint8 {want} (every leaf's 32-element blocks, in leaf order)")
    else:
      mu_leaves, nu_leaves = treedef.flatten_up_to(adam_state.mu), treedef.flatten_up_to(adam_state.nu)
      scales = None
    p_leaves = treedef.flatten_up_to(params) if params is not None else None
    if p_leaves is not None:  # Python scalars, as optax takes them
      p_leaves = [x if x is None or hasattr(x, "dtype") else jnp.asarray(x) for x in p_leaves]
    code_dtype = np.dtype(np.uint8) if q8 else np.dtype(jnp.bfloat16)
    for i, g in enumerate(g_leaves):
      if tag_of(g.dtype) is None:
        raise TypeError(f"updates[{i}]: dtype {g.dtype}; with {moments} moments every leaf runs on hostopt's kernel, "
                        "which takes float32, bfloat16 or float16 gradients")
      for nm, x in (("mu", mu_leaves[i]), ("nu", nu_leaves[i])):
        if np.dtype(x.dtype) != code_dtype:
          raise TypeError(f"{nm}[{i}]: dtype {x.dtype}, expected {code_dtype}: this transformation keeps {moments} "
                          "moments; a state of another format is not converted")
        if tuple(np.shape(x)) != tuple(np.shape(g)):
          raise ValueError(f"{nm}[{i}] has shape {tuple(np.shape(x))}: expected {tuple(np.shape(g))} like updates[{i}]")
      if p_leaves is not None and p_leaves[i] is not None and tuple(np.shape(p_leaves[i])) != tuple(np.shape(g)):
        raise ValueError(f"params[{i}] has shape {tuple(np.shape(p_leaves[i]))}: expected {tuple(np.shape(g))} like "
                         f"updates[{i}] (mu, nu and params must have the shape of the updates)")
    if q8 and not _is_traced(scales):
      _check_exponents(scales, g_leaves)
    lr_count, wd_count = _schedule_counts(state, lr_schedule, wd_schedule)
    arrays = list(g_leaves) + list(mu_leaves) + list(nu_leaves) + ([scales] if q8 else [])
    numpy_route = (_not_tracing() and isinstance(count, np.ndarray) and all(isinstance(x, np.ndarray) for x in arrays))
    if not numpy_route and jax.default_backend() != "cpu" and state_memory is None:
      raise ValueError(f"hostopt.optax with {moments} moments runs on the host kernel: the arrays are on "
                       f"{jax.default_backend()}; make the transformation with state_memory='pinned_host' to keep "
                       "the moments in host memory and update them there")
    if not numpy_route and state_memory is not None:
      field = "_codes" if q8 else ""
      _check_in_memory(list(mu_leaves) + list(nu_leaves) + ([scales] if q8 else []),
                       [f"mu{field}[{i}]" for i in range(len(mu_leaves))] +
                       [f"nu{field}[{i}]" for i in range(len(nu_leaves))] + ["scales"], state_memory)
    if _xla.available() is not None:
      raise RuntimeError(f"hostopt.optax cannot run: {_xla.available()}")
    no_decay = is_static_number(weight_decay) and float(weight_decay) == 0.0 and wd_schedule is None
    n = len(g_leaves)
    decays = [False] * n if (not decoupled or no_decay) else mask_flags(mask, updates, treedef)
    if any(decays) and (p_leaves is None or any(p_leaves[i] is None for i in range(n) if decays[i])):
      raise ValueError("You are using a transformation that requires the current value of parameters, but you are "
                       "not passing `params` when calling `update`.")
    for i in range(n):
      if decays[i] and tag_of(p_leaves[i].dtype) is None:
        raise TypeError(f"params[{i}]: dtype {p_leaves[i].dtype}; expected float32, bfloat16 or float16")
    hp = _Hyper(learning_rate, b1, b2, eps, eps_root, weight_decay)
    if numpy_route:  # the schedules' values too, as the f32 numpy route checks them (refused before anything changes)
      _check_hyperparameters(_Hyper(
          lr=_call_jit(lr_schedule, jnp.asarray(lr_count)) if lr_schedule is not None else None,
          b1=None, b2=None, eps=None, eps_root=None,
          wd=_call_jit(wd_schedule, jnp.asarray(wd_count)) if wd_schedule is not None else None))
    _check_hyperparameters(hp)
    static_hp, dynamic = _static_and_dynamic(hp, lr_schedule, wd_schedule, evaluated=False)
    s = _Static(tuple(decays), (True,) * n, static_hp, lr_schedule, wd_schedule, nesterov, None, threads,
                None if numpy_route else state_memory, moments, seed)
    ps = [p_leaves[i] if decays[i] else None for i in range(n)]
    if numpy_route:  # the same jitted call on copies on the host's device (whatever the default), as numpy
      # np.asarray first: params may be jax arrays committed to an accelerator.
      j = lambda xs: [None if x is None else jnp.asarray(np.asarray(x)) for x in xs]
      try:
        cpu = jax.devices("cpu")[0]
      except RuntimeError as e:
        raise RuntimeError(f"hostopt.optax with {moments} moments runs numpy inputs on jax's CPU backend, which "
                           f"this process has not enabled (JAX_PLATFORMS): {e}") from None
      # Hyper-parameters given as arrays on an accelerator come to the host with the rest.
      dynamic = [np.asarray(v) if isinstance(v, jax.Array) else v for v in dynamic]
      with jax.default_device(cpu):
        outs = _compressed_flat_update_jit(s, j(g_leaves), j(mu_leaves), j(nu_leaves),
                                           None if scales is None else jnp.asarray(scales), j(ps), jnp.asarray(count),
                                           dynamic, lr_count, wd_count)
      outs = [[np.asarray(x) for x in col] for col in outs[:3]] + [None if outs[3] is None else np.asarray(outs[3])]
    else:
      flat_update = _compressed_flat_update_jit if _not_tracing() else functools.partial(_compressed_flat_update)
      outs = flat_update(s, list(g_leaves), list(mu_leaves), list(nu_leaves), scales, ps, count, dynamic, lr_count,
                         wd_count)
    u, new_mu, new_nu, new_sc = outs
    keep_numpy = lambda x: np.asarray(x) if numpy_route else x
    new_count = keep_numpy(_increment(count))
    if q8:
      new_adam = ScaleByAdam8bitState(count=new_count, mu_codes=treedef.unflatten(new_mu),
                                      nu_codes=treedef.unflatten(new_nu), scales=new_sc)
      if not _is_traced(new_sc) and not _is_traced(new_count):  # eager: 2 bytes per 32 parameters read back
        _report_blocks(_BLOCKS_TOLD, type("_Counts", (), {"step": int(new_count), "poisoned_blocks": poisoned_blocks(new_adam),
                                                   "saturated_blocks": 0})(), "hostopt.optax")
    else:
      new_adam = adam_state._replace(count=new_count, mu=treedef.unflatten(new_mu), nu=treedef.unflatten(new_nu))
    rest = jax.tree_util.tree_map(lambda c: keep_numpy(_increment(c)), tuple(state[1:]))
    return treedef.unflatten(u), (new_adam,) + rest

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class HostoptOptions(TypedDict, total=False):
  """hostopt's own options of hostopt.optax's factories, every one optional.

  They are keyword arguments collected apart from optax's, in ``**hostopt_options`` (whose
  annotation is ``Unpack[HostoptOptions]``), so that ``optax.inject_hyperparams`` never
  takes them for hyper-parameters: an explicit ``threads: int = 0`` parameter would be
  injected as a traced array, and the state's ``hyperparams`` would no longer be optax's.

  Attributes:
    threads (int): worker threads of the kernel; 0 (the default) is the threading runtime's
      default, at most ``hostopt._core.max_threads()``.
    reuse_state (bool): numpy states only: mu and nu are updated in place, in the caller's
      arrays, saving two copies per step (default False).
    state_memory (str or None): None (the default: the state in the params' memory, as
      optax) or ``"pinned_host"`` (the kernel leaves' moments in the devices' pinned host
      memory, updated on the host).
    moments (str): ``"f32"`` (the default; ``"8bit"`` in adamw_8bit), ``"bf16"`` or
      ``"8bit"``: how Adam's moments are stored.
    rounding_seed (int): the key of the compressed moments' stochastic rounding, in
      ``[0, 2**64)`` (default 0).
  """
  threads: int
  reuse_state: bool
  state_memory: Optional[str]
  moments: str
  rounding_seed: int


# What each of optax's arguments means here, and its type where it is a plain one (the
# docstrings' "name (type, default value)" form, as hostopt.torch's; the signature carries
# optax's own annotations). An argument of a newer optax gets _OTHER_ARG.
_OPTAX_ARGS = {
    "learning_rate": (None, r"the learning rate :math:`\eta_t`: a number, a scalar array or a schedule (a "
                            "callable of the step count, evaluated by XLA inside the update). Finite, of either "
                            "sign (as optax), else ValueError."),
    "b1": ("float", r":math:`\beta_1`, the decay rate of the first moment, in ``[0, 1)``, else ValueError."),
    "b2": ("float", r":math:`\beta_2`, the decay rate of the second moment, in ``[0, 1)``, else ValueError."),
    "eps": ("float", r":math:`\epsilon`, added to the denominator outside the square root. ``>= 0`` (``+inf`` "
                     "included: Adam's term is then 0, as in optax), else ValueError."),
    "eps_root": ("float", r":math:`\epsilon_{root}`, added to :math:`\hat v_t` inside the square root. ``>= 0`` "
                          "(``+inf`` included), else ValueError."),
    "mu_dtype": (None, "the dtype of mu, as optax's: a leaf whose mu is not float32 runs on optax's own "
                       "arithmetic, not the kernel. Refused with compressed moments (ValueError)."),
    "weight_decay": (None, r":math:`\lambda`, the decoupled weight decay rate: a number, or a schedule where the "
                           "installed optax takes one. Finite, of either sign, else ValueError."),
    "mask": (None, "which leaves are decayed, as optax's: a tree of bools like the params (or a prefix of one), "
                   "or a callable of the params that returns one; None decays every leaf."),
    "nesterov": ("bool", r"Nesterov momentum: NAdam's :math:`\hat m_t` (as optax.nadam)."),
}
_OTHER_ARG = (None, "an argument of optax {version} that hostopt.optax does not implement: only its default is "
                    "taken (any other value raises NotImplementedError).")

# hostopt's options as the factories' docstrings list them: (name, type, description).
_HOSTOPT_ARGS = (
    ("threads", "int",
     "worker threads of the kernel: 0 is the threading runtime's default. An int in ``[0, "
     "hostopt._core.max_threads()]``, else ValueError."),
    ("reuse_state", "bool",
     "numpy states only: mu and nu are updated in place, in the caller's arrays (the state passed in is "
     "consumed), saving two copies per step. True or False, else TypeError; refused with compressed moments "
     "(ValueError)."),
    ("state_memory", "str or None",
     "None keeps the state in the params' memory, as optax. ``\"pinned_host\"``: on an accelerator, ``init`` "
     "puts the kernel leaves' float32 mu and nu (or the compressed codes and scales) in the devices' pinned host "
     "memory, where they take no HBM, and ``update`` sends the gradients (and the params, for weight decay) "
     "there, runs the kernel on the host (``compute_on(\"device_host\")``) and returns the updates in device "
     "memory: call ``init`` outside jit, or give ``jit(init)`` out_shardings in that memory. Needs a jax with "
     "memory spaces. Anything else: ValueError."),
    ("moments", "str",
     "how Adam's moments are stored: ``\"f32\"`` (optax's ``ScaleByAdamState``, 8 bytes per parameter), "
     "``\"bf16\"`` (bfloat16 mu and nu, 4 bytes) or ``\"8bit\"`` (``ScaleByAdam8bitState``: uint8 codes and one "
     "uint8 ``[blocks, 2]`` scales array, 2.06 bytes), stochastically rounded. With compressed moments every "
     "leaf runs on the kernel: float32, bfloat16 or float16 gradients and params, on the CPU or with "
     "``state_memory=\"pinned_host\"``. Another name: ValueError."),
    ("rounding_seed", "int",
     "the key of the compressed moments' stochastic rounding: with the step and the element's index it decides "
     "every rounding, so a run is reproducible. An integer in ``[0, 2**64)``, else ValueError."),
)

_RULE = r"""
  .. math::
    m_t = \beta_1 m_{t-1} + (1-\beta_1)\,g_t, \qquad v_t = \beta_2 v_{t-1} + (1-\beta_2)\,g_t^2,

    <MHAT}, \qquad \hat v_t = \frac{v_t}{1-\beta_2^t},

    u_t = -\eta_t\left(\frac{\hat m_t}{\sqrt{\hat v_t + \epsilon_{root}} + \epsilon}<DECAY}\right)
"""
_MHAT = r"\hat m_t = \frac{m_t}{1-\beta_1^t}"
_MHAT_NESTEROV = r"\hat m_t = \frac{\beta_1 m_t}{1-\beta_1^{t+1}} + \frac{(1-\beta_1)\,g_t}{1-\beta_1^t}"
_TITLES = {"adam": "Adam", "adamw": "AdamW (decoupled weight decay)", "nadam": "NAdam (Adam with Nesterov momentum)",
           "nadamw": "NAdamW (NAdam with decoupled weight decay)"}


def _wrap(text: str, indent: str, hang: str = "  ", width: int = 96) -> str:
  """`text` in lines of at most `width` characters, indented by `indent` (and `hang` after the first)."""
  import textwrap
  return "\n".join(textwrap.wrap(text, width=width, initial_indent=indent, subsequent_indent=indent + hang,
                                 break_on_hyphens=False, break_long_words=False))


def _factory_doc(name: str, public_name: str, decoupled: bool, preset: Optional[Dict[str, Any]],
                 sig: inspect.Signature) -> str:
  """The Google-style docstring of one of hostopt.optax's factories, for the installed optax's
  signature `sig` (its arguments and defaults, read at import)."""
  nesterov = sig.parameters.get("nesterov")
  nesterov_default = bool(nesterov.default) if nesterov is not None else False
  title = _TITLES[name] + (" with " + ", ".join(f"{k}={v!r}" for k, v in preset.items()) if preset else "")
  lines = [f"{title} as optax.{name}, on hostopt's fused CPU kernels.", "",
           _wrap(f"The arguments, defaults, " + ("mask semantics " if decoupled else "") + "and state are the "
                 f"installed optax's (optax "
                 f"{optax.__version__}: the signature is optax.{name}'s, read at import); hostopt's own options "
                 "are keyword arguments collected apart, in ``**hostopt_options`` (:class:`HostoptOptions`), so "
                 "that ``optax.inject_hyperparams`` never takes them for hyper-parameters. With the count "
                 ":math:`t` starting at 1:", "  ", ""),
           _RULE.replace("<MHAT}", _MHAT_NESTEROV if nesterov_default else _MHAT)
           .replace("<DECAY}", r" + \lambda\,p_{t-1}" if decoupled else "").rstrip("\n"), ""]
  where = r"with :math:`\eta_t` the learning rate" + (r" and :math:`\lambda` the weight decay (masked)"
                                                       if decoupled else "") + "."
  if nesterov is not None:
    where += (r" With nesterov=False, :math:`\hat m_t = m_t/(1-\beta_1^t)`." if nesterov_default else
              r" With nesterov=True, :math:`\hat m_t` is NAdam's (as hostopt.optax.nadam).")
  where += (" The module docstring says which leaves run on the kernel (the others run optax's own "
            "arithmetic) and what the compressed states hold.")
  lines += [_wrap(where, "  ", ""), "", "  Args:"]
  for p in sig.parameters.values():
    if p.kind is inspect.Parameter.VAR_KEYWORD:
      continue
    kind, text = _OPTAX_ARGS.get(p.name, (_OTHER_ARG[0], _OTHER_ARG[1].format(version=optax.__version__)))
    if p.default is inspect.Parameter.empty:
      head = p.name
    elif kind is not None:
      head = f"{p.name} ({kind}, default {p.default!r})"
    else:
      head, text = p.name, f"{text} Default: {p.default!r}."
    lines.append(_wrap(f"{head}: {text}", "    "))
  for key, kind, text in _HOSTOPT_ARGS:
    if preset and key in preset:
      head = f"{key} ({kind}, default {preset[key]!r})"
      text = (f"preset: {preset[key]!r} here (another value is a TypeError: use {name}({key}=...)); "
              + text)
    else:
      head = f"{key} ({kind}, default {_HOSTOPT_OPTIONS[key]!r})"
    lines.append(_wrap(f"{head}: hostopt's option, by keyword only; {text}", "    "))
  lines += ["", "  Returns:", _wrap(
      f"An ``optax.GradientTransformationExtraArgs`` (init, update). ``init(params)`` builds the state "
      f"optax.{name} builds for the same call (with compressed moments, the state the module docstring "
      "describes); ``update(updates, state, params=None)`` returns ``(updates, state)``. numpy pytrees in give "
      "numpy out, jax pytrees jax; under ``jax.jit`` the kernel is an XLA FFI custom call.", "    ", "")]
  lines += ["", "  Raises:",
            _wrap("TypeError: a keyword that is neither optax's nor one of hostopt's options" +
                  (", or the preset option given another value" if preset else "") + ".", "    "),
            _wrap("ValueError: a known hyper-parameter outside hostopt's range (b1, b2 in [0, 1); eps, eps_root "
                  ">= 0; learning_rate" + (", weight_decay" if decoupled else "") + " finite), or an option that "
                  "is not one of those above. A traced hyper-parameter is checked by the FFI handler when the "
                  "update runs (jax's runtime error).", "    "),
            _wrap("NotImplementedError: a value other than its default for an argument of a newer optax that "
                  "this front does not implement.", "    ")]
  call = f"{public_name}(1e-3" + (", weight_decay=0.1" if decoupled else "") + ", threads=2)"
  lines += ["", "  Example:",
            "    >>> import jax, jax.numpy as jnp, optax",
            "    >>> import hostopt.optax",
            "    >>> params = {'w': jnp.ones((4, 3)), 'b': jnp.zeros(3)}",
            f"    >>> opt = optax.chain(optax.clip_by_global_norm(1.0),",
            f"    ...                   hostopt.optax.{call})",
            "    >>> state = opt.init(params)",
            "    >>> grads = jax.tree_util.tree_map(jnp.ones_like, params)",
            "    >>> updates, state = jax.jit(opt.update)(grads, state, params)",
            "    >>> params = optax.apply_updates(params, updates)",
            "",
            "    hostopt's options pass through ``optax.inject_hyperparams`` untouched:",
            "",
            f"    >>> ours = optax.inject_hyperparams(hostopt.optax.{public_name})(learning_rate=1e-3, threads=2)",
            f"    >>> theirs = optax.inject_hyperparams(optax.{name})(learning_rate=1e-3)",
            "    >>> sorted(ours.init(params).hyperparams) == sorted(theirs.init(params).hyperparams)",
            "    True",
            ""]
  return "\n".join(lines)


def _mirror(name: str, decoupled: bool, nesterov_default: Optional[bool] = None, preset: Optional[dict] = None,
            public_name: Optional[str] = None) -> Callable[..., optax.GradientTransformationExtraArgs]:
  """hostopt's `name` with the installed optax's signature, plus **hostopt_options.

  The signature (``__signature__``, which help(), inspect.signature() and
  optax.inject_hyperparams read) is optax's parameters followed by
  ``**hostopt_options: Unpack[HostoptOptions]``: hostopt's options cannot be explicit
  keyword parameters there, since inject_hyperparams would inject the numeric ones (threads,
  rounding_seed) as traced arrays. The docstring lists each of them (_factory_doc)."""
  ref = inspect.signature(getattr(optax, name))
  params = [p for p in ref.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
  # A string annotation (PEP 692's form): typing.Unpack is Python 3.11's, and its repr there
  # hides the TypedDict's name.
  params.append(inspect.Parameter("hostopt_options", inspect.Parameter.VAR_KEYWORD,
                                  annotation="typing.Unpack[HostoptOptions]"))
  sig = ref.replace(parameters=params, return_annotation=optax.GradientTransformationExtraArgs)

  def factory(*args, **kwargs):
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    options = dict(arguments.get("hostopt_options", {}))
    # optax.inject_hyperparams re-binds the arguments and passes the collected options back
    # as one keyword, hostopt_options={...}: unfold it.
    nested = options.pop("hostopt_options", {})
    given = {**nested, **options} if isinstance(nested, dict) else options
    for key, value in (preset or {}).items():
      if key in given and given[key] != value:
        raise TypeError(f"{public_name or name}: {key} is {value!r} here (use {name}({key}=...) for another)")
    arguments["hostopt_options"] = {**(preset or {}), **given}
    return _make(arguments, decoupled)

  factory.__signature__ = sig  # type: ignore[attr-defined]
  factory.__name__ = factory.__qualname__ = public_name or name
  factory.__doc__ = _factory_doc(name, public_name or name, decoupled, preset, sig)
  return factory


adam = _mirror("adam", decoupled=False)
adamw = _mirror("adamw", decoupled=True)
adamw_8bit = _mirror("adamw", decoupled=True, preset={"moments": "8bit"}, public_name="adamw_8bit")
nadam = _mirror("nadam", decoupled=False)
nadamw = _mirror("nadamw", decoupled=True)
