#pragma once
// The floating-point mode the kernels are written for: IEEE round to nearest even, with
// subnormal inputs and results kept. A process hosting hostopt may run with another one:
// XLA leaves the threads it runs on flushing subnormals (FTZ/DAZ in x86's MXCSR, FZ in
// AArch64's FPCR), and a step run partly on such a thread and partly on a fresh OpenMP
// worker gave different bits per thread (a clip factor of 4e-40 read as 0 on one of them).
// Each parallel region and each step plan sets the mode for its own duration and restores
// the caller's.

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace hostopt::detail {

class ieee_float_mode {
public:
#if defined(__x86_64__) || defined(_M_X64)
  // MXCSR: FTZ (bit 15), DAZ (bit 6), rounding control (bits 13-14, 00 = to nearest).
  static constexpr unsigned non_ieee_bits = 0x8000u | 0x0040u | 0x6000u;
  ieee_float_mode() noexcept : saved_(_mm_getcsr()) {
    if (saved_ & non_ieee_bits) _mm_setcsr(saved_ & ~non_ieee_bits);
  }
  ~ieee_float_mode() {
    if (saved_ & non_ieee_bits) _mm_setcsr(saved_);
  }
#elif defined(__aarch64__) && defined(__GNUC__)
  // FPCR: FZ (bit 24), FZ16 (bit 19), rounding mode (bits 22-23, 00 = to nearest), and
  // FEAT_AFP's FIZ (bit 0: subnormal inputs read as zero) and AH (bit 1: x86-like NaN and
  // flushing rules); both are RES0 without FEAT_AFP, so clearing them is harmless there.
  static constexpr unsigned non_ieee_bits = (1u << 24) | (1u << 19) | (3u << 22) | 3u;
  ieee_float_mode() noexcept : saved_(__builtin_aarch64_get_fpcr()) {
    if (saved_ & non_ieee_bits) __builtin_aarch64_set_fpcr(saved_ & ~non_ieee_bits);
  }
  ~ieee_float_mode() {
    if (saved_ & non_ieee_bits) __builtin_aarch64_set_fpcr(saved_);
  }
#else
  ieee_float_mode() noexcept : saved_(0) {}
#endif
  ieee_float_mode(const ieee_float_mode&) = delete;
  ieee_float_mode& operator=(const ieee_float_mode&) = delete;

private:
  unsigned saved_;
};

} // namespace hostopt::detail
