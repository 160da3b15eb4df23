#include "step_scalars.hpp"

#include <cmath>

namespace hostopt::detail {

namespace {

// b^t by binary exponentiation: a fixed sequence of IEEE multiplies, so the same bits on
// every CPU and C library (glibc's pow is not correctly rounded, and its FMA and non-FMA
// versions differ in the last bit). Error: a few ulp of double, far below float's.
double power(double b, std::int64_t t) {
  double result = 1.0, x = b;
  for (std::uint64_t e = std::uint64_t(t); e; e >>= 1) {
    if (e & 1) result *= x;
    x *= x;
  }
  return result;
}

} // namespace

step_scalars make_step_scalars(const adam_config& c, std::int64_t step, float grad_scale) {
  const double bc1 = c.bias_correction ? 1.0 - power(c.beta1, step) : 1.0;
  const double bc2 = c.bias_correction ? 1.0 - power(c.beta2, step) : 1.0;
  const double bc1_next = c.bias_correction ? 1.0 - power(c.beta1, step + 1) : 1.0;
  step_scalars s{};
  s.grad_scale = c.maximize ? -grad_scale : grad_scale; // torch: grad = -grad, before weight decay
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
