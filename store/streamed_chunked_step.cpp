// A stored optimizer's chunked steps (chunk_updater): what an offload pipeline drives. The
// ranges arrive in order; the store's own chunks stream around them as a whole step streams
// them — read ahead from begin_step on, each updated by the ranges that cover it (a range may
// start or end inside a chunk, or cover several), written back once the ranges have passed
// it — and finish_step commits. Until then the drive holds the last step, so a chunked step
// that fails or is aborted changes nothing there: the store stays usable, at that step.
#include "stored_optimizer_impl.hpp"

namespace hostopt {


std::size_t stored_optimizer::chunk_unit() const { return impl_->whole.unit(); }

void stored_optimizer::check_options(const chunk_step_options& o) const {
  impl_->check_chunk_options(o);
  decide_step(o.checks, 0.0); // names a bad option
  if (needs_unknown_norm(o.checks)) refuse_unknown_norm("begin_step");
  const auto lock = impl_->turns.acquire("begin_step", false);
  impl_->check_usable("begin_step");
  if (impl_->count >= max_step_count)
    throw std::invalid_argument("begin_step: the step count is at its limit (" + std::to_string(max_step_count) +
                                ", hostopt::max_step_count)");
}

step_result stored_optimizer::begin_step(const chunk_step_options& o) {
  impl& s = *impl_;
  auto lock = s.turns.acquire("begin_step", false);
  s.turns.let_waiters_go_first(lock);
  s.check_usable("begin_step");
  s.check_chunk_options(o);
  // The gradients arrive later: a norm the checks need must be known already.
  const step_io io{o.grad_type, out_of(o.copy_out, o.out_type), o.accumulator, false};
  const step_plan pl = s.plan(io, o.checks, []() -> double { refuse_unknown_norm("begin_step"); });
  if (!pl.decision().apply) { // counted now, committed with the next applied step (as step's skips)
    step_plan::check_count(s.skipped);
    ++s.skipped;
    return make_step_result(pl.decision(), s.count, s.skipped);
  }
  s.chunked.open(o, pl.decision());
  s.chunked_at = 0;
  s.chunked_entered = false;
  s.chunked_failed.clear();
  s.chunked_add_grad = o.accumulator ? s.kernels->add_grad(o.grad_type) : nullptr;
  s.mark_without_grad(o.tensors_without_grad);
  try {
    s.chunked_stream = s.stream_open(true, true);
  } catch (...) {
    s.drain();
    s.reset_pieces();
    throw;
  }
  s.turns.open_chunked();
  return make_step_result(pl.decision(), s.count, s.skipped);
}

void stored_optimizer::update_range(std::size_t begin, std::size_t end, const void* grad, void* out,
                                    const float* accumulator) {
  impl& s = *impl_;
  const auto lock = s.turns.acquire_chunked("update_range");
  if (!s.chunked_failed.empty())
    throw std::logic_error("update_range: this chunked step failed (" + s.chunked_failed +
                           "): abort_step(); the store holds the step before it");
  const chunk_step_options& o = s.chunked.options;
  s.chunked.check_next(begin, end, s.end(), s.whole.unit() == q8_block, grad, out, accumulator);
  if (begin == end) return;
  const std::size_t n = end - begin, gb = dtype_size(o.grad_type), ob = o.copy_out ? dtype_size(o.out_type) : 0;
  std::vector<byte_range> ranges{range_of(grad, n * gb, false, 0, 0)};
  if (out) ranges.push_back(range_of(out, n * ob, true, 1, 0));
  if (accumulator) ranges.push_back(range_of(accumulator, n * sizeof(float), false, 0, 1));
  const char* const kinds[] = {"grad", "out"};
  check_no_overlap(ranges, kinds);
  ++s.chunked.updates;
  try {
    for (std::size_t at = begin; at < end;) {
      const std::size_t k = s.chunked_at;
      if (!s.chunked_entered) {
        s.stream_enter(s.chunked_stream, k);
        s.chunked_entered = true;
        s.adopt_pending(s.chunks[k]);
      }
      const impl::chunk& c = s.chunks[k];
      const std::size_t c_begin = s.flat_at(c), c_end = c_begin + c.range.size(), hi = std::min(end, c_end);
      const std::size_t d = at - begin; // (the caller's buffers start at element `begin`)
      const block_counts b = s.update_part(
          c, at - c_begin, hi - c_begin, static_cast<const char*>(grad) + d * gb, gb,
          out ? static_cast<char*>(out) + d * ob : nullptr, o.out_type, accumulator ? accumulator + d : nullptr,
          s.chunked_add_grad);
      s.chunked.seen.poisoned += b.poisoned;
      s.chunked.seen.saturated += b.saturated;
      at = hi;
      if (hi == c_end) { // the chunk is done: written back, and the next one read ahead
        s.chunked_entered = false;
        ++s.chunked_at;
        s.stream_leave(s.chunked_stream, k);
      }
    }
    s.chunked.covered = end;
  } catch (const std::exception& e) {
    s.chunked_failed = e.what();
    s.drain();
    throw;
  }
}

step_result stored_optimizer::finish_step() {
  impl& s = *impl_;
  const auto lock = s.turns.acquire_chunked("finish_step");
  if (!s.chunked_failed.empty())
    throw std::logic_error("finish_step: this chunked step failed (" + s.chunked_failed +
                           "): abort_step(); the store holds the step before it");
  s.chunked.check_complete(s.end());
  // From here on the step closes whatever happens: committed, or (a failed write or commit)
  // not applied, the store at the step before (or, a commit record failed, unusable).
  struct closer {
    impl& s;
    ~closer() { s.close_chunked(); }
  } close_anyway{s};
  try {
    for (; s.chunked_at < s.chunks.size(); ++s.chunked_at) { // empty chunks (an empty arena) the ranges never entered
      if (!s.chunked_entered) {
        s.stream_enter(s.chunked_stream, s.chunked_at);
        s.adopt_pending(s.chunks[s.chunked_at]);
      }
      s.chunked_entered = false;
      s.stream_leave(s.chunked_stream, s.chunked_at);
    }
    s.stream_close(s.chunked_stream);
  } catch (...) {
    s.drain();
    throw;
  }
  s.commit_step(s.chunked.options.tensors_without_grad);
  return make_step_result(s.chunked.decision, s.count, s.skipped, s.chunked.seen);
}

void stored_optimizer::abort_step(const std::string&) noexcept {
  impl& s = *impl_;
  const auto lock = s.turns.lock_only();
  if (!s.turns.own_chunked_open()) return;
  s.drain(); // the chunks written so far are forgotten: the drive holds the step before
  s.close_chunked();
}

void stored_optimizer::mark_unusable(const std::string& reason) noexcept {
  impl& s = *impl_;
  const auto lock = s.turns.lock_only();
  if (s.turns.own_chunked_open()) {
    s.drain();
    s.close_chunked();
  }
  if (!s.broken.empty()) return; // the first reason stays
  try {
    s.broken = reason;
  } catch (...) {
    s.broken.assign(1, '!');
  }
}

bool stored_optimizer::usable() const {
  const auto lock = impl_->turns.lock_only();
  return !impl_->closed && impl_->broken.empty();
}

std::string stored_optimizer::failure_reason() const {
  const auto lock = impl_->turns.lock_only();
  return impl_->closed ? std::string("this stored optimizer is closed") : impl_->broken;
}

void stored_optimizer::accumulate_range(std::size_t begin, std::size_t end, float* acc, const void* grad,
                                        dtype grad_type, bool first) {
  if (begin > end || end > impl_->end())
    throw std::invalid_argument("accumulate_range: [" + std::to_string(begin) + ", " + std::to_string(end) +
                                "): expected a range inside [0, " + std::to_string(impl_->end()) + ")");
  accumulate_gradient(acc, {grad, end - begin, grad_type}, first, impl_->exec);
}

void stored_optimizer::read_params(std::size_t begin, std::size_t end, void* out, dtype type) const {
  impl& s = *impl_;
  const auto lock = s.turns.acquire("read_params", false, true); // this thread's open chunked step may read
  s.check_usable("read_params");
  if (begin > end || end > s.end())
    throw std::invalid_argument("read_params: [" + std::to_string(begin) + ", " + std::to_string(end) +
                                "): expected a range inside [0, " + std::to_string(s.end()) + ")");
  check_dtype("read_params type", type);
  if (begin == end) return;
  const std::size_t ob = dtype_size(type);
  std::memset(out, 0, (end - begin) * ob); // the padding between tensors
  if (!s.read_buffer) s.read_buffer.emplace(s.stores[0]->make_staging());
  const std::vector<moment_format> formats = formats_of(s.groups);
  for (std::size_t k = begin / s.chunk_elements; k < s.chunks.size() && s.flat_at(s.chunks[k]) < end; ++k) {
    const impl::chunk& c = s.chunks[k];
    if (s.read_chunk != k || s.read_commit != s.commit_id) {
      s.read_chunk = ~std::size_t(0);
      s.store_of(k).read_committed(k / s.stripes(), *s.read_buffer);
      s.read_chunk = k;
      s.read_commit = s.commit_id;
    }
    state_storage committed(formats, c.layout, state_storage::external_memory{});
    committed.bind(s.read_buffer->payload());
    for (const update_piece& piece : c.pieces) {
      const std::size_t p_begin = s.flat_at(c) + piece.offset;
      const std::size_t lo = std::max(begin, p_begin), hi = std::min(end, p_begin + piece.size);
      if (lo < hi)
        convert_params(committed.params() + piece.offset + (lo - p_begin),
                       {static_cast<char*>(out) + (lo - begin) * ob, hi - lo, type}, s.exec);
    }
  }
}

} // namespace hostopt
