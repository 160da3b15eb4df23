#include "step_plan.hpp"

#include "rounding_key.hpp"

#include <cfloat>
#include <cmath>
#include <stdexcept>
#include <string>

#include "buffer_checks.hpp"
#include "hostopt/gradient_checks.hpp"
#include "hostopt/optimizer.hpp"
#include "step_scalars.hpp"

namespace hostopt {

namespace {
// The largest gradient magnitude whose square is a finite float.
const double max_float_gradient = std::sqrt(double(FLT_MAX));
} // namespace

step_decision decide_step(const step_options& o, double raw_norm) {
  detail::check_grad_scale(o.grad_scale);
  if (!(o.max_grad_norm >= 0) || std::isinf(o.max_grad_norm))
    throw std::invalid_argument("max_grad_norm = " + std::to_string(o.max_grad_norm) +
                                ": expected a finite value >= 0 (0 = no clipping)");
  step_decision d;
  d.scale = o.grad_scale;
  if (!o.skip_nonfinite && o.max_grad_norm == 0) return d;
  const double norm = double(o.grad_scale) * raw_norm;
  d.grad_norm = norm;
  if (!std::isfinite(norm)) { // a NaN or inf gradient, or a norm that overflowed where it was computed
    // Asked not to check, and not to clip, the step goes on (returned above). Clipping by a
    // non-finite norm has no factor: an unclipped step would apply gradients that may be
    // huge but finite (a GPU norm that overflowed), so it is skipped, checked or not.
    d.apply = false;
    return d;
  }
  double seen = norm; // the norm of the gradients the kernel will see
  if (o.max_grad_norm > 0) {
    const double clip = clip_coefficient(norm, o.max_grad_norm);
    d.scale = float(double(o.grad_scale) * clip);
    seen = norm * clip;
  }
  // The kernel works in float and squares each scaled gradient for v: an element above
  // sqrt(FLT_MAX) ~ 1.8e19 makes v inf for good (and 1e30 * 1e10 overflows outright) even
  // when every input and the double norm are finite. Each |g_i| <= seen, so a seen norm
  // within that bound keeps every g and g*g finite in float.
  if (o.skip_nonfinite && !(seen <= max_float_gradient)) d.apply = false;
  return d;
}

namespace detail {

void step_plan::check_count(std::int64_t count) {
  if (count >= max_step_count)
    throw std::invalid_argument("step: the step count is at its limit (" + std::to_string(max_step_count) +
                                ", hostopt::max_step_count)");
}

namespace {
// The constants of step t for an entry whose kernel is chosen: the update rule's scalars
// and, for compressed moments, the key of the step's stochastic rounding.
void set_step_constants(group_kernel& gk, const adam_config& config, std::int64_t t, float scale) {
  gk.scalars = make_step_scalars(config, t, scale);
  if (gk.storage.format == moment_format::f32) return;
  gk.call.s = gk.scalars;
  gk.call.key = rounding_key(gk.storage.seed, t);
}
} // namespace

void step_plan::prepare(const kernel_set& ks, std::span<const adam_config> configs, const step_io& io,
                        std::span<group_kernel> groups) const {
  // With an accumulator the kernels take the f32 sum that the engine builds per block.
  const dtype kernel_grad = io.accumulator ? dtype::f32 : io.grad_type;
  for (std::size_t g = 0; g < configs.size(); ++g) {
    const kernel_variant var = variant_of(configs[g]);
    group_kernel& gk = groups[g];
    if (gk.storage.format != moment_format::f32) {
      gk.fn = nullptr;
      gk.compressed = io.delta ? ks.delta_compressed(gk.storage.format, io.grad_type)
                               : ks.adam_compressed(gk.storage.format, kernel_grad, io.out);
      gk.call.decay = var.decay;
      gk.call.nesterov = var.nesterov;
    } else {
      gk.compressed = nullptr;
      gk.fn = io.delta ? ks.delta(io.grad_type, var.decay, var.nesterov)
                       : ks.adam(kernel_grad, io.out, var.decay, var.nesterov);
    }
    set_step_constants(gk, configs[g], t_, decision_.scale);
  }
}

void step_plan::point_pieces(std::span<const adam_config> configs, std::span<group_kernel> groups,
                             const step_tensors& tensors) const {
  for (std::size_t k = 0; k < tensors.pieces.size(); ++k) {
    const std::size_t t = tensors.piece_tensor[k], g = tensors.tensors[t].group;
    if (tensors.lags[t] == 0) {
      tensors.pieces[k].group = g;
      continue;
    }
    group_kernel& own = groups[configs.size() + t];
    own = groups[g]; // its group's kernel and moment storage
    set_step_constants(own, configs[g], t_ - tensors.lags[t], decision_.scale);
    tensors.pieces[k].group = configs.size() + t;
  }
}

step_result make_step_result(const step_decision& decision, std::int64_t step_count,
                             std::int64_t skipped_steps, const block_counts& seen) {
  step_result r;
  r.applied = decision.apply;
  r.step = step_count;
  r.grad_norm = decision.grad_norm;
  r.applied_scale = decision.scale;
  r.skipped_steps = skipped_steps;
  r.poisoned_blocks = seen.poisoned;
  r.saturated_blocks = seen.saturated;
  return r;
}

void refuse_unknown_norm(const char* what) {
  throw std::invalid_argument(std::string(what) +
                              ": checks or clipping need the gradients' norm before any chunk arrives: pass "
                              "known_grad_norm (computed where the gradients are, e.g. on the GPU), or step "
                              "unchecked (skip_nonfinite = false, max_grad_norm = 0)");
}

void check_update_leaf(const std::string& at, const float* params, const_view grad, mut_view update,
                       std::size_t config, std::span<const adam_config> configs, dtype grad_type) {
  const std::size_t n = grad.size;
  if (config >= configs.size())
    throw std::invalid_argument(at + "config = " + std::to_string(config) + ": expected an index below " +
                                std::to_string(configs.size()));
  const bool decays = variant_of(configs[config]).decay != decay_kind::none;
  if (decays || params) check_view(at + "params", params, n, dtype::f32, n);
  check_view(at + "grad", grad.data, n, grad.type, n);
  check_view(at + "update", update.data, update.size, update.type, n);
  if (grad.type != grad_type)
    throw std::invalid_argument(at + "grad.type = " + std::string(dtype_name(grad.type)) + ": expected " +
                                std::string(dtype_name(grad_type)) + " (one gradient dtype per call)");
  if (update.type != grad.type)
    throw std::invalid_argument(at + "update.type = " + std::string(dtype_name(update.type)) + ": expected " +
                                std::string(dtype_name(grad.type)) + " like grad");
}

step_plan one_buffer_plan(const kernel_set& ks, std::span<const adam_config> configs, std::int64_t step,
                          const step_io& io, float grad_scale, std::span<group_kernel> groups, bool signed_rates) {
  check_step_number(step);
  for (std::size_t g = 0; g < configs.size(); ++g) {
    const std::string where = configs.size() == 1 ? "config" : "configs[" + std::to_string(g) + "]";
    if (signed_rates)
      validate_signed_rates(configs[g], where);
    else
      validate(configs[g], where);
  }
  return step_plan::make(ks, configs, step - 1, io, unchecked(grad_scale), [] { return 0.0; }, groups);
}

} // namespace detail
} // namespace hostopt
