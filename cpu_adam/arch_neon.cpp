// AArch64 NEON instantiation of the kernels (only built on aarch64, whose vector division
// and square root — vdivq_f32, vsqrtq_f32, used directly in simd_ops.hpp because xsimd
// 8.1 would use 32-bit NEON's estimates — are correctly rounded).
#include "adam_kernel.hpp"

namespace hostopt::detail {
extern constexpr kernel_set kernel_set_neon = HOSTOPT_KERNEL_NS::make_kernel_set<xsimd::neon64>(
    "neon", "AArch64 Advanced SIMD: 4 floats per vector", "AArch64 Advanced SIMD (always present)");
}
