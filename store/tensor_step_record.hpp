#pragma once
// The tensors' own step counts of a committed step (per-tensor steps: a tensor without a
// gradient in a step keeps its count), so that opening the store restores them as
// load_checkpoint restores a file's: a step record (step_record_file.hpp) in the file
// "tensor_steps" of the first directory, written only for steps where some tensor is behind
// the shared count (the commit record says whether it was).

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace hostopt::detail {

/// The file's path in `dir`.
std::string tensor_step_record_path(const std::string& dir);

/// Writes each tensor's lag behind the shared step count (`lags`, one per layout tensor) as
/// step `step`'s record, committed with `commit_id`; fdatasync when `sync`.
void write_tensor_lags(const std::string& dir, std::uint64_t step, std::uint64_t commit_id,
                       const std::vector<std::int64_t>& lags, bool sync);

/// The lags `dir`'s file holds for (step, commit_id), for `tensors` tensors, each in
/// [0, count]; nullopt with `problem` saying what where there is none (or the file is missing:
/// `problem` says so too).
std::optional<std::vector<std::int64_t>> read_tensor_lags(const std::string& dir, std::uint64_t step,
                                                          std::uint64_t commit_id, std::size_t tensors,
                                                          std::int64_t count, std::string& problem);

} // namespace hostopt::detail
