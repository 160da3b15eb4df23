// The argument conversions every part of hostopt._core shares (argument_conversion.hpp).
#include "argument_conversion.hpp"

#include <pybind11/numpy.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "hostopt/moment_format.hpp"

namespace hostopt::bindings {

namespace {

// Whether numpy dtype `d` holds hostopt dtype `t`: float32 for f32, float16 for f16, and
// for bf16 the uint16 view the Python layer makes (or ml_dtypes' bfloat16 itself). The
// kind is checked, not only the size: int32 is not f32, float16 is not bf16.
bool holds(const py::dtype& d, dtype t) {
  if (!d.attr("isnative").cast<bool>()) return false; // big-endian data would be read as garbage
  // Read through Python: pybind11 < 2.12 reads PyArray_Descr's fields directly, and
  // numpy 2 moved them (Debian's pybind11 would see a wrong itemsize under numpy 2).
  const char kind = py::str(d.attr("kind")).cast<std::string>()[0];
  const std::size_t size = d.attr("itemsize").cast<std::size_t>();
  switch (t) {
  case dtype::f32: return kind == 'f' && size == 4;
  case dtype::f16: return kind == 'f' && size == 2;
  case dtype::bf16: return size == 2 && (kind == 'u' || std::string(py::str(d.attr("name"))) == "bfloat16");
  }
  return false;
}

} // namespace

dtype dtype_from(const std::string& what, const std::string& name) {
  try {
    return parse_dtype(name);
  } catch (const std::invalid_argument&) {
    throw py::type_error(what + ": dtype '" + name + "' is not supported, expected f32, bf16 or f16");
  }
}

buffer check_array(const py::handle& obj, const std::string& what, const std::string& dtype_name_,
                   bool writable) {
  if (!py::isinstance<py::array>(obj))
    throw py::type_error(what + ": expected a numpy array, got " +
                         std::string(py::str(py::type::handle_of(obj).attr("__name__"))));
  auto arr = py::reinterpret_borrow<py::array>(obj);
  const dtype t = dtype_from(what, dtype_name_);
  if (!holds(arr.dtype(), t))
    throw py::type_error(what + ": numpy dtype " + std::string(py::str(arr.dtype())) + " does not hold " +
                         std::string(dtype_name(t)) + " (expected native-endian " +
                         (t == dtype::f32   ? "float32"
                          : t == dtype::f16 ? "float16"
                                            : "a uint16 view of bfloat16") +
                         ")");
  if (!(arr.flags() & py::array::c_style))
    throw py::value_error(what +
                          ": array is not C-contiguous; hostopt works in place and never copies silently "
                          "(pass numpy.ascontiguousarray(x) if a copy is what you want)");
  if (writable && !arr.writeable())
    throw py::value_error(what + ": array is read-only but hostopt writes it in place");
  buffer b;
  b.data = const_cast<void*>(arr.data());
  b.size = std::size_t(arr.size());
  b.type = t;
  return b;
}

bool is_numpy_bool(py::handle obj) {
  const py::handle t = py::type::handle_of(obj);
  return std::string(py::str(t.attr("__name__"))).rfind("bool", 0) == 0 &&
         std::string(py::str(t.attr("__module__"))) == "numpy";
}

double real_of(py::handle obj, const std::string& what) {
  const bool number = !py::isinstance<py::bool_>(obj) && !py::isinstance<py::str>(obj) &&
                      !py::isinstance<py::bytes>(obj) && !is_numpy_bool(obj) &&
                      (PyFloat_Check(obj.ptr()) || PyIndex_Check(obj.ptr()) ||
                       (Py_TYPE(obj.ptr())->tp_as_number && Py_TYPE(obj.ptr())->tp_as_number->nb_float));
  if (!number)
    throw py::type_error(what + " = " + std::string(py::repr(obj)) +
                         ": expected a real number (int or float)");
  const double v = PyFloat_AsDouble(obj.ptr());
  if (v == -1.0 && PyErr_Occurred()) {
    const bool overflow = PyErr_ExceptionMatches(PyExc_OverflowError);
    py::error_already_set e; // fetches (and clears) the Python error
    const std::string given = what + " = " + std::string(py::repr(obj)).substr(0, 60);
    if (overflow) throw py::value_error(given + ": expected a real number a double holds");
    throw py::type_error(given + ": expected a real number (int or float): " + e.what());
  }
  return v;
}

bool bool_of(py::handle obj, const std::string& what) {
  if (py::isinstance<py::bool_>(obj)) return obj.ptr() == Py_True;
  if (is_numpy_bool(obj)) return PyObject_IsTrue(obj.ptr()) == 1;
  throw py::type_error(what + " = " + std::string(py::repr(obj)) + ": expected a bool (True or False)");
}

std::string string_of(py::handle obj, const std::string& what) {
  if (!py::isinstance<py::str>(obj))
    throw py::type_error(what + " = " + std::string(py::repr(obj)) + ": expected a string (a dtype name)");
  return obj.cast<std::string>();
}

adam_config config_from(py::dict d, adam_config base) {
  for (auto item : d) {
    const std::string k = py::str(item.first);
    bool known = false;
    for_each_field(base, [&](const char* name, auto& v) {
      if (k != name) return;
      known = true;
      using T = std::decay_t<decltype(v)>;
      if constexpr (std::is_same_v<T, adam_mode>) {
        try {
          v = parse_mode(std::string(py::str(item.second)));
        } catch (const std::invalid_argument& e) {
          throw py::value_error(std::string("config: ") + e.what());
        }
      } else if constexpr (std::is_same_v<T, bool>) {
        v = bool_of(item.second, "config['" + k + "']");
      } else {
        v = T(real_of(item.second, "config['" + k + "']"));
      }
    });
    if (!known)
      throw py::value_error(
          "config: unknown key '" + k +
          "', expected lr, beta1, beta2, eps, eps_root, weight_decay, mode, bias_correction, nesterov, maximize");
  }
  return base;
}

py::dict config_to(const adam_config& c) {
  py::dict d;
  for_each_field(c, [&](const char* name, const auto& v) {
    if constexpr (std::is_same_v<std::decay_t<decltype(v)>, adam_mode>)
      d[name] = mode_name(v);
    else
      d[name] = v;
  });
  return d;
}

std::vector<param_group> groups_from(py::list groups) {
  std::vector<param_group> gs;
  for (auto g : groups) {
    const std::string at = "groups[" + std::to_string(gs.size()) + "]";
    auto d = g.cast<py::dict>();
    param_group pg;
    pg.config = config_from(d["config"].cast<py::dict>());
    if (d.contains("moments")) pg.moments = parse_moment_format(d["moments"].cast<std::string>());
    if (d.contains("rounding_seed"))
      pg.rounding_seed =
          integer_of<std::uint64_t>(d["rounding_seed"], at + "['rounding_seed']", " in [0, 2**64)", true);
    for (auto t : d["tensors"].cast<py::list>()) {
      auto tup = t.cast<py::tuple>();
      const std::string name = tup[0].cast<std::string>();
      std::vector<std::int64_t> shape;
      for (auto extent : tup[1])
        shape.push_back(integer_of<std::int64_t>(
            extent, at + ": tensor '" + name + "' shape " + std::string(py::repr(tup[1])) + ": extent",
            " in [0, 2**63)"));
      pg.tensors.push_back({name, std::move(shape)});
    }
    gs.push_back(std::move(pg));
  }
  return gs;
}

} // namespace hostopt::bindings
