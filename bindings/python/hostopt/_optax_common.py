"""What every route of hostopt.optax's transformations shares: a factory call checked into
one record (Arguments), the hyper-parameters of an update (checked by the core's rule, split
into the static ones a jitted update is specialised on and its operands, schedules evaluated
at optax's counts), the leaves of an update and which of them decay, and where arrays live
(state_memory: the moments in the devices' pinned host memory).

Two transformations build on it: _optax_f32 (optax's float moments: float32 ones on the
kernel, the others on optax's own arithmetic) and _optax_compressed (bf16 or 8-bit moments,
every leaf on the kernel).
"""

import dataclasses
import inspect
from typing import Any, List, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from . import _core, _threads
from ._arrays import check_seed
from ._hyper import AdamHyperParameters
from ._masks import mask_flags
from ._xla import is_static_number

# optax's own functions, taken at import (a test may put hostopt's in their place).
OPTAX = {name: getattr(optax, name) for name in ("adam", "adamw")}
increment = getattr(optax, "safe_increment", None) or optax.safe_int32_increment
# hostopt's own options and their defaults (HostoptOptions).
OPTIONS = {"threads": 0, "reuse_state": False, "state_memory": None, "moments": "f32", "rounding_seed": 0}
# optax's arguments this front implements; a newer optax's others are taken at their default only.
KNOWN = ("learning_rate", "b1", "b2", "eps", "eps_root", "mu_dtype", "weight_decay", "mask", "nesterov")


class ScaleByAdam8bitState(NamedTuple):
  """The Adam state of hostopt.optax with moments="8bit": optax's count, each leaf's mu and
  nu as uint8 codes of its shape, and `scales`, one uint8 [blocks, 2] array of exponent
  bytes (mu's, nu's per 32-element block): each leaf's ceil(size / 32) blocks, leaf after
  leaf in leaf order. Zero bytes everywhere are zero moments."""
  count: Any
  mu_codes: Any
  nu_codes: Any
  scales: Any


ScaleByAdam8bitState.__module__ = "hostopt.optax"  # its public home: pickled states name it there


def is_traced(x) -> bool:
  return isinstance(x, jax.core.Tracer)


def not_tracing() -> bool:
  """Whether no jax transformation is tracing the caller (then numpy in gives numpy out)."""
  try:
    from jax._src import core as jax_core
    return bool(jax_core.trace_state_clean())
  except (ImportError, AttributeError):  # pragma: no cover - a jax without it: decide by the inputs alone
    return True


# --- hyper-parameters ----------------------------------------------------------------------

class Hyper(NamedTuple):
  """Adam's six hyper-parameters by the core's names, in the order the kernel and the FFI
  handlers take them. Each is a number, an array (traced or not), a schedule or its value,
  or None where there is none."""
  lr: Any = None
  beta1: Any = None
  beta2: Any = None
  eps: Any = None
  eps_root: Any = None
  weight_decay: Any = None


# How optax's signatures (and the errors) name them, and the range each error states (the
# rule itself is the core's: the optax form's, _hyper.AdamHyperParameters.refused).
OPTAX_NAMES = Hyper("learning_rate", "b1", "b2", "eps", "eps_root", "weight_decay")
RANGES = Hyper(lr="a finite value", beta1="a value in [0, 1)", beta2="a value in [0, 1)",
               eps="a value >= 0 (+inf included)", eps_root="a value >= 0 (+inf included)",
               weight_decay="a finite value")


def check_hyperparameters(hp: Hyper) -> None:
  """Refuses, naming it, a known hyper-parameter (a number, numpy array or jax array not
  being traced) outside the optax form's range (the core's rule: b1, b2 in [0, 1); eps,
  eps_root >= 0, +inf included; learning_rate, weight_decay finite, of either sign), before
  anything changes; traced ones are refused by the FFI handler that reads them, by the same
  rule. Schedules (callables) pass: they are checked where they are evaluated."""
  for field, name, rule, v in zip(Hyper._fields, OPTAX_NAMES, RANGES, hp):
    if v is None or callable(v) or is_traced(v):
      continue
    for x in np.asarray(v, dtype=np.float64).reshape(-1):
      if AdamHyperParameters(**{field: float(x)}).refused(signed_rates=True):
        raise ValueError(f"{name} = {float(x)}: expected {rule} (hostopt.optax refuses a hyper-parameter "
                         "outside its range, traced or not)")


class ByIdentity:
  """A schedule as a jit static argument: hashed by identity, so any callable will do."""
  __slots__ = ("fn",)

  def __init__(self, fn):
    self.fn = fn

  def __hash__(self):
    return id(self.fn)

  def __eq__(self, other):
    return isinstance(other, ByIdentity) and other.fn is self.fn

  def __call__(self, count):
    return self.fn(count)


call_jit = jax.jit(lambda f, x: f(x), static_argnums=0)


def schedule_counts(state, schedules: Hyper) -> Hyper:
  """The counts optax's state keeps for the learning-rate and weight-decay schedules (None
  where no schedule): the last element's count, and WeightDecaySchedule's (masked or not)."""
  *_, lr_state = state  # optax's chain: the Adam state, [the weight decay's], the learning rate's
  lr_count = lr_state.count if schedules.lr is not None else None
  wd_count = None
  if schedules.weight_decay is not None:
    _, wd_state, *_ = state
    wd_leaves = jax.tree_util.tree_leaves(wd_state)
    if not wd_leaves:
      raise TypeError(f"weight_decay is a schedule, but optax {optax.__version__}'s adamw keeps no count for it "
                      "(this optax takes a number)")
    wd_count = wd_leaves[0]
  return Hyper(lr=lr_count, weight_decay=wd_count)


def static_and_dynamic(hp: Hyper, schedules: Hyper, evaluated: bool) -> Tuple[Hyper, List[Any]]:
  """Which hyper-parameters a jitted update is specialised on, and which are its operands.

  Static: the ones known now as Python numbers (floats, attributes of the FFI call); a
  scheduled one is None (evaluated inside the call at its count) unless `evaluated`, the
  numpy route, which evaluates the schedules first. Dynamic: the others (arrays, traced or
  not) in field order, the scheduled ones excepted."""
  static = Hyper(*(None if fn is not None and not evaluated else float(v) if is_static_number(v) else None
                   for v, fn in zip(hp, schedules)))
  dynamic = [v for v, fn, known in zip(hp, schedules, static) if known is None and fn is None]
  return static, dynamic


@dataclasses.dataclass(frozen=True)
class Static:
  """What a jitted update is specialised on (hashable): everything but the arrays."""
  decays: Tuple[bool, ...]
  kernel: Tuple[bool, ...]
  hp: Hyper  # per hyper-parameter: its Python float, or None when it is an operand or scheduled
  schedules: Hyper  # ByIdentity schedules, evaluated inside the jitted call (so eager and jit agree)
  nesterov: bool
  mu_dtype: Any
  threads: int
  state_memory: Optional[str] = None  # "pinned_host": kernel leaves' mu/nu live in host memory
  moments: str = "f32"  # "bf16" or "8bit": compressed moments (every leaf on the kernel)
  seed: int = 0  # of their stochastic rounding


def resolve_hp(s: Static, dynamic, counts: Hyper) -> Hyper:
  """The six hyper-parameters inside a jitted update: static floats, schedules evaluated at
  their counts, the rest from `dynamic` in field order."""
  it = iter(dynamic)
  return Hyper(*(v if v is not None else fn(at) if fn is not None else next(it)
                 for v, fn, at in zip(s.hp, s.schedules, counts)))


# --- a factory call ------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Arguments:
  """One factory call, checked: the optax arguments this front reads and hostopt's options."""
  reference: Any  # optax's own transformation for the same arguments (its init builds the other states)
  decoupled: bool  # adamw/nadamw: weight decay (masked)
  hp: Hyper  # as given: numbers, arrays, or schedules (learning_rate; weight_decay where optax takes one)
  schedules: Hyper  # the callables among them, as ByIdentity (None elsewhere)
  mask: Any
  nesterov: bool
  mu_dtype: Any
  threads: int  # resolved: 0 became _threads.default_threads()
  reuse_state: bool
  state_memory: Optional[str]
  moments: str  # "f32", "bf16" or "8bit"
  seed: int


def arguments(args: dict, decoupled: bool) -> Arguments:
  """A factory's bound arguments (optax's, and ``hostopt_options``) as an Arguments record;
  refuses, naming it, an unknown option, a bad value of one, a known hyper-parameter outside
  its range, a non-default value for an argument of a newer optax, and compressed moments
  with mu_dtype or reuse_state."""
  options = dict(OPTIONS)
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
    raise ValueError(f"threads = {threads!r}: expected an int in [0, {_core.max_threads()}] (0 = hostopt's "
                     "default, hostopt.default_threads())")
  name = "adamw" if decoupled else "adam"
  reference_fn = OPTAX[name]
  reference = reference_fn(**args)
  hp = Hyper(lr=args["learning_rate"], beta1=args["b1"], beta2=args["b2"], eps=args["eps"],
             eps_root=args["eps_root"], weight_decay=args.get("weight_decay", 0.0) if decoupled else 0.0)
  for key, value in args.items():  # arguments of a newer optax that this front does not implement
    if key not in KNOWN and value is not inspect.signature(reference_fn).parameters[key].default:
      raise NotImplementedError(f"hostopt.optax.{name}: argument {key}={value!r} of optax {optax.__version__} is "
                                "not supported")
  check_hyperparameters(hp)  # the known ones, at once
  if moments != "f32":
    clash = [k for k, v in (("mu_dtype", args.get("mu_dtype")), ("reuse_state", reuse_state)) if v not in (None, False)]
    if clash:
      raise ValueError(f"moments={moments!r} with {clash[0]}: compressed moments live on the host kernel in their "
                       "own format (mu_dtype and reuse_state apply to optax's float moments)")
  scheduled = lambda v: ByIdentity(v) if callable(v) else None
  return Arguments(reference=reference, decoupled=decoupled, hp=hp,
                   schedules=Hyper(lr=scheduled(hp.lr), weight_decay=scheduled(hp.weight_decay)),
                   mask=args.get("mask") if decoupled else None, nesterov=bool(args.get("nesterov", False)),
                   mu_dtype=args.get("mu_dtype"), threads=_threads.resolve(int(threads)), reuse_state=reuse_state,
                   state_memory=state_memory, moments=moments, seed=seed)


# --- an update -----------------------------------------------------------------------------

def update_leaves(updates, params) -> Tuple[List[Any], Any, Optional[List[Any]]]:
  """The gradient leaves (Python scalars as arrays, as optax takes them), their treedef, and
  the params' leaves in the same order (None without params)."""
  g_leaves, treedef = jax.tree_util.tree_flatten(updates)
  g_leaves = [x if hasattr(x, "dtype") else jnp.asarray(x) for x in g_leaves]
  p_leaves = treedef.flatten_up_to(params) if params is not None else None
  if p_leaves is not None:
    p_leaves = [x if x is None or hasattr(x, "dtype") else jnp.asarray(x) for x in p_leaves]
  return g_leaves, treedef, p_leaves


def decayed(a: Arguments, updates, treedef, p_leaves) -> List[bool]:
  """Which leaves take weight decay: none without decay (adam, or a weight decay of 0),
  else as optax.masked reads the mask. Their params are required, as optax requires them."""
  wd = a.hp.weight_decay
  no_decay = is_static_number(wd) and float(wd) == 0.0 and a.schedules.weight_decay is None
  n = treedef.num_leaves
  decays = [False] * n if (not a.decoupled or no_decay) else mask_flags(a.mask, updates, treedef)
  if any(decays) and (p_leaves is None or any(p is None for p, d in zip(p_leaves, decays) if d)):
    raise ValueError("You are using a transformation that requires the current value of parameters, but you are "
                     "not passing `params` when calling `update`.")
  return decays


def update_hyper(a: Arguments, counts: Hyper, evaluate: bool) -> Hyper:
  """This update's hyper-parameters, the known ones checked before anything changes: as
  given, or with `evaluate` (the numpy route) with the schedules' values at their counts,
  evaluated by XLA as inside the jitted call of the jax route."""
  hp = a.hp
  if evaluate:
    hp = hp._replace(**{field: call_jit(fn, jnp.asarray(count))
                        for field, fn, count in zip(Hyper._fields, a.schedules, counts) if fn is not None})
  check_hyperparameters(hp)
  return hp


def counted(rest, numpy_route: bool):
  """optax's other states after an update: every leaf of them (schedule counts, masked or
  not) is a count, incremented; numpy in, numpy out."""
  keep = np.asarray if numpy_route else (lambda x: x)
  return jax.tree_util.tree_map(lambda c: keep(increment(c)), tuple(rest))


# --- where the arrays live (state_memory) ---------------------------------------------------

def place(x, kind: str, uncommitted_to=None):
  """A jax array in memory `kind` of its devices (traced arrays, placed by the caller's
  jit(init) out_shardings, and numpy arrays as they are). An uncommitted array (from numpy
  or scalar params) goes to `uncommitted_to` (replicated_like), where it cannot clash with
  the other leaves' devices under jit."""
  if isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array):
    return x
  if not x.committed and uncommitted_to is not None:
    x = jax.device_put(x, uncommitted_to)
  kinds = {m.kind for d in x.sharding.device_set for m in d.addressable_memories()}
  if kind not in kinds:
    raise ValueError(f"state_memory={kind!r}: the params' devices have memories {sorted(kinds)}")
  return jax.device_put(x, x.sharding.with_memory_kind(kind))


def replicated_like(leaves):
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


def check_in_memory(arrays, names, kind: str):
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


def to_host(leaves):
  """state_memory's route in: each kernel leaf's gradient and param (g, mu, nu, p) go to host
  memory, where the moments stay; 16-bit ones cross in 16 bits (the kernel call widens them)."""
  put = lambda x: None if x is None else jax.device_put(x, jax.memory.Space.Host)
  return [(put(g), m, v, put(p)) for g, m, v, p in leaves]


def updates_to_device(outs):
  """state_memory's route out: each leaf's update (u, mu, nu) back to device memory."""
  return [(jax.device_put(u, jax.memory.Space.Device), m, v) for u, m, v in outs]


def f32(x):
  """Exact widening to float32 (None passes)."""
  return x if x is None or x.dtype == jnp.float32 else x.astype(jnp.float32)
