#pragma once
/// \file adam_config.hpp
/// Hyper-parameters of one parameter group.

#include <string>
#include <string_view>

namespace hostopt {

/// How weight decay enters the update.
enum class adam_mode : unsigned char {
  adam = 0,  ///< coupled L2: g += wd * p before the moments (torch.optim.Adam)
  adamw = 1, ///< decoupled: p *= 1 - lr * wd before the update (torch AdamW, optax.adamw)
};

/// Hyper-parameters of the Adam/AdamW update (see docs/design.md, "The update rule"). Names
/// follow torch.optim; eps_root and nesterov follow optax. All may change between steps.
struct adam_config {
  double lr = 1e-3;           ///< learning rate, >= 0 and finite
  double beta1 = 0.9;         ///< first-moment decay, in [0, 1)
  double beta2 = 0.999;       ///< second-moment decay, in [0, 1)
  double eps = 1e-8;          ///< added outside the square root, >= 0 and finite
  double eps_root = 0.0;      ///< added inside the square root (optax), >= 0 and finite
  double weight_decay = 0.0;  ///< >= 0 and finite; meaning set by `mode`
  adam_mode mode = adam_mode::adamw;
  bool bias_correction = true; ///< divide the moments by 1 - beta^t
  bool nesterov = false;       ///< Nesterov momentum as optax.nadam/nadamw
  bool maximize = false;       ///< ascend (torch's maximize): the gradient is negated first
};

/// Calls f(name, field) for every field, in a fixed order, with the names torch and optax
/// users know (f receives double&, adam_mode& or bool&): how checkpoints and the Python
/// bindings serialise a config, so the list of fields exists once.
template <class Config, class F>
void for_each_field(Config& c, F&& f) {
  f("lr", c.lr);
  f("beta1", c.beta1);
  f("beta2", c.beta2);
  f("eps", c.eps);
  f("eps_root", c.eps_root);
  f("weight_decay", c.weight_decay);
  f("mode", c.mode);
  f("bias_correction", c.bias_correction);
  f("nesterov", c.nesterov);
  f("maximize", c.maximize);
}

/// "adam" or "adamw"; parse_mode is its inverse (std::invalid_argument naming the text).
const char* mode_name(adam_mode mode);
adam_mode parse_mode(std::string_view name);

/// Throws std::invalid_argument naming the first bad field, its value and the expected
/// range. `where` prefixes the message (e.g. "group 2").
void validate(const adam_config& config, const std::string& where = "adam_config");

/// The optax form's rule (adam_update): validate's, except that lr and weight_decay may have
/// either sign (a negative rate ascends) and eps or eps_root may be +inf (Adam's term is then
/// 0), as optax takes them. Throws like validate.
void validate_signed_rates(const adam_config& config, const std::string& where = "adam_config");

} // namespace hostopt
