#include "hyperparameter_record.hpp"

#include <bit>
#include <type_traits>

#include "step_record_file.hpp"

namespace hostopt::detail {
namespace {

// Fields per group: adam_config's, counted (a field added later changes the records' size
// and is told apart by this count, never written past a place).
std::uint64_t fields() {
  static const std::uint64_t n = [] {
    adam_config c;
    std::uint64_t k = 0;
    for_each_field(c, [&](const char*, auto&) { ++k; });
    return k;
  }();
  return n;
}

// A place's words: groups, fields per group, then the groups' fields (8 bytes each, in
// for_each_field's order).
step_record_kind kind_of(std::size_t groups) {
  return {"hyperparameters", {'h', 'o', 's', 't', 'o', 'p', 'h', 'p'}, 1, std::size_t(2 + groups * fields()),
          "the hyper-parameters"};
}

} // namespace

void write_hyperparameters(const std::string& dir, std::uint64_t step, std::uint64_t commit_id,
                           const std::vector<adam_config>& configs, bool sync) {
  std::vector<std::uint64_t> words{std::uint64_t(configs.size()), fields()};
  for (adam_config c : configs)
    for_each_field(c, [&](const char*, auto& v) {
      using T = std::remove_cvref_t<decltype(v)>;
      if constexpr (std::is_same_v<T, double>) words.push_back(std::bit_cast<std::uint64_t>(v));
      else words.push_back(std::uint64_t(v)); // (adam_mode, bool)
    });
  write_step_record(kind_of(configs.size()), dir, step, commit_id, words, sync);
}

std::optional<std::vector<adam_config>> read_hyperparameters(const std::string& dir, std::uint64_t step,
                                                             std::uint64_t commit_id, std::size_t groups,
                                                             std::string& problem) {
  const step_record_kind kind = kind_of(groups);
  const auto words = read_step_record(kind, dir, step, commit_id, problem);
  if (!words) return std::nullopt;
  const std::string where = step_record_path(kind, dir) + ", commit " + std::to_string(step) + ": ";
  if ((*words)[0] != groups || (*words)[1] != fields()) {
    problem = where + "a record of " + std::to_string((*words)[0]) + " groups of " + std::to_string((*words)[1]) +
              " fields, not " + std::to_string(groups) + " of " + std::to_string(fields());
    return std::nullopt;
  }
  std::vector<adam_config> configs(groups);
  std::size_t i = 2;
  bool ok = true;
  for (adam_config& c : configs)
    for_each_field(c, [&](const char*, auto& v) {
      using T = std::remove_cvref_t<decltype(v)>;
      const std::uint64_t w = (*words)[i++];
      if constexpr (std::is_same_v<T, double>) v = std::bit_cast<double>(w);
      else if (w > 1) ok = false;
      else v = T(w);
    });
  if (!ok) {
    problem = where + "a record with a flag that is neither 0 nor 1";
    return std::nullopt;
  }
  return configs;
}

} // namespace hostopt::detail
