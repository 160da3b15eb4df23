// AVX2 + FMA + F16C instantiation of the kernels; compiled with -mavx2 -mfma -mf16c.
// (xsimd names the arch fma3<avx2>; the kernel itself uses no fused multiply-add.)
#include "adam_kernel.hpp"

namespace hostopt::detail {
extern constexpr kernel_set kernel_set_avx2 = HOSTOPT_KERNEL_NS::make_kernel_set<xsimd::fma3<xsimd::avx2>>(
    "avx2", "AVX2: 8 floats per vector, F16C conversions", "AVX2, FMA, F16C; YMM state enabled by the OS");
}
