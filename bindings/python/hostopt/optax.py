r"""optax-compatible Adam family whose update runs on hostopt's fused CPU kernels.

``hostopt.optax.adam``, ``adamw``, ``nadam`` and ``nadamw`` take optax's arguments and
defaults and return ``optax.GradientTransformationExtraArgs``; their states have exactly
the tree structure optax builds for the same call (``ScaleByAdamState(count, mu, nu)``,
the weight-decay state, the learning-rate state), so code that inspects, checkpoints or
wraps optax states keeps working. They compose with ``optax.chain``,
``optax.inject_hyperparams``, ``optax.apply_if_finite`` and ``optax.MultiSteps``, and
``update`` works under ``jax.jit`` (through ``jax.pure_callback``).

.. math::
  m_t = \beta_1 m_{t-1} + (1-\beta_1) g_t,\quad v_t = \beta_2 v_{t-1} + (1-\beta_2) g_t^2,\quad
  u_t = -\eta_t\left(\frac{\hat m_t}{\sqrt{\hat v_t + \epsilon_{root}} + \epsilon} + \lambda p_{t-1}\right)

with :math:`\hat m_t = m_t/(1-\beta_1^t)` (Nesterov: :math:`\beta_1 m_t/(1-\beta_1^{t+1}) +
(1-\beta_1) g_t/(1-\beta_1^t)`), :math:`\hat v_t = v_t/(1-\beta_2^t)` and decoupled weight
decay :math:`\lambda` (``adamw``/``nadamw``; masked like optax).

Inputs may be numpy or jax pytrees; outputs are of the same kind. ``update`` never mutates
the state it is given, unless the transformation was made with ``reuse_state=True``
(numpy states only), which updates mu and nu in place to save two copies per step.

Example:
  >>> import optax, hostopt.optax
  >>> opt = optax.chain(optax.clip_by_global_norm(1.0), hostopt.optax.adamw(1e-3, weight_decay=0.1))
  >>> state = opt.init(params)
  >>> updates, state = opt.update(grads, state, params)
  >>> params = optax.apply_updates(params, updates)
"""

from typing import Any, Callable, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from . import _core
from ._arrays import as_buffer

__all__ = ["adam", "adamw", "nadam", "nadamw"]

ScalarOrSchedule = Union[float, jax.Array, Callable[[Any], Any]]


def _is_traced(x) -> bool:
  return isinstance(x, jax.core.Tracer)


def _f32_work(x, reuse: bool) -> np.ndarray:
  """A flat float32 array to update in place: x itself when allowed and possible."""
  if reuse and isinstance(x, np.ndarray) and x.dtype == np.float32 and x.flags.c_contiguous and x.flags.writeable:
    return x.reshape(-1)
  return np.array(x, dtype=np.float32, copy=True).reshape(-1)


def _host_update(grads, mus, nus, params, count, lr, b1, b2, eps, eps_root, wd, decay_mask, nesterov, threads,
                 reuse=False):
  """The update on host arrays: (updates, new mu, new nu), all leaves of one gradient dtype
  in one call and one parallel region (hostopt::adam_update over leaves), one fused pass per
  element: the update is written in the gradient's dtype, params are only read for the
  weight decay. Hyper-parameters cross as two structs (with and without decay)."""
  t = int(count) + 1
  common = dict(lr=float(lr), beta1=float(b1), beta2=float(b2), eps=float(eps), eps_root=float(eps_root),
                mode="adamw", nesterov=bool(nesterov))
  wd = float(wd)
  configs = [_core.AdamConfig(**common, weight_decay=0.0), _core.AdamConfig(**common, weight_decay=wd)]
  by_tag = {}
  out_u, out_m, out_v = [], [], []
  for i, g in enumerate(grads):
    g = np.asarray(g)
    shape = g.shape
    # optax's contract: mu, nu (and params) have the update's shape, leaf by leaf.
    for name, leaves in (("mu", mus), ("nu", nus), ("params", params)):
      if leaves is not None and leaves[i] is not None and tuple(np.shape(leaves[i])) != tuple(shape):
        raise ValueError(f"{name}[{i}] has shape {tuple(np.shape(leaves[i]))}: expected {tuple(shape)} like "
                         f"updates[{i}] (mu, nu and params must have the shape of the updates)")
    if g.dtype not in (np.float32, np.float16) and g.dtype.name != "bfloat16":
      g = g.astype(np.float32)  # e.g. float64 leaves: computed in float32
    gbuf, tag = as_buffer(np.ascontiguousarray(g), f"updates[{i}]")
    decays = wd != 0.0 and decay_mask[i]
    p = None
    if decays:
      if params is None or params[i] is None:
        raise ValueError("You are using a transformation that requires the current value of parameters, but you are "
                         "not passing `params` when calling `update`.")
      p = np.ascontiguousarray(np.asarray(params[i]), dtype=np.float32).reshape(-1)
    m, v = _f32_work(mus[i], reuse), _f32_work(nus[i], reuse)
    u = np.empty(gbuf.size, gbuf.dtype)
    entry = by_tag.setdefault(tag, ([], [], [], [], [], []))
    for lst, x in zip(entry, (p, m, v, gbuf.reshape(-1), u, 1 if decays else 0)):
      lst.append(x)
    out_u.append(u.view(g.dtype).reshape(shape))
    out_m.append(m)
    out_v.append(v)
  for tag, (ps, ms, vs, gs, us, config_of) in by_tag.items():  # one call per gradient dtype
    _core.optax_update_leaves(ps, ms, vs, gs, tag, us, configs, config_of, t, 1.0, threads)
  # Moments go back in their own dtype (mu_dtype), after the update.
  back = lambda w, x: x if np.shares_memory(w, x) else w.reshape(np.shape(x)).astype(np.asarray(x).dtype, copy=False)
  out_m = [back(m, x) for m, x in zip(out_m, mus)]
  out_v = [back(v, x) for v, x in zip(out_v, nus)]
  return out_u, out_m, out_v


def _make(learning_rate: ScalarOrSchedule, b1, b2, eps, eps_root, mu_dtype, weight_decay, mask, nesterov,
          decoupled: bool, threads: int, reuse_state: bool) -> optax.GradientTransformationExtraArgs:
  if decoupled:
    reference = optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype,
                            weight_decay=weight_decay, mask=mask, nesterov=nesterov)
  else:
    reference = optax.adam(learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype,
                           nesterov=nesterov)
  for name, value in (("b1", b1), ("b2", b2)):
    if not _is_traced(value) and not 0.0 <= float(value) < 1.0:
      raise ValueError(f"{name} = {float(value)}: expected a value in [0, 1)")
  for name, value in (("eps", eps), ("eps_root", eps_root), ("weight_decay", weight_decay)):
    if not _is_traced(value) and not (float(value) >= 0.0 and np.isfinite(float(value))):
      raise ValueError(f"{name} = {float(value)}: expected a finite value >= 0")

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
    lr_state = state[-1]
    if callable(learning_rate):
      lr = learning_rate(lr_state.count)
    else:
      lr = learning_rate
    g_leaves, treedef = jax.tree_util.tree_flatten(updates)
    mu_leaves = treedef.flatten_up_to(adam_state.mu)
    nu_leaves = treedef.flatten_up_to(adam_state.nu)
    p_leaves = treedef.flatten_up_to(params) if params is not None else None
    if decoupled and mask is not None:
      m = mask(params if params is not None else updates) if callable(mask) else mask
      decay_mask = [bool(x) for x in treedef.flatten_up_to(m)]
    else:
      decay_mask = [True] * len(g_leaves)
    wd = weight_decay if decoupled else 0.0
    scalars = (count, lr, b1, b2, eps, eps_root, wd)
    traced = any(_is_traced(x) for x in list(g_leaves) + list(mu_leaves) + list(nu_leaves) + list(scalars) +
                 (list(p_leaves) if p_leaves is not None else []))
    n = len(g_leaves)

    if traced:
      result_shapes = (
          [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in g_leaves],
          [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in mu_leaves],
          [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in nu_leaves],
      )

      def callback(g, mu, nu, p, count_, lr_, b1_, b2_, eps_, eps_root_, wd_):
        return _host_update(g, mu, nu, p, count_, lr_, b1_, b2_, eps_, eps_root_, wd_, decay_mask, nesterov, threads)

      u, new_mu, new_nu = jax.pure_callback(callback, result_shapes, list(g_leaves), list(mu_leaves),
                                            list(nu_leaves), p_leaves, *scalars)
      to_kind = lambda xs: xs
    else:
      jax_inputs = any(isinstance(x, jax.Array) for x in g_leaves)
      host = lambda xs: jax.device_get(list(xs)) if jax_inputs else list(xs)  # all transfers start together
      reuse = reuse_state and not jax_inputs
      u, new_mu, new_nu = _host_update(host(g_leaves), host(mu_leaves), host(nu_leaves),
                                       host(p_leaves) if p_leaves is not None else None,
                                       *(np.asarray(x) for x in scalars), decay_mask, nesterov, threads, reuse)
      to_kind = (lambda xs: [jax.device_put(x) for x in xs]) if jax_inputs else (lambda xs: xs)

    new_count = optax.safe_int32_increment(count)
    if not traced and not isinstance(count, jax.Array):
      new_count = np.asarray(new_count)  # numpy states stay numpy
    new_adam = adam_state._replace(count=new_count, mu=treedef.unflatten(to_kind(new_mu)),
                                   nu=treedef.unflatten(to_kind(new_nu)))
    new_state = [new_adam] + list(state[1:])
    if callable(learning_rate):
      lr_count = optax.safe_int32_increment(lr_state.count)
      if not traced and not isinstance(lr_state.count, jax.Array):
        lr_count = np.asarray(lr_count)
      new_state[-1] = lr_state._replace(count=lr_count)
    return treedef.unflatten(to_kind(u)), tuple(new_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def adam(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
         eps_root: float = 0.0, mu_dtype: Optional[Any] = None, *, nesterov: bool = False, threads: int = 0,
         reuse_state: bool = False) -> optax.GradientTransformationExtraArgs:
  """optax.adam on hostopt's kernels (same arguments, defaults and state). ``threads``
  sets the worker threads (0 = default); ``reuse_state`` updates numpy mu/nu in place."""
  return _make(learning_rate, b1, b2, eps, eps_root, mu_dtype, 0.0, None, nesterov, False, threads, reuse_state)


def adamw(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
          eps_root: float = 0.0, mu_dtype: Optional[Any] = None, weight_decay: float = 1e-4, mask=None, *,
          nesterov: bool = False, threads: int = 0, reuse_state: bool = False) -> optax.GradientTransformationExtraArgs:
  """optax.adamw on hostopt's kernels (same arguments, defaults — weight_decay 1e-4 — mask
  semantics and state)."""
  return _make(learning_rate, b1, b2, eps, eps_root, mu_dtype, weight_decay, mask, nesterov, True, threads,
               reuse_state)


def nadam(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
          eps_root: float = 0.0, mu_dtype: Optional[Any] = None, *, threads: int = 0,
          reuse_state: bool = False) -> optax.GradientTransformationExtraArgs:
  """optax.nadam (adam with Nesterov momentum) on hostopt's kernels."""
  return adam(learning_rate, b1, b2, eps, eps_root, mu_dtype, nesterov=True, threads=threads, reuse_state=reuse_state)


def nadamw(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
           eps_root: float = 0.0, mu_dtype: Optional[Any] = None, weight_decay: float = 1e-4, mask=None, *,
           threads: int = 0, reuse_state: bool = False) -> optax.GradientTransformationExtraArgs:
  """optax.nadamw (adamw with Nesterov momentum) on hostopt's kernels."""
  return adamw(learning_rate, b1, b2, eps, eps_root, mu_dtype, weight_decay, mask, nesterov=True, threads=threads,
               reuse_state=reuse_state)
