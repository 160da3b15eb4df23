#pragma once
// The io_uring io_queue (liburing), where hostopt was built with it and the kernel allows it.

#include <memory>

#include "io_queue.hpp"

namespace hostopt::drive {

/// std::system_error naming why where io_uring cannot be used (uring_unavailable_reason()).
std::unique_ptr<io_queue> make_uring_queue(unsigned depth);

} // namespace hostopt::drive
