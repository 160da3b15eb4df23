// The host copy engine: "device" memory is host memory, each direction is a FIFO served
// by its own copy thread, and an optional bandwidth cap stretches each copy to the time
// it would take over PCIe. The offload pipeline runs the same code on it as on CUDA.
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>

#include "host_memory.hpp"
#include "steady_clock.hpp"
#include "hostopt/copy_engine.hpp"

namespace hostopt {

namespace {

using detail::now_ns;

constexpr std::size_t history = 4096; // completed copies remembered per direction

// One direction: a queue, a thread, completion bookkeeping.
class copy_stream {
public:
  copy_stream(copy_direction dir, const host_engine_options& opts) : dir_(dir), opts_(opts) {
    thread_ = std::thread([this] { run(); });
  }
  ~copy_stream() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  std::uint64_t enqueue(void* dst, const void* src, std::size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back({dst, src, bytes, ++enqueued_});
    cv_.notify_all();
    return enqueued_;
  }

  void wait(std::uint64_t seq) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      check_known(seq);
    }
    // Spin briefly before sleeping: in steady state the copy is about to finish, and a
    // sleeping waiter woken by the copy thread tends to be placed on the copy thread's
    // core (wake-affine), stalling the next copy until the scheduler rebalances (~ms).
    const auto spin_until = std::chrono::steady_clock::now() + std::chrono::microseconds(200);
    while (completed_.load(std::memory_order_acquire) < seq && std::chrono::steady_clock::now() < spin_until)
      std::this_thread::yield();
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [&] { return completed_.load() >= seq; });
    const record& r = records_[seq % history];
    if (r.sequence == seq && r.error) std::rethrow_exception(r.error);
  }

  copy_timing timing(std::uint64_t seq) const {
    std::lock_guard<std::mutex> lock(mu_);
    const record& r = records_[seq % history];
    if (seq == 0 || seq > completed_.load() || r.sequence != seq)
      throw std::invalid_argument("copy_engine::timing: copy " + std::to_string(seq) +
                                  " is not a completed copy among the last 4096 of its direction");
    return r.time;
  }

private:
  struct task {
    void* dst;
    const void* src;
    std::size_t bytes;
    std::uint64_t seq;
  };
  struct record {
    std::uint64_t sequence = 0;
    copy_timing time{};
    std::exception_ptr error;
  };

  void check_known(std::uint64_t seq) const {
    if (seq == 0 || seq > enqueued_)
      throw std::invalid_argument("copy_engine::wait: ticket " + std::to_string(seq) + " was never issued");
  }

  void run() {
    for (;;) {
      task t;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return; // stop requested and drained
        t = queue_.front();
        queue_.pop_front();
      }
      record r;
      r.sequence = t.seq;
      r.time.start_ns = now_ns();
      try {
        if (opts_.before_copy) opts_.before_copy(dir_, t.seq);
        if (t.bytes) std::memcpy(t.dst, t.src, t.bytes);
        if (opts_.bandwidth_gbps > 0) {
          const auto until = std::chrono::nanoseconds(r.time.start_ns + std::int64_t(double(t.bytes) / opts_.bandwidth_gbps));
          std::this_thread::sleep_until(std::chrono::steady_clock::time_point(until));
        }
      } catch (const std::exception& e) {
        r.error = std::make_exception_ptr(std::runtime_error(
            std::string(dir_ == copy_direction::to_host ? "copy to host" : "copy to device") + " #" +
            std::to_string(t.seq) + " of " + std::to_string(t.bytes) + " bytes failed: " + e.what()));
      } catch (...) {
        r.error = std::make_exception_ptr(std::runtime_error("copy #" + std::to_string(t.seq) + " failed"));
      }
      r.time.end_ns = now_ns();
      {
        std::lock_guard<std::mutex> lock(mu_);
        records_[t.seq % history] = std::move(r);
        completed_.store(t.seq, std::memory_order_release);
      }
      done_cv_.notify_all();
    }
  }

  copy_direction dir_;
  const host_engine_options& opts_;
  mutable std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  std::deque<task> queue_;
  std::array<record, history> records_{};
  std::uint64_t enqueued_ = 0;
  std::atomic<std::uint64_t> completed_{0};
  bool stop_ = false;
  std::thread thread_;
};

class host_copy_engine final : public copy_engine {
public:
  explicit host_copy_engine(host_engine_options o)
      : opts_(std::move(o)), to_host_(copy_direction::to_host, opts_), to_device_(copy_direction::to_device, opts_) {
    if (!(opts_.bandwidth_gbps >= 0))
      throw std::invalid_argument("host_engine_options.bandwidth_gbps = " + std::to_string(opts_.bandwidth_gbps) +
                                  ": expected >= 0 (0 = uncapped)");
  }
  std::string_view name() const override { return "host"; }

  void* allocate_device(std::size_t bytes) override {
    if (bytes == 0) return nullptr;
    void* p = nullptr;
    if (posix_memalign(&p, 4096, (bytes + 4095) / 4096 * 4096) != 0)
      throw std::runtime_error("host engine: cannot allocate " + std::to_string(bytes) + " bytes of device memory");
    return p;
  }
  void free_device(void* p) noexcept override { std::free(p); }
  pinned_allocation allocate_pinned(std::size_t bytes) override { return detail::allocate_locked_host(bytes); }
  void free_pinned(pinned_allocation a, std::size_t bytes) noexcept override { detail::free_locked_host(a, bytes); }

  copy_ticket copy_async(copy_direction dir, void* dst, const void* src, std::size_t bytes) override {
    if (bytes && (!dst || !src))
      throw std::invalid_argument("copy_async: null " + std::string(dst ? "source" : "destination") + " for " +
                                  std::to_string(bytes) + " bytes");
    return {stream(dir).enqueue(dst, src, bytes), dir};
  }
  void wait(const copy_ticket& t) override { stream(t.direction).wait(t.sequence); }
  copy_timing timing(const copy_ticket& t) const override {
    return const_cast<host_copy_engine*>(this)->stream(t.direction).timing(t.sequence);
  }

private:
  copy_stream& stream(copy_direction d) { return d == copy_direction::to_host ? to_host_ : to_device_; }
  host_engine_options opts_;
  copy_stream to_host_, to_device_;
};

} // namespace

std::unique_ptr<copy_engine> make_host_copy_engine(host_engine_options options) {
  return std::make_unique<host_copy_engine>(std::move(options));
}

} // namespace hostopt
