// AArch64 NEON instantiation of the kernels (only built on aarch64, where NEON's vector
// division and square root are correctly rounded; 32-bit NEON's are estimates).
#include "adam_kernel.hpp"

namespace hostopt::detail {
extern constexpr kernel_set kernel_set_neon = HOSTOPT_KERNEL_NS::make_kernel_set<xsimd::neon64>(
    "neon", "AArch64 Advanced SIMD: 4 floats per vector", "AArch64 Advanced SIMD (always present)");
}
