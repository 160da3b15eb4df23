#include "cpu_features.hpp"

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#include <cstdint>
#endif

namespace hostopt::detail {

#if defined(__x86_64__) || defined(_M_X64)
namespace {

struct cpuid_regs {
  unsigned a = 0, b = 0, c = 0, d = 0;
};

cpuid_regs cpuid(unsigned leaf, unsigned sub) {
  cpuid_regs r;
  __cpuid_count(leaf, sub, r.a, r.b, r.c, r.d);
  return r;
}

std::uint64_t xgetbv0() {
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (std::uint64_t(hi) << 32) | lo;
}

bool os_saves(std::uint64_t mask) {
  const cpuid_regs l1 = cpuid(1, 0);
  const bool osxsave = (l1.c >> 27) & 1u;
  return osxsave && (xgetbv0() & mask) == mask;
}

unsigned max_leaf() { return cpuid(0, 0).a; }

// Everything arch_avx2.cpp is compiled with: AVX2, FMA, F16C (and AVX).
bool detect_avx2() {
  if (max_leaf() < 7) return false;
  const cpuid_regs l1 = cpuid(1, 0), l7 = cpuid(7, 0);
  const bool fma = (l1.c >> 12) & 1u, f16c = (l1.c >> 29) & 1u, avx = (l1.c >> 28) & 1u;
  const bool avx2 = (l7.b >> 5) & 1u;
  return fma && f16c && avx && avx2 && os_saves(0x6u);
}

// Everything arch_avx512.cpp is compiled with: AVX-512 F, BW, VL, DQ and AVX2, FMA, F16C.
bool detect_avx512() {
  if (max_leaf() < 7) return false;
  const cpuid_regs l7 = cpuid(7, 0);
  const bool f = (l7.b >> 16) & 1u, dq = (l7.b >> 17) & 1u, bw = (l7.b >> 30) & 1u, vl = (l7.b >> 31) & 1u;
  // XCR0: SSE (1), AVX (2), opmask (5), ZMM_Hi256 (6), Hi16_ZMM (7).
  return f && dq && bw && vl && detect_avx2() && os_saves(0xE6u);
}

} // namespace

// Read once: under a hypervisor every CPUID traps to it (microseconds), and a step that
// names its kernel asks on every call.
bool cpu_has_avx512() noexcept {
  static const bool has = detect_avx512();
  return has;
}
bool cpu_has_avx2() noexcept {
  static const bool has = detect_avx2();
  return has;
}

bool cpu_has_sse2() noexcept { return true; } // part of x86-64
bool cpu_has_neon() noexcept { return false; }

#elif defined(__aarch64__)

bool cpu_has_avx512() noexcept { return false; }
bool cpu_has_avx2() noexcept { return false; }
bool cpu_has_sse2() noexcept { return false; }
bool cpu_has_neon() noexcept { return true; } // mandatory in AArch64

#else

bool cpu_has_avx512() noexcept { return false; }
bool cpu_has_avx2() noexcept { return false; }
bool cpu_has_sse2() noexcept { return false; }
bool cpu_has_neon() noexcept { return false; }

#endif

} // namespace hostopt::detail
