// hostopt._core's StoredOptimizer: the optimizer state on a drive (store/stored_optimizer),
// created, opened or imported from an Optimizer, stepped with a flat gradient, exported into
// an Optimizer. The GIL is released while it streams.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstddef>
#include <memory>
#include <optional>
#include <utility>
#include <string>

#include "argument_conversion.hpp"
#include "module_parts.hpp"
#include "hostopt/sharding.hpp"
#include "hostopt/stored_optimizer.hpp"

namespace hostopt::bindings {

namespace {

/// A const getter of stored_optimizer, called with the GIL released.
template <class R>
auto released(R (stored_optimizer::*get)() const) {
  return [get](const stored_optimizer& o) {
    py::gil_scoped_release release;
    return (o.*get)();
  };
}

using optional_range = std::optional<std::pair<std::size_t, std::size_t>>;

state_store_options store_options(const std::vector<std::string>& dirs, std::size_t staging_bytes, unsigned buffers,
                                  std::size_t chunk_elements, bool sync, const std::string& io,
                                  const optional_range& range = std::nullopt) {
  state_store_options o;
  if (range) o.range = arena_range{range->first, range->second};
  o.dirs = dirs;
  o.staging_bytes = staging_bytes;
  o.buffers = buffers;
  o.chunk_elements = chunk_elements;
  o.sync_every_step = sync;
  o.io = io;
  return o;
}

} // namespace

void bind_stored_optimizer(py::module_& m) {
  m.def(
      "arena_layout",
      [](py::list groups) {
        const std::vector<segment> layout = hostopt::arena_layout(groups_from(groups));
        py::list out;
        for (const auto& s : layout) out.append(py::make_tuple(s.name, s.shape, s.offset, s.size, s.group));
        return py::make_tuple(out, hostopt::arena_end(layout));
      },
      py::arg("groups"), "(segments, arena size) of the groups' layout, without allocating any state.");
  py::class_<stored_optimizer>(m, "StoredOptimizer", "Optimizer state on a drive (see hostopt.StoredOptimizer).")
      .def_static(
          "create",
          [](py::list groups, const std::vector<std::string>& dir, std::size_t staging_bytes, unsigned buffers,
             std::size_t chunk_elements, bool sync, const std::string& io, int threads, const std::string& kernel,
             py::handle initial_params, const optional_range& range) {
            const std::vector<param_group> gs = groups_from(groups);
            buffer p;
            if (!initial_params.is_none()) p = check_array(initial_params, "initial_params", "f32", false);
            const state_store_options o = store_options(dir, staging_bytes, buffers, chunk_elements, sync, io, range);
            py::gil_scoped_release release;
            return std::make_unique<stored_optimizer>(
                stored_optimizer::create(gs, o, {threads, kernel}, {p.data, p.size, p.type}));
          },
          py::arg("groups"), py::arg("dirs"), py::arg("staging_bytes"), py::arg("buffers"), py::arg("chunk_elements"),
          py::arg("sync"), py::arg("io"), py::arg("threads"), py::arg("kernel"), py::arg("initial_params"),
          py::arg("range") = py::none())
      .def_static(
          "open",
          [](py::list groups, const std::vector<std::string>& dir, std::size_t staging_bytes, unsigned buffers,
             std::size_t chunk_elements, bool sync, const std::string& io, int threads, const std::string& kernel,
             const optional_range& range, bool previous) {
            const std::vector<param_group> gs = groups_from(groups);
            const state_store_options o = store_options(dir, staging_bytes, buffers, chunk_elements, sync, io, range);
            py::gil_scoped_release release;
            return std::make_unique<stored_optimizer>(previous ? stored_optimizer::open_previous(gs, o, {threads, kernel})
                                                               : stored_optimizer::open(gs, o, {threads, kernel}));
          },
          py::arg("groups"), py::arg("dirs"), py::arg("staging_bytes"), py::arg("buffers"), py::arg("chunk_elements"),
          py::arg("sync"), py::arg("io"), py::arg("threads"), py::arg("kernel"), py::arg("range") = py::none(),
          py::arg("previous") = false)
      .def_static(
          "import_state",
          [](const optimizer& ram, py::list groups, const std::vector<std::string>& dir, std::size_t staging_bytes, unsigned buffers,
             std::size_t chunk_elements, bool sync, const std::string& io) {
            const std::vector<param_group> gs = groups_from(groups);
            const state_store_options o = store_options(dir, staging_bytes, buffers, chunk_elements, sync, io);
            py::gil_scoped_release release;
            return std::make_unique<stored_optimizer>(stored_optimizer::create(ram, gs, o));
          },
          py::arg("ram"), py::arg("groups"), py::arg("dirs"), py::arg("staging_bytes"), py::arg("buffers"),
          py::arg("chunk_elements"), py::arg("sync"), py::arg("io"))
      .def_static(
          "import_state",
          // A rank's shard: the store holds the range the sharded optimizer holds.
          [](const sharded_optimizer& ram, py::list groups, const std::vector<std::string>& dir,
             std::size_t staging_bytes, unsigned buffers, std::size_t chunk_elements, bool sync, const std::string& io) {
            const std::vector<param_group> gs = groups_from(groups);
            const arena_range held = ram.local().range();
            const state_store_options o = store_options(dir, staging_bytes, buffers, chunk_elements, sync, io,
                                                        std::make_pair(held.begin, held.end));
            py::gil_scoped_release release;
            return std::make_unique<stored_optimizer>(stored_optimizer::create(ram.local(), gs, o));
          },
          py::arg("ram"), py::arg("groups"), py::arg("dirs"), py::arg("staging_bytes"), py::arg("buffers"),
          py::arg("chunk_elements"), py::arg("sync"), py::arg("io"))
      .def(
          "step_flat",
          &step_flat<stored_optimizer>,
          py::arg("grad"), py::arg("grad_dtype"), py::arg("out"), py::arg("out_dtype"), py::arg("grad_scale"),
          py::arg("max_grad_norm"), py::arg("skip_nonfinite"), py::arg("known_grad_norm"))
      .def(
          "step_flat_adopting",
          // step_flat, first setting the masters of the ranges `adopt` to `params`' values there
          // (params None: nothing adopted); tensors_without_grad: per-tensor steps.
          [](stored_optimizer& o, py::handle grad, const std::string& grad_dtype, py::handle out,
             const std::string& out_dtype, float grad_scale, double max_grad_norm, bool skip_nonfinite,
             double known_grad_norm, py::handle params, const std::vector<std::pair<std::size_t, std::size_t>>& adopt,
             const std::vector<std::size_t>& tensors_without_grad) {
            const flat_step_args a = flat_step_args_of(grad, grad_dtype, out, out_dtype, grad_scale, max_grad_norm,
                                                       skip_nonfinite, known_grad_norm);
            const_view pv{};
            if (!params.is_none()) {
              const buffer p = check_array(params, "params", "f32", false);
              pv = {p.data, p.size, p.type};
            }
            std::vector<arena_range> ranges;
            for (const auto& [begin, end] : adopt) ranges.push_back({begin, end});
            py::gil_scoped_release release;
            return o.step(a.grad_view(), a.out_view(), a.options, pv, ranges, tensors_without_grad);
          },
          py::arg("grad"), py::arg("grad_dtype"), py::arg("out"), py::arg("out_dtype"), py::arg("grad_scale"),
          py::arg("max_grad_norm"), py::arg("skip_nonfinite"), py::arg("known_grad_norm"), py::arg("params"),
          py::arg("adopt"), py::arg("tensors_without_grad") = std::vector<std::size_t>())
      .def(
          "adopt_at_next_step",
          // The masters of the ranges `adopt` set to `values` (their elements in order) by the
          // next applied step, as it reads each chunk: stored_optimizer::adopt_at_next_step.
          [](stored_optimizer& o, const std::vector<std::pair<std::size_t, std::size_t>>& adopt, py::handle values) {
            const buffer v = check_array(values, "values", "f32", false);
            std::vector<arena_range> ranges;
            for (const auto& [begin, end] : adopt) ranges.push_back({begin, end});
            py::gil_scoped_release release;
            o.adopt_at_next_step(ranges, {static_cast<const float*>(v.data), v.size});
          },
          py::arg("adopt"), py::arg("values"))
      .def_property_readonly("pending_adoption",
                             [](const stored_optimizer& o) {
                               py::gil_scoped_release release; // (waits for another thread's step)
                               return o.pending_adoption();
                             })
      .def(
          "read_params_range",
          // The committed step's parameters of [begin, end) into `out` (end - begin elements).
          [](const stored_optimizer& o, std::size_t begin, std::size_t end, py::handle out,
             const std::string& out_dtype) {
            const buffer b = check_array(out, "out", out_dtype, true);
            if (begin > end || b.size != end - begin)
              throw std::invalid_argument("read_params_range: out holds " + std::to_string(b.size) +
                                          " elements for [" + std::to_string(begin) + ", " + std::to_string(end) +
                                          ")");
            py::gil_scoped_release release;
            o.read_params(begin, end, b.data, b.type);
          },
          py::arg("begin"), py::arg("end"), py::arg("out"), py::arg("out_dtype"))
      .def(
          "copy_state_to",
          [](const stored_optimizer& o, optimizer& ram) {
            py::gil_scoped_release release;
            o.copy_state_to(ram);
          },
          py::arg("ram"))
      .def(
          "copy_state_to",
          [](const stored_optimizer& o, sharded_optimizer& ram) {
            py::gil_scoped_release release;
            o.copy_state_to(ram.local());
          },
          py::arg("ram"))
      .def(
          "copy_params_to",
          [](const stored_optimizer& o, py::handle out, const std::string& out_dtype) {
            const buffer b = check_array(out, "out", out_dtype, true);
            py::gil_scoped_release release;
            o.copy_params_to({b.data, b.size, b.type});
          },
          py::arg("out"), py::arg("out_dtype"))
      .def(
          "save",
          [](const stored_optimizer& o, const std::string& path) {
            py::gil_scoped_release release;
            o.save_checkpoint(path);
          },
          py::arg("path"))
      .def(
          "save_shard",
          [](const stored_optimizer& o, const std::string& dir, const std::string& save_id, int world_size, int rank) {
            py::gil_scoped_release release;
            o.save_shard(dir, save_id, world_size, rank);
          },
          py::arg("dir"), py::arg("save_id"), py::arg("world_size"), py::arg("rank"))
      .def(
          "commit_shard_save",
          [](const stored_optimizer& o, const std::string& dir, const std::string& save_id, int world_size) {
            py::gil_scoped_release release;
            o.commit_shard_save(dir, save_id, world_size);
          },
          py::arg("dir"), py::arg("save_id"), py::arg("world_size"))
      .def("close", [](stored_optimizer& o) {
        py::gil_scoped_release release;
        o.close();
      })
      // (Getters that take the optimizer's lock release the GIL: a step holds that lock for
      // its whole streaming, and other Python threads must not wait on it with the GIL.)
      .def_property_readonly("step_count", released(&stored_optimizer::step_count))
      .def_property_readonly("skipped_steps", released(&stored_optimizer::skipped_steps))
      .def_property_readonly("tensor_steps", released(&stored_optimizer::tensor_steps))
      .def_property_readonly("arena_size", &stored_optimizer::arena_size)
      .def_property_readonly("range",
                             [](const stored_optimizer& o) { return py::make_tuple(o.range().begin, o.range().end); })
      .def_property_readonly("num_groups", &stored_optimizer::num_groups)
      .def_property_readonly("chunks", &stored_optimizer::chunks)
      .def_property_readonly("chunk_elements", &stored_optimizer::chunk_elements)
      .def_property_readonly("chunk_bytes", &stored_optimizer::chunk_bytes)
      .def_property_readonly("staging_bytes", &stored_optimizer::staging_bytes)
      .def_property_readonly("stripes", released(&stored_optimizer::stripes))
      .def_property_readonly("recovery", &stored_optimizer::recovery)
      .def_property_readonly("step_io_bytes", &stored_optimizer::step_io_bytes)
      .def_property_readonly("io_backend", released(&stored_optimizer::io_backend))
      .def_property_readonly("cached_pages", released(&stored_optimizer::cached_pages))
      .def("segments",
           [](const stored_optimizer& o) {
             py::list out;
             for (const auto& s : o.segments()) out.append(py::make_tuple(s.name, s.shape, s.offset, s.size, s.group));
             return out;
           })
      .def("group_config",
           [](const stored_optimizer& o, std::size_t g) {
             adam_config c;
             {
               py::gil_scoped_release release;
               c = o.group_config(g);
             }
             return config_to(c);
           })
      .def("set_group_config", [](stored_optimizer& o, std::size_t g, py::dict d) {
        adam_config base;
        {
          py::gil_scoped_release release;
          base = o.group_config(g);
        }
        const adam_config c = config_from(d, base); // only the keys given change
        py::gil_scoped_release release;
        o.set_group_config(g, c);
      });
}

} // namespace hostopt::bindings
