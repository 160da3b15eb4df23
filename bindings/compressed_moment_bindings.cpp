// hostopt._core's compressed moments (bf16, and 8-bit codes with block exponents): the format
// names and byte counts, the 8-bit format's constants, and the step, encoder and decoder over
// caller-owned code arrays.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "argument_conversion.hpp"
#include "module_parts.hpp"

#include "../cpu_adam/q8_exponents.hpp" // the exponent bytes the 8-bit encoder writes
#include "hostopt/adam_config.hpp"
#include "hostopt/kernels.hpp"
#include "hostopt/moment_format.hpp"

namespace hostopt::bindings {

namespace {

// Compressed moments: numpy arrays of codes (uint16 for bf16, uint8 for 8bit) and block
// exponents (uint8), checked here for kind and layout; sizes by the library.
std::pair<void*, std::size_t> check_codes(py::handle obj, const char* what, std::size_t itemsize,
                                          bool writable) {
  if (!py::isinstance<py::array>(obj)) throw py::type_error(std::string(what) + ": expected a numpy array");
  auto arr = py::reinterpret_borrow<py::array>(obj);
  // By name: pybind11's itemsize()/kind() read numpy 1's descriptor layout (numpy 2 moved it).
  const std::string expected = "uint" + std::to_string(8 * itemsize);
  if (std::string(py::str(arr.dtype().attr("name"))) != expected ||
      !arr.dtype().attr("isnative").cast<bool>())
    throw py::type_error(std::string(what) + ": numpy dtype " + std::string(py::str(arr.dtype())) +
                         ", expected native-endian " + expected);
  if (!(arr.flags() & py::array::c_style))
    throw py::value_error(std::string(what) + ": array is not C-contiguous");
  if (writable && !arr.writeable())
    throw py::value_error(std::string(what) + ": array is read-only but hostopt writes it in place");
  return std::make_pair(const_cast<void*>(arr.data()), std::size_t(arr.size()));
}

// A tensor's compressed moments in `format` (n elements), its three arrays checked.
compressed_moments moments_of(py::handle m, py::handle v, py::handle scales, const std::string& format,
                              std::size_t n, bool writable) {
  const moment_format f = parse_moment_format(format);
  if (f == moment_format::f32) throw py::value_error("format 'f32': compressed moments are bf16 or 8bit");
  const std::size_t item = f == moment_format::bf16 ? 2 : 1;
  const auto [md, mn] = check_codes(m, "exp_avg", item, writable);
  const auto [vd, vn] = check_codes(v, "exp_avg_sq", item, writable);
  const auto [sd, sn] = check_codes(scales, "scales", 1, writable);
  if (mn != n || vn != n || sn != moment_scale_bytes(f, n))
    throw py::value_error("compressed moments: exp_avg/exp_avg_sq/scales hold " + std::to_string(mn) + "/" +
                          std::to_string(vn) + "/" + std::to_string(sn) + " elements, expected " +
                          std::to_string(n) + "/" + std::to_string(n) + "/" +
                          std::to_string(moment_scale_bytes(f, n)));
  return compressed_moments{f, md, vd, f == moment_format::q8 ? static_cast<std::uint8_t*>(sd) : nullptr};
}

} // namespace

void bind_compressed_moments(py::module_& m) {
  // The 8-bit format's constants, for the Python fronts: read from here, never copied there.
  m.attr("Q8_BLOCK") = q8_block;
  m.attr("Q8_MAX_EXPONENT_BYTES") = py::make_tuple(detail::q8_m_max_base, detail::q8_v_max_base);
  m.attr("Q8_POISONED_EXPONENT_BYTE") = detail::q8_poisoned_base;
  m.def(
      "moment_format",
      [](const std::string& name) { return std::string(moment_format_name(parse_moment_format(name))); },
      py::arg("name"),
      "The canonical name of a moment format ('f32', 'bf16', '8bit'); ValueError naming an unknown one.");
  m.def(
      "moment_scale_bytes",
      [](const std::string& format, std::size_t n) {
        return moment_scale_bytes(parse_moment_format(format), n);
      },
      "Bytes of block exponents the format needs for n elements (hostopt::moment_scale_bytes).");
  m.def(
      "adam_step_compressed",
      [](py::handle params, py::handle exp_avg, py::handle exp_avg_sq, py::handle scales,
         const std::string& format, py::handle grad, const std::string& grad_dtype, py::handle out,
         const std::string& out_dtype, py::dict config, std::int64_t step, float grad_scale,
         std::uint64_t seed, std::uint64_t first_index, std::uint64_t state_size, int threads,
         const std::string& kernel) {
        const buffer p = check_array(params, "params", "f32", true);
        const compressed_moments mo = moments_of(exp_avg, exp_avg_sq, scales, format, p.size, true);
        const buffer g = check_array(grad, "grad", grad_dtype, false);
        buffer o;
        if (!out.is_none()) o = check_array(out, "out", out_dtype, true);
        const adam_config c = config_from(config);
        py::gil_scoped_release release;
        adam_step(static_cast<float*>(p.data), mo, p.size, {g.data, g.size, g.type}, {o.data, o.size, o.type},
                  c, step, grad_scale, {seed, first_index, state_size}, {threads, kernel});
      },
      py::arg("params"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("scales"), py::arg("format"),
      py::arg("grad"), py::arg("grad_dtype") = "f32", py::arg("out") = py::none(),
      py::arg("out_dtype") = "f32", py::arg("config") = py::dict(), py::arg("step") = 1,
      py::arg("grad_scale") = 1.0f, py::arg("seed") = 0, py::arg("first_index") = 0,
      py::arg("state_size") = 0, py::arg("threads") = 0, py::arg("kernel") = "",
      "One fused Adam/AdamW step over compressed moments (see hostopt.CompressedMoments).");
  m.def(
      "encode_moments",
      [](py::handle m32, py::handle v32, py::handle exp_avg, py::handle exp_avg_sq, py::handle scales,
         const std::string& format, std::uint64_t seed) {
        const buffer a = check_array(m32, "exp_avg", "f32", false);
        const buffer b = check_array(v32, "exp_avg_sq", "f32", false);
        const compressed_moments mo = moments_of(exp_avg, exp_avg_sq, scales, format, a.size, true);
        if (b.size != a.size) throw py::value_error("exp_avg_sq: size differs from exp_avg's");
        py::gil_scoped_release release;
        encode_moments(static_cast<const float*>(a.data), static_cast<const float*>(b.data), mo, a.size,
                       {seed});
      },
      "f32 moments -> compressed (lossy).");
  m.def(
      "decode_moments",
      [](py::handle exp_avg, py::handle exp_avg_sq, py::handle scales, const std::string& format,
         py::handle m32, py::handle v32) {
        const buffer a = check_array(m32, "out exp_avg", "f32", true);
        const buffer b = check_array(v32, "out exp_avg_sq", "f32", true);
        const compressed_moments mo =
            moments_of(exp_avg, exp_avg_sq, scales, format, a.size, false); // read only
        if (b.size != a.size) throw py::value_error("exp_avg_sq: size differs from exp_avg's");
        py::gil_scoped_release release;
        decode_moments(mo, a.size, static_cast<float*>(a.data), static_cast<float*>(b.data));
      },
      "compressed -> f32 moments (exact).");
}

} // namespace hostopt::bindings
