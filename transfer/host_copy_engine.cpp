// The host engine: a model of CUDA's stream semantics on threads, so that the pipeline's
// device-side ordering is tested where no GPU exists. "Device" memory is host memory.
//
// - A stream is a FIFO queue executed by its own thread, one operation at a time.
// - An event counts its records: a record is issued when enqueued and completes when its
//   stream reaches it; a wait (by a stream or the host) captures the latest issued record
//   at the time it is enqueued and waits for it — CUDA's rule, which makes a dependency
//   recorded too early (or not at all) visible as stale data.
// - A flag is a 32-bit word; a stream waits until (int32_t)(flag - value) >= 0.
// - Copies of one direction share one "DMA engine" (a mutex), as on a GPU, optionally
//   stretched to a PCIe bandwidth.
// - The first failure is sticky: later operations are dropped (events still complete so
//   nobody hangs) and every call throws its text.
// One mutex guards all of it: the engine's work per operation is tiny next to a copy.
#include <array>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <list>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <variant>

#include "host_memory.hpp"
#include "steady_clock.hpp"
#include "hostopt/copy_engine.hpp"

namespace hostopt {

namespace {

using detail::now_ns;

// Records complete in their own streams' order, not in the order they were made: an event
// recorded on two streams can see its later record complete first, and a wait for the
// earlier one must still wait for it (CUDA's rule). So each record is tracked.
struct event_impl {
  std::uint64_t issued = 0;                // records enqueued (generation of the latest)
  std::set<std::uint64_t> outstanding;     // records enqueued, not yet reached by their stream
  std::int64_t time_ns = 0;                // when the latest record ran
  bool done(std::uint64_t generation) const { return outstanding.count(generation) == 0; }
};

struct flag_impl {
  std::uint32_t value = 0;
  bool freed = false; // free_flag let its waits go
};

struct copy_op {
  copy_direction dir;
  void* dst;
  const void* src;
  std::size_t bytes;
};
struct record_op {
  event_impl* event;
  std::uint64_t generation;
};
struct wait_event_op {
  event_impl* event;
  std::uint64_t generation;
};
struct wait_flag_op {
  flag_impl* flag;
  std::uint32_t value;
};
struct host_fn_op {
  std::function<void()> fn;
};
using operation = std::variant<copy_op, record_op, wait_event_op, wait_flag_op, host_fn_op>;

bool flag_reached(std::uint32_t flag, std::uint32_t value) { return std::int32_t(flag - value) >= 0; }

class host_copy_engine;

struct queued_op {
  operation op;
  std::int64_t enqueued_ns;
};

struct stream_impl {
  std::deque<queued_op> queue;
  std::uint64_t enqueued = 0, done = 0;
  bool stop = false;
  std::thread thread;
};

class host_copy_engine final : public copy_engine {
public:
  explicit host_copy_engine(host_engine_options o) : opts_(std::move(o)) {
    // Below 1e-6 GB/s (1 KB/s) a copy's modelled time would outlast any run.
    if (!(opts_.bandwidth_gbps == 0 || (opts_.bandwidth_gbps >= 1e-6 && opts_.bandwidth_gbps <= 1e9)))
      throw std::invalid_argument("host_engine_options.bandwidth_gbps = " + std::to_string(opts_.bandwidth_gbps) +
                                  ": expected 0 (uncapped) or 1e-6 to 1e9 GB/s");
  }

  ~host_copy_engine() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      shutdown_ = true; // waits give up: nothing will write their flags any more
      for (auto& s : streams_) s.stop = true;
    }
    cv_.notify_all();
    for (auto& s : streams_) s.thread.join();
    for (auto* e : events_) delete e; // still live: never destroyed by their users
    for (auto* f : flags_) delete f;
  }

  std::string_view name() const override { return "host"; }

  void* allocate_device(std::size_t bytes) override {
    if (bytes == 0) return nullptr;
    void* p = nullptr;
    if (bytes > (std::size_t(1) << 47) || posix_memalign(&p, 4096, (bytes + 4095) / 4096 * 4096) != 0)
      throw std::runtime_error("host engine: cannot allocate " + std::to_string(bytes) + " bytes of device memory");
    return p;
  }
  void free_device(void* p) noexcept override { std::free(p); }
  pinned_allocation allocate_pinned(std::size_t bytes) override {
    pinned_allocation a = detail::allocate_locked_host(bytes);
    if (!opts_.move_bytes && a.data) std::memset(a.data, 0, bytes); // no copy will ever fill it
    return a;
  }
  void free_pinned(pinned_allocation a, std::size_t bytes) noexcept override { detail::free_locked_host(a, bytes); }

  device_stream create_stream() override {
    std::lock_guard<std::mutex> lock(mu_);
    throw_if_failed();
    stream_impl& s = streams_.emplace_back();
    s.thread = std::thread([this, &s] { run(s); });
    live_streams_.insert(&s);
    return {&s};
  }

  void destroy_stream(device_stream h) noexcept override {
    std::unique_lock<std::mutex> lock(mu_);
    auto* s = static_cast<stream_impl*>(h.handle);
    if (!live_streams_.count(s)) return;
    live_streams_.erase(s);
    s->stop = true;
    cv_.notify_all();
    lock.unlock();
    s->thread.join(); // after its queue drained
    lock.lock();
    streams_.remove_if([&](const stream_impl& x) { return &x == s; });
  }

  device_event create_event() override {
    std::lock_guard<std::mutex> lock(mu_);
    throw_if_failed();
    auto* e = new event_impl;
    events_.insert(e);
    return {e};
  }
  void destroy_event(device_event h) noexcept override {
    std::lock_guard<std::mutex> lock(mu_);
    auto* e = static_cast<event_impl*>(h.handle);
    if (events_.erase(e)) retired_events_.emplace_back(e); // a queued wait may still name it
  }

  void record_event(device_event e, device_stream s) override {
    std::lock_guard<std::mutex> lock(mu_);
    event_impl& ev = event(e, "record_event");
    stream_impl& st = stream(s, "record_event");
    throw_if_failed();
    ev.outstanding.insert(++ev.issued);
    enqueue(st, record_op{&ev, ev.issued});
  }

  void stream_wait_event(device_stream s, device_event e) override {
    std::lock_guard<std::mutex> lock(mu_);
    event_impl& ev = event(e, "stream_wait_event");
    stream_impl& st = stream(s, "stream_wait_event");
    throw_if_failed();
    if (ev.issued) enqueue(st, wait_event_op{&ev, ev.issued}); // never recorded: nothing to wait for
  }

  void synchronize_event(device_event e) override {
    std::unique_lock<std::mutex> lock(mu_);
    event_impl& ev = event(e, "synchronize_event");
    const std::uint64_t gen = ev.issued;
    cv_.wait(lock, [&] { return ev.done(gen) || !error_.empty(); });
    throw_if_failed();
  }

  bool event_done(device_event e) override {
    std::lock_guard<std::mutex> lock(mu_);
    event_impl& ev = event(e, "event_done");
    throw_if_failed();
    return ev.done(ev.issued);
  }

  std::int64_t event_time_ns(device_event e) override {
    std::lock_guard<std::mutex> lock(mu_);
    event_impl& ev = event(e, "event_time_ns");
    throw_if_failed();
    if (ev.issued == 0 || !ev.done(ev.issued))
      throw std::invalid_argument(std::string("event_time_ns: the event ") +
                                  (ev.issued ? "has not completed yet" : "was never recorded"));
    return ev.time_ns;
  }

  void synchronize_stream(device_stream s) override {
    std::unique_lock<std::mutex> lock(mu_);
    stream_impl& st = stream(s, "synchronize_stream");
    const std::uint64_t target = st.enqueued;
    cv_.wait(lock, [&] { return st.done >= target || !error_.empty(); });
    throw_if_failed();
  }

  void copy_async(device_stream s, copy_direction dir, void* dst, const void* src, std::size_t bytes) override {
    if (bytes && (!dst || !src))
      throw std::invalid_argument("copy_async: null " + std::string(dst ? "source" : "destination") + " for " +
                                  std::to_string(bytes) + " bytes");
    if (dir != copy_direction::to_host && dir != copy_direction::to_device)
      throw std::invalid_argument("copy_async: direction " + std::to_string(int(dir)) + " is not a copy_direction");
    std::lock_guard<std::mutex> lock(mu_);
    stream_impl& st = stream(s, "copy_async");
    throw_if_failed();
    enqueue(st, copy_op{dir, dst, src, bytes});
  }

  void launch_host_function(device_stream s, std::function<void()> fn) override {
    if (!fn) throw std::invalid_argument("launch_host_function: empty function");
    std::lock_guard<std::mutex> lock(mu_);
    stream_impl& st = stream(s, "launch_host_function");
    throw_if_failed();
    enqueue(st, host_fn_op{std::move(fn)});
  }

  device_flag allocate_flag() override {
    std::lock_guard<std::mutex> lock(mu_);
    throw_if_failed();
    auto* f = new flag_impl;
    flags_.insert(f);
    return {f};
  }
  void free_flag(device_flag h) noexcept override {
    std::lock_guard<std::mutex> lock(mu_);
    auto* f = static_cast<flag_impl*>(h.handle);
    if (!flags_.erase(f)) return;
    f->freed = true; // pending waits on it go, as copy_engine::free_flag says
    retired_flags_.emplace_back(f);
    cv_.notify_all();
  }
  void stream_wait_flag(device_stream s, device_flag f, std::uint32_t value) override {
    std::lock_guard<std::mutex> lock(mu_);
    flag_impl& fl = flag(f, "stream_wait_flag");
    stream_impl& st = stream(s, "stream_wait_flag");
    throw_if_failed();
    enqueue(st, wait_flag_op{&fl, value});
  }
  void write_flag(device_flag f, std::uint32_t value) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      flag(f, "write_flag").value = value;
    }
    cv_.notify_all();
  }
  std::string flag_mechanism() const override { return "host model (stream threads wait on the flag)"; }

  std::string sticky_error() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return error_;
  }

private:
  stream_impl& stream(device_stream h, const char* what) {
    auto* s = static_cast<stream_impl*>(h.handle);
    if (!live_streams_.count(s))
      throw std::invalid_argument(std::string(what) + ": not a stream of this engine (null or destroyed)");
    return *s;
  }
  event_impl& event(device_event h, const char* what) {
    auto* e = static_cast<event_impl*>(h.handle);
    if (!events_.count(e))
      throw std::invalid_argument(std::string(what) + ": not an event of this engine (null or destroyed)");
    return *e;
  }
  flag_impl& flag(device_flag h, const char* what) {
    auto* f = static_cast<flag_impl*>(h.handle);
    if (!flags_.count(f))
      throw std::invalid_argument(std::string(what) + ": not a flag of this engine (null or freed)");
    return *f;
  }
  void throw_if_failed() const {
    if (!error_.empty()) throw std::runtime_error("device error (sticky): " + error_);
  }
  void enqueue(stream_impl& s, operation op) {
    s.queue.push_back({std::move(op), now_ns()});
    ++s.enqueued;
    cv_.notify_all();
  }
  void fail(std::string msg) { // with mu_ held
    if (error_.empty()) error_ = std::move(msg);
    cv_.notify_all();
  }

  // Runs one operation with mu_ held (released around copies and host functions).
  const char* execute(std::unique_lock<std::mutex>& lock, operation& op, const void*& object) {
    const auto healthy = [&] { return error_.empty() && !shutdown_; };
    if (auto* w = std::get_if<wait_event_op>(&op)) {
      object = w->event;
      cv_.wait(lock, [&] { return w->event->done(w->generation) || !healthy(); });
      return "wait event";
    }
    if (auto* w = std::get_if<wait_flag_op>(&op)) {
      object = w->flag;
      cv_.wait(lock, [&] { return flag_reached(w->flag->value, w->value) || w->flag->freed || !healthy(); });
      return "wait flag";
    }
    if (auto* r = std::get_if<record_op>(&op)) {
      object = r->event;
      r->event->outstanding.erase(r->generation); // completes even after a failure: nobody hangs
      if (r->generation == r->event->issued) r->event->time_ns = now_ns();
      return "record";
    }
    if (auto* c = std::get_if<copy_op>(&op)) {
      const char* kind = c->dir == copy_direction::to_host ? "copy to host" : "copy to device";
      if (!healthy()) return kind;
      const int d = int(c->dir);
      lock.unlock();
      std::string failure;
      {
        std::lock_guard<std::mutex> dma(dma_[d]); // one copy engine per direction
        const std::uint64_t seq = ++copies_[d];
        const std::int64_t t0 = now_ns();
        try {
          if (opts_.before_copy) opts_.before_copy(c->dir, seq);
          if (c->bytes && opts_.move_bytes) std::memcpy(c->dst, c->src, c->bytes);
          if (opts_.bandwidth_gbps > 0)
            std::this_thread::sleep_until(std::chrono::steady_clock::time_point(std::chrono::nanoseconds(
                t0 + std::int64_t(std::min(double(c->bytes) / opts_.bandwidth_gbps, 1e18))))); // no overflow
        } catch (const std::exception& e) {
          failure = std::string(kind) + " #" + std::to_string(seq) + " of " + std::to_string(c->bytes) +
                    " bytes failed: " + e.what();
        }
      }
      lock.lock();
      if (!failure.empty()) fail(failure);
      return kind;
    }
    auto& h = std::get<host_fn_op>(op);
    if (!healthy()) return "host function";
    lock.unlock();
    std::string failure;
    try {
      h.fn();
    } catch (const std::exception& e) {
      failure = std::string("host function failed: ") + e.what();
    } catch (...) {
      failure = "host function failed";
    }
    lock.lock();
    if (!failure.empty()) fail(failure);
    return "host function";
  }

  void run(stream_impl& s) {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return s.stop || shutdown_ || !s.queue.empty(); });
      if (shutdown_ || s.queue.empty()) return; // shutdown drops the queue; stop drains it first
      queued_op q = std::move(s.queue.front());
      s.queue.pop_front();
      const void* object = nullptr;
      const std::int64_t start = now_ns();
      const char* kind = execute(lock, q.op, object);
      ++s.done;
      cv_.notify_all();
      if (opts_.on_op) {
        const device_op_record rec{&s, kind, object, q.enqueued_ns, start, now_ns()};
        lock.unlock();
        opts_.on_op(rec);
        lock.lock();
      }
    }
  }

  host_engine_options opts_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::array<std::mutex, 2> dma_;
  std::array<std::uint64_t, 2> copies_{};
  std::list<stream_impl> streams_;
  std::set<stream_impl*> live_streams_;
  std::set<event_impl*> events_;
  std::set<flag_impl*> flags_;
  std::deque<std::unique_ptr<event_impl>> retired_events_;
  std::deque<std::unique_ptr<flag_impl>> retired_flags_;
  std::string error_;
  bool shutdown_ = false;

};

} // namespace

std::unique_ptr<copy_engine> make_host_copy_engine(host_engine_options options) {
  return std::make_unique<host_copy_engine>(std::move(options));
}

} // namespace hostopt
