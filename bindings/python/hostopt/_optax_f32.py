"""hostopt.optax's transformation with optax's float moments (moments="f32", the default):
the state is optax's own (ScaleByAdamState(count, mu, nu) and the others); a leaf whose mu
and nu are float32 runs on the kernel (numpy leaves through hostopt._core, jax ones through
the XLA FFI call), every other leaf on optax's own arithmetic (hostopt.optax's docstring).
"""

import dataclasses
import functools
import warnings
from typing import Any, List

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax.experimental.compute_on import compute_on

from . import _core, _xla
from ._dtypes import tag_of
from ._hyper import AdamHyperParameters
from ._optax_common import (Arguments, Hyper, ScaleByAdam8bitState, Static, counted, decayed, check_in_memory, f32,
                            increment, is_traced, not_tracing, place, replicated_like, resolve_hp, schedule_counts,
                            static_and_dynamic, to_host, update_hyper, update_leaves, updates_to_device)
from ._xla import is_static_number


def _on_kernel(g, mu, nu, p, decays: bool) -> bool:
  """Whether a leaf runs on the fused kernel (else on optax's own transformations)."""
  f32_ = np.dtype(np.float32)
  return (np.dtype(mu.dtype) == f32_ and np.dtype(nu.dtype) == f32_ and tag_of(g.dtype) is not None
          and (not decays or tag_of(p.dtype) is not None))


def _optax_leaves(s: Static, hp: Hyper, gs, mus, nus, ps, decays, count):
  """optax's own arithmetic for the leaves the kernel does not take (exactly optax.adam/adamw)."""
  adam = optax.scale_by_adam(b1=hp.beta1, b2=hp.beta2, eps=hp.eps, eps_root=hp.eps_root, mu_dtype=s.mu_dtype,
                             nesterov=s.nesterov)
  u, st = adam.update(list(gs), optax.ScaleByAdamState(count=count, mu=list(mus), nu=list(nus)))
  idx = [i for i, d in enumerate(decays) if d]
  if idx and not (is_static_number(hp.weight_decay) and hp.weight_decay == 0.0):
    dw = optax.add_decayed_weights(hp.weight_decay)
    sub, _ = dw.update([u[i] for i in idx], dw.init(None), [ps[i] for i in idx])
    for i, x in zip(idx, sub):
      u[i] = x
  scale = optax.scale_by_learning_rate((lambda _count: hp.lr) if s.schedules.lr is not None else hp.lr)
  u, _ = scale.update(u, scale.init(None))
  return u, st.mu, st.nu


def _flat_update(s: Static, gs, mus, nus, ps, count, dynamic, counts: Hyper):
  """The update of flat leaf lists; jax-traceable (runs under jit)."""
  hp = resolve_hp(s, dynamic, counts)
  n = len(gs)
  u, new_mu, new_nu = [None] * n, list(mus), list(nus)
  k_idx = [i for i in range(n) if s.kernel[i]]
  if k_idx:
    leaves = [(gs[i], mus[i], nus[i], ps[i] if s.decays[i] else None) for i in k_idx]
    hp_kernel = hp if any(s.decays) else hp._replace(weight_decay=0.0)
    call = lambda count, hp_kernel, leaves, per_shard=True: _xla.adam_update(
        count, hp_kernel, [(f32(g), m, v, f32(p)) for g, m, v, p in leaves], nesterov=s.nesterov,
        threads=s.threads, per_shard=per_shard)
    if s.state_memory is None:
      outs = call(count, hp_kernel, leaves)
    else:  # the moments stay in host memory: the gradients come to them, the updates go back
      # hp_kernel is closed over: its Python floats stay static attributes (as jit arguments they
      # would become float32 operands and change the bits).
      outs = compute_on("device_host")(jax.jit(lambda c, lv: call(c, hp_kernel, lv, False)))(count, to_host(leaves))
      outs = updates_to_device(outs)
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


@dataclasses.dataclass
class _KernelLeaves:
  """The numpy route's kernel leaves, as hostopt._core.optax_update_leaves takes them."""
  params: List[Any] = dataclasses.field(default_factory=list)  # float32, or None where the leaf does not decay
  mus: List[Any] = dataclasses.field(default_factory=list)
  nus: List[Any] = dataclasses.field(default_factory=list)
  grads: List[Any] = dataclasses.field(default_factory=list)
  updates: List[Any] = dataclasses.field(default_factory=list)
  config_of: List[int] = dataclasses.field(default_factory=list)  # 1: the decayed config


def _numpy_update(s: Static, hp: Hyper, gs, mus, nus, ps, count, reuse: bool, dynamic, counts: Hyper):
  """The update on numpy leaves: kernel leaves through hostopt._core (mu/nu in place with
  reuse_state), the others through optax's arithmetic, converted back to numpy."""
  t = int(count) + 1 if int(count) < np.iinfo(np.int32).max else int(count)
  n = len(gs)
  u: List[Any] = [None] * n
  new_mu: List[Any] = [None] * n
  new_nu: List[Any] = [None] * n
  k_idx = [i for i in range(n) if s.kernel[i]]
  if k_idx:
    model = AdamHyperParameters(**{field: float(np.asarray(v)) for field, v in hp._asdict().items()})
    configs = [_core.AdamConfig(**m.config(mode="adamw", nesterov=s.nesterov))
               for m in (dataclasses.replace(model, weight_decay=0.0), model)]
    k = _KernelLeaves()

    def work(x):  # the moments, updated in place: the caller's arrays with reuse_state
      x = np.asarray(x)
      if reuse and x.flags.c_contiguous and x.flags.writeable:
        return x, x.reshape(-1)
      w = np.array(x, dtype=np.float32, copy=True)
      return w, w.reshape(-1)
    for i in k_idx:
      new_mu[i], m = work(mus[i])
      new_nu[i], v = work(nus[i])
      u[i] = np.empty(np.shape(gs[i]), np.float32)
      k.params.append(np.ascontiguousarray(ps[i], dtype=np.float32).reshape(-1) if s.decays[i] else None)
      k.mus.append(m)
      k.nus.append(v)
      k.grads.append(np.ascontiguousarray(gs[i], dtype=np.float32).reshape(-1))  # exact widening of 16-bit gradients
      k.updates.append(u[i].reshape(-1))
      k.config_of.append(1 if s.decays[i] else 0)
    _core.optax_update_leaves(k.params, k.mus, k.nus, k.grads, "f32", k.updates, configs, k.config_of, t, 1.0,
                              s.threads)
  o_idx = [i for i in range(n) if not s.kernel[i]]
  if o_idx:  # optax's arithmetic, through the same jitted call as the jax route (the same bits)
    sub = dataclasses.replace(s, decays=tuple(s.decays[i] for i in o_idx), kernel=(False,) * len(o_idx))
    pick = lambda xs: [jnp.asarray(xs[i]) for i in o_idx]
    ou, om, on = _flat_update_jit(sub, pick(gs), pick(mus), pick(nus),
                                  [jnp.asarray(ps[i]) if s.decays[i] else None for i in o_idx], jnp.asarray(count),
                                  dynamic, counts)
    for j, i in enumerate(o_idx):
      u[i], new_mu[i], new_nu[i] = np.asarray(ou[j]), np.asarray(om[j]), np.asarray(on[j])
  return u, new_mu, new_nu


def _place_moments(adam_state, params, kind: str):
  """mu and nu of the leaves the kernel takes (both float32, params of a kernel dtype), in
  memory `kind` of their devices; the others stay where optax's arithmetic runs on them."""
  leaves, treedef = jax.tree_util.tree_flatten(params)
  mus, nus = treedef.flatten_up_to(adam_state.mu), treedef.flatten_up_to(adam_state.nu)
  target = replicated_like(leaves)
  f32_ = np.dtype(np.float32)
  for i, p in enumerate(leaves):
    if (np.dtype(mus[i].dtype) == f32_ and np.dtype(nus[i].dtype) == f32_ and hasattr(p, "dtype")
        and tag_of(p.dtype) is not None):
      mus[i], nus[i] = place(mus[i], kind, target), place(nus[i], kind, target)
  return adam_state._replace(mu=treedef.unflatten(mus), nu=treedef.unflatten(nus))


_warned_backend = False


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


def transformation(a: Arguments) -> optax.GradientTransformationExtraArgs:
  """The transformation of a factory call with float moments."""

  def init_fn(params):
    state = a.reference.init(params)
    leaves = jax.tree_util.tree_leaves(params)
    if leaves and all(isinstance(x, np.ndarray) for x in leaves):  # numpy in, numpy out
      state = jax.tree_util.tree_map(lambda x: np.asarray(x).copy(), state)
    elif a.state_memory is not None:
      adam_state, *rest = state
      state = (_place_moments(adam_state, params, a.state_memory), *rest)
    return state

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args  # optax's extra-args protocol: unused here
    adam_state, *rest = state
    if isinstance(adam_state, ScaleByAdam8bitState):
      raise TypeError("state[0] is a ScaleByAdam8bitState (8-bit moments): this transformation keeps float moments "
                      "(optax's ScaleByAdamState); make it with moments='8bit', or start from its own init")
    count = adam_state.count
    g_leaves, treedef, p_leaves = update_leaves(updates, params)
    mu_leaves = treedef.flatten_up_to(adam_state.mu)
    nu_leaves = treedef.flatten_up_to(adam_state.nu)
    n = len(g_leaves)
    for i, g in enumerate(g_leaves):  # optax's contract: mu, nu (and params) have the update's shape
      for nm, leaves in (("mu", mu_leaves), ("nu", nu_leaves), ("params", p_leaves)):
        if leaves is not None and leaves[i] is not None and tuple(np.shape(leaves[i])) != tuple(np.shape(g)):
          raise ValueError(f"{nm}[{i}] has shape {tuple(np.shape(leaves[i]))}: expected {tuple(np.shape(g))} like "
                           f"updates[{i}] (mu, nu and params must have the shape of the updates)")
    counts = schedule_counts(state, a.schedules)
    # numpy in, numpy out — unless a jax transformation is tracing us (lax.cond inside
    # optax.apply_if_finite, a jit): then the work must be staged, not run at trace time.
    numpy_route = (not_tracing() and isinstance(count, np.ndarray) and
                   all(isinstance(x, np.ndarray) for x in list(g_leaves) + list(mu_leaves) + list(nu_leaves)) and
                   not any(is_traced(v) for v in a.hp))
    decays = decayed(a, updates, treedef, p_leaves)
    # Schedules evaluated by XLA on the numpy route, as inside the jitted call of the jax route.
    hp = update_hyper(a, counts, evaluate=numpy_route)
    # The kernel runs on the host: on another backend the moments must be in host memory
    # (state_memory), or optax's arithmetic runs where the arrays are.
    on_host = numpy_route or a.state_memory is not None or _backend_is_cpu()
    kernel = tuple(on_host and _on_kernel(g_leaves[i], mu_leaves[i], nu_leaves[i], p_leaves[i] if decays[i] else None,
                                          decays[i]) for i in range(n))
    if not numpy_route and a.state_memory is not None:
      k_idx = [i for i in range(n) if kernel[i]]
      check_in_memory([mu_leaves[i] for i in k_idx] + [nu_leaves[i] for i in k_idx],
                      [f"mu[{i}]" for i in k_idx] + [f"nu[{i}]" for i in k_idx], a.state_memory)
    # Off the numpy route the schedules' slots are evaluated inside the jitted call.
    static_hp, dynamic = static_and_dynamic(hp, a.schedules, evaluated=numpy_route)
    s = Static(decays=tuple(decays), kernel=kernel, hp=static_hp, schedules=a.schedules, nesterov=a.nesterov,
               mu_dtype=a.mu_dtype, threads=a.threads, state_memory=a.state_memory)
    if numpy_route:
      u, new_mu, new_nu = _numpy_update(s, hp, g_leaves, mu_leaves, nu_leaves, p_leaves, count, a.reuse_state,
                                        dynamic, counts)
    else:
      if any(kernel) and _xla.available() is not None:
        raise RuntimeError(f"hostopt.optax cannot run on jax arrays: {_xla.available()}")
      ps = [p_leaves[i] if decays[i] else None for i in range(n)]
      # Inside the caller's trace, inline (the FFI call then sees whether its gradients are
      # temporaries of the caller's computation); eager calls run the same code jitted.
      flat_update = _flat_update_jit if not_tracing() else functools.partial(_flat_update)
      u, new_mu, new_nu = flat_update(s, list(g_leaves), list(mu_leaves), list(nu_leaves), ps, count, dynamic,
                                      counts)
    keep_numpy = np.asarray if numpy_route else (lambda x: x)
    new_adam = adam_state._replace(count=keep_numpy(increment(count)), mu=treedef.unflatten(new_mu),
                                   nu=treedef.unflatten(new_nu))
    return treedef.unflatten(u), (new_adam,) + counted(rest, numpy_route)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
