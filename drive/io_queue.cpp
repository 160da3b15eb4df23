#include "io_queue.hpp"

#include <unistd.h>

#include <cerrno>
#include <stdexcept>

#include "thread_queue.hpp"
#include "uring_queue.hpp"

namespace hostopt::drive {

std::int64_t transfer_now(const io_request& r) {
  std::size_t done = 0;
  while (done < r.bytes) {
    auto* at = static_cast<char*>(r.buffer) + done;
    const auto where = static_cast<off_t>(r.offset + done);
    const ssize_t n = r.write ? ::pwrite(r.fd, at, r.bytes - done, where) : ::pread(r.fd, at, r.bytes - done, where);
    if (n < 0) {
      if (errno == EINTR) continue;
      return -errno;
    }
    if (n == 0) break; // end of file
    done += static_cast<std::size_t>(n);
  }
  return static_cast<std::int64_t>(done);
}

std::string to_string(io_backend b) {
  switch (b) {
  case io_backend::automatic: return "auto";
  case io_backend::uring: return "io_uring";
  case io_backend::threads: return "threads";
  }
  return "?";
}

io_backend parse_io_backend(const std::string& name, const std::string& what) {
  for (io_backend b : {io_backend::automatic, io_backend::uring, io_backend::threads})
    if (name == to_string(b)) return b;
  throw std::invalid_argument(what + " = '" + name + "': expected auto, io_uring or threads");
}

void io_queue::submit(const io_request& r) {
  if (in_flight_ >= depth_)
    throw std::logic_error("io_queue::submit: " + std::to_string(depth_) + " requests already in flight (the depth)");
  start(r);
  ++in_flight_;
}

std::vector<io_completion> io_queue::wait(std::size_t at_least) {
  std::vector<io_completion> out;
  if (in_flight_ == 0) return out;
  collect(at_least < in_flight_ ? at_least : in_flight_, out);
  in_flight_ -= out.size();
  return out;
}

std::unique_ptr<io_queue> make_io_queue(unsigned depth, io_backend backend) {
  if (depth < 1 || depth > 4096)
    throw std::invalid_argument("io queue depth " + std::to_string(depth) + ": expected 1 to 4096");
  if (backend == io_backend::threads) return std::make_unique<thread_queue>(depth);
  if (backend == io_backend::automatic && !uring_unavailable_reason().empty())
    return std::make_unique<thread_queue>(depth);
  return make_uring_queue(depth); // (throws, naming why, where io_uring is unavailable)
}

} // namespace hostopt::drive
