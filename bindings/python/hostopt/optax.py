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
``threads`` (worker threads, 0 = ``hostopt.default_threads()``), ``reuse_state`` (numpy states
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

import inspect
from typing import Any, Callable, Dict, Optional, TypedDict

import optax

from . import _optax_compressed, _optax_f32
from ._optax_common import OPTIONS as _HOSTOPT_OPTIONS, ScaleByAdam8bitState, arguments
from ._optax_compressed import poisoned_blocks

__all__ = ["adam", "adamw", "nadam", "nadamw", "adamw_8bit", "HostoptOptions", "ScaleByAdam8bitState", "poisoned_blocks"]


# The warn-once record of every transformation of this process (CompressedMomentsWarning):
# optax.inject_hyperparams and friends build the transformation again at every update, so a
# record per transformation would warn at every update.
_BLOCKS_TOLD = type("_Told", (), {})()


def _make(args: dict, decoupled: bool) -> optax.GradientTransformationExtraArgs:
  """The transformation of one factory call: optax's float moments, or compressed ones."""
  a = arguments(args, decoupled)
  if a.moments == "f32":
    return _optax_f32.transformation(a)
  return _optax_compressed.transformation(a, _BLOCKS_TOLD)


class HostoptOptions(TypedDict, total=False):
  """hostopt's own options of hostopt.optax's factories, every one optional.

  They are keyword arguments collected apart from optax's, in ``**hostopt_options`` (whose
  annotation is ``Unpack[HostoptOptions]``), so that ``optax.inject_hyperparams`` never
  takes them for hyper-parameters: an explicit ``threads: int = 0`` parameter would be
  injected as a traced array, and the state's ``hyperparams`` would no longer be optax's.

  Attributes:
    threads (int): worker threads of the kernel; 0 (the default) is hostopt's default,
      ``hostopt.default_threads()`` (OMP_NUM_THREADS when set, else the physical cores of the process's CPU set), at most
      ``hostopt._core.max_threads()``.
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
     "worker threads of the kernel: 0 is hostopt's default, ``hostopt.default_threads()`` (OMP_NUM_THREADS when set, else the physical cores "
     "of the process's CPU set). An int in ``[0, hostopt._core.max_threads()]``, else ValueError."),
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
    other_kind, other_text = _OTHER_ARG
    kind, text = _OPTAX_ARGS.get(p.name, (other_kind, other_text.format(version=optax.__version__)))
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
