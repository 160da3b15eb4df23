#pragma once
// Software prefetch of the streams a kernel walks, a fixed distance ahead.
//
// The step does enough arithmetic per cache line (exact sqrt and division, and for
// compressed moments decode, rounding bits and encode) that, with one thread busy computing, the
// hardware prefetchers alone leave DRAM idle part of the time: at 64M params on one core,
// the f32 step ran at 84% of its roofline twin and the bf16-moment step at 79%. Asking for
// each stream's line 4 KiB ahead keeps the memory system busy while the core computes:
// f32 85 -> 69 ms, bf16 moments 74 -> 61 ms (Xeon, Emerald Rapids, one and two threads
// alike; 2 KiB and 8 KiB ahead were slower, and so was prefetching into L2 only). The twins
// prefetch the same lines, so the roofline stays the best the memory system does.
//
// A prefetch never faults and changes no value: every kernel still writes the same bits.
//
// Only included by the per-instruction-set translation units (cpu_adam/arch_*.cpp).

#include <cstddef>
#include <cstdint>

namespace hostopt::detail {
namespace HOSTOPT_KERNEL_NS {

/// How far ahead of the element being updated each stream is prefetched, in bytes: 4 KiB
/// per stream keeps the lines in flight within L1 (four or five streams, 48 KiB).
inline constexpr std::size_t prefetch_distance = 4096;

/// The address `prefetch_distance` bytes past p, made as an integer: it may lie past the
/// end of the array (a prefetch of it is harmless), which pointer arithmetic may not.
inline const void* ahead(const void* p) noexcept {
  return reinterpret_cast<const void*>(reinterpret_cast<std::uintptr_t>(p) + prefetch_distance);
}

/// Asks for the line `prefetch_distance` bytes past p: of a stream that is only read, or
/// (Write) of one read and then written back, owned where the CPU can (no second request
/// at the store).
template <bool Write>
inline void prefetch_line(const void* p) noexcept {
#if defined(__GNUC__)
  __builtin_prefetch(ahead(p), Write ? 1 : 0, 3);
#else
  (void)p;
#endif
}

/// Prefetches every line of the Bytes bytes from p (at least one line), each
/// `prefetch_distance` ahead: a unit of work's share of a stream.
template <bool Write, std::size_t Bytes>
inline void prefetch_unit_ahead(const void* p) noexcept {
  static_assert((Bytes & (Bytes - 1)) == 0, "a unit's share of a stream is a power of two: whole lines, or one");
  constexpr std::size_t lines = Bytes > 64 ? Bytes / 64 : 1;
  for (std::size_t l = 0; l < lines; ++l) {
    const void* line = reinterpret_cast<const void*>(reinterpret_cast<std::uintptr_t>(p) + 64 * l);
    prefetch_line<Write>(line);
  }
}

} // namespace HOSTOPT_KERNEL_NS
} // namespace hostopt::detail
