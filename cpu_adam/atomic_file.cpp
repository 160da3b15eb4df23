// Atomic replacement and checked reading of files (POSIX). See atomic_file.hpp.
#include "atomic_file.hpp"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <random>
#include <stdexcept>
#include <utility>

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

namespace hostopt::detail {

namespace {

constexpr std::uint64_t max_read_bytes = std::uint64_t(4) << 20; // one pread at most

std::string directory_of(const std::string& path) {
  const auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

std::string base_of(const std::string& path) {
  const auto slash = path.find_last_of('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

// Temp files are "<name>.hostopt-tmp.<pid>.<16 random hex digits>": unique per call (a
// restarted process may reuse a pid), and flock()ed by their writer for as long as it
// writes, so a later save can tell a dead writer's leftovers (no lock) from a live one's.
std::string temp_prefix(const std::string& path) { return base_of(path) + ".hostopt-tmp."; }

std::string unique_temp_path(const std::string& path) {
  static std::atomic<std::uint64_t> counter{0};
  static const std::uint64_t seed = [] {
    std::random_device rd;
    return (std::uint64_t(rd()) << 32) ^ rd();
  }();
  std::uint64_t x = seed + 0x9E3779B97F4A7C15ull * (counter.fetch_add(1) + 1);
  x ^= x >> 31; // splitmix64's finalizer
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  char digits[17];
  std::snprintf(digits, sizeof digits, "%016llx", (unsigned long long)x);
  return directory_of(path) + "/" + temp_prefix(path) + std::to_string(::getpid()) + "." + digits;
}

// Removes temp files of this path whose writer is gone (a kill -9 mid-save): nobody holds
// their lock. Best effort: a failure here never fails the save.
void remove_stale_temps(const std::string& path) {
  const std::string dir = directory_of(path), prefix = temp_prefix(path);
  DIR* d = ::opendir(dir.c_str());
  if (!d) return;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    const int fd = ::openat(::dirfd(d), name.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) continue;
    struct stat st {};
    if (::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && ::flock(fd, LOCK_EX | LOCK_NB) == 0)
      ::unlinkat(::dirfd(d), name.c_str(), 0); // unlocked: its writer is gone
    ::close(fd);
  }
  ::closedir(d);
}

// What may be replaced: nothing (a new file) or a regular file. Devices, fifos, sockets,
// directories and symbolic links are refused: as root a save to /dev/null would otherwise
// replace the device node.
void check_replaceable(std::string_view owner, const std::string& path, const std::string& what) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return;
    fail_file_errno(owner, path, "cannot stat " + what);
  }
  if (S_ISREG(st.st_mode)) return;
  if (S_ISLNK(st.st_mode))
    fail_file(owner, path,
              what +
                  " is a symbolic link: hostopt replaces files atomically by renaming over them and will not "
                  "replace a link or write through it; save to the link's target instead");
  fail_file(
      owner, path,
      what +
          " exists and is not a regular file (a device, fifo, socket or directory): refusing to replace it");
}

// Creates a unique temp file beside `path`, locked by this writer: its descriptor and path.
std::pair<int, std::string> create_locked_temp(std::string_view owner, const std::string& path) {
  for (int attempt = 0;; ++attempt) {
    const std::string tmp = unique_temp_path(path);
    // (read and write: a file written out of order is read back for its checksum)
    const int fd = ::open(tmp.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0 && (errno != EEXIST || attempt == 8))
      fail_file_errno(owner, tmp, "cannot create the temporary file");
    if (fd < 0) continue;
    // Locked while written; a cleaner that removed it between open and flock is detected.
    struct stat mine {
    }, named{};
    if (::flock(fd, LOCK_EX | LOCK_NB) == 0 && ::fstat(fd, &mine) == 0 && ::stat(tmp.c_str(), &named) == 0 &&
        mine.st_ino == named.st_ino && mine.st_dev == named.st_dev)
      return {fd, tmp};
    ::close(fd);
    if (attempt == 8) fail_file(owner, tmp, "cannot create and lock a temporary file");
  }
}

void fsync_directory(const std::string& path) {
  const int dfd = ::open(directory_of(path).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) { // make the rename itself durable
    ::fsync(dfd);
    ::close(dfd);
  }
}

} // namespace

void check_path(const std::string& path, const std::string& what) {
  if (path.empty()) throw std::invalid_argument(what + ": the path is empty");
  if (path.find('\0') != std::string::npos)
    throw std::invalid_argument(what + " '" + std::string(path.c_str()) +
                                "...': the path holds a NUL byte (it would be cut there): refused");
}

void fail_file(std::string_view owner, const std::string& path, const std::string& problem) {
  throw std::runtime_error(std::string(owner) + " '" + path + "': " + problem);
}

void fail_file_errno(std::string_view owner, const std::string& path, const std::string& problem) {
  const int err = errno; // before anything else can change it
  fail_file(owner, path, problem + ": " + std::strerror(err));
}

file_reader::file_reader(std::string_view owner, std::string path, const refusals& refused)
    : owner_(owner), path_(std::move(path)) {
  check_path(path_, refused.what);
  // Non-blocking open: a fifo would otherwise block here forever; it is refused below.
  fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd_ < 0) fail_file_errno(owner_, path_, refused.cannot_open);
  struct stat st {};
  if (::fstat(fd_, &st) != 0) {
    const int err = errno;
    ::close(fd_); // the destructor does not run for a constructor that throws
    errno = err;
    fail_file_errno(owner_, path_, refused.cannot_stat);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd_);
    fail_file(owner_, path_, refused.not_regular);
  }
  size_ = std::uint64_t(st.st_size);
}

file_reader::file_reader(file_reader&& other) noexcept
    : owner_(std::move(other.owner_)), path_(std::move(other.path_)), fd_(std::exchange(other.fd_, -1)),
      size_(other.size_) {}

file_reader& file_reader::operator=(file_reader&& other) noexcept {
  std::swap(owner_, other.owner_);
  std::swap(path_, other.path_);
  std::swap(fd_, other.fd_);
  std::swap(size_, other.size_);
  return *this;
}

file_reader::~file_reader() {
  if (fd_ >= 0) ::close(fd_);
}

void file_reader::read_at(void* dst, std::uint64_t n, std::uint64_t at) const {
  char* p = static_cast<char*>(dst);
  while (n) {
    const ssize_t r = ::pread(fd_, p, std::size_t(std::min<std::uint64_t>(n, max_read_bytes)), off_t(at));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) fail_file_errno(owner_, path_, "read failed");
    if (r == 0) fail_file(owner_, path_, "truncated: the file ends at byte " + std::to_string(at));
    p += r;
    n -= std::uint64_t(r);
    at += std::uint64_t(r);
  }
}

void file_writer::write(const void* data, std::size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n) {
    const ssize_t w = ::write(fd_, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      fail_file_errno(owner_, path_, "write failed");
    }
    p += w;
    n -= std::size_t(w);
  }
}

void file_writer::write_at(const void* data, std::size_t n, std::uint64_t at, const std::string& problem) {
  if (::pwrite(fd_, data, n, off_t(at)) != ssize_t(n)) fail_file_errno(owner_, path_, problem);
}

void file_writer::read_at(void* data, std::size_t n, std::uint64_t at) const {
  for (std::size_t done = 0; done < n;) {
    const ssize_t got = ::pread(fd_, static_cast<char*>(data) + done, n - done, off_t(at + done));
    if (got < 0 && errno == EINTR) continue;
    if (got == 0) fail_file(owner_, path_, "read back: the file is shorter than written");
    if (got < 0) fail_file_errno(owner_, path_, "read back failed");
    done += std::size_t(got);
  }
}

void replace_file_atomically(std::string_view owner, const std::string& path, const std::string& what,
                             const std::function<void(file_writer&)>& fill) {
  check_path(path, what);
  check_replaceable(owner, path, what);
  remove_stale_temps(path);
  const auto [fd, tmp] = create_locked_temp(owner, path);
  try {
    file_writer out(owner, tmp, fd);
    fill(out);
    if (::fsync(fd) != 0) fail_file_errno(owner, tmp, "fsync failed");
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  if (::close(fd) != 0) {
    ::unlink(tmp.c_str());
    fail_file_errno(owner, tmp, "close failed");
  }
  try {
    check_replaceable(owner, path, what); // it may have been replaced while we wrote
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    errno = err;
    fail_file_errno(owner, path, "cannot rename the temporary file over it");
  }
  fsync_directory(path);
}

void write_file_atomically(std::string_view owner, const std::string& path, const std::string& text,
                           const std::string& what) {
  replace_file_atomically(owner, path, what, [&](file_writer& out) { out.write(text.data(), text.size()); });
}

std::string read_small_file(std::string_view owner, const std::string& path, const std::string& what,
                            std::size_t limit) {
  const file_reader file(
      owner, path,
      {what, "cannot open " + what, "cannot stat " + what, what + " is not a regular file: refused"});
  if (file.size() > limit)
    fail_file(owner, path,
              what + " has " + std::to_string(file.size()) + " bytes: more than the " +
                  std::to_string(limit) + " expected");
  std::string text(std::size_t(file.size()), '\0');
  file.read_at(text.data(), text.size(), 0);
  return text;
}

} // namespace hostopt::detail
