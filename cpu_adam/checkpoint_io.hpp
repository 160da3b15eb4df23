#pragma once
// Checkpoint writing and reading with extra metadata: what the sharded optimizer uses to
// tie the shard files of one save together (save id, step, range). See checkpoint.hpp.

#include <map>
#include <span>
#include <string>

#include "hostopt/optimizer.hpp"

namespace hostopt::detail {

using checkpoint_metadata = std::map<std::string, std::string>;

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

} // namespace hostopt::detail
