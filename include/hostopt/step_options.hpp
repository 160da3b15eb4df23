#pragma once
/// \file step_options.hpp
/// How a step is checked and clipped, what it did, and the one rule that decides it.

#include <cstdint>

namespace hostopt {

/// Checks and clipping of a step (all applied before anything is written).
struct step_options {
  /// Multiplies the gradients first: 1 / loss_scale (see dynamic_loss_scaler).
  float grad_scale = 1.0f;
  /// > 0: clip by global norm with optax's rule — the scaled gradients' norm N, when
  /// N >= max_grad_norm, is brought to max_grad_norm (folded into the scale: one pass).
  /// A NaN or infinite N (a non-finite gradient, or a known_grad_norm that overflowed where
  /// it was computed) has no clip factor: the step is skipped and counted in
  /// step_result::skipped_steps, with skip_nonfinite or without — never applied unclipped.
  double max_grad_norm = 0.0;
  /// Check every gradient first; a non-finite one skips the step, leaving params, moments
  /// and the step count bit-for-bit as they were (step_result says so). Costs one read of
  /// the gradients unless known_grad_norm is given. "Non-finite" is judged as the kernel
  /// computes, in float: a step whose scaled (and clipped) gradients' norm exceeds
  /// sqrt(FLT_MAX) ~ 1.8e19 is skipped too — a gradient beyond it overflows g*g (v would
  /// stay inf for good), and 1e30 scaled by 1e10 overflows outright.
  bool skip_nonfinite = true;
  /// >= 0 (or inf/NaN): the norm of the unscaled gradients, computed by the caller (e.g.
  /// on the GPU), used instead of a statistics pass. Negative: not known. Inf or NaN skips
  /// the step when it is checked (skip_nonfinite) or clipped (max_grad_norm > 0).
  double known_grad_norm = -1.0;
};

/// Whether the options decide from the gradients' norm (a check or a clip) and none is
/// known yet: the step must then read the gradients — or, where it cannot (a chunked step,
/// a shard), be given the norm.
inline bool needs_unknown_norm(const step_options& o) {
  return (o.skip_nonfinite || o.max_grad_norm > 0) && o.known_grad_norm < 0;
}

/// What a checked step does, decided from the norm of the unscaled gradients (NaN or inf
/// when one is non-finite): the one rule every step path (optimizer::step, the sharded
/// step, the offload pipeline) applies.
struct step_decision {
  bool apply = true;        ///< false: skip the step (a non-finite norm, checked or clipped)
  float scale = 1.0f;       ///< grad_scale times the clip factor: the kernel's multiplier
  double grad_norm = -1.0;  ///< norm of grad_scale * gradients (-1 when not needed)
};
/// Validates `options` (std::invalid_argument for a bad grad_scale or max_grad_norm) and
/// decides. `raw_norm` is only read when options need it (skip_nonfinite or clipping).
step_decision decide_step(const step_options& options, double raw_norm);

/// What a step did.
struct step_result {
  bool applied = false;          ///< the state was updated
  std::int64_t step = 0;         ///< step count after the call
  double grad_norm = -1.0;       ///< norm of grad_scale * gradients (-1 when not computed)
  float applied_scale = 1.0f;    ///< the gradient multiplier used: grad_scale times the clip factor
  std::int64_t skipped_steps = 0; ///< steps skipped for non-finite gradients so far
  /// 8-bit groups (moment_format::q8), counted by the step's encode over the blocks it
  /// updated (a skipped step, f32 and bf16 groups count none); integers, the same for every
  /// kernel, thread count and chunking:
  /// Blocks whose moments are NaN after the step (a NaN moment or an infinite m: all 32
  /// elements decode as NaN, for good; counted by every step that updates them).
  std::uint64_t poisoned_blocks = 0;
  /// Blocks whose range this step's encode exceeded: an element with a nonzero gradient had
  /// a v more than 2^33 below its block's largest (raised to the smallest code: its step
  /// shrinks, frozen beside an outlier), or a largest moment clamped at the top code.
  std::uint64_t saturated_blocks = 0;
};

} // namespace hostopt
