"""What a step's 8-bit blocks went through, told once: every front reports a step's
``poisoned_blocks`` and ``saturated_blocks`` (hostopt::step_result) here, and the first
step that has some warns (README: "Compressed moments", 8-bit).
"""

import warnings


class CompressedMomentsWarning(RuntimeWarning):
  """A step left 8-bit moment blocks poisoned (NaN: all 32 elements, for good) or
  saturated (an element's v raised to its block's floor beside a much larger one: its
  steps shrink, frozen). Issued once per optimizer and kind, the first time a step counts
  such a block; the counts of every step are in its statistics."""


_WHAT = {
    "poisoned_blocks": ("poisoned", "their moments are NaN: all 32 parameters of each block become NaN and stay so "
                        "(restore a checkpoint; skip_nonfinite, on by default for 8-bit moments, keeps non-finite "
                        "gradients out)"),
    "saturated_blocks": ("saturated", "an element with a gradient had its second moment raised to its block's "
                         "smallest code, more than 2^33 below the block's largest (an outlier gradient beside it, "
                         "or an overflowing one): its steps shrink, frozen until the outlier's moment decays "
                         "(clipping scales both alike and does not help: find the outlier, or give this tensor f32 "
                         "moments)"),
}


def report(owner, result, front: str, stacklevel: int = 3) -> None:
  """Warns (CompressedMomentsWarning) the first time `owner`'s steps count poisoned or
  saturated blocks, once per kind; `result` is a StepResult (or has its two counts)."""
  told = owner.__dict__.setdefault("_hostopt_blocks_told", set())
  front = owner.__dict__.get("_hostopt_front", front)  # a front wrapping the owner names itself
  for key, (kind, why) in _WHAT.items():
    count = int(getattr(result, key, 0) or 0)
    if count and kind not in told:
      told.add(kind)
      warnings.warn(f"{front}: step {result.step} left {count} 8-bit moment block(s) {kind}: {why}. Warned once; "
                    f"every step's count is in its statistics ({key}). README: 'Compressed moments'.",
                    CompressedMomentsWarning, stacklevel=stacklevel)
