#pragma once
// One parallel region per step (OpenMP or TBB, chosen at build time) and the static,
// 64-byte aligned partition of a flat range across its threads.

#include <cstddef>
#include <utility>

namespace hostopt::detail {

/// Elements per alignment unit: 64 bytes of f32.
inline constexpr std::size_t align_elems = 16;

/// Elements per unit of a thread's slice: 128 bytes of f32, whole blocks of the 8-bit
/// moment format (q8_block), so no block is shared by two threads.
inline constexpr std::size_t slice_elems = 32;

/// Worker count used when the caller asks for 0 threads.
int default_threads();

/// Name of the threading runtime: "openmp" or "tbb".
const char* threading_backend();

/// Runs body(ctx, tid, nthreads) once per worker, tid in [0, nthreads), and returns when
/// all are done. nthreads may be lower than `threads` if the runtime gives fewer.
void run_parallel(int threads, void (*body)(void* ctx, int tid, int nthreads) noexcept, void* ctx);

template <class F>
void run_parallel(int threads, F& f) {
  run_parallel(
      threads, [](void* c, int tid, int n) noexcept { (*static_cast<F*>(c))(tid, n); }, &f);
}

/// Part `part` of `nparts` of [begin, end): contiguous, boundaries at multiples of
/// `unit` (absolute; threads' slices: slice_elems), sizes balanced to within one unit.
inline std::pair<std::size_t, std::size_t> partition(std::size_t begin, std::size_t end, int part,
                                                     int nparts, std::size_t unit = slice_elems) {
  const std::size_t first_unit = begin / unit;
  const std::size_t units = (end + unit - 1) / unit - first_unit;
  const std::size_t lo_unit = first_unit + units * std::size_t(part) / std::size_t(nparts);
  const std::size_t hi_unit = first_unit + units * std::size_t(part + 1) / std::size_t(nparts);
  std::size_t lo = lo_unit * unit, hi = hi_unit * unit;
  if (lo < begin) lo = begin;
  if (hi > end) hi = end;
  if (lo > hi) lo = hi;
  return {lo, hi};
}

} // namespace hostopt::detail
