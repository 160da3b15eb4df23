// The offload pipeline. A call enqueues all of its device work at once and returns; the
// CPU side runs on the pipeline thread. With `depth` pinned buffers per direction used as
// rings and one host-written flag `released` counting chunks the CPU is done with (chunks
// are numbered g = 0, 1, 2, ... across operations):
//
//   copy-in stream:  [wait the gradients' producer]  (or, with per-chunk gradient events,
//                    chunk k waits its own event until the first chunk without one)
//                    for g: wait released >= g - depth + 1 (its buffer is free); copy g in
//                    record "gradients consumed"
//   copy-out stream: [wait the parameters' last reader]
//                    for g: wait released >= g + 1 (the CPU wrote it); copy g out
//                    record "parameters ready"
//   pipeline thread: for g: wait copy-in(g); wait copy-out(g - depth) (its parameter
//                    buffer is reused); update g into parameter buffer g % depth;
//                    released = g + 1
//
// so copy-in of g+1, update of g and copy-out of g-1 overlap, and the device never waits
// on the host except through the flag and the handle's events. A chunk the CPU does not
// update (a skipped or failed step) gets the unchanged parameters, so every enqueued copy
// still carries valid data. The pipeline knows nothing of Adam: it drives a chunk_updater
// (begin_step / update_range / finish_step), which decides checks, clipping and skips.
#include "hostopt/offload_pipeline.hpp"
#include "steady_clock.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>

namespace hostopt {

namespace {

using detail::now_ns;

void check_device_view(const char* what, const void* data, std::size_t size, dtype type, std::size_t expected,
                       dtype expected_type) {
  if (type != expected_type)
    throw std::invalid_argument(std::string(what) + ".type = " + std::to_string(int(type)) + ": expected " +
                                std::string(dtype_name(expected_type)) + " (pipeline_options)");
  if (size != expected)
    throw std::invalid_argument(std::string(what) + ".size = " + std::to_string(size) + ": expected " +
                                std::to_string(expected) + " elements (the optimizer's arena_size())");
  if (!data && size)
    throw std::invalid_argument(std::string(what) + ".data is null for " + std::to_string(size) +
                                " elements");
}

} // namespace

const char* stage_name(pipeline_stage s) {
  switch (s) {
  case pipeline_stage::copy_in: return "copy-in";
  case pipeline_stage::update: return "update";
  case pipeline_stage::copy_out: return "copy-out";
  case pipeline_stage::accumulate: return "accumulate";
  }
  return "?";
}

// --- device events, pooled per operation ----------------------------------------------

// One operation's events: per chunk, copy start and end in each direction (the CPU waits on
// the ends; the timeline reads all four), and the two the handle hands out.
struct op_events {
  std::vector<device_event> in_start, in_end, out_start, out_end;
  device_event consumed, ready;
};

// Event sets are made once and reused: a set goes back to the pool when its operation is
// done and the last handle of it is gone (a trainer may still wait on its events).
class event_pool : public std::enable_shared_from_this<event_pool> {
public:
  event_pool(copy_engine& e, std::size_t chunks) : engine_(e), chunks_(chunks) {}
  ~event_pool() {
    for (auto& set : free_) destroy(*set);
  }
  std::shared_ptr<op_events> acquire() {
    std::unique_ptr<op_events> set;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!free_.empty()) {
        set = std::move(free_.back());
        free_.pop_back();
      }
    }
    if (!set) set = make();
    auto self = shared_from_this();
    return std::shared_ptr<op_events>(set.release(), [self](op_events* p) {
      std::lock_guard<std::mutex> lock(self->mu_);
      self->free_.emplace_back(p);
    });
  }

private:
  std::unique_ptr<op_events> make() {
    auto set = std::make_unique<op_events>();
    try {
      for (auto* v : {&set->in_start, &set->in_end, &set->out_start, &set->out_end})
        for (std::size_t k = 0; k < chunks_; ++k) v->push_back(engine_.create_event());
      set->consumed = engine_.create_event();
      set->ready = engine_.create_event();
    } catch (...) {
      destroy(*set);
      throw;
    }
    return set;
  }
  void destroy(op_events& set) noexcept {
    for (auto* v : {&set.in_start, &set.in_end, &set.out_start, &set.out_end})
      for (auto e : *v) engine_.destroy_event(e);
    if (set.consumed) engine_.destroy_event(set.consumed);
    if (set.ready) engine_.destroy_event(set.ready);
  }

  copy_engine& engine_;
  std::size_t chunks_;
  std::mutex mu_;
  std::vector<std::unique_ptr<op_events>> free_;
};

// --- the handle --------------------------------------------------------------------------

struct pipeline_handle::state {
  mutable std::mutex mu;
  mutable std::condition_variable cv;
  bool finished = false;
  step_result result{};
  std::exception_ptr error;
  std::shared_ptr<op_events> events;
  bool writes_params = false;

  void finish(step_result r, std::exception_ptr e) {
    {
      std::lock_guard<std::mutex> lock(mu);
      finished = true;
      result = r;
      error = std::move(e);
    }
    cv.notify_all();
  }
};

step_result pipeline_handle::wait() const {
  if (!state_) throw std::logic_error("pipeline_handle::wait: empty handle");
  std::unique_lock<std::mutex> lock(state_->mu);
  state_->cv.wait(lock, [&] { return state_->finished; });
  if (state_->error) std::rethrow_exception(state_->error);
  return state_->result;
}

bool pipeline_handle::done() const {
  if (!state_) return true;
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->finished;
}

device_event pipeline_handle::grads_consumed() const {
  return state_ ? state_->events->consumed : device_event{};
}

device_event pipeline_handle::params_ready() const {
  return state_ && state_->writes_params ? state_->events->ready : device_event{};
}

// --- the pipeline ------------------------------------------------------------------------

struct offload_pipeline::impl {
  static constexpr std::size_t max_queued = 16;
  enum class op_kind { step, accumulate };
  struct operation {
    op_kind kind;
    const void* grads;
    void* params;
    step_options checks;
    std::vector<std::size_t> without_grad; // tensors the step leaves alone
    std::uint64_t first_chunk;             // g of chunk 0
    std::int64_t issued_ns;
    std::shared_ptr<pipeline_handle::state> handle;
  };

  chunk_updater& opt;
  copy_engine& engine;
  pipeline_options options;
  std::size_t arena = 0, chunk = 0, chunks = 0, gsz = 0, psz = 0, depth = 0;
  std::vector<pinned_buffer> grad_bufs, param_bufs;
  std::vector<float> accumulator; // arena floats, made on the first accumulate
  int micro_batches = 0;          // pipeline thread only (read by callers when idle)

  device_stream in_stream, out_stream;
  device_event order_event, push_event; // private: a caller's stream turned into a wait; push_params
  device_flag released;
  std::shared_ptr<event_pool> pool;

  mutable std::mutex mu;
  mutable std::condition_variable cv;
  std::deque<operation> queue; // front: the one running
  std::uint64_t next_chunk = 0;
  bool stop = false;
  std::string device_failure;    // sticky: the engine failed
  bool lost_micro_batch = false; // an accumulation failed: the next step must not apply
  pipeline_timeline current, last;
  std::thread worker;

  impl(chunk_updater& o, copy_engine& e, pipeline_options opts)
      : opt(o), engine(e), options(std::move(opts)) {
    if (options.depth < 2 || options.depth > 64)
      throw std::invalid_argument("pipeline_options.depth = " + std::to_string(options.depth) +
                                  ": expected 2 (double buffering) to 64 buffers per direction");
    if (options.chunk_elems == 0)
      throw std::invalid_argument("pipeline_options.chunk_elems = 0: expected > 0");
    dtype_size(options.grad_type); // throws for a value outside the enum
    dtype_size(options.param_type);
    arena = opt.arena_size();
    depth = std::size_t(options.depth);
    // A chunk larger than the arena is the arena (rounded up to the updater's unit): no
    // overflow near SIZE_MAX.
    const std::size_t unit = opt.chunk_unit();
    chunk = (std::min(options.chunk_elems, std::max<std::size_t>(arena, 1)) + unit - 1) / unit * unit;
    chunks = (arena + chunk - 1) / chunk;
    gsz = dtype_size(options.grad_type);
    psz = dtype_size(options.param_type);
    const std::size_t buf_elems = std::min(chunk, std::max<std::size_t>(arena, 1));
    for (std::size_t i = 0; i < depth; ++i) {
      grad_bufs.emplace_back(engine, buf_elems * gsz);
      param_bufs.emplace_back(engine, buf_elems * psz);
    }
    current.spans.reserve(3 * chunks + 8);
    last.spans.reserve(3 * chunks + 8);
    try {
      in_stream = engine.create_stream();
      out_stream = engine.create_stream();
      order_event = engine.create_event();
      push_event = engine.create_event();
      released = engine.allocate_flag();
      pool = std::make_shared<event_pool>(engine, chunks);
      pool->acquire(); // the first set, made now rather than on the first step
    } catch (...) {
      release_device_objects();
      throw;
    }
    worker = std::thread([this] { run(); });
  }

  void release_device_objects() noexcept {
    if (in_stream) engine.destroy_stream(in_stream);
    if (out_stream) engine.destroy_stream(out_stream);
    if (order_event) engine.destroy_event(order_event);
    if (push_event) engine.destroy_event(push_event);
    if (released) engine.free_flag(released);
  }

  ~impl() {
    {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return queue.empty(); }); // drain the operations in flight
      stop = true;
    }
    cv.notify_all();
    worker.join();
    release_device_objects();
  }

  void refuse_if_unusable() { // with mu held
    note_device_failure();
    if (!device_failure.empty()) throw std::logic_error("offload_pipeline is not usable: " + device_failure);
    if (!opt.usable()) throw std::logic_error("offload_pipeline is not usable: " + opt.failure_reason());
  }

  // With mu held: a sticky device error makes the pipeline and the optimizer not usable
  // (the device's copies of the parameters can no longer be trusted), once.
  void note_device_failure() noexcept {
    if (!device_failure.empty()) return;
    try {
      const std::string e = engine.sticky_error();
      if (e.empty()) return;
      device_failure = "device error: " + e;
      opt.mark_unusable("offload pipeline: " + device_failure +
                        (opt.commits_whole_steps()
                             ? " (the updater holds its last completed step: reopen it, and make a new pipeline)"
                             : " (restore a checkpoint, or reset_failure() if the state is known whole)"));
    } catch (...) {
    }
  }

  // The order's waits, enqueued first: a bad handle is refused before any work is queued.
  static void check_order(const device_order& order) {
    if (!order.grads_ready && !order.grads_stream)
      throw std::invalid_argument(
          "device_order: no gradient dependency: pass grads_ready (an event recorded after "
          "the work that wrote the gradients) or grads_stream (the stream that wrote them)");
    if (order.grads_ready && order.grads_stream)
      throw std::invalid_argument("device_order: both grads_ready and grads_stream are set: pass one");
    if (order.params_free && order.params_stream)
      throw std::invalid_argument("device_order: both params_free and params_stream are set: pass one");
  }

  void check_chunk_events(const device_order& order) const {
    if (!order.chunk_grads_ready.empty() && order.chunk_grads_ready.size() != chunks)
      throw std::invalid_argument(
          "device_order.chunk_grads_ready: " + std::to_string(order.chunk_grads_ready.size()) +
          " events: expected none or one per chunk (" + std::to_string(chunks) + ")");
  }

  void wait_on(device_stream copy_stream, device_event ev, device_stream after) {
    if (ev) {
      engine.stream_wait_event(copy_stream, ev);
    } else {
      engine.record_event(order_event, after);
      engine.stream_wait_event(copy_stream, order_event);
    }
  }

  // The order's waits that come first on the copy streams: the parameters' (for a step),
  // and the gradients' unless chunk events defer it to the first chunk without one.
  void enqueue_order(const device_order& order, bool params) {
    if (order.chunk_grads_ready.empty()) wait_on(in_stream, order.grads_ready, order.grads_stream);
    if (!params) return;
    if (order.params_free || order.params_stream)
      wait_on(out_stream, order.params_free, order.params_stream);
    else
      wait_on(out_stream, order.grads_ready, order.grads_stream);
  }

  pipeline_handle submit(operation op, const device_order& order) {
    check_order(order);
    check_chunk_events(order);
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return queue.size() < max_queued; }); // documented: a fifth call waits
    refuse_if_unusable();
    op.handle = std::make_shared<pipeline_handle::state>();
    op.handle->events = pool->acquire();
    op.handle->writes_params = op.kind == op_kind::step;
    op.first_chunk = next_chunk;
    op.issued_ns = now_ns();
    enqueue_order(order, op.kind == op_kind::step); // may throw: nothing else is queued yet
    try {
      enqueue_device_work(op, order);
    } catch (const std::exception& e) { // only a device failure gets here: the device is lost
      note_device_failure();
      if (device_failure.empty()) device_failure = std::string("device error while enqueueing: ") + e.what();
      // Part of this operation's device work is queued: let every flag wait of it go.
      try {
        engine.write_flag(released, std::uint32_t(op.first_chunk + chunks));
      } catch (...) {
      }
      throw std::runtime_error("offload_pipeline: the device failed while the operation was enqueued (" +
                               std::string(e.what()) +
                               "); nothing was updated: the optimizer state is unchanged");
    }
    next_chunk += chunks;
    queue.push_back(op);
    cv.notify_all();
    return pipeline_handle(op.handle);
  }

  std::pair<std::size_t, std::size_t> range(std::size_t k) const {
    return {k * chunk, std::min(arena, (k + 1) * chunk)};
  }

  // Enqueued in the order the device runs it — copy-in of the first `depth` chunks, then
  // for each chunk k its copy-out and the copy-in of k + depth — so that even where both
  // copy streams share one hardware queue (CUDA_DEVICE_MAX_CONNECTIONS=1) every flag wait
  // can be satisfied by work queued before it: a flag-gated copy never blocks work the
  // CPU needs first (CUDA cannot see the dependency through the flag).
  void enqueue_device_work(const operation& op, const device_order& order) {
    const op_events& ev = *op.handle->events;
    bool grads_waited = order.chunk_grads_ready.empty(); // enqueue_order did it
    const auto copy_in = [&](std::size_t k) {
      const std::uint64_t g = op.first_chunk + k;
      const auto [lo, hi] = range(k);
      if (!grads_waited && order.chunk_grads_ready[k]) {
        engine.stream_wait_event(in_stream, order.chunk_grads_ready[k]);
      } else if (!grads_waited) { // this chunk and all after it: the whole gradient dependency
        wait_on(in_stream, order.grads_ready, order.grads_stream);
        grads_waited = true;
      }
      if (g >= depth) engine.stream_wait_flag(in_stream, released, std::uint32_t(g - depth + 1));
      engine.record_event(ev.in_start[k], in_stream);
      engine.copy_async(in_stream, copy_direction::to_host, grad_bufs[g % depth].data(),
                        static_cast<const char*>(op.grads) + lo * gsz, (hi - lo) * gsz);
      engine.record_event(ev.in_end[k], in_stream);
    };
    const auto copy_out = [&](std::size_t k) {
      const std::uint64_t g = op.first_chunk + k;
      const auto [lo, hi] = range(k);
      engine.stream_wait_flag(out_stream, released, std::uint32_t(g + 1));
      engine.record_event(ev.out_start[k], out_stream);
      engine.copy_async(out_stream, copy_direction::to_device, static_cast<char*>(op.params) + lo * psz,
                        param_bufs[g % depth].data(), (hi - lo) * psz);
      engine.record_event(ev.out_end[k], out_stream);
    };
    for (std::size_t k = 0; k < std::min(depth, chunks); ++k) copy_in(k);
    for (std::size_t k = 0; k < chunks; ++k) {
      if (op.kind == op_kind::step) copy_out(k);
      if (k + depth < chunks) copy_in(k + depth);
    }
    engine.record_event(ev.consumed, in_stream);
    if (op.kind == op_kind::step) engine.record_event(ev.ready, out_stream);
  }

  void run() {
    for (;;) {
      operation op;
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return stop || !queue.empty(); });
        if (queue.empty()) return;
        op = queue.front();
      }
      const outcome out = execute(op);
      {
        std::lock_guard<std::mutex> lock(mu);
        std::swap(last, current); // published before the handle finishes
        note_device_failure();
      }
      op.handle->finish(out.result, out.error);
      {
        std::lock_guard<std::mutex> lock(mu);
        queue.pop_front(); // after: a call made next finds the previous handle done
      }
      cv.notify_all();
    }
  }

  void record(std::size_t k, pipeline_stage s, std::int64_t a, std::int64_t b, std::int64_t issued) {
    if (current.spans.size() < current.spans.capacity()) current.spans.push_back({k, s, a, b, issued});
  }

  // Waits for a copy's end event and records its span from the engine's clock.
  void wait_copy(const operation& op, device_event start, device_event end, std::size_t k, pipeline_stage s) {
    engine.synchronize_event(end);
    record(k, s, engine.event_time_ns(start), engine.event_time_ns(end), op.issued_ns);
  }

  struct outcome {
    step_result result{};
    std::exception_ptr error;
  };

  outcome execute(const operation& op) {
    current.spans.clear();
    const outcome out = op.kind == op_kind::step ? execute_step(op) : execute_accumulate(op);
    current.end_ns = now_ns();
    // The operation's wall starts with its first device copy, not at the call: waiting for
    // the gradients' producer or for earlier operations is not the pipeline's time.
    current.start_ns = current.end_ns;
    for (const auto& span : current.spans) current.start_ns = std::min(current.start_ns, span.start_ns);
    return out;
  }

  static outcome failed(const std::string& msg) {
    return {{}, std::make_exception_ptr(std::runtime_error(msg))};
  }

  // Chunk k's turn on the CPU: its gradients are in, its parameter buffer is free; `fill`
  // writes the parameter buffer, then the flag lets both streams go on.
  template <class Fill> void process_chunk(const operation& op, std::size_t k, Fill&& fill) {
    const op_events& ev = *op.handle->events;
    const std::uint64_t g = op.first_chunk + k;
    wait_copy(op, ev.in_start[k], ev.in_end[k], k, pipeline_stage::copy_in);
    if (op.kind == op_kind::step && k >= depth)
      wait_copy(op, ev.out_start[k - depth], ev.out_end[k - depth], k - depth, pipeline_stage::copy_out);
    fill(k, g % depth);
    engine.write_flag(released, std::uint32_t(g + 1));
  }

  // Lets every flag wait of the operation go at once (the data they release is not valid:
  // only for a device that failed, or a fill that could not go on).
  void release_all(const operation& op) noexcept {
    try {
      engine.write_flag(released, std::uint32_t(op.first_chunk + chunks));
    } catch (...) {
    }
  }

  // After a skip or a failure: the remaining chunks [from, chunks) get the unchanged
  // parameters (read while this thread's failed step may still be open), so the device
  // buffer holds the optimizer's parameters, and are released. Returns false when some
  // chunk could not be given valid parameters (the caller's message says push_params).
  // Never leaves a flag wait of the operation blocked, whatever fails.
  bool release_rest(const operation& op, std::size_t from) noexcept {
    bool valid = true;
    try {
      if (!engine.sticky_error().empty()) throw std::runtime_error("device lost");
      for (std::size_t k = from; k < chunks; ++k)
        process_chunk(op, k, [&](std::size_t c, std::size_t slot) {
          if (op.kind != op_kind::step) return;
          const auto [lo, hi] = range(c);
          try {
            opt.read_params(lo, hi, param_bufs[slot].data(), options.param_type);
          } catch (...) { // a poisoned optimizer with no step open: nothing valid to send
            valid = false;
          }
        });
    } catch (...) {
      valid = false;
      release_all(op);
    }
    finish_copies(op, nullptr);
    return valid || op.kind != op_kind::step;
  }

  // Waits for the last parameter copies (their buffers are reused by the next operation).
  void finish_copies(const operation& op, std::optional<std::string>* error) noexcept {
    if (op.kind != op_kind::step) return;
    const op_events& ev = *op.handle->events;
    // In chunk order: after a device fault every later wait fails too, so the first one that
    // fails names the copy that did.
    for (std::size_t c = chunks - std::min(depth, chunks); c < chunks; ++c) {
      try {
        wait_copy(op, ev.out_start[c], ev.out_end[c], c, pipeline_stage::copy_out);
      } catch (const std::exception& e) {
        if (error && !*error) *error = "chunk " + std::to_string(c) + ": " + e.what();
        return;
      }
    }
  }

  outcome execute_step(const operation& op) {
    if (lost_micro_batch) { // never a step on part of its micro-batches
      lost_micro_batch = false;
      micro_batches = 0;
      const bool valid = release_rest(op, 0);
      return failed(
          std::string("offload step not applied: an accumulation before it failed, so its micro-batches "
                      "are incomplete; the optimizer state is unchanged") +
          (valid
               ? ""
               : "; the device parameter buffer was not written with valid parameters: call push_params()"));
    }
    const bool use_acc = micro_batches > 0;
    std::size_t updated = 0, k = 0;
    pipeline_stage stage = pipeline_stage::copy_in;
    std::int64_t before = 0;
    bool begun_step = false;
    try {
      before = opt.step_count();
      const step_result begun =
          opt.begin_step({options.grad_type, true, options.param_type, use_acc, op.checks, op.without_grad});
      if (!begun.applied) { // skipped by the checks: the device still gets (unchanged) parameters
        micro_batches = 0;  // a skipped step drops its accumulated micro-batches too
        const bool valid = release_rest(op, 0);
        if (const std::string e = engine.sticky_error(); !e.empty())
          return failed("offload step: device error: " + e);
        if (!valid)
          return failed("offload step skipped, but the device parameter buffer could not be rewritten");
        return {begun, nullptr};
      }
      begun_step = true;
      for (k = 0; k < chunks; ++k) {
        stage = pipeline_stage::copy_in;
        process_chunk(op, k, [&](std::size_t c, std::size_t slot) {
          const auto [lo, hi] = range(c);
          stage = pipeline_stage::update;
          if (options.before_update) options.before_update(c);
          const std::int64_t t0 = now_ns();
          opt.update_range(lo, hi, grad_bufs[slot].data(), param_bufs[slot].data(),
                           use_acc ? accumulator.data() + lo : nullptr);
          record(c, pipeline_stage::update, t0, now_ns(), t0);
          ++updated;
        });
      }
      stage = pipeline_stage::copy_out;
      std::optional<std::string> copy_out_error;
      finish_copies(op, &copy_out_error);
      if (copy_out_error) throw std::runtime_error(*copy_out_error);
    } catch (const std::exception& e) {
      const std::string device = engine.sticky_error();
      std::string msg = "offload step failed " +
                        (k < chunks ? "at chunk " + std::to_string(k) + " of " + std::to_string(chunks)
                                    : "after updating all " + std::to_string(chunks) + " chunks") +
                        " (stage " + stage_name(stage) + "): " + e.what();
      const bool partly = begun_step && updated > 0 && updated < chunks;
      // An updater that commits whole steps (a store) keeps the step before whole when a step
      // fails midway; the in-RAM optimizer is left half-updated (abort_step poisons it).
      const bool whole = opt.commits_whole_steps();
      if (!begun_step) {
        msg += "; the optimizer state is unchanged";
      } else if (updated == 0) {
        msg += "; no chunk was updated: the optimizer state is unchanged";
      } else if (updated == chunks && device.empty()) {
        msg += "; every chunk was updated: the optimizer state holds step " + std::to_string(before + 1) +
               " but the device parameters may be stale: call push_params()";
      } else if (updated == chunks && whole) {
        msg += "; every chunk was updated and the step commits (step " + std::to_string(before + 1) +
               "), but the device failed: the pipeline refuses from now on and the optimizer is marked not "
               "usable: reopen it (and make a new pipeline) to go on";
      } else if (updated == chunks) {
        msg += "; every chunk was updated: the optimizer state holds step " + std::to_string(before + 1) +
               ", whole, but the device failed: the pipeline refuses from now on and the optimizer is marked "
               "not usable until reset_failure() (then save it with a checkpoint)";
      }
      if (begun_step && updated == chunks) {
        const std::string dropped = dropped_micro_batches(use_acc);
        // The host state is whole at the new step, device error or not: finish it, so that
        // after a GPU failure reset_failure() gives a consistent optimizer to save (the
        // device error marks it not usable, and the pipeline refuses from now on).
        micro_batches = 0;
        step_result r;
        try {
          r = opt.finish_step();
        } catch (const std::exception& f) {
          return failed(msg + "; then finishing the step failed too: " + f.what() + not_finished(before) + dropped);
        }
        if (device.empty()) return {r, std::make_exception_ptr(std::runtime_error(msg))};
        return failed(msg);
      }
      // An updater that still holds the step before, whole (a store: its abort keeps it), never
      // read the accumulator into its state: the micro-batches stay for the retry.
      const bool keep = use_acc && whole && opt.usable();
      const std::string dropped = keep ? kept_micro_batches() : dropped_micro_batches(use_acc);
      // The chunks not updated get their unchanged parameters, read while this thread's
      // step is still open (after abort_step a poisoned optimizer would refuse the read).
      const bool rest_valid = release_rest(op, std::min(k, chunks));
      std::string state;
      if (partly && whole)
        state = "; the optimizer state is unchanged (it holds step " + std::to_string(before) +
                ": the updater commits a step whole or not at all), but the device parameters of chunks [0, " +
                std::to_string(updated) + ") hold the step that was not applied" +
                (device.empty() ? ": call push_params()"
                                : ", and the device failed: the pipeline refuses from now on (reopen the optimizer, "
                                  "and make a new pipeline)");
      else if (partly)
        state = "; chunks [0, " + std::to_string(updated) + ") hold step " + std::to_string(before + 1) +
                " and the rest step " + std::to_string(before) +
                ": the pipeline and the optimizer are not usable until the state is restored (load a checkpoint, "
                "then push_params())";
      if (!rest_valid)
        state += "; the device parameter buffer was not written with valid parameters" +
                 std::string(partly && whole ? " for the other chunks either" : "") +
                 ": call push_params() (after restoring the state if the optimizer is not usable)";
      msg += state + dropped;
      if (begun_step) opt.abort_step(msg); // poisons the in-RAM optimizer when chunks were updated
      if (!keep) micro_batches = 0;
      return failed(msg);
    }
    try {
      const step_result r = opt.finish_step();
      micro_batches = 0;
      return {r, nullptr};
    } catch (const std::exception& e) { // (an updater that commits at the end: a store's write or commit)
      const bool keep = use_acc && opt.commits_whole_steps() && opt.usable() && opt.step_count() == before;
      const std::string told = keep ? kept_micro_batches() : dropped_micro_batches(use_acc);
      if (!keep) micro_batches = 0;
      return failed(std::string("offload step failed finishing (after updating all ") + std::to_string(chunks) +
                    " chunks): " + e.what() + not_finished(before) + told);
    }
  }

  // A step whose finish failed (an updater that commits at the end: a store's write or commit).
  std::string not_finished(std::int64_t before) const {
    if (opt.usable() && opt.step_count() == before)
      return "; the optimizer state is unchanged (it holds step " + std::to_string(before) +
             "), but the device parameters hold the step that was not applied: call push_params()";
    return "; the optimizer is not usable: " + opt.failure_reason() +
           "; the device parameters hold the new step, which it may not hold: call push_params() once it is "
           "usable again";
  }

  // What a failed step says of the micro-batches accumulated for it: dropped with it, as a
  // skipped step's are (a retry applies its own gradients alone).
  std::string dropped_micro_batches(bool used) const {
    if (!used) return "";
    return "; the " + std::to_string(micro_batches) + " micro-batch(es) accumulated for it were dropped with it";
  }

  std::string kept_micro_batches() const {
    return "; the " + std::to_string(micro_batches) +
           " micro-batch(es) accumulated for it are kept: a retry of the step averages them with its gradients";
  }


  outcome execute_accumulate(const operation& op) {
    std::size_t k = 0;
    pipeline_stage stage = pipeline_stage::copy_in;
    try {
      if (accumulator.size() != arena) accumulator.assign(arena, 0.0f); // once, on first use
      for (k = 0; k < chunks; ++k) {
        stage = pipeline_stage::copy_in;
        process_chunk(op, k, [&](std::size_t c, std::size_t slot) {
          const auto [lo, hi] = range(c);
          stage = pipeline_stage::accumulate;
          if (options.before_update) options.before_update(c);
          const std::int64_t t0 = now_ns();
          opt.accumulate_range(lo, hi, accumulator.data() + lo, grad_bufs[slot].data(), options.grad_type,
                               micro_batches == 0);
          record(c, pipeline_stage::accumulate, t0, now_ns(), t0);
        });
      }
    } catch (const std::exception& e) {
      release_rest(op, std::min(k, chunks)); // chunk k was not released
      const int lost = micro_batches;
      micro_batches = 0;
      lost_micro_batch = true; // the step these micro-batches belong to must not apply
      return failed("offload accumulation failed at chunk " + std::to_string(k) + " (stage " +
                    stage_name(stage) + "): " + e.what() + "; the accumulator was reset, discarding " +
                    std::to_string(lost) +
                    " earlier micro-batch(es); the optimizer state is unchanged, and the next step will fail "
                    "instead of applying without them");
    }
    ++micro_batches;
    step_result r;
    r.step = opt.step_count();
    return {r, nullptr};
  }
};

offload_pipeline::offload_pipeline(chunk_updater& updater, copy_engine& engine, pipeline_options options)
    : impl_(std::make_unique<impl>(updater, engine, std::move(options))) {}

offload_pipeline::~offload_pipeline() = default;

pipeline_handle offload_pipeline::step_async(const_view device_grads, mut_view device_params,
                                             const device_order& order, float grad_scale) {
  step_options unchecked;
  unchecked.grad_scale = grad_scale;
  unchecked.skip_nonfinite = false;
  return step_async(device_grads, device_params, order, unchecked);
}

pipeline_handle offload_pipeline::step_async(const_view device_grads, mut_view device_params,
                                             const device_order& order, const step_options& options,
                                             std::vector<std::size_t> tensors_without_grad) {
  impl& s = *impl_;
  check_device_view("device_grads", device_grads.data, device_grads.size, device_grads.type, s.arena,
                    s.options.grad_type);
  check_device_view("device_params", device_params.data, device_params.size, device_params.type, s.arena,
                    s.options.param_type);
  {
    // An unusable pipeline refuses as documented (std::logic_error) before the optimizer's
    // own option check would report its unusable state its own way.
    std::lock_guard<std::mutex> lock(s.mu);
    s.refuse_if_unusable();
  }
  // Bad options are refused here, on the caller's thread, before anything is enqueued.
  s.opt.check_options(
      {s.options.grad_type, true, s.options.param_type, false, options, tensors_without_grad});
  return s.submit({impl::op_kind::step, device_grads.data, device_params.data, options,
                   std::move(tensors_without_grad), 0, 0, nullptr},
                  order);
}

pipeline_handle offload_pipeline::accumulate_async(const_view device_grads, const device_order& order) {
  impl& s = *impl_;
  check_device_view("device_grads", device_grads.data, device_grads.size, device_grads.type, s.arena,
                    s.options.grad_type);
  return s.submit({impl::op_kind::accumulate, device_grads.data, nullptr, step_options{}, {}, 0, 0, nullptr},
                  order);
}

step_result offload_pipeline::step(const_view device_grads, mut_view device_params, const device_order& order,
                                   float grad_scale) {
  return step_async(device_grads, device_params, order, grad_scale).wait();
}

void offload_pipeline::push_params(mut_view device_params) {
  impl& s = *impl_;
  check_device_view("device_params", device_params.data, device_params.size, device_params.type, s.arena,
                    s.options.param_type);
  std::unique_lock<std::mutex> lock(s.mu);
  s.cv.wait(lock, [&] { return s.queue.empty(); });
  s.refuse_if_unusable();
  try {
    for (std::size_t k = 0; k < s.chunks; ++k) {
      const auto [lo, hi] = s.range(k);
      void* buf = s.param_bufs[0].data();
      s.opt.read_params(lo, hi, buf, s.options.param_type);
      s.engine.copy_async(s.out_stream, copy_direction::to_device,
                          static_cast<char*>(device_params.data) + lo * s.psz, buf, (hi - lo) * s.psz);
      s.engine.record_event(s.push_event, s.out_stream);
      s.engine.synchronize_event(s.push_event); // the buffer is reused by the next chunk
    }
  } catch (...) {
    s.note_device_failure();
    throw;
  }
}

device_stream offload_pipeline::copy_in_stream() const { return impl_->in_stream; }

device_stream offload_pipeline::copy_out_stream() const { return impl_->out_stream; }

int offload_pipeline::accumulated_micro_batches() const {
  std::unique_lock<std::mutex> lock(impl_->mu);
  impl_->cv.wait(lock, [&] { return impl_->queue.empty(); });
  return impl_->micro_batches;
}

bool offload_pipeline::usable() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->note_device_failure();
  return impl_->device_failure.empty() && impl_->opt.usable();
}

std::string offload_pipeline::failure_reason() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->note_device_failure();
  return impl_->device_failure.empty() ? impl_->opt.failure_reason() : impl_->device_failure;
}

std::size_t offload_pipeline::num_chunks() const { return impl_->chunks; }

std::size_t offload_pipeline::chunk_elems() const { return impl_->chunk; }

std::size_t offload_pipeline::pinned_bytes() const {
  std::size_t bytes = 0;
  for (const auto& b : impl_->grad_bufs) bytes += b.size();
  for (const auto& b : impl_->param_bufs) bytes += b.size();
  return bytes;
}

pipeline_timeline offload_pipeline::last_timeline() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->last;
}

} // namespace hostopt
