#pragma once
// The portable io_queue: `depth` threads, each taking one request at a time and calling
// pread/pwrite until it is done (or fails), so `depth` requests are in flight in the kernel.

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "io_queue.hpp"

namespace hostopt::drive {

class thread_queue final : public io_queue {
public:
  explicit thread_queue(unsigned depth);
  ~thread_queue() override;
  io_backend backend() const override { return io_backend::threads; }

protected:
  void start(const io_request& r) override;
  void collect(std::size_t at_least, std::vector<io_completion>& out) override;

private:
  void work();
  std::mutex mutex_;
  std::condition_variable requested_, completed_;
  std::deque<io_request> requests_;
  std::vector<io_completion> completions_;
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

} // namespace hostopt::drive
