#pragma once
/// \file chunk_updater.hpp
/// A step whose gradients arrive chunk by chunk: what the offload pipeline (transfer/)
/// drives, and all it knows of the optimizer. hostopt::optimizer implements it (so does a
/// shard's optimizer, over its range); the update rule, the step policy (checks, clipping,
/// skips) and the state stay behind this interface.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "hostopt/dtype.hpp"
#include "hostopt/step_options.hpp"

namespace hostopt {

/// How a chunked step reads its inputs and how it is checked.
struct chunk_step_options {
  dtype grad_type = dtype::f32; ///< dtype of the gradient chunks
  bool copy_out = false;        ///< write the new parameters to an output chunk
  dtype out_type = dtype::f32;  ///< dtype of the output chunks
  bool accumulator = false;     ///< add an f32 accumulator chunk to each gradient chunk
  /// Scale, clipping and the non-finite check. The gradients arrive only later, so checks
  /// that need their norm need checks.known_grad_norm (computed where they are, e.g. on
  /// the GPU); without it such a begin_step is refused. Unchecked by default.
  step_options checks = {1.0f, 0.0, false, -1.0};
  /// Tensors (indices into the updater's tensors) that have no gradient this step, as
  /// torch skips a parameter whose .grad is None: their parameters, moments and own step
  /// count stay; their output elements get the unchanged parameters. Their gradient
  /// elements are never read. Refused by an updater that cannot keep per-tensor counts.
  std::vector<std::size_t> tensors_without_grad;
};

/// The chunked step's contract. Elements are those of the updater's flat layout
/// [0, arena_size()); a step's chunks cover it in order, once each (chunk k starts where
/// chunk k-1 ended), and finish_step refuses a step whose chunks did not reach the end.
class chunk_updater {
public:
  virtual ~chunk_updater() = default;

  /// Elements of the flat layout (gradient, output and accumulator buffers).
  virtual std::size_t arena_size() const = 0;
  /// Chunks end on multiples of this many elements (or at arena_size()): 16, or 32 where
  /// the state has 8-bit blocks that a chunk may not cut.
  virtual std::size_t chunk_unit() const { return 16; }

  /// Throws what begin_step would for these options (std::invalid_argument), without
  /// starting anything: lets a caller refuse bad options before it moves any data.
  virtual void check_options(const chunk_step_options& options) const = 0;
  /// Starts a step: validates the options and decides it (the same rule as a synchronous
  /// step). When the checks skip it (non-finite known_grad_norm), the skip is counted and
  /// the result says applied = false: no step is open and no chunk may be updated.
  /// Otherwise the step is open (result.applied, result.applied_scale) for this thread.
  virtual step_result begin_step(const chunk_step_options& options) = 0;
  /// Updates elements [begin, end), the next chunk: `grad`, `out` and `accumulator` point
  /// at element `begin` of the caller's buffers in the flat layout (out and accumulator as
  /// begin_step said); they may not overlap the updater's state.
  virtual void update_range(std::size_t begin, std::size_t end, const void* grad, void* out = nullptr,
                            const float* accumulator = nullptr) = 0;
  /// Ends the step (the caller covered every element): the step count grows by one.
  virtual step_result finish_step() = 0;
  /// Closes an open step without counting it; if ranges were updated the state is
  /// half-updated and the updater becomes not usable with `reason`.
  virtual void abort_step(const std::string& reason) noexcept = 0;

  /// acc[i] = grad[i] (+ acc[i] unless `first`) for elements [begin, end), in f32: a
  /// micro-batch added to the accumulator. Touches no optimizer state.
  virtual void accumulate_range(std::size_t begin, std::size_t end, float* acc, const void* grad, dtype grad_type,
                                bool first) = 0;
  /// The current parameters of [begin, end), rounded to `type`, into `out` (padding
  /// written as zeros): what a device copy of the parameters must hold. The thread with
  /// a chunked step open may call it (the pipeline fills the chunks a failed step did not
  /// update with their unchanged values).
  virtual void read_params(std::size_t begin, std::size_t end, void* out, dtype type) const = 0;
  /// Makes the updater not usable with `reason` (e.g. the device its pipeline drives
  /// failed), closing this thread's open chunked step if any. Restoring a checkpoint
  /// makes it usable again.
  virtual void mark_unusable(const std::string& reason) noexcept = 0;
  /// true where a chunked step that fails or is aborted after some ranges leaves the state at
  /// the step before, whole, and usable (a stored optimizer: its steps commit at finish_step;
  /// what ends its unusability is reopening it); false where those ranges stay updated and
  /// the updater is then not usable until restored (the in-RAM optimizer: reset_failure()).
  virtual bool commits_whole_steps() const { return false; }

  /// False while the state is half-updated (see abort_step).
  virtual bool usable() const = 0;
  virtual std::string failure_reason() const = 0;
  /// Completed steps.
  virtual std::int64_t step_count() const = 0;
};

} // namespace hostopt
