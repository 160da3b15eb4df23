#pragma once
// Validation of caller buffers at the API boundary: null pointers, sizes, dtypes and
// overlaps, with messages that name the argument, the value and what was expected.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "hostopt/dtype.hpp"

namespace hostopt::detail {

/// Throws std::invalid_argument if `t` is not a dtype enumerator.
void check_dtype(const std::string& what, dtype t);

/// Throws if data is null with size > 0, the dtype is invalid, or size != expected.
void check_view(const std::string& what, const void* data, std::size_t size, dtype t,
                std::size_t expected);

void check_step_number(std::int64_t step);
void check_grad_scale(float grad_scale);
void check_threads(int threads);

/// A byte range a step reads or writes, for overlap checks.
struct byte_range {
  std::uintptr_t lo = 0, hi = 0; // [lo, hi)
  bool written = false;
  int kind = 0;            // index into the names given to check_no_overlap
  std::size_t index = 0;   // which view of that kind
};

inline byte_range range_of(const void* p, std::size_t bytes, bool written, int kind,
                           std::size_t index) {
  const auto lo = reinterpret_cast<std::uintptr_t>(p);
  return {lo, lo + bytes, written, kind, index};
}

/// Sorts `ranges` in place and throws std::invalid_argument naming the first pair that
/// overlaps where at least one side is written. kind_names[kind] names each kind
/// ("grad", "out", "optimizer state"). Empty ranges never overlap.
void check_no_overlap(std::vector<byte_range>& ranges, const char* const* kind_names,
                      const std::vector<std::string>* tensor_names = nullptr, bool index_every_kind = false);

/// check_no_overlap over the ranges of `leaves` leaves (byte_range::index = leaf): one leaf
/// is named by kind alone ("grad"), several by "leaf i" and kind.
void check_no_overlap_of_leaves(std::vector<byte_range>& ranges, const char* const* kind_names, std::size_t leaves);

} // namespace hostopt::detail
