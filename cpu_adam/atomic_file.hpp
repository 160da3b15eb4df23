#pragma once
// Files on disk that survive a crash and refuse what is not a file: a file replaced
// atomically (a temporary file beside it, fsync, rename over it, fsync of the directory)
// and a regular file read without blocking on a fifo or device. Knows nothing of what the
// files hold. Errors name a file as "<owner> '<path>': <problem>", the owner saying whose
// file it is (checkpoints pass "checkpoint").

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <utility>

namespace hostopt::detail {

/// Throws std::invalid_argument when a path is empty or holds a NUL byte (the system would
/// cut it there). `what` names the file in the message.
void check_path(const std::string& path, const std::string& what);

/// Throws std::runtime_error "<owner> '<path>': <problem>".
[[noreturn]] void fail_file(std::string_view owner, const std::string& path, const std::string& problem);

/// fail_file with ": " and the system error of errno appended.
[[noreturn]] void fail_file_errno(std::string_view owner, const std::string& path,
                                  const std::string& problem);

/// A regular file open for reading, closed with the object. Opening never blocks: a fifo
/// or a device is refused, not waited on.
class file_reader {
public:
  /// How a caller words the refusals of opening (each keeps its own phrasing): `what` names
  /// the file for check_path, the others are the problems reported.
  struct refusals {
    std::string what, cannot_open, cannot_stat, not_regular;
  };
  /// Opens `path` (checked by check_path first); refused with the words of `refused`.
  file_reader(std::string_view owner, std::string path, const refusals& refused);
  file_reader(file_reader&& other) noexcept;
  file_reader& operator=(file_reader&& other) noexcept;
  file_reader(const file_reader&) = delete;
  file_reader& operator=(const file_reader&) = delete;
  ~file_reader();

  const std::string& path() const { return path_; }
  /// Its size in bytes when it was opened.
  std::uint64_t size() const { return size_; }
  /// Reads `n` bytes from byte `at` into `dst`: "truncated: the file ends at byte N" when
  /// the file ends first, "read failed" with the system error on an error.
  void read_at(void* dst, std::uint64_t n, std::uint64_t at) const;

private:
  std::string owner_, path_;
  int fd_ = -1;
  std::uint64_t size_ = 0;
};

/// The temporary file that replace_file_atomically hands its caller to fill.
class file_writer {
public:
  file_writer(std::string_view owner, std::string path, int fd)
      : owner_(owner), path_(std::move(path)), fd_(fd) {}

  /// The temporary file's path (errors name it).
  const std::string& path() const { return path_; }
  /// Appends `n` bytes ("write failed" with the system error).
  void write(const void* data, std::size_t n);
  /// Writes `n` bytes at byte `at`, over bytes written before; `problem` words a failure.
  void write_at(const void* data, std::size_t n, std::uint64_t at, const std::string& problem);
  /// Reads back `n` bytes from byte `at` (what was written: a checksum over a file written
  /// out of order).
  void read_at(void* data, std::size_t n, std::uint64_t at) const;

private:
  std::string owner_, path_;
  int fd_;
};

/// Replaces `path` with what `fill` writes, atomically: a crash at any point leaves the old
/// file or the new one, never a torn one. Refused: a path that exists and is not a regular
/// file (a device, fifo, socket, directory or symbolic link: a link is not followed). The
/// temporary file is "<name>.hostopt-tmp.<pid>.<16 hex digits>" in the same directory,
/// locked while written; the leftovers of writers that died are removed first. It is
/// fsynced, renamed over `path`, and the directory fsynced. On any error the temporary file
/// is removed and `path` is untouched. `what` names the file in errors.
void replace_file_atomically(std::string_view owner, const std::string& path, const std::string& what,
                             const std::function<void(file_writer&)>& fill);

/// replace_file_atomically with `text` as the contents.
void write_file_atomically(std::string_view owner, const std::string& path, const std::string& text,
                           const std::string& what);

/// The contents of a small regular file (at most `limit` bytes): a fifo or device is
/// refused without blocking. std::runtime_error naming `what` and the path otherwise.
std::string read_small_file(std::string_view owner, const std::string& path, const std::string& what,
                            std::size_t limit = std::size_t(16) << 20);

} // namespace hostopt::detail
