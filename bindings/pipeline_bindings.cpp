// hostopt._core's offload pipeline: copy engines, streams and events as integer handles
// (a torch CUDA stream's cuda_stream — but 0 means "none": the legacy default stream is 1,
// cudaStreamLegacy — or a cudaEvent_t), device buffers as integer addresses (a tensor's
// data_ptr()). A private, unchecked layer: addresses and handles are trusted, as a C++
// caller's would be; hostopt.torch passes only buffers it allocated and keeps alive. This is
// the layer hostopt.torch drives for device parameters; on the host engine "device" memory is
// host memory, so CPU tensors stand in for device tensors in tests. Waits release the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <string>

#include "argument_conversion.hpp"
#include "module_parts.hpp"

#include "hostopt/offload_pipeline.hpp"
#include "hostopt/optimizer.hpp"
#include "hostopt/stored_optimizer.hpp"

namespace hostopt::bindings {

namespace {

void* address(std::uintptr_t a) { return reinterpret_cast<void*>(a); }
std::uintptr_t handle_of(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }

// The pipeline with the engine and the optimizer it was made with kept alive.
struct pipeline_holder {
  std::shared_ptr<copy_engine> engine;
  py::object optimizer; // keeps the Python Optimizer (and so its C++ object) alive
  std::unique_ptr<offload_pipeline> pipe;
};

device_order order_of(std::uintptr_t grads_stream, std::uintptr_t grads_event, std::uintptr_t params_stream,
                      std::uintptr_t params_event) {
  device_order o;
  o.grads_stream = {address(grads_stream)};
  o.grads_ready = {address(grads_event)};
  o.params_stream = {address(params_stream)};
  o.params_free = {address(params_event)};
  return o;
}

} // namespace

void bind_pipeline(py::module_& m) {
  py::class_<copy_engine, std::shared_ptr<copy_engine>>(
      m, "CopyEngine", "A device behind the offload pipeline (cuda or host).")
      .def_static(
          "host",
          [](double gbps) {
            host_engine_options options;
            options.bandwidth_gbps = gbps;
            return std::shared_ptr<copy_engine>(make_host_copy_engine(options));
          },
          py::arg("bandwidth_gbps") = 0.0)
      .def_static(
          "cuda", [](int device) { return std::shared_ptr<copy_engine>(make_cuda_copy_engine(device)); },
          py::arg("device") = 0)
      .def_static("cuda_available", &cuda_device_available)
      .def_property_readonly("name", [](const copy_engine& e) { return std::string(e.name()); })
      .def_property_readonly("flag_mechanism", &copy_engine::flag_mechanism)
      .def_property_readonly("sticky_error", &copy_engine::sticky_error)
      .def("create_stream", [](copy_engine& e) { return handle_of(e.create_stream().handle); })
      .def("destroy_stream", [](copy_engine& e, std::uintptr_t s) { e.destroy_stream({address(s)}); })
      .def("create_event", [](copy_engine& e) { return handle_of(e.create_event().handle); })
      .def("destroy_event", [](copy_engine& e, std::uintptr_t ev) { e.destroy_event({address(ev)}); })
      .def("record_event", [](copy_engine& e, std::uintptr_t ev,
                              std::uintptr_t s) { e.record_event({address(ev)}, {address(s)}); })
      .def("stream_wait_event", [](copy_engine& e, std::uintptr_t s,
                                   std::uintptr_t ev) { e.stream_wait_event({address(s)}, {address(ev)}); })
      .def("synchronize_event",
           [](copy_engine& e, std::uintptr_t ev) {
             py::gil_scoped_release release;
             e.synchronize_event({address(ev)});
           })
      .def("synchronize_stream",
           [](copy_engine& e, std::uintptr_t s) {
             py::gil_scoped_release release;
             e.synchronize_stream({address(s)});
           })
      .def("event_done", [](copy_engine& e, std::uintptr_t ev) { return e.event_done({address(ev)}); });

  py::class_<pipeline_handle>(m, "PipelineHandle", "A step or accumulation in flight.")
      .def("wait",
           [](const pipeline_handle& h) {
             py::gil_scoped_release release;
             return h.wait();
           })
      .def("done", &pipeline_handle::done)
      .def_property_readonly("grads_consumed",
                             [](const pipeline_handle& h) { return handle_of(h.grads_consumed().handle); })
      .def_property_readonly("params_ready",
                             [](const pipeline_handle& h) { return handle_of(h.params_ready().handle); });

  py::class_<pipeline_holder>(
      m, "OffloadPipeline", "offload_pipeline over an Optimizer or a StoredOptimizer: device gradients in, device parameters out.")
      .def(py::init([](py::object opt, std::shared_ptr<copy_engine> engine, std::size_t chunk_elems,
                       int depth, const std::string& grad_type, const std::string& param_type) {
             if (!engine) throw py::value_error("OffloadPipeline: engine is None");
             pipeline_options po;
             po.chunk_elems = chunk_elems;
             po.depth = depth;
             po.grad_type = dtype_from("grad_type", grad_type);
             po.param_type = dtype_from("param_type", param_type);
             auto h = std::make_unique<pipeline_holder>();
             h->engine = engine;
             h->optimizer = opt;
             // An Optimizer, or a StoredOptimizer (its state on a drive, streamed around the chunks).
             chunk_updater& updater = py::isinstance<stored_optimizer>(opt)
                                          ? static_cast<chunk_updater&>(opt.cast<stored_optimizer&>())
                                          : opt.cast<optimizer&>();
             h->pipe = std::make_unique<offload_pipeline>(updater, *engine, po);
             return h;
           }),
           py::arg("optimizer"), py::arg("engine"), py::arg("chunk_elems") = std::size_t(1) << 22,
           py::arg("depth") = 2, py::arg("grad_type") = "f32", py::arg("param_type") = "f32")
      .def(
          "step_async",
          [](pipeline_holder& h, std::uintptr_t grads, const std::string& grad_type, std::uintptr_t params,
             const std::string& param_type, std::size_t size, std::uintptr_t grads_stream,
             std::uintptr_t grads_event, std::uintptr_t params_stream, std::uintptr_t params_event,
             float grad_scale, double max_grad_norm, bool skip_nonfinite, double known_grad_norm,
             const std::vector<std::uintptr_t>& chunk_grads_events,
             std::vector<std::size_t> tensors_without_grad) {
            step_options o;
            o.grad_scale = grad_scale;
            o.max_grad_norm = max_grad_norm;
            o.skip_nonfinite = skip_nonfinite;
            o.known_grad_norm = known_grad_norm;
            device_order order = order_of(grads_stream, grads_event, params_stream, params_event);
            for (const std::uintptr_t e : chunk_grads_events) order.chunk_grads_ready.push_back({address(e)});
            return h.pipe->step_async({address(grads), size, dtype_from("grad_type", grad_type)},
                                      {address(params), size, dtype_from("param_type", param_type)}, order, o,
                                      std::move(tensors_without_grad));
          },
          py::arg("grads"), py::arg("grad_type"), py::arg("params"), py::arg("param_type"), py::arg("size"),
          py::arg("grads_stream") = 0, py::arg("grads_event") = 0, py::arg("params_stream") = 0,
          py::arg("params_event") = 0, py::arg("grad_scale") = 1.0f, py::arg("max_grad_norm") = 0.0,
          py::arg("skip_nonfinite") = false, py::arg("known_grad_norm") = -1.0,
          py::arg("chunk_grads_events") = std::vector<std::uintptr_t>{},
          py::arg("tensors_without_grad") = std::vector<std::size_t>{},
          py::keep_alive<0, 1>()) // the handle's events live in the pipeline's pool (and engine)
      .def(
          "accumulate_async",
          [](pipeline_holder& h, std::uintptr_t grads, const std::string& grad_type, std::size_t size,
             std::uintptr_t grads_stream, std::uintptr_t grads_event) {
            return h.pipe->accumulate_async({address(grads), size, dtype_from("grad_type", grad_type)},
                                            order_of(grads_stream, grads_event, 0, 0));
          },
          py::arg("grads"), py::arg("grad_type"), py::arg("size"), py::arg("grads_stream") = 0,
          py::arg("grads_event") = 0, py::keep_alive<0, 1>())
      .def(
          "push_params",
          [](pipeline_holder& h, std::uintptr_t params, const std::string& param_type, std::size_t size) {
            py::gil_scoped_release release;
            h.pipe->push_params({address(params), size, dtype_from("param_type", param_type)});
          },
          py::arg("params"), py::arg("param_type"), py::arg("size"))
      .def_property_readonly(
          "copy_in_stream",
          [](const pipeline_holder& h) { return handle_of(h.pipe->copy_in_stream().handle); })
      .def_property_readonly("usable", [](const pipeline_holder& h) { return h.pipe->usable(); })
      .def_property_readonly("failure_reason",
                             [](const pipeline_holder& h) { return h.pipe->failure_reason(); })
      .def_property_readonly("num_chunks", [](const pipeline_holder& h) { return h.pipe->num_chunks(); })
      .def_property_readonly("chunk_elems", [](const pipeline_holder& h) { return h.pipe->chunk_elems(); })
      .def_property_readonly("pinned_bytes", [](const pipeline_holder& h) { return h.pipe->pinned_bytes(); })
      .def_property_readonly(
          "accumulated_micro_batches",
          [](const pipeline_holder& h) {
            py::gil_scoped_release release; // (waits for operations in flight)
            return h.pipe->accumulated_micro_batches();
          },
          "Micro-batches in the accumulator, for the next step (a failed step over a store keeps them).")
      .def("last_timeline", [](const pipeline_holder& h) {
        const pipeline_timeline tl = h.pipe->last_timeline();
        py::dict d;
        d["wall_seconds"] = tl.wall_seconds();
        for (auto s : {pipeline_stage::copy_in, pipeline_stage::update, pipeline_stage::copy_out,
                       pipeline_stage::accumulate})
          d[stage_name(s)] = tl.busy_seconds(s);
        d["chrome_trace"] = tl.chrome_trace_json();
        return d;
      });
}

} // namespace hostopt::bindings
