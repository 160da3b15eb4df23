#include "direct_file.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <new>
#include <system_error>
#include <utility>
#include <vector>

namespace hostopt::drive {

namespace {

[[noreturn]] void fail(int error, const std::string& what) {
  throw std::system_error(error, std::generic_category(), what);
}

int open_direct(const std::string& path, int flags) {
  const int fd = ::open(path.c_str(), flags | O_DIRECT | O_CLOEXEC, 0600);
  if (fd >= 0) return fd;
  const int error = errno;
  if (error == EINVAL) { // (open(2): the filesystem does not support O_DIRECT)
    fail(error, "cannot open " + path + " for O_DIRECT I/O: its filesystem does not support it (tmpfs, some "
                "network or overlay filesystems); use a directory on a local drive");
  }
  fail(error, "cannot open " + path);
}

} // namespace

direct_file direct_file::create(const std::string& path, std::uint64_t bytes) {
  const int fd = open_direct(path, O_RDWR | O_CREAT | O_TRUNC);
  direct_file f(fd, path);
  if (bytes > 0) {
    const int rc = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes));
    if (rc == ENOSPC) fail(rc, "cannot reserve " + std::to_string(bytes) + " bytes for " + path + ": the drive is full");
    if (rc == EOPNOTSUPP || rc == EINVAL) { // (no fallocate here: the size is set, blocks allocated as written)
      if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) fail(errno, "cannot size " + path);
    } else if (rc != 0) {
      fail(rc, "cannot reserve " + std::to_string(bytes) + " bytes for " + path);
    }
  }
  return f;
}

direct_file direct_file::open(const std::string& path) { return direct_file(open_direct(path, O_RDWR), path); }

direct_file::direct_file(direct_file&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)), path_(std::move(other.path_)) {}

direct_file& direct_file::operator=(direct_file&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
    path_ = std::move(other.path_);
  }
  return *this;
}

direct_file::~direct_file() {
  if (fd_ >= 0) ::close(fd_);
}

std::uint64_t direct_file::size() const {
  struct stat st {};
  if (::fstat(fd_, &st) != 0) fail(errno, "cannot stat " + path_);
  return static_cast<std::uint64_t>(st.st_size);
}

std::uint64_t direct_file::cached_pages() const {
  const std::uint64_t bytes = size();
  if (bytes == 0) return 0;
  void* map = ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd_, 0);
  if (map == MAP_FAILED) fail(errno, "cannot map " + path_ + " to count its cached pages");
  const long page = ::sysconf(_SC_PAGESIZE);
  std::vector<unsigned char> resident((bytes + page - 1) / page);
  const int rc = ::mincore(map, bytes, resident.data());
  const int error = errno;
  ::munmap(map, bytes);
  if (rc != 0) fail(error, "mincore on " + path_);
  std::uint64_t cached = 0;
  for (unsigned char r : resident) cached += r & 1u;
  return cached;
}

void direct_buffer_deleter::operator()(std::byte* p) const noexcept { std::free(p); }

direct_buffer make_direct_buffer(std::size_t bytes) {
  const std::size_t rounded = (bytes + direct_alignment - 1) / direct_alignment * direct_alignment;
  void* p = std::aligned_alloc(direct_alignment, rounded == 0 ? direct_alignment : rounded);
  if (p == nullptr) throw std::bad_alloc();
  std::memset(p, 0, rounded == 0 ? direct_alignment : rounded);
  return direct_buffer(static_cast<std::byte*>(p));
}

} // namespace hostopt::drive
