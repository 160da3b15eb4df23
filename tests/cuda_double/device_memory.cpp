// The CUDA double's memory: device memory the host cannot touch, page-locked host memory,
// and the classification every copy goes through.
//
// Device memory is a memfd mapped twice: PROT_NONE at the address cudaMalloc hands out,
// read/write at an alias only the double's workers use. A host load or store through a
// device pointer faults at once; the SIGSEGV handler names the allocation, then lets the
// previous handler (the default, or a sanitizer's) report the fault.
//
// Page-locked memory is mapped twice too, both read/write, and the double's workers copy
// through the alias. While a copy executes, the pages wholly inside its page-locked range are
// guarded at the address the host uses: read-only when the copy reads them, no access when
// it writes them. A host access that collides with a copy in flight (CUDA: undefined, the
// DMA may read half-written data or overwrite the host's) faults at once and is named. Only
// whole pages: a neighbour sharing a page with the range is never mistaken for the copy's.
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <sys/mman.h>
#include <unistd.h>
#include <vector>

#include "double_internal.hpp"

namespace cuda_double::detail {

namespace {

struct device_allocation {
  std::size_t bytes;  // as asked
  std::size_t mapped; // rounded up to pages
  int device;
  void* alias;
  int fd;
};

struct pinned_allocation {
  std::size_t bytes;
  std::size_t mapped;
  unsigned flags;
  void* alias;
};

// Never destroyed: stream workers may still copy while exit() runs static destructors.
std::mutex& memory_mu = *new std::mutex;
std::map<std::uintptr_t, device_allocation>& device_memory =
    *new std::map<std::uintptr_t, device_allocation>; // by address handed out
std::map<std::uintptr_t, pinned_allocation>& pinned_memory = *new std::map<std::uintptr_t, pinned_allocation>;

// The fault handler's view of device memory: lock-free slots [begin, end).
constexpr int fault_slots = 4096;
std::atomic<std::uintptr_t> slot_begin[fault_slots], slot_end[fault_slots];
// Guarded page-locked pages: [begin, end) and whether the copy in flight writes them.
std::atomic<std::uintptr_t> guard_begin[fault_slots], guard_end[fault_slots];
std::atomic<bool> guard_write[fault_slots];
std::atomic<bool> guards_frozen{false}; // a collision was reported: nothing unguards any more
struct sigaction previous_segv {};
std::atomic<bool> handler_installed{false};

void on_segv(int sig, siginfo_t* info, void* ucontext) {
  const auto addr = reinterpret_cast<std::uintptr_t>(info->si_addr);
  for (int i = 0; i < fault_slots; ++i) {
    const std::uintptr_t b = guard_begin[i].load(std::memory_order_relaxed);
    if (b && addr >= b && addr < guard_end[i].load(std::memory_order_relaxed)) {
      char msg[400];
      const int n = std::snprintf(
          msg, sizeof msg,
          "cuda double: VIOLATION: the host touched page-locked memory at %p while a copy in flight %s it "
          "(guarded pages at %p): the host may touch a copy's host memory only once it knows the copy "
          "completed (an event or stream synchronized, or a host function after it)\n",
          info->si_addr, guard_write[i].load(std::memory_order_relaxed) ? "writes" : "reads",
          reinterpret_cast<void*>(b));
      if (n > 0) (void)!write(2, msg, std::size_t(n));
      // The retried access must fault again under the previous handler (which reports it and
      // ends the process): the guards stay as they are from here on.
      guards_frozen.store(true);
      sigaction(SIGSEGV, &previous_segv, nullptr);
      return;
    }
  }
  for (int i = 0; i < fault_slots; ++i) {
    const std::uintptr_t b = slot_begin[i].load(std::memory_order_relaxed);
    if (b && addr >= b && addr < slot_end[i].load(std::memory_order_relaxed)) {
      char msg[256];
      const int n =
          std::snprintf(msg, sizeof msg,
                        "cuda double: VIOLATION: the host touched device memory at %p (a cudaMalloc "
                        "allocation at %p): device memory is not host-accessible\n",
                        info->si_addr, reinterpret_cast<void*>(b));
      if (n > 0) (void)!write(2, msg, std::size_t(n));
      break;
    }
  }
  // The previous handler reports (and ends) it: reinstall it and return, so the faulting
  // access runs again under it.
  sigaction(SIGSEGV, &previous_segv, nullptr);
  (void)sig;
  (void)ucontext;
}

void install_handler() {
  bool expected = false;
  if (!handler_installed.compare_exchange_strong(expected, true)) return;
  struct sigaction sa {};
  sa.sa_sigaction = on_segv;
  sa.sa_flags = SA_SIGINFO;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGSEGV, &sa, &previous_segv);
}

void add_slot(std::uintptr_t b, std::uintptr_t e) {
  for (int i = 0; i < fault_slots; ++i) {
    std::uintptr_t zero = 0;
    if (slot_begin[i].compare_exchange_strong(zero, b)) {
      slot_end[i].store(e);
      return;
    }
  }
}

void remove_slot(std::uintptr_t b) {
  for (int i = 0; i < fault_slots; ++i)
    if (slot_begin[i].load() == b) {
      slot_end[i].store(0);
      slot_begin[i].store(0);
      return;
    }
}

void add_guard_slot(std::uintptr_t b, std::uintptr_t e, bool write) {
  for (int i = 0; i < fault_slots; ++i) {
    std::uintptr_t zero = 0;
    if (guard_begin[i].compare_exchange_strong(zero, b)) {
      guard_write[i].store(write);
      guard_end[i].store(e);
      return;
    }
  }
}

void remove_guard_slot(std::uintptr_t b, std::uintptr_t e) {
  for (int i = 0; i < fault_slots; ++i)
    if (guard_begin[i].load() == b && guard_end[i].load() == e) {
      guard_end[i].store(0);
      guard_begin[i].store(0);
      return;
    }
}

// The guards in force: copies in flight over whole pages of page-locked memory. A page's
// protection is the strictest its guards need; protections change once per run of pages
// that share the same guards (one mprotect per copy in the usual, non-overlapping case).
struct active_guard {
  std::uintptr_t begin, end;
  bool write;
};
std::mutex& guard_mu = *new std::mutex;
std::vector<active_guard>& active_guards = *new std::vector<active_guard>;

void protect_as_guarded(std::uintptr_t begin, std::uintptr_t end) {
  std::vector<std::uintptr_t> cuts{begin, end};
  for (const auto& g : active_guards) {
    if (g.begin > begin && g.begin < end) cuts.push_back(g.begin);
    if (g.end > begin && g.end < end) cuts.push_back(g.end);
  }
  std::sort(cuts.begin(), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  for (std::size_t i = 0; i + 1 < cuts.size(); ++i) {
    bool read = false, written = false;
    for (const auto& g : active_guards)
      if (g.begin <= cuts[i] && cuts[i + 1] <= g.end) (g.write ? written : read) = true;
    const int prot = written ? PROT_NONE : read ? PROT_READ : PROT_READ | PROT_WRITE;
    if (mprotect(reinterpret_cast<void*>(cuts[i]), cuts[i + 1] - cuts[i], prot) != 0) {
      std::fprintf(stderr, "cuda double: mprotect of page-locked pages failed: %s\n", std::strerror(errno));
      std::abort();
    }
  }
}

std::size_t page_round(std::size_t bytes) {
  const auto page = std::size_t(sysconf(_SC_PAGESIZE));
  return (bytes + page - 1) / page * page;
}

template <class Map> typename Map::const_iterator containing(const Map& m, std::uintptr_t p) {
  auto it = m.upper_bound(p);
  if (it == m.begin()) return m.end();
  --it;
  if (p >= it->first + std::max<std::size_t>(it->second.bytes, 1)) return m.end();
  return it;
}

} // namespace

cudaError_t allocate_device_memory(void** out, std::size_t bytes, int device) {
  install_handler();
  const std::size_t mapped = page_round(bytes);
  const int fd = memfd_create("hostopt-cuda-double-device", MFD_CLOEXEC);
  if (fd < 0) return cudaErrorMemoryAllocation;
  if (ftruncate(fd, off_t(mapped)) != 0) {
    close(fd);
    return cudaErrorMemoryAllocation;
  }
  void* handed = mmap(nullptr, mapped, PROT_NONE, MAP_SHARED, fd, 0);
  void* alias = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (handed == MAP_FAILED || alias == MAP_FAILED) {
    if (handed != MAP_FAILED) munmap(handed, mapped);
    if (alias != MAP_FAILED) munmap(alias, mapped);
    close(fd);
    return cudaErrorMemoryAllocation;
  }
  // CUDA's fresh memory is not zeroed: neither is this (a recognizable pattern).
  std::memset(alias, 0xa5, mapped);
  const auto b = reinterpret_cast<std::uintptr_t>(handed);
  {
    std::lock_guard<std::mutex> lock(memory_mu);
    device_memory[b] = {bytes, mapped, device, alias, fd};
  }
  add_slot(b, b + mapped);
  *out = handed;
  return cudaSuccess;
}

cudaError_t free_device_memory(void* p) {
  device_allocation a{};
  {
    std::lock_guard<std::mutex> lock(memory_mu);
    auto it = device_memory.find(reinterpret_cast<std::uintptr_t>(p));
    if (it == device_memory.end()) return cudaErrorInvalidValue;
    a = it->second;
  }
  wait_until_unused(p, a.bytes); // cudaFree synchronizes: in-flight work finishes first
  {
    std::lock_guard<std::mutex> lock(memory_mu);
    device_memory.erase(reinterpret_cast<std::uintptr_t>(p));
  }
  remove_slot(reinterpret_cast<std::uintptr_t>(p));
  munmap(p, a.mapped);
  munmap(a.alias, a.mapped);
  close(a.fd);
  return cudaSuccess;
}

cudaError_t allocate_pinned_memory(void** out, std::size_t bytes, unsigned flags) {
  install_handler();
  const std::size_t mapped = page_round(std::max<std::size_t>(bytes, 1));
  const int fd = memfd_create("hostopt-cuda-double-pinned", MFD_CLOEXEC);
  if (fd < 0) return cudaErrorMemoryAllocation;
  if (ftruncate(fd, off_t(mapped)) != 0) {
    close(fd);
    return cudaErrorMemoryAllocation;
  }
  void* p = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  void* alias = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd); // the mappings keep the memory
  if (p == MAP_FAILED || alias == MAP_FAILED) {
    if (p != MAP_FAILED) munmap(p, mapped);
    if (alias != MAP_FAILED) munmap(alias, mapped);
    return cudaErrorMemoryAllocation;
  }
  std::memset(p, 0x5a, mapped); // not zeroed, as CUDA's is not
  std::lock_guard<std::mutex> lock(memory_mu);
  pinned_memory[reinterpret_cast<std::uintptr_t>(p)] = {bytes, mapped, flags, alias};
  *out = p;
  return cudaSuccess;
}

cudaError_t free_pinned_memory(void* p) {
  pinned_allocation a{};
  {
    std::lock_guard<std::mutex> lock(memory_mu);
    auto it = pinned_memory.find(reinterpret_cast<std::uintptr_t>(p));
    if (it == pinned_memory.end()) return cudaErrorInvalidValue;
    a = it->second;
  }
  wait_until_unused(p, a.bytes);
  {
    std::lock_guard<std::mutex> lock(memory_mu);
    pinned_memory.erase(reinterpret_cast<std::uintptr_t>(p));
  }
  munmap(p, a.mapped);
  munmap(a.alias, a.mapped);
  return cudaSuccess;
}

bool pinned_flags(const void* p, unsigned& flags) {
  std::lock_guard<std::mutex> lock(memory_mu);
  auto it = containing(pinned_memory, reinterpret_cast<std::uintptr_t>(p));
  if (it == pinned_memory.end()) return false;
  flags = it->second.flags;
  return true;
}

memory_span classify(const void* p, std::size_t bytes) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  memory_span span;
  std::lock_guard<std::mutex> lock(memory_mu);
  if (auto it = containing(device_memory, a); it != device_memory.end()) {
    span.kind = memory_kind::device;
    span.device = it->second.device;
    span.base = reinterpret_cast<const void*>(it->first);
    span.view = static_cast<char*>(it->second.alias) + (a - it->first);
    span.inside = a + bytes <= it->first + it->second.bytes;
    return span;
  }
  if (auto it = containing(pinned_memory, a); it != pinned_memory.end()) {
    span.kind = memory_kind::pinned;
    span.base = reinterpret_cast<const void*>(it->first);
    span.inside = a + bytes <= it->first + it->second.bytes;
    span.view = static_cast<char*>(it->second.alias) + (a - it->first);
    return span;
  }
  span.view = const_cast<void*>(p);
  return span;
}

void guard_host_range(const memory_access& r, bool on) {
  const auto page = std::uintptr_t(sysconf(_SC_PAGESIZE));
  const std::uintptr_t first = (r.begin + page - 1) / page * page, last = r.end / page * page;
  if (first >= last) return; // no whole page: nothing to guard
  std::lock_guard<std::mutex> lock(guard_mu);
  if (on) {
    add_guard_slot(first, last, r.write);
    active_guards.push_back({first, last, r.write});
  } else {
    if (guards_frozen.load()) return; // a reported collision must fault again
    const auto it = std::find_if(active_guards.begin(), active_guards.end(), [&](const active_guard& g) {
      return g.begin == first && g.end == last && g.write == r.write;
    });
    if (it != active_guards.end()) active_guards.erase(it);
    remove_guard_slot(first, last);
  }
  protect_as_guarded(first, last);
}

} // namespace cuda_double::detail

namespace cuda_double {

void* device_view(const void* p) {
  const detail::memory_span span = detail::classify(p, 0);
  return span.view;
}

} // namespace cuda_double
