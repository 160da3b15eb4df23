#pragma once
// Positioned reads and writes in flight together (a queue depth), for O_DIRECT files on
// local drives: io_uring where the kernel gives it, else a small pool of threads calling
// pread/pwrite (io_uring is refused in many containers: EPERM, ENOSYS). It moves bytes and
// knows nothing of what they are.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace hostopt::drive {

enum class io_backend { automatic, uring, threads };

/// "auto", "io_uring" or "threads".
std::string to_string(io_backend b);
/// Parses to_string's names; std::invalid_argument naming `what` otherwise.
io_backend parse_io_backend(const std::string& name, const std::string& what);

struct io_request {
  int fd = -1;
  bool write = false;
  void* buffer = nullptr;   // O_DIRECT: aligned to direct_alignment
  std::size_t bytes = 0;    // O_DIRECT: a multiple of direct_alignment
  std::uint64_t offset = 0; // O_DIRECT: a multiple of direct_alignment
  std::uint64_t tag = 0;    // the caller's, handed back with the completion
};

/// Runs `r` at once on the calling thread (pread/pwrite, EINTR retried): the bytes moved (short
/// only at the end of a file), or -errno. What the thread pool's workers run; also a caller's
/// one-off read beside a queue busy with others.
std::int64_t transfer_now(const io_request& r);

struct io_completion {
  std::uint64_t tag = 0;
  std::int64_t result = 0; // bytes moved (short only at the end of a file), or -errno
};

class io_queue {
public:
  virtual ~io_queue() = default;
  virtual io_backend backend() const = 0;
  unsigned depth() const { return depth_; }
  std::size_t in_flight() const { return in_flight_; }
  /// Starts a request. std::logic_error when depth() are already in flight (wait first).
  void submit(const io_request& r);
  /// The completions of at least min(at_least, in_flight()) requests, blocking until then;
  /// more when more are done.
  std::vector<io_completion> wait(std::size_t at_least = 1);

protected:
  explicit io_queue(unsigned depth) : depth_(depth) {}
  virtual void start(const io_request& r) = 0;
  virtual void collect(std::size_t at_least, std::vector<io_completion>& out) = 0;

private:
  unsigned depth_;
  std::size_t in_flight_ = 0;
};

/// A queue of `depth` (1 to 4096) requests. automatic: io_uring, or threads where io_uring
/// is unavailable; uring: std::system_error naming why when it is unavailable.
std::unique_ptr<io_queue> make_io_queue(unsigned depth, io_backend backend = io_backend::automatic);

/// Why io_uring cannot be used here ("not built in", the kernel's refusal), or "" when it can.
std::string uring_unavailable_reason();

} // namespace hostopt::drive
