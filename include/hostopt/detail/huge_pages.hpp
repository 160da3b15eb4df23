#pragma once
/// \file detail/huge_pages.hpp
/// Internal: how hostopt aligns its large host allocations (the optimizer arena, pinned
/// buffers), shared by cpu_adam/ and transfer/ so the rule exists once.

#include <cstddef>

namespace hostopt::detail {

/// A transparent huge page on x86-64 and (4 KiB-granule) aarch64 Linux.
inline constexpr std::size_t huge_page_bytes = std::size_t(2) << 20;

/// Alignment for `bytes`: a huge page when the allocation spans one (fewer TLB misses on a
/// streaming kernel, and madvise(MADV_HUGEPAGE) can apply), else `min_align`.
constexpr std::size_t allocation_alignment(std::size_t bytes, std::size_t min_align) {
  return bytes >= huge_page_bytes ? huge_page_bytes : min_align;
}

/// `bytes` rounded up to a multiple of `align`.
constexpr std::size_t round_up(std::size_t bytes, std::size_t align) { return (bytes + align - 1) / align * align; }

} // namespace hostopt::detail
