// The one-buffer step over compressed moments, and the explicit format conversions.
#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "buffer_checks.hpp"
#include "hostopt/kernels.hpp"
#include "kernel_registry.hpp"
#include "parallel.hpp"
#include "rounding_key.hpp"
#include "step_plan.hpp"
#include "update_engine.hpp"

namespace hostopt {

using namespace detail;

namespace {


// The format is a compressed one, the buffers are there for n elements, and an 8-bit
// piece starts on a block and ends on one or at the state's end; appends the moments'
// byte ranges for the overlap check. `what` names the argument ("moments", "out", "in").
void check_moments(const std::string& what, const compressed_moments& mo, std::size_t n, const rounding_stream& r,
                   std::vector<byte_range>& ranges, int kind, std::size_t leaf = 0,
                   const std::string& first_index_name = "rounding.first_index") {
  const moment_format f = mo.format;
  if (f != moment_format::bf16 && f != moment_format::q8) {
    if (f == moment_format::f32)
      throw std::invalid_argument(what + ".format = f32: compressed moments are bf16 or 8bit");
    detail::bad_moment_format(f);
  }
  if (n == 0) return;
  if (!mo.exp_avg || !mo.exp_avg_sq)
    throw std::invalid_argument(what + (mo.exp_avg ? ".exp_avg_sq" : ".exp_avg") + " is null for " +
                                std::to_string(n) + " elements: expected a buffer");
  if (f == moment_format::q8) {
    if (!mo.scales)
      throw std::invalid_argument(what + ".scales is null: the 8bit format needs " +
                                  std::to_string(moment_scale_bytes(f, n)) + " bytes of block exponents");
    if (r.first_index % q8_block)
      throw std::invalid_argument(first_index_name + " = " + std::to_string(r.first_index) +
                                  ": 8bit pieces start on a block (a multiple of " + std::to_string(q8_block) + ")");
    const std::uint64_t end = r.first_index + n;
    if (r.state_size != 0 && end > r.state_size)
      throw std::invalid_argument("rounding.state_size = " + std::to_string(r.state_size) + ": below the piece's end " +
                                  std::to_string(end));
    if (r.state_size != 0 && end != r.state_size && end % q8_block)
      throw std::invalid_argument("the piece ends at element " + std::to_string(end) + ", inside an 8bit block and " +
                                  "before the state's end (" + std::to_string(r.state_size) +
                                  "): it would re-scale elements it does not hold; end pieces on a multiple of " +
                                  std::to_string(q8_block));
  }
  ranges.push_back(range_of(mo.exp_avg, n * moment_code_bytes(f), true, kind, leaf));
  ranges.push_back(range_of(mo.exp_avg_sq, n * moment_code_bytes(f), true, kind + 1, leaf));
  if (f == moment_format::q8) ranges.push_back(range_of(mo.scales, moment_scale_bytes(f, n), true, kind + 2, leaf));
}

} // namespace

std::size_t moment_scale_bytes(moment_format format, std::size_t n) {
  if (format == moment_format::q8) return 2 * ((n + q8_block - 1) / q8_block);
  moment_format_name(format); // an unknown value throws
  return 0;
}

void adam_step(float* params, const compressed_moments& moments, std::size_t n, const_view grad, mut_view out,
               const adam_config& config, std::int64_t step, float grad_scale, const rounding_stream& rounding,
               const execution_options& exec) {
  check_grad_scale(grad_scale);
  check_threads(exec.threads);
  const kernel_set& ks = kernel_set_by_name(exec.kernel);
  check_view("params", params, n, dtype::f32, n);
  check_view("grad", grad.data, grad.size, grad.type, n);
  const bool has_out = out.data != nullptr || out.size != 0;
  if (has_out) check_view("out", out.data, out.size, out.type, n);
  const char* names[] = {"params", "grad", "out", "moments.exp_avg", "moments.exp_avg_sq", "moments.scales"};
  std::vector<byte_range> ranges{range_of(params, n * 4, true, 0, 0),
                                 range_of(grad.data, n * dtype_size(grad.type), false, 1, 0)};
  if (has_out) ranges.push_back(range_of(out.data, n * dtype_size(out.type), true, 2, 0));
  check_moments("moments", moments, n, rounding, ranges, 3);
  check_step_number(step);
  validate(config, "config");

  group_kernel gk;
  gk.storage = {moments.format, moments.exp_avg, moments.exp_avg_sq, moments.scales, 0, rounding.seed};
  const step_io io{grad.type, has_out ? std::optional<dtype>(out.type) : std::nullopt, false, false};
  step_plan::make(ks, std::span<const adam_config>(&config, 1), step - 1, io, unchecked(grad_scale),
                  [] { return 0.0; }, std::span<group_kernel>(&gk, 1));
  if (n == 0) return;
  check_no_overlap(ranges, names);

  update_piece piece{0, n, 0, grad.data, has_out ? out.data : nullptr};
  update_job job = one_piece_job(params, nullptr, nullptr, piece, gk, dtype_size(grad.type),
                                 has_out ? dtype_size(out.type) : 0);
  job.index_origin = rounding.first_index;
  run_update(job, exec.threads);
}

void adam_update(std::span<const compressed_update_leaf> leaves, std::span<const adam_config> configs,
                 std::int64_t step, float grad_scale, std::uint64_t rounding_seed, const execution_options& exec) {
  check_grad_scale(grad_scale);
  check_threads(exec.threads);
  const kernel_set& ks = kernel_set_by_name(exec.kernel);
  const dtype grad_type = leaves.empty() ? dtype::f32 : leaves[0].grad.type;
  // Every leaf first: nothing is written unless all are good. Leaf i runs over the region's
  // elements [first[i], first[i] + n), each leaf starting on a slice (32 elements), so no
  // 8-bit block is split between threads.
  std::vector<std::size_t> first(leaves.size() + 1, 0);
  std::vector<byte_range> ranges;
  bool formats[2] = {false, false};
  for (std::size_t i = 0; i < leaves.size(); ++i) {
    const compressed_update_leaf& l = leaves[i];
    const std::string at = leaves.size() == 1 ? std::string() : "leaves[" + std::to_string(i) + "].";
    const std::size_t n = l.grad.size;
    check_update_leaf(at, l.params, l.grad, l.update, l.config, configs, grad_type);
    check_moments(at + "moments", l.moments, n, {rounding_seed, l.first_index, 0}, ranges, 2, i, at + "first_index");
    formats[int(l.moments.format) - 1] = true;
    first[i + 1] = first[i] + (n + slice_elems - 1) / slice_elems * slice_elems;
    if (n == 0) continue;
    const std::size_t esz = dtype_size(grad_type);
    ranges.push_back(range_of(l.update.data, n * esz, true, 1, i));
    // The update may be written over its own gradient (each block of the gradient is
    // loaded before that block's update is stored), as XLA's aliasing asks.
    if (l.grad.data != l.update.data) ranges.push_back(range_of(l.grad.data, n * esz, false, 5, i));
    if (l.params) ranges.push_back(range_of(l.params, n * 4, false, 0, i));
  }
  const char* kinds[] = {"params", "update", "moments.exp_avg", "moments.exp_avg_sq", "moments.scales", "grad"};
  check_no_overlap_of_leaves(ranges, kinds, leaves.size());
  // One plan per format present, each with a kernel per config.
  const step_io io{grad_type, std::nullopt, false, /*delta=*/true};
  std::vector<group_kernel> groups[2];
  for (int f = 0; f < 2; ++f) {
    if (!formats[f] && !(f == 0 && leaves.empty())) continue;
    groups[f].resize(configs.size());
    for (group_kernel& g : groups[f]) g.storage = {moment_format(f + 1), nullptr, nullptr, nullptr, 0, rounding_seed};
    one_buffer_plan(ks, configs, step, io, grad_scale, groups[f], /*signed_rates=*/true);
  }
  const std::size_t total = first.back();
  if (total == 0) return;
  const std::size_t esz = dtype_size(grad_type);
  auto body = [&](int tid, int nt) {
    const auto [lo, hi] = partition(0, total, tid, nt);
    if (lo >= hi) return;
    std::size_t i = std::size_t(std::upper_bound(first.begin(), first.end(), lo) - first.begin()) - 1;
    for (std::size_t at = lo; at < hi && i < leaves.size(); ++i) {
      const compressed_update_leaf& l = leaves[i];
      const std::size_t a = at - first[i], b = std::min(hi - first[i], l.grad.size);
      if (a < b) {
        const compressed_moments& mo = l.moments;
        const std::size_t cb = moment_code_bytes(mo.format);
        const group_kernel& g = groups[int(mo.format) - 1][l.config];
        compressed_call call = g.call;
        call.first = l.first_index + a;
        float* p = const_cast<float*>(l.params); // read only: the delta kernels never store to it
        g.compressed(call, p ? p + a : nullptr, static_cast<char*>(mo.exp_avg) + a * cb,
                     static_cast<char*>(mo.exp_avg_sq) + a * cb, mo.scales ? mo.scales + 2 * (a / q8_block) : nullptr,
                     static_cast<const char*>(l.grad.data) + a * esz, static_cast<char*>(l.update.data) + a * esz,
                     b - a);
      }
      at = first[i + 1];
    }
  };
  run_parallel(exec.threads, body);
}

void encode_moments(const float* exp_avg, const float* exp_avg_sq, const compressed_moments& out, std::size_t n,
                    const rounding_stream& rounding) {
  check_view("exp_avg", exp_avg, n, dtype::f32, n);
  check_view("exp_avg_sq", exp_avg_sq, n, dtype::f32, n);
  const char* names[] = {"exp_avg", "exp_avg_sq", "out.exp_avg", "out.exp_avg_sq", "out.scales"};
  std::vector<byte_range> ranges{range_of(exp_avg, n * 4, false, 0, 0), range_of(exp_avg_sq, n * 4, false, 1, 0)};
  check_moments("out", out, n, rounding, ranges, 2);
  if (n == 0) return;
  for (std::size_t i = 0; i < n; ++i) // a pass over the input: conversions are rare
    if (exp_avg_sq[i] < 0.0f)
      throw std::invalid_argument("exp_avg_sq[" + std::to_string(i) + "] = " + std::to_string(exp_avg_sq[i]) +
                                  ": a second moment is never negative");
  check_no_overlap(ranges, names);
  const ieee_float_mode mode;
  active_kernel_set().encode_moments(out.format)(exp_avg, exp_avg_sq, out.exp_avg, out.exp_avg_sq, out.scales, n,
                                                 rounding_key(rounding.seed, 0), rounding.first_index);
}

void decode_moments(const compressed_moments& in, std::size_t n, float* exp_avg, float* exp_avg_sq) {
  check_view("exp_avg", exp_avg, n, dtype::f32, n);
  check_view("exp_avg_sq", exp_avg_sq, n, dtype::f32, n);
  const char* names[] = {"exp_avg", "exp_avg_sq", "in.exp_avg", "in.exp_avg_sq", "in.scales"};
  std::vector<byte_range> ranges{range_of(exp_avg, n * 4, true, 0, 0), range_of(exp_avg_sq, n * 4, true, 1, 0)};
  check_moments("in", in, n, rounding_stream{}, ranges, 2);
  if (n == 0) return;
  check_no_overlap(ranges, names);
  const ieee_float_mode mode;
  active_kernel_set().decode_moments(in.format)(in.exp_avg, in.exp_avg_sq, in.scales, exp_avg, exp_avg_sq, n);
}

} // namespace hostopt
