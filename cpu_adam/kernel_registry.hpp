#pragma once
// The kernels compiled into this build, best first, and the choice among them.

#include <span>
#include <string_view>

#include "kernel_set.hpp"

namespace hostopt::detail {

struct registry_entry {
  const kernel_set* kernels;
  bool (*supported)() noexcept;
};

/// Every kernel set compiled in, best first.
std::span<const registry_entry> kernel_registry();

/// The default kernel set (best supported, or HOSTOPT_FORCE_ARCH), chosen once.
const kernel_set& active_kernel_set();

/// The kernel set called `name` ("" = active); throws std::invalid_argument for an
/// unknown name, std::runtime_error when this CPU cannot run it.
const kernel_set& kernel_set_by_name(std::string_view name);

} // namespace hostopt::detail
