#include "aligned_buffer.hpp"

#include "hostopt/detail/huge_pages.hpp"

#include <cstdlib>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace hostopt::detail {

aligned_floats::aligned_floats(std::size_t count) : size_(count) {
  if (count == 0) return;
  const std::size_t bytes = count * sizeof(float);
  const std::size_t align = allocation_alignment(bytes, 64);
  const std::size_t rounded = round_up(bytes, align);
  void* p = nullptr;
  if (posix_memalign(&p, align, rounded) != 0 || p == nullptr)
    throw std::runtime_error("hostopt: cannot allocate " + std::to_string(rounded) +
                             " bytes of optimizer state (out of memory)");
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  // Fewer TLB misses on a streaming kernel; only advice, so a refusal is harmless.
  if (align == huge_page_bytes) madvise(p, rounded, MADV_HUGEPAGE);
#endif
  data_ = static_cast<float*>(p);
}

aligned_floats::~aligned_floats() { std::free(data_); }

aligned_floats& aligned_floats::operator=(aligned_floats&& o) noexcept {
  if (this != &o) {
    std::free(data_);
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
  }
  return *this;
}

} // namespace hostopt::detail
