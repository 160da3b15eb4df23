#include "buffer_checks.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <thread>

#include "hostopt/kernels.hpp"
#include "hostopt/optimizer.hpp"

namespace hostopt {

int max_threads() {
  static const int bound = [] {
    const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
    return int(std::min(4u * hw, 1024u));
  }();
  return bound;
}

} // namespace hostopt

namespace hostopt::detail {

void check_dtype(const std::string& what, dtype t) {
  if (t != dtype::f32 && t != dtype::bf16 && t != dtype::f16)
    throw std::invalid_argument(what + ".type = " + std::to_string(int(t)) +
                                ": expected a dtype (f32=0, bf16=1, f16=2)");
}

void check_view(const std::string& what, const void* data, std::size_t size, dtype t,
                std::size_t expected) {
  check_dtype(what, t);
  if (size != expected)
    throw std::invalid_argument(what + ".size = " + std::to_string(size) + ": expected " +
                                std::to_string(expected) + " elements");
  if (data == nullptr && size > 0)
    throw std::invalid_argument(what + ".data is null for " + std::to_string(size) +
                                " elements: expected a buffer");
}

void check_step_number(std::int64_t step) {
  if (step < 1 || step > max_step_count)
    throw std::invalid_argument("step = " + std::to_string(step) + ": expected a step number in [1, " +
                                std::to_string(max_step_count) + "] (bias correction uses 1 - beta^step)");
}

void check_grad_scale(float s) {
  if (!std::isfinite(s) || s < 0)
    throw std::invalid_argument("grad_scale = " + std::to_string(s) + ": expected a finite value >= 0");
}

void check_threads(int threads) {
  if (threads < 0 || threads > max_threads())
    throw std::invalid_argument("threads = " + std::to_string(threads) + ": expected a count in [0, " +
                                std::to_string(max_threads()) +
                                "] (0 = the threading runtime's default; the bound is 4 x the "
                                "hardware threads, at most 1024)");
}

namespace {
std::string describe(const byte_range& r, const char* const* kind_names,
                     const std::vector<std::string>* tensor_names, bool every_kind) {
  std::string s = kind_names[r.kind];
  if (tensor_names && r.index < tensor_names->size() && (every_kind || r.kind != 2))
    s += "[" + std::to_string(r.index) + "] ('" + (*tensor_names)[r.index] + "')";
  return s;
}
} // namespace

void check_no_overlap_of_leaves(std::vector<byte_range>& ranges, const char* const* kind_names, std::size_t leaves) {
  if (leaves == 1) return check_no_overlap(ranges, kind_names);
  if (ranges.empty()) return;
  std::vector<std::string> leaf_names(leaves);
  for (std::size_t i = 0; i < leaves; ++i) leaf_names[i] = "leaf " + std::to_string(i);
  check_no_overlap(ranges, kind_names, &leaf_names, /*index_every_kind=*/true);
}

void check_no_overlap(std::vector<byte_range>& ranges, const char* const* kind_names,
                      const std::vector<std::string>* tensor_names, bool index_every_kind) {
  std::sort(ranges.begin(), ranges.end(),
            [](const byte_range& a, const byte_range& b) { return a.lo < b.lo; });
  // Sweep: keep the open range reaching furthest, and the furthest written one.
  const byte_range* reach = nullptr;
  const byte_range* reach_written = nullptr;
  for (const auto& r : ranges) {
    if (r.lo == r.hi) continue;
    const byte_range* clash = nullptr;
    if (reach_written && reach_written->hi > r.lo) clash = reach_written;
    else if (r.written && reach && reach->hi > r.lo) clash = reach;
    if (clash)
      throw std::invalid_argument(describe(*clash, kind_names, tensor_names, index_every_kind) + " and " +
                                  describe(r, kind_names, tensor_names, index_every_kind) +
                                  " overlap in memory: expected separate buffers");
    if (!reach || r.hi > reach->hi) reach = &r;
    if (r.written && (!reach_written || r.hi > reach_written->hi)) reach_written = &r;
  }
}

} // namespace hostopt::detail
