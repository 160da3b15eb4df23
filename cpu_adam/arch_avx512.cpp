// AVX-512 (F + BW) instantiation of the kernels; compiled with -mavx512f -mavx512bw.
#include "adam_kernel.hpp"

namespace hostopt::detail {
extern constexpr kernel_set kernel_set_avx512 = HOSTOPT_KERNEL_NS::make_kernel_set<xsimd::avx512bw>("avx512");
}
