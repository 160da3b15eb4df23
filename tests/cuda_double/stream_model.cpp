// The CUDA double's streams and events, and the race detector.
//
// Each stream runs its operations in order on a worker thread of its own, each after a
// delay drawn from the seed (reproducible per stream and position), so work that lacks a
// dependency runs at a different moment each seed instead of "fast enough". Host functions
// run on one callback thread for the whole process, as CUDA's do: a blocked one holds back
// every stream's host functions.
//
// Ordering is tracked with vector clocks: an operation knows, for every stream, the last
// operation of that stream it is ordered after — through its own stream's order, an event
// it waits for (the record current when the wait was enqueued), a flag wait (everything the
// host had learned when the flag let it go) and the host's own knowledge when it enqueued
// it (synchronizing with a stream or event, a query that saw it done, or a host function
// that ran: all teach the host, and so every operation it enqueues later). When an
// operation starts, every started operation of another stream that touched overlapping
// memory, with at least one of the two writing, must be ordered before it; otherwise both
// call sites are reported. Host threads count as one: an order a host thread learns is
// credited to all, so the detector never reports a race the host's own synchronization
// prevents (and may miss one between two host threads that never talk).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>

#include "double_internal.hpp"

using vclock = std::vector<std::uint64_t>;

namespace cuda_double::detail {

struct completion {
  bool done = false;
  std::int64_t time_ns = 0;
  cudaError_t error = cudaSuccess;
  vclock vc; // final once started
  std::uint32_t stream = 0;
  std::uint64_t seq = 0;
};

} // namespace cuda_double::detail

using cuda_double::detail::completion;

namespace {

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void join(vclock& a, const vclock& b) {
  if (a.size() < b.size()) a.resize(b.size(), 0);
  for (std::size_t i = 0; i < b.size(); ++i) a[i] = std::max(a[i], b[i]);
}
bool covers(const vclock& vc, std::uint32_t stream, std::uint64_t seq) {
  return stream < vc.size() && vc[stream] >= seq;
}

enum class op_kind { work, wait_event, wait_value, host_function };

struct op {
  op_kind kind = op_kind::work;
  cuda_double::detail::work w;
  cuda_double::detail::call_site site;
  std::uint64_t seq = 0, enqueue_index = 0, delay_ns = 0;
  vclock host_vc; // what the host knew when it enqueued it
  std::vector<std::shared_ptr<completion>> deps;
  const std::uint32_t* word = nullptr;
  std::uint32_t value = 0;
  unsigned flags = 0;
  cudaHostFn_t fn = nullptr;
  void* user = nullptr;
  std::shared_ptr<completion> done = std::make_shared<completion>();
};

struct access_record {
  cuda_double::detail::memory_access range;
  std::uint32_t stream;
  std::uint64_t seq;
  std::uint64_t observed_at; // enqueue index when the host learned of it; max = not yet
  std::shared_ptr<completion> done;
  const char* api;
  cuda_double::detail::call_site site;
};

} // namespace

struct CUstream_st {
  std::uint32_t id = 0;
  int device = 0;
  unsigned flags = 0;
  bool legacy = false;
  bool destroyed = false;
  bool capturing = false, capture_invalidated = false;
  std::deque<std::unique_ptr<op>> queue;
  std::shared_ptr<completion> tail;
  std::uint64_t next_seq = 1;
  vclock last_vc; // the last started operation's clock
  std::mt19937_64 rng;
};

struct CUevent_st {
  int device = 0;
  unsigned flags = 0;
  bool destroyed = false;
  std::shared_ptr<completion> record;
};

namespace cuda_double::detail {

namespace {

// Never destroyed (references to leaked objects): the stream workers and the callback
// thread are detached and may still wait on these while exit() runs static destructors,
// and a destroyed condition variable with waiters hangs the exit.
std::mutex& mu = *new std::mutex; // everything below
std::condition_variable& cv = *new std::condition_variable;
std::vector<CUstream_st*>& streams = *new std::vector<CUstream_st*>; // by id; destroyed ones stay
std::vector<CUstream_st*>& legacy_streams = *new std::vector<CUstream_st*>;
vclock& host_vc = *new vclock;
std::uint64_t enqueue_counter = 0;
std::vector<access_record>& records = *new std::vector<access_record>;

// The callback thread (host functions).
struct host_call {
  cudaHostFn_t fn;
  void* user;
  const vclock* vc;
  bool finished = false;
};
std::deque<host_call*>& host_calls = *new std::deque<host_call*>;
bool callback_thread_started = false;

void host_learns(const vclock& vc) {
  join(host_vc, vc);
  for (auto& r : records)
    if (r.observed_at == std::numeric_limits<std::uint64_t>::max() && covers(host_vc, r.stream, r.seq))
      r.observed_at = enqueue_counter;
}

std::uint64_t min_pending_index() {
  std::uint64_t m = std::numeric_limits<std::uint64_t>::max();
  for (auto* s : streams)
    if (!s->queue.empty()) m = std::min(m, s->queue.front()->enqueue_index);
  return m;
}

// Records the host has learned of, with nothing still queued from before it did, can race
// with nothing any more.
void prune_records() {
  const std::uint64_t pending = min_pending_index();
  std::erase_if(records, [&](const access_record& r) { return r.done->done && r.observed_at < pending; });
}

const char* verb(bool write) { return write ? "writes" : "reads"; }

void check_races(const op& o, std::uint32_t stream) {
  prune_records();
  for (const auto& a : o.w.accesses)
    for (const auto& r : records) {
      if (r.stream == stream || !(a.write || r.range.write)) continue;
      if (a.end <= r.range.begin || r.range.end <= a.begin) continue;
      if (covers(o.done->vc, r.stream, r.seq)) continue;
      std::ostringstream text;
      text << "race: " << o.w.api << " on stream " << stream << " " << verb(a.write) << " [0x" << std::hex
           << a.begin << ", 0x" << a.end << ") while " << r.api << " on stream " << std::dec << r.stream
           << " " << verb(r.range.write) << " [0x" << std::hex << r.range.begin << ", 0x" << r.range.end
           << std::dec
           << "), with no ordering between them (stream order, event, flag wait or host synchronization); "
           << "this one enqueued at " << describe(o.site) << "; the other at " << describe(r.site);
      violation(text.str());
      return;
    }
  for (const auto& a : o.w.accesses)
    records.push_back({a, stream, o.seq, std::numeric_limits<std::uint64_t>::max(), o.done, o.w.api, o.site});
}

bool value_reached(const op& o) {
  const std::uint32_t now = __atomic_load_n(o.word, __ATOMIC_ACQUIRE);
  switch (o.flags & 0x3u) {
  case CU_STREAM_WAIT_VALUE_GEQ: return std::int32_t(now - o.value) >= 0;
  case CU_STREAM_WAIT_VALUE_EQ: return now == o.value;
  case CU_STREAM_WAIT_VALUE_AND: return (now & o.value) != 0;
  default: return (~(now | o.value)) != 0; // NOR
  }
}

void run_host_function(std::unique_lock<std::mutex>& lock, op& o) {
  host_call call{o.fn, o.user, &o.done->vc};
  host_calls.push_back(&call);
  cv.notify_all();
  cv.wait(lock, [&] { return call.finished; });
}

void callback_thread() {
  std::unique_lock<std::mutex> lock(mu);
  for (;;) {
    cv.wait(lock, [] { return !host_calls.empty(); });
    host_call* call = host_calls.front();
    host_calls.pop_front();
    host_learns(*call->vc); // its stream's earlier work is done, and the host now knows
    lock.unlock();
    in_host_function() = true;
    call->fn(call->user);
    in_host_function() = false;
    lock.lock();
    call->finished = true;
    cv.notify_all();
  }
}

// Device work and copies: the body, then the rest of the modelled time. A device's link has
// one copy engine per direction, as PCIe and NVLink-C2C devices do: copies in one direction
// take turns (from any stream), so a modelled link never moves more than its bandwidth.
// A copy of page-locked memory is in flight, its host pages guarded, from its start (the
// seeded delay `in_flight_ns` included) to its end; the guard's own cost is inside the
// modelled time, not added to it.
void run_modelled(int device, const work& w, std::uint64_t in_flight_ns) {
  static std::mutex* const links = new std::mutex[2 * 64]; // leaked: workers may outlive exit
  std::unique_lock<std::mutex> link;
  if (w.link >= 0 && w.modelled_ns && device >= 0 && device < 64)
    link = std::unique_lock<std::mutex>(links[2 * device + w.link]);
  const auto begin = std::chrono::steady_clock::now();
  for (const auto& g : w.host_guards) guard_host_range(g, true);
  if (in_flight_ns) std::this_thread::sleep_for(std::chrono::nanoseconds(in_flight_ns));
  if (w.body) w.body();
  if (w.modelled_ns)
    std::this_thread::sleep_until(begin + std::chrono::nanoseconds(w.modelled_ns + in_flight_ns));
  for (const auto& g : w.host_guards) guard_host_range(g, false);
}

void worker(CUstream_st* s) {
  std::unique_lock<std::mutex> lock(mu);
  for (;;) {
    cv.wait(lock, [&] { return !s->queue.empty() || s->destroyed; });
    if (s->queue.empty()) return; // destroyed and drained
    op& o = *s->queue.front();
    for (const auto& d : o.deps) cv.wait(lock, [&] { return d->done; });
    // A plain host store releases it, or the device failing (CUDA ends every stream's
    // pending work then; the operation completes with the sticky error).
    if (o.kind == op_kind::wait_value)
      while (!value_reached(o) && sticky_error(s->device) == cudaSuccess)
        cv.wait_for(lock, std::chrono::microseconds(100));
    // The operation starts: its clock, then the race check.
    vclock vc = o.host_vc;
    join(vc, s->last_vc);
    for (const auto& d : o.deps) join(vc, d->vc);
    if (o.kind == op_kind::wait_value) join(vc, host_vc);
    if (vc.size() <= s->id) vc.resize(s->id + 1, 0);
    vc[s->id] = o.seq;
    o.done->vc = vc;
    s->last_vc = vc;
    check_races(o, s->id);
    std::unique_ptr<op> owned = std::move(s->queue.front());
    s->queue.pop_front();
    cv.notify_all(); // min_pending_index moved

    // A copy touching page-locked memory spends its delay in flight, its host pages guarded
    // (guard_host_range): a host access that races it then collides with it.
    const bool guarded = !owned->w.host_guards.empty();
    lock.unlock();
    if (owned->delay_ns && !guarded) std::this_thread::sleep_for(std::chrono::nanoseconds(owned->delay_ns));
    lock.lock();
    cudaError_t error = sticky_error(s->device);
    if (error == cudaSuccess) {
      if (owned->w.fault != cudaSuccess) {
        if (owned->w.on_fault) owned->w.on_fault();
        set_sticky_error(s->device, owned->w.fault);
        error = owned->w.fault;
      } else if (owned->kind == op_kind::host_function) {
        run_host_function(lock, *owned);
      } else if (owned->w.body || owned->w.modelled_ns || guarded) {
        lock.unlock();
        run_modelled(s->device, owned->w, guarded ? owned->delay_ns : 0);
        lock.lock();
      }
    }
    owned->done->error = error;
    owned->done->time_ns = now_ns();
    owned->done->done = true;
    cv.notify_all();
  }
}

std::uint64_t draw_delay(CUstream_st* s) {
  const std::uint64_t max = config().max_delay_ns;
  if (max == 0) return 0;
  const std::uint64_t r = s->rng();
  return (r & 1) ? 0 : (r >> 1) % (max + 1);
}

CUstream_st* new_stream(int device, unsigned flags, bool legacy) {
  auto* s = new CUstream_st; // never freed: handles are never reused
  s->id = std::uint32_t(streams.size());
  s->device = device;
  s->flags = flags;
  s->legacy = legacy;
  s->rng.seed(config().seed * 0x9e3779b97f4a7c15ull + s->id);
  streams.push_back(s);
  if (!callback_thread_started) {
    std::thread(callback_thread).detach();
    callback_thread_started = true;
  }
  std::thread(worker, s).detach();
  return s;
}

// The legacy default stream's implicit synchronization: its work waits for every blocking
// stream's earlier work on the device, and a blocking stream's work waits for its earlier work.
void add_implicit_dependencies(CUstream_st* s, op& o) {
  if (s->legacy) {
    for (auto* t : streams)
      if (t != s && t->device == s->device && !t->legacy && !(t->flags & cudaStreamNonBlocking) && t->tail)
        o.deps.push_back(t->tail);
  } else if (!(s->flags & cudaStreamNonBlocking) && std::size_t(s->device) < legacy_streams.size()) {
    if (auto* l = legacy_streams[std::size_t(s->device)]; l && l->tail) o.deps.push_back(l->tail);
  }
}

std::shared_ptr<completion> push(CUstream_st* s, std::unique_ptr<op> o) {
  o->seq = s->next_seq++;
  o->enqueue_index = ++enqueue_counter;
  o->host_vc = host_vc;
  o->delay_ns = draw_delay(s);
  o->done->stream = s->id;
  o->done->seq = o->seq;
  add_implicit_dependencies(s, *o);
  auto done = o->done;
  s->tail = done;
  s->queue.push_back(std::move(o));
  cv.notify_all();
  return done;
}

} // namespace

CUstream_st* resolve_stream(cudaStream_t s, int device, const char* api) {
  std::lock_guard<std::mutex> lock(mu);
  if (s == nullptr || s == cudaStreamLegacy || s == cudaStreamPerThread) {
    if (device < 0) return nullptr;
    if (legacy_streams.size() <= std::size_t(device)) legacy_streams.resize(std::size_t(device) + 1, nullptr);
    auto*& l = legacy_streams[std::size_t(device)];
    if (!l) l = new_stream(device, 0, true);
    return l;
  }
  for (auto* x : streams)
    if (x == s) {
      if (x->destroyed) {
        violation(std::string(api) + " on a destroyed stream; called from " + describe(capture_call_site()));
        return nullptr;
      }
      return x;
    }
  return nullptr;
}

int stream_device(CUstream_st* s) { return s->device; }

std::shared_ptr<completion> enqueue(CUstream_st* s, work w) {
  auto o = std::make_unique<op>();
  o->site = capture_call_site();
  o->w = std::move(w);
  std::lock_guard<std::mutex> lock(mu);
  return push(s, std::move(o));
}

cudaError_t enqueue_wait_value(CUstream_st* s, const std::uint32_t* word, std::uint32_t value,
                               unsigned flags) {
  auto o = std::make_unique<op>();
  o->kind = op_kind::wait_value;
  o->w.api = "cuStreamWaitValue32";
  o->site = capture_call_site();
  o->word = word;
  o->value = value;
  o->flags = flags;
  // It reads the word until it passes: freeing the word waits for it (cudaFreeHost).
  const auto w = reinterpret_cast<std::uintptr_t>(word);
  o->w.accesses = {{w, w + sizeof(std::uint32_t), false}};
  std::lock_guard<std::mutex> lock(mu);
  push(s, std::move(o));
  return cudaSuccess;
}

cudaError_t enqueue_host_function(CUstream_st* s, cudaHostFn_t fn, void* user) {
  auto o = std::make_unique<op>();
  o->kind = op_kind::host_function;
  o->w.api = "cudaLaunchHostFunc";
  o->site = capture_call_site();
  o->fn = fn;
  o->user = user;
  std::lock_guard<std::mutex> lock(mu);
  push(s, std::move(o));
  return cudaSuccess;
}

cudaError_t enqueue_event_wait(CUstream_st* s, CUevent_st* e) {
  std::lock_guard<std::mutex> lock(mu);
  if (!e->record) return cudaSuccess; // never recorded: no wait at all
  auto o = std::make_unique<op>();
  o->kind = op_kind::wait_event;
  o->w.api = "cudaStreamWaitEvent";
  o->site = capture_call_site();
  o->deps.push_back(e->record); // bound now: a later record of the event changes nothing
  push(s, std::move(o));
  return cudaSuccess;
}

cudaError_t record_event(CUevent_st* e, CUstream_st* s) {
  auto o = std::make_unique<op>();
  o->w.api = "cudaEventRecord";
  o->site = capture_call_site();
  std::lock_guard<std::mutex> lock(mu);
  e->record = push(s, std::move(o));
  return cudaSuccess;
}

void host_waits(const std::shared_ptr<completion>& c, bool learn) {
  if (!c) return;
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return c->done; });
  if (learn) host_learns(c->vc);
}

bool host_queries(const std::shared_ptr<completion>& c) {
  if (!c) return true;
  std::lock_guard<std::mutex> lock(mu);
  if (!c->done) return false;
  host_learns(c->vc);
  return true;
}

std::shared_ptr<completion> stream_tail(CUstream_st* s) {
  std::lock_guard<std::mutex> lock(mu);
  return s->tail;
}

std::vector<std::shared_ptr<completion>> device_tails(int device) {
  std::lock_guard<std::mutex> lock(mu);
  std::vector<std::shared_ptr<completion>> out;
  for (auto* s : streams)
    if (s->device == device && s->tail) out.push_back(s->tail);
  return out;
}

void wait_until_unused(const void* p, std::size_t bytes) {
  const auto b = reinterpret_cast<std::uintptr_t>(p), e = b + std::max<std::size_t>(bytes, 1);
  std::unique_lock<std::mutex> lock(mu);
  const auto in_use = [&] {
    for (auto* s : streams)
      for (const auto& o : s->queue)
        for (const auto& a : o->w.accesses)
          if (a.begin < e && b < a.end) return true;
    for (const auto& r : records)
      if (!r.done->done && r.range.begin < e && b < r.range.end) return true;
    return false;
  };
  cv.wait(lock, [&] { return !in_use(); });
  std::erase_if(records, [&](const access_record& r) { return r.range.begin < e && b < r.range.end; });
}

cudaError_t create_stream(CUstream_st** out, int device, unsigned flags) {
  std::lock_guard<std::mutex> lock(mu);
  *out = new_stream(device, flags, false);
  return cudaSuccess;
}

cudaError_t destroy_stream(CUstream_st* s) {
  // As CUDA: returns at once; the worker finishes the stream's work, then ends.
  std::lock_guard<std::mutex> lock(mu);
  if (s->legacy) return cudaErrorInvalidResourceHandle;
  s->destroyed = true;
  cv.notify_all();
  return cudaSuccess;
}

bool begin_capture(CUstream_st* s) {
  std::lock_guard<std::mutex> lock(mu);
  if (s->capturing) return false;
  s->capturing = true;
  s->capture_invalidated = false;
  return true;
}
bool end_capture(CUstream_st* s) {
  std::lock_guard<std::mutex> lock(mu);
  const bool ok = s->capturing && !s->capture_invalidated;
  s->capturing = false;
  s->capture_invalidated = false;
  return ok;
}
bool capturing(CUstream_st* s) {
  std::lock_guard<std::mutex> lock(mu);
  return s->capturing;
}
void invalidate_capture(CUstream_st* s) {
  std::lock_guard<std::mutex> lock(mu);
  s->capture_invalidated = true;
}

namespace {
// Never freed (a reference to a leaked vector, as above): handles are never reused, so a
// destroyed one is recognized.
std::vector<CUevent_st*>& events = *new std::vector<CUevent_st*>;
} // namespace

cudaError_t create_event(CUevent_st** out, int device, unsigned flags) {
  std::lock_guard<std::mutex> lock(mu);
  auto* e = new CUevent_st;
  e->device = device;
  e->flags = flags;
  events.push_back(e);
  *out = e;
  return cudaSuccess;
}

CUevent_st* resolve_event(cudaEvent_t e, const char* api) {
  std::lock_guard<std::mutex> lock(mu);
  for (auto* x : events)
    if (x == e) {
      if (x->destroyed) {
        violation(std::string(api) + " on a destroyed event; called from " + describe(capture_call_site()));
        return nullptr;
      }
      return x;
    }
  return nullptr;
}

cudaError_t destroy_event(CUevent_st* e) {
  // As CUDA: a pending record completes on its own; the handle is dead from now on.
  std::lock_guard<std::mutex> lock(mu);
  e->destroyed = true;
  e->record.reset(); // waits already enqueued hold their own reference
  return cudaSuccess;
}

int event_device(CUevent_st* e) { return e->device; }
unsigned event_flags(CUevent_st* e) { return e->flags; }
std::shared_ptr<completion> event_record(CUevent_st* e) {
  std::lock_guard<std::mutex> lock(mu);
  return e->record;
}
std::int64_t completion_time_ns(const std::shared_ptr<completion>& c) {
  std::lock_guard<std::mutex> lock(mu);
  return c->time_ns;
}
cudaError_t completion_error(const std::shared_ptr<completion>& c) {
  std::lock_guard<std::mutex> lock(mu);
  return c->error;
}

} // namespace cuda_double::detail
