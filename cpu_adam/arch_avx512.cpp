// AVX-512 instantiation of the kernels; compiled with -mavx512f -mavx512bw -mavx512vl
// -mavx512dq (plus -mavx2 -mfma -mf16c): the registry checks all of them (cpu_has_avx512).
#include "adam_kernel.hpp"

namespace hostopt::detail {
extern constexpr kernel_set kernel_set_avx512 = HOSTOPT_KERNEL_NS::make_kernel_set<xsimd::avx512bw>(
    "avx512", "AVX-512: 16 floats per vector", "AVX-512 F, BW, VL, DQ; AVX2, FMA, F16C; ZMM state enabled by the OS");
}
