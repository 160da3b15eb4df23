#pragma once
// The open chunked step (begin_step .. finish_step, what the offload pipeline runs): what
// begin_step decided and how far its chunks have come. The turn it holds on the optimizer
// is operation_turns'.

#include <cstddef>
#include <cstdint>
#include <vector>

#include "hostopt/chunk_updater.hpp"
#include "hostopt/step_options.hpp"
#include "kernel_set.hpp"

namespace hostopt::detail {

struct chunked_step {
  chunk_step_options options{};
  step_decision decision;
  std::size_t updates = 0; // update_range calls so far: an abort after one leaves the state half-updated
  std::size_t covered = 0; // the chunks so far cover [0, covered), in order
  block_counts seen;       // what the chunks' kernels saw so far

  /// begin_step: `options`, decided as `decision`, opens.
  void open(const chunk_step_options& options, const step_decision& decision);
  /// update_range: refuses [begin, end) of a flat layout of `size` elements when it is not
  /// the next chunk, or (not empty) when it cuts an 8-bit block (`q8_blocks`: a group has them) or its
  /// buffers are not the ones begin_step announced.
  void check_next(std::size_t begin, std::size_t end, std::size_t size, bool q8_blocks, const void* grad,
                  const void* out, const float* accumulator) const;
  /// finish_step: refuses a step whose chunks did not reach the end of `size` elements.
  void check_complete(std::size_t size) const;
  /// Ends the step; `decision` and `seen` keep what it decided and counted (finish_step reads them after).
  void close();
};

/// A step's tensors without a gradient (per-tensor steps): valid indices below `tensors`,
/// and only where each tensor has its own step count (`whole`: the whole layout is held, not
/// a shard's range, whose tensors share one count). std::invalid_argument prefixed by `what`.
void check_tensors_without_grad(const std::vector<std::size_t>& without, std::size_t tensors, bool whole,
                                const char* what);

} // namespace hostopt::detail
