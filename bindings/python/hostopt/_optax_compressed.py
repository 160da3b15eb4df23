"""hostopt.optax's transformation with compressed moments (moments="bf16" or "8bit"): every
leaf on the kernel, the state optax's ScaleByAdamState with bfloat16 mu and nu, or
ScaleByAdam8bitState (uint8 codes and one [blocks, 2] array of exponent bytes); numpy
states run the same jitted call on jax's CPU backend (hostopt.optax's docstring).
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax.experimental.compute_on import compute_on

from . import _moments, _xla
from ._block_checks import report as _report_blocks
from ._dtypes import tag_of
from ._optax_common import (Arguments, Hyper, ScaleByAdam8bitState, Static, counted, decayed, check_in_memory, f32,
                            increment, is_traced, not_tracing, place, replicated_like, resolve_hp, schedule_counts,
                            static_and_dynamic, to_host, update_hyper, update_leaves, updates_to_device)

class _BlockCounts(NamedTuple):
  """An update's 8-bit block counts, as _block_checks.report reads a step's."""
  step: int
  poisoned_blocks: int
  saturated_blocks: int = 0  # counted by the kernels of the other fronts only


def poisoned_blocks(state):
  """How many 8-bit blocks of the ScaleByAdam8bitStates in `state` (any optax state tree)
  are poisoned: an exponent byte 255, their 32 moments NaN (for good). An int for a known
  state, a traced int32 under jit."""
  found = [x for x in jax.tree_util.tree_leaves(state, is_leaf=lambda x: isinstance(x, ScaleByAdam8bitState))
           if isinstance(x, ScaleByAdam8bitState)]
  if any(is_traced(x.scales) for x in found):
    return sum((jnp.any(jnp.asarray(x.scales) == 255, axis=1).sum(dtype=jnp.int32) for x in found), jnp.int32(0))
  return int(sum(np.count_nonzero(np.any(np.asarray(x.scales) == 255, axis=1)) for x in found))


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


def _flat_update(s: Static, gs, mus, nus, scales, ps, count, dynamic, counts: Hyper):
  """The update over compressed moments (every leaf on the kernel); jax-traceable."""
  hp = resolve_hp(s, dynamic, counts)
  # Gradients as they are (the update takes their dtype); params widened for the decay term.
  leaves = [(g, m, v, p if d else None) for g, m, v, p, d in zip(gs, mus, nus, ps, s.decays)]
  hp_kernel = hp if any(s.decays) else hp._replace(weight_decay=0.0)
  call = lambda count, leaves, scales, per_shard=True: _xla.adam_update_compressed(
      count, hp_kernel, [(g, m, v, f32(p)) for g, m, v, p in leaves], scales, moments=s.moments, seed=s.seed,
      nesterov=s.nesterov, threads=s.threads, per_shard=per_shard)
  if s.state_memory is None:
    outs, new_scales = call(count, leaves, scales)
  else:  # as the f32 route: the codes stay in host memory, the gradients come, the updates go back
    outs, new_scales = compute_on("device_host")(jax.jit(lambda c, lv, sc: call(c, lv, sc, False)))(
        count, to_host(leaves), scales)
    outs = updates_to_device(outs)
  u, m, v = (list(col) for col in zip(*outs)) if outs else ([], [], [])
  return u, m, v, new_scales


_flat_update_jit = jax.jit(_flat_update, static_argnums=0)


def transformation(a: Arguments, blocks_told) -> optax.GradientTransformationExtraArgs:
  """The transformation of a factory call with compressed moments (hostopt.optax's docstring);
  `blocks_told` records the CompressedMomentsWarnings already given (_block_checks.report)."""
  q8 = a.moments == "8bit"
  code_dtype = np.dtype(_moments.HELD_DTYPES[a.moments])  # (bfloat16: ml_dtypes', which jax brings)

  def init_fn(params):
    leaves, treedef = jax.tree_util.tree_flatten(params)
    numpy_in = bool(leaves) and all(isinstance(x, np.ndarray) for x in leaves)
    zeros = np.zeros if numpy_in else jnp.zeros
    # optax's other state (the weight decay's and the schedule's) without building its f32
    # moments: every leaf of it is a count starting at 0 (else, optax's own init).
    _, *rest = jax.eval_shape(a.reference.init, params)
    if all(np.shape(x) == () and np.issubdtype(x.dtype, np.integer) for x in jax.tree_util.tree_leaves(rest)):
      rest = jax.tree_util.tree_map(lambda x: zeros((), x.dtype), rest)
    else:  # pragma: no cover - an optax whose other state is not counts
      _, *rest = a.reference.init(params)
    count = zeros((), np.int32)
    # Codes like the params (jnp.zeros_like keeps a jax array's sharding, as optax's init).
    like = (lambda x: np.zeros(np.shape(x), code_dtype)) if numpy_in else (lambda x: jnp.zeros_like(x, dtype=code_dtype))
    codes = lambda: treedef.unflatten([like(x) for x in leaves])
    if q8:
      scales = zeros((sum(_blocks(x) for x in leaves), 2), np.uint8)
      adam = ScaleByAdam8bitState(count=count, mu_codes=codes(), nu_codes=codes(), scales=scales)
    else:
      adam = optax.ScaleByAdamState(count=count, mu=codes(), nu=codes())
    if a.state_memory is not None and not numpy_in:  # the codes (and scales) in host memory; the count stays
      # Uncommitted codes (of numpy or scalar params) and the one scales array go replicated over
      # the params' devices: committed to one device they would clash with sharded params.
      target = replicated_like(leaves)
      to_memory = lambda t: jax.tree_util.tree_map(lambda x: place(x, a.state_memory, target), t)
      if q8:
        adam = adam._replace(mu_codes=to_memory(adam.mu_codes), nu_codes=to_memory(adam.nu_codes),
                             scales=place(adam.scales, a.state_memory, target))
      else:
        adam = adam._replace(mu=to_memory(adam.mu), nu=to_memory(adam.nu))
    return (adam, *rest)

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    adam_state, *rest = state
    if q8 != isinstance(adam_state, ScaleByAdam8bitState):
      raise TypeError(f"state[0] is a {type(adam_state).__name__}: this transformation keeps its {a.moments} moments "
                      f"in {'ScaleByAdam8bitState' if q8 else 'ScaleByAdamState with bfloat16 mu and nu'} (made by "
                      "its init); a state of another format is not converted")
    count = adam_state.count
    g_leaves, treedef, p_leaves = update_leaves(updates, params)
    if q8:
      mu_leaves, nu_leaves = treedef.flatten_up_to(adam_state.mu_codes), treedef.flatten_up_to(adam_state.nu_codes)
      scales = adam_state.scales
      want = (sum(_blocks(g) for g in g_leaves), 2)
      if not hasattr(scales, "dtype") or np.dtype(scales.dtype) != np.uint8 or tuple(np.shape(scales)) != want:
        raise ValueError("scales: " + (f"{scales.dtype} {tuple(np.shape(scales))}" if hasattr(scales, "dtype")
                                        else type(scales).__name__) +
                         f", expected uint8 {want} (every leaf's 32-element blocks, in leaf order)")
    else:
      mu_leaves, nu_leaves = treedef.flatten_up_to(adam_state.mu), treedef.flatten_up_to(adam_state.nu)
      scales = None
    for i, g in enumerate(g_leaves):
      if tag_of(g.dtype) is None:
        raise TypeError(f"updates[{i}]: dtype {g.dtype}; with {a.moments} moments every leaf runs on hostopt's "
                        "kernel, which takes float32, bfloat16 or float16 gradients")
      for nm, x in (("mu", mu_leaves[i]), ("nu", nu_leaves[i])):
        if _moments.held_format(x.dtype) != a.moments:
          raise TypeError(f"{nm}[{i}]: dtype {x.dtype}, expected {code_dtype}: this transformation keeps "
                          f"{a.moments} moments; a state of another format is not converted")
        if tuple(np.shape(x)) != tuple(np.shape(g)):
          raise ValueError(f"{nm}[{i}] has shape {tuple(np.shape(x))}: expected {tuple(np.shape(g))} like updates[{i}]")
      if p_leaves is not None and p_leaves[i] is not None and tuple(np.shape(p_leaves[i])) != tuple(np.shape(g)):
        raise ValueError(f"params[{i}] has shape {tuple(np.shape(p_leaves[i]))}: expected {tuple(np.shape(g))} like "
                         f"updates[{i}] (mu, nu and params must have the shape of the updates)")
    if q8 and not is_traced(scales):
      _check_exponents(scales, g_leaves)
    counts = schedule_counts(state, a.schedules)
    arrays = list(g_leaves) + list(mu_leaves) + list(nu_leaves) + ([scales] if q8 else [])
    numpy_route = (not_tracing() and isinstance(count, np.ndarray) and all(isinstance(x, np.ndarray) for x in arrays))
    if not numpy_route and jax.default_backend() != "cpu" and a.state_memory is None:
      raise ValueError(f"hostopt.optax with {a.moments} moments runs on the host kernel: the arrays are on "
                       f"{jax.default_backend()}; make the transformation with state_memory='pinned_host' to keep "
                       "the moments in host memory and update them there")
    if not numpy_route and a.state_memory is not None:
      field = "_codes" if q8 else ""
      check_in_memory(list(mu_leaves) + list(nu_leaves) + ([scales] if q8 else []),
                      [f"mu{field}[{i}]" for i in range(len(mu_leaves))] +
                      [f"nu{field}[{i}]" for i in range(len(nu_leaves))] + ["scales"], a.state_memory)
    if _xla.available() is not None:
      raise RuntimeError(f"hostopt.optax cannot run: {_xla.available()}")
    n = len(g_leaves)
    decays = decayed(a, updates, treedef, p_leaves)
    for i in range(n):
      if decays[i] and tag_of(p_leaves[i].dtype) is None:
        raise TypeError(f"params[{i}]: dtype {p_leaves[i].dtype}; expected float32, bfloat16 or float16")
    # The numpy route checks the schedules' values too (refused before anything changes); the
    # jitted call evaluates them itself, at the same counts.
    update_hyper(a, counts, evaluate=numpy_route)
    static_hp, dynamic = static_and_dynamic(a.hp, a.schedules, evaluated=False)
    s = Static(decays=tuple(decays), kernel=(True,) * n, hp=static_hp, schedules=a.schedules, nesterov=a.nesterov,
               mu_dtype=None, threads=a.threads, state_memory=None if numpy_route else a.state_memory,
               moments=a.moments, seed=a.seed)
    ps = [p_leaves[i] if decays[i] else None for i in range(n)]
    if numpy_route:  # the same jitted call on copies on the host's device (whatever the default), as numpy
      # np.asarray first: params may be jax arrays committed to an accelerator.
      j = lambda xs: [None if x is None else jnp.asarray(np.asarray(x)) for x in xs]
      try:
        cpu = jax.devices("cpu")[0]
      except RuntimeError as e:
        raise RuntimeError(f"hostopt.optax with {a.moments} moments runs numpy inputs on jax's CPU backend, which "
                           f"this process has not enabled (JAX_PLATFORMS): {e}") from None
      # Hyper-parameters given as arrays on an accelerator come to the host with the rest.
      dynamic = [np.asarray(v) if isinstance(v, jax.Array) else v for v in dynamic]
      with jax.default_device(cpu):
        u, new_mu, new_nu, new_sc = _flat_update_jit(s, j(g_leaves), j(mu_leaves), j(nu_leaves),
                                                     None if scales is None else jnp.asarray(scales), j(ps),
                                                     jnp.asarray(count), dynamic, counts)
      u, new_mu, new_nu = ([np.asarray(x) for x in col] for col in (u, new_mu, new_nu))
      new_sc = None if new_sc is None else np.asarray(new_sc)
    else:
      flat_update = _flat_update_jit if not_tracing() else functools.partial(_flat_update)
      u, new_mu, new_nu, new_sc = flat_update(s, list(g_leaves), list(mu_leaves), list(nu_leaves), scales, ps, count,
                                              dynamic, counts)
    new_count = np.asarray(increment(count)) if numpy_route else increment(count)
    if q8:
      new_adam = ScaleByAdam8bitState(count=new_count, mu_codes=treedef.unflatten(new_mu),
                                      nu_codes=treedef.unflatten(new_nu), scales=new_sc)
      if not is_traced(new_sc) and not is_traced(new_count):  # eager: 2 bytes per 32 parameters read back
        _report_blocks(blocks_told, _BlockCounts(step=int(new_count), poisoned_blocks=poisoned_blocks(new_adam)),
                       "hostopt.optax")
    else:
      new_adam = adam_state._replace(count=new_count, mu=treedef.unflatten(new_mu), nu=treedef.unflatten(new_nu))
    return treedef.unflatten(u), (new_adam,) + counted(rest, numpy_route)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
