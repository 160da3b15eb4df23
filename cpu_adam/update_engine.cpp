#include "update_engine.hpp"

#include <algorithm>
#include <atomic>

#include "parallel.hpp"

namespace hostopt::detail {

namespace {

// Elements per accumulator block: 16 KiB of f32, well inside L1/L2.
constexpr std::size_t accumulate_block = 4096;

void add_to(block_counts& total, const block_counts& c) noexcept {
  total.poisoned += c.poisoned;
  total.saturated += c.saturated;
}

// The group's kernel over arena elements [a, a + n); what a compressed one saw is added to `seen`.
void run_kernel(const update_job& job, const group_kernel& g, std::size_t a, const void* grad, void* out,
                std::size_t n, block_counts& seen) noexcept {
  const moment_storage& st = g.storage;
  if (!g.compressed) { // f32 moments: the job's flat arrays, or the group's own
    float* m = st.exp_avg ? static_cast<float*>(st.exp_avg) + (a - st.origin) : job.exp_avg + a;
    float* v = st.exp_avg_sq ? static_cast<float*>(st.exp_avg_sq) + (a - st.origin) : job.exp_avg_sq + a;
    g.fn(g.scalars, job.params + a, m, v, grad, out, n);
    return;
  }
  const std::size_t k = a - st.origin;
  const std::size_t code_bytes = moment_code_bytes(st.format);
  compressed_call call = g.call;
  call.first = job.index_origin + a;
  add_to(seen, g.compressed(call, job.params + a, static_cast<char*>(st.exp_avg) + k * code_bytes,
                            static_cast<char*>(st.exp_avg_sq) + k * code_bytes,
                            st.scales ? st.scales + 2 * (k / q8_block) : nullptr, grad, out, n));
}

// Runs the kernel over [a, b) of one piece, adding the accumulator first when present.
void run_range(const update_job& job, const group_kernel& g, std::size_t a, std::size_t b, const void* grad,
               void* out, block_counts& seen) noexcept {
  if (!job.flat_accumulator) {
    run_kernel(job, g, a, grad, out, b - a, seen);
    return;
  }
  alignas(64) float sum[accumulate_block];
  for (std::size_t lo = a; lo < b; lo += accumulate_block) {
    const std::size_t n = std::min(accumulate_block, b - lo);
    const std::size_t skip = lo - a;
    job.add_grad(sum, job.flat_accumulator + (lo - job.flat_origin),
                 static_cast<const char*>(grad) + skip * job.grad_elem_bytes, n);
    run_kernel(job, g, lo, sum, out ? static_cast<char*>(out) + skip * job.out_elem_bytes : nullptr, n, seen);
  }
}

void run_slice(const update_job& job, std::size_t lo, std::size_t hi, block_counts& seen) noexcept {
  const update_piece* first = job.pieces;
  const update_piece* last = job.pieces + job.num_pieces;
  // First piece that ends after lo.
  const update_piece* it = std::upper_bound(
      first, last, lo, [](std::size_t x, const update_piece& p) { return x < p.offset + p.size; });
  for (; it != last && it->offset < hi; ++it) {
    const std::size_t a = std::max(lo, it->offset);
    const std::size_t b = std::min(hi, it->offset + it->size);
    if (a >= b) continue;
    const void* grad;
    void* out;
    if (job.flat_grad) {
      if (it->no_grad) continue; // a tensor without a gradient this step (chunked step)
      grad = static_cast<const char*>(job.flat_grad) + (a - job.flat_origin) * job.grad_elem_bytes;
      out = job.flat_out ? static_cast<char*>(job.flat_out) + (a - job.flat_origin) * job.out_elem_bytes : nullptr;
    } else {
      if (!it->grad) continue; // a tensor without a gradient this step
      const std::size_t skip = a - it->offset;
      grad = static_cast<const char*>(it->grad) + skip * job.grad_elem_bytes;
      out = it->out ? static_cast<char*>(it->out) + skip * job.out_elem_bytes : nullptr;
    }
    run_range(job, job.groups[it->group], a, b, grad, out, seen);
  }
}

} // namespace

block_counts run_update(const update_job& job, int threads) {
  if (job.begin >= job.end || job.num_pieces == 0) return {};
  // Each thread adds its slice's counts once: integers, so the totals do not depend on
  // the order or on the thread count.
  std::atomic<std::uint64_t> poisoned{0}, saturated{0};
  auto body = [&](int tid, int n) {
    const auto [lo, hi] = partition(job.begin, job.end, tid, n);
    if (lo >= hi) return;
    block_counts seen;
    run_slice(job, lo, hi, seen);
    poisoned.fetch_add(seen.poisoned, std::memory_order_relaxed);
    saturated.fetch_add(seen.saturated, std::memory_order_relaxed);
  };
  run_parallel(threads, body);
  return {poisoned.load(), saturated.load()};
}

} // namespace hostopt::detail
