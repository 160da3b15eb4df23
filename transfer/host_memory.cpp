#include "host_memory.hpp"

#include "hostopt/detail/huge_pages.hpp"

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

namespace hostopt::detail {

namespace {
std::atomic<bool> warned{false};
} // namespace

pinned_allocation allocate_locked_host(std::size_t bytes) {
  if (bytes == 0) return {};
  const std::size_t page = std::size_t(sysconf(_SC_PAGESIZE));
  const std::size_t align = allocation_alignment(bytes, page);
  const std::size_t size = round_up(bytes, align);
  void* p = nullptr;
  if (const int rc = posix_memalign(&p, align, size); rc != 0)
    throw std::runtime_error("pinned buffer: cannot allocate " + std::to_string(bytes) + " bytes: " + std::strerror(rc));
  if (align == huge_page_bytes) madvise(p, size, MADV_HUGEPAGE); // advice only
  pinned_allocation a{p, false};
  if (mlock(p, size) == 0) {
    a.locked = true;
  } else if (!warned.exchange(true)) {
    const int err = errno;
    rlimit lim{};
    getrlimit(RLIMIT_MEMLOCK, &lim);
    std::fprintf(stderr,
                 "hostopt: warning: cannot page-lock %zu bytes (%s; RLIMIT_MEMLOCK is %llu bytes): continuing with "
                 "pageable memory, which copies slower (raise it with `ulimit -l`)\n",
                 size, std::strerror(err), (unsigned long long)lim.rlim_cur);
  }
  return a;
}

void free_locked_host(pinned_allocation a, std::size_t bytes) noexcept {
  if (!a.data) return;
  if (a.locked) {
    const std::size_t page = std::size_t(sysconf(_SC_PAGESIZE));
    munlock(a.data, round_up(bytes, allocation_alignment(bytes, page)));
  }
  std::free(a.data);
}

} // namespace hostopt::detail
