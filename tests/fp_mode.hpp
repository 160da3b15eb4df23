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
/// Sets the mode word flush_subnormals returned.
inline void set_fp_mode(unsigned mode) {
#if defined(__x86_64__)
  _mm_setcsr(mode);
#elif defined(__aarch64__)
  __builtin_aarch64_set_fpcr(mode);
#else
  (void)mode;
#endif
}
/// Flushing on (or off) for a scope; the caller's mode back at its end, also when a check throws.
class flushing_scope {
public:
  explicit flushing_scope(bool on = true) : before_(flush_subnormals(on)) {}
  ~flushing_scope() { set_fp_mode(before_); }
  flushing_scope(const flushing_scope&) = delete;
  flushing_scope& operator=(const flushing_scope&) = delete;

private:
  unsigned before_;
};
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
