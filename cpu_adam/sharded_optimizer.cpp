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

void sharded_optimizer::save(const std::string& dir) const {
  save_checkpoint(local_, shard_file(dir, rank_, world_));
  if (rank_ != 0) return;
  nlohmann::json index = {{"format", "hostopt-sharded"}, {"version", "1"}, {"world_size", world_}, {"arena_size", arena_}};
  for (int r = 0; r < world_; ++r) {
    const shard_range s = shard_of(arena_, world_, r);
    index["ranges"].push_back({s.begin, s.end});
  }
  const std::string path = dir + "/index.json", tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::trunc);
    f << index.dump(2) << "\n";
    f.flush();
    if (!f) throw std::runtime_error("sharded checkpoint '" + dir + "': cannot write index.json");
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0)
    throw std::runtime_error("sharded checkpoint '" + dir + "': cannot rename index.json into place");
}

void sharded_optimizer::load(const std::string& dir) {
  std::ifstream f(dir + "/index.json");
  if (!f) throw std::runtime_error("sharded checkpoint '" + dir + "': no index.json");
  nlohmann::json index;
  try {
    f >> index;
  } catch (const std::exception& e) {
    throw std::runtime_error("sharded checkpoint '" + dir + "': index.json is not valid JSON: " + e.what());
  }
  if (index.value("format", "") != "hostopt-sharded" || index.value("version", "") != "1")
    throw std::runtime_error("sharded checkpoint '" + dir + "': unknown format or version in index.json");
  const int old_world = index.value("world_size", 0);
  if (old_world < 1 || old_world > 1 << 20)
    throw std::runtime_error("sharded checkpoint '" + dir + "': world_size " + std::to_string(old_world) + " is invalid");
  if (index.value("arena_size", std::size_t(0)) != arena_)
    throw std::runtime_error("sharded checkpoint '" + dir + "': arena size " + index["arena_size"].dump() +
                             " differs from this model's " + std::to_string(arena_));
  // Read every old shard this rank needs (verified by load_checkpoint), then copy.
  std::vector<std::unique_ptr<sharded_optimizer>> sources;
  for (int r = 0; r < old_world; ++r) {
    const shard_range s = shard_of(arena_, old_world, r);
    if (s.end <= shard_.begin || s.begin >= shard_.end) continue;
    sources.emplace_back(new sharded_optimizer(groups_, old_world, r, execution_options{1, ""}, layout_));
    load_checkpoint(sources.back()->local_, shard_file(dir, r, old_world));
  }
  const optimizer* meta = sources.empty() ? nullptr : &sources.front()->local_;
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
