#pragma once
// Runs one step over (part of) a flat arena: one parallel region, each thread takes its
// static 64-byte aligned slice of the range and calls the group's kernel on every piece
// (tensor) that intersects it. Padding between pieces is never touched. Allocates nothing.

#include <cstddef>
#include <cstdint>

#include "kernel_set.hpp"
#include "step_scalars.hpp"

namespace hostopt::detail {

/// One tensor's elements in the arena and where its gradient and copy-out live.
struct update_piece {
  std::size_t offset = 0;  // first arena element
  std::size_t size = 0;    // elements
  std::size_t group = 0;   // index into update_job::groups
  const void* grad = nullptr; // element `offset` of this piece's gradient
  void* out = nullptr;        // element `offset` of this piece's copy-out, or null
};

/// A group's kernel and its per-step constants.
struct group_kernel {
  adam_fn fn = nullptr;
  step_scalars scalars{};
};

struct update_job {
  float* params = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  const update_piece* pieces = nullptr; // sorted by offset, non-overlapping
  std::size_t num_pieces = 0;
  const group_kernel* groups = nullptr;
  std::size_t grad_elem_bytes = 4;
  std::size_t out_elem_bytes = 4;
  std::size_t begin = 0, end = 0;       // arena range to update
};

/// Index of the out-dtype column of kernel_set::adam (0 = no copy-out).
int out_column(bool has_out, int out_dtype);

/// Runs the job on `threads` workers (0 = default).
void run_update(const update_job& job, int threads);

} // namespace hostopt::detail
