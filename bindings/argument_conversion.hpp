#pragma once
// The argument conversions every part of hostopt._core shares. Arrays arrive as numpy arrays
// with an explicit hostopt dtype and are checked for type, contiguity, writability and size,
// never copied; scalars are converted here rather than by pybind11, whose errors name
// neither the argument nor the rule. Every error names the argument and what was expected.
#include <pybind11/pybind11.h>

#include <cstddef>
#include <string>
#include <vector>

#include "hostopt/adam_config.hpp"
#include "hostopt/dtype.hpp"
#include "hostopt/optimizer.hpp"
#include "hostopt/step_options.hpp"

namespace py = pybind11;

namespace hostopt::bindings {

// A checked numpy buffer.
struct buffer {
  void* data = nullptr;
  std::size_t size = 0;
  dtype type = dtype::f32;
};

// The hostopt dtype named `name` ("f32", "bf16", "f16"); TypeError naming `what` otherwise.
dtype dtype_from(const std::string& what, const std::string& name);

// `obj` as a C-contiguous numpy array holding dtype `dtype_name_` (and writable when asked).
buffer check_array(const py::handle& obj, const std::string& what, const std::string& dtype_name_,
                   bool writable);

// Whether `obj` is a numpy.bool_ (by its type, without importing numpy).
bool is_numpy_bool(py::handle obj);

// An integer argument: an int or anything with __index__ (numpy integers), never a float
// or bool truncated; pybind11's own cast refuses a float or a negative seed with an error
// that names neither the argument nor the rule. A non-integer is a TypeError, or with
// `value_error` a ValueError (as the package's check_seed raises for seeds).
template <class T>
T integer_of(py::handle obj, const std::string& what, const std::string& rule, bool value_error = false) {
  if (py::isinstance<py::bool_>(obj) || is_numpy_bool(obj) || !PyIndex_Check(obj.ptr())) {
    const std::string message = what + " = " + std::string(py::repr(obj)) + ": expected an integer" + rule;
    if (value_error) throw py::value_error(message);
    throw py::type_error(message);
  }
  const auto index = py::reinterpret_steal<py::object>(PyNumber_Index(obj.ptr()));
  if (!index) { // __index__ refused it (a float array): named, not numpy's message alone
    py::error_already_set e;
    const std::string message = what + " = " + std::string(py::repr(obj)) + ": expected an integer" + rule;
    if (value_error) throw py::value_error(message);
    throw py::type_error(message);
  }
  try {
    return index.cast<T>();
  } catch (const py::cast_error&) {
    throw py::value_error(what + " = " + std::string(py::repr(obj)) + ": expected an integer" + rule);
  }
}

// A real-number argument: a Python int or float, or a numpy scalar (anything with __float__
// or __index__ that is neither a bool nor a string); TypeError naming `what` otherwise, and
// ValueError for an int too large for a double. Converted here rather than by pybind11, whose
// errors name neither the argument nor the rule (and which takes True as 1.0).
double real_of(py::handle obj, const std::string& what);

// A bool argument: True/False or numpy.bool_, never an int, float or string taken for one
// (pybind11 takes numpy.bool_ only, with "Unable to cast Python instance" for the rest).
bool bool_of(py::handle obj, const std::string& what);

// A string argument (a dtype name), named when it is not one.
std::string string_of(py::handle obj, const std::string& what);

// Keys of a config dict: the C++ field names (adam_config's one field list). Only the
// keys given change `base`.
adam_config config_from(py::dict d, adam_config base = {});
py::dict config_to(const adam_config& c);

// [{"config": {...}, "tensors": [(name, shape), ...]}, ...] -> parameter groups.
std::vector<param_group> groups_from(py::list groups);

/// The flat step of an optimizer class (Optimizer, StoredOptimizer), as _core binds it: the
/// arrays checked, the GIL released while it runs.
template <class Opt>
step_result step_flat(Opt& o, py::handle grad, const std::string& grad_dtype, py::handle out,
                      const std::string& out_dtype, float grad_scale, double max_grad_norm, bool skip_nonfinite,
                      double known_grad_norm);

/// A step's options from the fronts' arguments (validated by the step).
inline step_options options_of(float grad_scale, double max_grad_norm, bool skip_nonfinite, double known_grad_norm) {
  step_options so;
  so.grad_scale = grad_scale;
  so.max_grad_norm = max_grad_norm;
  so.skip_nonfinite = skip_nonfinite;
  so.known_grad_norm = known_grad_norm;
  return so;
}

/// A flat step's arguments, checked: the gradient, the optional copy-out, the options.
struct flat_step_args {
  buffer grad, out;
  step_options options;
  const_view grad_view() const { return {grad.data, grad.size, grad.type}; }
  mut_view out_view() const { return {out.data, out.size, out.type}; }
};

inline flat_step_args flat_step_args_of(py::handle grad, const std::string& grad_dtype, py::handle out,
                                        const std::string& out_dtype, float grad_scale, double max_grad_norm,
                                        bool skip_nonfinite, double known_grad_norm) {
  flat_step_args a;
  a.grad = check_array(grad, "grad", grad_dtype, false);
  if (!out.is_none()) a.out = check_array(out, "out", out_dtype, true);
  a.options = options_of(grad_scale, max_grad_norm, skip_nonfinite, known_grad_norm);
  return a;
}

template <class Opt>
step_result step_flat(Opt& o, py::handle grad, const std::string& grad_dtype, py::handle out,
                      const std::string& out_dtype, float grad_scale, double max_grad_norm, bool skip_nonfinite,
                      double known_grad_norm) {
  const flat_step_args a =
      flat_step_args_of(grad, grad_dtype, out, out_dtype, grad_scale, max_grad_norm, skip_nonfinite, known_grad_norm);
  py::gil_scoped_release release;
  return o.step(a.grad_view(), a.out_view(), a.options);
}

} // namespace hostopt::bindings
