#pragma once
// Page-locked host memory without CUDA: page-aligned allocation, huge-page advice for
// large buffers, mlock where RLIMIT_MEMLOCK allows (a warning, not a failure, if not).

#include <cstddef>

#include "hostopt/copy_engine.hpp"

namespace hostopt::detail {

/// Throws std::runtime_error naming the bytes and the reason on failure.
pinned_allocation allocate_locked_host(std::size_t bytes);
void free_locked_host(pinned_allocation a, std::size_t bytes) noexcept;

} // namespace hostopt::detail
