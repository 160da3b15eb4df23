// One rank's share of the optimizer: an optimizer holding the rank's range of the arena
// (its flat buffers are the range's slice of every full buffer), global decisions from
// global norms, and checkpoints that re-shard by reading ranges from the old shard files.
#include "hostopt/sharding.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <dirent.h>
#include <stdexcept>
#include <string>

#include <nlohmann/json.hpp>

#include "atomic_file.hpp"
#include "checkpoint_io.hpp"
#include "held_layout.hpp"
#include "parallel.hpp"
#include "safetensors_header.hpp"

namespace hostopt {

namespace {

std::string shard_file(const std::string& dir, int rank, int world, const std::string& id) {
  return dir + "/shard-" + std::to_string(rank) + "-of-" + std::to_string(world) + "." + id + ".safetensors";
}

void check_save_id(const std::string& id) {
  const bool ok = !id.empty() && id.size() <= 64 && std::all_of(id.begin(), id.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
           c == '-';
  });
  if (!ok || id == "." || id == "..")
    throw std::invalid_argument("save_id '" + id + "': expected 1 to 64 letters, digits, '.', '_' or '-'");
}

// The sizes of a shard's buffers, named as the caller knows them (the shard's optimizer
// would call them flat_grad and flat_out).
void check_shard_views(const_view grad, mut_view params, shard_range shard) {
  auto check = [&](const char* what, std::size_t size) {
    if (size != shard.size())
      throw std::invalid_argument(std::string(what) + ".size = " + std::to_string(size) + ": expected " +
                                  std::to_string(shard.size()) + " (the shard's range [" + std::to_string(shard.begin) +
                                  ", " + std::to_string(shard.end) + ") of the arena)");
  };
  check("shard_grad", grad.size);
  if (params.data != nullptr || params.size != 0) check("shard_params", params.size);
}

// Whether a step agrees and reduces the norm: no norm given, and checked or clipped. Decided
// from the options as given, valid or not (max_grad_norm NaN or -1 counts as clipping): a
// rank whose options are refused must still join the agreement the others make, never
// refuse alone while they wait in the reduction.
bool reduces(const step_options& o) {
  return o.known_grad_norm < 0 && (o.skip_nonfinite || o.max_grad_norm != 0);
}

} // namespace

shard_range shard_of(std::size_t arena_size, int world_size, int rank, std::size_t unit) {
  if (unit == 0 || unit % detail::align_elems)
    throw std::invalid_argument("unit = " + std::to_string(unit) + ": expected a multiple of 16 elements");
  if (world_size < 1) throw std::invalid_argument("world_size = " + std::to_string(world_size) + ": expected >= 1");
  if (rank < 0 || rank >= world_size)
    throw std::invalid_argument("rank = " + std::to_string(rank) + ": expected a value in [0, " +
                                std::to_string(world_size) + ")");
  const auto [b, e] = detail::partition(0, arena_size, rank, world_size, unit);
  return {b, e};
}

shard_range shard_of(const std::vector<param_group>& groups, int world_size, int rank) {
  return shard_of(arena_end(arena_layout(groups)), world_size, rank, detail::range_unit(groups));
}

sharded_optimizer::sharded_optimizer(std::vector<param_group> groups, int world_size, int rank, execution_options exec)
    : world_(world_size), rank_(rank), arena_(arena_end(arena_layout(groups))),
      shard_(shard_of(groups, world_size, rank)), local_(std::move(groups), shard_, std::move(exec)) {}

void sharded_optimizer::set_params(std::string_view name, std::span<const float> full_values) {
  local_.set_params(name, {full_values.data(), full_values.size(), dtype::f32});
}

grad_stats sharded_optimizer::shard_stats(const_view shard_grad) const {
  const std::size_t n = shard_.size();
  if (shard_grad.size != n)
    throw std::invalid_argument("shard_grad.size = " + std::to_string(shard_grad.size) + ": expected " +
                                std::to_string(n) + " (the shard's range)");
  std::vector<const_view> views; // the tensor elements of the range: padding is never read
  for (const auto& s : local_.segments()) {
    const std::size_t lo = std::max(shard_.begin, s.offset), hi = std::min(shard_.end, s.offset + s.size);
    if (lo < hi)
      views.push_back({static_cast<const char*>(shard_grad.data) + (lo - shard_.begin) * dtype_size(shard_grad.type),
                       hi - lo, shard_grad.type});
  }
  return gradient_stats(views, local_.execution());
}

void sharded_optimizer::set_norm_reduction(sum_across_ranks reduce) {
  std::lock_guard<std::mutex> lock(*reduce_mu_);
  reduce_ = std::move(reduce);
}

sum_across_ranks sharded_optimizer::norm_reduction() const {
  std::lock_guard<std::mutex> lock(*reduce_mu_);
  return reduce_;
}

// Every rank adds its refusal: 2^rank in worlds of up to 24 ranks (which ranks refused,
// exact even in float32), else 1 (how many). Any rank's refusal makes every rank throw.
void sharded_optimizer::agree(const sum_across_ranks& reduce, const std::string* refusal) const {
  constexpr int named = 24;
  const double total = reduce(refusal ? (world_ <= named ? std::ldexp(1.0, rank_) : 1.0) : 0.0);
  if (total == 0 && !refusal) return;
  const std::string of = " of " + std::to_string(world_) + " ranks";
  int count = -1;
  std::string who; // "rank 1", "ranks 0, 2"
  if (world_ <= named && total >= 1 && total < std::ldexp(1.0, world_) && total == std::floor(total)) {
    const auto mask = std::uint32_t(total);
    count = 0;
    for (int r = 0; r < world_; ++r)
      if (mask >> r & 1) who += (count++ ? ", " : "") + std::to_string(r);
    who = (count > 1 ? "ranks " : "rank ") + who;
  } else if (world_ > named && total >= 1 && total <= world_ && total == std::floor(total)) {
    count = int(total);
  }
  std::string what = "sharded step refused by ";
  if (count < 0) // a reduction that does not sum (or lost this rank's refusal)
    what += "some of the " + std::to_string(world_) + " ranks (the reduction of the refusals returned " +
            std::to_string(total) + ")";
  else
    what += std::to_string(count) + of + (who.empty() ? "" : " (" + who + ")");
  if (refusal)
    what += "; rank " + std::to_string(rank_) + " refused it: " + *refusal;
  else
    what += count == 1 ? ": see that rank's error" : ": see their errors";
  what += "; nothing was applied on any rank";
  throw sharded_step_refused(what, count, refusal ? *refusal : std::string());
}

void sharded_optimizer::check_step(const_view shard_grad, mut_view shard_params, const step_options& options) const {
  check_shard_views(shard_grad, shard_params, shard_);
  decide_step(options, 0.0); // the options, whatever the norm
  step_options given = options;
  given.known_grad_norm = 0; // the global norm will be known: its all-reduce can carry the verdict
  local_.check_step(shard_grad, shard_params, given);
}

void sharded_optimizer::agree_step(const_view shard_grad, mut_view shard_params, const step_options& options,
                                   const sum_across_ranks& reduce) const {
  if (!reduce) throw std::invalid_argument("agree_step: reduce is empty (expected a sum across every rank)");
  std::string refusal;
  bool refused = false;
  try {
    check_step(shard_grad, shard_params, options);
  } catch (const std::exception& e) {
    refusal = e.what();
    refused = true;
  }
  agree(reduce, refused ? &refusal : nullptr);
}

void sharded_optimizer::refuse_step(const std::string& reason, const step_options& options,
                                    const sum_across_ranks& reduce) const {
  if (reduce) agree(reduce, &reason);
  const sum_across_ranks own = norm_reduction();
  if (own && reduces(options)) agree(own, &reason);
}

step_result sharded_optimizer::step(const_view shard_grad, mut_view shard_params, const step_options& options) {
  // The global norm, when the checks need one and the caller has a reduction for it; the
  // shard's optimizer refuses such a step without one (its plan's rule for ranges). Whether
  // the step reduces depends on the options alone (the same on every rank), never on a
  // check that could fail on one rank only: a refusing rank still joins the agreement.
  const sum_across_ranks reduce = norm_reduction();
  if (!reduce || !reduces(options)) {
    check_shard_views(shard_grad, shard_params, shard_);
    return local_.step(shard_grad, shard_params, options);
  }
  agree_step(shard_grad, shard_params, options, reduce);
  step_options o = options;
  o.known_grad_norm = std::sqrt(reduce(shard_stats(shard_grad).sum_squares));
  return local_.step(shard_grad, shard_params, o);
}

namespace detail {

std::string shard_save_path(const std::string& dir, const std::string& save_id, int rank, int world) {
  check_path(dir, "sharded checkpoint directory");
  check_save_id(save_id);
  // Overwriting the committed save's files would break the one save a crash falls back to.
  std::string text;
  try {
    text = read_small_file(checkpoint_owner, dir + "/index.json", "sharded checkpoint index");
    if (!nlohmann::json::accept(text)) text.clear();
  } catch (const std::exception&) { // no index yet (or unreadable): nothing committed to protect
    text.clear();
  }
  if (!text.empty()) {
    // An index naming save_id twice (one of them perhaps this save) is refused, as load does.
    const auto index = parse_json_unique(dir + "/index.json", "index.json", text);
    if (index.is_object() && index.contains("save_id") && index["save_id"] == save_id)
      throw std::invalid_argument("save_id '" + save_id + "' is the committed save in '" + dir +
                                  "': give every save a new id (a counter), so a crash mid-save keeps it");
  }
  return shard_file(dir, rank, world, save_id);
}

checkpoint_metadata shard_save_metadata(const std::string& save_id, int rank, int world) {
  return {{"save_id", save_id}, {"shard_world", std::to_string(world)}, {"shard_rank", std::to_string(rank)}};
}

} // namespace detail

void sharded_optimizer::save(const std::string& dir, const std::string& save_id) const {
  detail::save_checkpoint(local_, detail::shard_save_path(dir, save_id, rank_, world_),
                          detail::shard_save_metadata(save_id, rank_, world_));
}

void sharded_optimizer::commit_save(const std::string& dir, const std::string& save_id) const {
  if (rank_ != 0) {
    detail::check_path(dir, "sharded checkpoint directory");
    check_save_id(save_id);
    throw std::logic_error("commit_save: call it on rank 0 (after every rank saved)");
  }
  detail::commit_shard_save(dir, save_id, local_.segments(), arena_, world_, local_.chunk_unit());
}

namespace detail {

void commit_shard_save(const std::string& dir, const std::string& save_id, std::span<const segment> segs,
                       std::size_t arena, int world, std::size_t unit) {
  check_path(dir, "sharded checkpoint directory");
  check_save_id(save_id);
  std::string step;
  for (int r = 0; r < world; ++r) { // every shard of the save is there and names it
    const std::string file = shard_file(dir, r, world, save_id);
    checkpoint_metadata meta{{"save_id", ""}, {"step", ""}, {"range", ""}};
    read_checkpoint_metadata(file, segs, meta, /*verify=*/true); // whole before old saves go
    const shard_range s = shard_of(arena, world, r, unit);
    if (meta["save_id"] != save_id || meta["range"] != std::to_string(s.begin) + ":" + std::to_string(s.end) ||
        (r > 0 && meta["step"] != step))
      throw std::runtime_error("sharded checkpoint '" + dir + "': " + file + " is not rank " + std::to_string(r) +
                               "'s shard of save '" + save_id + "' at the same step");
    step = meta["step"];
  }
  nlohmann::json index = {{"format", "hostopt-sharded"}, {"version", "2"}, {"world_size", world},
                          {"arena_size", arena},     {"save_id", save_id}, {"step", step}};
  write_file_atomically(checkpoint_owner, dir + "/index.json", index.dump(2) + "\n",
                                "sharded checkpoint index");
  // The index now names this save: the shard files of other saves can go.
  if (DIR* d = ::opendir(dir.c_str())) {
    const std::string keep = "." + save_id + ".safetensors";
    while (const dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      const bool shard = name.rfind("shard-", 0) == 0 && name.size() > 12 &&
                         name.compare(name.size() - 12, 12, ".safetensors") == 0;
      if (shard && (name.size() < keep.size() || name.compare(name.size() - keep.size(), keep.size(), keep) != 0))
        ::unlinkat(::dirfd(d), name.c_str(), 0);
    }
    ::closedir(d);
  }
}

} // namespace detail

void sharded_optimizer::load(const std::string& dir) {
  detail::check_path(dir, "sharded checkpoint directory");
  const std::string where = "sharded checkpoint '" + dir + "': ";
  // Every key once: a reader keeps only one of two (a save_id or step given twice).
  const nlohmann::json index = detail::parse_json_unique(
      dir + "/index.json", "index.json",
      detail::read_small_file(detail::checkpoint_owner, dir + "/index.json", "sharded checkpoint index"));
  if (!index.is_object() || index.value("format", "") != "hostopt-sharded" || index.value("version", "") != "2")
    throw std::runtime_error(where + "unknown format or version in index.json (expected hostopt-sharded version 2)");
  const auto& w = index["world_size"];
  if (!w.is_number_integer() || w.get<std::int64_t>() < 1 || w.get<std::int64_t>() > (1 << 20))
    throw std::runtime_error(where + "world_size " + w.dump() + " is invalid");
  const int old_world = w.get<int>();
  if (!index["arena_size"].is_number_unsigned() || index["arena_size"].get<std::size_t>() != arena_)
    throw std::runtime_error(where + "arena size " + index["arena_size"].dump() + " differs from this model's " +
                             std::to_string(arena_));
  if (!index["save_id"].is_string() || !index["step"].is_string())
    throw std::runtime_error(where + "index.json lacks save_id or step");
  const std::string id = index["save_id"].get<std::string>(), step = index["step"].get<std::string>();
  try {
    check_save_id(id);
  } catch (const std::invalid_argument& e) {
    throw std::runtime_error(where + "index.json: " + e.what());
  }
  // The old shards that hold part of this rank's range, each refused unless it is that
  // rank's shard of the same save and step as the index.
  std::vector<std::string> files;
  std::vector<detail::checkpoint_metadata> expected;
  for (int r = 0; r < old_world; ++r) {
    const shard_range s = shard_of(arena_, old_world, r, local_.chunk_unit());
    if (s.end <= shard_.begin || s.begin >= shard_.end) continue;
    files.push_back(shard_file(dir, r, old_world, id));
    expected.push_back({{"save_id", id},
                        {"step", step},
                        {"shard_world", std::to_string(old_world)},
                        {"shard_rank", std::to_string(r)},
                        {"range", std::to_string(s.begin) + ":" + std::to_string(s.end)}});
  }
  if (files.empty()) { // an empty shard of an empty arena: only the counters
    files.push_back(shard_file(dir, 0, old_world, id));
    expected.push_back({{"save_id", id}, {"step", step}});
  }
  detail::load_checkpoint(local_, files, expected);
}

} // namespace hostopt
