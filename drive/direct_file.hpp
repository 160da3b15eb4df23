#pragma once
// A file on a local drive opened for O_DIRECT I/O (the page cache bypassed: state streamed
// through RAM must not evict the training job's memory), and the buffers such I/O needs.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace hostopt::drive {

/// O_DIRECT alignment of buffers, offsets and lengths: 4096 covers every common drive's
/// logical block (512 or 4096 bytes).
constexpr std::size_t direct_alignment = 4096;

class direct_file {
public:
  /// Creates (or truncates) `path` and reserves `bytes` on its drive (fallocate: a full drive
  /// is named now, not mid-write). std::system_error naming the path and the cause, e.g. a
  /// filesystem without O_DIRECT (tmpfs).
  static direct_file create(const std::string& path, std::uint64_t bytes);
  /// Opens an existing file for O_DIRECT reads and writes.
  static direct_file open(const std::string& path);
  direct_file(direct_file&& other) noexcept;
  direct_file& operator=(direct_file&& other) noexcept;
  direct_file(const direct_file&) = delete;
  direct_file& operator=(const direct_file&) = delete;
  ~direct_file();

  int fd() const { return fd_; }
  const std::string& path() const { return path_; }
  std::uint64_t size() const;
  /// Pages of the file in the page cache (mincore): 0 after O_DIRECT I/O alone.
  std::uint64_t cached_pages() const;

private:
  direct_file(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  int fd_ = -1;
  std::string path_;
};

/// Memory aligned for O_DIRECT, zero-filled.
struct direct_buffer_deleter {
  void operator()(std::byte* p) const noexcept;
};
using direct_buffer = std::unique_ptr<std::byte[], direct_buffer_deleter>;
direct_buffer make_direct_buffer(std::size_t bytes);

} // namespace hostopt::drive
