#include "step_scalars.hpp"

#include <cmath>

namespace hostopt::detail {

step_scalars make_step_scalars(const adam_config& c, std::int64_t step, float grad_scale) {
  const double t = double(step);
  const double bc1 = c.bias_correction ? 1.0 - std::pow(c.beta1, t) : 1.0;
  const double bc2 = c.bias_correction ? 1.0 - std::pow(c.beta2, t) : 1.0;
  const double bc1_next = c.bias_correction ? 1.0 - std::pow(c.beta1, t + 1.0) : 1.0;
  step_scalars s{};
  s.grad_scale = grad_scale;
  s.l2 = float(c.weight_decay);
  s.beta1 = float(c.beta1);
  s.one_minus_beta1 = float(1.0 - c.beta1);
  s.beta2 = float(c.beta2);
  s.one_minus_beta2 = float(1.0 - c.beta2);
  s.step_size = float(c.lr / bc1);
  s.inv_bc2 = float(1.0 / bc2);
  s.eps = float(c.eps);
  s.eps_root = float(c.eps_root);
  s.decay = float(1.0 - c.lr * c.weight_decay);
  s.lr = float(c.lr);
  s.nesterov_m = float(c.beta1 / bc1_next);
  s.nesterov_g = float((1.0 - c.beta1) / bc1);
  s.lr_wd = float(c.lr * c.weight_decay);
  return s;
}

kernel_variant variant_of(const adam_config& c) {
  decay_kind d = decay_kind::none;
  if (c.weight_decay != 0.0)
    d = c.mode == adam_mode::adam ? decay_kind::coupled : decay_kind::decoupled;
  return {d, c.nesterov};
}

} // namespace hostopt::detail
