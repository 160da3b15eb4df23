"""torch.optim optimizers whose state and update live in hostopt.

``hostopt.torch.Adam`` and ``hostopt.torch.AdamW`` are drop-ins for torch.optim.Adam and
torch.optim.AdamW over CPU parameters, with torch's semantics: param groups with their own
hyper-parameters (``maximize`` included), lr schedulers, ``zero_grad``, closures, a step
count per parameter (a parameter whose first gradient arrives late, or one added with
``add_param_group``, starts at step 1), and ``state_dict``/``load_state_dict`` in torch's
format (``step``, ``exp_avg``, ``exp_avg_sq``), so checkpoints move both ways.

Memory: float32 parameters become views into hostopt's arena (the master weights are the
parameters: 12 bytes per parameter in all); bfloat16/float16 parameters keep float32
master weights in the arena (``state[p]["master_param"]``, saved and loaded exactly by
``state_dict``) and receive the rounded result in the same fused pass.

Parameters stay correct whatever the user does to them: before each step, a parameter whose
``.data`` was replaced (re-initialised, ``load_state_dict(assign=True)``, ``model.to(...)``,
``share_memory_()``) or, for 16-bit parameters, written in place (``load_state_dict``) is
adopted — its values become the master weights.

``foreach`` and ``fused`` are accepted for compatibility and change nothing: hostopt's step is
always one fused pass. ``amsgrad``, ``capturable`` and ``differentiable`` are refused.
Threads: all physical cores of the process's CPU set unless ``threads=`` says otherwise
(``default_threads()``).
"""

import os
from typing import Callable, Dict, List, Optional

import numpy as np
import torch

from . import _core
from ._arrays import as_buffer

__all__ = ["Adam", "AdamW", "default_threads"]

_TAGS = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
_MOMENTS = ("exp_avg", "exp_avg_sq")
_MASTER = "master_param"  # f32 master weights of a 16-bit parameter, in state_dict


def default_threads() -> int:
  """Physical cores among the CPUs this process may run on (SMT siblings share a core's
  load/store units, so a memory-bound step gains nothing from them)."""
  try:
    cpus = os.sched_getaffinity(0)
  except AttributeError:
    return os.cpu_count() or 1
  cores = set()
  for c in cpus:
    try:
      with open(f"/sys/devices/system/cpu/cpu{c}/topology/core_id") as f:
        core = f.read().strip()
      with open(f"/sys/devices/system/cpu/cpu{c}/topology/physical_package_id") as f:
        package = f.read().strip()
    except OSError:
      return max(1, len(cpus))
    cores.add((package, core))
  return max(1, len(cores))


class _Tracked:
  """What hostopt knows of one parameter: where its master lives and what the parameter's
  storage looked like after hostopt last wrote it (to notice the user's replacements)."""
  __slots__ = ("param", "master", "ptr", "version", "dtype", "shape")

  def __init__(self, param: torch.Tensor, master: torch.Tensor):
    self.param, self.master = param, master
    self.remember()

  def remember(self) -> None:
    p = self.param
    self.ptr, self.version, self.dtype, self.shape = p.data_ptr(), p._version, p.dtype, tuple(p.shape)


class _HostAdam(torch.optim.Optimizer):
  _mode = "adamw"

  def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
               amsgrad: bool = False, *, foreach: Optional[bool] = None, maximize: bool = False,
               capturable: bool = False, differentiable: bool = False, fused: Optional[bool] = None,
               threads: Optional[int] = None):
    # torch's own checks and messages.
    if not 0.0 <= lr:
      raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
      raise ValueError(f"Invalid epsilon value: {eps}")
    if not 0.0 <= betas[0] < 1.0:
      raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
    if not 0.0 <= betas[1] < 1.0:
      raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
    if not 0.0 <= weight_decay:
      raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    if amsgrad:
      raise ValueError("amsgrad=True is not supported by hostopt (its max(v) state breaks the single pass)")
    if capturable or differentiable:
      raise ValueError("capturable/differentiable are CUDA-graph/autograd features hostopt does not offer")
    defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=False, foreach=foreach,
                    maximize=bool(maximize), capturable=False, differentiable=False, fused=fused)
    self._threads = default_threads() if threads is None else int(threads)
    self._layout = None  # set by _build
    super().__init__(params, defaults)

  # --- layout -------------------------------------------------------------------------
  def add_param_group(self, param_group: dict) -> None:
    for key in ("amsgrad", "capturable", "differentiable"):
      if param_group.get(key):
        raise ValueError(f"param group with {key}=True: not supported by hostopt")
    super().add_param_group(param_group)
    self._layout = None  # rebuilt, with the state kept, on the next step

  def _config(self, group: dict) -> dict:
    return {"lr": float(group["lr"]), "beta1": float(group["betas"][0]), "beta2": float(group["betas"][1]),
            "eps": float(group["eps"]), "weight_decay": float(group["weight_decay"]), "mode": self._mode,
            "maximize": bool(group.get("maximize", False))}

  def _build(self) -> None:
    """One hostopt optimizer per parameter dtype (stepped together), holding the master
    weights, moments and each parameter's own step count."""
    by_dtype: Dict[str, list] = {}
    for gi, group in enumerate(self.param_groups):
      for pi, p in enumerate(group["params"]):
        if p.device.type != "cpu":
          raise ValueError(f"param_groups[{gi}]['params'][{pi}] is on {p.device}: hostopt.torch steps CPU "
                           "parameters (CUDA parameters need the offload pipeline, which it does not drive yet)")
        if p.dtype not in _TAGS:
          raise TypeError(f"param_groups[{gi}]['params'][{pi}] has dtype {p.dtype}: expected float32, bfloat16 or "
                          "float16")
        by_dtype.setdefault(_TAGS[p.dtype], []).append((gi, p))
    layout = {}
    for tag, entries in by_dtype.items():
      groups = [{"config": self._config(g), "tensors": []} for g in self.param_groups]
      for k, (gi, p) in enumerate(entries):
        groups[gi]["tensors"].append((f"{gi}.{k}", list(p.shape)))
      core = _core.Optimizer(groups, self._threads, "")
      segs = {s[0]: (i, s) for i, s in enumerate(core.segments())}
      flat_p, flat_m, flat_v = core.params(), core.exp_avg(), core.exp_avg_sq()
      steps = np.zeros(len(entries), dtype=np.float32)  # torch's per-parameter "step", one view each
      seg_steps = [0] * len(segs)
      tracked, seg_of = [], []
      for k, (gi, p) in enumerate(entries):
        si, (_, shape, off, size, _) = segs[f"{gi}.{k}"]
        mp = flat_p[off:off + size]
        st = self.state[p]
        master = torch.from_numpy(mp).view(p.shape)
        if p.dtype != torch.float32 and _MASTER in st and tuple(st[_MASTER].shape) == tuple(p.shape):
          master.copy_(st[_MASTER])  # exact f32 masters from a checkpoint or an earlier layout
        else:
          master.copy_(p.detach())
        m = torch.from_numpy(flat_m[off:off + size]).view(p.shape)
        v = torch.from_numpy(flat_v[off:off + size]).view(p.shape)
        for key, view in zip(_MOMENTS, (m, v)):
          if key in st:  # keep state across rebuilds and loads
            if st[key].numel() != view.numel():
              raise ValueError(f"state of param_groups[{gi}] parameter {k}: {key} has {st[key].numel()} elements, "
                               f"the parameter {view.numel()}")
            view.copy_(st[key].reshape(p.shape))
          st[key] = view
        seg_steps[si] = int(st["step"]) if "step" in st else 0
        st["step"] = torch.from_numpy(steps[k:k + 1]).reshape(())
        if p.dtype == torch.float32:
          p.data = master  # the parameter is the master weight
          st.pop(_MASTER, None)
        else:
          st[_MASTER] = master
        tracked.append(_Tracked(p, master))
        seg_of.append(si)
      core.tensor_steps = seg_steps
      steps[:] = [seg_steps[si] for si in seg_of]
      layout[tag] = (core, tracked, steps, seg_of)
    self._layout = layout
    self._applied = {}  # (dtype, group) -> config last given to the core
    self._views = {}  # (dtype, index) -> (grad tensor, data_ptr, numpy view), reused while unchanged

  def _adopt_user_changes(self) -> None:
    """Parameters the user replaced or wrote since the last step become the masters."""
    rebuild = False
    for core, tracked, _, _ in self._layout.values():
      for t in tracked:
        p = t.param
        if p.dtype != t.dtype or tuple(p.shape) != t.shape:
          if tuple(p.shape) != t.shape:
            raise ValueError(f"a parameter changed shape from {t.shape} to {tuple(p.shape)} after it was given to "
                             "the optimizer: its moments no longer fit (make a new optimizer, or load a state)")
          self.state[p].pop(_MASTER, None)  # another dtype: its values are the new masters
          rebuild = True
        elif p.data_ptr() != t.ptr or (p.dtype != torch.float32 and p._version != t.version):
          t.master.copy_(p.detach())
          if p.dtype == torch.float32:
            p.data = t.master  # back into the arena, with the values the user gave it
          t.remember()
    if rebuild:
      self._build()

  # --- the step -----------------------------------------------------------------------
  @torch.no_grad()
  def step(self, closure: Optional[Callable[[], float]] = None):
    """Performs a single optimization step (one fused pass per parameter dtype)."""
    loss = None
    if closure is not None:
      with torch.enable_grad():
        loss = closure()
    if self._layout is None:
      self._build()
    else:
      self._adopt_user_changes()
    configs = [self._config(g) for g in self.param_groups]  # lr schedulers and edits take effect here
    for tag, (core, tracked, steps, seg_of) in self._layout.items():
      for gi, cfg in enumerate(configs):
        if self._applied.get((tag, gi)) != cfg:
          core.set_group_config(gi, cfg)
          self._applied[(tag, gi)] = cfg
      grads: List = [None] * len(seg_of)
      outs: List = [None] * len(seg_of)
      any_grad = False
      for i, t in enumerate(tracked):
        p = t.param
        g = p.grad
        cached = self._views.get((tag, i))
        if g is None:
          view = None
        elif cached is not None and cached[0] is g and cached[1] == g.data_ptr():
          view = cached[2]  # the same gradient tensor as last step (zero_grad keeps it)
        else:
          if g.is_sparse:
            raise RuntimeError("hostopt.torch does not support sparse gradients")
          if g.dtype != p.dtype:
            g = g.to(p.dtype)  # a gradient in another dtype than its parameter: one conversion
          view = as_buffer(g, f"grad of parameter {i}")[0]
          self._views[(tag, i)] = (p.grad, p.grad.data_ptr(), view)
        any_grad = any_grad or view is not None
        grads[seg_of[i]] = view
        if tag != "f32":
          outs[seg_of[i]] = as_buffer(p.data, "param", writable=True)[0]
      if not any_grad:
        continue
      core.step_tensors(grads, tag, outs if tag != "f32" else [], tag, 1.0)
      counts = core.tensor_steps
      steps[:] = [counts[si] for si in seg_of]
      if tag != "f32":
        for t in tracked:
          t.remember()  # hostopt's own write (through numpy) is not the user's
    return loss

  # --- state_dict -----------------------------------------------------------------------
  def state_dict(self) -> dict:
    """torch's format, as copies: the tensors handed out are not the arena, so an
    optimizer that loads them (torch 2 does not copy) never shares hostopt's state. 16-bit
    parameters add their f32 masters as "master_param"."""
    sd = super().state_dict()
    sd["state"] = {k: {key: (v.clone() if torch.is_tensor(v) else v) for key, v in st.items()}
                   for k, st in sd["state"].items()}
    return sd

  def load_state_dict(self, state_dict: dict) -> None:
    """Loads torch's format (from hostopt or torch.optim.Adam/AdamW) into the arena, with
    each parameter's own step; f32 moments and masters are kept exact (torch would cast
    them to a 16-bit parameter's dtype)."""
    exact = {k: {key: v for key, v in st.items() if key in _MOMENTS + (_MASTER,) and torch.is_tensor(v)}
             for k, st in state_dict["state"].items()}
    super().load_state_dict(state_dict)
    params = [p for g in self.param_groups for p in g["params"]]
    ids = [i for g in state_dict["param_groups"] for i in g["params"]]
    for index, p in zip(ids, params):
      if index in exact:
        for key, v in exact[index].items():
          self.state[p][key] = v.detach().to(dtype=torch.float32, device="cpu")
    self._layout = None
    self._build()


class Adam(_HostAdam):
  r"""Adam with coupled L2 weight decay (as torch.optim.Adam): ``g += weight_decay * p``."""
  _mode = "adam"


class AdamW(_HostAdam):
  r"""AdamW with decoupled weight decay (as torch.optim.AdamW): ``p *= 1 - lr * weight_decay``."""
  _mode = "adamw"

  def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
               amsgrad: bool = False, **kwargs):
    super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kwargs)
