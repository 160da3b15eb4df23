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
  std::size_t chunk_elems = std::size_t(1) << 22; ///< elements per chunk (rounded up to 16), > 0
  int depth = 2;                                  ///< pinned buffers per direction, in [2, 64]
  dtype grad_type = dtype::f32;                   ///< dtype of the device gradients
  dtype param_type = dtype::bf16;                 ///< dtype of the device parameters written back
  /// Test hook, called on the pipeline thread before chunk k is updated; an exception it
  /// throws fails that update (fault injection).
  std::function<void(std::size_t chunk)> before_update;
};

/// Pipeline stages, as recorded in the timeline.
enum class pipeline_stage : std::uint8_t { copy_in = 0, update = 1, copy_out = 2, accumulate = 3 };
const char* stage_name(pipeline_stage s);

/// One stage of one chunk, in nanoseconds of std::chrono::steady_clock.
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

/// A step or accumulation in flight. Copyable; waiting on any copy waits for the same work.
class pipeline_handle {
public:
  pipeline_handle() = default;
  /// Blocks until done; returns the step's result or throws std::runtime_error naming the
  /// chunk and stage that failed (and whether the optimizer state is still consistent).
  step_result wait() const;
  /// Done (successfully or not); never blocks.
  bool done() const;
  /// For the CUDA engine: an event (cudaEvent_t as void*) recorded after the last
  /// parameter copy of this step, which the trainer's stream can wait on
  /// (cudaStreamWaitEvent) so the GPU waits only where it needs the new parameters.
  /// nullptr on the host engine or before the step has issued its last copy.
  void* device_event() const;

  struct state;
  explicit pipeline_handle(std::shared_ptr<state> s) : state_(std::move(s)) {}

private:
  std::shared_ptr<state> state_;
};

/// Streams gradients in and parameters out around a chunked step (chunk_updater: an
/// optimizer, or a shard's). The pipeline knows nothing of Adam: the updater decides,
/// updates and counts; the pipeline moves the bytes.
///
/// Device buffers are in the updater's flat layout (arena_size() elements): the
/// gradients in options.grad_type, the parameters in options.param_type. One operation
/// runs at a time: a call made while one is in flight waits for it first. Allocates its
/// pinned buffers once, at construction; a step allocates nothing else.
class offload_pipeline {
public:
  /// Throws std::invalid_argument for bad options; std::runtime_error when pinned memory
  /// cannot be allocated. `updater` (e.g. an optimizer) and `engine` must outlive the pipeline.
  offload_pipeline(chunk_updater& updater, copy_engine& engine, pipeline_options options = {});
  /// Waits for (drains) an operation in flight, then stops the pipeline thread.
  ~offload_pipeline();
  offload_pipeline(const offload_pipeline&) = delete;
  offload_pipeline& operator=(const offload_pipeline&) = delete;

  /// Starts a step: gradients from `device_grads` (plus any accumulated micro-batches),
  /// new parameters to `device_params`. Returns at once. Sizes and dtypes are checked
  /// before anything moves (std::invalid_argument). `grads_ready_event` (cudaEvent_t as
  /// void*, optional) makes the gradient copies wait for it on the device.
  pipeline_handle step_async(const_view device_grads, mut_view device_params, float grad_scale = 1.0f,
                             void* grads_ready_event = nullptr);
  /// The same with checks and clipping: options.known_grad_norm (the norm of the
  /// unscaled gradients, computed where they are, e.g. on the GPU) lets the updater decide
  /// before any chunk moves — a non-finite norm skips the step (state untouched, the skip
  /// counted, the accumulated micro-batches dropped as a skipped step's are), and
  /// max_grad_norm clips by folding the factor into the scale. Checks that need the norm
  /// and get none (known_grad_norm < 0) are refused with std::invalid_argument at the call.
  pipeline_handle step_async(const_view device_grads, mut_view device_params, const step_options& options,
                             void* grads_ready_event = nullptr);
  /// Streams a non-final micro-batch's gradients into the f32 host accumulator, so the
  /// device can free them; the next step_async adds the accumulator in its fused pass.
  pipeline_handle accumulate_async(const_view device_grads, void* grads_ready_event = nullptr);
  /// step_async(...).wait().
  step_result step(const_view device_grads, mut_view device_params, float grad_scale = 1.0f);
  /// Copies the optimizer's current master parameters to the device (param_type), e.g.
  /// at start-up or after a failed parameter copy. Synchronous.
  void push_params(mut_view device_params);

  /// Micro-batches accumulated since the last step (waits for an operation in flight).
  /// The f32 accumulator (4 bytes per arena element) is allocated on the first one.
  int accumulated_micro_batches() const;
  /// False after a failure that left the optimizer state partly updated; then every
  /// operation throws std::logic_error with failure_reason() (restore a checkpoint).
  bool usable() const;
  std::string failure_reason() const;
  /// Number of chunks a step is cut into.
  std::size_t num_chunks() const;
  /// Timeline of the last completed operation.
  pipeline_timeline last_timeline() const;

private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

} // namespace hostopt
