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
  and nu updated in place: donate the state (``jax.jit(..., donate_argnums=...)``) and no
  full-size copy is made. 16-bit gradients are widened to float32 first, as optax's own
  arithmetic does (the update is float32, like optax's);
- every other leaf — float64 (under ``jax_enable_x64``), complex (nu from :math:`|g|^2`),
  16-bit moments (``mu_dtype`` or 16-bit params) — runs optax's own ``scale_by_adam``,
  ``add_decayed_weights`` and ``scale_by_learning_rate`` on it: optax's results and dtypes
  exactly, never a cast.

Hyper-parameters may be Python numbers (passed to the kernel as float64 attributes),
arrays or schedules (passed as traced scalars; ``weight_decay`` may be a schedule where
optax accepts one); eager and jitted calls give the same bits. ``vmap`` works;
differentiating through ``update`` raises (the kernel has no derivative rule: use optax
itself for meta-gradients).

hostopt's own options are keyword arguments collected apart from optax's, so that
``optax.inject_hyperparams`` never mistakes them for hyper-parameters:
``threads`` (worker threads, 0 = the runtime's default) and ``reuse_state`` (numpy states
only: mu and nu are updated in place, saving two copies per step). Inputs may be numpy or
jax pytrees; outputs are of the same kind.

Example:
  >>> import optax, hostopt.optax
  >>> opt = optax.chain(optax.clip_by_global_norm(1.0), hostopt.optax.adamw(1e-3, weight_decay=0.1))
  >>> state = opt.init(params)
  >>> step = jax.jit(lambda g, s, p: opt.update(g, s, p), donate_argnums=1)
  >>> updates, state = step(grads, state, params)
  >>> params = optax.apply_updates(params, updates)
"""

import dataclasses
import functools
import inspect
from typing import Any, Callable, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from . import _core, _xla
from ._arrays import as_buffer

__all__ = ["adam", "adamw", "nadam", "nadamw"]

_HOSTOPT_OPTIONS = {"threads": 0, "reuse_state": False}
_KNOWN = ("learning_rate", "b1", "b2", "eps", "eps_root", "mu_dtype", "weight_decay", "mask", "nesterov")
_KERNEL_INPUT = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(jnp.bfloat16))
# optax's own functions, taken at import (a test may put hostopt's in their place).
_OPTAX = {name: getattr(optax, name) for name in ("adam", "adamw")}
_increment = getattr(optax, "safe_increment", None) or optax.safe_int32_increment


def _is_traced(x) -> bool:
  return isinstance(x, jax.core.Tracer)


def _is_number(x) -> bool:
  return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class _Static:
  """What a jitted update is specialised on (hashable): everything but the arrays."""
  decays: Tuple[bool, ...]
  kernel: Tuple[bool, ...]
  hp: Tuple[Any, ...]  # per hyper-parameter: its Python float, or None when it is an operand
  lr_schedule: Optional[Callable]  # evaluated inside the jitted call, so eager and jit agree
  wd_schedule: Optional[Callable]
  nesterov: bool
  mu_dtype: Any
  threads: int


def _on_kernel(g, mu, nu, p, decays: bool) -> bool:
  """Whether a leaf runs on the fused kernel (else on optax's own transformations)."""
  f32 = np.dtype(np.float32)
  return (np.dtype(mu.dtype) == f32 and np.dtype(nu.dtype) == f32 and np.dtype(g.dtype) in _KERNEL_INPUT
          and (not decays or np.dtype(p.dtype) in _KERNEL_INPUT))


def _optax_leaves(s: _Static, hp, gs, mus, nus, ps, decays, count):
  """optax's own arithmetic for the leaves the kernel does not take (exactly optax.adam/adamw)."""
  lr, b1, b2, eps, eps_root, wd = hp
  adam = optax.scale_by_adam(b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=s.mu_dtype, nesterov=s.nesterov)
  u, st = adam.update(list(gs), optax.ScaleByAdamState(count=count, mu=list(mus), nu=list(nus)))
  idx = [i for i, d in enumerate(decays) if d]
  if idx and not (_is_number(wd) and wd == 0.0):
    dw = optax.add_decayed_weights(wd)
    sub, _ = dw.update([u[i] for i in idx], dw.init(None), [ps[i] for i in idx])
    for i, x in zip(idx, sub):
      u[i] = x
  scale = optax.scale_by_learning_rate((lambda _count: lr) if s.lr_schedule is not None else lr)
  u, _ = scale.update(u, scale.init(None))
  return u, st.mu, st.nu


def _flat_update(s: _Static, gs, mus, nus, ps, count, dynamic, lr_count, wd_count):
  """The update of flat leaf lists; jax-traceable (runs under jit)."""
  it = iter(dynamic)
  hp = list(v if v is not None else next(it, None) for v in s.hp)
  if s.lr_schedule is not None:
    hp[0] = s.lr_schedule(lr_count)
  if s.wd_schedule is not None:
    hp[5] = s.wd_schedule(wd_count)
  hp = tuple(hp)
  n = len(gs)
  u, new_mu, new_nu = [None] * n, list(mus), list(nus)
  k_idx = [i for i in range(n) if s.kernel[i]]
  if k_idx:
    f32 = lambda x: x if x.dtype == jnp.float32 else x.astype(jnp.float32)  # exact widening
    leaves = [(f32(gs[i]), mus[i], nus[i], f32(ps[i]) if s.decays[i] else None) for i in k_idx]
    hp_kernel = hp if any(s.decays) else hp[:5] + (0.0,)
    for i, (ui, mi, vi) in zip(k_idx, _xla.adam_update(count, hp_kernel, leaves, nesterov=s.nesterov,
                                                        threads=s.threads)):
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
_call_jit = jax.jit(lambda f, x: f(x), static_argnums=0)


def _numpy_update(s: _Static, hp, gs, mus, nus, ps, count, reuse: bool):
  """The update on numpy leaves: kernel leaves through hostopt._core (mu/nu in place with
  reuse_state), the others through optax's arithmetic, converted back to numpy."""
  t = int(count) + 1 if int(count) < np.iinfo(np.int32).max else int(count)
  n = len(gs)
  u, new_mu, new_nu = [None] * n, [None] * n, [None] * n
  k_idx = [i for i in range(n) if s.kernel[i]]
  if k_idx:
    lr, b1, b2, eps, eps_root, wd = (float(np.asarray(v)) for v in hp)
    common = dict(lr=lr, beta1=b1, beta2=b2, eps=eps, eps_root=eps_root, mode="adamw", nesterov=s.nesterov)
    configs = [_core.AdamConfig(**common, weight_decay=0.0), _core.AdamConfig(**common, weight_decay=wd)]
    cols = ([], [], [], [], [], [])
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
  if o_idx:
    pick = lambda xs: [jnp.asarray(xs[i]) for i in o_idx]
    ou, om, on = _optax_leaves(s, hp, pick(gs), pick(mus), pick(nus),
                               [jnp.asarray(ps[i]) if s.decays[i] else None for i in o_idx],
                               [s.decays[i] for i in o_idx], jnp.asarray(count))
    for j, i in enumerate(o_idx):
      u[i], new_mu[i], new_nu[i] = np.asarray(ou[j]), np.asarray(om[j]), np.asarray(on[j])
  return u, new_mu, new_nu


def _decay_mask(mask, updates, treedef, n: int):
  """optax.masked's reading of a mask: a callable gets the updates (as optax.masked calls
  it in update), a tree may be a prefix of the updates' tree."""
  if mask is None:
    return [True] * n
  tree = mask(updates) if callable(mask) else mask
  full = jax.tree_util.tree_map(lambda m, sub: jax.tree_util.tree_map(lambda _: bool(m), sub), tree, updates)
  return [bool(x) for x in treedef.flatten_up_to(full)]


def _make(args: dict, decoupled: bool) -> optax.GradientTransformationExtraArgs:
  options = dict(_HOSTOPT_OPTIONS)
  extra = args.pop("hostopt_options")
  unknown = set(extra) - set(options)
  if unknown:
    raise TypeError(f"unexpected keyword argument(s) {sorted(unknown)}: hostopt's own options are "
                    f"{sorted(options)}, the others are optax's")
  options.update(extra)
  threads, reuse_state = options["threads"], options["reuse_state"]
  if not isinstance(threads, (int, np.integer)) or isinstance(threads, bool) or threads < 0:
    raise ValueError(f"threads = {threads!r}: expected an int >= 0 (0 = the threading runtime's default)")
  name = "adamw" if decoupled else "adam"
  reference_fn = _OPTAX[name]
  reference = reference_fn(**args)
  learning_rate, b1, b2, eps, eps_root = (args[k] for k in ("learning_rate", "b1", "b2", "eps", "eps_root"))
  weight_decay = args.get("weight_decay", 0.0) if decoupled else 0.0
  mask = args.get("mask") if decoupled else None
  mu_dtype, nesterov = args.get("mu_dtype"), bool(args.get("nesterov", False))
  for key, value in args.items():  # arguments of a newer optax that this front does not implement
    if key not in _KNOWN and value is not inspect.signature(reference_fn).parameters[key].default:
      raise NotImplementedError(f"hostopt.optax.{name}: argument {key}={value!r} of optax {optax.__version__} is "
                                "not supported")
  for nm, value in (("b1", b1), ("b2", b2)):
    if _is_number(value) and not 0.0 <= float(value) < 1.0:
      raise ValueError(f"{nm} = {float(value)}: expected a value in [0, 1)")
  for nm, value in (("eps", eps), ("eps_root", eps_root), ("weight_decay", weight_decay)):
    if _is_number(value) and not (float(value) >= 0.0 and np.isfinite(float(value))):
      raise ValueError(f"{nm} = {float(value)}: expected a finite value >= 0")

  def init_fn(params):
    state = reference.init(params)
    leaves = jax.tree_util.tree_leaves(params)
    if leaves and all(isinstance(x, np.ndarray) for x in leaves):  # numpy in, numpy out
      state = jax.tree_util.tree_map(lambda x: np.asarray(x).copy(), state)
    return state

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args  # optax's extra-args protocol: unused here
    adam_state = state[0]
    count = adam_state.count
    g_leaves, treedef = jax.tree_util.tree_flatten(updates)
    mu_leaves = treedef.flatten_up_to(adam_state.mu)
    nu_leaves = treedef.flatten_up_to(adam_state.nu)
    p_leaves = treedef.flatten_up_to(params) if params is not None else None
    n = len(g_leaves)
    for i, g in enumerate(g_leaves):  # optax's contract: mu, nu (and params) have the update's shape
      for nm, leaves in (("mu", mu_leaves), ("nu", nu_leaves), ("params", p_leaves)):
        if leaves is not None and leaves[i] is not None and tuple(np.shape(leaves[i])) != tuple(np.shape(g)):
          raise ValueError(f"{nm}[{i}] has shape {tuple(np.shape(leaves[i]))}: expected {tuple(np.shape(g))} like "
                           f"updates[{i}] (mu, nu and params must have the shape of the updates)")
    lr_count = state[-1].count if callable(learning_rate) else None
    wd_count = jax.tree_util.tree_leaves(state[1])[0] if callable(weight_decay) else None  # masked or not
    # Schedules are evaluated by XLA on every route (numpy, eager, jit), so all give the same bits.
    lr = _call_jit(learning_rate, lr_count) if callable(learning_rate) else learning_rate
    wd = _call_jit(weight_decay, wd_count) if callable(weight_decay) else weight_decay
    no_decay = _is_number(wd) and float(wd) == 0.0 and not callable(weight_decay)
    decays = [False] * n if (not decoupled or no_decay) else _decay_mask(mask, updates, treedef, n)
    if any(decays) and (p_leaves is None or any(p_leaves[i] is None for i in range(n) if decays[i])):
      raise ValueError("You are using a transformation that requires the current value of parameters, but you are "
                       "not passing `params` when calling `update`.")
    hp = (lr, b1, b2, eps, eps_root, wd)
    kernel = tuple(_on_kernel(g_leaves[i], mu_leaves[i], nu_leaves[i], p_leaves[i] if decays[i] else None, decays[i])
                   for i in range(n))
    s = _Static(tuple(decays), kernel, tuple(float(v) if _is_number(v) else None for v in hp),
                learning_rate if callable(learning_rate) else None,
                weight_decay if callable(weight_decay) else None, nesterov, mu_dtype, int(threads))
    numpy_in = all(isinstance(x, np.ndarray) for x in list(g_leaves) + list(mu_leaves) + list(nu_leaves))
    if numpy_in and not any(_is_traced(v) for v in hp):
      u, new_mu, new_nu = _numpy_update(s, hp, g_leaves, mu_leaves, nu_leaves, p_leaves, np.asarray(count),
                                        reuse_state)
    else:
      if any(kernel) and _xla.available() is not None:
        raise RuntimeError(f"hostopt.optax cannot run on jax arrays: {_xla.available()}")
      # Schedules are evaluated inside the call from their counts (eager and jit: same bits).
      dynamic = [v for k, v in enumerate(hp) if not _is_number(v)
                 and not (k == 0 and s.lr_schedule is not None) and not (k == 5 and s.wd_schedule is not None)]
      ps = [p_leaves[i] if decays[i] else None for i in range(n)]
      u, new_mu, new_nu = _flat_update_jit(s, list(g_leaves), list(mu_leaves), list(nu_leaves), ps, count, dynamic,
                                           lr_count, wd_count)

    keep_numpy = lambda x: np.asarray(x) if isinstance(count, np.ndarray) else x
    new_adam = adam_state._replace(count=keep_numpy(_increment(count)), mu=treedef.unflatten(new_mu),
                                   nu=treedef.unflatten(new_nu))
    # Every other leaf of optax's state (schedule counts, masked or not) is a count.
    rest = jax.tree_util.tree_map(lambda c: np.asarray(_increment(c)) if isinstance(c, np.ndarray) else _increment(c),
                                  tuple(state[1:]))
    return treedef.unflatten(u), (new_adam,) + rest

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _mirror(name: str, decoupled: bool, nesterov_default: Optional[bool] = None) -> Callable:
  """hostopt's `name` with the installed optax's signature, plus **hostopt_options."""
  ref = inspect.signature(getattr(optax, name))
  params = [p for p in ref.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
  params.append(inspect.Parameter("hostopt_options", inspect.Parameter.VAR_KEYWORD))
  sig = ref.replace(parameters=params, return_annotation=optax.GradientTransformationExtraArgs)

  def factory(*args, **kwargs):
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    options = dict(arguments.get("hostopt_options", {}))
    # optax.inject_hyperparams re-binds the arguments and passes the collected options back
    # as one keyword, hostopt_options={...}: unfold it.
    nested = options.pop("hostopt_options", {})
    arguments["hostopt_options"] = {**nested, **options} if isinstance(nested, dict) else options
    return _make(arguments, decoupled)

  factory.__signature__ = sig
  factory.__name__ = factory.__qualname__ = name
  factory.__doc__ = (f"optax.{name} on hostopt's kernels: optax {optax.__version__}'s arguments, defaults, mask "
                     "semantics and state. hostopt's own keyword options: threads (int, 0 = default) and "
                     "reuse_state (numpy states: update mu/nu in place). See hostopt.optax.")
  return factory


adam = _mirror("adam", decoupled=False)
adamw = _mirror("adamw", decoupled=True)
nadam = _mirror("nadam", decoupled=False)
nadamw = _mirror("nadamw", decoupled=True)
