#pragma once
/// \file sharding.hpp
/// ZeRO-style sharding of the optimizer state across processes: each rank owns one
/// contiguous, 64-byte aligned range of the flat arena (tensors may cross ranges). The
/// transport is the caller's (MPI, torch.distributed): reduce-scatter the gradients into
/// the shard, step it, all-gather the parameters.

#include <cstddef>
#include <string>
#include <vector>

#include "hostopt/gradient_checks.hpp"
#include "hostopt/optimizer.hpp"

namespace hostopt {

/// Arena range [begin, end) owned by `rank` of `world_size`: contiguous, boundaries at
/// multiples of 16 elements (64 bytes) or at arena_size, sizes balanced to within one
/// alignment unit. Throws std::invalid_argument for world_size < 1 or rank outside it.
struct shard_range {
  std::size_t begin = 0, end = 0;
};
shard_range shard_of(std::size_t arena_size, int world_size, int rank);


/// One rank's share of an optimizer: the state of arena range [shard().begin, shard().end)
/// only (12 bytes per element of the range). Gradient and parameter buffers are the
/// shard's slice of the full flat arena layout (what MPI_Reduce_scatter and
/// MPI_Allgatherv exchange), so the results are bit-identical to the single-process
/// optimizer on the same summed gradients.
class sharded_optimizer {
public:
  sharded_optimizer(std::vector<param_group> groups, int world_size, int rank, execution_options exec = {});

  int world_size() const { return world_; }
  int rank() const { return rank_; }
  /// Elements of the full arena (every rank's buffers are laid out in it).
  std::size_t arena_size() const { return arena_; }
  shard_range shard() const { return shard_; }
  /// The full model's tensors (global arena offsets).
  std::span<const segment> segments() const { return layout_; }

  /// Sets the shard's part of tensor `name` from the full tensor's values (f32).
  void set_params(std::string_view name, std::span<const float> full_values);
  /// Statistics of this shard's gradients (tensor elements only); all-reduce the sums of
  /// squares across ranks and pass sqrt(total) as step_options::known_grad_norm to clip.
  grad_stats shard_stats(const_view shard_grad) const;
  /// Steps the shard: `shard_grad` holds arena elements [shard().begin, shard().end) of
  /// the summed gradients; `shard_params` (optional) receives the new parameters of the
  /// same range (padding never written).
  step_result step(const_view shard_grad, mut_view shard_params, const step_options& options = {});

  /// The shard's state (its tensors are the pieces of the model's tensors in the range).
  const optimizer& local() const { return local_; }
  optimizer& local() { return local_; }

  /// Writes this rank's shard to DIR/shard-RANK-of-WORLD.safetensors (atomically) and, on
  /// rank 0, DIR/index.json (atomically too) naming the world size, each rank's range, the
  /// step and the save id. Every file of one save carries the same save id and step;
  /// `save_id` defaults to "step-N". Pass an id every rank agrees on and that differs
  /// between runs (e.g. a random number broadcast from rank 0) when a restarted job may
  /// save the same step into the same directory again.
  void save(const std::string& dir, const std::string& save_id = "") const;
  /// Loads from a sharded checkpoint written with any world size: the ranges this rank
  /// owns are read from the shard files that hold them (re-sharding). Everything is read
  /// and checked before the state changes; shard files whose save id, step, world size,
  /// rank or range differ from index.json (files of different saves) are refused.
  void load(const std::string& dir);

private:
  sharded_optimizer(std::vector<param_group> groups, int world_size, int rank, execution_options exec,
                    std::vector<segment> layout);

  std::vector<param_group> groups_;
  int world_, rank_;
  std::vector<segment> layout_; // the full model's layout (no state)
  std::size_t arena_;
  shard_range shard_;
  std::vector<std::size_t> piece_global_; // global arena offset of each local tensor piece (filled by local_'s init)
  optimizer local_;
  std::vector<const_view> grad_views_;
  std::vector<mut_view> out_views_;
};

} // namespace hostopt
