#include "hostopt/adam_config.hpp"

#include <cmath>
#include <cstdio>
#include <stdexcept>

namespace hostopt {

namespace {

std::string fmt(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.17g", x);
  return buf;
}

void require(bool ok, const std::string& where, const char* field, double value,
             const char* expected) {
  if (!ok)
    throw std::invalid_argument(where + "." + field + " = " + fmt(value) + ": expected " + expected);
}

} // namespace

const char* mode_name(adam_mode mode) { return mode == adam_mode::adam ? "adam" : "adamw"; }

adam_mode parse_mode(std::string_view name) {
  if (name == "adam") return adam_mode::adam;
  if (name == "adamw") return adam_mode::adamw;
  throw std::invalid_argument("mode '" + std::string(name) + "': expected 'adam' or 'adamw'");
}

void validate(const adam_config& c, const std::string& where) {
  require(std::isfinite(c.lr) && c.lr >= 0, where, "lr", c.lr, "a finite value >= 0");
  require(c.beta1 >= 0 && c.beta1 < 1, where, "beta1", c.beta1, "a value in [0, 1)");
  require(c.beta2 >= 0 && c.beta2 < 1, where, "beta2", c.beta2, "a value in [0, 1)");
  require(std::isfinite(c.eps) && c.eps >= 0, where, "eps", c.eps, "a finite value >= 0");
  require(std::isfinite(c.eps_root) && c.eps_root >= 0, where, "eps_root", c.eps_root,
          "a finite value >= 0");
  require(std::isfinite(c.weight_decay) && c.weight_decay >= 0, where, "weight_decay",
          c.weight_decay, "a finite value >= 0");
  require(c.mode == adam_mode::adam || c.mode == adam_mode::adamw, where, "mode", double(int(c.mode)),
          "adam (0) or adamw (1)");
}

void validate_signed_rates(const adam_config& config, const std::string& where) {
  adam_config c = config;
  c.lr = std::fabs(c.lr);
  c.weight_decay = std::fabs(c.weight_decay);
  // optax's arithmetic with eps or eps_root = +inf: Adam's term is 0 (the update is the decay
  // term alone), which the kernel computes as it stands.
  if (std::isinf(c.eps) && c.eps > 0) c.eps = 0;
  if (std::isinf(c.eps_root) && c.eps_root > 0) c.eps_root = 0;
  validate(c, where);
}

} // namespace hostopt
