// Portable scalar instantiation of the kernels: the full implementation on any CPU.
#include "adam_kernel.hpp"

namespace hostopt::detail {
extern constexpr kernel_set kernel_set_scalar = HOSTOPT_KERNEL_NS::make_kernel_set<HOSTOPT_KERNEL_NS::scalar_arch>(
    "scalar", "portable C++, one float at a time", "none");
}
