// The offload pipeline. One pipeline thread runs each operation as a schedule over the
// chunks of the arena, with `depth` pinned buffers per direction used as rings:
//
//   issue copy-in of chunks 0 .. depth-1
//   for k: wait copy-in(k); wait copy-out(k - depth) (its parameter buffer is reused);
//          update(k) on the CPU into parameter buffer k % depth; issue copy-out(k);
//          issue copy-in(k + depth) into gradient buffer k % depth (update(k) released it)
//
// so copy-in of k+1, update of k and copy-out of k-1 run at the same time. A buffer is
// reused only after the ticket of its last use completed. The pipeline knows nothing of
// Adam: it drives a chunk_updater (begin_step / update_range / finish_step), which decides
// checks, clipping and skips, and counts steps.
#include "hostopt/offload_pipeline.hpp"
#include "steady_clock.hpp"

#include <algorithm>
#include <cmath>
#include <chrono>
#include <condition_variable>
#include <cstdio>
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
    throw std::invalid_argument(std::string(what) + ".data is null for " + std::to_string(size) + " elements");
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

// --- the handle --------------------------------------------------------------------------

struct pipeline_handle::state {
  mutable std::mutex mu;
  mutable std::condition_variable cv;
  bool finished = false;
  step_result result{};
  std::exception_ptr error;
  void* event = nullptr;

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

void* pipeline_handle::device_event() const {
  if (!state_) return nullptr;
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->event;
}

// --- the pipeline ------------------------------------------------------------------------

struct offload_pipeline::impl {
  enum class op_kind { step, accumulate };
  struct operation {
    op_kind kind;
    const void* grads;
    void* params;
    step_options checks;
    void* ready_event;
    std::shared_ptr<pipeline_handle::state> handle;
  };

  chunk_updater& opt;
  copy_engine& engine;
  pipeline_options options;
  std::size_t arena = 0, chunk = 0, chunks = 0, gsz = 0, psz = 0;
  std::vector<pinned_buffer> grad_bufs, param_bufs;
  std::vector<float> accumulator; // arena floats, made on the first accumulate
  int micro_batches = 0;

  // Ring bookkeeping, sized once.
  std::vector<copy_ticket> in_tickets, out_tickets;
  std::vector<std::size_t> out_chunk; // which chunk each parameter buffer last held
  std::vector<std::int64_t> in_issued, out_issued; // when each slot's copy was issued

  mutable std::mutex mu;
  std::condition_variable cv;
  std::optional<operation> pending;
  bool busy = false, stop = false;
  pipeline_timeline current, last;
  std::thread worker;

  impl(chunk_updater& o, copy_engine& e, pipeline_options opts) : opt(o), engine(e), options(std::move(opts)) {
    if (options.depth < 2 || options.depth > 64)
      throw std::invalid_argument("pipeline_options.depth = " + std::to_string(options.depth) +
                                  ": expected 2 (double buffering) to 64 buffers per direction");
    if (options.chunk_elems == 0) throw std::invalid_argument("pipeline_options.chunk_elems = 0: expected > 0");
    dtype_size(options.grad_type); // throws for a value outside the enum
    dtype_size(options.param_type);
    arena = opt.arena_size();
    // A chunk larger than the arena is the arena (rounded up to 16): no overflow near SIZE_MAX.
    chunk = (std::min(options.chunk_elems, std::max<std::size_t>(arena, 1)) + 15) / 16 * 16;
    chunks = (arena + chunk - 1) / chunk;
    gsz = dtype_size(options.grad_type);
    psz = dtype_size(options.param_type);
    const std::size_t buf_elems = std::min(chunk, std::max<std::size_t>(arena, 1));
    for (int i = 0; i < options.depth; ++i) {
      grad_bufs.emplace_back(engine, buf_elems * gsz);
      param_bufs.emplace_back(engine, buf_elems * psz);
    }
    in_tickets.resize(std::size_t(options.depth));
    out_tickets.resize(std::size_t(options.depth));
    out_chunk.resize(std::size_t(options.depth));
    in_issued.resize(std::size_t(options.depth));
    out_issued.resize(std::size_t(options.depth));
    current.spans.reserve(3 * chunks + 8);
    last.spans.reserve(3 * chunks + 8);
    worker = std::thread([this] { run(); });
  }

  ~impl() {
    {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return !busy; }); // drain the operation in flight
      stop = true;
    }
    cv.notify_all();
    worker.join();
  }

  pipeline_handle submit(operation op) {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return !busy; }); // documented: one operation at a time
    refuse_if_unusable();
    op.handle = std::make_shared<pipeline_handle::state>();
    pending = op;
    busy = true;
    cv.notify_all();
    return pipeline_handle(op.handle);
  }

  // A failed step poisons the optimizer (optimizer::abort_step): the pipeline refuses
  // to run on it until it is restored.
  void refuse_if_unusable() const {
    if (!opt.usable()) throw std::logic_error("offload_pipeline is not usable: " + opt.failure_reason());
  }

  void run() {
    for (;;) {
      operation op;
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return stop || pending.has_value(); });
        if (!pending) return;
        op = *pending;
        pending.reset();
      }
      const outcome out = execute(op);
      {
        std::lock_guard<std::mutex> lock(mu);
        std::swap(last, current); // published before the handle finishes
      }
      op.handle->finish(out.result, out.error);
      {
        std::lock_guard<std::mutex> lock(mu);
        busy = false; // after: an operation submitted next finds the previous handle done
      }
      cv.notify_all();
    }
  }

  std::pair<std::size_t, std::size_t> range(std::size_t k) const { return {k * chunk, std::min(arena, (k + 1) * chunk)}; }

  void record(std::size_t k, pipeline_stage s, std::int64_t a, std::int64_t b, std::int64_t issued) {
    if (current.spans.size() < current.spans.capacity()) current.spans.push_back({k, s, a, b, issued});
  }

  void issue_copy_in(const operation& op, std::size_t k) {
    const auto [lo, hi] = range(k);
    const std::size_t slot = k % std::size_t(options.depth);
    in_issued[slot] = now_ns();
    in_tickets[slot] = engine.copy_async(copy_direction::to_host, grad_bufs[slot].data(),
                                         static_cast<const char*>(op.grads) + lo * gsz, (hi - lo) * gsz);
  }

  // Fills the gradient ring: copy-in of the first `depth` chunks, after the gradients are ready.
  void start_copy_in(const operation& op) {
    if (op.ready_event) engine.wait_device_event(copy_direction::to_host, op.ready_event);
    for (std::size_t i = 0; i < std::min(std::size_t(options.depth), chunks); ++i) issue_copy_in(op, i);
  }

  void wait_copy(const copy_ticket& t, std::size_t k, pipeline_stage s, std::int64_t issued) {
    engine.wait(t);
    const copy_timing tm = engine.timing(t);
    record(k, s, tm.start_ns, tm.end_ns, issued);
  }

  // Waits for every copy still in flight, ignoring their errors (after a failure, before
  // the buffers can be reused).
  void drain() noexcept {
    for (const auto* tickets : {&in_tickets, &out_tickets})
      for (const auto& t : *tickets)
        if (t.sequence) try {
            engine.wait(t);
          } catch (...) {
          }
  }

  struct outcome {
    step_result result{};
    std::exception_ptr error;
  };

  outcome execute(const operation& op) {
    current.spans.clear();
    current.start_ns = now_ns();
    std::fill(in_tickets.begin(), in_tickets.end(), copy_ticket{});
    std::fill(out_tickets.begin(), out_tickets.end(), copy_ticket{});
    const outcome out = op.kind == op_kind::step ? execute_step(op) : execute_accumulate(op);
    current.end_ns = now_ns();
    return out;
  }

  static outcome failed(const std::string& msg) { return {{}, std::make_exception_ptr(std::runtime_error(msg))}; }

  outcome execute_step(const operation& op) {
    const auto depth = std::size_t(options.depth);
    const bool use_acc = micro_batches > 0;
    std::size_t updated = 0, k = 0;
    pipeline_stage stage = pipeline_stage::copy_in;
    std::optional<std::string> copy_out_error;
    std::int64_t before = 0;
    try {
      before = opt.step_count();
      const step_result begun = opt.begin_step({options.grad_type, true, options.param_type, use_acc, op.checks});
      if (!begun.applied) { // skipped by the checks before anything moved
        micro_batches = 0;  // a skipped step drops its accumulated micro-batches too
        return {begun, nullptr};
      }
      start_copy_in(op);
      for (k = 0; k < chunks; ++k) {
        const std::size_t slot = k % depth;
        const auto [lo, hi] = range(k);
        stage = pipeline_stage::copy_in;
        wait_copy(in_tickets[slot], k, stage, in_issued[slot]);
        if (out_tickets[slot].sequence) { // the parameter buffer's previous chunk
          try {
            wait_copy(out_tickets[slot], out_chunk[slot], pipeline_stage::copy_out, out_issued[slot]);
          } catch (const std::exception& e) {
            if (!copy_out_error) copy_out_error = "chunk " + std::to_string(out_chunk[slot]) + ": " + e.what();
          }
        }
        stage = pipeline_stage::update;
        if (options.before_update) options.before_update(k);
        const std::int64_t t0 = now_ns();
        opt.update_range(lo, hi, grad_bufs[slot].data(), param_bufs[slot].data(),
                         use_acc ? accumulator.data() + lo : nullptr);
        record(k, stage, t0, now_ns(), t0);
        ++updated;
        stage = pipeline_stage::copy_out;
        out_issued[slot] = now_ns();
        out_tickets[slot] = engine.copy_async(copy_direction::to_device, static_cast<char*>(op.params) + lo * psz,
                                              param_bufs[slot].data(), (hi - lo) * psz);
        out_chunk[slot] = k;
        if (k + depth < chunks) {
          stage = pipeline_stage::copy_in;
          issue_copy_in(op, k + depth);
        }
      }
      if (void* ev = engine.record_device_event(copy_direction::to_device)) {
        std::lock_guard<std::mutex> lock(op.handle->mu);
        op.handle->event = ev;
      }
      for (std::size_t i = 0; i < std::min(depth, chunks); ++i) {
        const std::size_t c = chunks - 1 - i;
        try {
          wait_copy(out_tickets[c % depth], c, pipeline_stage::copy_out, out_issued[c % depth]);
        } catch (const std::exception& e) {
          if (!copy_out_error) copy_out_error = "chunk " + std::to_string(c) + ": " + e.what();
        }
      }
    } catch (const std::exception& e) {
      drain();
      std::string msg = "offload step failed at chunk " + std::to_string(k) + " of " + std::to_string(chunks) +
                        " (stage " + stage_name(stage) + "): " + e.what();
      if (updated == 0) {
        msg += "; no chunk was updated: the optimizer state is unchanged";
      } else {
        msg += "; chunks [0, " + std::to_string(updated) + ") hold step " + std::to_string(before + 1) +
               " and the rest step " + std::to_string(before) +
               ": the pipeline and the optimizer are not usable until the state is restored (load a checkpoint)";
      }
      opt.abort_step(msg); // poisons the optimizer when chunks were updated
      return failed(msg);
    }
    const step_result r = opt.finish_step();
    micro_batches = 0;
    if (copy_out_error)
      return {r, std::make_exception_ptr(std::runtime_error(
                     "offload step " + std::to_string(r.step) + ": copying parameters to the device failed (" +
                     *copy_out_error + "); the optimizer state holds the new step, but device parameters "
                     "may be stale: call push_params()"))};
    return {r, nullptr};
  }

  outcome execute_accumulate(const operation& op) {
    const auto depth = std::size_t(options.depth);
    std::size_t k = 0;
    pipeline_stage stage = pipeline_stage::copy_in;
    try {
      if (accumulator.size() != arena) accumulator.assign(arena, 0.0f); // once, on first use
      start_copy_in(op);
      for (k = 0; k < chunks; ++k) {
        const std::size_t slot = k % depth;
        const auto [lo, hi] = range(k);
        stage = pipeline_stage::copy_in;
        wait_copy(in_tickets[slot], k, stage, in_issued[slot]);
        stage = pipeline_stage::accumulate;
        const std::int64_t t0 = now_ns();
        opt.accumulate_range(lo, hi, accumulator.data() + lo, grad_bufs[slot].data(), options.grad_type,
                             micro_batches == 0);
        record(k, stage, t0, now_ns(), t0);
        if (k + depth < chunks) {
          stage = pipeline_stage::copy_in;
          issue_copy_in(op, k + depth);
        }
      }
    } catch (const std::exception& e) {
      drain();
      const int lost = micro_batches;
      micro_batches = 0;
      return failed("offload accumulation failed at chunk " + std::to_string(k) + " (stage " + stage_name(stage) +
                    "): " + e.what() + "; the accumulator was reset, discarding " + std::to_string(lost) +
                    " earlier micro-batch(es); the optimizer state is unchanged");
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

pipeline_handle offload_pipeline::step_async(const_view device_grads, mut_view device_params, float grad_scale,
                                             void* grads_ready_event) {
  step_options unchecked;
  unchecked.grad_scale = grad_scale;
  unchecked.skip_nonfinite = false;
  return step_async(device_grads, device_params, unchecked, grads_ready_event);
}

pipeline_handle offload_pipeline::step_async(const_view device_grads, mut_view device_params,
                                             const step_options& options, void* grads_ready_event) {
  impl& s = *impl_;
  check_device_view("device_grads", device_grads.data, device_grads.size, device_grads.type, s.arena,
                    s.options.grad_type);
  check_device_view("device_params", device_params.data, device_params.size, device_params.type, s.arena,
                    s.options.param_type);
  // Bad options are refused here, on the caller's thread, before anything moves.
  s.opt.check_options({s.options.grad_type, true, s.options.param_type, false, options});
  return s.submit({impl::op_kind::step, device_grads.data, device_params.data, options, grads_ready_event, nullptr});
}

pipeline_handle offload_pipeline::accumulate_async(const_view device_grads, void* grads_ready_event) {
  impl& s = *impl_;
  check_device_view("device_grads", device_grads.data, device_grads.size, device_grads.type, s.arena,
                    s.options.grad_type);
  return s.submit({impl::op_kind::accumulate, device_grads.data, nullptr, step_options{}, grads_ready_event, nullptr});
}

step_result offload_pipeline::step(const_view device_grads, mut_view device_params, float grad_scale) {
  return step_async(device_grads, device_params, grad_scale).wait();
}

void offload_pipeline::push_params(mut_view device_params) {
  impl& s = *impl_;
  check_device_view("device_params", device_params.data, device_params.size, device_params.type, s.arena,
                    s.options.param_type);
  std::unique_lock<std::mutex> lock(s.mu);
  s.cv.wait(lock, [&] { return !s.busy; });
  s.refuse_if_unusable();
  for (std::size_t k = 0; k < s.chunks; ++k) {
    const auto [lo, hi] = s.range(k);
    void* buf = s.param_bufs[0].data();
    s.opt.read_params(lo, hi, buf, s.options.param_type);
    s.engine.wait(s.engine.copy_async(copy_direction::to_device, static_cast<char*>(device_params.data) + lo * s.psz,
                                      buf, (hi - lo) * s.psz));
  }
}

int offload_pipeline::accumulated_micro_batches() const {
  std::unique_lock<std::mutex> lock(impl_->mu);
  impl_->cv.wait(lock, [&] { return !impl_->busy; });
  return impl_->micro_batches;
}

bool offload_pipeline::usable() const { return impl_->opt.usable(); }

std::string offload_pipeline::failure_reason() const { return impl_->opt.failure_reason(); }

std::size_t offload_pipeline::num_chunks() const { return impl_->chunks; }

pipeline_timeline offload_pipeline::last_timeline() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->last;
}

} // namespace hostopt
