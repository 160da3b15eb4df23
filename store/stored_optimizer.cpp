// The optimizer state on a drive, streamed through staging buffers each step: chunks of the
// arena are laid out as an optimizer holding that range (a shard) would lay them out in RAM,
// so each chunk is updated in its staging buffer by the in-RAM optimizer's own plan and
// kernels (same bits), and drive::chunk_store makes each step a commit.
#include "hostopt/stored_optimizer.hpp"

#include <algorithm>
#include <random>
#include <filesystem>
#include <cstring>
#include <stdexcept>

#include "buffer_checks.hpp"
#include "checksum.hpp"
#include "checkpoint_io.hpp"
#include "chunk_store.hpp"
#include "exclusive_state.hpp"
#include "held_layout.hpp"
#include "hyperparameter_record.hpp"
#include "hostopt/gradient_checks.hpp"
#include "kernel_registry.hpp"
#include "parallel.hpp"
#include "state_storage.hpp"
#include "step_plan.hpp"
#include "update_engine.hpp"

namespace hostopt {

using namespace detail;

namespace {

// The commit words: what kind of store, its chunking, and the optimizer's counters.
constexpr std::uint64_t store_kind = 0x686f73746f707431; // "hostopt1"
// The range words came with stores of a range (a shard): records written before them have
// w_range_begin words (the range is then in the fingerprint alone). w_hyperparameters (1:
// each commit keeps its hyper-parameters, hyperparameter_record.hpp) came after: records
// before it have w_hyperparameters words. An older hostopt refuses a record of more words
// than it knows.
enum word : std::size_t {
  w_kind, w_chunk_elements, w_count, w_skipped, w_stripes, w_stripe, w_commit_id,
  w_range_begin, w_range_end, w_layout_end, w_hyperparameters, num_words
};

drive::durability durability_of(const state_store_options& o) {
  return o.sync_every_step ? drive::durability::sync : drive::durability::none;
}

void check_options(const state_store_options& o) {
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

std::vector<moment_format> formats_of(const std::vector<param_group>& groups) {
  std::vector<moment_format> f;
  for (const param_group& g : groups) f.push_back(g.moments);
  return f;
}

std::size_t round_up(std::size_t x, std::size_t unit) { return (x + unit - 1) / unit * unit; }

} // namespace

struct stored_optimizer::impl {
  // One chunk of the arena: laid out as an optimizer holding [range) lays out its state.
  struct chunk {
    arena_range range;
    held_layout layout;
    state_storage storage; // external: bound to its staging buffer when used
    std::vector<update_piece> pieces;
  };

  mutable std::mutex lock; // every public operation, one at a time
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
    group_kernels.resize(configs.size());
    chunk_kernels.resize(configs.size());
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

  // Streams every chunk through the staging buffers: `visit(k, storage bound to its buffer)`,
  // then (write) written back. Reads run buffers - 2 chunks ahead. Writing without reading
  // (fill) starts from zeroed buffers.
  template <class Visit>
  void stream(bool read, bool write, Visit&& visit) {
    const std::size_t n = chunks.size(), buffers = staging.size();
    const std::size_t ahead = read ? buffers - 2 : 0;
    std::fill(read_done.begin(), read_done.end(), char(!read));
    std::fill(write_done.begin(), write_done.end(), 0);
    try {
      for (std::size_t k = 0; k < std::min(ahead, n); ++k) start_read(k, staging[k % buffers]);
      for (std::size_t k = 0; k < n; ++k) {
        drive::chunk_store::staging& buf = staging[k % buffers];
        if (read) {
          while (!read_done[k]) settle(k);
        } else if (write && k >= buffers) {
          while (!write_done[k - buffers]) settle(k - buffers);
        }
        if (!read) std::memset(buf.payload(), 0, chunk_bytes);
        chunks[k].storage.bind(buf.payload());
        visit(k, chunks[k]);
        if (write) start_write(k, buf);
        const std::size_t next = k + ahead;
        if (read && next < n) {
          if (next >= buffers)
            while (write && !write_done[next - buffers]) settle(next - buffers);
          start_read(next, staging[next % buffers]);
        }
      }
      for (std::size_t k = 0; k < n; ++k)
        while (!(write ? write_done[k] : read_done[k])) settle(k);
    } catch (...) {
      drain();
      throw;
    }
  }

  // One chunk's update by the step's kernels, in its staging buffer.
  block_counts update(const chunk& c, const void* grad, std::size_t grad_bytes, void* out, std::size_t out_bytes) {
    for (std::size_t g = 0; g < configs.size(); ++g) {
      chunk_kernels[g] = group_kernels[g];
      chunk_kernels[g].storage = c.storage.kernel_storage(g, seeds[g]);
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
    j.begin = 0;
    j.end = c.range.size();
    j.index_origin = c.range.begin; // compressed moments round by layout index, as in RAM
    j.flat_grad = static_cast<const char*>(grad) + flat_at(c) * grad_bytes;
    j.flat_out = out ? static_cast<char*>(out) + flat_at(c) * out_bytes : nullptr;
    return run_update(j, exec.threads);
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
    if (!ram.tensor_lags().empty())
      throw std::invalid_argument(std::string(what) + ": the in-RAM optimizer's tensors have their own step counts "
                                  "(per-tensor steps): a store keeps one count for all");
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
};

stored_optimizer::stored_optimizer(std::unique_ptr<impl> s) : impl_(std::move(s)) {}
stored_optimizer::stored_optimizer(stored_optimizer&&) noexcept = default;
stored_optimizer& stored_optimizer::operator=(stored_optimizer&&) noexcept = default;
stored_optimizer::~stored_optimizer() = default;

stored_optimizer stored_optimizer::create(std::vector<param_group> groups, const state_store_options& options,
                                          execution_options exec, const_view initial_params) {
  check_options(options);
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
  check_options(options);
  auto s = std::make_unique<impl>(std::move(groups), ram.execution(), options.range);
  const exclusive_state es(ram, "stored_optimizer::create");
  s->check_same_state(es, "stored_optimizer::create");
  s->configs = es.configs();
  s->seeds = es.seeds();
  s->count = es.step_count();
  s->skipped = es.skipped_steps();
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
  check_options(options);
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
                             "Remove the store files (chunks, commit, lock, hyperparameters) in every directory and create it again");
  for (std::size_t i = 0; i < n; ++i) {
    const std::string& dir = options.dirs[i];
    heads.push_back(drive::chunk_store::peek(dir));
    const auto& w = heads.back().words;
    if ((w.size() != num_words && w.size() != w_hyperparameters && w.size() != w_range_begin) ||
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
                                   const_view flat_params, std::span<const arena_range> adopt) {
  impl& s = *impl_;
  const std::lock_guard<std::mutex> lock(s.lock);
  s.check_usable("step");
  if (!adopt.empty()) {
    check_view("flat_params", flat_params.data, flat_params.size, flat_params.type, s.end());
    if (flat_params.type != dtype::f32)
      throw std::invalid_argument("stored_optimizer::step: flat_params holds master parameters: float32 expected");
    for (std::size_t i = 0; i < adopt.size(); ++i)
      if (adopt[i].begin >= adopt[i].end || adopt[i].end > s.end() || (i && adopt[i].begin < adopt[i - 1].end))
        throw std::invalid_argument("stored_optimizer::step: adopt[" + std::to_string(i) + "] = [" +
                                    std::to_string(adopt[i].begin) + ", " + std::to_string(adopt[i].end) +
                                    "): expected sorted, disjoint, non-empty ranges within [0, " +
                                    std::to_string(s.end()) + ")");
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
  s.stat_views.clear();
  for (const update_piece& piece : s.whole_pieces) // per tensor: padding is never read
    s.stat_views.push_back({static_cast<const char*>(flat_grad.data) + piece.offset * dtype_size(flat_grad.type),
                            piece.size, flat_grad.type});
  const step_io io{flat_grad.type, has_out ? std::optional<dtype>(flat_out.type) : std::nullopt, false, false};
  for (std::size_t g = 0; g < s.configs.size(); ++g) { // the plan picks kernels and rounding keys from these
    s.group_kernels[g].storage = moment_storage{};
    s.group_kernels[g].storage.format = s.groups[g].moments;
    s.group_kernels[g].storage.seed = s.seeds[g];
  }
  const step_plan pl = step_plan::make(*s.kernels, s.configs, s.count, io, opts,
                                       [&] { return gradient_stats(s.stat_views, s.exec).norm; }, s.group_kernels);
  if (!pl.decision().apply) {
    step_plan::check_count(s.skipped); // (the skipped count shares the step count's limit)
    ++s.skipped;
    return make_step_result(pl.decision(), s.count, s.skipped);
  }
  block_counts seen;
  const std::size_t gb = dtype_size(flat_grad.type), ob = has_out ? dtype_size(flat_out.type) : 0;
  std::size_t next_adopt = 0; // the first range that does not end before the chunk (chunks come in order)
  s.stream(true, true, [&](std::size_t, impl::chunk& c) {
    const std::size_t c_begin = s.flat_at(c), c_end = c_begin + c.range.size();
    while (next_adopt < adopt.size() && adopt[next_adopt].end <= c_begin) ++next_adopt;
    for (std::size_t i = next_adopt; i < adopt.size() && adopt[i].begin < c_end; ++i) {
      const std::size_t lo = std::max(adopt[i].begin, c_begin), hi = std::min(adopt[i].end, c_end);
      std::memcpy(c.storage.params() + (lo - c_begin), static_cast<const float*>(flat_params.data) + lo,
                  (hi - lo) * sizeof(float));
    }
    const block_counts b = s.update(c, flat_grad.data, gb, has_out ? flat_out.data : nullptr, ob);
    seen.poisoned += b.poisoned;
    seen.saturated += b.saturated;
  });
  ++s.count;
  try {
    s.commit();
  } catch (...) {
    --s.count;
    throw;
  }
  return make_step_result(pl.decision(), s.count, s.skipped, seen);
}

void stored_optimizer::copy_state_to(optimizer& ram) const {
  impl& s = *impl_;
  const std::lock_guard<std::mutex> lock(s.lock);
  s.check_usable("copy_state_to");
  exclusive_state es(ram, "stored_optimizer::copy_state_to", true);
  s.check_same_state(es, "stored_optimizer::copy_state_to");
  try {
    s.stream(true, false, [&](std::size_t, impl::chunk& c) {
      for (const update_piece& piece : c.pieces) s.copy_piece(c, piece, es, true);
    });
    es.set_counters(s.configs, s.count, s.skipped);
    es.set_seeds(s.seeds);
  } catch (const std::exception& e) {
    es.mark_failed(std::string("stored_optimizer::copy_state_to failed midway: ") + e.what());
    throw;
  }
  es.clear_failure();
}

void stored_optimizer::copy_params_to(mut_view flat_out) const {
  impl& s = *impl_;
  const std::lock_guard<std::mutex> lock(s.lock);
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
  const std::lock_guard<std::mutex> lock(s.lock);
  s.check_usable("save_checkpoint");
  if (!s.whole.whole())
    throw std::invalid_argument("stored_optimizer::save_checkpoint: this store holds a shard [" +
                                std::to_string(s.whole.range().begin) + ", " + std::to_string(s.whole.range().end) +
                                ") of the layout: copy_state_to a sharded_optimizer of the same rank, and save that");
  for (const std::string& dir : s.dirs) // (a checkpoint written over the chunks or the commit record would end the store)
    for (const char* own : {"chunks", "commit", "lock", "hyperparameters"}) {
      std::error_code e1, e2;
      const std::filesystem::path mine = std::filesystem::weakly_canonical(std::filesystem::path(dir) / own, e1);
      const std::filesystem::path target = std::filesystem::weakly_canonical(path, e2);
      if (!e1 && !e2 && mine == target)
        throw std::invalid_argument("stored_optimizer::save_checkpoint: '" + path + "' is this store's own " + own +
                                    " file: save the checkpoint elsewhere");
    }
  const std::span<const segment> segs = s.whole.segments();
  const detail::checkpoint_description d{segs, s.whole.range(), formats_of(s.groups), s.configs, s.seeds, s.count,
                                         s.skipped, {}};
  std::size_t i = 0; // the first tensor that does not end before the chunk: chunks come in layout order
  detail::save_checkpoint_streamed(d, path, [&](const detail::checkpoint_put& put) {
    i = 0;
    s.stream(true, false, [&](std::size_t, impl::chunk& c) {
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
  });
}

std::int64_t stored_optimizer::step_count() const {
  const std::lock_guard<std::mutex> lock(impl_->lock);
  return impl_->count;
}
std::int64_t stored_optimizer::skipped_steps() const {
  const std::lock_guard<std::mutex> lock(impl_->lock);
  return impl_->skipped;
}
std::size_t stored_optimizer::arena_size() const { return impl_->end(); }
arena_range stored_optimizer::range() const { return impl_->whole.range(); }
std::span<const segment> stored_optimizer::segments() const { return impl_->whole.segments(); }
std::size_t stored_optimizer::num_groups() const { return impl_->configs.size(); }
adam_config stored_optimizer::group_config(std::size_t group) const {
  const std::lock_guard<std::mutex> lock(impl_->lock);
  if (group >= impl_->configs.size())
    throw std::invalid_argument("group = " + std::to_string(group) + ": expected an index below " +
                                std::to_string(impl_->configs.size()));
  return impl_->configs[group];
}
void stored_optimizer::set_group_config(std::size_t group, const adam_config& config) {
  const std::lock_guard<std::mutex> lock(impl_->lock);
  if (group >= impl_->configs.size())
    throw std::invalid_argument("group = " + std::to_string(group) + ": expected an index below " +
                                std::to_string(impl_->configs.size()));
  validate(config, "set_group_config");
  impl_->configs[group] = config;
}
void stored_optimizer::set_lr(std::size_t group, double lr) {
  const std::lock_guard<std::mutex> lock(impl_->lock);
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
  return impl_->staging.size() * (impl_->chunk_bytes + drive::direct_alignment);
}
std::string stored_optimizer::io_backend() const {
  const std::lock_guard<std::mutex> lock(impl_->lock);
  return impl_->stores.empty() ? "closed" : drive::to_string(impl_->stores[0]->backend());
}
void stored_optimizer::close() {
  const std::lock_guard<std::mutex> lock(impl_->lock);
  impl_->stores.clear(); // (each waits for its I/O, then releases its lock)
  impl_->staging.clear();
  impl_->closed = true;
}
std::uint64_t stored_optimizer::step_io_bytes() const {
  return 2 * std::uint64_t(impl_->chunks.size()) * (impl_->chunk_bytes + drive::direct_alignment);
}
std::size_t stored_optimizer::stripes() const {
  const std::lock_guard<std::mutex> lock(impl_->lock);
  return impl_->stores.size();
}
std::uint64_t stored_optimizer::cached_pages() const {
  const std::lock_guard<std::mutex> lock(impl_->lock);
  std::uint64_t pages = 0;
  for (const auto& store : impl_->stores) pages += store->cached_pages();
  return pages;
}

} // namespace hostopt
