#pragma once
// The state of a stored_optimizer (stored_optimizer.hpp), shared by the files that implement
// it: stored_optimizer.cpp (create, open, whole steps, exports) and streamed_chunked_step.cpp
// (the chunked steps an offload pipeline drives). Chunks of the arena are laid out as an
// optimizer holding that range (a shard) would lay them out in RAM, so each chunk is updated in
// its staging buffer by the in-RAM optimizer's own plan and kernels (same bits), and
// drive::chunk_store makes each step a commit.
#include "hostopt/sharding.hpp"
#include "hostopt/stored_optimizer.hpp"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <optional>
#include <random>
#include <stdexcept>

#include "buffer_checks.hpp"
#include "checkpoint_io.hpp"
#include "checksum.hpp"
#include "chunk_store.hpp"
#include "chunked_step.hpp"
#include "exclusive_state.hpp"
#include "held_layout.hpp"
#include "hyperparameter_record.hpp"
#include "tensor_step_record.hpp"
#include "kernel_registry.hpp"
#include "operation_turns.hpp"
#include "parallel.hpp"
#include "state_storage.hpp"
#include "step_plan.hpp"
#include "update_engine.hpp"

namespace hostopt {

namespace store_detail {

// The commit words: what kind of store, its chunking, and the optimizer's counters.
constexpr std::uint64_t store_kind = 0x686f73746f707431; // "hostopt1"
// The range words came with stores of a range (a shard): records written before them have
// w_range_begin words (the range is then in the fingerprint alone). w_hyperparameters (1:
// each commit keeps its hyper-parameters, hyperparameter_record.hpp) came after: records
// before it have w_hyperparameters words. w_tensor_steps (1: some tensor is behind the count,
// and the commit's tensor_step_record.hpp holds each one's lag; 0: none is) came last: records
// before it have w_tensor_steps words. An older hostopt refuses a record of more words than
// it knows.
enum word : std::size_t {
  w_kind, w_chunk_elements, w_count, w_skipped, w_stripes, w_stripe, w_commit_id,
  w_range_begin, w_range_end, w_layout_end, w_hyperparameters, w_tensor_steps, num_words
};

inline drive::durability durability_of(const state_store_options& o) {
  return o.sync_every_step ? drive::durability::sync : drive::durability::none;
}

inline std::vector<moment_format> formats_of(const std::vector<param_group>& groups) {
  std::vector<moment_format> f;
  for (const param_group& g : groups) f.push_back(g.moments);
  return f;
}

inline std::size_t round_up(std::size_t x, std::size_t unit) { return (x + unit - 1) / unit * unit; }

} // namespace store_detail

// (A private header, included by the store's own files alone.)
using namespace detail;
using namespace store_detail;

struct stored_optimizer::impl {
  // One chunk of the arena: laid out as an optimizer holding [range) lays out its state.
  struct chunk {
    arena_range range;
    held_layout layout;
    state_storage storage; // external: bound to its staging buffer when used
    std::vector<update_piece> pieces;
  };

  // Every public operation, one at a time, first come first served; a chunked step keeps the
  // turn of the thread that began it until it finishes or aborts (operation_turns).
  detail::operation_turns turns;
  execution_options exec;
  const kernel_set* kernels;
  std::vector<param_group> groups;
  held_layout whole;
  std::vector<update_piece> whole_pieces;
  std::vector<adam_config> configs;
  std::vector<std::uint64_t> seeds;
  std::size_t chunk_elements = 0, chunk_bytes = 0;
  std::vector<chunk> chunks;
  std::uint64_t fingerprint = 0;
  // (staging first: the stores go first, waiting for their I/O into it)
  std::vector<drive::chunk_store::staging> staging;
  std::vector<std::unique_ptr<drive::chunk_store>> stores; // one per directory: chunk k in stores[k % n]
  std::uint64_t commit_id = 0; // the same in every stripe's record of one commit
  std::string first_dir;       // where each commit's hyper-parameters are kept (hyperparameter_record.hpp)
  std::vector<std::string> dirs; // every stripe's directory (an export must not land on the store's files)
  bool sync = true;
  std::string broken;          // why every later step is refused ("" while none is)
  bool closed = false;
  std::int64_t count = 0, skipped = 0;
  // Per layout tensor: the applied steps it had no gradient in (per-tensor steps), its own
  // count being count - lag; all zero unless a step named tensors without a gradient.
  std::vector<std::int64_t> lag;
  std::string recovery; // what open did where the last step could not be opened
  // Scratch of a step.
  std::vector<group_kernel> group_kernels, chunk_kernels;
  std::vector<const_view> stat_views;
  std::vector<char> read_done, write_done;

  impl(std::vector<param_group> gs, execution_options e, const std::optional<arena_range>& range)
      : exec(std::move(e)), kernels(nullptr), groups(std::move(gs)),
        whole(groups, range ? *range : arena_range{0, arena_end(arena_layout(groups))}), whole_pieces(whole.pieces()) {
    check_threads(exec.threads);
    kernels = &kernel_set_by_name(exec.kernel);
    for (const param_group& g : groups) {
      configs.push_back(g.config);
      seeds.push_back(g.rounding_seed);
    }
    lag.assign(whole.segments().size(), 0);
    group_kernels.resize(configs.size() + lag.size()); // groups, then tensors behind the count
    chunk_kernels.resize(configs.size() + lag.size());
  }
  bool any_lag() const {
    return std::any_of(lag.begin(), lag.end(), [](std::int64_t l) { return l != 0; });
  }
  // Per layout tensor: 1 where `without` names it (named twice: once).
  std::vector<char> tensor_marks(std::span<const std::size_t> without) const {
    std::vector<char> marks(lag.size(), 0);
    for (const std::size_t t : without) marks[t] = 1;
    return marks;
  }

  // Elements held, and the first one's layout index: flat buffers index from `base()`.
  std::size_t end() const { return whole.size(); }
  std::size_t base() const { return whole.range().begin; }
  // Where a chunk starts in flat buffers (gradients, copy-outs, initial parameters).
  std::size_t flat_at(const chunk& c) const { return c.range.begin - base(); }

  // Chunks of `elements` each (the last shorter) and the bytes of the largest.
  void lay_out_chunks(std::size_t elements) {
    chunk_elements = elements;
    chunks.clear();
    const std::vector<moment_format> formats = formats_of(groups);
    std::size_t largest = 0;
    for (std::size_t b = 0; b == 0 || b < end(); b += elements) {
      const arena_range r{base() + b, base() + std::min(end(), b + elements)};
      held_layout layout(groups, r);
      state_storage storage(formats, layout, state_storage::external_memory{});
      largest = std::max(largest, storage.contiguous_bytes());
      std::vector<update_piece> pieces = layout.pieces();
      chunks.push_back({r, std::move(layout), std::move(storage), std::move(pieces)});
    }
    chunk_bytes = round_up(std::max<std::size_t>(largest, 1), drive::direct_alignment);
    fingerprint = fingerprint_of();
  }

  // Chunking from the staging budget: each of `buffers` buffers holds a chunk and its stamp.
  void choose_chunks(const state_store_options& o) {
    const std::size_t unit = whole.unit();
    if (o.chunk_elements) {
      if (o.chunk_elements % unit)
        throw std::invalid_argument("state_store_options.chunk_elements = " + std::to_string(o.chunk_elements) +
                                    ": expected a multiple of " + std::to_string(unit) +
                                    " (8-bit blocks and 64-byte units are never cut)");
      lay_out_chunks(o.chunk_elements);
      check_budget(o, o.buffers);
      return;
    }
    const std::size_t per_buffer = o.staging_bytes / o.buffers;
    const std::size_t stamp = drive::direct_alignment;
    const std::size_t whole_bytes =
        state_storage(formats_of(groups), whole, state_storage::external_memory{}).contiguous_bytes();
    const double per_element = end() ? double(whole_bytes) / double(end()) : 12.0;
    std::size_t elements = per_buffer > stamp ? std::size_t(double(per_buffer - stamp) / per_element) / unit * unit : 0;
    elements = std::min(elements, round_up(std::max<std::size_t>(end(), 1), unit));
    if (elements < unit) { // refused before laying out a multitude of tiny chunks
      const std::size_t least = (round_up(std::size_t(per_element * double(unit)) + 64 * groups.size() + 64,
                                          drive::direct_alignment) + stamp) * o.buffers;
      throw std::invalid_argument("state_store_options.staging_bytes = " + std::to_string(o.staging_bytes) + ": " +
                                  std::to_string(o.buffers) + " buffers need about " + std::to_string(least) +
                                  " bytes at least (raise the budget, or lower buffers)");
    }
    for (;;) { // chunks of uneven groups may hold more than the average: shrink until each fits
      lay_out_chunks(elements);
      if ((chunk_bytes + stamp) * o.buffers <= o.staging_bytes) return;
      if (elements == unit) check_budget(o, o.buffers); // the smallest chunk does not fit: names the budget
      elements = std::max(unit, elements - std::max(unit, elements / 16 / unit * unit));
    }
  }

  void check_budget(const state_store_options& o, unsigned buffers) const {
    const std::size_t need = (chunk_bytes + drive::direct_alignment) * buffers;
    if (need > o.staging_bytes)
      throw std::invalid_argument("state_store_options.staging_bytes = " + std::to_string(o.staging_bytes) +
                                  ": " + std::to_string(buffers) + " buffers of " + std::to_string(chunk_elements) +
                                  "-element chunks need " + std::to_string(need) +
                                  " bytes (raise the budget, or lower buffers or chunk_elements)");
  }

  // What a store's bytes mean: the layout, the formats, the rounding seeds and the chunking.
  std::uint64_t fingerprint_of() const {
    checksum64 c;
    auto add = [&](std::uint64_t x) { c.add(&x, sizeof x); };
    add(store_kind);
    add(chunk_elements);
    add(end());
    if (!whole.whole()) add(base()); // (a whole layout's fingerprint is what it was before ranges)
    for (const segment& s : whole.segments()) {
      add(s.name.size());
      c.add(s.name.data(), s.name.size());
      add(s.shape.size());
      for (const std::int64_t e : s.shape) add(std::uint64_t(e));
      add(s.offset);
      add(s.group);
    }
    for (std::size_t g = 0; g < groups.size(); ++g) {
      add(std::uint64_t(groups[g].moments));
      add(seeds[g]);
    }
    return c.finish();
  }

  // Stripe i's store: chunks i, i + n, i + 2n, ... of n directories.
  drive::store_shape shape(std::size_t i, std::size_t n) const {
    checksum64 c;
    for (const std::uint64_t x : {fingerprint, std::uint64_t(i), std::uint64_t(n)}) c.add(&x, sizeof x);
    return {(chunks.size() - i + n - 1) / n, chunk_bytes, c.finish()};
  }
  std::size_t stripes() const { return stores.size(); }
  drive::chunk_store& store_of(std::size_t k) const { return *stores[k % stores.size()]; }

  void make_staging(unsigned buffers) {
    // The chunks' checksums on the step's threads (2 x its bytes per step: on one thread they
    // would keep the drive waiting).
    for (auto& store : stores)
      store->set_parallel_runner([threads = exec.threads](std::size_t pieces, const std::function<void(std::size_t)>& body) {
        auto slice = [&](int tid, int nthreads) {
          const auto [lo, hi] = partition(0, pieces, tid, nthreads, 1);
          for (std::size_t i = lo; i < hi; ++i) body(i);
        };
        run_parallel(threads, slice);
      });
    staging.clear();
    for (unsigned i = 0; i < buffers; ++i) staging.push_back(stores[0]->make_staging()); // (one slot size for all)
    read_done.assign(chunks.size(), 0);
    write_done.assign(chunks.size(), 0);
  }

  std::vector<std::uint64_t> words(std::size_t stripe) const {
    std::vector<std::uint64_t> w(num_words);
    w[w_commit_id] = commit_id;
    w[w_stripes] = stripes();
    w[w_stripe] = stripe;
    w[w_kind] = store_kind;
    w[w_chunk_elements] = chunk_elements;
    w[w_count] = std::uint64_t(count);
    w[w_skipped] = std::uint64_t(skipped);
    w[w_range_begin] = whole.range().begin;
    w[w_range_end] = whole.range().end;
    w[w_layout_end] = arena_end(whole.segments());
    w[w_hyperparameters] = 1;
    w[w_tensor_steps] = any_lag();
    return w;
  }

  // Waits for a request of chunk k's store, marking each finished chunk's read (the first
  // time) or write.
  void settle(std::size_t k) {
    const std::size_t n = stripes(), i = k % n;
    for (const std::uint64_t local : stores[i]->finish(1)) {
      const std::size_t c = local * n + i;
      (read_done[c] ? write_done[c] : read_done[c]) = 1;
    }
  }
  void start_read(std::size_t k, drive::chunk_store::staging& buf) { store_of(k).start_read(k / stripes(), buf); }
  void start_write(std::size_t k, drive::chunk_store::staging& buf) { store_of(k).start_write(k / stripes(), buf); }
  // Every stripe's record of one step, with one id. A failure partway leaves some stripes a
  // step ahead of the others: this object then refuses every later step (a retry would
  // reuse the slots that reopening rolls back to); reopening opens all at the older step.
  void commit() {
    commit_id = std::random_device{}() | (std::uint64_t(std::random_device{}()) << 32);
    try { // (before any record: nothing to undo)
      for (const auto& st : stores) st->check_still_there();
      write_hyperparameters(first_dir, stores[0]->next_step(), commit_id, configs, sync);
      if (any_lag()) write_tensor_lags(first_dir, stores[0]->next_step(), commit_id, lag, sync);
    } catch (...) {
      drain();
      throw;
    }
    try {
      for (std::size_t i = 0; i < stripes(); ++i) stores[i]->commit(words(i)); // (killed between: open takes the older)
    } catch (const std::exception& e) {
      broken = std::string("a commit failed (") + e.what() + "): the store holds this step or the one before; "
               "reopen it to go on";
      throw;
    }
  }
  // The last completed step as a checkpoint file (the in-RAM save's bytes, `extra` added to
  // its metadata), streamed: every chunk read once and verified, its pieces written where
  // the file holds them. Refuses a path that is one of the store's own files.
  void save_streamed(const std::string& path, const detail::checkpoint_metadata& extra, const char* what) {
    impl& s = *this;
  for (const std::string& dir : s.dirs) // (a checkpoint written over the chunks or the commit record would end the store)
    for (const char* own : {"chunks", "commit", "lock", "hyperparameters", "tensor_steps"}) {
      std::error_code e1, e2;
      const std::filesystem::path mine = std::filesystem::weakly_canonical(std::filesystem::path(dir) / own, e1);
      const std::filesystem::path target = std::filesystem::weakly_canonical(path, e2);
      if (!e1 && !e2 && mine == target)
        throw std::invalid_argument(std::string(what) + ": '" + path + "' is this store's own " + own +
                                    " file: save the checkpoint elsewhere");
    }
  const std::span<const segment> segs = s.whole.segments();
  const detail::checkpoint_description d{segs, s.whole.range(), formats_of(s.groups), s.configs, s.seeds, s.count,
                                         s.skipped, s.any_lag() ? s.lag : std::vector<std::int64_t>()};
  std::size_t i = 0; // the first tensor that does not end before the chunk: chunks come in layout order
  detail::save_checkpoint_streamed(d, path, [&](const detail::checkpoint_put& put) {
    i = 0;
    s.stream(true, false, [&](std::size_t, chunk& c) {
      while (i < segs.size() && segs[i].offset + segs[i].size <= c.range.begin) ++i;
      for (std::size_t j = i; j < segs.size() && segs[j].offset < c.range.end; ++j) {
        const segment& seg = segs[j];
        const std::size_t lo = std::max(seg.offset, c.range.begin), hi = std::min(seg.offset + seg.size, c.range.end);
        if (lo >= hi) continue; // (an empty tensor)
        const std::size_t local = lo - c.range.begin, n = hi - lo, first = lo - seg.offset, g = seg.group;
        const moment_format f = s.groups[g].moments;
        put(j, 0, first, c.storage.params() + local, n * 4);
        for (int k = 1; k <= 2; ++k) put(j, k, first, c.storage.moment_at(k, g, local), n * moment_code_bytes(f));
        if (f == moment_format::q8)
          put(j, 3, first, c.storage.moment_at(3, g, local), 2 * ((n + q8_block - 1) / q8_block));
      }
    });
  }, extra);
  }

  // Refuses (std::invalid_argument, naming both ranges) unless this store holds rank `rank`'s
  // shard of `world`: a sharded checkpoint's file must be that rank's.
  void check_holds_shard(int world, int rank, const char* what) const {
    const shard_range want = shard_of(groups, world, rank); // (refuses a bad world or rank)
    if (want.begin != whole.range().begin || want.end != whole.range().end)
      throw std::invalid_argument(std::string(what) + ": this store holds [" + std::to_string(whole.range().begin) +
                                  ", " + std::to_string(whole.range().end) + ") of the layout, where rank " +
                                  std::to_string(rank) + " of " + std::to_string(world) + " holds [" +
                                  std::to_string(want.begin) + ", " + std::to_string(want.end) +
                                  ") (state_store_options::range = shard_of(groups, world_size, rank); shard=(world_size, rank) in "
                                  "Python)");
  }

  // Before a step's plan: each group's format and seed, from which the plan picks its kernels
  // and rounding keys (the chunks' storage is bound per chunk, in update_part).
  void reset_group_kernels() {
    for (std::size_t g = 0; g < configs.size(); ++g) {
      group_kernels[g].storage = moment_storage{};
      group_kernels[g].storage.format = groups[g].moments;
      group_kernels[g].storage.seed = seeds[g];
    }
  }

  // An applied step's commit: the counts it commits (the tensors in `without` had no
  // gradient: their own counts stay), back where they were if the commit throws; committed,
  // it holds what adopt_at_next_step left pending.
  void commit_step(std::span<const std::size_t> without) {
    const std::vector<std::int64_t> before = lag;
    ++count;
    const std::vector<char> none = tensor_marks(without);
    for (std::size_t t = 0; t < lag.size(); ++t) lag[t] += none[t];
    try {
      commit();
    } catch (...) {
      --count;
      lag = before;
      throw;
    }
    pending.clear();
  }

  // A step's plan: each group's kernel for t = count + 1, and each tensor behind the count
  // its own entry (groups[configs.size() + tensor], step_plan's step_tensors) that every
  // chunk's pieces of it point at.
  template <class NormFn>
  step_plan plan(const step_io& io, const step_options& opts, NormFn&& norm) {
    reset_group_kernels();
    step_plan pl = step_plan::make(*kernels, configs, count, io, opts, std::forward<NormFn>(norm), group_kernels,
                                   {whole.segments(), lag, whole.piece_tensor(), whole_pieces});
    if (pl.decision().apply && any_lag()) // (otherwise every piece is at its group: reset_pieces)
      for (chunk& c : chunks)
        for (std::size_t k = 0; k < c.pieces.size(); ++k) {
          const std::size_t t = c.layout.piece_tensor()[k];
          c.pieces[k].group = lag[t] ? configs.size() + t : whole.segments()[t].group;
        }
    return pl;
  }
  // The pieces of a step's tensors without a gradient (`without`): skipped by the kernels,
  // their parameters copied out unchanged.
  void mark_without_grad(std::span<const std::size_t> without) {
    const std::vector<char> none = tensor_marks(without);
    for (chunk& c : chunks)
      for (std::size_t k = 0; k < c.pieces.size(); ++k) c.pieces[k].no_grad = none[c.layout.piece_tensor()[k]];
  }
  // After a step: every piece back at its group (what the exports read) with a gradient.
  void reset_pieces() {
    auto reset = [&](std::vector<update_piece>& pieces, std::span<const std::size_t> tensor) {
      for (std::size_t k = 0; k < pieces.size(); ++k) {
        pieces[k].group = whole.segments()[tensor[k]].group;
        pieces[k].no_grad = false;
      }
    };
    reset(whole_pieces, whole.piece_tensor());
    for (chunk& c : chunks) reset(c.pieces, c.layout.piece_tensor());
  }

  // Masters a front set for the next applied step (adopt_at_next_step): sorted, disjoint
  // ranges, each with its values.
  struct pending_range {
    arena_range range;
    std::vector<float> values;
  };
  std::vector<pending_range> pending;
  // The pending values that fall in chunk c, into its staging masters (before its update).
  void adopt_pending(chunk& c) {
    const std::size_t c_begin = flat_at(c), c_end = c_begin + c.range.size();
    auto it = std::lower_bound(pending.begin(), pending.end(), c_begin,
                               [](const pending_range& p, std::size_t at) { return p.range.end <= at; });
    for (; it != pending.end() && it->range.begin < c_end; ++it) {
      const std::size_t lo = std::max(it->range.begin, c_begin), hi = std::min(it->range.end, c_end);
      std::memcpy(c.storage.params() + (lo - c_begin), it->values.data() + (lo - it->range.begin),
                  (hi - lo) * sizeof(float));
    }
  }
  // Adopt ranges (step's and adopt_at_next_step's): sorted, disjoint, non-empty, held.
  void check_adopt_ranges(std::span<const arena_range> adopt, const char* what) const {
    for (std::size_t i = 0; i < adopt.size(); ++i)
      if (adopt[i].begin >= adopt[i].end || adopt[i].end > end() || (i && adopt[i].begin < adopt[i - 1].end))
        throw std::invalid_argument(std::string(what) + ": adopt[" + std::to_string(i) + "] = [" +
                                    std::to_string(adopt[i].begin) + ", " + std::to_string(adopt[i].end) +
                                    "): expected sorted, disjoint, non-empty ranges within [0, " +
                                    std::to_string(end()) + ")");
  }
  void check_usable(const char* what) const {
    if (closed) throw std::runtime_error(std::string(what) + ": this stored optimizer is closed");
    if (!broken.empty()) throw std::runtime_error(std::string(what) + ": " + broken);
  }
  // After a failure: every request in flight finished (their buffers are ours), errors
  // dropped, and the chunks this attempt wrote forgotten (a retry writes them all again).
  void drain() noexcept {
    for (auto& store : stores) {
      store->drain();
      if (store->in_flight() == 0) store->forget_writes();
    }
  }

  // The streaming of every chunk through the staging buffers, a chunk at a time: stream()
  // runs it to the end; a chunked step as its ranges arrive. Reads run buffers - 2 chunks
  // ahead; writing without reading (fill) starts from zeroed buffers. After a failure the
  // caller drains (drain()): the buffers in flight are ours again.
  struct streaming {
    bool read = false, write = false;
    std::size_t ahead = 0;
  };
  streaming stream_open(bool read, bool write) {
    const streaming st{read, write, read ? staging.size() - 2 : 0};
    std::fill(read_done.begin(), read_done.end(), char(!read));
    std::fill(write_done.begin(), write_done.end(), 0);
    for (std::size_t k = 0; k < std::min(st.ahead, chunks.size()); ++k) start_read(k, staging[k % staging.size()]);
    return st;
  }
  // Chunk k in its staging buffer (read, or zeroed), its storage bound there.
  chunk& stream_enter(const streaming& st, std::size_t k) {
    const std::size_t buffers = staging.size();
    drive::chunk_store::staging& buf = staging[k % buffers];
    if (st.read) {
      while (!read_done[k]) settle(k);
    } else if (st.write && k >= buffers) {
      while (!write_done[k - buffers]) settle(k - buffers);
    }
    if (!st.read) std::memset(buf.payload(), 0, chunk_bytes);
    chunks[k].storage.bind(buf.payload());
    return chunks[k];
  }
  // Chunk k done with: written back (write), and the read ahead moved on into a buffer whose
  // write has finished.
  void stream_leave(const streaming& st, std::size_t k) {
    const std::size_t buffers = staging.size(), next = k + st.ahead;
    if (st.write) start_write(k, staging[k % buffers]);
    if (st.read && next < chunks.size()) {
      if (next >= buffers)
        while (st.write && !write_done[next - buffers]) settle(next - buffers);
      start_read(next, staging[next % buffers]);
    }
  }
  // Every chunk's request finished (the writes: then a commit may follow).
  void stream_close(const streaming& st) {
    for (std::size_t k = 0; k < chunks.size(); ++k)
      while (!(st.write ? write_done[k] : read_done[k])) settle(k);
  }
  // Streams every chunk: `visit(k, chunk bound to its buffer)`, then (write) written back.
  template <class Visit>
  void stream(bool read, bool write, Visit&& visit) {
    try {
      const streaming st = stream_open(read, write);
      for (std::size_t k = 0; k < chunks.size(); ++k) {
        visit(k, stream_enter(st, k));
        stream_leave(st, k);
      }
      stream_close(st);
    } catch (...) {
      drain();
      throw;
    }
  }

  // One chunk's update by the step's kernels, in its staging buffer.
  block_counts update(const chunk& c, const void* grad, std::size_t grad_bytes, void* out, dtype out_type) {
    return update_part(c, 0, c.range.size(), static_cast<const char*>(grad) + flat_at(c) * grad_bytes, grad_bytes,
                       out ? static_cast<char*>(out) + flat_at(c) * dtype_size(out_type) : nullptr, out_type);
  }
  // Elements [lo, hi) of a chunk (its own indices): `grad`, `out` and `accumulator` point at
  // element lo's (a chunked step's range may start or end inside a chunk).
  block_counts update_part(const chunk& c, std::size_t lo, std::size_t hi, const void* grad, std::size_t grad_bytes,
                           void* out, dtype out_type, const float* accumulator = nullptr,
                           add_grad_fn add_grad = nullptr) {
    const std::size_t out_bytes = out ? dtype_size(out_type) : 0;
    for (std::size_t g = 0; g < configs.size(); ++g) {
      chunk_kernels[g] = group_kernels[g];
      chunk_kernels[g].storage = c.storage.kernel_storage(g, seeds[g]);
    }
    for (const update_piece& piece : c.pieces)
      if (piece.group >= configs.size()) { // a tensor behind the count: its own entry, its group's storage
        const std::size_t g = whole.segments()[piece.group - configs.size()].group;
        chunk_kernels[piece.group] = group_kernels[piece.group];
        chunk_kernels[piece.group].storage = c.storage.kernel_storage(g, seeds[g]);
      }
    update_job j;
    j.params = c.storage.params();
    j.exp_avg = c.storage.flat_array(1).data();
    j.exp_avg_sq = c.storage.flat_array(2).data();
    j.pieces = c.pieces.data();
    j.num_pieces = c.pieces.size();
    j.groups = chunk_kernels.data();
    j.grad_elem_bytes = grad_bytes;
    j.out_elem_bytes = out_bytes;
    j.begin = lo;
    j.end = hi;
    j.index_origin = c.range.begin; // compressed moments round by layout index, as in RAM
    j.flat_grad = grad;
    j.flat_out = out;
    j.flat_origin = lo;
    j.flat_accumulator = accumulator;
    j.add_grad = add_grad;
    const block_counts seen = run_update(j, exec.threads);
    if (out)
      for (const update_piece& piece : c.pieces) { // a tensor without a gradient: its parameters as they are
        const std::size_t a = std::max(lo, piece.offset), b = std::min(hi, piece.offset + piece.size);
        if (!piece.no_grad || a >= b) continue;
        convert_params(c.storage.params() + a, {static_cast<char*>(out) + (a - lo) * out_bytes, b - a, out_type}, exec);
      }
    return seen;
  }

  // A piece's params and moments between a chunk's storage and an in-RAM optimizer's state
  // (holding the same range: its flat element i is ours): to_ram or from it.
  void copy_piece(const chunk& c, const update_piece& piece, const exclusive_state& ram, bool to_ram) const {
    if (!piece.size) return;
    const std::size_t g = piece.group, at = flat_at(c) + piece.offset;
    const moment_format f = groups[g].moments;
    auto move = [&](char* chunk_side, char* ram_side, std::size_t bytes) {
      if (to_ram) std::memcpy(ram_side, chunk_side, bytes);
      else std::memcpy(chunk_side, ram_side, bytes);
    };
    move(reinterpret_cast<char*>(c.storage.params() + piece.offset), ram.data_at(0, g, at), piece.size * 4);
    for (int k = 1; k <= 2; ++k)
      move(c.storage.moment_at(k, g, piece.offset), ram.data_at(k, g, at), piece.size * moment_code_bytes(f));
    if (f == moment_format::q8)
      move(c.storage.moment_at(3, g, piece.offset), ram.data_at(3, g, at),
           2 * ((piece.size + q8_block - 1) / q8_block));
  }

  void check_same_state(const exclusive_state& ram, const char* what) const {
    const auto segs = ram.segments();
    bool same = ram.range().begin == whole.range().begin && ram.range().end == whole.range().end &&
                segs.size() == whole.segments().size() &&
                ram.formats() == formats_of(groups);
    for (std::size_t i = 0; same && i < segs.size(); ++i) {
      const segment &a = segs[i], &b = whole.segments()[i];
      same = a.name == b.name && a.shape == b.shape && a.offset == b.offset && a.group == b.group;
    }
    if (!same) {
      auto text = [](arena_range r) { return "[" + std::to_string(r.begin) + ", " + std::to_string(r.end) + ")"; };
      bool same_layout = segs.size() == whole.segments().size();
      for (std::size_t i = 0; same_layout && i < segs.size(); ++i) {
        const segment &a = segs[i], &b = whole.segments()[i];
        same_layout = a.name == b.name && a.shape == b.shape && a.offset == b.offset && a.group == b.group;
      }
      std::string differs;
      if (!same_layout)
        differs = "another layout (tensor names, shapes or groups) than this store's groups";
      else if (ram.formats() != formats_of(groups))
        differs = "other moment formats than this store's groups";
      else
        differs = "the range " + text(ram.range()) + " of the layout, where this store holds " + text(whole.range()) +
                  " (another rank or world size)";
      throw std::invalid_argument(std::string(what) + ": the in-RAM optimizer holds " + differs);
    }
    for (std::size_t g = 0; g < groups.size(); ++g)
      if (ram.seeds()[g] != groups[g].rounding_seed) // (the store's fingerprint holds every group's)
        throw std::invalid_argument(std::string(what) + ": group " + std::to_string(g) + "'s rounding seed is " +
                                    std::to_string(ram.seeds()[g]) + " in the in-RAM optimizer and " +
                                    std::to_string(groups[g].rounding_seed) + " in the groups (a store opens only "
                                    "with the groups it was made from: give them the same seed)");
  }

  // A store of another range (a shard where the whole is asked for, another rank's, or the
  // whole where a shard is) is refused naming both ranges.
  void check_same_range(const std::vector<std::uint64_t>& w, const std::string& dir) const {
    if (w.size() <= w_layout_end) return; // (written before the range words: the fingerprint decides)
    const bool stored_whole = w[w_range_begin] == 0 && w[w_range_end] == w[w_layout_end];
    if (stored_whole && whole.whole()) return; // (another model: the layout checks name it)
    auto text = [](std::uint64_t b, std::uint64_t e) { return "[" + std::to_string(b) + ", " + std::to_string(e) + ")"; };
    const std::string have = stored_whole ? "the whole layout" : "the range " + text(w[w_range_begin], w[w_range_end]) +
                                                                     " of the layout (a shard)";
    const std::string want = whole.whole() ? "the whole layout" : "the range " + text(whole.range().begin,
                                                                                        whole.range().end);
    if (stored_whole != whole.whole() || w[w_range_begin] != whole.range().begin || w[w_range_end] != whole.range().end)
      throw std::runtime_error("the store in " + dir + " holds " + have + ", not " + want +
                               " (state_store_options.range, shard= in Python: each rank opens its own store)");
  }

  void create_stores(const state_store_options& o) {
    const std::size_t n = o.dirs.size();
    if (n > chunks.size())
      throw std::invalid_argument("state_store_options.dirs: " + std::to_string(n) + " directories for " +
                                  std::to_string(chunks.size()) + " chunks (a smaller chunk_elements, or fewer "
                                  "directories: each needs a chunk)");
    for (std::size_t i = 0; i < n; ++i)
      stores.push_back(std::make_unique<drive::chunk_store>(drive::chunk_store::create(
          o.dirs[i], shape(i, n), durability_of(o), o.buffers, drive::parse_io_backend(o.io, "state_store_options.io"))));
    first_dir = o.dirs[0];
    dirs = o.dirs;
    sync = o.sync_every_step;
    make_staging(o.buffers);
  }

  // The open chunked step (chunk_updater: begin_step .. finish_step, what an offload
  // pipeline drives; streamed_chunked_step.cpp): what begin_step decided, how far its ranges
  // have come, and where the streaming stands.
  detail::chunked_step chunked;
  streaming chunked_stream;
  std::size_t chunked_at = 0;    // the chunk the next range starts in (those before it are written back)
  bool chunked_entered = false;  // chunk chunked_at is in its staging buffer
  std::string chunked_failed;    // why its streaming stopped ("" while it goes on)
  add_grad_fn chunked_add_grad = nullptr;
  // read_params' chunk of the committed step, read beside any streaming into a buffer of its
  // own, and kept while no commit replaces it (a pipeline reads a chunk a range at a time).
  mutable std::optional<drive::chunk_store::staging> read_buffer;
  mutable std::size_t read_chunk = ~std::size_t(0);
  mutable std::uint64_t read_commit = 0;
  void check_chunk_options(const chunk_step_options& o) const {
    check_dtype("grad_type", o.grad_type);
    if (o.copy_out) check_dtype("out_type", o.out_type);
    check_tensors_without_grad(o.tensors_without_grad, lag.size(), whole.whole(), "begin_step");
  }
  // Ends the chunked step (finished, failed or aborted): the turn goes to the next caller.
  void close_chunked() {
    reset_pieces();
    chunked.close();
    chunked_entered = false;
    turns.close_chunked();
  }
};

} // namespace hostopt
