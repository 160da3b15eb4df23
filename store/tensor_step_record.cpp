#include "tensor_step_record.hpp"

#include "step_record_file.hpp"

namespace hostopt::detail {
namespace {

// A place's words: tensors, then each one's lag.
step_record_kind kind_of(std::size_t tensors) {
  return {"tensor_steps", {'h', 'o', 's', 't', 'o', 'p', 't', 's'}, 1, 1 + tensors, "the tensors' step counts"};
}

} // namespace

std::string tensor_step_record_path(const std::string& dir) { return step_record_path(kind_of(0), dir); }

void write_tensor_lags(const std::string& dir, std::uint64_t step, std::uint64_t commit_id,
                       const std::vector<std::int64_t>& lags, bool sync) {
  std::vector<std::uint64_t> words{std::uint64_t(lags.size())};
  for (const std::int64_t l : lags) words.push_back(std::uint64_t(l));
  write_step_record(kind_of(lags.size()), dir, step, commit_id, words, sync);
}

std::optional<std::vector<std::int64_t>> read_tensor_lags(const std::string& dir, std::uint64_t step,
                                                          std::uint64_t commit_id, std::size_t tensors,
                                                          std::int64_t count, std::string& problem) {
  const step_record_kind kind = kind_of(tensors);
  const auto words = read_step_record(kind, dir, step, commit_id, problem);
  if (!words) {
    if (problem.empty()) problem = "the file " + tensor_step_record_path(dir) + " is missing";
    return std::nullopt;
  }
  const std::string where = tensor_step_record_path(dir) + ", commit " + std::to_string(step) + ": ";
  if ((*words)[0] != tensors) {
    problem = where + "a record of " + std::to_string((*words)[0]) + " tensors, not " + std::to_string(tensors);
    return std::nullopt;
  }
  std::vector<std::int64_t> lags;
  for (std::size_t i = 0; i < tensors; ++i) {
    const std::uint64_t w = (*words)[1 + i];
    if (w > std::uint64_t(count)) {
      problem = where + "tensor " + std::to_string(i) + " is " + std::to_string(w) + " steps behind a count of " +
                std::to_string(count);
      return std::nullopt;
    }
    lags.push_back(std::int64_t(w));
  }
  return lags;
}

} // namespace hostopt::detail
