"""torch.optim optimizers whose state and update live in hostopt.

``hostopt.torch.Adam`` and ``hostopt.torch.AdamW`` are drop-ins for torch.optim.Adam and
torch.optim.AdamW over CPU parameters: param groups with their own hyper-parameters, lr
schedulers, ``zero_grad``, closures, and ``state_dict``/``load_state_dict`` in torch's format
(``step``, ``exp_avg``, ``exp_avg_sq``), so checkpoints move both ways.

Memory: float32 parameters become views into hostopt's arena (the master weights are the
parameters: 12 bytes per parameter in all); bfloat16/float16 parameters keep float32
master weights in the arena and receive the rounded result in the same fused pass.
"""

import math
from typing import Callable, Dict, List, Optional

import numpy as np
import torch

from . import _core
from ._arrays import as_buffer

__all__ = ["Adam", "AdamW"]

_TAGS = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


class _HostAdam(torch.optim.Optimizer):
  _mode = "adamw"

  def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
               amsgrad: bool = False, *, foreach: Optional[bool] = None, maximize: bool = False,
               capturable: bool = False, differentiable: bool = False, fused: Optional[bool] = None,
               threads: int = 0):
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
    if maximize:
      raise ValueError("maximize=True is not supported by hostopt; negate the loss instead")
    if capturable or differentiable:
      raise ValueError("capturable/differentiable are CUDA-graph/autograd features hostopt does not offer")
    defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=False, foreach=foreach,
                    maximize=False, capturable=False, differentiable=False, fused=fused)
    self._threads = int(threads)
    self._cores: Dict[str, "_core.Optimizer"] = {}
    self._layout = None  # set by _build
    super().__init__(params, defaults)

  # --- layout -------------------------------------------------------------------------
  def add_param_group(self, param_group: dict) -> None:
    super().add_param_group(param_group)
    self._layout = None  # rebuilt, with the state kept, on the next step

  def _param_list(self) -> List[torch.Tensor]:
    return [p for g in self.param_groups for p in g["params"]]

  def _config(self, group: dict) -> dict:
    return {"lr": float(group["lr"]), "beta1": float(group["betas"][0]), "beta2": float(group["betas"][1]),
            "eps": float(group["eps"]), "weight_decay": float(group["weight_decay"]), "mode": self._mode}

  def _build(self) -> None:
    """One hostopt optimizer per parameter dtype (all stepped together, so their counts agree)."""
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
    step = self._resume_step()
    layout = {}
    for tag, entries in by_dtype.items():
      groups = [{"config": self._config(g), "tensors": []} for g in self.param_groups]
      for k, (gi, p) in enumerate(entries):
        groups[gi]["tensors"].append((f"{gi}.{k}", list(p.shape)))
      core = _core.Optimizer(groups, self._threads, "")
      core.step_count = step
      step_tensor = torch.tensor(float(step))
      segs = {s[0]: s for s in core.segments()}
      flat_p, flat_m, flat_v = core.params(), core.exp_avg(), core.exp_avg_sq()
      tensors = []
      for k, (gi, p) in enumerate(entries):
        _, shape, off, size, _ = segs[f"{gi}.{k}"]
        mp = flat_p[off:off + size]
        mp[:] = p.detach().reshape(-1).float().numpy()
        st = self.state[p]
        m = torch.from_numpy(flat_m[off:off + size]).view(p.shape)
        v = torch.from_numpy(flat_v[off:off + size]).view(p.shape)
        if "exp_avg" in st:  # keep state across rebuilds and loads
          m.copy_(st["exp_avg"].reshape(p.shape))
          v.copy_(st["exp_avg_sq"].reshape(p.shape))
        st["exp_avg"], st["exp_avg_sq"] = m, v
        st["step"] = step_tensor  # shared: the count is the optimizer's
        if p.dtype == torch.float32:
          p.data = torch.from_numpy(mp).view(p.shape)  # the parameter is the master weight
        tensors.append(p)
      layout[tag] = (core, tensors, step_tensor)
    self._layout = layout
    self._applied = {}  # (dtype, group) -> config last given to the core
    self._views = {}  # (dtype, index) -> (grad tensor, data_ptr, numpy view), reused while unchanged

  def _resume_step(self) -> int:
    steps = [int(st["step"]) for st in self.state.values() if "step" in st]
    return max(steps) if steps else 0

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
    configs = [self._config(g) for g in self.param_groups]  # lr schedulers and edits take effect here
    for tag, (core, tensors, step_tensor) in self._layout.items():
      for gi, cfg in enumerate(configs):
        if self._applied.get((tag, gi)) != cfg:
          core.set_group_config(gi, cfg)
          self._applied[(tag, gi)] = cfg
      grads, outs = [], []
      for i, p in enumerate(tensors):
        g = p.grad
        cached = self._views.get((tag, i))
        if g is None:
          grads.append(None)
        elif cached is not None and cached[0] is g and cached[1] == g.data_ptr():
          grads.append(cached[2])  # the same gradient tensor as last step (zero_grad keeps it)
        else:
          if g.is_sparse:
            raise RuntimeError("hostopt.torch does not support sparse gradients")
          if g.dtype != p.dtype:
            g = g.to(p.dtype)  # a gradient in another dtype than its parameter: one conversion
          view = as_buffer(g, f"grad of parameter {i}")[0]
          self._views[(tag, i)] = (p.grad, p.grad.data_ptr(), view)
          grads.append(view)
        if tag != "f32":
          outs.append(as_buffer(p.data, "param", writable=True)[0])
      if all(g is None for g in grads):
        continue
      step_tensor.fill_(float(core.step_tensors(grads, tag, outs, tag, 1.0).step))
    return loss

  def state_dict(self) -> dict:
    """torch's format. Each parameter gets its own "step" tensor (inside, one is shared),
    so torch optimizers that increment it per parameter can load it."""
    sd = super().state_dict()
    sd["state"] = {k: {**v, "step": v["step"].clone()} if "step" in v else dict(v) for k, v in sd["state"].items()}
    return sd

  def load_state_dict(self, state_dict: dict) -> None:
    """Loads torch's format (from hostopt or torch.optim.Adam/AdamW) into the arena."""
    super().load_state_dict(state_dict)
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
