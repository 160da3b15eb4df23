// hostopt._core's rules for what the Python fronts check before any optimizer exists: a
// config's hyper-parameters by C++'s own rule (hostopt::validate, or adam_update's for the
// optax form), and the largest step count. A front asks which fields break the rule and
// phrases the error in its own words (torch's param_groups keys, optax's argument names).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "hostopt/adam_config.hpp"
#include "hostopt/optimizer.hpp"
#include "module_parts.hpp"

namespace py = pybind11;
using namespace hostopt;

namespace {

void check(const adam_config& c, bool signed_rates) {
  if (signed_rates)
    validate_signed_rates(c, "config");
  else
    validate(c, "config");
}

// The fields of `c` the rule refuses, in adam_config's field order (empty: `c` is valid).
// Each field is checked alone over the defaults, which names every bad one, not only the
// first validate() throws for: the rules are per field.
std::vector<std::string> refused_fields(const adam_config& c, bool signed_rates) {
  std::vector<std::string> refused;
  try {
    check(c, signed_rates);
    return refused;
  } catch (const std::invalid_argument&) {
  }
  for_each_field(c, [&](const char* name, const auto& value) {
    adam_config alone;
    for_each_field(alone, [&](const char* other, auto& slot) {
      if constexpr (std::is_same_v<std::decay_t<decltype(slot)>, std::decay_t<decltype(value)>>)
        if (std::strcmp(other, name) == 0) slot = value;
    });
    try {
      check(alone, signed_rates);
    } catch (const std::invalid_argument&) {
      refused.push_back(name);
    }
  });
  if (refused.empty()) check(c, signed_rates); // a rule across fields: raised with its own message
  return refused;
}

} // namespace

namespace hostopt::bindings {

void bind_hyperparameters(py::module_& m) {
  m.attr("MAX_STEP_COUNT") = max_step_count;
  m.def("refused_fields", &refused_fields, py::arg("config"), py::arg("signed_rates") = false,
        "The fields of an AdamConfig that C++'s rule refuses, in its field order ([]: valid): "
        "hostopt::validate's, or with signed_rates the optax form's (adam_update: lr and weight_decay of "
        "either sign, eps and eps_root +inf allowed).");
}

} // namespace hostopt::bindings
