#pragma once
// The hyper-parameters of each committed step of a state store, so that opening the store
// restores them as load_checkpoint does: a step record (step_record_file.hpp) in the file
// "hyperparameters" of the first directory.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "hostopt/adam_config.hpp"

namespace hostopt::detail {

/// Writes `configs` as the hyper-parameters of step `step` (the chunk store's), committed
/// with `commit_id`, into `dir`'s file (made if missing); fdatasync when `sync`.
/// std::system_error naming the file on an I/O error.
void write_hyperparameters(const std::string& dir, std::uint64_t step, std::uint64_t commit_id,
                           const std::vector<adam_config>& configs, bool sync);

/// The hyper-parameters `dir`'s file holds for (step, commit_id), for `groups` groups.
/// nullopt with `problem` empty: no file (a store made before they were kept); nullopt with
/// `problem` saying what: a missing, torn, corrupt or other commit's record.
std::optional<std::vector<adam_config>> read_hyperparameters(const std::string& dir, std::uint64_t step,
                                                             std::uint64_t commit_id, std::size_t groups,
                                                             std::string& problem);

} // namespace hostopt::detail
