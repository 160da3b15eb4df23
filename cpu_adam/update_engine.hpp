#pragma once
// Runs one step over (part of) a flat arena: one parallel region, each thread takes its
// static 64-byte aligned slice of the range and calls the group's kernel on every piece
// (tensor) that intersects it. Padding between pieces is never touched. Allocates nothing.

#include <cstddef>
#include <cstdint>

#include "kernel_set.hpp"
#include "step_scalars.hpp"

namespace hostopt::detail {

/// One tensor's elements in the arena and, for per-tensor views, where its gradient and
/// copy-out live.
struct update_piece {
  std::size_t offset = 0;     // first arena element
  std::size_t size = 0;       // elements
  std::size_t group = 0;      // index into update_job::groups
  const void* grad = nullptr; // its first element's gradient (per-tensor views)
  void* out = nullptr;        // its first element's copy-out, or null (per-tensor views)
  bool no_grad = false;       // flat buffers: no gradient this step, left untouched
};

/// Where a group's moments live when they are not the job's f32 arrays: the group's own
/// storage for the arena elements from `origin` (a multiple of q8_block) on. An f32 group
/// with null pointers uses the job's arrays.
struct moment_storage {
  moment_format format = moment_format::f32;
  void* exp_avg = nullptr;        // f32 or bf16 values or 8-bit codes, one per element
  void* exp_avg_sq = nullptr;
  std::uint8_t* scales = nullptr; // 8-bit: two exponent bytes per block
  std::size_t origin = 0;
  std::uint64_t seed = 0;         // of the stochastic rounding
};

/// A group's kernel and its per-step constants.
struct group_kernel {
  adam_fn fn = nullptr;
  step_scalars scalars{};
  // Compressed moments (storage.format != f32): this kernel instead of fn, with call's
  // constants (call.first is set per range).
  moment_storage storage;
  adam_compressed_fn compressed = nullptr;
  compressed_call call;
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
  std::size_t begin = 0, end = 0; // arena range to update
  // Job index a is element index_origin + a of the whole layout (a shard's offset): the
  // index compressed moments' rounding is keyed on.
  std::uint64_t index_origin = 0;
  // Flat buffers in arena layout instead of the pieces' own pointers: arena element e's
  // gradient is flat_grad[e - flat_origin] (likewise flat_out, flat_accumulator).
  const void* flat_grad = nullptr;
  void* flat_out = nullptr;
  std::size_t flat_origin = 0;
  // Optional f32 gradient accumulator (flat layout): the step's gradient is then
  // grad + accumulator, summed block by block into an L1-resident buffer (add_grad) and
  // fed to the groups' kernels, which must be their f32-gradient variants.
  const float* flat_accumulator = nullptr;
  add_grad_fn add_grad = nullptr;
};

/// A job over one piece, elements [0, n) of caller-owned buffers (the one-buffer steps;
/// exp_avg/exp_avg_sq unused by a group with compressed storage).
inline update_job one_piece_job(float* params, float* exp_avg, float* exp_avg_sq, const update_piece& piece,
                                const group_kernel& group, std::size_t grad_elem_bytes, std::size_t out_elem_bytes) {
  update_job job;
  job.params = params;
  job.exp_avg = exp_avg;
  job.exp_avg_sq = exp_avg_sq;
  job.pieces = &piece;
  job.num_pieces = 1;
  job.groups = &group;
  job.grad_elem_bytes = grad_elem_bytes;
  job.out_elem_bytes = out_elem_bytes;
  job.begin = 0;
  job.end = piece.size;
  return job;
}

/// Runs the job on `threads` workers (0 = default); returns what the compressed kernels
/// saw (block_counts: zero without 8-bit groups).
block_counts run_update(const update_job& job, int threads);

} // namespace hostopt::detail
