#pragma once
// An optimizer whose state lives on a local drive, not in RAM: every step streams it through a
// few staging buffers (read chunk k+d ahead, update chunk k with the same fused kernels as the
// in-RAM optimizer, write chunk k-1 back), and after every applied step what is on the drive
// IS that step, verified (drive/chunk_store: two slots per chunk, a commit record last).
// Its steps give the in-RAM optimizer's bits, for every moment format and kernel.
//
// Link hostopt::store (the installed package's target; it brings hostopt::hostopt).
//
// It is a chunk_updater: an offload_pipeline drives it as it drives the in-RAM optimizer,
// gradients in and parameters out a chunk at a time around the streamed step.
//
// Per-tensor steps, as the in-RAM optimizer's: a tensor named without a gradient in a step
// keeps its parameters, moments and own step count (torch's per-parameter "step"), and each
// commit keeps the tensors' counts.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "hostopt/optimizer.hpp"

namespace hostopt {

/// Where and how the state is kept.
struct state_store_options {
  /// Existing directories on local drives with O_DIRECT (not tmpfs), one per drive: the
  /// store's files go there (chunks: 2 x the state in all; commit; lock; in the first,
  /// hyperparameters and, once a tensor's count lags, tensor_steps: copy them all). Several
  /// stripe the chunks (chunk k in dirs[k % n]); open names them as create did, in the same
  /// order.
  std::vector<std::string> dirs;
  /// RAM for the staging buffers: buffers x chunk bytes stays within it.
  std::size_t staging_bytes = std::size_t(256) << 20;
  /// Staging buffers (at least 3): chunks read ahead = buffers - 2, one updated, one written.
  unsigned buffers = 8;
  /// Chunk size in elements (a multiple of the layout's unit, 16 or 32); 0: from the budget.
  /// A store keeps the chunking it was created with.
  std::size_t chunk_elements = 0;
  /// true: each commit is durable (fdatasync) — a power loss keeps it too; false: a killed
  /// process keeps every commit, a power loss may take the last ones.
  bool sync_every_step = true;
  /// "auto" (io_uring, else threads), "io_uring" or "threads".
  std::string io = "auto";
  /// A range of the layout to hold: a rank's shard, shard_of(groups, world_size, rank), each
  /// rank its own store (its own dirs). step's buffers are then that range's slice of the
  /// flat layout (what a reduce-scatter gives and an all-gather takes), as sharded_optimizer's,
  /// and a checked or clipping step needs the global norm (step_options::known_grad_norm).
  /// Unset: the whole layout. A store opens only with the range it was created with.
  std::optional<arena_range> range;
};

class stored_optimizer final : public chunk_updater {
public:
  /// A new store in options.dirs (refused where one exists) holding the groups' state at step
  /// 0: zero moments, and `initial_params` (f32, the flat layout of the range held:
  /// arena_size() elements) or zero params. Committed before it returns.
  static stored_optimizer create(std::vector<param_group> groups, const state_store_options& options,
                                 execution_options exec = {}, const_view initial_params = {});
  /// A new store holding `ram`'s whole state (params, moments, counters): an import. The
  /// groups must be ram's (their rounding seeds too: a store reopens only with them), and
  /// ram must hold the options' range (an optimizer made with that range for a shard); the
  /// store keeps ram's hyper-parameters.
  static stored_optimizer create(const optimizer& ram, std::vector<param_group> groups,
                                 const state_store_options& options);
  /// The store in options.dirs at its last committed step, every chunk verified. Where a
  /// chunk of that step is bad (a power loss without sync_every_step, a corrupt slot) and the
  /// step before verifies whole, it opens there (recovery() says so). Striped stores killed
  /// between their stripes' commits open at the step all of them hold. Refused
  /// (std::runtime_error naming it): no store, another layout, format or seed, a store open
  /// elsewhere, a corrupt or truncated chunk or record in both steps, stripes named in
  /// another order. The hyper-parameters are those of the step it opens at, as
  /// load_checkpoint restores a file's: each commit keeps them (a small record beside the
  /// first directory's chunks, written before the commit). The groups' are used where the
  /// store keeps none (made before hostopt kept them) or the record cannot be read
  /// (recovery() says so); set_group_config changes them for later steps.
  static stored_optimizer open(std::vector<param_group> groups, const state_store_options& options,
                               execution_options exec = {});
  /// As open, then back to the applied step before the last, for good: its state and
  /// counters (skipped steps since then undone too), e.g. to undo a step found bad after it
  /// committed. Every stripe's record of that step is verified, and found to be one commit,
  /// before any stripe erases its later one; the erasure is durable whatever
  /// sync_every_step says. Where the last step could not be opened (a bad chunk: open falls
  /// back, recovery() says so), it stands at the step open fell back to. Refused
  /// (std::runtime_error naming it, nothing rolled back): the store stands at the step it
  /// was created with; a step that failed or was killed midway has begun writing over the
  /// slots of the step before the last; the store went back already; a step was killed
  /// between the stripes' commits.
  static stored_optimizer open_previous(std::vector<param_group> groups, const state_store_options& options,
                                        execution_options exec = {});

  stored_optimizer(stored_optimizer&&) noexcept;
  stored_optimizer(const stored_optimizer&) = delete;
  stored_optimizer& operator=(const stored_optimizer&) = delete;
  stored_optimizer& operator=(stored_optimizer&&) noexcept;
  ~stored_optimizer();

  /// One step with a flat gradient (arena_size() elements) and an optional flat copy-out, as
  /// optimizer::step. Buffers and options are checked before any I/O. An applied step is
  /// committed when this returns; one that throws while streaming (an I/O error, a bad
  /// chunk) leaves the store and this object at the previous step — and flat_out partly
  /// written. One that throws while committing leaves the store unknown: every later step
  /// is refused, and reopening finds the step the drive holds. A skipped step (non-finite
  /// gradients) touches no drive: its count is committed with the next applied step.
  step_result step(const_view flat_grad, mut_view flat_out, const step_options& options);
  step_result step(const_view flat_grad, mut_view flat_out = {}, float grad_scale = 1.0f);
  /// step(), first setting the master parameters of the flat ranges `adopt` (sorted,
  /// disjoint [begin, end) element ranges of flat buffers) to `flat_params`' values there
  /// (float32, arena_size() elements; read nowhere else): a front adopting parameters its
  /// user wrote since the last step, as the in-RAM optimizer's parameters are its masters.
  /// Committed with the step; a skipped step adopts nothing (adopt again at the next).
  /// `tensors_without_grad` (indices into segments(); a store of the whole layout) had no
  /// gradient in this step, as torch skips a parameter whose .grad is None: their elements
  /// of flat_grad are never read, their parameters, moments and own step count stay, and
  /// flat_out gets their parameters unchanged.
  step_result step(const_view flat_grad, mut_view flat_out, const step_options& options, const_view flat_params,
                   std::span<const arena_range> adopt, std::span<const std::size_t> tensors_without_grad = {});
  /// Sets the master parameters of the flat ranges `adopt` (sorted, disjoint) to `values`
  /// (the ranges' elements one after the other) at the next applied step, whole or chunked
  /// (an offload pipeline's), as it reads each chunk and before it updates it: a front
  /// adopting what its user wrote into parameters that live on a device, with RAM for those
  /// values only. Committed with that step; kept across skipped, failed and aborted steps
  /// (their store holds the step before); replaces what an earlier call left pending (an
  /// empty `adopt` clears it); lost when the store is closed. Checked first, nothing changed
  /// on error.
  void adopt_at_next_step(std::span<const arena_range> adopt, std::span<const float> values);
  /// Elements adopt_at_next_step left for the next applied step.
  std::size_t pending_adoption() const;

  std::int64_t step_count() const override;
  std::int64_t skipped_steps() const;
  /// Each tensor's own step count, in segments() order (optimizer::tensor_steps): the applied
  /// steps that gave it a gradient. The bias correction of its next step uses its own count.
  std::vector<std::int64_t> tensor_steps() const;
  /// Elements of a flat gradient or copy-out: the range held (padding included).
  std::size_t arena_size() const override;
  /// The part of the layout held: [0, arena_end) unless options.range named a shard.
  arena_range range() const;
  /// The whole layout's tensors (layout offsets), as optimizer::segments.
  std::span<const segment> segments() const;
  std::size_t num_groups() const;
  adam_config group_config(std::size_t group) const;
  /// Replaces a group's hyper-parameters for later steps (schedules); validated first.
  void set_group_config(std::size_t group, const adam_config& config);
  void set_lr(std::size_t group, double lr);

  /// The streaming: chunks of the arena, each one's bytes on the drive (a multiple of 4 KiB),
  /// the staging RAM (buffers x (chunk bytes + 4 KiB stamp), and read_params' buffer once it
  /// has one; 0 once closed), and the I/O backend in use.
  std::size_t chunks() const;
  std::size_t chunk_elements() const;
  std::size_t chunk_bytes() const;
  std::size_t staging_bytes() const;
  /// Directories the chunks are striped over.
  std::size_t stripes() const;
  std::string io_backend() const;
  /// Bytes read and written by one applied step (every chunk's slot, stamps included).
  std::uint64_t step_io_bytes() const;
  /// Pages of the store's chunk files in the page cache: 0 when its I/O bypassed it.
  std::uint64_t cached_pages() const;
  /// What open did where the last step could not be opened whole ("" when it opened
  /// there): a fallback, stripes brought to one step, or hyper-parameters it could not read.
  std::string recovery() const;
  /// Releases the store (its files' lock, its staging memory): another process may open it.
  /// Every completed step is on the drive already; later steps and exports are refused.
  void close();

  /// Reads the whole state into `ram` (an optimizer of the same groups holding the store's
  /// range: the whole layout, or the shard's): params, moments, counters, seeds — an export
  /// (then ram.save_checkpoint), or a
  /// check against an in-RAM run. Refused before anything changes for another layout;
  /// an I/O error midway leaves `ram` marked failed (not usable until it is loaded).
  void copy_state_to(optimizer& ram) const;

  /// The master parameters of the last completed step, streamed from the drive (every chunk
  /// verified as a step's reads are) into `flat_out` (arena_size() elements; float32, or
  /// bfloat16 / float16 rounded as the step's copy-out rounds them): what a resumed run puts
  /// back into its model. The padding between tensors is left as it is; the state is not
  /// changed, and needs no RAM beyond the staging buffers. An I/O error or a bad chunk
  /// throws with flat_out partly written.
  void copy_params_to(mut_view flat_out) const;

  /// Writes the last completed step as a checkpoint file (save_checkpoint's format, the same
  /// bytes as saving an optimizer that copy_state_to filled), streamed: every chunk read
  /// once (verified), its pieces written where the file holds them, the file then read back
  /// once for its checksum; no RAM beyond the staging buffers. Atomic as save_checkpoint;
  /// the same paths are refused. A store of a shard is refused (std::invalid_argument):
  /// save_shard writes its part of a sharded checkpoint.
  void save_checkpoint(const std::string& path) const;
  /// A rank's part of a sharded checkpoint (sharding.hpp's format: the file
  /// sharded_optimizer::save writes, the same bytes as saving a sharded_optimizer that
  /// copy_state_to filled), streamed as save_checkpoint streams. This store must hold rank
  /// `rank`'s shard of `world_size` (options.range = shard_of(groups, world_size, rank)),
  /// else std::invalid_argument naming both ranges; `save_id` and `dir` as
  /// sharded_optimizer::save takes them. After every rank's save returned, rank 0 commits
  /// it (commit_shard_save, or a sharded_optimizer's commit_save); the checkpoint then loads
  /// into a sharded_optimizer of any world size.
  void save_shard(const std::string& dir, const std::string& save_id, int world_size, int rank) const;
  /// Rank 0's commit of a sharded save, as sharded_optimizer::commit_save: every shard file
  /// verified, index.json written atomically, other saves' shard files removed. This store
  /// must hold rank 0's shard of `world_size`.
  void commit_shard_save(const std::string& dir, const std::string& save_id, int world_size) const;

  // --- chunked steps (chunk_updater: what the offload pipeline drives) -----------------
  // The ranges a step's gradients arrive in need not be the store's chunks: a range may start
  // or end inside one, or cover several. The store's chunks stream as a whole step streams
  // them: read ahead from begin_step on, updated as ranges cover them, written back once
  // covered; finish_step waits for the writes and commits. The steps' bits are the in-RAM
  // optimizer's, whatever the ranges. Every other public operation waits while another
  // thread's chunked step is open, and is refused (std::logic_error) on the thread that has
  // one open, but read_params.

  /// Chunks of a step end on multiples of this (16, or 32 with 8-bit moments) or at the end.
  std::size_t chunk_unit() const override;
  /// What begin_step would refuse, checked without starting anything.
  void check_options(const chunk_step_options& options) const override;
  /// Decides the step as step() does (a check that needs the gradients' norm needs
  /// options.checks.known_grad_norm); a skipped one is counted, committed with the next
  /// applied step. tensors_without_grad as step() takes them (refused on a store of a
  /// shard). Starts reading the first chunks.
  step_result begin_step(const chunk_step_options& options) override;
  /// Updates elements [begin, end) (the next range): `grad`, `out` and `accumulator` point at
  /// element begin's. Blocks while the drive reads the chunks it needs. An I/O error or a bad
  /// chunk throws; the step can then only be aborted.
  void update_range(std::size_t begin, std::size_t end, const void* grad, void* out = nullptr,
                    const float* accumulator = nullptr) override;
  /// Waits for the writes and commits the step, as step() commits one: an error here leaves
  /// the store at the step before (a failed commit record: not usable, reopen it). The
  /// chunked step is closed either way.
  step_result finish_step() override;
  /// Closes the open step without applying it. Unlike the in-RAM optimizer, a store whose
  /// step was aborted after some ranges stays usable: the drive holds the step before, and
  /// the next step writes every chunk again. (As after a whole step that failed midway, the
  /// chunks it wrote went over the slots of the step before the last: open_previous is then
  /// refused, and open has no earlier step to fall back to.)
  void abort_step(const std::string& reason) noexcept override;
  /// A micro-batch into the caller's f32 accumulator; touches no state.
  void accumulate_range(std::size_t begin, std::size_t end, float* acc, const void* grad, dtype grad_type,
                        bool first) override;
  /// The committed step's parameters of [begin, end), rounded to `type` (padding as zeros),
  /// read from the drive whatever an open step has updated: what a device copy holds before
  /// the step commits. A chunk is read once into a buffer of its own (one more chunk of
  /// staging RAM, allocated on first use) and kept until the next commit.
  void read_params(std::size_t begin, std::size_t end, void* out, dtype type) const override;
  /// Refuses every later step and export with `reason` (a device the pipeline drives
  /// failed), closing this thread's open step; reopening the store ends it.
  void mark_unusable(const std::string& reason) noexcept override;
  /// true: a chunked step commits whole at finish_step or not at all.
  bool commits_whole_steps() const override { return true; }
  /// False once closed, after a failed commit record, or after mark_unusable.
  bool usable() const override;
  std::string failure_reason() const override;

private:
  struct impl;
  explicit stored_optimizer(std::unique_ptr<impl> s);
  static stored_optimizer open_store(std::vector<param_group> groups, const state_store_options& options,
                                     execution_options exec, bool previous);
  std::unique_ptr<impl> impl_;
};

} // namespace hostopt
