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
#include "hostopt/chunk_updater.hpp"
#include "hostopt/dtype.hpp"
#include "hostopt/kernels.hpp"
#include "hostopt/moment_format.hpp"
#include "hostopt/step_options.hpp"

namespace hostopt {

class optimizer;
namespace detail {
class exclusive_state; // the checkpoint code's locked access to an optimizer's state
}

/// Largest step count an optimizer holds (2^53: every t + 1 is exact in double, where the
/// bias corrections are computed). Setting or stepping past it is refused.
inline constexpr std::int64_t max_step_count = std::int64_t(1) << 53;

/// Largest optimizer state in bytes (params + moments): 2^47, the user address space of an
/// x86-64 process (4-level paging). Larger layouts are refused before allocating.
inline constexpr std::uint64_t max_state_bytes = std::uint64_t(1) << 47;

/// A tensor to register: a unique name and a shape (every extent >= 0).
struct tensor_spec {
  std::string name;
  std::vector<std::int64_t> shape;
};

/// Tensors that share hyper-parameters (torch param_groups, optax masks) and how their
/// moments are stored. A typical choice: 8-bit moments for the large matrices, f32 for
/// norms, biases and embeddings (moment_format.hpp; master weights are always f32).
struct param_group {
  adam_config config;
  std::vector<tensor_spec> tensors;
  moment_format moments = moment_format::f32;
  /// Seed of the compressed moments' stochastic rounding (rounding_stream): the bits of
  /// element i at step t are a function of (seed, t, i) and nothing else. Unused for f32.
  std::uint64_t rounding_seed = 0;
};

/// Where a registered tensor lives in the arena.
struct segment {
  std::string name;
  std::vector<std::int64_t> shape;
  std::size_t offset = 0; ///< first element in the arena, a multiple of 16 (64 bytes); of
                          ///< q8_block (32) in a group with 8-bit moments
  std::size_t size = 0;   ///< number of elements (product of the shape)
  std::size_t group = 0;  ///< index of its parameter group
};

/// The arena layout of the groups' tensors: the segments an optimizer built from them has
/// (validated the same way), computed without allocating any state.
std::vector<segment> arena_layout(const std::vector<param_group>& groups);

/// Elements of the arena a layout needs: the end of its last segment, aligned to 16.
std::size_t arena_end(std::span<const segment> layout);

/// Elements [begin, end) of an arena layout.
struct arena_range {
  std::size_t begin = 0, end = 0;
  std::size_t size() const { return end - begin; }
};

/// Adam/AdamW optimizer state in host memory.
///
/// Layout: tensors are placed group after group, in registration order, each at a 64-byte
/// aligned offset of one flat arena; params, exp_avg and exp_avg_sq are three such arenas
/// (12 bytes per element plus alignment padding). The layout is fixed at construction.
/// A step runs one parallel region over the whole arena and allocates nothing.
///
/// Compressed moments (param_group::moments bf16 or 8bit): params stay one flat f32 arena,
/// and each group stores its moments in its own format (8 or 6.0625 bytes per element
/// with the master). The flat exp_avg()/exp_avg_sq() views then do not exist (refused);
/// read_moments()/write_moments() give any tensor's moments as f32, exp_avg(name) views the
/// tensors of f32 groups. Tensors of 8-bit groups start on a 32-element block, and a range
/// (shard) or chunk may not cut one of their blocks: with an 8-bit group, range ends and
/// chunk ends are multiples of 32 (or the arena's end).
///
/// An optimizer may hold only a range of the layout (a shard, see sharding.hpp): its flat
/// buffers then cover that range (arena_size() = range().size()), and tensors that cross
/// the range's ends are held in part. segments() always describes the whole layout.
///
/// Thread safety: every public operation is serialized by a lock inside the object, first
/// come, first served (callers that waited for a chunked step to close go before the next
/// one opens), so concurrent steps, saves and loads from several threads give the serial
/// result and none waits behind a stepping loop for more than a step or two. A
/// chunked step (begin_step .. finish_step, what the offload pipeline runs) belongs to the
/// thread that began it: other threads' operations wait until it is finished or aborted,
/// and the owner calling anything but update_range/finish_step/abort_step (or read_params,
/// usable, failure_reason, step_in_progress) is refused.
/// The spans returned by params()/exp_avg()/exp_avg_sq() are plain views: reading or
/// writing through them while another thread steps is a data race, as with any container.
///
/// Failures: a chunked step aborted after some ranges were updated leaves a half-updated
/// state. The optimizer is then not usable: every operation that reads or writes the state
/// (steps, views, set_params, save_checkpoint, counters) throws std::runtime_error with
/// failure_reason() until load_checkpoint() restores a whole state (or reset_failure()
/// declares the state whole).
class optimizer final : public chunk_updater {
public:
  /// Registers the groups' tensors and zero-initialises params and moments (the flat
  /// arrays first touched by the threads that will update them; compressed groups' storage
  /// in even byte slices). Throws std::invalid_argument for an empty or
  /// duplicate name, a negative extent, a layout over max_state_bytes, bad
  /// hyper-parameters or bad execution options.
  explicit optimizer(std::vector<param_group> groups, execution_options exec = {});
  /// The same holding only elements [range.begin, range.end) of the layout (both ends
  /// multiples of 16, of 32 with an 8-bit group, or the arena's end; std::invalid_argument
  /// otherwise).
  optimizer(std::vector<param_group> groups, arena_range range, execution_options exec = {});
  ~optimizer() override;
  optimizer(optimizer&&) noexcept;
  optimizer& operator=(optimizer&&) noexcept;
  optimizer(const optimizer&) = delete;
  optimizer& operator=(const optimizer&) = delete;

  // --- layout -----------------------------------------------------------------------
  /// Elements this optimizer holds, padding included: the size of a flat gradient or
  /// copy-out view (the whole arena, or the range's size).
  std::size_t arena_size() const override;
  /// 32 (q8_block) when a group has 8-bit moments, else 16.
  std::size_t chunk_unit() const override;
  /// The part of the layout held: [0, arena_end) unless constructed with a range.
  arena_range range() const;
  /// Tensor elements held, padding excluded.
  std::size_t num_params() const;
  /// Bytes this optimizer holds for params and moments: 3 x 4 x arena_size() when every
  /// group is f32; with compressed groups, 4 x arena_size() plus each group's moments.
  std::size_t state_bytes() const;
  /// Every tensor of the layout, in arena order (offsets in the whole layout).
  std::span<const segment> segments() const;
  /// The tensor called `name`; throws std::invalid_argument naming it when unknown.
  const segment& tensor(std::string_view name) const;

  // --- hyper-parameters and step count ------------------------------------------------
  std::size_t num_groups() const;
  adam_config group_config(std::size_t group) const;
  /// How a group stores its moments (fixed at construction).
  moment_format group_moments(std::size_t group) const;
  /// The seed of a group's stochastic rounding (a checkpoint's load restores it).
  std::uint64_t group_rounding_seed(std::size_t group) const;
  /// Sets it (for resuming a state saved elsewhere: the same seed continues the same
  /// rounding stream); serialized with steps like set_group_config.
  void set_group_rounding_seed(std::size_t group, std::uint64_t seed);
  /// Replaces a group's hyper-parameters (schedules); validated first, nothing changes on error.
  void set_group_config(std::size_t group, const adam_config& config);
  /// Sets lr of one group; validated like set_group_config.
  void set_lr(std::size_t group, double lr);
  /// Completed steps; the next step uses t = step_count() + 1.
  std::int64_t step_count() const override;
  /// For resuming; must be in [0, max_step_count]. Every tensor's own count becomes `count`.
  void set_step_count(std::int64_t count);
  /// Each tensor's own step count, in segments() order: the steps in which it received a
  /// gradient (torch's per-parameter "step"). A step with flat buffers or the chunked
  /// step advances every tensor; a per-tensor step advances only the tensors given a
  /// gradient. Bias correction uses the tensor's own count, so a tensor whose first
  /// gradient arrives late (unfrozen, added) starts at t = 1 as in torch. On an optimizer
  /// holding a range, the tensors it overlaps share its step_count().
  std::vector<std::int64_t> tensor_steps() const;
  /// For resuming (e.g. from torch's per-parameter steps): one count per tensor, each in
  /// [0, max_step_count]; step_count() becomes the largest. Refused on an optimizer that
  /// holds a range of the layout when the counts differ.
  void set_tensor_steps(std::span<const std::int64_t> steps);

  // --- execution ----------------------------------------------------------------------
  execution_options execution() const;
  /// Changes threads/kernel for later steps; validated first.
  void set_execution(const execution_options& exec);

  // --- state --------------------------------------------------------------------------
  /// The held elements of each array (arena_size() floats, in the flat layout). The
  /// moment views exist when every group's moments are f32; std::logic_error otherwise.
  std::span<float> params();
  std::span<float> exp_avg();
  std::span<float> exp_avg_sq();
  std::span<const float> params() const;
  std::span<const float> exp_avg() const;
  std::span<const float> exp_avg_sq() const;
  /// One tensor's slice of each array; throw for an unknown name or a tensor this
  /// optimizer does not hold whole, and (moments) a tensor of a compressed group.
  std::span<float> params(std::string_view name);
  std::span<float> exp_avg(std::string_view name);
  std::span<float> exp_avg_sq(std::string_view name);
  /// Copies `values` (any dtype, exactly tensor(name).size elements: the whole tensor)
  /// into the master parameters of `name`; of a tensor held in part, the held part.
  void set_params(std::string_view name, const_view values);
  /// One tensor's moments as f32, whatever its group's format (exact: every code is an f32
  /// value). Each span has tensor(name).size elements; the tensor must be held whole.
  void read_moments(std::string_view name, std::span<float> exp_avg, std::span<float> exp_avg_sq) const;
  /// One tensor's compressed storage in a bf16 or 8-bit group: its tensor(name).size codes
  /// per moment and, for 8-bit, the exponent bytes of its blocks (2 per block; the tensor
  /// starts a block). Plain views like exp_avg(name): what a framework's state dict holds.
  /// Throws for an f32 group's tensor (use exp_avg(name)) and as exp_avg(name) does.
  compressed_moments moment_codes(std::string_view name);
  /// Sets one tensor's moments from f32 values: copied for an f32 group, encoded for a
  /// compressed one (lossy, stochastically rounded with the group's seed: the explicit
  /// conversion between formats). Validated first (sizes, exp_avg_sq >= 0 for compressed
  /// groups); on error nothing changes.
  void write_moments(std::string_view name, std::span<const float> exp_avg, std::span<const float> exp_avg_sq);

  // --- the step -----------------------------------------------------------------------
  /// One step with a flat gradient in the flat layout (arena_size() elements; padding is
  /// never read) and an optional flat copy-out in the same layout (padding never written).
  /// All buffers are validated before anything is written; on error nothing changes.
  /// The overloads taking a float grad_scale trust the gradients (no checks, fastest).
  step_result step(const_view flat_grad, mut_view flat_out = {}, float grad_scale = 1.0f);
  /// The same with checks and clipping (step_options).
  step_result step(const_view flat_grad, mut_view flat_out, const step_options& options);
  /// Throws what step(flat_grad, flat_out, options) would refuse before reading a gradient
  /// (buffers, options, a state that is not usable, a step count at its limit), changing
  /// nothing. A step that passes may still be skipped (non-finite gradients).
  void check_step(const_view flat_grad, mut_view flat_out, const step_options& options) const;
  /// One step with one gradient view per tensor (arena order, one dtype for all) and
  /// optionally one copy-out view per tensor (one dtype for all). An empty view
  /// (`const_view{}`) means the tensor has no gradient this step: its parameters, moments
  /// and copy-out are left untouched and its own step count stays (torch skips parameters
  /// whose .grad is None); step_count() counts the step. Refused on
  /// an optimizer that holds a range of the layout (use the flat overloads).
  step_result step(std::span<const const_view> grads, std::span<const mut_view> outs = {},
                   float grad_scale = 1.0f);
  /// The same with checks and clipping (step_options).
  step_result step(std::span<const const_view> grads, std::span<const mut_view> outs, const step_options& options);
  /// Steps skipped so far because of non-finite gradients.
  std::int64_t skipped_steps() const;
  /// For resuming; must be in [0, max_step_count].
  void set_skipped_steps(std::int64_t count);

  // --- failures -----------------------------------------------------------------------
  /// False after a chunked step failed midway (the state is partly updated).
  bool usable() const override;
  /// Why the optimizer is not usable ("" when it is).
  std::string failure_reason() const override;
  /// Declares the state whole again (e.g. after the caller restored it through the
  /// views). load_checkpoint() does this itself.
  void reset_failure();

  // --- chunked steps (chunk_updater: what the offload pipeline drives) -----------------
  /// See chunk_updater::begin_step. Throws std::invalid_argument for bad dtypes or
  /// options, or checks that need a norm without checks.known_grad_norm.
  step_result begin_step(const chunk_step_options& options) override;
  void check_options(const chunk_step_options& options) const override;
  /// Updates flat-layout elements [begin, end) (padding inside is skipped).
  void update_range(std::size_t begin, std::size_t end, const void* grad, void* out = nullptr,
                    const float* accumulator = nullptr) override;
  step_result finish_step() override;
  void abort_step(const std::string& reason = "a chunked step was aborted after updating part of the arena") noexcept
      override;
  void mark_unusable(const std::string& reason) noexcept override;
  void accumulate_range(std::size_t begin, std::size_t end, float* acc, const void* grad, dtype grad_type,
                        bool first) override;
  void read_params(std::size_t begin, std::size_t end, void* out, dtype type) const override;
  /// Whether begin_step() opened a step that is not finished or aborted yet.
  bool step_in_progress() const;
  /// How many callers are blocked on this optimizer right now: queued for its lock, or
  /// waiting for another thread's chunked step to close. Never blocks (a contention
  /// diagnostic: e.g. a save stuck behind a pipeline shows here).
  std::size_t waiting_callers() const noexcept;

private:
  friend class detail::exclusive_state;
  struct impl;
  std::unique_ptr<impl> impl_;
};

} // namespace hostopt
