// hostopt._core's Optimizer: the flat-arena state (its tensors, groups, moments in any format
// and checkpoints) with numpy views of its memory that keep it alive, its steps over one flat
// gradient or a list of tensors, and the StepResult they return.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "argument_conversion.hpp"
#include "module_parts.hpp"

#include "hostopt/checkpoint.hpp"
#include "hostopt/kernels.hpp"
#include "hostopt/moment_format.hpp"
#include "hostopt/optimizer.hpp"
#include "hostopt/step_options.hpp"

namespace hostopt::bindings {

namespace {

// A float32 numpy view of optimizer memory that keeps the optimizer alive.
py::array_t<float> view_of(std::span<float> s, py::handle owner) {
  return py::array_t<float>({py::ssize_t(s.size())}, {py::ssize_t(sizeof(float))}, s.data(), owner);
}

} // namespace

void bind_optimizer(py::module_& m) {
  py::class_<step_result>(m, "StepResult", "What a step did (hostopt::step_result).")
      .def_readonly("applied", &step_result::applied)
      .def_readonly("step", &step_result::step)
      .def_readonly("grad_norm", &step_result::grad_norm)
      .def_readonly("applied_scale", &step_result::applied_scale)
      .def_readonly("skipped_steps", &step_result::skipped_steps)
      .def_readonly("poisoned_blocks", &step_result::poisoned_blocks)
      .def_readonly("saturated_blocks", &step_result::saturated_blocks)
      .def("__repr__", [](const step_result& r) {
        return "StepResult(applied=" + std::string(r.applied ? "True" : "False") +
               ", step=" + std::to_string(r.step) + ", grad_norm=" + std::to_string(r.grad_norm) +
               ", applied_scale=" + std::to_string(r.applied_scale) +
               ", skipped_steps=" + std::to_string(r.skipped_steps) +
               ", poisoned_blocks=" + std::to_string(r.poisoned_blocks) +
               ", saturated_blocks=" + std::to_string(r.saturated_blocks) + ")";
      });

  py::class_<optimizer>(m, "Optimizer", "Flat-arena Adam/AdamW state (see hostopt.Optimizer).")
      .def(py::init([](py::list groups, py::handle threads, const std::string& kernel) {
             return std::make_unique<optimizer>(
                 groups_from(groups),
                 execution_options{integer_of<int>(threads, "threads", " in [-2**31, 2**31)"), kernel});
           }),
           py::arg("groups"), py::arg("threads") = 0, py::arg("kernel") = "")
      .def_property_readonly("arena_size", &optimizer::arena_size)
      .def_property_readonly("num_params", &optimizer::num_params)
      .def_property_readonly("state_bytes", &optimizer::state_bytes)
      .def_property_readonly(
          "chunk_unit", &optimizer::chunk_unit,
          "Elements that chunks and shard cuts are multiples of: 16, or 32 with an 8-bit group")
      .def_property_readonly("num_groups", &optimizer::num_groups)
      .def_property("step_count", &optimizer::step_count, &optimizer::set_step_count)
      .def_property(
          "tensor_steps", &optimizer::tensor_steps,
          [](optimizer& o, const std::vector<std::int64_t>& steps) { o.set_tensor_steps(steps); },
          "Each tensor's own step count (torch's per-parameter step), in segments() order")
      .def_property_readonly("threads", [](const optimizer& o) { return o.execution().threads; })
      .def("segments",
           [](const optimizer& o) {
             py::list out;
             for (const auto& s : o.segments())
               out.append(py::make_tuple(s.name, s.shape, s.offset, s.size, s.group));
             return out;
           })
      .def("group_config", [](const optimizer& o, std::size_t g) { return config_to(o.group_config(g)); })
      .def("set_group_config",
           [](optimizer& o, std::size_t g, py::dict d) {
             o.set_group_config(g, config_from(d, o.group_config(g))); // only the keys given change
           })
      .def(
          "save",
          [](const optimizer& o, const std::string& path) {
            py::gil_scoped_release release;
            save_checkpoint(o, path);
          },
          py::arg("path"))
      .def(
          "load",
          [](optimizer& o, const std::string& path) {
            py::gil_scoped_release release;
            load_checkpoint(o, path);
          },
          py::arg("path"))
      .def_property("skipped_steps", &optimizer::skipped_steps, &optimizer::set_skipped_steps)
      .def("params", [](py::object self) { return view_of(self.cast<optimizer&>().params(), self); })
      .def("exp_avg", [](py::object self) { return view_of(self.cast<optimizer&>().exp_avg(), self); })
      .def("exp_avg_sq", [](py::object self) { return view_of(self.cast<optimizer&>().exp_avg_sq(), self); })
      .def(
          "moment_views",
          [](py::object self, const std::string& name) {
            optimizer& o = self.cast<optimizer&>();
            py::array_t<float> m = view_of(o.exp_avg(name), self); // in order: the first error names exp_avg
            return py::make_tuple(m, view_of(o.exp_avg_sq(name), self));
          },
          py::arg("name"), "float32 views of the moments of a tensor of an f32 group (any arena).")
      .def("group_rounding_seed", &optimizer::group_rounding_seed, py::arg("group"))
      .def("set_group_rounding_seed", &optimizer::set_group_rounding_seed, py::arg("group"), py::arg("seed"))
      .def(
          "group_moments",
          [](const optimizer& o, std::size_t g) {
            return std::string(moment_format_name(o.group_moments(g)));
          },
          "How group g stores its moments: 'f32', 'bf16' or '8bit'.")
      .def(
          "read_moments",
          [](const optimizer& o, const std::string& name) {
            const std::size_t n = o.tensor(name).size;
            // Explicit strides: pybind11 before 2.12 derives them from the dtype's item size,
            // which it misreads under numpy 2 (every element aliased the first).
            const std::vector<py::ssize_t> shape{py::ssize_t(n)}, strides{py::ssize_t(sizeof(float))};
            py::array_t<float> m(shape, strides), v(shape, strides);
            o.read_moments(name, {m.mutable_data(), n}, {v.mutable_data(), n});
            return py::make_tuple(m, v);
          },
          py::arg("name"), "One tensor's moments as new float32 arrays (exact), whatever its group's format.")
      .def(
          "write_moments",
          [](optimizer& o, const std::string& name, py::handle m, py::handle v) {
            const buffer a = check_array(m, "exp_avg", "f32", false);
            const buffer b = check_array(v, "exp_avg_sq", "f32", false);
            o.write_moments(name, {static_cast<const float*>(a.data), a.size},
                            {static_cast<const float*>(b.data), b.size});
          },
          py::arg("name"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
          "Sets one tensor's moments from float32 arrays (encoded, lossy, for a compressed group).")
      .def(
          "moment_codes",
          [](py::object self, const std::string& name) -> py::tuple {
            // -> py::tuple: pybind11 3's make_tuple returns typing::Tuple<element types...>, so the
            // two branches' returns would otherwise deduce different types.
            optimizer& o = self.cast<optimizer&>();
            const compressed_moments c = o.moment_codes(name);
            const auto n = py::ssize_t(o.tensor(name).size);
            if (c.format == moment_format::bf16)
              return py::make_tuple(py::array_t<std::uint16_t>({n}, {py::ssize_t(2)},
                                                               static_cast<std::uint16_t*>(c.exp_avg), self),
                                    py::array_t<std::uint16_t>({n}, {py::ssize_t(2)},
                                                               static_cast<std::uint16_t*>(c.exp_avg_sq),
                                                               self),
                                    py::none());
            const auto blocks = py::ssize_t(moment_scale_bytes(c.format, std::size_t(n)) / 2);
            return py::make_tuple(
                py::array_t<std::uint8_t>({n}, {py::ssize_t(1)}, static_cast<std::uint8_t*>(c.exp_avg), self),
                py::array_t<std::uint8_t>({n}, {py::ssize_t(1)}, static_cast<std::uint8_t*>(c.exp_avg_sq),
                                          self),
                py::array_t<std::uint8_t>({blocks, py::ssize_t(2)}, {py::ssize_t(2), py::ssize_t(1)},
                                          c.scales, self));
          },
          py::arg("name"),
          "Views of one tensor's compressed moments: (exp_avg, exp_avg_sq, scales) as uint16 bf16 bits, or uint8 "
          "codes with (blocks, 2) exponent bytes (8-bit; None for bf16).")
      .def(
          "step_flat",
          &step_flat<optimizer>,
          py::arg("grad"), py::arg("grad_dtype") = "f32", py::arg("out") = py::none(),
          py::arg("out_dtype") = "f32", py::arg("grad_scale") = 1.0f, py::arg("max_grad_norm") = 0.0,
          py::arg("skip_nonfinite") = false, py::arg("known_grad_norm") = -1.0)
      .def(
          "step_tensors",
          [](optimizer& o, py::list grads, const std::string& grad_dtype, py::list outs,
             const std::string& out_dtype, float grad_scale, double max_grad_norm, bool skip_nonfinite,
             double known_grad_norm) {
            std::vector<const_view> gv;
            std::vector<mut_view> ov;
            gv.reserve(grads.size());
            const auto segs = o.segments();
            for (std::size_t i = 0; i < grads.size(); ++i) {
              if (grads[i].is_none()) {
                gv.push_back({nullptr, 0, dtype_from("grads", grad_dtype)}); // no gradient: tensor skipped
                continue;
              }
              const std::string what =
                  "grads[" + std::to_string(i) + "]" + (i < segs.size() ? " ('" + segs[i].name + "')" : "");
              const buffer b = check_array(grads[i], what, grad_dtype, false);
              gv.push_back({b.data, b.size, b.type});
            }
            for (std::size_t i = 0; i < outs.size(); ++i) {
              const std::string what =
                  "outs[" + std::to_string(i) + "]" + (i < segs.size() ? " ('" + segs[i].name + "')" : "");
              const buffer b = check_array(outs[i], what, out_dtype, true);
              ov.push_back({b.data, b.size, b.type});
            }
            const step_options so = options_of(grad_scale, max_grad_norm, skip_nonfinite, known_grad_norm);
            py::gil_scoped_release release;
            return o.step(gv, ov, so);
          },
          py::arg("grads"), py::arg("grad_dtype") = "f32", py::arg("outs") = py::list(),
          py::arg("out_dtype") = "f32", py::arg("grad_scale") = 1.0f, py::arg("max_grad_norm") = 0.0,
          py::arg("skip_nonfinite") = false, py::arg("known_grad_norm") = -1.0)
      .def("reset_failure", &optimizer::reset_failure)
      .def_property_readonly("usable", &optimizer::usable)
      .def_property_readonly("failure_reason", &optimizer::failure_reason);
}

} // namespace hostopt::bindings
