#pragma once
// What this CPU and operating system can run. xsimd 8.1 reads CPUID but does not check
// that the OS saves the AVX/AVX-512 register state (XCR0), so we do both here.

namespace hostopt::detail {

bool cpu_has_avx512() noexcept; // AVX-512 F, BW, VL, DQ + AVX2/FMA/F16C, ZMM/opmask state enabled by the OS
bool cpu_has_avx2() noexcept;   // AVX2 + FMA + F16C, with YMM state enabled by the OS
bool cpu_has_sse2() noexcept;
bool cpu_has_neon() noexcept;

} // namespace hostopt::detail
