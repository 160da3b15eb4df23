#pragma once
// One flat arena's step in each moment format, and its roofline twin (the same loads and
// stores, no arithmetic), timed one call at a time: what `kernel` interleaves and `project`
// measures its in-cache costs and the memory's bandwidth with.

#include <optional>
#include <vector>

#include "bench_common.hpp"
#include "hostopt/kernels.hpp"
#include "kernel_set.hpp"
#include "subcommands.hpp"

namespace bench {

/// Bytes a step moves per parameter: the master read and written, both moments read and
/// written (block exponents included), the gradient read and the copy-out written.
double bytes_per_param(const dtype_mix& mix, hostopt::moment_format state = hostopt::moment_format::f32);

/// A flat arena of n parameters with f32 moments and, per compressed format asked for,
/// the same moments encoded; the gradient and copy-out of `mix`. Buffers are first-touched
/// by `threads` workers, as the step will use them.
class state_steps {
public:
  state_steps(std::size_t n, const dtype_mix& mix, const std::vector<hostopt::moment_format>& states, int threads,
              const hostopt::detail::kernel_set& kernels, const hostopt::adam_config& config, bool two_pass = false);
  ~state_steps();
  state_steps(const state_steps&) = delete;
  state_steps& operator=(const state_steps&) = delete;

  /// Seconds of one step of states[k] (the step number advances on every call's own count).
  double step(std::size_t k, std::int64_t t);
  /// Seconds of states[k]'s roofline twin over the same buffers: `twin`'s (default: the
  /// kernels the steps run), e.g. the active kernels' to measure the memory, not a kernel.
  double roofline(std::size_t k, const hostopt::detail::kernel_set* twin = nullptr);
  /// Bytes the buffers of n parameters take (what a memory check asks for).
  static double allocated_bytes(std::size_t n, const dtype_mix& mix, const std::vector<hostopt::moment_format>& states);
  /// Seconds of the two-pass way (f32 step, then a cast pass to the copy-out's dtype).
  double two_pass(std::int64_t t);

private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

} // namespace bench
