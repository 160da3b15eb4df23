// One rank's share of the optimizer. Its local optimizer holds the pieces of the model's
// tensors that fall in the rank's arena range, laid out at the same offsets relative to
// the range's start as in the full arena (a leading "padding" tensor, never stepped,
// keeps that true when the range starts between tensors), so the shard's slice of any
// flat buffer maps onto it directly.
#include "hostopt/sharding.hpp"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <memory>
#include <stdexcept>
#include <string>

#include <nlohmann/json.hpp>

#include "checkpoint_io.hpp"
#include "hostopt/checkpoint.hpp"
#include "parallel.hpp"

namespace hostopt {

namespace {

constexpr const char* pad_name = "__shard_padding__";

std::size_t arena_end(const std::vector<segment>& layout) {
  std::size_t end = 0;
  for (const auto& s : layout) end = (s.offset + s.size + detail::align_elems - 1) / detail::align_elems * detail::align_elems;
  return end;
}

// The local optimizer's groups for [begin, end), and each local tensor's global offset.
std::vector<param_group> local_groups(const std::vector<param_group>& groups, const std::vector<segment>& layout,
                                      shard_range r, std::vector<std::size_t>& global_offset) {
  std::vector<param_group> out(groups.size());
  for (std::size_t g = 0; g < groups.size(); ++g) out[g].config = groups[g].config;
  bool first = true;
  for (const auto& s : layout) {
    const std::size_t lo = std::max(r.begin, s.offset), hi = std::min(r.end, s.offset + s.size);
    if (lo >= hi) continue;
    if (first && lo > r.begin) { // the range starts in padding: keep offsets aligned
      out[s.group].tensors.push_back({pad_name, {std::int64_t(lo - r.begin)}});
      global_offset.push_back(r.begin);
    }
    first = false;
    if (lo == s.offset && hi == s.offset + s.size) {
      out[s.group].tensors.push_back({s.name, s.shape});
    } else {
      const std::size_t a = lo - s.offset, b = hi - s.offset;
      out[s.group].tensors.push_back({s.name + "[" + std::to_string(a) + ":" + std::to_string(b) + "]",
                                      {std::int64_t(b - a)}});
    }
    global_offset.push_back(lo);
  }
  return out;
}

std::string shard_file(const std::string& dir, int rank, int world) {
  return dir + "/shard-" + std::to_string(rank) + "-of-" + std::to_string(world) + ".safetensors";
}

} // namespace

shard_range shard_of(std::size_t arena_size, int world_size, int rank) {
  if (world_size < 1) throw std::invalid_argument("world_size = " + std::to_string(world_size) + ": expected >= 1");
  if (rank < 0 || rank >= world_size)
    throw std::invalid_argument("rank = " + std::to_string(rank) + ": expected a value in [0, " +
                                std::to_string(world_size) + ")");
  const auto [b, e] = detail::partition(0, arena_size, rank, world_size);
  return {b, e};
}

sharded_optimizer::sharded_optimizer(std::vector<param_group> groups, int world_size, int rank, execution_options exec)
    : sharded_optimizer(groups, world_size, rank, std::move(exec), arena_layout(groups)) {}

sharded_optimizer::sharded_optimizer(std::vector<param_group> groups, int world_size, int rank,
                                     execution_options exec, std::vector<segment> layout)
    : groups_(std::move(groups)), world_(world_size), rank_(rank), layout_(std::move(layout)),
      arena_(arena_end(layout_)), shard_(shard_of(arena_, world_size, rank)),
      local_(local_groups(groups_, layout_, shard_, piece_global_), std::move(exec)) {
  for (const auto& s : local_.segments())
    if (s.offset != piece_global_[&s - local_.segments().data()] - shard_.begin)
      throw std::logic_error("sharded_optimizer: local layout does not mirror the global one");
  grad_views_.resize(local_.segments().size());
  out_views_.resize(local_.segments().size());
}

void sharded_optimizer::set_params(std::string_view name, std::span<const float> full_values) {
  const auto it = std::find_if(layout_.begin(), layout_.end(), [&](const segment& s) { return s.name == name; });
  if (it == layout_.end()) throw std::invalid_argument("tensor name '" + std::string(name) + "': unknown");
  if (full_values.size() != it->size)
    throw std::invalid_argument("set_params('" + std::string(name) + "'): " + std::to_string(full_values.size()) +
                                " values, expected " + std::to_string(it->size));
  const std::size_t lo = std::max(shard_.begin, it->offset), hi = std::min(shard_.end, it->offset + it->size);
  if (lo >= hi) return; // not in this shard
  std::memcpy(local_.params().data() + (lo - shard_.begin), full_values.data() + (lo - it->offset),
              (hi - lo) * sizeof(float));
}

grad_stats sharded_optimizer::shard_stats(const_view shard_grad) const {
  const std::size_t n = shard_.end - shard_.begin;
  if (shard_grad.size != n)
    throw std::invalid_argument("shard_grad.size = " + std::to_string(shard_grad.size) + ": expected " +
                                std::to_string(n) + " (the shard's range)");
  std::vector<const_view> views;
  const auto segs = local_.segments();
  for (const auto& s : segs)
    if (s.name != pad_name)
      views.push_back({static_cast<const char*>(shard_grad.data) + s.offset * dtype_size(shard_grad.type), s.size,
                       shard_grad.type});
  return gradient_stats(views, local_.execution());
}

step_result sharded_optimizer::step(const_view shard_grad, mut_view shard_params, const step_options& options) {
  const std::size_t n = shard_.end - shard_.begin;
  if (shard_grad.size != n)
    throw std::invalid_argument("shard_grad.size = " + std::to_string(shard_grad.size) + ": expected " +
                                std::to_string(n) + " (the shard's range)");
  const bool has_out = shard_params.data || shard_params.size;
  if (has_out && shard_params.size != n)
    throw std::invalid_argument("shard_params.size = " + std::to_string(shard_params.size) + ": expected " +
                                std::to_string(n) + " (the shard's range)");
  const std::size_t gsz = dtype_size(shard_grad.type);
  const std::size_t osz = has_out ? dtype_size(shard_params.type) : 0;
  const auto segs = local_.segments();
  for (std::size_t i = 0; i < segs.size(); ++i) {
    if (segs[i].name == pad_name) { // never stepped, never written
      grad_views_[i] = {};
      out_views_[i] = {nullptr, 0, shard_params.type};
      continue;
    }
    grad_views_[i] = {static_cast<const char*>(shard_grad.data) + segs[i].offset * gsz, segs[i].size, shard_grad.type};
    if (has_out)
      out_views_[i] = {static_cast<char*>(shard_params.data) + segs[i].offset * osz, segs[i].size, shard_params.type};
  }
  return local_.step(grad_views_, has_out ? std::span<const mut_view>(out_views_) : std::span<const mut_view>{},
                     options);
}

void sharded_optimizer::save(const std::string& dir, const std::string& save_id) const {
  detail::check_path(dir, "sharded checkpoint directory");
  // Every file of one save names it, so shards of different saves are never mixed on load.
  const std::string id = save_id.empty() ? "step-" + std::to_string(local_.step_count()) : save_id;
  const std::string step = std::to_string(local_.step_count());
  detail::save_checkpoint(local_, shard_file(dir, rank_, world_),
                          {{"save_id", id},
                           {"shard_world", std::to_string(world_)},
                           {"shard_rank", std::to_string(rank_)},
                           {"shard_range", std::to_string(shard_.begin) + ":" + std::to_string(shard_.end)}});
  if (rank_ != 0) return;
  nlohmann::json index = {{"format", "hostopt-sharded"}, {"version", "2"},      {"world_size", world_},
                          {"arena_size", arena_},        {"save_id", id},        {"step", step}};
  for (int r = 0; r < world_; ++r) {
    const shard_range s = shard_of(arena_, world_, r);
    index["ranges"].push_back({s.begin, s.end});
  }
  detail::write_file_atomically(dir + "/index.json", index.dump(2) + "\n", "sharded checkpoint index");
}

void sharded_optimizer::load(const std::string& dir) {
  detail::check_path(dir, "sharded checkpoint directory");
  const std::string where = "sharded checkpoint '" + dir + "': ";
  nlohmann::json index;
  try {
    index = nlohmann::json::parse(detail::read_small_file(dir + "/index.json", "sharded checkpoint index"));
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(where + "index.json is not valid JSON: " + e.what());
  }
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
  // Read every old shard this rank needs (each verified completely by load_checkpoint, and
  // refused unless it belongs to the same save and step as the index), then copy.
  std::vector<std::unique_ptr<sharded_optimizer>> sources;
  for (int r = 0; r < old_world; ++r) {
    const shard_range s = shard_of(arena_, old_world, r);
    if (s.end <= shard_.begin || s.begin >= shard_.end) continue;
    sources.emplace_back(new sharded_optimizer(groups_, old_world, r, execution_options{1, ""}, layout_));
    detail::load_checkpoint(sources.back()->local_, shard_file(dir, r, old_world),
                            {{"save_id", id},
                             {"step", step},
                             {"shard_world", std::to_string(old_world)},
                             {"shard_rank", std::to_string(r)},
                             {"shard_range", std::to_string(s.begin) + ":" + std::to_string(s.end)}});
  }
  const optimizer* meta = sources.empty() ? nullptr : &sources.front()->local_;
  for (const auto& p : sources) {
    const sharded_optimizer& src = *p;
    if (src.local_.skipped_steps() != meta->skipped_steps())
      throw std::runtime_error(where + "the shards disagree on skipped_steps: files of different runs");
    for (std::size_t g = 0; g < local_.num_groups(); ++g) {
      const adam_config a = src.local_.group_config(g), b = meta->group_config(g);
      if (a.lr != b.lr || a.beta1 != b.beta1 || a.beta2 != b.beta2 || a.eps != b.eps || a.eps_root != b.eps_root ||
          a.weight_decay != b.weight_decay || a.mode != b.mode || a.bias_correction != b.bias_correction ||
          a.nesterov != b.nesterov)
        throw std::runtime_error(where + "the shards disagree on the hyper-parameters of group " + std::to_string(g));
    }
  }
  local_.reset_failure(); // every source verified: the state below is replaced whole
  for (const auto& p : sources) {
    const sharded_optimizer& src = *p;
    const std::size_t lo = std::max(shard_.begin, src.shard_.begin), hi = std::min(shard_.end, src.shard_.end);
    const std::size_t from = lo - src.shard_.begin, to = lo - shard_.begin, n = hi - lo;
    std::memcpy(local_.params().data() + to, src.local_.params().data() + from, n * 4);
    std::memcpy(local_.exp_avg().data() + to, src.local_.exp_avg().data() + from, n * 4);
    std::memcpy(local_.exp_avg_sq().data() + to, src.local_.exp_avg_sq().data() + from, n * 4);
  }
  if (meta) {
    for (std::size_t g = 0; g < local_.num_groups(); ++g) local_.set_group_config(g, meta->group_config(g));
    local_.set_step_count(meta->step_count());
    local_.set_skipped_steps(meta->skipped_steps());
  }
}

} // namespace hostopt
