#include "thread_queue.hpp"

namespace hostopt::drive {

thread_queue::thread_queue(unsigned depth) : io_queue(depth) {
  workers_.reserve(depth);
  for (unsigned i = 0; i < depth; ++i) workers_.emplace_back([this] { work(); });
}

thread_queue::~thread_queue() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true; // (requests still queued are done first: their buffers are the caller's)
  }
  requested_.notify_all();
  for (auto& t : workers_) t.join();
}

void thread_queue::start(const io_request& r) {
  {
    std::lock_guard lock(mutex_);
    requests_.push_back(r);
  }
  requested_.notify_one();
}

void thread_queue::collect(std::size_t at_least, std::vector<io_completion>& out) {
  std::unique_lock lock(mutex_);
  completed_.wait(lock, [&] { return completions_.size() >= at_least; });
  out.insert(out.end(), completions_.begin(), completions_.end());
  completions_.clear();
}

void thread_queue::work() {
  std::unique_lock lock(mutex_);
  for (;;) {
    requested_.wait(lock, [&] { return stopping_ || !requests_.empty(); });
    if (requests_.empty()) return; // stopping, nothing left
    const io_request r = requests_.front();
    requests_.pop_front();
    lock.unlock();
    const io_completion c{r.tag, transfer_now(r)};
    lock.lock();
    completions_.push_back(c);
    completed_.notify_all();
  }
}

} // namespace hostopt::drive
