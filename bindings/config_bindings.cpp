// hostopt._core's AdamConfig: a group's hyper-parameters as a struct, made from and shown as
// the config dict every call takes (argument_conversion.hpp's config_from and config_to).
#include <pybind11/pybind11.h>

#include <string>

#include "argument_conversion.hpp"
#include "module_parts.hpp"

#include "hostopt/adam_config.hpp"

namespace hostopt::bindings {

void bind_adam_config(py::module_& m) {
  py::class_<adam_config>(m, "AdamConfig", "Hyper-parameters of a group (hostopt::adam_config), as a struct.")
      .def(py::init([](py::kwargs kw) { return config_from(py::dict(kw)); }))
      .def("as_dict", [](const adam_config& c) { return config_to(c); })
      .def("__repr__",
           [](const adam_config& c) { return "AdamConfig(" + std::string(py::str(config_to(c))) + ")"; });
}

} // namespace hostopt::bindings
