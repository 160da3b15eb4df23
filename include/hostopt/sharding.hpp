#pragma once
/// \file sharding.hpp
/// ZeRO-style sharding of the optimizer state across processes: each rank owns one
/// contiguous, 64-byte aligned range of the flat arena (tensors may cross ranges). The
/// transport is the caller's (MPI, torch.distributed): reduce-scatter the gradients into
/// the shard, step it, all-gather the parameters.

#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "hostopt/gradient_checks.hpp"
#include "hostopt/optimizer.hpp"

namespace hostopt {

/// Arena range [begin, end) owned by `rank` of `world_size`: contiguous, boundaries at
/// multiples of `unit` elements (16: 64 bytes) or at arena_size, sizes balanced to within
/// one unit. Throws std::invalid_argument for world_size < 1 or rank outside it.
using shard_range = arena_range;
shard_range shard_of(std::size_t arena_size, int world_size, int rank, std::size_t unit = 16);
/// The shard of the groups' layout that a sharded_optimizer of rank `rank` holds: cut on
/// multiples of 16, or of 32 (q8_block) when a group has 8-bit moments (no block is cut).
shard_range shard_of(const std::vector<param_group>& groups, int world_size, int rank);

/// Sums a value across every rank and returns the total (e.g. MPI_Allreduce with
/// MPI_SUM, or torch.distributed.all_reduce). Called collectively: every rank must step.
using sum_across_ranks = std::function<double(double local)>;

/// A sharded step refused by one or more ranks, thrown on every rank of it (the ranks agree
/// before any of them waits in a reduction; nothing is applied on any rank). what() says how
/// many ranks refused and which (up to 24 ranks), and on a refusing rank why.
class sharded_step_refused : public std::runtime_error {
public:
  sharded_step_refused(const std::string& what, int refused_ranks, std::string reason)
      : std::runtime_error(what), refused_(refused_ranks), reason_(std::move(reason)) {}
  /// How many ranks refused (-1 when the reduction did not return a count).
  int refused_ranks() const noexcept { return refused_; }
  /// This rank's own refusal ("" when only other ranks refused).
  const std::string& reason() const noexcept { return reason_; }

private:
  int refused_;
  std::string reason_;
};

/// One rank's share of an optimizer: an optimizer holding arena range shard() of the
/// layout (12 bytes per element of the range). Gradient and parameter buffers are the
/// shard's slice of the full flat arena layout (what MPI_Reduce_scatter and
/// MPI_Allgatherv exchange), so the results are bit-identical to the single-process
/// optimizer on the same summed gradients.
///
/// Decisions that must be the same on every rank are made from global quantities: a step
/// that checks for non-finite gradients or clips needs the global norm — passed as
/// step_options::known_grad_norm (all-reduced by the caller), or computed through the
/// reduction set with set_norm_reduction — and is refused otherwise (a rank-local decision
/// would let one rank skip while the others apply, and clip by the wrong norm).
///
/// Refusals never leave ranks waiting: a step that reduces first validates this rank's
/// inputs, then the ranks sum their refusals through the same reduction, and if any rank
/// refused, every rank throws sharded_step_refused before the norm's reduction. A step given
/// known_grad_norm makes no collective of its own, so hostopt cannot agree for it: fold
/// check_step's verdict into the all-reduce that computes the norm (or call agree_step) and
/// step only when no rank refused, as examples/torch_distributed.py does.
class sharded_optimizer {
public:
  sharded_optimizer(std::vector<param_group> groups, int world_size, int rank, execution_options exec = {});

  int world_size() const { return world_; }
  int rank() const { return rank_; }
  /// Elements of the full arena (every rank's buffers are laid out in it).
  std::size_t arena_size() const { return arena_; }
  shard_range shard() const { return shard_; }
  /// The full model's tensors (global arena offsets).
  std::span<const segment> segments() const { return local_.segments(); }

  /// Sets the shard's part of tensor `name` from the full tensor's values (f32).
  void set_params(std::string_view name, std::span<const float> full_values);
  /// Statistics of this shard's gradients (tensor elements only); all-reduce the sums of
  /// squares across ranks and pass sqrt(total) as step_options::known_grad_norm.
  grad_stats shard_stats(const_view shard_grad) const;
  /// How the global norm is computed when a checked or clipping step is given none: the
  /// shard's sum of squares is summed across ranks by `reduce` (collective). Such a step
  /// calls `reduce` twice: the ranks' refusals (0 on a rank that accepts the step; integers
  /// below 2^24, exact in float32 too), then the sums of squares. Set it on every rank or
  /// on none.
  void set_norm_reduction(sum_across_ranks reduce);
  /// Steps the shard: `shard_grad` holds arena elements [shard().begin, shard().end) of
  /// the summed gradients; `shard_params` (optional) receives the new parameters of the
  /// same range (padding never written). With checks or clipping, the global norm comes
  /// from options.known_grad_norm or the norm reduction; with neither (and more than one
  /// rank) the step is refused with std::invalid_argument. Every rank must call it, with
  /// the same options. When it reduces (the norm reduction computes the norm), the ranks
  /// agree first: a step refused on any rank (buffers, options, a state that is not usable,
  /// see check_step) throws sharded_step_refused on every rank, nothing applied anywhere,
  /// and no rank is left waiting. A step that does not reduce throws its refusal on the
  /// refusing rank alone (see the class comment). The global norm sums per-shard block sums:
  /// its last bits can differ from one process's statistics pass (a tensor crossing a
  /// shard boundary is summed in other blocks); pass the all-reduced norm to a
  /// single-process reference for bit-identical comparisons, as the examples do.
  step_result step(const_view shard_grad, mut_view shard_params, const step_options& options);
  /// Throws what step(shard_grad, shard_params, options) would refuse on this rank, given the
  /// global norm (options.known_grad_norm may still be unknown: its all-reduce can carry the
  /// verdict), changing nothing and calling no reduction.
  void check_step(const_view shard_grad, mut_view shard_params, const step_options& options) const;
  /// The agreement a reducing step makes, through `reduce` (collective: every rank calls it
  /// before its step): check_step on this rank, one sum of the refusals, and
  /// sharded_step_refused on every rank when any refused. For steps given known_grad_norm
  /// (one collective more than folding check_step into the norm's all-reduce).
  void agree_step(const_view shard_grad, mut_view shard_params, const step_options& options,
                  const sum_across_ranks& reduce) const;
  /// For a rank that cannot make its step call (its inputs failed before it, e.g. while
  /// converting its buffers), so that the others are not left waiting for it: joins the
  /// agreement the other ranks make — agree_step's through `reduce` when given, else the
  /// step's own when a step with `options` reduces — as a refusing rank with `reason`, and
  /// throws sharded_step_refused. Returns when there is no agreement to join (no rank
  /// waits): the caller then throws its own error.
  void refuse_step(const std::string& reason, const step_options& options, const sum_across_ranks& reduce = {}) const;

  /// The shard's optimizer (it holds range shard() of the layout).
  const optimizer& local() const { return local_; }
  optimizer& local() { return local_; }

  /// Writes this rank's shard of save `save_id` to DIR/shard-RANK-of-WORLD.SAVE_ID.safetensors
  /// (atomically). `save_id` names one save: the same on every rank and different for each
  /// save (a counter, or one broadcast from rank 0; not the step count, which a skipped
  /// step leaves unchanged); letters, digits, '.', '_' and '-', at most 64. The committed
  /// save's id is refused; earlier saves in DIR stay intact until commit_save.
  void save(const std::string& dir, const std::string& save_id) const;
  /// Rank 0, after every rank's save of `save_id` returned (a barrier): verifies every shard
  /// file of it completely (checksums included), points DIR/index.json at it (written
  /// atomically: a crash leaves the previous save current), then removes the shard files
  /// of other saves.
  void commit_save(const std::string& dir, const std::string& save_id) const;
  /// Loads the save index.json names, written with any world size (re-sharding): each rank
  /// opens the old shard files that hold part of its range, verifies each completely in a
  /// streaming pass (the checksum covers the whole file), then streams it again and copies
  /// out only the ranges it owns — memory stays a few MiB of buffers, no old shard is
  /// materialised, and each overlapping file is read twice. Shard files whose save id,
  /// step, world size, rank or range differ from the index are refused before the state
  /// changes.
  void load(const std::string& dir);

private:
  int world_, rank_;
  std::size_t arena_;
  shard_range shard_;
  optimizer local_;
  std::unique_ptr<std::mutex> reduce_mu_ = std::make_unique<std::mutex>(); // movable
  sum_across_ranks reduce_;
  sum_across_ranks norm_reduction() const;
  void agree(const sum_across_ranks& reduce, const std::string* refusal) const;
};

} // namespace hostopt
