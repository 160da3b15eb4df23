"""Adam's hyper-parameters, one model for every front: the six numbers of
hostopt::adam_config by its field names, checked by the core's own rule.

A front turns what its user gave (torch's param_groups, optax's arguments, hostopt.jax's
group options) into an AdamHyperParameters, asks :meth:`AdamHyperParameters.refused` which
fields the core refuses, and names them in its own words (``param_groups[0]['lr']``,
``learning_rate``): the rule lives in C++ (hostopt::validate, and adam_update's for the
optax form), the wording in each front. The defaults are the core's, read from it.
"""

import dataclasses
from typing import Any, Dict, Tuple

from . import _core

_DEFAULTS = _core.AdamConfig().as_dict()


@dataclasses.dataclass(frozen=True)
class AdamHyperParameters:
  """lr, beta1, beta2, eps, eps_root and weight_decay as numbers (the core's names and
  defaults). Not checked on construction: :meth:`refused` says what the core refuses."""
  lr: float = _DEFAULTS["lr"]
  beta1: float = _DEFAULTS["beta1"]
  beta2: float = _DEFAULTS["beta2"]
  eps: float = _DEFAULTS["eps"]
  eps_root: float = _DEFAULTS["eps_root"]
  weight_decay: float = _DEFAULTS["weight_decay"]

  def config(self, **flags: Any) -> Dict[str, Any]:
    """The core's config dict: these six, and the flags given (mode, bias_correction,
    nesterov, maximize)."""
    return {**dataclasses.asdict(self), **flags}

  def refused(self, signed_rates: bool = False) -> Tuple[str, ...]:
    """The fields the core's rule refuses, in field order (empty: all valid): the
    optimizer's (hostopt::validate: lr, eps, eps_root, weight_decay finite and >= 0, the
    betas in [0, 1)), or with `signed_rates` the optax form's (adam_update: lr and
    weight_decay finite of either sign, eps and eps_root >= 0 with +inf included)."""
    return tuple(_core.refused_fields(_core.AdamConfig(**dataclasses.asdict(self)), signed_rates))
