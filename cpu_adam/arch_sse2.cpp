// Baseline x86-64 (SSE2) instantiation of the kernels; compiled with no extra flags.
#include "adam_kernel.hpp"

namespace hostopt::detail {
extern constexpr kernel_set kernel_set_sse2 = HOSTOPT_KERNEL_NS::make_kernel_set<xsimd::sse2>(
    "sse2", "SSE2: 4 floats per vector, the x86-64 baseline", "SSE2");
}
