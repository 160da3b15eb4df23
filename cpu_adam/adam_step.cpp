// hostopt::adam_step: the one-buffer step, validated and run through the update engine.
#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "parallel.hpp"

#include "buffer_checks.hpp"
#include "hostopt/kernels.hpp"
#include "kernel_registry.hpp"
#include "step_plan.hpp"
#include "step_scalars.hpp"
#include "update_engine.hpp"

#include <cmath>

namespace hostopt {

using namespace detail;

namespace {

const kernel_set& check_execution(float grad_scale, const execution_options& exec) {
  check_grad_scale(grad_scale);
  check_threads(exec.threads);
  return kernel_set_by_name(exec.kernel);
}

} // namespace

void adam_step(float* params, float* exp_avg, float* exp_avg_sq, std::size_t n, const_view grad,
               mut_view out, const adam_config& config, std::int64_t step, float grad_scale,
               const execution_options& exec) {
  const kernel_set& ks = check_execution(grad_scale, exec);
  check_view("params", params, n, dtype::f32, n);
  check_view("exp_avg", exp_avg, n, dtype::f32, n);
  check_view("exp_avg_sq", exp_avg_sq, n, dtype::f32, n);
  check_view("grad", grad.data, grad.size, grad.type, n);
  const bool has_out = out.data != nullptr || out.size != 0;
  if (has_out) check_view("out", out.data, out.size, out.type, n);
  group_kernel gk;
  const step_io io{grad.type, has_out ? std::optional<dtype>(out.type) : std::nullopt, false, false};
  one_buffer_plan(ks, std::span<const adam_config>(&config, 1), step, io, grad_scale, std::span<group_kernel>(&gk, 1));
  if (n == 0) return;

  const char* names[] = {"params", "exp_avg", "exp_avg_sq", "grad", "out"};
  std::vector<byte_range> ranges{range_of(params, n * 4, true, 0, 0), range_of(exp_avg, n * 4, true, 1, 0),
                                 range_of(exp_avg_sq, n * 4, true, 2, 0),
                                 range_of(grad.data, n * dtype_size(grad.type), false, 3, 0)};
  if (has_out) ranges.push_back(range_of(out.data, n * dtype_size(out.type), true, 4, 0));
  check_no_overlap(ranges, names);

  update_piece piece{0, n, 0, grad.data, has_out ? out.data : nullptr};
  run_update(one_piece_job(params, exp_avg, exp_avg_sq, piece, gk, dtype_size(grad.type),
                           has_out ? dtype_size(out.type) : 0),
             exec.threads);
}

void adam_update(const float* params, float* exp_avg, float* exp_avg_sq, std::size_t n, const_view grad,
                 mut_view update, const adam_config& config, std::int64_t step, float grad_scale,
                 const execution_options& exec) {
  if (grad.size != n) check_view("grad", grad.data, grad.size, grad.type, n);
  const update_leaf leaf{params, exp_avg, exp_avg_sq, grad, update, 0};
  adam_update(std::span<const update_leaf>(&leaf, 1), std::span<const adam_config>(&config, 1), step, grad_scale,
              exec);
}

void adam_update(std::span<const update_leaf> leaves, std::span<const adam_config> configs, std::int64_t step,
                 float grad_scale, const execution_options& exec) {
  const kernel_set& ks = check_execution(grad_scale, exec);
  const dtype grad_type = leaves.empty() ? dtype::f32 : leaves[0].grad.type;
  // Every leaf first: nothing is written unless all are good.
  std::vector<std::size_t> first(leaves.size() + 1, 0); // leaf i covers [first[i], first[i+1])
  std::vector<byte_range> ranges; // of every leaf: one region runs them all at once
  const char* names[] = {"params", "exp_avg", "exp_avg_sq", "grad", "update"};
  for (std::size_t i = 0; i < leaves.size(); ++i) {
    const update_leaf& l = leaves[i];
    const std::string at = leaves.size() == 1 ? std::string() : "leaves[" + std::to_string(i) + "].";
    const std::size_t n = l.grad.size;
    check_update_leaf(at, l.params, l.grad, l.update, l.config, configs, grad_type);
    check_view(at + "exp_avg", l.exp_avg, n, dtype::f32, n);
    check_view(at + "exp_avg_sq", l.exp_avg_sq, n, dtype::f32, n);
    first[i + 1] = first[i] + n;
    if (n == 0) continue;
    const std::size_t esz = dtype_size(grad_type);
    ranges.insert(ranges.end(), {range_of(l.exp_avg, n * 4, true, 1, i), range_of(l.exp_avg_sq, n * 4, true, 2, i),
                                 range_of(l.update.data, n * esz, true, 4, i)});
    // The update may be written over its own gradient (the kernel loads each block of the
    // gradient before it stores that block's update): XLA hands the same buffer to both
    // when it aliases them. Any other overlap is refused.
    if (l.grad.data != l.update.data) ranges.push_back(range_of(l.grad.data, n * esz, false, 3, i));
    if (l.params) ranges.push_back(range_of(l.params, n * 4, false, 0, i));
  }
  check_no_overlap_of_leaves(ranges, names, leaves.size());
  std::vector<group_kernel> groups(configs.size());
  one_buffer_plan(ks, configs, step, {grad_type, std::nullopt, false, true}, grad_scale, groups, /*signed_rates=*/true);
  const std::size_t total = first.back();
  if (total == 0) return;
  const std::size_t esz = dtype_size(grad_type);
  // One region over all leaves' elements, as one range.
  auto body = [&](int tid, int nt) {
    const auto [lo, hi] = partition(0, total, tid, nt);
    if (lo >= hi) return;
    std::size_t i = std::size_t(std::upper_bound(first.begin(), first.end(), lo) - first.begin()) - 1;
    for (std::size_t at = lo; at < hi; ++i) {
      const std::size_t a = at - first[i], b = std::min(hi, first[i + 1]) - first[i];
      if (a < b) {
        const update_leaf& l = leaves[i];
        const group_kernel& g = groups[l.config];
        float* p = const_cast<float*>(l.params); // read only: the delta kernels never store to it
        g.fn(g.scalars, p ? p + a : nullptr, l.exp_avg + a, l.exp_avg_sq + a,
             static_cast<const char*>(l.grad.data) + a * esz, static_cast<char*>(l.update.data) + a * esz, b - a);
      }
      at = first[i] + b;
    }
  };
  run_parallel(exec.threads, body);
}

void accumulate_gradient(float* acc, const_view grad, bool first, const execution_options& exec) {
  using namespace detail;
  check_threads(exec.threads);
  const kernel_set& ks = kernel_set_by_name(exec.kernel);
  const std::size_t n = grad.size;
  check_view("grad", grad.data, grad.size, grad.type, n);
  check_view("acc", acc, n, dtype::f32, n);
  if (n == 0) return;
  const char* names[] = {"acc", "grad"};
  std::vector<byte_range> ranges{range_of(acc, n * 4, true, 0, 0),
                                 range_of(grad.data, n * dtype_size(grad.type), false, 1, 0)};
  check_no_overlap(ranges, names);
  const add_grad_fn add = ks.add_grad(grad.type);
  const std::size_t gsz = dtype_size(grad.type);
  auto body = [&](int tid, int nt) {
    const auto [lo, hi] = partition(0, n, tid, nt);
    if (lo < hi) add(acc + lo, first ? nullptr : acc + lo, static_cast<const char*>(grad.data) + lo * gsz, hi - lo);
  };
  run_parallel(exec.threads, body);
}

} // namespace hostopt

namespace hostopt {

void convert_params(const float* in, mut_view out, const execution_options& exec) {
  using namespace detail;
  check_threads(exec.threads);
  const kernel_set& ks = kernel_set_by_name(exec.kernel);
  const std::size_t n = out.size;
  check_view("out", out.data, out.size, out.type, n);
  check_view("in", in, n, dtype::f32, n);
  if (n == 0) return;
  const char* names[] = {"in", "out"};
  std::vector<byte_range> ranges{range_of(in, n * 4, false, 0, 0), range_of(out.data, n * dtype_size(out.type), true, 1, 0)};
  check_no_overlap(ranges, names);
  const std::size_t osz = dtype_size(out.type);
  const cast_fn cast = ks.cast(out.type);
  auto body = [&](int tid, int nt) {
    const auto [lo, hi] = partition(0, n, tid, nt);
    if (lo >= hi) return;
    char* dst = static_cast<char*>(out.data) + lo * osz;
    if (out.type == dtype::f32) std::memcpy(dst, in + lo, (hi - lo) * 4);
    else cast(in + lo, dst, hi - lo);
  };
  run_parallel(exec.threads, body);
}

} // namespace hostopt
