// hostopt::adam_step: the one-buffer step, validated and run through the update engine.
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "parallel.hpp"

#include "buffer_checks.hpp"
#include "hostopt/kernels.hpp"
#include "kernel_registry.hpp"
#include "step_scalars.hpp"
#include "update_engine.hpp"

namespace hostopt {

namespace {
// The checks both one-buffer steps share; returns the kernel set to run.
const detail::kernel_set& check_step_arguments(const adam_config& config, std::int64_t step, float grad_scale,
                                               const execution_options& exec) {
  validate(config, "config");
  detail::check_step_number(step);
  detail::check_grad_scale(grad_scale);
  detail::check_threads(exec.threads);
  return detail::kernel_set_by_name(exec.kernel);
}
} // namespace

void adam_step(float* params, float* exp_avg, float* exp_avg_sq, std::size_t n, const_view grad,
               mut_view out, const adam_config& config, std::int64_t step, float grad_scale,
               const execution_options& exec) {
  using namespace detail;
  const kernel_set& ks = check_step_arguments(config, step, grad_scale, exec);
  check_view("params", params, n, dtype::f32, n);
  check_view("exp_avg", exp_avg, n, dtype::f32, n);
  check_view("exp_avg_sq", exp_avg_sq, n, dtype::f32, n);
  check_view("grad", grad.data, grad.size, grad.type, n);
  const bool has_out = out.data != nullptr || out.size != 0;
  if (has_out) check_view("out", out.data, out.size, out.type, n);
  if (n == 0) return;

  const char* names[] = {"params", "exp_avg", "exp_avg_sq", "grad", "out"};
  std::vector<byte_range> ranges{range_of(params, n * 4, true, 0, 0), range_of(exp_avg, n * 4, true, 1, 0),
                                 range_of(exp_avg_sq, n * 4, true, 2, 0),
                                 range_of(grad.data, n * dtype_size(grad.type), false, 3, 0)};
  if (has_out) ranges.push_back(range_of(out.data, n * dtype_size(out.type), true, 4, 0));
  check_no_overlap(ranges, names);

  const kernel_variant var = variant_of(config);
  group_kernel gk;
  gk.fn = ks.adam[int(grad.type)][out_column(has_out, int(out.type))][int(var.decay)][var.nesterov];
  gk.scalars = make_step_scalars(config, step, grad_scale);
  update_piece piece{0, n, 0, grad.data, has_out ? out.data : nullptr};
  update_job job;
  job.params = params;
  job.exp_avg = exp_avg;
  job.exp_avg_sq = exp_avg_sq;
  job.pieces = &piece;
  job.num_pieces = 1;
  job.groups = &gk;
  job.grad_elem_bytes = dtype_size(grad.type);
  job.out_elem_bytes = has_out ? dtype_size(out.type) : 0;
  job.begin = 0;
  job.end = n;
  run_update(job, exec.threads);
}

void adam_update(const float* params, float* exp_avg, float* exp_avg_sq, std::size_t n, const_view grad,
                 mut_view update, const adam_config& config, std::int64_t step, float grad_scale,
                 const execution_options& exec) {
  using namespace detail;
  const kernel_set& ks = check_step_arguments(config, step, grad_scale, exec);
  const kernel_variant var = variant_of(config);
  if (var.decay != decay_kind::none || params) check_view("params", params, n, dtype::f32, n);
  check_view("exp_avg", exp_avg, n, dtype::f32, n);
  check_view("exp_avg_sq", exp_avg_sq, n, dtype::f32, n);
  check_view("grad", grad.data, grad.size, grad.type, n);
  check_view("update", update.data, update.size, update.type, n);
  if (update.type != grad.type)
    throw std::invalid_argument("update.type = " + std::string(dtype_name(update.type)) + ": expected " +
                                std::string(dtype_name(grad.type)) + " like grad");
  if (n == 0) return;
  const char* names[] = {"params", "exp_avg", "exp_avg_sq", "grad", "update"};
  const std::size_t esz = dtype_size(grad.type);
  std::vector<byte_range> ranges{range_of(exp_avg, n * 4, true, 1, 0), range_of(exp_avg_sq, n * 4, true, 2, 0),
                                 range_of(grad.data, n * esz, false, 3, 0), range_of(update.data, n * esz, true, 4, 0)};
  if (params) ranges.push_back(range_of(params, n * 4, false, 0, 0));
  check_no_overlap(ranges, names);
  const adam_fn fn = ks.delta[int(grad.type)][int(var.decay)][var.nesterov];
  const step_scalars sc = make_step_scalars(config, step, grad_scale);
  float* p = const_cast<float*>(params); // read only: the delta kernels never store to it
  auto body = [&](int tid, int nt) {
    const auto [lo, hi] = partition(0, n, tid, nt);
    if (lo >= hi) return;
    fn(sc, p ? p + lo : nullptr, exp_avg + lo, exp_avg_sq + lo, static_cast<const char*>(grad.data) + lo * esz,
       static_cast<char*>(update.data) + lo * esz, hi - lo);
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
  const add_grad_fn add = ks.add_grad[int(grad.type)];
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
  const cast_fn cast = ks.cast[out_column(true, int(out.type))];
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
