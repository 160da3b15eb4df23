#pragma once
// Checkpoint writing and reading with extra metadata: what the sharded optimizer uses to
// tie the shard files of one save together (save id, step, range). See checkpoint.hpp.

#include <cstdint>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "hostopt/optimizer.hpp"

namespace hostopt::detail {

using checkpoint_metadata = std::map<std::string, std::string>;

/// What a checkpoint records besides the data: an in-RAM optimizer's state, or a state
/// store's (which is not in RAM).
struct checkpoint_description {
  std::span<const segment> segs; // the whole layout
  arena_range range;             // the part of it held
  std::vector<moment_format> formats;
  std::vector<adam_config> configs;
  std::vector<std::uint64_t> seeds;
  std::int64_t step_count = 0, skipped_steps = 0;
  std::vector<std::int64_t> tensor_lags; // empty: every tensor at step_count
};

/// Hands a streamed save one piece of tensor segs[tensor]'s entry `kind` (0 param, 1
/// exp_avg, 2 exp_avg_sq, 3 moment_scales), from the tensor's element `first` on, as the
/// in-RAM arena holds it (scales: whole 32-element blocks).
using checkpoint_put = std::function<void(std::size_t tensor, int kind, std::size_t first, const void* data,
                                          std::size_t bytes)>;

/// The checkpoint save_checkpoint writes of an optimizer holding the state `d` describes —
/// the same bytes — from pieces `fill` hands over through its argument in any order, every
/// byte of every entry once (a state store streams its chunks). Written where the pieces
/// go, then read back once for the checksum; atomic as save_checkpoint (any failure,
/// a missing or stray piece included, leaves `path` as it was). `extra` as save_checkpoint's.
void save_checkpoint_streamed(const checkpoint_description& d, const std::string& path,
                              const std::function<void(const checkpoint_put&)>& fill,
                              const checkpoint_metadata& extra = {});

/// save_checkpoint, with `extra` entries added to __metadata__ (covered by the checksum;
/// keys must not collide with hostopt's own).
void save_checkpoint(const optimizer& opt, const std::string& path, const checkpoint_metadata& extra);

/// load_checkpoint that also refuses the file unless its __metadata__ has every entry of
/// `expected` with the same value; the file's values of the keys named in `read_back` are
/// returned through it (for the caller's own checks).
void load_checkpoint(optimizer& opt, const std::string& path, const checkpoint_metadata& expected,
                     checkpoint_metadata* read_back = nullptr);

/// Loads `opt` (whole, or a range of its layout) from files that each hold a range of the
/// same layout and save — a single whole file, or the shard files of any world size —
/// reading from each only the ranges `opt` holds, never a whole old shard into memory.
/// expected[f] (when given) must match file f's metadata. Every file is verified
/// completely (structure, then a streaming checksum pass) before anything changes; the
/// files must agree on step, skipped steps and hyper-parameters and cover opt's range.
void load_checkpoint(optimizer& opt, std::span<const std::string> paths, std::span<const checkpoint_metadata> expected,
                     checkpoint_metadata* read_back = nullptr);

/// Verifies the structure of a checkpoint of `layout` (and with `verify` its checksum,
/// streaming the data) and returns the __metadata__ values of the keys in `values`.
void read_checkpoint_metadata(const std::string& path, std::span<const segment> layout, checkpoint_metadata& values,
                              bool verify = false);

// A sharded checkpoint's files (sharded_optimizer's save and commit_save, which a state store
// holding a rank's shard writes too).

/// Where rank `rank` of `world` writes its shard of save `save_id` in `dir`
/// (DIR/shard-RANK-of-WORLD.SAVE_ID.safetensors), after checking the directory and the id
/// (std::invalid_argument: a bad id, or the id of the save DIR's index.json commits).
std::string shard_save_path(const std::string& dir, const std::string& save_id, int rank, int world);
/// The __metadata__ entries a shard file carries besides hostopt's own.
checkpoint_metadata shard_save_metadata(const std::string& save_id, int rank, int world);
/// Rank 0's commit of save `save_id` (after every rank saved): verifies every shard file,
/// writes index.json atomically, then removes other saves' shard files.
void commit_shard_save(const std::string& dir, const std::string& save_id, std::span<const segment> segs,
                       std::size_t arena, int world, std::size_t unit);

} // namespace hostopt::detail
