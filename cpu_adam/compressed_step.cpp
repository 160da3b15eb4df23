// The one-buffer step over compressed moments, and the explicit format conversions.
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
                   std::vector<byte_range>& ranges, int kind) {
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
      throw std::invalid_argument("rounding.first_index = " + std::to_string(r.first_index) +
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
  ranges.push_back(range_of(mo.exp_avg, n * moment_code_bytes(f), true, kind, 0));
  ranges.push_back(range_of(mo.exp_avg_sq, n * moment_code_bytes(f), true, kind + 1, 0));
  if (f == moment_format::q8) ranges.push_back(range_of(mo.scales, moment_scale_bytes(f, n), true, kind + 2, 0));
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
