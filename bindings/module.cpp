// hostopt._core: a thin pybind11 layer over the C++ API. Arrays arrive as numpy arrays
// with an explicit hostopt dtype (the Python package turns torch/jax/ml_dtypes arrays into
// zero-copy numpy views first); they are checked for type, contiguity, writability and
// size (argument_conversion.hpp), never copied. Steps run with the GIL released.
#include <pybind11/pybind11.h>
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <cmath>
#include <type_traits>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "argument_conversion.hpp"
#include "hostopt/hostopt.hpp"
#include "../cpu_adam/q8_exponents.hpp" // the exponent bytes the 8-bit encoder writes

namespace py = pybind11;
using namespace hostopt;
using namespace hostopt::bindings;

namespace {

step_options options_of(float grad_scale, double max_grad_norm, bool skip_nonfinite, double known_grad_norm) {
  step_options so;
  so.grad_scale = grad_scale;
  so.max_grad_norm = max_grad_norm;
  so.skip_nonfinite = skip_nonfinite;
  so.known_grad_norm = known_grad_norm;
  return so;
}

// A float32 numpy view of optimizer memory that keeps the optimizer alive.
py::array_t<float> view_of(std::span<float> s, py::handle owner) {
  return py::array_t<float>({py::ssize_t(s.size())}, {py::ssize_t(sizeof(float))}, s.data(), owner);
}

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
sharded_call sharded_args(const sharded_optimizer& o, const sharded_handles& h, const sum_across_ranks& agreement) {
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
      py::gil_scoped_release release; // waits as the step does: the reduction takes the GIL itself
      o.refuse_step(reason, raw, agreement); // throws when other ranks wait for this one
    }
    throw; // no rank waits: this rank's own error
  }
}

} // namespace

void bind_pipeline(py::module_& m); // pipeline_bindings.cpp

PYBIND11_MODULE(_core, m) {
  m.doc() = "hostopt's C++ core: SIMD Adam/AdamW on host memory";
  m.attr("__version__") = library_version();
  // The 8-bit format's constants, for the Python fronts: read from here, never copied there.
  m.attr("Q8_BLOCK") = q8_block;
  m.attr("Q8_MAX_EXPONENT_BYTES") = py::make_tuple(detail::q8_m_max_base, detail::q8_v_max_base);
  m.attr("Q8_POISONED_EXPONENT_BYTE") = detail::q8_poisoned_base;
  m.def("active_kernel", &active_kernel, "Name of the kernel used by default (HOSTOPT_FORCE_ARCH overrides).");
  m.def("kernels", [] {
    py::list out;
    for (const auto& k : kernels()) out.append(py::make_tuple(k.name, k.supported));
    return out;
  }, "(name, supported) for every kernel compiled in, best first.");

  m.def(
      "adam_step",
      [](py::handle params, py::handle exp_avg, py::handle exp_avg_sq, py::handle grad, const std::string& grad_dtype,
         py::handle out, const std::string& out_dtype, py::dict config, std::int64_t step, float grad_scale,
         int threads, const std::string& kernel) {
        const buffer p = check_array(params, "params", "f32", true);
        const buffer mm = check_array(exp_avg, "exp_avg", "f32", true);
        const buffer vv = check_array(exp_avg_sq, "exp_avg_sq", "f32", true);
        const buffer g = check_array(grad, "grad", grad_dtype, false);
        buffer o;
        if (!out.is_none()) o = check_array(out, "out", out_dtype, true);
        if (mm.size != p.size || vv.size != p.size)
          throw py::value_error("exp_avg/exp_avg_sq: " + std::to_string(mm.size) + "/" + std::to_string(vv.size) +
                                " elements, expected " + std::to_string(p.size) + " like params");
        const adam_config c = config_from(config);
        py::gil_scoped_release release;
        adam_step(static_cast<float*>(p.data), static_cast<float*>(mm.data), static_cast<float*>(vv.data), p.size,
                  {g.data, g.size, g.type}, {o.data, o.size, o.type}, c, step, grad_scale, {threads, kernel});
      },
      py::arg("params"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("grad"), py::arg("grad_dtype") = "f32",
      py::arg("out") = py::none(), py::arg("out_dtype") = "f32", py::arg("config") = py::dict(), py::arg("step") = 1,
      py::arg("grad_scale") = 1.0f, py::arg("threads") = 0, py::arg("kernel") = "",
      "One fused Adam/AdamW step in place over float32 numpy arrays (see hostopt.adam_step).");

  // Compressed moments: numpy arrays of codes (uint16 for bf16, uint8 for 8bit) and block
  // exponents (uint8), checked here for kind and layout; sizes by the library.
  auto codes = [](py::handle obj, const char* what, std::size_t itemsize, bool writable) {
    if (!py::isinstance<py::array>(obj)) throw py::type_error(std::string(what) + ": expected a numpy array");
    auto arr = py::reinterpret_borrow<py::array>(obj);
    // By name: pybind11's itemsize()/kind() read numpy 1's descriptor layout (numpy 2 moved it).
    const std::string expected = "uint" + std::to_string(8 * itemsize);
    if (std::string(py::str(arr.dtype().attr("name"))) != expected || !arr.dtype().attr("isnative").cast<bool>())
      throw py::type_error(std::string(what) + ": numpy dtype " + std::string(py::str(arr.dtype())) +
                           ", expected native-endian " + expected);
    if (!(arr.flags() & py::array::c_style)) throw py::value_error(std::string(what) + ": array is not C-contiguous");
    if (writable && !arr.writeable())
      throw py::value_error(std::string(what) + ": array is read-only but hostopt writes it in place");
    return std::make_pair(const_cast<void*>(arr.data()), std::size_t(arr.size()));
  };
  auto moments_of = [codes](py::handle m, py::handle v, py::handle scales, const std::string& format, std::size_t n,
                            bool writable) {
    const moment_format f = parse_moment_format(format);
    if (f == moment_format::f32) throw py::value_error("format 'f32': compressed moments are bf16 or 8bit");
    const std::size_t item = f == moment_format::bf16 ? 2 : 1;
    const auto [md, mn] = codes(m, "exp_avg", item, writable);
    const auto [vd, vn] = codes(v, "exp_avg_sq", item, writable);
    const auto [sd, sn] = codes(scales, "scales", 1, writable);
    if (mn != n || vn != n || sn != moment_scale_bytes(f, n))
      throw py::value_error("compressed moments: exp_avg/exp_avg_sq/scales hold " + std::to_string(mn) + "/" +
                            std::to_string(vn) + "/" + std::to_string(sn) + " elements, expected " + std::to_string(n) +
                            "/" + std::to_string(n) + "/" + std::to_string(moment_scale_bytes(f, n)));
    return compressed_moments{f, md, vd, f == moment_format::q8 ? static_cast<std::uint8_t*>(sd) : nullptr};
  };
  m.def(
      "moment_scale_bytes",
      [](const std::string& format, std::size_t n) { return moment_scale_bytes(parse_moment_format(format), n); },
      "Bytes of block exponents the format needs for n elements (hostopt::moment_scale_bytes).");
  m.def(
      "adam_step_compressed",
      [moments_of](py::handle params, py::handle exp_avg, py::handle exp_avg_sq, py::handle scales,
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
        adam_step(static_cast<float*>(p.data), mo, p.size, {g.data, g.size, g.type}, {o.data, o.size, o.type}, c, step,
                  grad_scale, {seed, first_index, state_size}, {threads, kernel});
      },
      py::arg("params"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("scales"), py::arg("format"),
      py::arg("grad"), py::arg("grad_dtype") = "f32", py::arg("out") = py::none(), py::arg("out_dtype") = "f32",
      py::arg("config") = py::dict(), py::arg("step") = 1, py::arg("grad_scale") = 1.0f, py::arg("seed") = 0,
      py::arg("first_index") = 0, py::arg("state_size") = 0, py::arg("threads") = 0, py::arg("kernel") = "",
      "One fused Adam/AdamW step over compressed moments (see hostopt.CompressedMoments).");
  m.def(
      "encode_moments",
      [moments_of](py::handle m32, py::handle v32, py::handle exp_avg, py::handle exp_avg_sq, py::handle scales,
                   const std::string& format, std::uint64_t seed) {
        const buffer a = check_array(m32, "exp_avg", "f32", false);
        const buffer b = check_array(v32, "exp_avg_sq", "f32", false);
        const compressed_moments mo = moments_of(exp_avg, exp_avg_sq, scales, format, a.size, true);
        if (b.size != a.size) throw py::value_error("exp_avg_sq: size differs from exp_avg's");
        py::gil_scoped_release release;
        encode_moments(static_cast<const float*>(a.data), static_cast<const float*>(b.data), mo, a.size, {seed});
      },
      "f32 moments -> compressed (lossy).");
  m.def(
      "decode_moments",
      [moments_of](py::handle exp_avg, py::handle exp_avg_sq, py::handle scales, const std::string& format,
                   py::handle m32, py::handle v32) {
        const buffer a = check_array(m32, "out exp_avg", "f32", true);
        const buffer b = check_array(v32, "out exp_avg_sq", "f32", true);
        const compressed_moments mo = moments_of(exp_avg, exp_avg_sq, scales, format, a.size, false); // read only
        if (b.size != a.size) throw py::value_error("exp_avg_sq: size differs from exp_avg's");
        py::gil_scoped_release release;
        decode_moments(mo, a.size, static_cast<float*>(a.data), static_cast<float*>(b.data));
      },
      "compressed -> f32 moments (exact).");

  py::class_<adam_config>(m, "AdamConfig", "Hyper-parameters of a group (hostopt::adam_config), as a struct.")
      .def(py::init([](py::kwargs kw) { return config_from(py::dict(kw)); }))
      .def("as_dict", [](const adam_config& c) { return config_to(c); })
      .def("__repr__", [](const adam_config& c) { return "AdamConfig(" + std::string(py::str(config_to(c))) + ")"; });

  m.def(
      "optax_update_leaves",
      [](py::list params, py::list exp_avg, py::list exp_avg_sq, py::list grads, const std::string& grad_dtype,
         py::list updates, const std::vector<adam_config>& configs, const std::vector<std::size_t>& config_of,
         std::int64_t step, float grad_scale, int threads) {
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
          leaves[i] = {static_cast<const float*>(p.data), static_cast<float*>(mm.data), static_cast<float*>(vv.data),
                       {g.data, g.size, g.type}, {u.data, u.size, u.type}, config_of[i]};
        }
        py::gil_scoped_release release;
        adam_update(leaves, configs, step, grad_scale, {threads, ""}); // one parallel region for all leaves
      },
      py::arg("params"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("grads"), py::arg("grad_dtype"),
      py::arg("updates"), py::arg("configs"), py::arg("config_of"), py::arg("step"), py::arg("grad_scale") = 1.0f,
      py::arg("threads") = 0,
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

  m.def("moment_format", [](const std::string& name) { return std::string(moment_format_name(parse_moment_format(name))); },
        py::arg("name"), "The canonical name of a moment format ('f32', 'bf16', '8bit'); ValueError naming an unknown one.");
  m.def("shard_of", [](std::size_t arena_size, int world, int rank, std::size_t unit) {
    const shard_range r = shard_of(arena_size, world, rank, unit);
    return py::make_tuple(r.begin, r.end);
  }, py::arg("arena_size"), py::arg("world_size"), py::arg("rank"), py::arg("unit") = 16,
     "[begin, end) of the arena owned by `rank` (hostopt::shard_of): cut on multiples of `unit` (16; 32 when a "
     "group has 8-bit moments, as ShardedOptimizer and Optimizer.chunk_unit use).");

  py::register_exception<sharded_step_refused>(m, "ShardedStepRefused", PyExc_RuntimeError);
  py::class_<sharded_optimizer>(m, "ShardedOptimizer",
                                "One rank's shard of the optimizer state (see hostopt.ShardedOptimizer).")
      .def(py::init([](py::list groups, py::handle world, py::handle rank, py::handle threads) {
             const std::string int32 = " in [-2**31, 2**31)";
             return std::make_unique<sharded_optimizer>(
                 groups_from(groups), integer_of<int>(world, "world_size", int32), integer_of<int>(rank, "rank", int32),
                 execution_options{integer_of<int>(threads, "threads", int32), ""});
           }),
           py::arg("groups"), py::arg("world_size"), py::arg("rank"), py::arg("threads") = 0)
      .def_property_readonly("arena_size", &sharded_optimizer::arena_size)
      .def_property_readonly("shard", [](const sharded_optimizer& o) { return py::make_tuple(o.shard().begin, o.shard().end); })
      .def_property_readonly("step_count", [](const sharded_optimizer& o) { return o.local().step_count(); })
      .def_property_readonly("state_bytes", [](const sharded_optimizer& o) { return o.local().state_bytes(); })
      .def("segments", [](const sharded_optimizer& o) {
        py::list out;
        for (const auto& s : o.segments()) out.append(py::make_tuple(s.name, s.shape, s.offset, s.size, s.group));
        return out;
      })
      .def("set_params", [](sharded_optimizer& o, const std::string& name, py::handle values) {
        const buffer b = check_array(values, "values", "f32", false);
        o.set_params(name, std::span<const float>(static_cast<const float*>(b.data), b.size));
      })
      .def("shard_sum_squares", [](const sharded_optimizer& o, py::handle grad, const std::string& dt) {
        const buffer b = check_array(grad, "shard_grad", dt, false);
        py::gil_scoped_release release;
        return o.shard_stats({b.data, b.size, b.type}).sum_squares;
      }, py::arg("shard_grad"), py::arg("grad_dtype") = "f32")
      .def("step", [](sharded_optimizer& o, py::handle grad, py::handle gdt, py::handle out, py::handle odt,
                      py::handle grad_scale, py::handle known_grad_norm, py::handle max_grad_norm,
                      py::handle skip_nonfinite) {
        const sharded_call c =
            sharded_args(o, {grad, gdt, out, odt, grad_scale, known_grad_norm, max_grad_norm, skip_nonfinite}, {});
        step_result r;
        {
          py::gil_scoped_release release;
          r = o.step({c.grad.data, c.grad.size, c.grad.type}, {c.out.data, c.out.size, c.out.type}, c.options);
        }
        return py::make_tuple(r.applied, r.step);
      }, py::arg("shard_grad"), py::arg("grad_dtype") = "f32", py::arg("shard_params") = py::none(),
         py::arg("params_dtype") = "f32", py::arg("grad_scale") = 1.0f, py::arg("known_grad_norm") = -1.0,
         py::arg("max_grad_norm") = 0.0, py::arg("skip_nonfinite") = true,
         "Steps the shard (sharded_optimizer::step). With a norm reduction and a checked or clipping step, the "
         "ranks agree first: a step refused on any rank raises ShardedStepRefused on every rank, nothing applied.")
      .def("check_step", [](const sharded_optimizer& o, py::handle grad, py::handle gdt, py::handle out,
                            py::handle odt, py::handle grad_scale, py::handle known_grad_norm,
                            py::handle max_grad_norm, py::handle skip_nonfinite) {
        const buffer g = check_array(grad, "shard_grad", string_of(gdt, "grad_dtype"), false);
        buffer b;
        if (!out.is_none()) b = check_array(out, "shard_params", string_of(odt, "params_dtype"), true);
        const step_options so =
            sharded_options({grad, gdt, out, odt, grad_scale, known_grad_norm, max_grad_norm, skip_nonfinite});
        o.check_step({g.data, g.size, g.type}, {b.data, b.size, b.type}, so);
      }, py::arg("shard_grad"), py::arg("grad_dtype") = "f32", py::arg("shard_params") = py::none(),
         py::arg("params_dtype") = "f32", py::arg("grad_scale") = 1.0f, py::arg("known_grad_norm") = -1.0,
         py::arg("max_grad_norm") = 0.0, py::arg("skip_nonfinite") = true,
         "Raises what step would refuse on this rank, given the global norm (known_grad_norm may still be -1), "
         "changing nothing and calling no reduction: fold its verdict into the norm's all-reduce.")
      .def("agree_step", [](const sharded_optimizer& o, py::handle grad, py::handle gdt, py::handle out,
                            py::handle odt, py::handle grad_scale, py::handle known_grad_norm,
                            py::handle max_grad_norm, py::handle skip_nonfinite, py::function reduce) {
        const sum_across_ranks sum = python_sum(std::move(reduce));
        const sharded_call c =
            sharded_args(o, {grad, gdt, out, odt, grad_scale, known_grad_norm, max_grad_norm, skip_nonfinite}, sum);
        py::gil_scoped_release release;
        o.agree_step({c.grad.data, c.grad.size, c.grad.type}, {c.out.data, c.out.size, c.out.type}, c.options, sum);
      }, py::arg("shard_grad"), py::arg("grad_dtype") = "f32", py::arg("shard_params") = py::none(),
         py::arg("params_dtype") = "f32", py::arg("grad_scale") = 1.0f, py::arg("known_grad_norm") = -1.0,
         py::arg("max_grad_norm") = 0.0, py::arg("skip_nonfinite") = true, py::kw_only(),
         py::arg("sum_across_ranks"),
         "The agreement a reducing step makes, through sum_across_ranks (collective: every rank, before a step "
         "given known_grad_norm): ShardedStepRefused on every rank when any rank would refuse the step.")
      .def("save", [](const sharded_optimizer& o, const std::string& dir, const std::string& save_id) {
             py::gil_scoped_release release;
             o.save(dir, save_id);
           }, py::arg("dir"), py::arg("save_id"))
      .def("commit_save", [](const sharded_optimizer& o, const std::string& dir, const std::string& save_id) {
             py::gil_scoped_release release;
             o.commit_save(dir, save_id);
           }, py::arg("dir"), py::arg("save_id"))
      .def("set_norm_reduction", [](sharded_optimizer& o, py::function reduce) {
             o.set_norm_reduction(python_sum(std::move(reduce))); // called from the step, without the GIL
           }, py::arg("sum_across_ranks"),
           "sum_across_ranks(local) -> total across every rank (e.g. torch.distributed.all_reduce in float64): a "
           "checked or clipping step calls it twice, for the ranks' refusals and for the sums of squares.")
      .def("load", [](sharded_optimizer& o, const std::string& dir) {
             py::gil_scoped_release release;
             o.load(dir);
           }, py::arg("dir"));

  py::class_<step_result>(m, "StepResult", "What a step did (hostopt::step_result).")
      .def_readonly("applied", &step_result::applied)
      .def_readonly("step", &step_result::step)
      .def_readonly("grad_norm", &step_result::grad_norm)
      .def_readonly("applied_scale", &step_result::applied_scale)
      .def_readonly("skipped_steps", &step_result::skipped_steps)
      .def_readonly("poisoned_blocks", &step_result::poisoned_blocks)
      .def_readonly("saturated_blocks", &step_result::saturated_blocks)
      .def("__repr__", [](const step_result& r) {
        return "StepResult(applied=" + std::string(r.applied ? "True" : "False") + ", step=" + std::to_string(r.step) +
               ", grad_norm=" + std::to_string(r.grad_norm) + ", applied_scale=" + std::to_string(r.applied_scale) +
               ", skipped_steps=" + std::to_string(r.skipped_steps) +
               ", poisoned_blocks=" + std::to_string(r.poisoned_blocks) +
               ", saturated_blocks=" + std::to_string(r.saturated_blocks) + ")";
      });

  py::class_<optimizer>(m, "Optimizer", "Flat-arena Adam/AdamW state (see hostopt.Optimizer).")
      .def(py::init([](py::list groups, py::handle threads, const std::string& kernel) {
             return std::make_unique<optimizer>(
                 groups_from(groups), execution_options{integer_of<int>(threads, "threads", " in [-2**31, 2**31)"), kernel});
           }),
           py::arg("groups"), py::arg("threads") = 0, py::arg("kernel") = "")
      .def_property_readonly("arena_size", &optimizer::arena_size)
      .def_property_readonly("num_params", &optimizer::num_params)
      .def_property_readonly("state_bytes", &optimizer::state_bytes)
      .def_property_readonly("chunk_unit", &optimizer::chunk_unit,
                             "Elements that chunks and shard cuts are multiples of: 16, or 32 with an 8-bit group")
      .def_property_readonly("num_groups", &optimizer::num_groups)
      .def_property("step_count", &optimizer::step_count, &optimizer::set_step_count)
      .def_property(
          "tensor_steps", &optimizer::tensor_steps,
          [](optimizer& o, const std::vector<std::int64_t>& steps) { o.set_tensor_steps(steps); },
          "Each tensor's own step count (torch's per-parameter step), in segments() order")
      .def_property_readonly("threads", [](const optimizer& o) { return o.execution().threads; })
      .def("segments", [](const optimizer& o) {
        py::list out;
        for (const auto& s : o.segments()) out.append(py::make_tuple(s.name, s.shape, s.offset, s.size, s.group));
        return out;
      })
      .def("group_config", [](const optimizer& o, std::size_t g) { return config_to(o.group_config(g)); })
      .def("set_group_config", [](optimizer& o, std::size_t g, py::dict d) {
        o.set_group_config(g, config_from(d, o.group_config(g))); // only the keys given change
      })
      .def("save", [](const optimizer& o, const std::string& path) {
             py::gil_scoped_release release;
             save_checkpoint(o, path);
           }, py::arg("path"))
      .def("load", [](optimizer& o, const std::string& path) {
             py::gil_scoped_release release;
             load_checkpoint(o, path);
           }, py::arg("path"))
      .def_property("skipped_steps", &optimizer::skipped_steps, &optimizer::set_skipped_steps)
      .def("params", [](py::object self) { return view_of(self.cast<optimizer&>().params(), self); })
      .def("exp_avg", [](py::object self) { return view_of(self.cast<optimizer&>().exp_avg(), self); })
      .def("exp_avg_sq", [](py::object self) { return view_of(self.cast<optimizer&>().exp_avg_sq(), self); })
      .def("moment_views", [](py::object self, const std::string& name) {
        optimizer& o = self.cast<optimizer&>();
        py::array_t<float> m = view_of(o.exp_avg(name), self); // in order: the first error names exp_avg
        return py::make_tuple(m, view_of(o.exp_avg_sq(name), self));
      }, py::arg("name"), "float32 views of the moments of a tensor of an f32 group (any arena).")
      .def("group_rounding_seed", &optimizer::group_rounding_seed, py::arg("group"))
      .def("set_group_rounding_seed", &optimizer::set_group_rounding_seed, py::arg("group"), py::arg("seed"))
      .def("group_moments", [](const optimizer& o, std::size_t g) {
        return std::string(moment_format_name(o.group_moments(g)));
      }, "How group g stores its moments: 'f32', 'bf16' or '8bit'.")
      .def("read_moments", [](const optimizer& o, const std::string& name) {
        const std::size_t n = o.tensor(name).size;
        // Explicit strides: pybind11 before 2.12 derives them from the dtype's item size,
        // which it misreads under numpy 2 (every element aliased the first).
        const std::vector<py::ssize_t> shape{py::ssize_t(n)}, strides{py::ssize_t(sizeof(float))};
        py::array_t<float> m(shape, strides), v(shape, strides);
        o.read_moments(name, {m.mutable_data(), n}, {v.mutable_data(), n});
        return py::make_tuple(m, v);
      }, py::arg("name"), "One tensor's moments as new float32 arrays (exact), whatever its group's format.")
      .def("write_moments", [](optimizer& o, const std::string& name, py::handle m, py::handle v) {
        const buffer a = check_array(m, "exp_avg", "f32", false);
        const buffer b = check_array(v, "exp_avg_sq", "f32", false);
        o.write_moments(name, {static_cast<const float*>(a.data), a.size}, {static_cast<const float*>(b.data), b.size});
      }, py::arg("name"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
         "Sets one tensor's moments from float32 arrays (encoded, lossy, for a compressed group).")
      .def("moment_codes", [](py::object self, const std::string& name) -> py::tuple {
        // -> py::tuple: pybind11 3's make_tuple returns typing::Tuple<element types...>, so the
        // two branches' returns would otherwise deduce different types.
        optimizer& o = self.cast<optimizer&>();
        const compressed_moments c = o.moment_codes(name);
        const auto n = py::ssize_t(o.tensor(name).size);
        if (c.format == moment_format::bf16)
          return py::make_tuple(py::array_t<std::uint16_t>({n}, {py::ssize_t(2)}, static_cast<std::uint16_t*>(c.exp_avg), self),
                                py::array_t<std::uint16_t>({n}, {py::ssize_t(2)}, static_cast<std::uint16_t*>(c.exp_avg_sq), self),
                                py::none());
        const auto blocks = py::ssize_t(moment_scale_bytes(c.format, std::size_t(n)) / 2);
        return py::make_tuple(py::array_t<std::uint8_t>({n}, {py::ssize_t(1)}, static_cast<std::uint8_t*>(c.exp_avg), self),
                              py::array_t<std::uint8_t>({n}, {py::ssize_t(1)}, static_cast<std::uint8_t*>(c.exp_avg_sq), self),
                              py::array_t<std::uint8_t>({blocks, py::ssize_t(2)}, {py::ssize_t(2), py::ssize_t(1)}, c.scales, self));
      }, py::arg("name"),
         "Views of one tensor's compressed moments: (exp_avg, exp_avg_sq, scales) as uint16 bf16 bits, or uint8 "
         "codes with (blocks, 2) exponent bytes (8-bit; None for bf16).")
      .def("step_flat",
           [](optimizer& o, py::handle grad, const std::string& grad_dtype, py::handle out, const std::string& out_dtype,
              float grad_scale, double max_grad_norm, bool skip_nonfinite, double known_grad_norm) {
             const buffer g = check_array(grad, "grad", grad_dtype, false);
             buffer b;
             if (!out.is_none()) b = check_array(out, "out", out_dtype, true);
             const step_options so = options_of(grad_scale, max_grad_norm, skip_nonfinite, known_grad_norm);
             py::gil_scoped_release release;
             return o.step({g.data, g.size, g.type}, {b.data, b.size, b.type}, so);
           },
           py::arg("grad"), py::arg("grad_dtype") = "f32", py::arg("out") = py::none(), py::arg("out_dtype") = "f32",
           py::arg("grad_scale") = 1.0f, py::arg("max_grad_norm") = 0.0, py::arg("skip_nonfinite") = false,
           py::arg("known_grad_norm") = -1.0)
      .def("step_tensors",
           [](optimizer& o, py::list grads, const std::string& grad_dtype, py::list outs, const std::string& out_dtype,
              float grad_scale, double max_grad_norm, bool skip_nonfinite, double known_grad_norm) {
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
           py::arg("grads"), py::arg("grad_dtype") = "f32", py::arg("outs") = py::list(), py::arg("out_dtype") = "f32",
           py::arg("grad_scale") = 1.0f, py::arg("max_grad_norm") = 0.0, py::arg("skip_nonfinite") = false,
           py::arg("known_grad_norm") = -1.0)
      .def("reset_failure", &optimizer::reset_failure)
      .def_property_readonly("usable", &optimizer::usable)
      .def_property_readonly("failure_reason", &optimizer::failure_reason);
  bind_pipeline(m);
}
