"""The JAX primitive behind hostopt.optax under jax.jit: one XLA FFI call into hostopt's
fused kernel for all f32 leaves of an update, mu and nu updated in place.

``adam_update(count, hp, leaves, ...)`` binds it. Lowered to the custom call
``hostopt_adam_update`` (hostopt._xla_ffi, registered for the CPU platform) with mu and nu
aliased to their outputs, so a donated state is updated where it lies (a kept one costs one
copy made by XLA), and the update written over the gradient when the gradient is computed in
the same jitted step (a temporary: the update then needs no buffer of its own; XLA:CPU pages
in every temporary afresh each run). Static hyper-parameters travel as f64 attributes, traced ones
(schedules, inject_hyperparams) as one scalar vector operand; both reach the kernel as the
same doubles, so eager calls (which run the same jitted call) and jit give the same bits.

vmap: elementwise over the leaves (one call for the whole batch) when only the arrays are
batched; per batch element (lax.map) when the count or a hyper-parameter is.

``adam_update_compressed`` binds the same over compressed moments (bf16 values or 8-bit
codes, with one array of every leaf's blocks' exponent bytes), lowered to
``hostopt_adam_update_compressed`` with the codes and each leaf's slice of the exponents
aliased to their outputs. Exponent bytes the encoder never writes (a corrupt or foreign
state) are refused by the call, which checks the bytes it holds; a call run per shard is
handed where XLA found one in the whole array, so that every shard refuses alike. Under
vmap it runs per batch element (8-bit blocks belong to one leaf: a batch flattened into one
leaf would mix them). Under jit with several devices it is
a custom_partitioning op like the f32 call's: a leaf cut along dim 0 alone (8-bit: into
whole blocks) runs per shard, its rounding indices from the shard's index among the leaf's
equal pieces (one uint32, from the mesh axes' indices), so the bits are those of the whole
arrays; XLA gathers any other leaf.

Differentiating through either update raises: the kernel has no derivative rule, and
optax.adamw is the tool for meta-gradients through an optimizer.
"""

import functools
import inspect
import itertools
from typing import List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import core
from jax._src import dispatch
from jax.experimental.custom_partitioning import custom_partitioning
from jax.interpreters import ad, batching, mlir

from ._moments import Q8_BLOCK, Q8_MAX_EXPONENT, Q8_POISONED, q8_blocks  # the 8-bit format's constants

try:
  from jax.extend.core import Primitive
except ImportError:  # pragma: no cover - older jax
  from jax.core import Primitive

try:
  import jax.ffi as _ffi
except ImportError:  # jax < 0.4.35
  import jax.extend.ffi as _ffi

TARGET = "hostopt_adam_update"
HP_NAMES = ("lr", "b1", "b2", "eps", "eps_root", "wd")

# XLA FFI API 0.1 came with jaxlib 0.4.34; the handlers speak 0.1 and later (one build, any
# of those jaxlibs: see bindings/xla_ffi_module.cpp). An API 0.0 XLA would call them through
# another table layout, so they are never registered there.
OLDEST_JAXLIB = (0, 4, 34)


def _release(version: str) -> Tuple[int, ...]:
  """(0, 4, 34) from '0.4.34' or '0.4.34.dev20240901'."""
  out = []
  for part in version.split(".")[:3]:
    digits = "".join(itertools.takewhile(str.isdigit, part))
    out.append(int(digits or 0))
  return tuple(out)


_unavailable: Optional[str] = None
try:
  from . import _xla_ffi
except ImportError as e:
  _unavailable = (f"hostopt was built without its XLA FFI handlers ({e}); a build makes them when it finds XLA FFI "
                  "headers (jaxlib >= 0.4.34 at build time: pip's build requirement brings it), so reinstall hostopt "
                  "with pip, or pass -DHOSTOPT_XLA_FFI_INCLUDE_DIR=<jaxlib>/include to CMake")
else:
  import jaxlib.version
  if _release(jaxlib.version.__version__) < OLDEST_JAXLIB:
    _unavailable = (f"hostopt.optax's XLA FFI handlers need jaxlib >= 0.4.34 (XLA FFI API 0.1 or newer); jaxlib "
                    f"{jaxlib.version.__version__} is installed: pip install -U jax jaxlib")
  else:
    for _name, _capsule in _xla_ffi.targets().items():
      _ffi.register_ffi_target(_name, _capsule, platform="cpu")


def available() -> Optional[str]:
  """None when the FFI handlers are registered, else why not."""
  return _unavailable


_NOT_MAPPED = getattr(batching, "not_mapped", None)  # None in current jax

_prim = Primitive("hostopt_adam_update")
_prim.multiple_results = True


def _leaf_operands(decays: str, operands):
  """Splits the flat leaf operands into (g, mu, nu, p|None) per leaf."""
  out, i = [], 0
  for d in decays:
    if d == "1":
      out.append(tuple(operands[i:i + 4]))
      i += 4
    else:
      out.append(tuple(operands[i:i + 3]) + (None,))
      i += 3
  return out


def _abstract_eval(count, hp, *operands, decays, **_):
  outs = []
  for g, mu, nu, _p in _leaf_operands(decays, operands):
    outs += [g, mu, nu]  # the update has the (f32) gradient's type; the moments keep theirs
  return outs


def _lowering(ctx, count, hp, *operands, decays, over_grad, traced, nesterov, threads, static):
  aliases, i = {}, 2
  for k, d in enumerate(decays):
    # The moments are updated over themselves. The update is written over the gradient when
    # the gradient is computed in the same computation (a temporary: no fresh buffer to page
    # in every step); a gradient that is an argument of the computation would have to be
    # copied first, so then the update gets a buffer of its own.
    if over_grad[k] == "1":
      aliases[i] = 3 * k
    aliases[i + 1] = 3 * k + 1
    aliases[i + 2] = 3 * k + 2
    i += 4 if d == "1" else 3
  attrs = dict(zip(HP_NAMES, (float(v) for v in static)))
  rule = _ffi.ffi_lowering(TARGET, operand_output_aliases=aliases)
  return rule(ctx, count, hp, *operands, traced=int(traced), nesterov=int(nesterov), threads=int(threads),
              decays=decays, **attrs)


def _computed_here(x) -> bool:
  """Whether x is a value computed inside the computation being traced (not one of its
  arguments): then the update may be written over it without XLA copying it first. Reads
  the tracing frame (JAX internals, the same in jax 0.4.30 and 0.10); when it cannot tell,
  says no, which costs a buffer for the update but never a copy."""
  try:
    frame = x._trace.frame
    var = frame.tracer_to_var.get(id(x)) if hasattr(frame, "tracer_to_var") else getattr(x, "val", None)
    return var is not None and all(var is not v for v in frame.invars)
  except Exception:  # noqa: BLE001 - any other tracer or jax version: the safe answer
    return False


def _impl(*args, **params):
  # The primitive alone, compiled once per signature (JAX's own dispatch caches it; a jit
  # made here would recompile every call and recurse under jax.disable_jit()).
  return dispatch.apply_primitive(_prim, *args, **params)


def _batch(args, dims, **params):
  count, hp = args[:2]
  size = next(a.shape[d] for a, d in zip(args, dims) if d is not _NOT_MAPPED)
  if dims[0] is _NOT_MAPPED and dims[1] is _NOT_MAPPED:
    # Elementwise over the leaves: one call over the whole batch.
    leaves = [batching.bdim_at_front(a, d, size) for a, d in zip(args[2:], dims[2:])]
    return _prim.bind(count, hp, *leaves, **params), [0] * _n_out(params)
  # A batched count or hyper-parameter: one call per batch element.
  mask = tuple(d is not _NOT_MAPPED for d in dims)
  batched = [batching.bdim_at_front(a, d, size) for a, d in zip(args, dims) if d is not _NOT_MAPPED]
  unbatched = [a for a, d in zip(args, dims) if d is _NOT_MAPPED]
  outs = _sequential(_prim, tuple(sorted(params.items())), mask)(batched, unbatched)
  return outs, [0] * len(outs)


@functools.lru_cache(maxsize=256)
def _sequential(prim, params_items, mask):
  """lax.map of the call over the batched operands, jitted once per signature (an eager vmap
  would otherwise compile a new scan every call)."""
  params = dict(params_items)

  def run(batched, unbatched):
    def one(xs):
      it_b, it_u = iter(xs), iter(unbatched)
      return prim.bind(*[next(it_b) if m else next(it_u) for m in mask], **params)
    return jax.lax.map(one, batched)
  return jax.jit(run)


def _n_out(params) -> int:
  return 3 * len(params["decays"])


def _jvp(primals, tangents, **params):
  raise TypeError("hostopt.optax's update is not differentiable: it runs hostopt's fused C++ kernel through an XLA "
                  "FFI call, which has no derivative rule. To differentiate through an optimizer step "
                  "(meta-learning), use optax.adam/adamw, whose update is written in jax.numpy.")


_prim.def_impl(_impl)
_prim.def_abstract_eval(_abstract_eval)
mlir.register_lowering(_prim, _lowering, platform="cpu")
batching.primitive_batchers[_prim] = _batch
ad.primitive_jvps[_prim] = _jvp


def is_static_number(x) -> bool:
  """A hyper-parameter known now (a Python or numpy real scalar, 0-d numpy arrays too): it
  reaches the kernel as a float64 attribute, on every route alike."""
  if isinstance(x, np.ndarray):
    return x.ndim == 0 and x.dtype.kind in "iuf"
  return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def _split_hyperparameters(hp_values: Sequence):
  """(static floats, the dynamic ones as one f32/f64 vector operand, their bit mask): static
  numbers reach the kernel as f64 attributes, the rest as operands."""
  static, dynamic, traced = [], [], 0
  for k, v in enumerate(hp_values):
    if is_static_number(v):
      static.append(float(v))
    else:
      static.append(0.0)
      dynamic.append(v)
      traced |= 1 << k
  if dynamic:
    dt = jnp.float64 if any(jnp.result_type(v) == jnp.float64 for v in dynamic) else jnp.float32
    hp = jnp.stack([jnp.asarray(v, dt).reshape(()) for v in dynamic])
  else:
    hp = jnp.zeros((0,), jnp.float32)
  return tuple(static), hp, traced


def adam_update(count, hp_values: Sequence, leaves: List[Tuple], *, nesterov: bool, threads: int,
                per_shard: bool = True):
  """One FFI call for `leaves` = [(g, mu, nu, p or None)], all float32 and of one shape
  per leaf. hp_values: (lr, b1, b2, eps, eps_root, wd), each a Python float (static) or
  an array (traced or not). Returns [(u, new_mu, new_nu)] per leaf."""
  if _unavailable is not None:
    raise RuntimeError(_unavailable)
  static, hp, traced = _split_hyperparameters(hp_values)
  operands, decays, over_grad = [], "", ""
  for g, mu, nu, p in leaves:
    operands += [g, mu, nu] + ([p] if p is not None else [])
    decays += "1" if p is not None else "0"
    over_grad += "1" if _computed_here(g) else "0"
  count = jnp.asarray(count, jnp.int32)
  params = dict(decays=decays, over_grad=over_grad, traced=traced, nesterov=bool(nesterov), threads=int(threads),
                static=static)
  args = [count, hp, *operands]
  if per_shard and _runs_per_shard(args):
    outs = _per_shard(params, [len(jnp.shape(g)) for g, _, _, _ in leaves])(*args)
  else:
    outs = _prim.bind(*args, **params)
  return [tuple(outs[3 * k:3 * k + 3]) for k in range(len(leaves))]


def _per_shard(params, ranks):
  """The call as a custom_partitioning op: elementwise, so under jit with sharded leaves it
  runs on each device's shard of every leaf (no gather of the moments); the scalars are
  replicated. Each leaf's arrays follow its gradient's sharding."""
  decays = params["decays"]
  spans, i = [], 2
  for d in decays:
    k = 4 if d == "1" else 3
    spans.append((i, k))
    i += k

  def call(count, hp, *operands):
    return tuple(_prim.bind(count, hp, *operands, **params))

  def partition(mesh, arg_shapes, result_shape):
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    arg_shardings, result_shardings = [replicated, replicated], []
    for i, k in spans:
      # The gradient's sharding as XLA gave it (decode_shardings=False: any tiling, sub-axes
      # included, is a tiling of an elementwise call).
      leaf = arg_shapes[i].sharding or replicated
      arg_shardings += [leaf] * k
      result_shardings += [leaf] * 3
    return mesh, call, tuple(result_shardings), tuple(arg_shardings)

  operands, results = ["", "h"], []
  for leaf, ((_, k), rank) in enumerate(zip(spans, ranks)):
    dims = " ".join(f"l{leaf}d{j}" for j in range(rank))
    operands += [dims] * k
    results += [dims] * 3
  # How _batch_partitioned recognises the op as ours: its batching rule and operand count.
  partition._hostopt_batch = (functools.partial(_batch, **params), 2 + sum(k for _, k in spans))
  op = custom_partitioning(call)
  # decode_shardings=False: JAX's decoding into a NamedSharding of the mesh raises
  # IndivisibleError (and the compile fails) for a leaf cut over part of a mesh axis, a
  # sharding Shardy propagates, e.g. through a reshape; the call takes any sharding as it is.
  op.def_partition(partition=partition, sharding_rule=", ".join(operands) + " -> " + ", ".join(results),
                   need_replication_factors=("h",), decode_shardings=False)
  return op


def _runs_per_shard(args) -> bool:
  """Whether the call is a per-shard (custom_partitioning) op: with Shardy and several
  devices, under jit (no eager tracer), and outside shard_map's manual axes. There the arrays
  are already each device's own, and in a partly manual region (manual over some axes, a
  leaf constrained to another) XLA's partitioner aborts the process on the op (a failed
  CHECK) instead of raising; the plain call is the right one."""
  if not (_SHARDY and jax.device_count() > 1):
    return False
  if not all(type(x).__name__ == "DynamicJaxprTracer" for x in args if isinstance(x, core.Tracer)):
    return False
  mesh = jax.sharding.get_abstract_mesh() if hasattr(jax.sharding, "get_abstract_mesh") else None
  return not getattr(mesh, "manual_axes", ())


def _batch_partitioned(args, dims, *, partition, **rest):
  """vmap of a per-shard op: its plain call's batching rule (no longer per shard). JAX has no
  batching rule for custom_partitioning; any other user of it gets the error JAX gives."""
  ours = getattr(partition, "_hostopt_batch", None)
  if ours is None:
    raise NotImplementedError("Batching rule for 'custom_partitioning' not implemented")
  rule, n = ours
  return rule(list(args[len(args) - n:]), list(dims[len(dims) - n:]))


# Per-shard execution needs Shardy's sharding rules (jax >= 0.5); under GSPMD (jax 0.4) the
# call sees whole arrays (XLA gathers sharded ones around it).
_SHARDY = ("sharding_rule" in inspect.signature(custom_partitioning.def_partition).parameters and
           bool(getattr(jax.config, "jax_use_shardy_partitioner", False)))
if _SHARDY:
  from jax._src.custom_partitioning import custom_partitioning_p as _cp_prim
  _registered = getattr(batching, "fancy_primitive_batchers", None)  # where current jax keeps them
  if _registered is None or _cp_prim not in _registered:
    batching.primitive_batchers[_cp_prim] = _batch_partitioned


# --- compressed moments ---------------------------------------------------------------------

COMPRESSED_TARGET = "hostopt_adam_update_compressed"
_cprim = Primitive("hostopt_adam_update_compressed")
_cprim.multiple_results = True


def _leaf_groups(decays: str, q8: bool, operands):
  """Splits the flat operands into per-leaf groups (g, mu, nu, p|None, piece, scales|None)."""
  groups, i = [], 0
  for d in decays:
    g, mu, nu = operands[i:i + 3]
    i += 3
    p = operands[i] if d == "1" else None
    i += d == "1"
    piece = operands[i]
    scales = operands[i + 1] if q8 else None
    i += 1 + q8
    groups.append((g, mu, nu, p, piece, scales))
  return groups


def _compressed_abstract_eval(count, hp, check, *operands, decays, moments, **_):
  outs = []
  for g, mu, nu, _p, _piece, scales in _leaf_groups(decays, moments == "8bit", operands):
    outs += [g, mu, nu] + ([scales] if scales is not None else [])
  return outs


def _compressed_lowering(ctx, count, hp, check, *operands, decays, over_grad, traced, nesterov, threads, static,
                         moments, seed, firsts):
  q8 = moments == "8bit"
  per_leaf = 4 if q8 else 3
  aliases, i = {}, 3
  for k, d in enumerate(decays):
    out = per_leaf * k
    if over_grad[k] == "1":  # the update over a gradient computed here (as _lowering)
      aliases[i] = out
    aliases[i + 1], aliases[i + 2] = out + 1, out + 2
    i += 4 if d == "1" else 3
    i += 1  # piece
    if q8:
      aliases[i] = out + 3
      i += 1
  attrs = dict(zip(HP_NAMES, (float(v) for v in static)))
  rule = _ffi.ffi_lowering(COMPRESSED_TARGET, operand_output_aliases=aliases)
  return rule(ctx, count, hp, check, *operands, traced=int(traced), nesterov=int(nesterov), threads=int(threads),
              decays=decays, moments=moments, seed_lo=int(seed & 0xFFFFFFFF), seed_hi=int(seed >> 32),
              firsts=",".join(str(f) for f in firsts), **attrs)


_NO_BAD_EXPONENT = np.array([-1, 0, 0], np.int32)
_CHECK_HERE = np.array([-2, 0, 0], np.int32)  # the call checks the exponent bytes it holds


def _exponent_check(scales):
  """int32 (row, column, byte) of the first exponent byte of `scales` ([blocks, 2] uint8)
  that the 8-bit encoder never writes, or (-1, 0, 0). For a call run per shard: computed by
  XLA over the whole array and handed to every shard's call as one replicated operand, so
  that every shard refuses together (a refusal by the shard holding the byte alone would
  leave the others waiting in the next collective, and XLA then aborts the process)."""
  if scales.size == 0:
    return jnp.asarray(_NO_BAD_EXPONENT)
  bad = ((scales > jnp.asarray(Q8_MAX_EXPONENT, jnp.uint8)) & (scales != jnp.uint8(Q8_POISONED))).reshape(-1)
  k = jnp.argmax(bad).astype(jnp.int32)
  return jnp.where(bad[k], jnp.stack([k // 2, k % 2, scales.reshape(-1)[k].astype(jnp.int32)]),
                   jnp.asarray(_NO_BAD_EXPONENT))


def _compressed_batch(args, dims, **params):
  # Always per batch element: each element's leaves keep their own blocks and indices.
  size = next(a.shape[d] for a, d in zip(args, dims) if d is not _NOT_MAPPED)
  mask = tuple(d is not _NOT_MAPPED for d in dims)
  batched = [batching.bdim_at_front(a, d, size) for a, d in zip(args, dims) if d is not _NOT_MAPPED]
  unbatched = [a for a, d in zip(args, dims) if d is _NOT_MAPPED]
  outs = _sequential(_cprim, tuple(sorted(params.items())), mask)(batched, unbatched)
  return outs, [0] * len(outs)


def _compressed_impl(*args, **params):
  return dispatch.apply_primitive(_cprim, *args, **params)


_cprim.def_impl(_compressed_impl)
_cprim.def_abstract_eval(_compressed_abstract_eval)
mlir.register_lowering(_cprim, _compressed_lowering, platform="cpu")
batching.primitive_batchers[_cprim] = _compressed_batch
ad.primitive_jvps[_cprim] = _jvp


def adam_update_compressed(count, hp_values: Sequence, leaves: List[Tuple], scales, *, moments: str, seed: int,
                           nesterov: bool, threads: int, per_shard: bool = True):
  """One FFI call for `leaves` = [(g, mu, nu, p or None)]: g float32, bfloat16 or float16;
  mu and nu bfloat16 (moments="bf16") or uint8 codes (moments="8bit", with `scales` uint8
  [blocks, 2]: every leaf's 32-element blocks in leaf order; None for bf16); p float32.
  hp_values as adam_update's. Returns ([(u, mu, nu)] per leaf, new scales or None).

  Leaf i's rounding indices start at the sum of the earlier leaves' sizes, each rounded up
  to a block. Under jit with several devices (Shardy) the call runs per shard, as
  adam_update's, on each leaf cut along dim 0 alone into shards of whole blocks (8-bit);
  a leaf cut otherwise is gathered around the call."""
  if _unavailable is not None:
    raise RuntimeError(_unavailable)
  static, hp, traced = _split_hyperparameters(hp_values)
  q8 = moments == "8bit"
  blocks = [q8_blocks(np.size(g)) for g, _, _, _ in leaves]
  if q8 and tuple(jnp.shape(scales)) != (sum(blocks), 2):
    raise ValueError(f"scales has shape {tuple(jnp.shape(scales))}, expected ({sum(blocks)}, 2): every leaf's "
                     "32-element blocks in leaf order")
  if not leaves:
    return [], scales
  operands, decays, over_grad, firsts, block = [], "", "", [], 0
  for (g, mu, nu, p), b in zip(leaves, blocks):
    shape = jnp.shape(g)
    # Which of the leaf's equal pieces this call holds: 0, the whole leaf (a shard's own
    # index under _compressed_per_shard).
    operands += [g, mu, nu] + ([p] if p is not None else []) + [jnp.zeros((1,), jnp.uint32)]
    if q8:  # the leaf's blocks' exponent bytes
      operands.append(jax.lax.slice_in_dim(scales, block, block + b))
    decays += "1" if p is not None else "0"
    over_grad += "1" if _computed_here(g) else "0"
    firsts.append(Q8_BLOCK * block)
    block += b
  params = dict(decays=decays, over_grad=over_grad, traced=traced, nesterov=bool(nesterov), threads=int(threads),
                static=static, moments=moments, seed=int(seed), firsts=tuple(firsts))
  count = jnp.asarray(count, jnp.int32)
  if per_shard and _runs_per_shard([count, hp, *operands]):
    # Each shard's call holds a piece of the exponent bytes: XLA checks the whole array.
    check = _exponent_check(scales) if q8 else jnp.asarray(_NO_BAD_EXPONENT)
    outs = _compressed_per_shard(params, [len(jnp.shape(g)) for g, _, _, _ in leaves],
                                 [tuple(jnp.shape(g)) for g, _, _, _ in leaves])(count, hp, check, *operands)
  else:  # one call holds whole leaves: it checks their exponent bytes itself
    outs = _cprim.bind(count, hp, jnp.asarray(_CHECK_HERE), *operands, **params)
  per_leaf = 4 if q8 else 3
  results = [tuple(outs[per_leaf * i:per_leaf * i + 3]) for i in range(len(leaves))]
  new_scales = jnp.concatenate([outs[per_leaf * i + 3] for i in range(len(leaves))]) if q8 else None
  return results, new_scales


def _decoded(mesh, sharding, ndim: int):
  """A sharding XLA hands a custom_partitioning op (decode_shardings=False: a GSPMDSharding)
  as a NamedSharding over `mesh` where one says the same (custom_partitioning's own
  decoding); else as it is: a cut over part of a mesh axis (a sub-axis, which Shardy
  propagates through reshapes) has no PartitionSpec, and decoding it raised IndivisibleError
  and failed the compile."""
  if sharding is None or isinstance(sharding, jax.sharding.NamedSharding) or mesh.empty:
    return sharding
  try:
    from jax._src.sharding_impls import parse_flatten_op_sharding
    spec = parse_flatten_op_sharding(sharding._to_xla_hlo_sharding(ndim), mesh)[0]
  except (ImportError, ValueError, NotImplementedError, AssertionError):  # IndivisibleError is a ValueError
    return sharding
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec, *(None,) * (ndim - len(spec))))


def _dim0_axes(mesh, sharding, shape, q8: bool):
  """The mesh axes a leaf may run per shard on: those of its sharding's dim 0 when no other
  dim is cut, the cut is even and (8-bit) each shard holds whole 32-element blocks; else
  None (the leaf is gathered around the call)."""
  spec = tuple(getattr(sharding, "spec", None) or ())
  if not shape or not isinstance(sharding, jax.sharding.NamedSharding) or not spec or spec[0] is None:
    return None
  if any(s is not None for s in spec[1:]):
    return None
  axes = (spec[0],) if isinstance(spec[0], str) else tuple(spec[0])
  shards = int(np.prod([mesh.shape[a] for a in axes]))
  row = int(np.prod(shape[1:]))
  if shape[0] % shards or (q8 and (shape[0] // shards * row) % Q8_BLOCK):
    return None
  return spec[0]


def _shard_index(mesh, axes):
  """Inside a per-shard call: this shard's index along a dimension cut over mesh `axes` (a
  name, or names major first), as uint32[1]: the shard's piece of its leaf."""
  k = jnp.uint32(0)
  for a in (axes,) if isinstance(axes, str) else axes:
    k = k * jnp.uint32(mesh.shape[a]) + jax.lax.axis_index(a).astype(jnp.uint32)
  return k.reshape(1)


def _compressed_per_shard(params, ranks, shapes):
  """adam_update_compressed's call as a custom_partitioning op (see _per_shard): each leaf
  cut along dim 0 alone into shards of whole blocks runs on each device's shard, with its
  exponent bytes cut alike and the shard's index as its piece; any other leaf is gathered
  (replicated) around the call."""
  q8 = params["moments"] == "8bit"
  decays = params["decays"]
  spans, i = [], 3
  for d in decays:
    k = (4 if d == "1" else 3) + 1 + q8  # g, mu, nu, [p], piece, [scales]
    spans.append((i, k))
    i += k

  def call(count, hp, check, *operands):
    return tuple(_cprim.bind(count, hp, check, *operands, **params))

  def partition(mesh, arg_shapes, result_shape):
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    arg_shardings, result_shardings, pieces = [replicated] * 3, [], []
    for (i, k), shape in zip(spans, shapes):
      axes = _dim0_axes(mesh, _decoded(mesh, arg_shapes[i].sharding, len(shape)), shape, q8)
      if axes is None:
        leaf = blocks = replicated
      else:
        spec = jax.sharding.PartitionSpec
        leaf = jax.sharding.NamedSharding(mesh, spec(axes, *[None] * (len(shape) - 1)))
        blocks = jax.sharding.NamedSharding(mesh, spec(axes, None))
        pieces.append((i + k - 1 - q8, axes))
      arg_shardings += [leaf] * (k - 1 - q8) + [replicated] + ([blocks] if q8 else [])
      result_shardings += [leaf] * 3 + ([blocks] if q8 else [])

    def per_shard_call(*args):
      args = list(args)
      for at, axes in pieces:
        args[at] = _shard_index(mesh, axes)
      return call(*args)
    return mesh, per_shard_call, tuple(result_shardings), tuple(arg_shardings)

  operands, results, replicated_factors = ["", "h", "c"], [], ["h", "c"]
  for leaf, ((_, k), rank) in enumerate(zip(spans, ranks)):
    dims = " ".join(f"l{leaf}d{j}" for j in range(rank))
    operands += [dims] * (k - 1 - q8) + [f"l{leaf}r"]
    replicated_factors.append(f"l{leaf}r")
    results += [dims] * 3
    if q8:
      operands.append(f"l{leaf}b l{leaf}s")
      results.append(f"l{leaf}b l{leaf}s")
      replicated_factors.append(f"l{leaf}s")
  partition._hostopt_batch = (functools.partial(_compressed_batch, **params), 3 + sum(k for _, k in spans))
  op = custom_partitioning(call)
  op.def_partition(partition=partition, sharding_rule=", ".join(operands) + " -> " + ", ".join(results),
                   need_replication_factors=tuple(replicated_factors), decode_shardings=False)
  return op
