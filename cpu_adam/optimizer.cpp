// The optimizer: a flat arena of master params and moments (or a range of one: a shard),
// steps run as step plans over it, every public operation serialized by one mutex.
#include "hostopt/optimizer.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "buffer_checks.hpp"
#include "chunked_step.hpp"
#include "exclusive_state.hpp"
#include "half_conversion.hpp"
#include "held_layout.hpp"
#include "hostopt/gradient_checks.hpp"
#include "kernel_registry.hpp"
#include "operation_turns.hpp"
#include "state_storage.hpp"
#include "step_plan.hpp"
#include "update_engine.hpp"

namespace hostopt {

using namespace detail;

namespace {

const char* const view_kinds[] = {"grads", "outs", "optimizer state"};
constexpr int kind_grad = 0, kind_out = 1, kind_state = 2;

void check_count(const char* what, std::int64_t count) {
  if (count < 0 || count > max_step_count)
    throw std::invalid_argument(std::string(what) + " = " + std::to_string(count) + ": expected a count in [0, " +
                                std::to_string(max_step_count) + "] (hostopt::max_step_count)");
}

} // namespace

struct optimizer::impl {
  operation_turns turns; // the lock, the chunked step's turn, the failure flag
  chunked_step chunk;    // the open chunked step's options and progress

  execution_options exec;
  const kernel_set* kernels;
  held_layout layout;    // the tensors, and the part of them held
  state_storage storage; // params and each group's moments
  std::vector<adam_config> configs;
  std::vector<std::uint64_t> seeds; // per group: the compressed moments' rounding seed
  std::int64_t count = 0, skipped = 0;
  // Per tensor (segments order): how many of the last `count` steps it missed (no
  // gradient in a per-tensor step); its own step count is count - lag. The step plan gives
  // the tensors behind their own kernel entries.
  std::vector<std::int64_t> lag;
  // Scratch sized at construction so that a step allocates nothing.
  std::vector<update_piece> pieces; // the held part of each tensor (held_layout::pieces)
  std::vector<group_kernel> group_kernels;
  std::vector<byte_range> ranges;
  std::vector<const_view> stat_views; // the step's gradients, per piece, for the checks

  // The execution options are checked first, then the layout.
  impl(const std::vector<param_group>& groups, arena_range range, execution_options options)
      : exec(checked(std::move(options))), kernels(&kernel_set_by_name(exec.kernel)), layout(groups, range),
        storage(formats_of(groups), layout), pieces(layout.pieces()) {
    for (const param_group& g : groups) {
      configs.push_back(g.config);
      seeds.push_back(g.rounding_seed);
    }
    group_kernels.resize(configs.size() + layout.segments().size()); // groups, then tensors behind the count
    for (std::size_t g = 0; g < configs.size(); ++g)
      group_kernels[g].storage = storage.kernel_storage(g, seeds[g]);
    lag.assign(layout.segments().size(), 0);
    ranges.reserve(2 * layout.segments().size() + 3);
    stat_views.reserve(pieces.size());
  }
  static execution_options checked(execution_options e) {
    check_threads(e.threads);
    return e;
  }
  static std::vector<moment_format> formats_of(const std::vector<param_group>& groups) {
    std::vector<moment_format> formats;
    for (const param_group& g : groups) formats.push_back(g.moments);
    return formats;
  }

  float* p() const { return storage.params(); }

  void check_group(std::size_t g) const {
    if (g >= configs.size())
      throw std::invalid_argument("group = " + std::to_string(g) + ": expected an index below " +
                                  std::to_string(configs.size()));
  }

  // A chunked step's tensors without a gradient (chunked_step.hpp).
  void check_without_grad(const std::vector<std::size_t>& tensors, const char* what) const {
    check_tensors_without_grad(tensors, layout.segments().size(), layout.whole(), what);
  }

  // Writes the unchanged parameters of the pieces without a gradient inside [begin, end)
  // to `out` (flat layout, element `begin` first).
  void copy_out_without_grad(std::size_t begin, std::size_t end, void* out) const {
    if (chunk.options.tensors_without_grad.empty()) return; // the common step: nothing to look for
    for (const update_piece& piece : pieces) {
      if (!piece.no_grad) continue;
      const std::size_t a = std::max(begin, piece.offset), b = std::min(end, piece.offset + piece.size);
      if (a >= b) continue;
      convert_params(p() + a,
                     {static_cast<char*>(out) + (a - begin) * dtype_size(chunk.options.out_type), b - a,
                      chunk.options.out_type},
                     exec);
    }
  }

  void close_chunked() {
    for (update_piece& piece : pieces) piece.no_grad = false;
    chunk.close();
    turns.close_chunked();
  }

  // Array k (params, exp_avg, exp_avg_sq), refused while the state is half-updated.
  std::span<float> view(int k, const char* what) const {
    const auto lock = turns.acquire(what);
    if (k > 0 && !storage.flat_moments()) {
      std::size_t g = 0;
      while (storage.format(g) == moment_format::f32) ++g;
      throw std::logic_error(std::string(what) + ": group " + std::to_string(g) + " stores its moments as " +
                             std::string(moment_format_name(storage.format(g))) +
                             ": the flat f32 moment views exist only when every group's moments are f32 (use "
                             "read_moments/write_moments, or exp_avg(name) for tensors of f32 groups)");
    }
    return storage.flat_array(k);
  }

  // A tensor's f32 moments as a view: the flat arrays' slice, or its f32 group's storage.
  std::span<float> moment_view(int k, std::string_view name, const char* what) const {
    const auto lock = turns.acquire(what);
    const segment& s = layout.whole_tensor(name);
    if (storage.format(s.group) != moment_format::f32)
      throw std::invalid_argument(std::string(what) + "('" + s.name + "'): its group " +
                                  std::to_string(s.group) + " stores its moments as " +
                                  std::string(moment_format_name(storage.format(s.group))) +
                                  ", not f32: use read_moments/write_moments");
    return storage.f32_moments(k, s.group, s.offset - layout.range().begin, s.size);
  }

  void check_moment_sizes(const char* what, const segment& s, std::size_t m, std::size_t v) const {
    if (m != s.size || v != s.size)
      throw std::invalid_argument(std::string(what) + "('" + s.name + "'): exp_avg/exp_avg_sq hold " +
                                  std::to_string(m) + "/" + std::to_string(v) + " elements: expected " +
                                  std::to_string(s.size) + " each (the tensor's size)");
  }

  update_job job(dtype grad_type, std::optional<dtype> out) const {
    update_job j;
    j.params = p();
    j.exp_avg = storage.flat_array(1).data(); // null: every group has its own storage
    j.exp_avg_sq = storage.flat_array(2).data();
    j.pieces = pieces.data();
    j.num_pieces = pieces.size();
    j.groups = group_kernels.data();
    j.grad_elem_bytes = dtype_size(grad_type);
    j.out_elem_bytes = out ? dtype_size(*out) : 0;
    j.begin = 0;
    j.end = layout.size();
    j.index_origin = layout.range().begin; // compressed moments round by layout index, whatever the shard
    return j;
  }

  // A range (a shard) sees only its part of the gradients: a skip or clip decided from
  // them would differ between ranks. Such decisions need the global norm.
  void check_range_norm(const step_options& o) const {
    if (!layout.whole() && needs_unknown_norm(o)) {
      decide_step(o, 0.0); // a bad option is named first
      throw std::invalid_argument(
          "step: this optimizer holds a range of the arena (a shard): skip_nonfinite and max_grad_norm need the "
          "global gradient norm (known_grad_norm: sqrt of the all-reduced shard sums of squares, or "
          "sharded_optimizer::set_norm_reduction); a norm of the shard alone would let ranks decide differently");
    }
  }

  // The checks of a flat step's buffers (sizes, dtypes, no overlap with each other or the
  // state) and of its grad_scale; returns whether it has a copy-out.
  bool check_flat_step(const_view flat_grad, mut_view flat_out, const step_options& opts) {
    check_grad_scale(opts.grad_scale);
    const std::size_t n = layout.size();
    check_view("flat_grad", flat_grad.data, flat_grad.size, flat_grad.type, n);
    const bool has_out = flat_out.data != nullptr || flat_out.size != 0;
    if (has_out) check_view("flat_out", flat_out.data, flat_out.size, flat_out.type, n);
    ranges.clear();
    ranges.push_back(range_of(flat_grad.data, n * dtype_size(flat_grad.type), false, kind_grad, 0));
    if (has_out) ranges.push_back(range_of(flat_out.data, n * dtype_size(flat_out.type), true, kind_out, 0));
    storage.add_ranges(ranges, kind_state);
    check_no_overlap(ranges, view_kinds);
    return has_out;
  }

  // Makes the step's plan; a skipped step is counted here. The norm, when the options
  // need one and none is known, comes from the statistics of stat_views.
  step_plan plan(const step_io& io, const step_options& o) {
    return plan(io, o, [&] { return gradient_stats(stat_views, exec).norm; });
  }
  template <class NormFn>
  step_plan plan(const step_io& io, const step_options& o, NormFn&& norm) {
    check_range_norm(o);
    const step_plan pl = step_plan::make(*kernels, configs, count, io, o, norm, group_kernels,
                                         {layout.segments(), lag, layout.piece_tensor(), pieces});
    if (!pl.decision().apply) {
      check_count("skipped steps", skipped + 1);
      ++skipped;
    }
    return pl;
  }

  void clear_lags() { std::fill(lag.begin(), lag.end(), 0); }
};

optimizer::optimizer(std::vector<param_group> groups, execution_options exec)
    : optimizer(groups, arena_range{0, arena_end(arena_layout(groups))}, std::move(exec)) {}

optimizer::optimizer(std::vector<param_group> groups, arena_range range, execution_options exec)
    : impl_(std::make_unique<impl>(groups, range, std::move(exec))) {
  impl_->storage.first_touch(impl_->exec.threads);
}

optimizer::~optimizer() = default;
optimizer::optimizer(optimizer&&) noexcept = default;
optimizer& optimizer::operator=(optimizer&&) noexcept = default;

std::size_t optimizer::arena_size() const { return impl_->layout.size(); }
arena_range optimizer::range() const { return impl_->layout.range(); }
std::size_t optimizer::num_params() const { return impl_->layout.num_params(); }
std::size_t optimizer::chunk_unit() const { return impl_->layout.unit(); }
std::size_t optimizer::state_bytes() const { return impl_->storage.bytes(); }
std::span<const segment> optimizer::segments() const {
  return impl_->layout.segments();
} // fixed at construction
const segment& optimizer::tensor(std::string_view name) const {
  return impl_->layout.segments()[impl_->layout.index_of(name)];
}

std::size_t optimizer::num_groups() const { return impl_->configs.size(); }
adam_config optimizer::group_config(std::size_t group) const {
  const auto lock = impl_->turns.acquire("group_config", false);
  impl_->check_group(group);
  return impl_->configs[group];
}
moment_format optimizer::group_moments(std::size_t group) const {
  impl_->check_group(group); // fixed at construction
  return impl_->storage.format(group);
}
std::uint64_t optimizer::group_rounding_seed(std::size_t group) const {
  const auto lock = impl_->turns.acquire("group_rounding_seed", false);
  impl_->check_group(group);
  return impl_->seeds[group];
}
void optimizer::set_group_rounding_seed(std::size_t group, std::uint64_t seed) {
  const auto lock = impl_->turns.acquire("set_group_rounding_seed", false);
  impl_->check_group(group);
  impl_->seeds[group] = seed;
  impl_->group_kernels[group].storage.seed = seed; // what the step plans read
}
void optimizer::set_group_config(std::size_t group, const adam_config& config) {
  const auto lock = impl_->turns.acquire("set_group_config", false);
  impl_->check_group(group);
  validate(config, "groups[" + std::to_string(group) + "].config");
  impl_->configs[group] = config;
}
void optimizer::set_lr(std::size_t group, double lr) {
  const auto lock = impl_->turns.acquire("set_lr", false);
  impl_->check_group(group);
  adam_config c = impl_->configs[group];
  c.lr = lr;
  validate(c, "groups[" + std::to_string(group) + "].config");
  impl_->configs[group] = c;
}

std::int64_t optimizer::step_count() const {
  const auto lock = impl_->turns.acquire("step_count", false);
  return impl_->count;
}
void optimizer::set_step_count(std::int64_t count) {
  const auto lock = impl_->turns.acquire("set_step_count");
  check_count("step count", count);
  impl_->count = count;
  impl_->clear_lags();
}

std::vector<std::int64_t> optimizer::tensor_steps() const {
  const auto lock = impl_->turns.acquire("tensor_steps", false);
  std::vector<std::int64_t> steps(impl_->layout.segments().size());
  for (std::size_t i = 0; i < steps.size(); ++i) steps[i] = impl_->count - impl_->lag[i];
  return steps;
}

void optimizer::set_tensor_steps(std::span<const std::int64_t> steps) {
  impl& s = *impl_;
  const auto lock = s.turns.acquire("set_tensor_steps");
  if (steps.size() != s.layout.segments().size())
    throw std::invalid_argument("set_tensor_steps: " + std::to_string(steps.size()) +
                                " counts: expected one per tensor (" +
                                std::to_string(s.layout.segments().size()) + ")");
  std::int64_t top = 0;
  for (std::size_t i = 0; i < steps.size(); ++i) {
    if (steps[i] < 0 || steps[i] > max_step_count)
      throw std::invalid_argument("set_tensor_steps: tensor '" + s.layout.names()[i] +
                                  "' step count = " + std::to_string(steps[i]) + ": expected [0, " +
                                  std::to_string(max_step_count) + "] (hostopt::max_step_count)");
    top = std::max(top, steps[i]);
  }
  const bool differ = std::any_of(steps.begin(), steps.end(), [&](std::int64_t x) { return x != top; });
  if (differ && !s.layout.whole())
    throw std::invalid_argument("set_tensor_steps: this optimizer holds a range of the arena (a shard), whose "
                                "tensors share one step count; the counts given differ");
  s.count = top;
  for (std::size_t i = 0; i < steps.size(); ++i) s.lag[i] = top - steps[i];
}

execution_options optimizer::execution() const {
  const auto lock = impl_->turns.acquire("execution", false);
  return impl_->exec;
}
void optimizer::set_execution(const execution_options& exec) {
  const auto lock = impl_->turns.acquire("set_execution", false);
  check_threads(exec.threads);
  impl_->kernels = &kernel_set_by_name(exec.kernel);
  impl_->exec = exec;
}

std::span<float> optimizer::params() { return impl_->view(0, "params"); }
std::span<float> optimizer::exp_avg() { return impl_->view(1, "exp_avg"); }
std::span<float> optimizer::exp_avg_sq() { return impl_->view(2, "exp_avg_sq"); }
std::span<const float> optimizer::params() const { return impl_->view(0, "params"); }
std::span<const float> optimizer::exp_avg() const { return impl_->view(1, "exp_avg"); }
std::span<const float> optimizer::exp_avg_sq() const { return impl_->view(2, "exp_avg_sq"); }

std::span<float> optimizer::params(std::string_view name) {
  const segment& s = impl_->layout.whole_tensor(name);
  return params().subspan(s.size ? s.offset - impl_->layout.range().begin : 0, s.size);
}
std::span<float> optimizer::exp_avg(std::string_view name) { return impl_->moment_view(1, name, "exp_avg"); }
std::span<float> optimizer::exp_avg_sq(std::string_view name) { return impl_->moment_view(2, name, "exp_avg_sq"); }

void optimizer::read_moments(std::string_view name, std::span<float> exp_avg, std::span<float> exp_avg_sq) const {
  const impl& s = *impl_;
  const auto lock = s.turns.acquire("read_moments");
  const segment& seg = s.layout.whole_tensor(name);
  s.check_moment_sizes("read_moments", seg, exp_avg.size(), exp_avg_sq.size());
  if (!seg.size) return;
  const std::size_t flat = seg.offset - s.layout.range().begin;
  const moment_format f = s.storage.format(seg.group);
  if (f == moment_format::f32) {
    // memmove: the caller's spans may be views of this optimizer's own state.
    std::memmove(exp_avg.data(), s.storage.moment_at(1, seg.group, flat), seg.size * sizeof(float));
    std::memmove(exp_avg_sq.data(), s.storage.moment_at(2, seg.group, flat), seg.size * sizeof(float));
    return;
  }
  decode_moments(s.storage.codes_at(seg.group, flat), seg.size, exp_avg.data(), exp_avg_sq.data());
}

compressed_moments optimizer::moment_codes(std::string_view name) {
  const impl& s = *impl_;
  const auto lock = s.turns.acquire("moment_codes");
  const segment& seg = s.layout.whole_tensor(name);
  if (s.storage.format(seg.group) == moment_format::f32)
    throw std::invalid_argument("moment_codes('" + seg.name + "'): its group " + std::to_string(seg.group) +
                                " stores f32 moments: use exp_avg(name)/exp_avg_sq(name)");
  if (!seg.size) return {s.storage.format(seg.group), nullptr, nullptr, nullptr};
  return s.storage.codes_at(seg.group, seg.offset - s.layout.range().begin);
}

void optimizer::write_moments(std::string_view name, std::span<const float> exp_avg,
                              std::span<const float> exp_avg_sq) {
  impl& s = *impl_;
  const auto lock = s.turns.acquire("write_moments");
  const segment& seg = s.layout.whole_tensor(name);
  s.check_moment_sizes("write_moments", seg, exp_avg.size(), exp_avg_sq.size());
  if (!seg.size) return;
  const std::size_t flat = seg.offset - s.layout.range().begin;
  if (s.storage.format(seg.group) == moment_format::f32) {
    // Refused as the compressed formats' encoder refuses it (and as load refuses it): a
    // negative v makes the parameter NaN a step later, and a save of it would not load.
    for (std::size_t i = 0; i < seg.size; ++i)
      if (exp_avg_sq[i] < 0.0f)
        throw std::invalid_argument("write_moments('" + seg.name + "'): exp_avg_sq[" + std::to_string(i) +
                                    "] = " + std::to_string(exp_avg_sq[i]) + ": a second moment is never negative");
    std::memmove(s.storage.moment_at(1, seg.group, flat), exp_avg.data(), seg.size * sizeof(float));
    std::memmove(s.storage.moment_at(2, seg.group, flat), exp_avg_sq.data(), seg.size * sizeof(float));
    return;
  }
  // The tensor ends its part of the storage (the rest of its last block is padding).
  encode_moments(exp_avg.data(), exp_avg_sq.data(), s.storage.codes_at(seg.group, flat), seg.size,
                 rounding_stream{s.seeds[seg.group], seg.offset, 0});
}

void optimizer::set_params(std::string_view name, const_view values) {
  const segment& s = tensor(name);
  check_view("values", values.data, values.size, values.type, s.size);
  const auto lock = impl_->turns.acquire("set_params");
  const arena_range held = impl_->layout.range();
  const std::size_t lo = std::max(held.begin, s.offset), hi = std::min(held.end, s.offset + s.size);
  if (lo >= hi) return; // nothing of it held (or an empty tensor, whose data may be null)
  float* dst = impl_->p() + (lo - held.begin);
  const std::size_t from = lo - s.offset, n = hi - lo;
  switch (values.type) {
  case dtype::f32: std::memmove(dst, static_cast<const float*>(values.data) + from, n * sizeof(float)); break;
  case dtype::bf16: {
    const auto* src = static_cast<const std::uint16_t*>(values.data) + from;
    for (std::size_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(src[i]);
    break;
  }
  case dtype::f16: {
    const auto* src = static_cast<const std::uint16_t*>(values.data) + from;
    for (std::size_t i = 0; i < n; ++i) dst[i] = f16_to_f32(src[i]);
    break;
  }
  }
}

step_result optimizer::step(const_view flat_grad, mut_view flat_out, float grad_scale) {
  step_options o;
  o.grad_scale = grad_scale;
  o.skip_nonfinite = false;
  return step(flat_grad, flat_out, o);
}

step_result optimizer::step(std::span<const const_view> grads, std::span<const mut_view> outs, float grad_scale) {
  step_options o;
  o.grad_scale = grad_scale;
  o.skip_nonfinite = false;
  return step(grads, outs, o);
}

std::int64_t optimizer::skipped_steps() const {
  const auto lock = impl_->turns.acquire("skipped_steps", false);
  return impl_->skipped;
}
void optimizer::set_skipped_steps(std::int64_t count) {
  const auto lock = impl_->turns.acquire("set_skipped_steps");
  check_count("skipped steps", count);
  impl_->skipped = count;
}

std::size_t optimizer::waiting_callers() const noexcept { return impl_->turns.waiting_callers(); }
bool optimizer::usable() const {
  const auto lock = impl_->turns.lock_only();
  return impl_->turns.failure().empty();
}
std::string optimizer::failure_reason() const {
  const auto lock = impl_->turns.lock_only();
  return impl_->turns.failure();
}
void optimizer::reset_failure() {
  const auto lock = impl_->turns.acquire("reset_failure", false);
  impl_->turns.clear_failure();
}

step_result optimizer::step(const_view flat_grad, mut_view flat_out, const step_options& opts) {
  impl& s = *impl_;
  const auto lock = s.turns.acquire("step");
  const bool has_out = s.check_flat_step(flat_grad, flat_out, opts);
  s.stat_views.clear();
  for (const auto& piece : s.pieces) // per tensor: padding is never read
    s.stat_views.push_back({static_cast<const char*>(flat_grad.data) + piece.offset * dtype_size(flat_grad.type),
                            piece.size, flat_grad.type});
  const step_plan pl = s.plan({flat_grad.type, out_of(has_out, flat_out.type), false}, opts);
  if (!pl.decision().apply) return make_step_result(pl.decision(), s.count, s.skipped);
  update_job job = s.job(flat_grad.type, out_of(has_out, flat_out.type));
  job.flat_grad = flat_grad.data;
  job.flat_out = has_out ? flat_out.data : nullptr;
  const block_counts seen = run_update(job, s.exec.threads);
  ++s.count;
  return make_step_result(pl.decision(), s.count, s.skipped, seen);
}

void optimizer::check_step(const_view flat_grad, mut_view flat_out, const step_options& opts) const {
  impl& s = *impl_;
  const auto lock = s.turns.acquire("step");
  s.check_flat_step(flat_grad, flat_out, opts);
  s.check_range_norm(opts);
  detail::step_plan::check_count(s.count);
  decide_step(opts, 0.0);
}

step_result optimizer::step(std::span<const const_view> grads, std::span<const mut_view> outs,
                            const step_options& opts) {
  impl& s = *impl_;
  const auto lock = s.turns.acquire("step");
  if (!s.layout.whole())
    throw std::invalid_argument("step with per-tensor views: this optimizer holds a range of the arena (a shard): "
                                "step it with flat buffers of its range");
  const std::size_t n = s.layout.segments().size();
  check_grad_scale(opts.grad_scale);
  if (grads.size() != n)
    throw std::invalid_argument("grads: " + std::to_string(grads.size()) + " views: expected one per tensor (" +
                                std::to_string(n) + ")");
  const bool has_out = !outs.empty();
  if (has_out && outs.size() != n)
    throw std::invalid_argument("outs: " + std::to_string(outs.size()) +
                                " views: expected none or one per tensor (" + std::to_string(n) + ")");
  // The first tensor with a gradient fixes the step's gradient dtype.
  std::size_t first = 0;
  while (first < n && grads[first].data == nullptr && grads[first].size == 0) ++first;
  const dtype grad_type = first < n ? grads[first].type : dtype::f32;
  const dtype out_type = has_out ? outs[0].type : dtype::f32;
  check_dtype("grads[" + std::to_string(first < n ? first : 0) + "]", grad_type);
  if (has_out) check_dtype("outs[0]", out_type);
  s.ranges.clear();
  // Cheap checks first; the message (with its allocations) is only built on failure.
  auto bad = [](const auto& view, std::size_t expected, dtype type) {
    return view.size != expected || (view.data == nullptr && view.size > 0) || view.type != type;
  };
  for (std::size_t i = 0; i < n; ++i) {
    if (grads[i].data == nullptr && grads[i].size == 0) continue; // no gradient: tensor skipped
    if (bad(grads[i], s.layout.segments()[i].size, grad_type)) {
      const std::string where = "grads[" + std::to_string(i) + "] ('" + s.layout.names()[i] + "')";
      check_view(where, grads[i].data, grads[i].size, grads[i].type, s.layout.segments()[i].size);
      throw std::invalid_argument(where + ".type = " + std::string(dtype_name(grads[i].type)) + ": expected " +
                                  std::string(dtype_name(grad_type)) + " like grads[" + std::to_string(first) +
                                  "] (one gradient dtype per step)");
    }
    s.ranges.push_back(range_of(grads[i].data, grads[i].size * dtype_size(grad_type), false, kind_grad, i));
    if (!has_out) continue;
    if (bad(outs[i], s.layout.segments()[i].size, out_type)) {
      const std::string where = "outs[" + std::to_string(i) + "] ('" + s.layout.names()[i] + "')";
      check_view(where, outs[i].data, outs[i].size, outs[i].type, s.layout.segments()[i].size);
      throw std::invalid_argument(where + ".type = " + std::string(dtype_name(outs[i].type)) + ": expected " +
                                  std::string(dtype_name(out_type)) + " like outs[0] (one copy-out dtype per step)");
    }
    s.ranges.push_back(range_of(outs[i].data, outs[i].size * dtype_size(out_type), true, kind_out, i));
  }
  s.storage.add_ranges(s.ranges, kind_state);
  check_no_overlap(s.ranges, view_kinds, &s.layout.names());

  for (std::size_t i = 0; i < n; ++i) { // whole: piece i is tensor i
    s.pieces[i].grad = grads[i].data;   // null: skipped by the engine
    s.pieces[i].out = has_out ? outs[i].data : nullptr;
  }
  s.stat_views.assign(grads.begin(), grads.end());
  const step_plan pl = s.plan({grad_type, out_of(has_out, out_type), false}, opts);
  if (!pl.decision().apply) return make_step_result(pl.decision(), s.count, s.skipped);
  const block_counts seen = run_update(s.job(grad_type, out_of(has_out, out_type)), s.exec.threads);
  ++s.count;
  for (std::size_t i = 0; i < n; ++i)
    if (grads[i].data == nullptr && grads[i].size == 0) ++s.lag[i]; // not stepped: its own count stays
  return make_step_result(pl.decision(), s.count, s.skipped, seen);
}

step_result optimizer::begin_step(const chunk_step_options& o) {
  impl& s = *impl_;
  auto lock = s.turns.acquire("begin_step", /*state=*/false);
  s.turns.let_waiters_go_first(lock);
  s.turns.refuse_if_failed("begin_step"); // once, after the waiters (one may have been a load that failed)
  check_dtype("grad_type", o.grad_type);
  if (o.copy_out) check_dtype("out_type", o.out_type);
  s.check_without_grad(o.tensors_without_grad, "begin_step");
  // The gradients arrive later: a norm the checks need must be known already.
  const step_plan pl = s.plan({o.grad_type, out_of(o.copy_out, o.out_type), o.accumulator}, o.checks,
                              []() -> double { refuse_unknown_norm("begin_step"); });
  if (!pl.decision().apply) return make_step_result(pl.decision(), s.count, s.skipped);
  s.chunk.open(o, pl.decision());
  s.turns.open_chunked();
  for (const std::size_t t : o.tensors_without_grad) s.pieces[t].no_grad = true; // whole: piece t is tensor t
  return make_step_result(pl.decision(), s.count, s.skipped);
}

void optimizer::check_options(const chunk_step_options& o) const {
  check_dtype("grad_type", o.grad_type);
  if (o.copy_out) check_dtype("out_type", o.out_type);
  decide_step(o.checks, 0.0);
  if (needs_unknown_norm(o.checks)) refuse_unknown_norm("begin_step");
  const auto lock = impl_->turns.acquire("begin_step"); // a failed state, a step count at its limit
  impl_->check_without_grad(o.tensors_without_grad, "begin_step");
  if (impl_->count >= max_step_count)
    throw std::invalid_argument("begin_step: the step count is at its limit (" + std::to_string(max_step_count) +
                                ", hostopt::max_step_count)");
}

void optimizer::update_range(std::size_t begin, std::size_t end, const void* grad, void* out,
                             const float* accumulator) {
  impl& s = *impl_;
  const auto lock = s.turns.acquire_chunked("update_range");
  s.chunk.check_next(begin, end, s.layout.size(), s.layout.unit() == q8_block, grad, out, accumulator);
  if (begin == end) return;
  // The chunk's buffers are the caller's, never the state (nor each other where written).
  const std::size_t n = end - begin;
  s.ranges.clear();
  s.ranges.push_back(range_of(grad, n * dtype_size(s.chunk.options.grad_type), false, kind_grad, 0));
  if (out) s.ranges.push_back(range_of(out, n * dtype_size(s.chunk.options.out_type), true, kind_out, 0));
  if (accumulator) s.ranges.push_back(range_of(accumulator, n * sizeof(float), false, kind_grad, 1));
  s.storage.add_ranges(s.ranges, kind_state);
  check_no_overlap(s.ranges, view_kinds);
  update_job job =
      s.job(s.chunk.options.grad_type, out_of(s.chunk.options.copy_out, s.chunk.options.out_type));
  job.begin = begin;
  job.end = end;
  job.flat_grad = grad;
  job.flat_out = out;
  job.flat_origin = begin;
  if (accumulator) {
    job.flat_accumulator = accumulator;
    job.add_grad = s.kernels->add_grad(s.chunk.options.grad_type);
  }
  ++s.chunk.updates;
  s.chunk.covered = end;
  const block_counts seen = run_update(job, s.exec.threads);
  s.chunk.seen.poisoned += seen.poisoned;
  s.chunk.seen.saturated += seen.saturated;
  if (out) s.copy_out_without_grad(begin, end, out);
}

step_result optimizer::finish_step() {
  impl& s = *impl_;
  const auto lock = s.turns.acquire_chunked("finish_step");
  s.chunk.check_complete(s.layout.size());
  for (std::size_t t = 0; t < s.pieces.size(); ++t)
    if (s.pieces[t].no_grad) ++s.lag[t]; // not stepped: its own count stays (whole: piece t is tensor t)
  s.close_chunked();
  ++s.count;
  return make_step_result(s.chunk.decision, s.count, s.skipped, s.chunk.seen);
}

void optimizer::abort_step(const std::string& reason) noexcept {
  impl& s = *impl_;
  const auto lock = s.turns.lock_only();
  if (!s.turns.own_chunked_open()) return;
  if (s.chunk.updates > 0) s.turns.keep_first_failure(reason);
  s.close_chunked();
}

void optimizer::mark_unusable(const std::string& reason) noexcept {
  impl& s = *impl_;
  const auto lock = s.turns.lock_only();
  if (s.turns.own_chunked_open()) s.close_chunked();
  s.turns.keep_first_failure(reason); // the first reason stays
}

bool optimizer::step_in_progress() const {
  const auto lock = impl_->turns.lock_only();
  return impl_->turns.chunked_open();
}

void optimizer::accumulate_range(std::size_t begin, std::size_t end, float* acc, const void* grad, dtype grad_type,
                                 bool first) {
  if (begin > end || end > impl_->layout.size())
    throw std::invalid_argument("accumulate_range: [" + std::to_string(begin) + ", " + std::to_string(end) +
                                "): expected a range inside [0, " + std::to_string(impl_->layout.size()) +
                                ")");
  accumulate_gradient(acc, {grad, end - begin, grad_type}, first, execution());
}

void optimizer::read_params(std::size_t begin, std::size_t end, void* out, dtype type) const {
  impl& s = *impl_;
  const auto lock = s.turns.acquire("read_params", true, true); // this thread's open chunked step may read
  if (begin > end || end > s.layout.size())
    throw std::invalid_argument("read_params: [" + std::to_string(begin) + ", " + std::to_string(end) +
                                "): expected a range inside [0, " + std::to_string(s.layout.size()) + ")");
  convert_params(s.p() + begin, {out, end - begin, type}, s.exec);
}

namespace detail {

exclusive_state::exclusive_state(const optimizer& opt, const char* what, bool allow_failed)
    : impl_(*opt.impl_), lock_(impl_.turns.acquire(what, !allow_failed)) {}
exclusive_state::~exclusive_state() = default;

std::span<const segment> exclusive_state::segments() const { return impl_.layout.segments(); }
arena_range exclusive_state::range() const { return impl_.layout.range(); }
char* exclusive_state::data_at(int k, std::size_t group, std::size_t flat) const {
  return k == 0 ? reinterpret_cast<char*>(impl_.p() + flat) : impl_.storage.moment_at(k, group, flat);
}
std::vector<moment_format> exclusive_state::formats() const { return impl_.storage.formats(); }
const std::vector<std::uint64_t>& exclusive_state::seeds() const { return impl_.seeds; }
void exclusive_state::set_seeds(std::span<const std::uint64_t> seeds) {
  if (seeds.size() != impl_.seeds.size())
    throw std::invalid_argument(std::to_string(seeds.size()) + " rounding seeds: expected one per group (" +
                                std::to_string(impl_.seeds.size()) + ")");
  for (std::size_t g = 0; g < seeds.size(); ++g) {
    impl_.seeds[g] = seeds[g];
    impl_.group_kernels[g].storage.seed = seeds[g];
  }
}
std::size_t exclusive_state::arena_size() const { return impl_.layout.size(); }
const std::vector<adam_config>& exclusive_state::configs() const { return impl_.configs; }
std::int64_t exclusive_state::step_count() const { return impl_.count; }
std::int64_t exclusive_state::skipped_steps() const { return impl_.skipped; }
std::vector<std::int64_t> exclusive_state::tensor_lags() const {
  const auto& lag = impl_.lag;
  const bool behind = std::any_of(lag.begin(), lag.end(), [](std::int64_t l) { return l != 0; });
  return behind ? lag : std::vector<std::int64_t>();
}

void exclusive_state::set_tensor_lags(std::span<const std::int64_t> lags) {
  impl_.clear_lags();
  if (lags.empty()) return;
  if (lags.size() != impl_.lag.size() || !impl_.layout.whole())
    throw std::invalid_argument("per-tensor step counts: expected one per tensor, on an optimizer holding the whole "
                                "layout");
  for (std::size_t i = 0; i < lags.size(); ++i) {
    if (lags[i] < 0 || lags[i] > impl_.count)
      throw std::invalid_argument("tensor '" + impl_.layout.names()[i] +
                                  "': step count outside [0, step count]");
    impl_.lag[i] = lags[i];
  }
}

void exclusive_state::set_counters(std::vector<adam_config> configs, std::int64_t step, std::int64_t skipped) {
  check_count("step count", step);
  check_count("skipped steps", skipped);
  if (configs.size() != impl_.configs.size())
    throw std::invalid_argument(std::to_string(configs.size()) + " parameter groups: expected " +
                                std::to_string(impl_.configs.size()));
  for (std::size_t g = 0; g < configs.size(); ++g) validate(configs[g], "groups[" + std::to_string(g) + "]");
  impl_.configs = std::move(configs);
  impl_.count = step;
  impl_.skipped = skipped;
  impl_.clear_lags();
}

void exclusive_state::mark_failed(const std::string& reason) { impl_.turns.replace_failure(reason); }
void exclusive_state::clear_failure() { impl_.turns.clear_failure(); }

} // namespace detail

} // namespace hostopt
