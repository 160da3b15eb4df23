#include "operation_turns.hpp"

#include <stdexcept>

namespace hostopt::detail {

operation_turns::lock operation_turns::acquire(const char* what, bool state, bool own_chunked_ok) const {
  lock held(mu_);
  if (own_chunked_open()) {
    if (own_chunked_ok) return held;
    throw std::logic_error(std::string(what) + ": this thread has a chunked step open (begin_step without "
                                               "finish_step or abort_step)");
  }
  if (chunked_open_) wait_for_close(held);
  if (state) refuse_if_failed(what);
  return held;
}

operation_turns::lock operation_turns::acquire_chunked(const char* what) const {
  lock held(mu_);
  if (!chunked_open_)
    throw std::logic_error(std::string(what) + ": no chunked step is open (call begin_step first)");
  if (chunk_owner_ != std::this_thread::get_id())
    throw std::logic_error(std::string(what) + ": the open chunked step belongs to another thread");
  return held;
}

void operation_turns::wait_for_close(lock& held) const {
  ++idle_waiters_;
  struct uncount { // also when the wait unwinds: a count left behind would block every begin_step
    const operation_turns& turns;
    ~uncount() {
      if (--turns.idle_waiters_ == 0) turns.idle_.notify_all();
    }
  } guard{*this};
  idle_.wait(held, [&] { return !chunked_open_; });
}

void operation_turns::let_waiters_go_first(lock& held) const {
  while (chunked_open_ || idle_waiters_ > 0) {
    if (chunked_open_)
      wait_for_close(held);
    else
      idle_.wait(held, [&] { return idle_waiters_ == 0 || chunked_open_; });
  }
}

void operation_turns::open_chunked() {
  chunked_open_ = true;
  chunk_owner_ = std::this_thread::get_id();
}

void operation_turns::close_chunked() {
  chunked_open_ = false;
  idle_.notify_all();
}

void operation_turns::refuse_if_failed(const char* what) const {
  if (!failure_.empty())
    throw std::runtime_error(std::string(what) + ": the optimizer is not usable: " + failure_ +
                             " (load a checkpoint, or call reset_failure() once the state is whole)");
}

void operation_turns::keep_first_failure(const std::string& reason) noexcept {
  if (!failure_.empty()) return;
  try {
    failure_ = reason;
  } catch (...) { // out of memory for the message: still poison
    failure_.assign(1, '!');
  }
}

} // namespace hostopt::detail
