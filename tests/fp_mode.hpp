#pragma once
// The calling thread's "flush subnormals" mode (what XLA leaves its threads in): FTZ and
// DAZ on x86-64, FZ on AArch64. For tests that call hostopt from such a thread.

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace ref {

/// Turns flushing on or off; returns the previous mode word.
inline unsigned flush_subnormals(bool on) {
#if defined(__x86_64__)
  const unsigned before = _mm_getcsr();
  _mm_setcsr(on ? (before | 0x8040u) : (before & ~0x8040u));
  return before;
#elif defined(__aarch64__)
  const unsigned before = __builtin_aarch64_get_fpcr();
  __builtin_aarch64_set_fpcr(on ? (before | (1u << 24)) : (before & ~(1u << 24)));
  return before;
#else
  (void)on;
  return 0;
#endif
}
/// The mode word (MXCSR or FPCR).
inline unsigned fp_mode() {
#if defined(__x86_64__)
  return _mm_getcsr();
#elif defined(__aarch64__)
  return __builtin_aarch64_get_fpcr();
#else
  return 0;
#endif
}

} // namespace ref
