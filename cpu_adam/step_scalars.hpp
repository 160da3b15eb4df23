#pragma once
// Per-step scalars of the update rule, computed once per step and group in double, then
// rounded to float, so every kernel and every thread sees the same constants.

#include <cstdint>

#include "hostopt/adam_config.hpp"

namespace hostopt::detail {

enum class decay_kind : std::uint8_t { none = 0, coupled = 1, decoupled = 2 };

struct step_scalars {
  float grad_scale;   // g = grad_scale * grad
  float l2;           // coupled weight decay (decay_kind::coupled)
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float step_size;    // lr / bc1
  float inv_bc2;      // 1 / bc2
  float eps, eps_root;
  float decay;        // 1 - lr * wd (decay_kind::decoupled)
  float lr;           // nesterov: p -= lr * (nesterov_m * m + nesterov_g * g) / denom
  float nesterov_m;   // beta1 / (1 - beta1^(t+1))
  float nesterov_g;   // (1 - beta1) / (1 - beta1^t)
  float lr_wd;        // lr * wd (the decoupled decay of an update in optax form)
};

/// Which kernel variant a config needs.
struct kernel_variant {
  decay_kind decay;
  bool nesterov;
};

step_scalars make_step_scalars(const adam_config& c, std::int64_t step, float grad_scale);
kernel_variant variant_of(const adam_config& c);

} // namespace hostopt::detail
