#pragma once
// The step policy, written once: a plan decides everything about one step — validation of
// the options, the non-finite skip, the clip factor, the step number, each group's kernel
// and per-step scalars, and which of them each tensor runs — and is then executed over any
// range of the arena. The synchronous step, the chunked step (the pipeline's) and a shard's
// step all make and run plans.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>

#include "hostopt/adam_config.hpp"
#include "hostopt/dtype.hpp"
#include "hostopt/optimizer.hpp"
#include "hostopt/step_options.hpp"
#include "fp_environment.hpp"
#include "kernel_set.hpp"
#include "update_engine.hpp"

namespace hostopt::detail {

/// What a step reads and writes.
struct step_io {
  dtype grad_type = dtype::f32;
  std::optional<dtype> out;  // copy-out dtype, none when empty
  bool accumulator = false;  // the gradient is grad + an f32 accumulator (kernels read f32)
  bool delta = false;        // the optax form: the update new_p - p in the gradient's dtype
};

/// A step_io's copy-out: `t` when the step writes one, none otherwise.
inline std::optional<dtype> out_of(bool has_out, dtype t) { return has_out ? std::optional<dtype>(t) : std::nullopt; }

/// The tensors of a step over an optimizer's arena, for a plan that points each piece at its
/// kernel entry. A tensor whose own step count lags the shared one (it had no gradient in
/// some per-tensor steps) runs its own entry, groups[configs.size() + tensor], with the bias
/// correction and rounding key of its own step t - lag; every other piece runs its group's.
struct step_tensors {
  std::span<const segment> tensors;          // the layout: each tensor's group
  std::span<const std::int64_t> lags;        // per tensor: the steps it is behind the shared count
  std::span<const std::size_t> piece_tensor; // per piece: its tensor
  std::span<update_piece> pieces;            // the plan sets each one's entry (update_piece::group)
};

/// Options of a step that trusts its gradients: scaled, never checked or clipped.
inline step_options unchecked(float grad_scale) {
  step_options o;
  o.grad_scale = grad_scale;
  o.skip_nonfinite = false;
  return o;
}

class step_plan {
public:
  /// Validates `options` and the step count (std::invalid_argument) and decides the step.
  /// `norm_of_grads()` is called only when the options need a norm and none is known; it
  /// returns the unscaled gradients' norm (NaN/inf when one is non-finite). When the step
  /// applies, `groups[g]` receives group g's kernel and scalars for t = count + 1, and
  /// `tensors`' pieces their entries (step_tensors).
  template <class NormFn>
  static step_plan make(const kernel_set& ks, std::span<const adam_config> configs, std::int64_t count,
                        const step_io& io, const step_options& options, NormFn&& norm_of_grads,
                        std::span<group_kernel> groups, const step_tensors& tensors = {}) {
    const ieee_float_mode mode; // the scalars (e.g. a tiny clip factor) are not flushed either
    check_count(count);
    double raw = options.known_grad_norm; // negative: not known
    if (needs_unknown_norm(options)) {
      decide_step(options, 0.0); // name a bad option before reading any gradient
      raw = norm_of_grads();
    }
    step_plan plan(decide_step(options, raw), count + 1);
    if (plan.decision_.apply) {
      plan.prepare(ks, configs, io, groups);
      plan.point_pieces(configs, groups, tensors);
    }
    return plan;
  }

  /// Whether the step applies, its scale and the norm it was judged by.
  const step_decision& decision() const { return decision_; }
  /// The step number t the kernels use.
  std::int64_t step() const { return t_; }
  /// Refuses a step from `count` completed steps when the count is at its limit.
  static void check_count(std::int64_t count);

private:
  step_plan(step_decision d, std::int64_t t) : decision_(d), t_(t) {}
  void prepare(const kernel_set& ks, std::span<const adam_config> configs, const step_io& io,
               std::span<group_kernel> groups) const;
  void point_pieces(std::span<const adam_config> configs, std::span<group_kernel> groups,
                    const step_tensors& tensors) const;

  step_decision decision_;
  std::int64_t t_;
};

/// What a step reports: its decision, the step count after it, the steps skipped so far and
/// what its compressed kernels saw.
step_result make_step_result(const step_decision& decision, std::int64_t step_count,
                             std::int64_t skipped_steps, const block_counts& seen = {});

/// A chunked step cannot read its gradients before they arrive: the norm provider of its
/// plan refuses, naming what to pass instead.
[[noreturn]] void refuse_unknown_norm(const char* what);

/// The checks every optax-form leaf shares (adam_update of f32 and of compressed leaves):
/// its config index, its params (required when its config decays), gradient and update
/// views of the gradient's size, one gradient dtype per call, the update in that dtype.
/// `at` prefixes the messages ("leaves[3]." or "").
void check_update_leaf(const std::string& at, const float* params, const_view grad, mut_view update,
                       std::size_t config, std::span<const adam_config> configs, dtype grad_type);

/// The plan of a one-buffer step (adam_step, adam_update): the same rules and scalars as
/// the optimizer's, for step number `step` (>= 1). The optax form (`signed_rates`) takes lr
/// and weight_decay of either sign, as optax does (a negative rate ascends), and eps or
/// eps_root = +inf (Adam's term is then 0, as in optax); everything else is validated as
/// for the optimizer.
step_plan one_buffer_plan(const kernel_set& ks, std::span<const adam_config> configs, std::int64_t step,
                          const step_io& io, float grad_scale, std::span<group_kernel> groups,
                          bool signed_rates = false);

} // namespace hostopt::detail
