// hostopt._core's sharded optimizer: one rank's shard of the state, where to cut the arena,
// and the agreement the ranks make through a Python reduction before a checked or clipping
// step, so that a step refused on one rank raises ShardedStepRefused on every rank.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstddef>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <utility>

#include "argument_conversion.hpp"
#include "module_parts.hpp"

#include "hostopt/kernels.hpp"
#include "hostopt/sharding.hpp"
#include "hostopt/step_options.hpp"

namespace hostopt::bindings {

namespace {

// A Python callable as a reduction the C++ step calls with the GIL released: copies of it
// (the step copies the one set) share one holder, so no copy touches a Python refcount
// without the GIL; the call takes the GIL.
sum_across_ranks python_sum(py::function f) {
  struct holder {
    py::function f;
    ~holder() {
      if (!Py_IsInitialized()) {
        f.release(); // the interpreter is gone: nothing to release it to
        return;
      }
      py::gil_scoped_acquire acquire;
      f = py::function();
    }
  };
  auto h = std::make_shared<holder>();
  h->f = std::move(f);
  return [h](double local) {
    py::gil_scoped_acquire acquire;
    return h->f(local).cast<double>();
  };
}

// A sharded step's arguments, converted here (not by pybind11 before the call: a conversion
// error there would skip the agreement). A conversion refused on one rank still joins the
// agreement the other ranks make (sharded_optimizer::refuse_step), so that every rank
// raises ShardedStepRefused instead of the others waiting in the reduction for good.
struct sharded_handles {
  py::handle grad, gdt, out, odt, grad_scale, known_grad_norm, max_grad_norm, skip_nonfinite;
};
struct sharded_call {
  buffer grad, out;
  step_options options;
};
step_options sharded_options(const sharded_handles& h) {
  step_options so;
  so.grad_scale = float(real_of(h.grad_scale, "grad_scale"));
  so.known_grad_norm = real_of(h.known_grad_norm, "known_grad_norm");
  so.max_grad_norm = real_of(h.max_grad_norm, "max_grad_norm");
  so.skip_nonfinite = bool_of(h.skip_nonfinite, "skip_nonfinite");
  return so;
}
sharded_call sharded_args(const sharded_optimizer& o, const sharded_handles& h,
                          const sum_across_ranks& agreement) {
  try {
    sharded_call c;
    c.grad = check_array(h.grad, "shard_grad", string_of(h.gdt, "grad_dtype"), false);
    if (!h.out.is_none()) c.out = check_array(h.out, "shard_params", string_of(h.odt, "params_dtype"), true);
    c.options = sharded_options(h);
    return c;
  } catch (const std::exception& e) {
    const std::string reason = e.what();
    // What decides whether the other ranks agree: each option as given, its default where
    // it does not convert (the default step checks, so it agrees).
    step_options raw;
    const auto as_given = [](auto convert) {
      try {
        convert();
      } catch (const std::exception&) {
      }
    };
    as_given([&] { raw.grad_scale = float(real_of(h.grad_scale, "grad_scale")); });
    as_given([&] { raw.known_grad_norm = real_of(h.known_grad_norm, "known_grad_norm"); });
    as_given([&] { raw.max_grad_norm = real_of(h.max_grad_norm, "max_grad_norm"); });
    as_given([&] { raw.skip_nonfinite = bool_of(h.skip_nonfinite, "skip_nonfinite"); });
    {
      py::gil_scoped_release release;        // waits as the step does: the reduction takes the GIL itself
      o.refuse_step(reason, raw, agreement); // throws when other ranks wait for this one
    }
    throw; // no rank waits: this rank's own error
  }
}

} // namespace

void bind_sharded(py::module_& m) {
  m.def(
      "shard_of",
      [](std::size_t arena_size, int world, int rank, std::size_t unit) {
        const shard_range r = shard_of(arena_size, world, rank, unit);
        return py::make_tuple(r.begin, r.end);
      },
      py::arg("arena_size"), py::arg("world_size"), py::arg("rank"), py::arg("unit") = 16,
      "[begin, end) of the arena owned by `rank` (hostopt::shard_of): cut on multiples of `unit` (16; 32 when a "
      "group has 8-bit moments, as ShardedOptimizer and Optimizer.chunk_unit use).");
  m.def(
      "shard_of_groups",
      [](py::list groups, int world, int rank) {
        const shard_range r = shard_of(groups_from(groups), world, rank);
        return py::make_tuple(r.begin, r.end);
      },
      py::arg("groups"), py::arg("world_size"), py::arg("rank"),
      "[begin, end) of the groups' layout owned by `rank` (hostopt::shard_of(groups, ...)): the unit is 32 when a "
      "group has 8-bit moments, else 16.");

  py::register_exception<sharded_step_refused>(m, "ShardedStepRefused", PyExc_RuntimeError);
  py::class_<sharded_optimizer>(m, "ShardedOptimizer",
                                "One rank's shard of the optimizer state (see hostopt.ShardedOptimizer).")
      .def(py::init([](py::list groups, py::handle world, py::handle rank, py::handle threads) {
             const std::string int32 = " in [-2**31, 2**31)";
             return std::make_unique<sharded_optimizer>(
                 groups_from(groups), integer_of<int>(world, "world_size", int32),
                 integer_of<int>(rank, "rank", int32),
                 execution_options{integer_of<int>(threads, "threads", int32), ""});
           }),
           py::arg("groups"), py::arg("world_size"), py::arg("rank"), py::arg("threads") = 0)
      .def_property_readonly("arena_size", &sharded_optimizer::arena_size)
      .def_property_readonly(
          "shard", [](const sharded_optimizer& o) { return py::make_tuple(o.shard().begin, o.shard().end); })
      .def_property_readonly("step_count", [](const sharded_optimizer& o) { return o.local().step_count(); })
      .def_property_readonly("state_bytes",
                             [](const sharded_optimizer& o) { return o.local().state_bytes(); })
      .def("segments",
           [](const sharded_optimizer& o) {
             py::list out;
             for (const auto& s : o.segments())
               out.append(py::make_tuple(s.name, s.shape, s.offset, s.size, s.group));
             return out;
           })
      // This rank's hyper-parameters (set them alike on every rank, as torch's param_groups).
      .def("group_config",
           [](const sharded_optimizer& o, std::size_t g) {
             adam_config c;
             {
               py::gil_scoped_release release; // (the shard's lock: a step may hold it)
               c = o.local().group_config(g);
             }
             return config_to(c);
           })
      .def("set_group_config",
           [](sharded_optimizer& o, std::size_t g, py::dict d) {
             adam_config base;
             {
               py::gil_scoped_release release;
               base = o.local().group_config(g);
             }
             const adam_config c = config_from(d, base); // only the keys given change
             py::gil_scoped_release release;
             o.local().set_group_config(g, c);
           })
      .def("set_params",
           [](sharded_optimizer& o, const std::string& name, py::handle values) {
             const buffer b = check_array(values, "values", "f32", false);
             o.set_params(name, std::span<const float>(static_cast<const float*>(b.data), b.size));
           })
      .def(
          "shard_sum_squares",
          [](const sharded_optimizer& o, py::handle grad, const std::string& dt) {
            const buffer b = check_array(grad, "shard_grad", dt, false);
            py::gil_scoped_release release;
            return o.shard_stats({b.data, b.size, b.type}).sum_squares;
          },
          py::arg("shard_grad"), py::arg("grad_dtype") = "f32")
      .def(
          "step",
          [](sharded_optimizer& o, py::handle grad, py::handle gdt, py::handle out, py::handle odt,
             py::handle grad_scale, py::handle known_grad_norm, py::handle max_grad_norm,
             py::handle skip_nonfinite) {
            const sharded_call c = sharded_args(
                o, {grad, gdt, out, odt, grad_scale, known_grad_norm, max_grad_norm, skip_nonfinite}, {});
            step_result r;
            {
              py::gil_scoped_release release;
              r = o.step({c.grad.data, c.grad.size, c.grad.type}, {c.out.data, c.out.size, c.out.type},
                         c.options);
            }
            return py::make_tuple(r.applied, r.step);
          },
          py::arg("shard_grad"), py::arg("grad_dtype") = "f32", py::arg("shard_params") = py::none(),
          py::arg("params_dtype") = "f32", py::arg("grad_scale") = 1.0f, py::arg("known_grad_norm") = -1.0,
          py::arg("max_grad_norm") = 0.0, py::arg("skip_nonfinite") = true,
          "Steps the shard (sharded_optimizer::step). With a norm reduction and a checked or clipping step, the "
          "ranks agree first: a step refused on any rank raises ShardedStepRefused on every rank, nothing applied.")
      .def(
          "check_step",
          [](const sharded_optimizer& o, py::handle grad, py::handle gdt, py::handle out, py::handle odt,
             py::handle grad_scale, py::handle known_grad_norm, py::handle max_grad_norm,
             py::handle skip_nonfinite) {
            const buffer g = check_array(grad, "shard_grad", string_of(gdt, "grad_dtype"), false);
            buffer b;
            if (!out.is_none()) b = check_array(out, "shard_params", string_of(odt, "params_dtype"), true);
            const step_options so = sharded_options(
                {grad, gdt, out, odt, grad_scale, known_grad_norm, max_grad_norm, skip_nonfinite});
            o.check_step({g.data, g.size, g.type}, {b.data, b.size, b.type}, so);
          },
          py::arg("shard_grad"), py::arg("grad_dtype") = "f32", py::arg("shard_params") = py::none(),
          py::arg("params_dtype") = "f32", py::arg("grad_scale") = 1.0f, py::arg("known_grad_norm") = -1.0,
          py::arg("max_grad_norm") = 0.0, py::arg("skip_nonfinite") = true,
          "Raises what step would refuse on this rank, given the global norm (known_grad_norm may still be -1), "
          "changing nothing and calling no reduction: fold its verdict into the norm's all-reduce.")
      .def(
          "agree_step",
          [](const sharded_optimizer& o, py::handle grad, py::handle gdt, py::handle out, py::handle odt,
             py::handle grad_scale, py::handle known_grad_norm, py::handle max_grad_norm,
             py::handle skip_nonfinite, py::function reduce) {
            const sum_across_ranks sum = python_sum(std::move(reduce));
            const sharded_call c = sharded_args(
                o, {grad, gdt, out, odt, grad_scale, known_grad_norm, max_grad_norm, skip_nonfinite}, sum);
            py::gil_scoped_release release;
            o.agree_step({c.grad.data, c.grad.size, c.grad.type}, {c.out.data, c.out.size, c.out.type},
                         c.options, sum);
          },
          py::arg("shard_grad"), py::arg("grad_dtype") = "f32", py::arg("shard_params") = py::none(),
          py::arg("params_dtype") = "f32", py::arg("grad_scale") = 1.0f, py::arg("known_grad_norm") = -1.0,
          py::arg("max_grad_norm") = 0.0, py::arg("skip_nonfinite") = true, py::kw_only(),
          py::arg("sum_across_ranks"),
          "The agreement a reducing step makes, through sum_across_ranks (collective: every rank, before a step "
          "given known_grad_norm): ShardedStepRefused on every rank when any rank would refuse the step.")
      .def(
          "save",
          [](const sharded_optimizer& o, const std::string& dir, const std::string& save_id) {
            py::gil_scoped_release release;
            o.save(dir, save_id);
          },
          py::arg("dir"), py::arg("save_id"))
      .def(
          "commit_save",
          [](const sharded_optimizer& o, const std::string& dir, const std::string& save_id) {
            py::gil_scoped_release release;
            o.commit_save(dir, save_id);
          },
          py::arg("dir"), py::arg("save_id"))
      .def(
          "set_norm_reduction",
          [](sharded_optimizer& o, py::function reduce) {
            o.set_norm_reduction(python_sum(std::move(reduce))); // called from the step, without the GIL
          },
          py::arg("sum_across_ranks"),
          "sum_across_ranks(local) -> total across every rank (e.g. torch.distributed.all_reduce in float64): a "
          "checked or clipping step calls it twice, for the ranks' refusals and for the sums of squares.")
      .def(
          "load",
          [](sharded_optimizer& o, const std::string& dir) {
            py::gil_scoped_release release;
            o.load(dir);
          },
          py::arg("dir"));
}

} // namespace hostopt::bindings
