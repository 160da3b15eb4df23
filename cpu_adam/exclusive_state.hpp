#pragma once
// Locked access to an optimizer's whole state for the code that must see it at once
// (checkpoints): holds the optimizer's lock, with no chunked step open, for its lifetime.
// Public operations of the same optimizer must not be called while one is alive (they
// would wait for this lock).

#include <cstdint>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "fair_mutex.hpp"
#include "hostopt/moment_format.hpp"
#include "hostopt/optimizer.hpp"

namespace hostopt::detail {

class exclusive_state {
public:
  /// Waits for an open chunked step to close. Throws std::runtime_error when the state is
  /// half-updated, unless `allow_failed` (a load, which replaces the state).
  exclusive_state(const optimizer& opt, const char* what, bool allow_failed = false);
  ~exclusive_state();
  exclusive_state(const exclusive_state&) = delete;
  exclusive_state& operator=(const exclusive_state&) = delete;

  std::span<const segment> segments() const;
  /// The part of the layout the optimizer holds (its arrays start at range().begin).
  arena_range range() const;
  /// Where array k of held flat element `flat` (a tensor element of group `group`) lives:
  /// 0 params (f32), 1 exp_avg and 2 exp_avg_sq (f32, bf16 or 8-bit codes, the group's
  /// format), 3 the 8-bit block exponents (two bytes per block; `flat` starts a block).
  char* data_at(int k, std::size_t group, std::size_t flat) const;
  /// Each group's moment format and rounding seed.
  std::vector<moment_format> formats() const;
  const std::vector<std::uint64_t>& seeds() const;
  /// Replaces the groups' rounding seeds (one per group).
  void set_seeds(std::span<const std::uint64_t> seeds);
  std::size_t arena_size() const;
  const std::vector<adam_config>& configs() const;
  std::int64_t step_count() const;
  std::int64_t skipped_steps() const;

  /// Per tensor, how many steps it is behind step_count() (its own count is the
  /// difference); empty when none is behind.
  std::vector<std::int64_t> tensor_lags() const;

  /// Replaces hyper-parameters and counters, validated first (std::invalid_argument);
  /// every tensor's own count becomes `step`.
  void set_counters(std::vector<adam_config> configs, std::int64_t step, std::int64_t skipped);
  /// After set_counters: the tensors' lags (empty: none), validated first.
  void set_tensor_lags(std::span<const std::int64_t> lags);
  /// Marks the state half-updated (a load that failed after it began writing).
  void mark_failed(const std::string& reason);
  /// Marks the state whole (a load that completed).
  void clear_failure();

private:
  optimizer::impl& impl_;
  std::unique_lock<fair_mutex> lock_;
};

} // namespace hostopt::detail
