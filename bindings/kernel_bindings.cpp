// hostopt._core's kernels: which ones are compiled in and which one a step uses, and the
// calls over caller-owned float32 arrays: the one-buffer step, the optax form over many
// leaves, gradient accumulation and parameter conversion. Arrays are checked, never copied;
// the work runs with the GIL released.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "argument_conversion.hpp"
#include "module_parts.hpp"

#include "hostopt/adam_config.hpp"
#include "hostopt/kernels.hpp"

namespace hostopt::bindings {

void bind_kernels(py::module_& m) {
  m.def("active_kernel", &active_kernel,
        "Name of the kernel used by default (HOSTOPT_FORCE_ARCH overrides).");
  m.def(
      "kernels",
      [] {
        py::list out;
        for (const auto& k : kernels()) out.append(py::make_tuple(k.name, k.supported));
        return out;
      },
      "(name, supported) for every kernel compiled in, best first.");

  m.def(
      "adam_step",
      [](py::handle params, py::handle exp_avg, py::handle exp_avg_sq, py::handle grad,
         const std::string& grad_dtype, py::handle out, const std::string& out_dtype, py::dict config,
         std::int64_t step, float grad_scale, int threads, const std::string& kernel) {
        const buffer p = check_array(params, "params", "f32", true);
        const buffer mm = check_array(exp_avg, "exp_avg", "f32", true);
        const buffer vv = check_array(exp_avg_sq, "exp_avg_sq", "f32", true);
        const buffer g = check_array(grad, "grad", grad_dtype, false);
        buffer o;
        if (!out.is_none()) o = check_array(out, "out", out_dtype, true);
        if (mm.size != p.size || vv.size != p.size)
          throw py::value_error("exp_avg/exp_avg_sq: " + std::to_string(mm.size) + "/" +
                                std::to_string(vv.size) + " elements, expected " + std::to_string(p.size) +
                                " like params");
        const adam_config c = config_from(config);
        py::gil_scoped_release release;
        adam_step(static_cast<float*>(p.data), static_cast<float*>(mm.data), static_cast<float*>(vv.data),
                  p.size, {g.data, g.size, g.type}, {o.data, o.size, o.type}, c, step, grad_scale,
                  {threads, kernel});
      },
      py::arg("params"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("grad"),
      py::arg("grad_dtype") = "f32", py::arg("out") = py::none(), py::arg("out_dtype") = "f32",
      py::arg("config") = py::dict(), py::arg("step") = 1, py::arg("grad_scale") = 1.0f,
      py::arg("threads") = 0, py::arg("kernel") = "",
      "One fused Adam/AdamW step in place over float32 numpy arrays (see hostopt.adam_step).");

  m.def(
      "optax_update_leaves",
      [](py::list params, py::list exp_avg, py::list exp_avg_sq, py::list grads,
         const std::string& grad_dtype, py::list updates, const std::vector<adam_config>& configs,
         const std::vector<std::size_t>& config_of, std::int64_t step, float grad_scale, int threads) {
        const std::size_t n = grads.size();
        if (params.size() != n || exp_avg.size() != n || exp_avg_sq.size() != n || updates.size() != n ||
            config_of.size() != n)
          throw py::value_error("optax_update_leaves: lists of different lengths");
        std::vector<update_leaf> leaves(n);
        for (std::size_t i = 0; i < n; ++i) {
          const std::string at = "[" + std::to_string(i) + "]";
          buffer p;
          if (!params[i].is_none()) p = check_array(params[i], "params" + at, "f32", false);
          const buffer mm = check_array(exp_avg[i], "mu" + at, "f32", true);
          const buffer vv = check_array(exp_avg_sq[i], "nu" + at, "f32", true);
          const buffer g = check_array(grads[i], "updates" + at, grad_dtype, false);
          const buffer u = check_array(updates[i], "out" + at, grad_dtype, true);
          // Every array of a leaf has the gradient's size (optax: shapes must match).
          const auto same_size = [&](const buffer& b, const char* name) {
            if (b.size != g.size)
              throw py::value_error(std::string(name) + at + " has " + std::to_string(b.size) +
                                    " elements: expected " + std::to_string(g.size) + " like updates" + at +
                                    " (mu, nu and params must have the shape of the updates)");
          };
          if (!params[i].is_none()) same_size(p, "params");
          same_size(mm, "mu");
          same_size(vv, "nu");
          same_size(u, "out");
          leaves[i] = {static_cast<const float*>(p.data), static_cast<float*>(mm.data),
                       static_cast<float*>(vv.data),      {g.data, g.size, g.type},
                       {u.data, u.size, u.type},          config_of[i]};
        }
        py::gil_scoped_release release;
        adam_update(leaves, configs, step, grad_scale, {threads, ""}); // one parallel region for all leaves
      },
      py::arg("params"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("grads"), py::arg("grad_dtype"),
      py::arg("updates"), py::arg("configs"), py::arg("config_of"), py::arg("step"),
      py::arg("grad_scale") = 1.0f, py::arg("threads") = 0,
      "The optax form over many leaves (hostopt::adam_update over update_leaf), one call, one parallel region, "
      "GIL released; configs are AdamConfig structs, config_of[i] indexes leaf i's.");

  m.def("max_threads", &max_threads, "The most worker threads a step may ask for (hostopt::max_threads).");

  m.def(
      "accumulate",
      [](py::handle acc, py::handle grad, const std::string& grad_dtype, bool first, int threads) {
        const buffer a = check_array(acc, "acc", "f32", true);
        const buffer g = check_array(grad, "grad", grad_dtype, false);
        if (a.size != g.size) throw py::value_error("accumulate: acc and grad sizes differ");
        py::gil_scoped_release release;
        accumulate_gradient(static_cast<float*>(a.data), {g.data, g.size, g.type}, first, {threads, ""});
      },
      py::arg("acc"), py::arg("grad"), py::arg("grad_dtype"), py::arg("first"), py::arg("threads") = 0,
      "acc = grad (first) or acc + grad, in f32 (hostopt::accumulate_gradient), GIL released.");

  m.def(
      "convert",
      [](py::handle in, py::handle out, const std::string& out_dtype, int threads) {
        const buffer i = check_array(in, "in", "f32", false);
        const buffer o = check_array(out, "out", out_dtype, true);
        if (i.size != o.size) throw py::value_error("convert: in and out sizes differ");
        py::gil_scoped_release release;
        convert_params(static_cast<const float*>(i.data), {o.data, o.size, o.type}, {threads, ""});
      },
      py::arg("in"), py::arg("out"), py::arg("out_dtype"), py::arg("threads") = 0,
      "float32 -> out_dtype with round-to-nearest-even (the step's copy-out rounding).");
}

} // namespace hostopt::bindings
