#pragma once
/// \file optimizer.hpp
/// The optimizer state: master parameters and Adam moments of many tensors in one flat,
/// 64-byte aligned arena, grouped by hyper-parameters.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "hostopt/adam_config.hpp"
#include "hostopt/dtype.hpp"
#include "hostopt/kernels.hpp"

namespace hostopt {

class optimizer;
namespace detail {
class exclusive_state; // the checkpoint code's locked access to an optimizer's state
}

/// Largest step count an optimizer holds (2^53: every t + 1 is exact in double, where the
/// bias corrections are computed). Setting or stepping past it is refused.
inline constexpr std::int64_t max_step_count = std::int64_t(1) << 53;

/// Largest optimizer state in bytes (params + moments): 2^48, the virtual address space of
/// x86-64 and aarch64 user processes. Larger layouts are refused before allocating.
inline constexpr std::uint64_t max_state_bytes = std::uint64_t(1) << 48;

/// A tensor to register: a unique name and a shape (every extent >= 0).
struct tensor_spec {
  std::string name;
  std::vector<std::int64_t> shape;
};

/// Tensors that share hyper-parameters (torch param_groups, optax masks).
struct param_group {
  adam_config config;
  std::vector<tensor_spec> tensors;
};

/// Where a registered tensor lives in the arena.
struct segment {
  std::string name;
  std::vector<std::int64_t> shape;
  std::size_t offset = 0; ///< first element in the arena, a multiple of 16 (64 bytes)
  std::size_t size = 0;   ///< number of elements (product of the shape)
  std::size_t group = 0;  ///< index of its parameter group
};

/// How a chunked step reads its inputs (see optimizer::begin_step).
struct chunk_step_options {
  dtype grad_type = dtype::f32; ///< dtype of the gradient chunks
  bool copy_out = false;        ///< write the new parameters to an output chunk
  dtype out_type = dtype::f32;  ///< dtype of the output chunks
  float grad_scale = 1.0f;      ///< multiplies the (accumulated) gradient
  bool accumulator = false;     ///< add an f32 accumulator chunk to each gradient chunk
};

/// Checks and clipping of a step (all applied before anything is written).
struct step_options {
  /// Multiplies the gradients first: 1 / loss_scale (see dynamic_loss_scaler).
  float grad_scale = 1.0f;
  /// > 0: clip by global norm with optax's rule — the scaled gradients' norm N, when
  /// N >= max_grad_norm, is brought to max_grad_norm (folded into the scale: one pass).
  double max_grad_norm = 0.0;
  /// Check every gradient first; a non-finite one skips the step, leaving params, moments
  /// and the step count bit-for-bit as they were (step_result says so). Costs one read of
  /// the gradients unless known_grad_norm is given. "Non-finite" is judged as the kernel
  /// computes: in float, so gradients whose scaled norm exceeds the float range
  /// (3.4e38; e.g. 1e30 scaled by 1e10) count as non-finite too.
  bool skip_nonfinite = true;
  /// >= 0 (or inf/NaN): the norm of the unscaled gradients, computed by the caller (e.g.
  /// on the GPU), used instead of a statistics pass. Negative: not known.
  double known_grad_norm = -1.0;
};

/// What a checked step does, decided from the norm of the unscaled gradients (NaN or inf
/// when one is non-finite): the one rule every step path (optimizer::step, the sharded
/// step, the offload pipeline) applies.
struct step_decision {
  bool apply = true;        ///< false: skip the step (non-finite gradients and skip_nonfinite)
  float scale = 1.0f;       ///< grad_scale times the clip factor: the kernel's multiplier
  double grad_norm = -1.0;  ///< norm of grad_scale * gradients (-1 when not needed)
};
/// Validates `options` (std::invalid_argument for a bad grad_scale or max_grad_norm) and
/// decides. `raw_norm` is only read when options need it (skip_nonfinite or clipping).
step_decision decide_step(const step_options& options, double raw_norm);

/// The arena layout of the groups' tensors: the segments an optimizer built from them has
/// (validated the same way), computed without allocating any state.
std::vector<segment> arena_layout(const std::vector<param_group>& groups);

/// What a step did.
struct step_result {
  bool applied = false;          ///< the state was updated
  std::int64_t step = 0;         ///< step count after the call
  double grad_norm = -1.0;       ///< norm of grad_scale * gradients (-1 when not computed)
  float applied_scale = 1.0f;    ///< the gradient multiplier used: grad_scale times the clip factor
  std::int64_t skipped_steps = 0; ///< steps skipped for non-finite gradients so far
};

/// Adam/AdamW optimizer state in host memory.
///
/// Layout: tensors are placed group after group, in registration order, each at a 64-byte
/// aligned offset of one flat arena; params, exp_avg and exp_avg_sq are three such arenas
/// (12 bytes per element plus alignment padding). The layout is fixed at construction.
/// A step runs one parallel region over the whole arena and allocates nothing.
///
/// Thread safety: every public operation is serialized by a mutex inside the object, so
/// concurrent steps, saves and loads from several threads give the serial result. A
/// chunked step (begin_step .. finish_step, what the offload pipeline runs) belongs to the
/// thread that began it: other threads' operations wait until it is finished or aborted,
/// and the owner calling anything but update_range/finish_step/abort_step is refused.
/// The spans returned by params()/exp_avg()/exp_avg_sq() are plain views: reading or
/// writing through them while another thread steps is a data race, as with any container.
///
/// Failures: a chunked step aborted after some ranges were updated leaves a half-updated
/// state. The optimizer is then not usable: every operation that reads or writes the state
/// (steps, views, set_params, save_checkpoint, counters) throws std::runtime_error with
/// failure_reason() until load_checkpoint() restores a whole state (or reset_failure()
/// declares the state whole).
class optimizer {
public:
  /// Registers the groups' tensors and zero-initialises params and moments (first touched
  /// by the threads that will update them). Throws std::invalid_argument for an empty or
  /// duplicate name, a negative extent, bad hyper-parameters or bad execution options.
  explicit optimizer(std::vector<param_group> groups, execution_options exec = {});
  ~optimizer();
  optimizer(optimizer&&) noexcept;
  optimizer& operator=(optimizer&&) noexcept;
  optimizer(const optimizer&) = delete;
  optimizer& operator=(const optimizer&) = delete;

  // --- layout -----------------------------------------------------------------------
  /// Elements in the arena, padding included; the size of a flat gradient or copy-out view.
  std::size_t arena_size() const;
  /// Elements of all tensors, padding excluded.
  std::size_t num_params() const;
  /// Bytes this optimizer holds for params and moments (3 x 4 x arena_size()).
  std::size_t state_bytes() const;
  /// Every tensor, in arena order.
  std::span<const segment> segments() const;
  /// The tensor called `name`; throws std::invalid_argument naming it when unknown.
  const segment& tensor(std::string_view name) const;

  // --- hyper-parameters and step count ------------------------------------------------
  std::size_t num_groups() const;
  adam_config group_config(std::size_t group) const;
  /// Replaces a group's hyper-parameters (schedules); validated first, nothing changes on error.
  void set_group_config(std::size_t group, const adam_config& config);
  /// Sets lr of one group; validated like set_group_config.
  void set_lr(std::size_t group, double lr);
  /// Completed steps; the next step uses t = step_count() + 1.
  std::int64_t step_count() const;
  /// For resuming; must be in [0, max_step_count].
  void set_step_count(std::int64_t count);

  // --- execution ----------------------------------------------------------------------
  execution_options execution() const;
  /// Changes threads/kernel for later steps; validated first.
  void set_execution(const execution_options& exec);

  // --- state --------------------------------------------------------------------------
  std::span<float> params();
  std::span<float> exp_avg();
  std::span<float> exp_avg_sq();
  std::span<const float> params() const;
  std::span<const float> exp_avg() const;
  std::span<const float> exp_avg_sq() const;
  /// One tensor's slice of each arena; throw for an unknown name.
  std::span<float> params(std::string_view name);
  std::span<float> exp_avg(std::string_view name);
  std::span<float> exp_avg_sq(std::string_view name);
  /// Copies `values` (any dtype, exactly tensor(name).size elements) into the master
  /// parameters of `name`.
  void set_params(std::string_view name, const_view values);

  // --- the step -----------------------------------------------------------------------
  /// One step with a flat gradient in arena layout (arena_size() elements; padding is
  /// never read) and an optional flat copy-out in arena layout (padding never written).
  /// All buffers are validated before anything is written; on error nothing changes.
  /// The overloads taking a float grad_scale trust the gradients (no checks, fastest).
  step_result step(const_view flat_grad, mut_view flat_out = {}, float grad_scale = 1.0f);
  /// The same with checks and clipping (step_options).
  step_result step(const_view flat_grad, mut_view flat_out, const step_options& options);
  /// One step with one gradient view per tensor (arena order, one dtype for all) and
  /// optionally one copy-out view per tensor (one dtype for all). An empty view
  /// (`const_view{}`) means the tensor has no gradient this step: its parameters, moments
  /// and copy-out are left untouched (torch skips parameters whose .grad is None). The
  /// step count is shared, so such a tensor's next step uses the shared count.
  step_result step(std::span<const const_view> grads, std::span<const mut_view> outs = {},
                   float grad_scale = 1.0f);
  /// The same with checks and clipping (step_options).
  step_result step(std::span<const const_view> grads, std::span<const mut_view> outs, const step_options& options);
  /// Steps skipped so far because of non-finite gradients.
  std::int64_t skipped_steps() const;
  /// For resuming; must be in [0, max_step_count].
  void set_skipped_steps(std::int64_t count);
  /// Counts a step skipped outside step() (the pipeline's check made before any chunk
  /// moved): the step count stays, skipped_steps() grows by one. Returns the new count.
  std::int64_t record_skipped_step();

  // --- failures -----------------------------------------------------------------------
  /// False after a chunked step failed midway (the state is partly updated).
  bool usable() const;
  /// Why the optimizer is not usable ("" when it is).
  std::string failure_reason() const;
  /// Declares the state whole again (e.g. after the caller restored it through the
  /// views). load_checkpoint() does this itself.
  void reset_failure();

  // --- chunked steps (what the offload pipeline drives) -------------------------------
  /// Starts a step whose gradients arrive chunk by chunk: fixes the dtypes and the
  /// per-step constants for t = step_count() + 1. Throws std::logic_error if a chunked
  /// step is already open, std::invalid_argument for a bad dtype or grad_scale.
  void begin_step(const chunk_step_options& options);
  /// Updates arena elements [begin, end) (padding inside is skipped). `grad` (and `out`,
  /// and `accumulator` when the step was begun with one) point at element `begin` of
  /// buffers in arena layout. Ranges of one step must not overlap; any order works.
  void update_range(std::size_t begin, std::size_t end, const void* grad, void* out = nullptr,
                    const float* accumulator = nullptr);
  /// Ends the chunked step: the step count becomes t. The caller must have covered the
  /// whole arena (the pipeline does).
  step_result finish_step();
  /// Closes an open chunked step without counting it. If ranges were already updated the
  /// state is half-updated: the optimizer becomes not usable with `reason` (see usable()).
  /// No-op when no chunked step is open.
  void abort_step(const std::string& reason = "a chunked step was aborted after updating part of the arena") noexcept;
  /// Whether begin_step() was called without finish_step() yet.
  bool step_in_progress() const;

private:
  friend class detail::exclusive_state;
  struct impl;
  std::unique_ptr<impl> impl_;
};

} // namespace hostopt
