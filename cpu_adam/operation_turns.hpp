#pragma once
// Whose turn it is on one optimizer: every public operation takes one fair lock, first come
// first served (fair_mutex.hpp), and a chunked step keeps the turn of the thread that began
// it from begin_step to finish_step or abort_step, however many times it takes the lock in
// between. Beside it, the failure flag: a state half-updated by a chunked step that failed
// is refused until it is declared whole.

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <mutex>
#include <string>
#include <thread>

#include "fair_mutex.hpp"

namespace hostopt::detail {

class operation_turns {
public:
  using lock = std::unique_lock<fair_mutex>;

  /// Takes the lock once no chunked step is open (another thread's chunked step is waited
  /// for; this thread's own is refused: it would wait for itself, unless `own_chunked_ok`).
  /// With `state`, also refuses when the state is half-updated.
  lock acquire(const char* what, bool state = true, bool own_chunked_ok = false) const;
  /// The lock for update_range/finish_step: the open chunked step must be this thread's.
  lock acquire_chunked(const char* what) const;
  /// The lock alone, whatever is open: for the calls any thread may make while a chunked
  /// step is open (abort_step, usable, failure_reason, step_in_progress).
  lock lock_only() const { return lock(mu_); }

  /// Before a chunked step opens: the callers that waited for the last one to close go
  /// first. Waiting for the close gives up a caller's turn at the lock, and a pipeline
  /// opens its next step at once: without this, a save (or another thread's chunked step)
  /// could wait through every step of a run. A chunked step opened meanwhile is waited for
  /// as acquire waits, counted.
  void let_waiters_go_first(lock& held) const;

  // Under the lock: a chunked step holds the turn of the calling thread until it closes.
  void open_chunked();
  void close_chunked(); // lets the callers waiting for it go
  bool chunked_open() const { return chunked_open_; }
  bool own_chunked_open() const { return chunked_open_ && chunk_owner_ == std::this_thread::get_id(); }

  /// Callers blocked right now: queued for the lock, or waiting for another thread's
  /// chunked step to close. Reads no state under the lock, so it never queues itself.
  std::size_t waiting_callers() const noexcept { return std::size_t(mu_.waiting()) + idle_waiters_.load(); }

  // The failure flag, under the lock. Non-empty: the state is half-updated (not usable).
  const std::string& failure() const { return failure_; }
  void refuse_if_failed(const char* what) const;
  /// Marks the state half-updated unless it already is: the first reason stays. Never
  /// throws (a reason that cannot be copied is recorded as "!").
  void keep_first_failure(const std::string& reason) noexcept;
  /// Marks it half-updated for `reason`, replacing any earlier one (a load that failed
  /// after it began writing).
  void replace_failure(const std::string& reason) { failure_ = reason; }
  void clear_failure() { failure_.clear(); }

private:
  // Waits for another thread's chunked step to close, counted in idle_waiters_ so that the
  // next chunked step lets this caller go first (let_waiters_go_first).
  void wait_for_close(lock& held) const;

  mutable fair_mutex mu_;
  mutable std::condition_variable_any idle_; // signalled when a chunked step closes
  // Callers waiting in acquire() for a chunked step to close. Changed under mu_; atomic so
  // that waiting_callers() can read it without queuing behind them.
  mutable std::atomic<std::size_t> idle_waiters_{0};
  bool chunked_open_ = false;
  std::thread::id chunk_owner_;
  std::string failure_;
};

} // namespace hostopt::detail
