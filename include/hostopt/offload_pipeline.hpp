#pragma once
/// \file offload_pipeline.hpp
/// The double-buffered offload pipeline: device gradients -> pinned gradient buffers ->
/// CPU update of that chunk (fused copy-out) -> pinned parameter buffers -> device
/// parameters, with chunk k+1 copied in while chunk k is updated and chunk k-1 copied out.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "hostopt/chunk_updater.hpp"
#include "hostopt/copy_engine.hpp"
#include "hostopt/dtype.hpp"
#include "hostopt/step_options.hpp"

namespace hostopt {

/// How the pipeline cuts and stages the arena.
struct pipeline_options {
  std::size_t chunk_elems = std::size_t(1) << 22; ///< elements per chunk (rounded up to the updater's chunk_unit(): 16, or 32 with 8-bit moments), > 0
  int depth = 2;                                  ///< pinned buffers per direction, in [2, 64]
  dtype grad_type = dtype::f32;                   ///< dtype of the device gradients
  dtype param_type = dtype::bf16;                 ///< dtype of the device parameters written back
  /// Test hook, called on the pipeline thread before chunk k is updated (or accumulated);
  /// an exception it throws fails that update (fault injection).
  std::function<void(std::size_t chunk)> before_update;
};

/// Pipeline stages, as recorded in the timeline.
enum class pipeline_stage : std::uint8_t { copy_in = 0, update = 1, copy_out = 2, accumulate = 3 };
const char* stage_name(pipeline_stage s);

/// One stage of one chunk, in nanoseconds of std::chrono::steady_clock (device spans are
/// read from the engine's events and placed on that clock by the engine).
struct stage_span {
  std::size_t chunk = 0;
  pipeline_stage stage = pipeline_stage::copy_in;
  std::int64_t start_ns = 0, end_ns = 0;
  std::int64_t issued_ns = 0; ///< when the pipeline issued it (a copy may start later)
};

/// What one step (or accumulation) of the pipeline did and how well it overlapped.
struct pipeline_timeline {
  std::vector<stage_span> spans;
  std::int64_t start_ns = 0, end_ns = 0;
  /// Busy seconds of each stage (sum over chunks), indexed by pipeline_stage.
  double busy_seconds(pipeline_stage s) const;
  double wall_seconds() const { return double(end_ns - start_ns) * 1e-9; }
  /// wall / busiest stage: 1.0 is perfect overlap, 3.0 is none (three equal stages).
  double wall_over_slowest_stage() const;
  /// Chrome trace JSON (chrome://tracing, Perfetto): one track per stage.
  std::string chrome_trace_json() const;
};

/// What orders an operation on the device: after what the gradients may be read, and
/// after what the device parameters may be overwritten. An event is waited on as its most
/// recent record at the time of the call; a stream as all work enqueued on it so far.
struct device_order {
  /// Recorded after the work that wrote the gradients (e.g. the backward pass). Required,
  /// or grads_stream: a call with neither is refused (std::invalid_argument).
  device_event grads_ready;
  /// Or: the stream that wrote the gradients.
  device_stream grads_stream;
  /// Recorded after the last device work that reads the parameter buffer (e.g. a forward
  /// on another stream); or params_stream. With neither, the gradient dependency covers it
  /// (the usual case: the forward that read the parameters ran before the backward).
  device_event params_free;
  device_stream params_stream;
  /// Optional, one per chunk (num_chunks(); an empty event where there is none): chunk k's
  /// gradients are complete once chunk_grads_ready[k] is. Lets the copy-in (and the CPU
  /// update) of early chunks start while later gradients are still being produced, e.g.
  /// events recorded by backward hooks as each chunk's last gradient is written. From
  /// the first chunk without its own event on, the gradient dependency above orders the
  /// copies; it is required all the same. The parameter copies keep their own order.
  std::vector<device_event> chunk_grads_ready;

  /// Ordered after all work enqueued on `s` so far (gradients and parameters).
  static device_order after(device_stream s) { return {{}, s, {}, {}, {}}; }
  /// Ordered after the event `e` (gradients and parameters).
  static device_order after(device_event e) { return {e, {}, {}, {}, {}}; }
};

/// A step or accumulation in flight. Copyable; every copy refers to the same operation.
/// Its device events are enqueued by the time the call that made it returns, so a stream
/// can wait on them at once, without any host wait; they stay valid while a copy of the
/// handle (and the engine) lives.
class pipeline_handle {
public:
  pipeline_handle() = default;
  /// Blocks until done; returns the step's result or throws std::runtime_error naming the
  /// chunk and stage that failed (and whether the optimizer state is still consistent).
  step_result wait() const;
  /// Done (successfully or not); never blocks.
  bool done() const;
  /// Completes when every gradient copy of this operation is done: the trainer may then
  /// overwrite or free the gradient buffer (stream_wait_event / cudaStreamWaitEvent).
  device_event grads_consumed() const;
  /// Completes when the new parameters are in the device buffer: the next forward waits
  /// on it. Empty for an accumulation.
  device_event params_ready() const;

  struct state;
  explicit pipeline_handle(std::shared_ptr<state> s) : state_(std::move(s)) {}

private:
  std::shared_ptr<state> state_;
};

/// Streams gradients in and parameters out around a chunked step (chunk_updater: an
/// optimizer, or a shard's). The pipeline knows nothing of Adam: the updater decides,
/// updates and counts; the pipeline moves the bytes.
///
/// Stream-ordered: a call enqueues all of its device work at once on the engine's two copy
/// streams — every gradient copy, every parameter copy, each gated by a host-written flag
/// (a copy into a pinned buffer waits until the CPU released it; a parameter copy waits
/// until the CPU wrote the chunk) — and returns. The CPU side runs on the pipeline thread.
/// So the device never waits on the host except through the handle's events.
///
/// Device buffers are in the updater's flat layout (arena_size() elements): the
/// gradients in options.grad_type, the parameters in options.param_type; only the
/// engine's copies touch them. Operations run in call order; up to 16 may be queued
/// (enqueued on the device, waiting for the CPU); a 17th call waits for the oldest. Pinned memory: depth x chunk x (grad + param bytes),
/// allocated once, at construction.
class offload_pipeline {
public:
  /// Throws std::invalid_argument for bad options; std::runtime_error when pinned memory
  /// cannot be allocated. `updater` (e.g. an optimizer) and `engine` must outlive the
  /// pipeline and its handles.
  offload_pipeline(chunk_updater& updater, copy_engine& engine, pipeline_options options = {});
  /// Waits for (drains) the operations in flight, then stops the pipeline thread.
  ~offload_pipeline();
  offload_pipeline(const offload_pipeline&) = delete;
  offload_pipeline& operator=(const offload_pipeline&) = delete;

  /// Starts a step: gradients from `device_grads` (plus any accumulated micro-batches),
  /// new parameters to `device_params`, ordered by `order`. Returns at once. Sizes, dtypes
  /// and the order are checked before anything is enqueued (std::invalid_argument).
  pipeline_handle step_async(const_view device_grads, mut_view device_params, const device_order& order,
                             float grad_scale = 1.0f);
  /// The same with checks and clipping: options.known_grad_norm (the norm of the
  /// unscaled gradients, computed where they are, e.g. on the GPU) lets the updater decide
  /// before any chunk is updated — a non-finite norm skips the step (state untouched, the
  /// skip counted, the accumulated micro-batches dropped as a skipped step's are; the
  /// device parameters are rewritten with the unchanged ones), and max_grad_norm clips by
  /// folding the factor into the scale. Checks that need the norm and get none
  /// (known_grad_norm < 0) are refused with std::invalid_argument at the call.
  /// `tensors_without_grad` (the updater's tensor indices) are left alone as torch leaves
  /// a parameter whose .grad is None (chunk_step_options::tensors_without_grad): their
  /// device parameters get their unchanged values and their gradient elements are copied
  /// but never read.
  pipeline_handle step_async(const_view device_grads, mut_view device_params, const device_order& order,
                             const step_options& options, std::vector<std::size_t> tensors_without_grad = {});
  /// Streams a non-final micro-batch's gradients into the f32 host accumulator; after the
  /// handle's grads_consumed() the device may reuse the gradient buffer. The next step adds
  /// the accumulator in its fused pass.
  pipeline_handle accumulate_async(const_view device_grads, const device_order& order);
  /// step_async(...).wait().
  step_result step(const_view device_grads, mut_view device_params, const device_order& order,
                   float grad_scale = 1.0f);
  /// Copies the optimizer's current master parameters to the device (param_type), e.g.
  /// at start-up or after a failed step. Waits for the operations in flight, then for the
  /// copies; the caller makes sure no device work reads `device_params` meanwhile.
  void push_params(mut_view device_params);

  /// The engine's stream that carries the gradient copies and the one that carries the
  /// parameter copies (for traces and for callers that order work after them).
  device_stream copy_in_stream() const;
  device_stream copy_out_stream() const;
  /// Micro-batches accumulated for the next step (waits for the operations in flight): those
  /// since the last step, and over an updater that commits whole steps (a store) those a
  /// failed step left to its retry. The f32 accumulator (4 bytes per arena element) is
  /// allocated on the first one.
  int accumulated_micro_batches() const;
  /// False after a failure that left the optimizer state partly updated, or a device error
  /// (sticky, as CUDA's); then every operation throws std::logic_error with
  /// failure_reason().
  bool usable() const;
  std::string failure_reason() const;
  /// Number of chunks a step is cut into.
  std::size_t num_chunks() const;
  /// Elements per chunk (the last one may be shorter): options.chunk_elems capped at the
  /// arena and rounded up to the updater's chunk_unit().
  std::size_t chunk_elems() const;
  /// Pinned host memory the pipeline holds: depth x chunk x (gradient + parameter bytes).
  std::size_t pinned_bytes() const;
  /// Timeline of the last completed operation.
  pipeline_timeline last_timeline() const;

private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

} // namespace hostopt
