"""What a step's 8-bit blocks went through, told once: every front reports a step's
``poisoned_blocks`` and ``saturated_blocks`` (hostopt::step_result) here (README:
"Compressed moments", 8-bit). A poisoned block warns at the first step that counts one (it
never recovers); saturation warns only when it lasts: a block can be saturated for a step
at the start of training, before v is averaged (v = (1 - b2) g^2 then, so a block whose
gradients span more than 2^16.5 is counted), which the next step undoes, while an outlier
freezes its block for thousands of steps.
"""

import os
import sys
import warnings


class CompressedMomentsWarning(RuntimeWarning):
  """A step left 8-bit moment blocks poisoned (NaN: all 32 elements, for good) or
  saturated (an element's v raised to its block's floor beside a much larger one: its
  steps shrink, frozen). Poisoning is warned at the first step that counts a poisoned
  block; saturation when two applied steps in a row count saturated blocks (a block can be
  saturated for a step at the start of training, before v is averaged; the warning waits
  for saturation that lasts). Once per optimizer and kind (hostopt.optax: once per
  process); the counts of every step are in its statistics."""


_WHAT = {
    "poisoned_blocks": ("poisoned", "their moments are NaN: all 32 parameters of each block become NaN and stay so "
                        "(restore a checkpoint; skip_nonfinite, on by default for 8-bit moments, keeps non-finite "
                        "gradients out)"),
    "saturated_blocks": ("saturated", "an element with a gradient had its second moment raised to its block's "
                         "smallest code, more than 2^33 below the block's largest (an outlier gradient beside it, "
                         "or an overflowing one): its steps shrink, frozen until the outlier's moment decays "
                         "(clipping scales both alike and does not help: find the outlier, or give this tensor f32 "
                         "moments). A block can be saturated for a step at the start of training, before v is "
                         "averaged; this warning waits for saturation that lasts: the previous applied step "
                         "counted saturated blocks too"),
}


def _package_dir(name: str):
  module = sys.modules.get(name)
  path = getattr(module, "__file__", None)
  return os.path.dirname(os.path.abspath(path)) + os.sep if path else None


def _user_stacklevel() -> int:
  """The stacklevel, for a warnings.warn in report(), of the first frame outside hostopt,
  torch, optax and jax (their wrappers of step and update: torch's no_grad and optimizer
  hooks, optax.inject_hyperparams): the user's step() or update() call."""
  prefixes = tuple(p for p in map(_package_dir, ("hostopt", "torch", "optax", "jax", "jaxlib")) if p)
  frame, level = sys._getframe(2), 2  # 1: report(), which calls warnings.warn
  while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(prefixes):
    frame, level = frame.f_back, level + 1
  return level


def report(owner, result, front: str) -> None:
  """Warns (CompressedMomentsWarning) about `owner`'s steps, once per kind: at the first
  step that counts poisoned blocks, and at the second applied step in a row that counts
  saturated ones. `result` is a StepResult (or has its counts, `step` and `applied`); the
  warning points at the first frame outside hostopt and the frameworks (the user's call)."""
  state = owner.__dict__
  told = state.setdefault("_hostopt_blocks_told", set())
  front = state.get("_hostopt_front", front)  # a front wrapping the owner names itself
  applied = bool(getattr(result, "applied", True))
  for key, (kind, why) in _WHAT.items():
    count = int(getattr(result, key, 0) or 0)
    if kind == "saturated":
      if not applied:  # a skipped step counts nothing: the run of saturated steps goes on
        continue
      lasting = count > 0 and state.get("_hostopt_saturated_before", False)
      state["_hostopt_saturated_before"] = count > 0
      if not lasting:
        continue
    if count and kind not in told:
      told.add(kind)
      again = " (as did the step before)" if kind == "saturated" else ""
      warnings.warn(f"{front}: step {result.step} left {count} 8-bit moment block(s) {kind}{again}: {why}. Warned "
                    f"once; every step's count is in its statistics ({key}). README: 'Compressed moments'.",
                    CompressedMomentsWarning, stacklevel=_user_stacklevel())
