#include "hostopt/optimizer.hpp"

#include <algorithm>
#include <cstring>
#include <map>
#include <stdexcept>

#include "aligned_buffer.hpp"
#include "buffer_checks.hpp"
#include "half_conversion.hpp"
#include "hostopt/gradient_checks.hpp"
#include <cmath>
#include "kernel_registry.hpp"
#include "parallel.hpp"
#include "step_scalars.hpp"
#include "update_engine.hpp"

namespace hostopt {

using namespace detail;

namespace {

const char* const view_kinds[] = {"grads", "outs", "optimizer state"};
constexpr int kind_grad = 0, kind_out = 1, kind_state = 2;

std::size_t align_up(std::size_t x) { return (x + align_elems - 1) / align_elems * align_elems; }

std::size_t element_count(const tensor_spec& t) {
  std::size_t n = 1;
  for (std::size_t d = 0; d < t.shape.size(); ++d) {
    const std::int64_t e = t.shape[d];
    if (e < 0)
      throw std::invalid_argument("tensor '" + t.name + "': shape[" + std::to_string(d) + "] = " +
                                  std::to_string(e) + ": expected an extent >= 0");
    if (e != 0 && n > std::size_t(-1) / 64 / std::size_t(e))
      throw std::invalid_argument("tensor '" + t.name + "': shape has too many elements");
    n *= std::size_t(e);
  }
  return n;
}

} // namespace

struct optimizer::impl {
  std::vector<segment> segs;
  std::vector<std::string> names; // segs[i].name, for error messages
  std::map<std::string, std::size_t, std::less<>> by_name;
  std::vector<adam_config> configs;
  execution_options exec;
  const kernel_set* kernels = nullptr;
  std::size_t arena = 0, nparams = 0;
  aligned_floats state; // params | exp_avg | exp_avg_sq, each `arena` floats
  std::int64_t count = 0;
  // Scratch sized at construction so that a step allocates nothing.
  std::vector<update_piece> pieces;
  std::vector<group_kernel> group_kernels;
  std::vector<byte_range> ranges;

  float* p() const { return state.data(); }
  float* m() const { return state.data() + arena; }
  float* v() const { return state.data() + 2 * arena; }

  std::size_t index_of(std::string_view name) const {
    const auto it = by_name.find(name);
    if (it == by_name.end())
      throw std::invalid_argument("tensor name '" + std::string(name) +
                                  "': unknown, expected one of the " + std::to_string(segs.size()) +
                                  " registered tensors");
    return it->second;
  }

  void check_group(std::size_t g) const {
    if (g >= configs.size())
      throw std::invalid_argument("group = " + std::to_string(g) + ": expected an index below " +
                                  std::to_string(configs.size()));
  }

  // An open chunked step (begin_step .. finish_step).
  bool chunked_open = false;
  chunk_step_options chunked{};

  // Chooses each group's kernel and computes its constants for step count + 1. With an
  // accumulator the kernels take the f32 sum that the engine builds per block.
  void prepare(dtype grad_type, bool has_out, dtype out_type, float grad_scale, bool accumulator) {
    const std::int64_t t = count + 1;
    const int grad_col = accumulator ? int(dtype::f32) : int(grad_type);
    for (std::size_t g = 0; g < configs.size(); ++g) {
      const kernel_variant var = variant_of(configs[g]);
      group_kernels[g].fn = kernels->adam[grad_col][out_column(has_out, int(out_type))][int(var.decay)][var.nesterov];
      group_kernels[g].scalars = make_step_scalars(configs[g], t, grad_scale);
    }
  }

  update_job job(dtype grad_type, bool has_out, dtype out_type) const {
    update_job j;
    j.params = p();
    j.exp_avg = m();
    j.exp_avg_sq = v();
    j.pieces = pieces.data();
    j.num_pieces = pieces.size();
    j.groups = group_kernels.data();
    j.grad_elem_bytes = dtype_size(grad_type);
    j.out_elem_bytes = has_out ? dtype_size(out_type) : 0;
    j.begin = 0;
    j.end = arena;
    return j;
  }

  std::int64_t skipped = 0;
  std::vector<const_view> stat_views; // the step's gradients, per tensor, for the checks

  // The checks of step_options, before anything is written: returns applied = false for a
  // skipped step, else the scale to step with (grad_scale times the clip factor).
  step_result check(const step_options& o) {
    check_grad_scale(o.grad_scale);
    if (o.max_grad_norm < 0 || std::isnan(o.max_grad_norm) || std::isinf(o.max_grad_norm))
      throw std::invalid_argument("max_grad_norm = " + std::to_string(o.max_grad_norm) +
                                  ": expected a finite value >= 0 (0 = no clipping)");
    step_result r;
    r.step = count;
    r.applied = true;
    r.applied_scale = o.grad_scale;
    r.skipped_steps = skipped;
    if (!o.skip_nonfinite && o.max_grad_norm == 0) return r;
    double raw_norm = o.known_grad_norm;
    if (raw_norm < 0) raw_norm = gradient_stats(stat_views, exec).norm; // NaN/inf when non-finite
    const double norm = double(o.grad_scale) * raw_norm;
    r.grad_norm = norm;
    if (!std::isfinite(norm)) {
      if (o.skip_nonfinite) {
        r.applied = false;
        r.skipped_steps = ++skipped;
        return r;
      }
      return r; // asked not to check: the step goes on
    }
    if (o.max_grad_norm > 0) r.applied_scale = float(double(o.grad_scale) * clip_coefficient(norm, o.max_grad_norm));
    return r;
  }

  step_result commit(step_result r = {}) {
    ++count;
    r.applied = true;
    r.step = count;
    r.skipped_steps = skipped;
    return r;
  }

  void refuse_if_chunked(const char* what) const {
    if (chunked_open)
      throw std::logic_error(std::string(what) + ": a chunked step is open (begin_step without finish_step)");
  }
};

std::vector<segment> arena_layout(const std::vector<param_group>& groups) {
  std::vector<segment> segs;
  std::map<std::string, std::size_t, std::less<>> seen;
  std::size_t offset = 0;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    validate(groups[g].config, "groups[" + std::to_string(g) + "].config");
    for (const auto& t : groups[g].tensors) {
      if (t.name.empty())
        throw std::invalid_argument("groups[" + std::to_string(g) +
                                    "]: a tensor has an empty name: expected a unique name");
      const std::size_t n = element_count(t);
      if (!seen.emplace(t.name, segs.size()).second)
        throw std::invalid_argument("tensor name '" + t.name + "': registered twice, expected unique names");
      segs.push_back({t.name, t.shape, offset, n, g});
      offset = align_up(offset + n);
    }
  }
  return segs;
}

optimizer::optimizer(std::vector<param_group> groups, execution_options exec)
    : impl_(std::make_unique<impl>()) {
  impl& s = *impl_;
  check_threads(exec.threads);
  s.kernels = &kernel_set_by_name(exec.kernel);
  s.exec = std::move(exec);
  s.segs = arena_layout(groups);
  for (const auto& g : groups) s.configs.push_back(g.config);
  std::size_t offset = 0;
  for (std::size_t i = 0; i < s.segs.size(); ++i) {
    s.by_name.emplace(s.segs[i].name, i);
    s.names.push_back(s.segs[i].name);
    s.nparams += s.segs[i].size;
    offset = align_up(s.segs[i].offset + s.segs[i].size);
  }
  s.arena = offset;
  s.state = aligned_floats(3 * s.arena);
  s.pieces.resize(s.segs.size());
  for (std::size_t i = 0; i < s.segs.size(); ++i)
    s.pieces[i] = {s.segs[i].offset, s.segs[i].size, s.segs[i].group, nullptr, nullptr};
  s.group_kernels.resize(s.configs.size());
  s.ranges.reserve(2 * s.segs.size() + 3);
  s.stat_views.reserve(s.segs.size());

  // First touch by the threads (and the partition) that will update each slice.
  impl* self = &s;
  auto zero = [self](int tid, int nthreads) {
    const auto [lo, hi] = partition(0, self->arena, tid, nthreads);
    for (float* base : {self->p(), self->m(), self->v()})
      if (lo < hi) std::memset(base + lo, 0, (hi - lo) * sizeof(float));
  };
  run_parallel(s.exec.threads, zero);
}

optimizer::~optimizer() = default;
optimizer::optimizer(optimizer&&) noexcept = default;
optimizer& optimizer::operator=(optimizer&&) noexcept = default;

std::size_t optimizer::arena_size() const { return impl_->arena; }
std::size_t optimizer::num_params() const { return impl_->nparams; }
std::size_t optimizer::state_bytes() const { return 3 * impl_->arena * sizeof(float); }
std::span<const segment> optimizer::segments() const { return impl_->segs; }
const segment& optimizer::tensor(std::string_view name) const {
  return impl_->segs[impl_->index_of(name)];
}

std::size_t optimizer::num_groups() const { return impl_->configs.size(); }
const adam_config& optimizer::group_config(std::size_t group) const {
  impl_->check_group(group);
  return impl_->configs[group];
}
void optimizer::set_group_config(std::size_t group, const adam_config& config) {
  impl_->check_group(group);
  validate(config, "groups[" + std::to_string(group) + "].config");
  impl_->configs[group] = config;
}
void optimizer::set_lr(std::size_t group, double lr) {
  impl_->check_group(group);
  adam_config c = impl_->configs[group];
  c.lr = lr;
  set_group_config(group, c);
}
std::int64_t optimizer::step_count() const { return impl_->count; }
void optimizer::set_step_count(std::int64_t count) {
  if (count < 0)
    throw std::invalid_argument("step count = " + std::to_string(count) + ": expected >= 0");
  impl_->count = count;
}

const execution_options& optimizer::execution() const { return impl_->exec; }
void optimizer::set_execution(const execution_options& exec) {
  check_threads(exec.threads);
  impl_->kernels = &kernel_set_by_name(exec.kernel);
  impl_->exec = exec;
}

std::span<float> optimizer::params() { return {impl_->p(), impl_->arena}; }
std::span<float> optimizer::exp_avg() { return {impl_->m(), impl_->arena}; }
std::span<float> optimizer::exp_avg_sq() { return {impl_->v(), impl_->arena}; }
std::span<const float> optimizer::params() const { return {impl_->p(), impl_->arena}; }
std::span<const float> optimizer::exp_avg() const { return {impl_->m(), impl_->arena}; }
std::span<const float> optimizer::exp_avg_sq() const { return {impl_->v(), impl_->arena}; }

std::span<float> optimizer::params(std::string_view name) {
  const segment& s = tensor(name);
  return {impl_->p() + s.offset, s.size};
}
std::span<float> optimizer::exp_avg(std::string_view name) {
  const segment& s = tensor(name);
  return {impl_->m() + s.offset, s.size};
}
std::span<float> optimizer::exp_avg_sq(std::string_view name) {
  const segment& s = tensor(name);
  return {impl_->v() + s.offset, s.size};
}

void optimizer::set_params(std::string_view name, const_view values) {
  const segment& s = tensor(name);
  check_view("values", values.data, values.size, values.type, s.size);
  float* dst = impl_->p() + s.offset;
  if (s.size == 0) return; // an empty tensor: nothing to copy (and values.data may be null)
  switch (values.type) {
  case dtype::f32: std::memmove(dst, values.data, s.size * sizeof(float)); break;
  case dtype::bf16: {
    const auto* src = static_cast<const std::uint16_t*>(values.data);
    for (std::size_t i = 0; i < s.size; ++i) dst[i] = bf16_to_f32(src[i]);
    break;
  }
  case dtype::f16: {
    const auto* src = static_cast<const std::uint16_t*>(values.data);
    for (std::size_t i = 0; i < s.size; ++i) dst[i] = f16_to_f32(src[i]);
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

std::int64_t optimizer::skipped_steps() const { return impl_->skipped; }
void optimizer::set_skipped_steps(std::int64_t count) {
  if (count < 0)
    throw std::invalid_argument("skipped steps = " + std::to_string(count) + ": expected >= 0");
  impl_->skipped = count;
}

step_result optimizer::step(const_view flat_grad, mut_view flat_out, const step_options& opts) {
  impl& s = *impl_;
  s.refuse_if_chunked("step");
  const float grad_scale = opts.grad_scale;
  check_grad_scale(grad_scale);
  check_view("flat_grad", flat_grad.data, flat_grad.size, flat_grad.type, s.arena);
  const bool has_out = flat_out.data != nullptr || flat_out.size != 0;
  if (has_out) check_view("flat_out", flat_out.data, flat_out.size, flat_out.type, s.arena);
  s.ranges.clear();
  s.ranges.push_back(range_of(flat_grad.data, s.arena * dtype_size(flat_grad.type), false, kind_grad, 0));
  if (has_out)
    s.ranges.push_back(range_of(flat_out.data, s.arena * dtype_size(flat_out.type), true, kind_out, 0));
  s.ranges.push_back(range_of(s.p(), 3 * s.arena * sizeof(float), true, kind_state, 0));
  check_no_overlap(s.ranges, view_kinds);

  s.stat_views.clear();
  for (const auto& seg : s.segs) // per tensor: padding is never read
    s.stat_views.push_back({static_cast<const char*>(flat_grad.data) + seg.offset * dtype_size(flat_grad.type),
                            seg.size, flat_grad.type});
  step_result checked = s.check(opts);
  if (!checked.applied) return checked;
  s.prepare(flat_grad.type, has_out, flat_out.type, checked.applied_scale, false);
  update_job job = s.job(flat_grad.type, has_out, flat_out.type);
  job.flat_grad = flat_grad.data;
  job.flat_out = has_out ? flat_out.data : nullptr;
  run_update(job, s.exec.threads);
  return s.commit(checked);
}

step_result optimizer::step(std::span<const const_view> grads, std::span<const mut_view> outs,
                            const step_options& opts) {
  impl& s = *impl_;
  s.refuse_if_chunked("step");
  const float grad_scale = opts.grad_scale;
  const std::size_t n = s.segs.size();
  check_grad_scale(grad_scale);
  if (grads.size() != n)
    throw std::invalid_argument("grads: " + std::to_string(grads.size()) +
                                " views: expected one per tensor (" + std::to_string(n) + ")");
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
    if (bad(grads[i], s.segs[i].size, grad_type)) {
      const std::string where = "grads[" + std::to_string(i) + "] ('" + s.names[i] + "')";
      check_view(where, grads[i].data, grads[i].size, grads[i].type, s.segs[i].size);
      throw std::invalid_argument(where + ".type = " + std::string(dtype_name(grads[i].type)) +
                                  ": expected " + std::string(dtype_name(grad_type)) +
                                  " like grads[" + std::to_string(first) + "] (one gradient dtype per step)");
    }
    s.ranges.push_back(range_of(grads[i].data, grads[i].size * dtype_size(grad_type), false, kind_grad, i));
    if (!has_out) continue;
    if (bad(outs[i], s.segs[i].size, out_type)) {
      const std::string where = "outs[" + std::to_string(i) + "] ('" + s.names[i] + "')";
      check_view(where, outs[i].data, outs[i].size, outs[i].type, s.segs[i].size);
      throw std::invalid_argument(where + ".type = " + std::string(dtype_name(outs[i].type)) +
                                  ": expected " + std::string(dtype_name(out_type)) +
                                  " like outs[0] (one copy-out dtype per step)");
    }
    s.ranges.push_back(range_of(outs[i].data, outs[i].size * dtype_size(out_type), true, kind_out, i));
  }
  s.ranges.push_back(range_of(s.p(), 3 * s.arena * sizeof(float), true, kind_state, 0));
  check_no_overlap(s.ranges, view_kinds, &s.names);

  for (std::size_t i = 0; i < n; ++i) {
    s.pieces[i].grad = grads[i].data; // null: skipped by the engine
    s.pieces[i].out = has_out ? outs[i].data : nullptr;
  }
  s.stat_views.assign(grads.begin(), grads.end());
  step_result checked = s.check(opts);
  if (!checked.applied) return checked;
  s.prepare(grad_type, has_out, out_type, checked.applied_scale, false);
  run_update(s.job(grad_type, has_out, out_type), s.exec.threads);
  return s.commit(checked);
}

void optimizer::begin_step(const chunk_step_options& o) {
  impl& s = *impl_;
  s.refuse_if_chunked("begin_step");
  check_dtype("grad_type", o.grad_type);
  if (o.copy_out) check_dtype("out_type", o.out_type);
  check_grad_scale(o.grad_scale);
  s.prepare(o.grad_type, o.copy_out, o.out_type, o.grad_scale, o.accumulator);
  s.chunked = o;
  s.chunked_open = true;
}

void optimizer::update_range(std::size_t begin, std::size_t end, const void* grad, void* out,
                             const float* accumulator) {
  impl& s = *impl_;
  if (!s.chunked_open) throw std::logic_error("update_range: no chunked step is open (call begin_step first)");
  if (begin > end || end > s.arena)
    throw std::invalid_argument("update_range: [" + std::to_string(begin) + ", " + std::to_string(end) +
                                "): expected a range inside [0, " + std::to_string(s.arena) + ")");
  if (begin == end) return;
  if (!grad) throw std::invalid_argument("update_range: grad is null: expected a gradient chunk");
  if (s.chunked.copy_out != (out != nullptr))
    throw std::invalid_argument(std::string("update_range: out is ") + (out ? "set" : "null") +
                                ": expected " + (s.chunked.copy_out ? "an output chunk" : "none (begin_step had copy_out off)"));
  if (s.chunked.accumulator != (accumulator != nullptr))
    throw std::invalid_argument(std::string("update_range: accumulator is ") + (accumulator ? "set" : "null") +
                                ": expected " + (s.chunked.accumulator ? "an accumulator chunk" : "none"));
  update_job job = s.job(s.chunked.grad_type, s.chunked.copy_out, s.chunked.out_type);
  job.begin = begin;
  job.end = end;
  job.flat_grad = grad;
  job.flat_out = out;
  job.flat_origin = begin;
  if (accumulator) {
    job.flat_accumulator = accumulator;
    job.add_grad = s.kernels->add_grad[int(s.chunked.grad_type)];
  }
  run_update(job, s.exec.threads);
}

step_result optimizer::finish_step() {
  impl& s = *impl_;
  if (!s.chunked_open) throw std::logic_error("finish_step: no chunked step is open (call begin_step first)");
  s.chunked_open = false;
  return s.commit();
}

void optimizer::abort_step() noexcept { impl_->chunked_open = false; }

bool optimizer::step_in_progress() const { return impl_->chunked_open; }

} // namespace hostopt
