// The optimizer state on a drive: creating, opening and going back to a store, whole steps and
// exports (the chunked steps are in streamed_chunked_step.cpp; the shared state, with its
// streaming through the staging buffers, in stored_optimizer_impl.hpp).
#include <filesystem>
#include <random>

#include "checkpoint_io.hpp"
#include "hostopt/gradient_checks.hpp"
#include "kernel_registry.hpp"
#include "stored_optimizer_impl.hpp"

namespace hostopt {

using namespace detail;
using namespace store_detail;

namespace {

void check_store_options(const state_store_options& o) {
  if (o.dirs.empty())
    throw std::invalid_argument("state_store_options.dirs is empty: name a directory on a local drive (several: one "
                                "per drive, striped)");
  for (std::size_t i = 0; i < o.dirs.size(); ++i) {
    if (o.dirs[i].empty()) throw std::invalid_argument("state_store_options.dirs[" + std::to_string(i) + "] is empty");
    for (std::size_t j = 0; j < i; ++j)
      if (std::filesystem::weakly_canonical(o.dirs[i]) == std::filesystem::weakly_canonical(o.dirs[j]))
        throw std::invalid_argument("state_store_options.dirs[" + std::to_string(j) + "] and [" + std::to_string(i) +
                                    "] are the same directory, " + o.dirs[i]);
  }
  if (o.buffers < 3)
    throw std::invalid_argument("state_store_options.buffers = " + std::to_string(o.buffers) +
                                ": expected at least 3 (one read ahead, one updated, one written back)");
  if (o.buffers > 1024)
    throw std::invalid_argument("state_store_options.buffers = " + std::to_string(o.buffers) + ": at most 1024");
  drive::parse_io_backend(o.io, "state_store_options.io");
}


} // namespace

stored_optimizer::stored_optimizer(std::unique_ptr<impl> s) : impl_(std::move(s)) {}
stored_optimizer::stored_optimizer(stored_optimizer&&) noexcept = default;
stored_optimizer& stored_optimizer::operator=(stored_optimizer&&) noexcept = default;
stored_optimizer::~stored_optimizer() = default;

stored_optimizer stored_optimizer::create(std::vector<param_group> groups, const state_store_options& options,
                                          execution_options exec, const_view initial_params) {
  check_store_options(options);
  auto s = std::make_unique<impl>(std::move(groups), std::move(exec), options.range);
  const bool has_params = initial_params.data != nullptr || initial_params.size != 0;
  if (has_params) {
    check_view("initial_params", initial_params.data, initial_params.size, initial_params.type, s->end());
    if (initial_params.type != dtype::f32)
      throw std::invalid_argument("initial_params: expected f32 (the master parameters), got " +
                                  std::string(dtype_name(initial_params.type)));
  }
  s->choose_chunks(options);
  s->create_stores(options);
  const float* p = static_cast<const float*>(initial_params.data);
  s->stream(false, true, [&](std::size_t, impl::chunk& c) {
    if (!has_params) return;
    for (const update_piece& piece : c.pieces)
      if (piece.size)
        std::memcpy(c.storage.params() + piece.offset, p + s->flat_at(c) + piece.offset,
                    piece.size * sizeof(float));
  });
  s->commit();
  return stored_optimizer(std::move(s));
}

stored_optimizer stored_optimizer::create(const optimizer& ram, std::vector<param_group> groups,
                                          const state_store_options& options) {
  check_store_options(options);
  auto s = std::make_unique<impl>(std::move(groups), ram.execution(), options.range);
  const exclusive_state es(ram, "stored_optimizer::create");
  s->check_same_state(es, "stored_optimizer::create");
  s->configs = es.configs();
  s->seeds = es.seeds();
  s->count = es.step_count();
  s->skipped = es.skipped_steps();
  if (const auto lags = es.tensor_lags(); !lags.empty()) s->lag = lags; // (held whole: check_same_state)
  s->choose_chunks(options);
  s->create_stores(options);
  s->stream(false, true, [&](std::size_t, impl::chunk& c) {
    for (const update_piece& piece : c.pieces) s->copy_piece(c, piece, es, false);
  });
  s->commit();
  return stored_optimizer(std::move(s));
}

stored_optimizer stored_optimizer::open(std::vector<param_group> groups, const state_store_options& options,
                                        execution_options exec) {
  return open_store(std::move(groups), options, std::move(exec), false);
}

stored_optimizer stored_optimizer::open_previous(std::vector<param_group> groups, const state_store_options& options,
                                                 execution_options exec) {
  return open_store(std::move(groups), options, std::move(exec), true);
}

stored_optimizer stored_optimizer::open_store(std::vector<param_group> groups, const state_store_options& options,
                                              execution_options exec, bool previous) {
  check_store_options(options);
  auto s = std::make_unique<impl>(std::move(groups), std::move(exec), options.range);
  // Every stripe's last commit: one model, one chunking, one count of stripes, each in its place.
  const std::size_t n = options.dirs.size();
  std::vector<drive::chunk_store::head> heads;
  std::vector<std::string> uncommitted; // stripes without a commit (an interrupted striped creation?)
  for (const std::string& dir : options.dirs) try {
      (void)drive::chunk_store::peek(dir);
    } catch (const std::runtime_error&) {
      uncommitted.push_back(dir);
    }
  if (!uncommitted.empty() && uncommitted.size() < n)
    throw std::runtime_error("the striped store's stripe in " + uncommitted[0] + " holds no committed step while "
                             "others do: its creation was interrupted (or the directory is not this store's). "
                             "Remove the store files (chunks, commit, lock, hyperparameters, tensor_steps) in every directory and create it "
                             "again");
  for (std::size_t i = 0; i < n; ++i) {
    const std::string& dir = options.dirs[i];
    heads.push_back(drive::chunk_store::peek(dir));
    const auto& w = heads.back().words;
    if ((w.size() != num_words && w.size() != w_tensor_steps && w.size() != w_hyperparameters &&
         w.size() != w_range_begin) ||
        w[w_kind] != store_kind)
      throw std::runtime_error("the store in " + dir + " is not a hostopt optimizer's state store");
    s->check_same_range(w, dir);
    if (w[w_stripes] != n || w[w_stripe] != i)
      throw std::runtime_error("the store in " + dir + " is stripe " + std::to_string(w[w_stripe]) + " of " +
                               std::to_string(w[w_stripes]) + " directories, given as dirs[" + std::to_string(i) +
                               "] of " + std::to_string(n) + " (name them as at its creation, in that order)");
    if (w[w_chunk_elements] != heads[0].words[w_chunk_elements])
      throw std::runtime_error("the stores in " + options.dirs[0] + " and " + dir + " have another chunking: not one "
                               "optimizer's stripes");
  }
  const std::size_t elements = heads[0].words[w_chunk_elements];
  if (elements == 0 || elements % s->whole.unit())
    throw std::runtime_error("the store in " + options.dirs[0] + " has chunks of " + std::to_string(elements) +
                             " elements, which this layout cannot have (another model)");
  s->lay_out_chunks(elements);
  for (std::size_t i = 0; i < n; ++i) {
    const drive::store_shape need = s->shape(i, n), saved = heads[i].shape;
    if (!(saved == need))
      throw std::runtime_error("the store in " + options.dirs[i] + " holds another state than these groups: " +
                               std::to_string(saved.chunks) + " chunks of " + std::to_string(saved.chunk_bytes) +
                               " bytes where they need " + std::to_string(need.chunks) + " of " +
                               std::to_string(need.chunk_bytes) +
                               (saved.chunks == need.chunks && saved.chunk_bytes == need.chunk_bytes
                                    ? ", and another fingerprint (tensor names, shapes, groups, moment formats, "
                                      "rounding seeds or the range held differ)"
                                    : " (another model, layout, moment format or range held)"));
  }
  // The store's chunking, in as many buffers as the budget holds (at least 3).
  unsigned buffers = options.buffers;
  while (buffers > 3 && (s->chunk_bytes + drive::direct_alignment) * buffers > options.staging_bytes) --buffers;
  s->check_budget(options, buffers);
  // Killed between the stripes' commits, some stripes hold step t and the others t - 1:
  // all open at t - 1, whose slots nothing has overwritten yet.
  // A stripe whose last step does not verify opens at the one before (chunk_store::open);
  // then every stripe at the lowest.
  const auto backend = drive::parse_io_backend(options.io, "state_store_options.io");
  for (std::size_t i = 0; i < n; ++i)
    s->stores.push_back(std::make_unique<drive::chunk_store>(
        drive::chunk_store::open(options.dirs[i], s->shape(i, n), durability_of(options), buffers, backend,
                                 false))); // (a fallback's record is erased once every check below passed)
  // The last commit every stripe made (a step is complete once all of them made it; killed
  // between the stripes' commits, some made one more), and where each stands after open:
  // its last commit, or the one before where that could not be opened (a fallback).
  std::uint64_t complete = heads[0].step, top = heads[0].step;
  for (const auto& h : heads) {
    complete = std::min(complete, h.step);
    top = std::max(top, h.step);
  }
  std::uint64_t low = s->stores[0]->committed_step(), high = low;
  for (std::size_t i = 0; i < n; ++i) {
    low = std::min(low, s->stores[i]->committed_step());
    high = std::max(high, s->stores[i]->committed_step());
    if (!s->stores[i]->fell_back().empty()) s->recovery += s->stores[i]->fell_back() + "; ";
  }
  const std::uint64_t last_count = s->stores[0]->committed_words()[w_count];
  auto stripe_at = [&](std::uint64_t commit) {
    for (std::size_t i = 0; i < n; ++i)
      if (s->stores[i]->committed_step() == commit) return options.dirs[i];
    return std::string();
  };
  // Where every stripe goes: the commit all of them stand at (or the one before where a
  // stripe stands a commit ahead). Going back: the commit before the last complete one —
  // where a stripe fell back from that one, open has gone there already.
  auto head_at = [&](std::uint64_t commit) {
    for (std::size_t i = 0; i < n; ++i)
      if (heads[i].step == commit) return options.dirs[i];
    return std::string();
  };
  if (top > complete + 1)
    throw std::runtime_error("the stripes in " + head_at(complete) + " and " + head_at(top) +
                             " last committed commits " + std::to_string(complete) + " and " + std::to_string(top) +
                             ", more than a step apart: not one optimizer's stripes (or one restored from an older "
                             "copy)");
  std::uint64_t target = low;
  if (previous) {
    if (complete == 0)
      throw std::runtime_error("stored_optimizer::open_previous: the store stands at the step it was created with "
                               "(step_count " + std::to_string(last_count) + "): there is no step before it");
    target = complete - 1;
    if (top > complete)
      throw std::runtime_error(
          "stored_optimizer::open_previous: a step was killed between the stripes' commits (" + head_at(top) +
          " made commit " + std::to_string(top) + ", " + head_at(complete) + " only " + std::to_string(complete) +
          "): it never completed, and the stripes that committed it no longer hold the step before the last "
          "completed one. Open the store without going back: it stands at the step every stripe holds");
  } else if (high > low + 1) {
    throw std::runtime_error("the stripes in " + stripe_at(low) + " and " + stripe_at(high) + " stand at commits " +
                             std::to_string(low) + " and " + std::to_string(high) + ", more than a step apart" +
                             (s->recovery.empty() ? "" : " (" + s->recovery + "opened there)") +
                             ": not one optimizer's stripes, or stripes that can no longer be opened together");
  }
  // Every stripe's record of that commit, verified, before any stripe erases a later one: one
  // id in all of them, or they are not one store's stripes (a directory named in another
  // store's place) and every store stays as it was.
  std::vector<std::vector<std::uint64_t>> at(n);
  for (std::size_t i = 0; i < n; ++i) try {
      at[i] = s->stores[i]->committed_step() == target ? s->stores[i]->committed_words()
                                                       : s->stores[i]->verify_previous();
    } catch (const std::runtime_error& e) {
      if (!previous) throw;
      throw std::runtime_error("stored_optimizer::open_previous: cannot go back from step_count " +
                               std::to_string(last_count) + ": " + e.what());
    }
  for (std::size_t i = 1; i < n; ++i)
    if (at[0][w_commit_id] != at[i][w_commit_id] || at[0][w_count] != at[i][w_count] ||
        at[0][w_skipped] != at[i][w_skipped])
      throw std::runtime_error("the stripes in " + options.dirs[0] + " and " + options.dirs[i] + " hold different "
                               "commits at commit " + std::to_string(target) + " (optimizer steps " +
                               std::to_string(at[0][w_count]) + " and " + std::to_string(at[i][w_count]) +
                               "): not one optimizer's stripes");
  // The tensors' own counts of that commit: one that kept them must give them back (its
  // steps' bias corrections depend on them), else open is refused, before any stripe lets go
  // of a later commit (nothing is lost: the file put back, the store opens as it was).
  if (at[0].size() > w_tensor_steps && at[0][w_tensor_steps] == 1) {
    std::string problem;
    auto lags = read_tensor_lags(options.dirs[0], target, at[0][w_commit_id], s->lag.size(),
                                 std::int64_t(at[0][w_count]), problem);
    if (!lags) {
      const std::string why = "the tensors' own step counts of step " + std::to_string(at[0][w_count]) +
                              " cannot be read (" + problem + ")";
      if (previous)
        throw std::runtime_error("stored_optimizer::open_previous: cannot go back from step_count " +
                                 std::to_string(last_count) + ": " + why + "; nothing was rolled back");
      throw std::runtime_error("the store in " + options.dirs[0] + " stands at step " +
                               std::to_string(at[0][w_count]) + ", and " + why +
                               ": open_previous opens the step before, if its counts can be read");
    }
    s->lag = std::move(*lags);
  }
  // Then each stripe ahead lets go of its later commit. (Killed between the erasures, the
  // stripes hold t - 1 and t: open brings all to t - 1.)
  for (std::size_t i = 0; i < n; ++i) {
    if (s->stores[i]->committed_step() == target) continue;
    if (!previous)
      s->recovery += "the store in " + options.dirs[i] + " rolled back to commit " + std::to_string(target) +
                     " with the other stripes; ";
    s->stores[i]->roll_back();
  }
  for (const auto& st : s->stores) st->erase_fallen_back();
  const auto& committed = s->stores[0]->committed_words();
  s->count = std::int64_t(committed[w_count]);
  s->skipped = std::int64_t(committed[w_skipped]);
  s->first_dir = options.dirs[0];
  s->dirs = options.dirs;
  s->sync = options.sync_every_step;
  // The hyper-parameters of the step it opened at, as load_checkpoint restores them; a store
  // made before they were kept has none (the groups' then), and a record that cannot be read
  // (or a missing file of a store that keeps them) is said in recovery().
  std::string problem;
  std::optional<std::vector<adam_config>> saved;
  if (committed.size() > w_hyperparameters && committed[w_hyperparameters] == 1) { // (else a commit from before)
    saved = read_hyperparameters(s->first_dir, s->stores[0]->committed_step(), committed[w_commit_id],
                                 s->configs.size(), problem);
    if (saved) try {
        for (std::size_t g = 0; g < saved->size(); ++g) validate((*saved)[g], "group " + std::to_string(g));
      } catch (const std::invalid_argument& e) {
        problem = e.what();
        saved.reset();
      }
    if (!saved && problem.empty())
      problem = "the file " + (std::filesystem::path(s->first_dir) / "hyperparameters").string() +
                " that this store keeps them in is missing";
  }
  if (saved) s->configs = std::move(*saved);
  else if (!problem.empty())
    s->recovery += "the hyper-parameters of the step it opened at could not be read (" + problem +
                   "): the groups' are used; ";
  s->make_staging(buffers);
  return stored_optimizer(std::move(s));
}

step_result stored_optimizer::step(const_view flat_grad, mut_view flat_out, float grad_scale) {
  return step(flat_grad, flat_out, unchecked(grad_scale));
}

step_result stored_optimizer::step(const_view flat_grad, mut_view flat_out, const step_options& opts) {
  return step(flat_grad, flat_out, opts, {}, {});
}

step_result stored_optimizer::step(const_view flat_grad, mut_view flat_out, const step_options& opts,
                                   const_view flat_params, std::span<const arena_range> adopt,
                                   std::span<const std::size_t> tensors_without_grad) {
  impl& s = *impl_;
  const auto lock = s.turns.acquire("step", false);
  s.check_usable("step");
  const std::vector<std::size_t> without(tensors_without_grad.begin(), tensors_without_grad.end());
  check_tensors_without_grad(without, s.lag.size(), s.whole.whole(), "stored_optimizer::step");
  if (!adopt.empty()) {
    check_view("flat_params", flat_params.data, flat_params.size, flat_params.type, s.end());
    if (flat_params.type != dtype::f32)
      throw std::invalid_argument("stored_optimizer::step: flat_params holds master parameters: float32 expected");
    s.check_adopt_ranges(adopt, "stored_optimizer::step");
  }
  check_grad_scale(opts.grad_scale);
  if (!s.whole.whole() && opts.known_grad_norm < 0 && (opts.skip_nonfinite || opts.max_grad_norm != 0))
    throw std::invalid_argument(std::string("stored_optimizer::step: this store holds a range of the layout (a "
                                            "shard), and ") +
                                (opts.max_grad_norm != 0 ? "max_grad_norm clips" : "skip_nonfinite is on (the default)") +
                                ": the decision needs the global gradient norm, or each rank would decide alone. "
                                "Pass step_options::known_grad_norm (the ranks' sums of squares, all-reduced, "
                                "square-rooted), or skip_nonfinite = false and no max_grad_norm");
  const std::size_t n = s.end();
  check_view("flat_grad", flat_grad.data, flat_grad.size, flat_grad.type, n);
  const bool has_out = flat_out.data != nullptr || flat_out.size != 0;
  if (has_out) {
    check_view("flat_out", flat_out.data, flat_out.size, flat_out.type, n);
    std::vector<byte_range> ranges{range_of(flat_grad.data, n * dtype_size(flat_grad.type), false, 0, 0),
                                   range_of(flat_out.data, n * dtype_size(flat_out.type), true, 1, 0)};
    const char* const kinds[] = {"flat_grad", "flat_out"};
    check_no_overlap(ranges, kinds);
  }
  const std::vector<char> no_grad = s.tensor_marks(without);
  s.stat_views.clear();
  for (std::size_t k = 0; k < s.whole_pieces.size(); ++k) { // per tensor: padding is never read, nor a missing gradient
    const update_piece& piece = s.whole_pieces[k];
    if (!no_grad[s.whole.piece_tensor()[k]])
      s.stat_views.push_back({static_cast<const char*>(flat_grad.data) + piece.offset * dtype_size(flat_grad.type),
                              piece.size, flat_grad.type});
  }
  const step_io io{flat_grad.type, has_out ? std::optional<dtype>(flat_out.type) : std::nullopt, false, false};
  struct reset { // (the pieces are shared with every later step and export)
    impl& s;
    ~reset() { s.reset_pieces(); }
  } reset_anyway{s};
  const step_plan pl = s.plan(io, opts, [&] { return gradient_stats(s.stat_views, s.exec).norm; });
  if (!pl.decision().apply) {
    step_plan::check_count(s.skipped); // (the skipped count shares the step count's limit)
    ++s.skipped;
    return make_step_result(pl.decision(), s.count, s.skipped);
  }
  block_counts seen;
  const std::size_t gb = dtype_size(flat_grad.type);
  s.mark_without_grad(without);
  std::size_t next_adopt = 0; // the first range that does not end before the chunk (chunks come in order)
  s.stream(true, true, [&](std::size_t, impl::chunk& c) {
    s.adopt_pending(c); // (then the step's own adopt ranges, which come later)
    const std::size_t c_begin = s.flat_at(c), c_end = c_begin + c.range.size();
    while (next_adopt < adopt.size() && adopt[next_adopt].end <= c_begin) ++next_adopt;
    for (std::size_t i = next_adopt; i < adopt.size() && adopt[i].begin < c_end; ++i) {
      const std::size_t lo = std::max(adopt[i].begin, c_begin), hi = std::min(adopt[i].end, c_end);
      std::memcpy(c.storage.params() + (lo - c_begin), static_cast<const float*>(flat_params.data) + lo,
                  (hi - lo) * sizeof(float));
    }
    const block_counts b = s.update(c, flat_grad.data, gb, has_out ? flat_out.data : nullptr, flat_out.type);
    seen.poisoned += b.poisoned;
    seen.saturated += b.saturated;
  });
  s.commit_step(without);
  return make_step_result(pl.decision(), s.count, s.skipped, seen);
}

void stored_optimizer::adopt_at_next_step(std::span<const arena_range> adopt, std::span<const float> values) {
  impl& s = *impl_;
  const auto lock = s.turns.acquire("adopt_at_next_step", false);
  s.check_usable("adopt_at_next_step");
  s.check_adopt_ranges(adopt, "adopt_at_next_step");
  std::size_t total = 0;
  for (const arena_range& r : adopt) total += r.size();
  if (values.size() != total)
    throw std::invalid_argument("adopt_at_next_step: " + std::to_string(values.size()) + " values for ranges of " +
                                std::to_string(total) + " elements");
  std::vector<impl::pending_range> pending;
  for (std::size_t at = 0; const arena_range& r : adopt) {
    pending.push_back({r, std::vector<float>(values.begin() + at, values.begin() + at + r.size())});
    at += r.size();
  }
  s.pending = std::move(pending);
}

std::size_t stored_optimizer::pending_adoption() const {
  const auto lock = impl_->turns.acquire("pending_adoption", false);
  std::size_t n = 0;
  for (const auto& p : impl_->pending) n += p.range.size();
  return n;
}

void stored_optimizer::copy_state_to(optimizer& ram) const {
  impl& s = *impl_;
  const auto lock = s.turns.acquire("copy_state_to", false);
  s.check_usable("copy_state_to");
  exclusive_state es(ram, "stored_optimizer::copy_state_to", true);
  s.check_same_state(es, "stored_optimizer::copy_state_to");
  try {
    s.stream(true, false, [&](std::size_t, impl::chunk& c) {
      for (const update_piece& piece : c.pieces) s.copy_piece(c, piece, es, true);
    });
    es.set_counters(s.configs, s.count, s.skipped);
    if (s.any_lag()) es.set_tensor_lags(s.lag);
    es.set_seeds(s.seeds);
  } catch (const std::exception& e) {
    es.mark_failed(std::string("stored_optimizer::copy_state_to failed midway: ") + e.what());
    throw;
  }
  es.clear_failure();
}

void stored_optimizer::copy_params_to(mut_view flat_out) const {
  impl& s = *impl_;
  const auto lock = s.turns.acquire("copy_params_to", false);
  s.check_usable("copy_params_to");
  check_view("flat_out", flat_out.data, flat_out.size, flat_out.type, s.end());
  const std::size_t ob = dtype_size(flat_out.type);
  s.stream(true, false, [&](std::size_t, impl::chunk& c) {
    for (const update_piece& piece : c.pieces) // per tensor: padding is never written
      if (piece.size)
        convert_params(c.storage.params() + piece.offset,
                       {static_cast<char*>(flat_out.data) + (s.flat_at(c) + piece.offset) * ob, piece.size,
                        flat_out.type},
                       s.exec);
  });
}

void stored_optimizer::save_checkpoint(const std::string& path) const {
  impl& s = *impl_;
  const auto lock = s.turns.acquire("save_checkpoint", false);
  s.check_usable("save_checkpoint");
  if (!s.whole.whole())
    throw std::invalid_argument("stored_optimizer::save_checkpoint: this store holds a shard [" +
                                std::to_string(s.whole.range().begin) + ", " + std::to_string(s.whole.range().end) +
                                ") of the layout: save_shard writes its part of a sharded checkpoint");
  s.save_streamed(path, {}, "stored_optimizer::save_checkpoint");
}

void stored_optimizer::save_shard(const std::string& dir, const std::string& save_id, int world_size,
                                  int rank) const {
  impl& s = *impl_;
  const auto lock = s.turns.acquire("save_shard", false);
  s.check_usable("save_shard");
  s.check_holds_shard(world_size, rank, "stored_optimizer::save_shard");
  s.save_streamed(detail::shard_save_path(dir, save_id, rank, world_size),
                  detail::shard_save_metadata(save_id, rank, world_size), "stored_optimizer::save_shard");
}

void stored_optimizer::commit_shard_save(const std::string& dir, const std::string& save_id, int world_size) const {
  impl& s = *impl_;
  const auto lock = s.turns.acquire("commit_shard_save", false);
  s.check_usable("commit_shard_save");
  try {
    s.check_holds_shard(world_size, 0, "stored_optimizer::commit_shard_save");
  } catch (const std::invalid_argument& e) { // (a logic error, as sharded_optimizer::commit_save's on rank != 0)
    throw std::logic_error(std::string(e.what()) + ": call it on rank 0's store, after every rank saved");
  }
  detail::commit_shard_save(dir, save_id, s.whole.segments(), arena_end(s.whole.segments()), world_size,
                            s.whole.unit());
}

std::int64_t stored_optimizer::step_count() const {
  const auto lock = impl_->turns.acquire("step_count", false);
  return impl_->count;
}

std::vector<std::int64_t> stored_optimizer::tensor_steps() const {
  const auto lock = impl_->turns.acquire("tensor_steps", false);
  std::vector<std::int64_t> steps(impl_->lag.size());
  for (std::size_t i = 0; i < steps.size(); ++i) steps[i] = impl_->count - impl_->lag[i];
  return steps;
}
std::int64_t stored_optimizer::skipped_steps() const {
  const auto lock = impl_->turns.acquire("skipped_steps", false);
  return impl_->skipped;
}
std::size_t stored_optimizer::arena_size() const { return impl_->end(); }
arena_range stored_optimizer::range() const { return impl_->whole.range(); }
std::span<const segment> stored_optimizer::segments() const { return impl_->whole.segments(); }
std::size_t stored_optimizer::num_groups() const { return impl_->configs.size(); }
adam_config stored_optimizer::group_config(std::size_t group) const {
  const auto lock = impl_->turns.acquire("group_config", false);
  if (group >= impl_->configs.size())
    throw std::invalid_argument("group = " + std::to_string(group) + ": expected an index below " +
                                std::to_string(impl_->configs.size()));
  return impl_->configs[group];
}
void stored_optimizer::set_group_config(std::size_t group, const adam_config& config) {
  const auto lock = impl_->turns.acquire("set_group_config", false);
  if (group >= impl_->configs.size())
    throw std::invalid_argument("group = " + std::to_string(group) + ": expected an index below " +
                                std::to_string(impl_->configs.size()));
  validate(config, "set_group_config");
  impl_->configs[group] = config;
}
void stored_optimizer::set_lr(std::size_t group, double lr) {
  const auto lock = impl_->turns.acquire("set_lr", false);
  if (group >= impl_->configs.size())
    throw std::invalid_argument("group = " + std::to_string(group) + ": expected an index below " +
                                std::to_string(impl_->configs.size()));
  adam_config c = impl_->configs[group];
  c.lr = lr;
  validate(c, "set_lr");
  impl_->configs[group] = c;
}
std::string stored_optimizer::recovery() const { return impl_->recovery; }
std::size_t stored_optimizer::chunks() const { return impl_->chunks.size(); }
std::size_t stored_optimizer::chunk_elements() const { return impl_->chunk_elements; }
std::size_t stored_optimizer::chunk_bytes() const { return impl_->chunk_bytes; }
std::size_t stored_optimizer::staging_bytes() const {
  const auto lock = impl_->turns.lock_only(); // (close() frees them)
  const std::size_t buffers = impl_->staging.size() + (impl_->read_buffer ? 1 : 0);
  return buffers * (impl_->chunk_bytes + drive::direct_alignment);
}
std::string stored_optimizer::io_backend() const {
  const auto lock = impl_->turns.acquire("io_backend", false);
  return impl_->stores.empty() ? "closed" : drive::to_string(impl_->stores[0]->backend());
}
void stored_optimizer::close() {
  const auto lock = impl_->turns.acquire("close", false);
  impl_->stores.clear(); // (each waits for its I/O, then releases its lock)
  impl_->staging.clear();
  impl_->read_buffer.reset();
  impl_->pending = {}; // (an adoption no step committed goes with the store)
  impl_->closed = true;
}
std::uint64_t stored_optimizer::step_io_bytes() const {
  return 2 * std::uint64_t(impl_->chunks.size()) * (impl_->chunk_bytes + drive::direct_alignment);
}
std::size_t stored_optimizer::stripes() const {
  const auto lock = impl_->turns.acquire("stripes", false);
  return impl_->stores.size();
}
std::uint64_t stored_optimizer::cached_pages() const {
  const auto lock = impl_->turns.acquire("cached_pages", false);
  std::uint64_t pages = 0;
  for (const auto& store : impl_->stores) pages += store->cached_pages();
  return pages;
}

} // namespace hostopt
