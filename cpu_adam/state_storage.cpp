#include "state_storage.hpp"

#include <algorithm>
#include <cstring>

#include "parallel.hpp"

namespace hostopt::detail {

state_storage::state_storage(std::span<const moment_format> formats, const held_layout& layout)
    : size_(layout.size()) {
  for (const moment_format f : formats) {
    stores_.push_back({f});
    flat_moments_ = flat_moments_ && f == moment_format::f32;
  }
  if (flat_moments_) {
    state_ = aligned_floats(3 * size_); // an arena's 3 f32 arrays fit max_state_bytes: cannot overflow
  } else {
    state_ = aligned_floats(size_);
    lay_out_group_moments(layout.pieces());
    moments_ = aligned_floats(moments_used_ / sizeof(float)); // a multiple of 64 bytes
    moments_base_ = reinterpret_cast<char*>(moments_.data());
  }
  params_ = state_.data();
}

state_storage::state_storage(std::span<const moment_format> formats, const held_layout& layout, external_memory)
    : size_(layout.size()) {
  for (const moment_format f : formats) {
    stores_.push_back({f});
    flat_moments_ = flat_moments_ && f == moment_format::f32;
  }
  if (!flat_moments_) lay_out_group_moments(layout.pieces());
}

namespace {
std::size_t align64(std::size_t b) { return (b + 63) / 64 * 64; }
} // namespace

std::size_t state_storage::contiguous_bytes() const {
  if (flat_moments_) return 3 * size_ * sizeof(float);
  return align64(size_ * sizeof(float)) + moments_used_;
}

void state_storage::bind(std::byte* memory) {
  params_ = reinterpret_cast<float*>(memory);
  if (!flat_moments_) moments_base_ = reinterpret_cast<char*>(memory) + align64(size_ * sizeof(float));
}

// Each group's part: its held pieces' flat span (whole blocks for 8-bit), every array
// 64-byte aligned in one allocation.
void state_storage::lay_out_group_moments(std::span<const update_piece> pieces) {
  const auto align64 = [](std::size_t b) { return (b + 63) / 64 * 64; };
  std::size_t bytes = 0;
  for (std::size_t g = 0; g < stores_.size(); ++g) {
    group_store& st = stores_[g];
    st.begin = size_;
    st.end = 0;
    for (const update_piece& piece : pieces)
      if (piece.group == g && piece.size) {
        st.begin = std::min(st.begin, piece.offset);
        st.end = std::max(st.end, piece.offset + piece.size);
      }
    if (st.begin >= st.end) st.begin = st.end = 0; // holds no element
    st.end = st.begin + align_up(st.end - st.begin, block_unit(st.format));
    const std::size_t n = st.end - st.begin;
    st.m = bytes;
    st.v = bytes = align64(bytes + n * moment_code_bytes(st.format));
    st.scales = bytes = align64(bytes + n * moment_code_bytes(st.format));
    bytes = align64(bytes + moment_scale_bytes(st.format, n));
  }
  moments_used_ = bytes;
}

void state_storage::first_touch(int threads) {
  auto zero = [this](int tid, int nthreads) {
    const auto [lo, hi] = partition(0, size_, tid, nthreads);
    if (lo < hi) std::memset(params() + lo, 0, (hi - lo) * sizeof(float));
    if (flat_moments_) {
      for (float* base : {flat_array(1).data(), flat_array(2).data()})
        if (lo < hi) std::memset(base + lo, 0, (hi - lo) * sizeof(float));
      return;
    }
    const auto [blo, bhi] = partition(0, moments_used_, tid, nthreads, 64); // zero bytes: zero moments
    if (blo < bhi) std::memset(moment_base() + blo, 0, bhi - blo);
  };
  run_parallel(threads, zero);
}

std::vector<moment_format> state_storage::formats() const {
  std::vector<moment_format> f;
  for (const group_store& st : stores_) f.push_back(st.format);
  return f;
}

char* state_storage::moment_at(int k, std::size_t group, std::size_t flat) const {
  if (flat_moments_) return reinterpret_cast<char*>(flat_array(k == 1 ? 1 : 2).data() + flat);
  const group_store& st = stores_[group];
  const std::size_t i = flat - st.begin;
  if (k == 3) return moment_base() + st.scales + 2 * (i / q8_block);
  return moment_base() + (k == 1 ? st.m : st.v) + i * moment_code_bytes(st.format);
}

compressed_moments state_storage::codes_at(std::size_t group, std::size_t flat) const {
  compressed_moments c;
  c.format = stores_[group].format;
  c.exp_avg = moment_at(1, group, flat);
  c.exp_avg_sq = moment_at(2, group, flat);
  if (c.format == moment_format::q8) c.scales = reinterpret_cast<std::uint8_t*>(moment_at(3, group, flat));
  return c;
}

std::span<float> state_storage::f32_moments(int k, std::size_t group, std::size_t flat, std::size_t n) const {
  if (!n) {
    if (flat_moments_) return {flat_array(k).data(), 0};
    return {reinterpret_cast<float*>(moment_base() + (k == 1 ? stores_[group].m : stores_[group].v)), 0};
  }
  return {reinterpret_cast<float*>(moment_at(k, group, flat)), n};
}

moment_storage state_storage::kernel_storage(std::size_t group, std::uint64_t seed) const {
  moment_storage ms;
  ms.seed = seed;
  if (flat_moments_) return ms; // f32, the job's flat arrays
  const group_store& st = stores_[group];
  ms.format = st.format;
  ms.exp_avg = moment_base() + st.m;
  ms.exp_avg_sq = moment_base() + st.v;
  ms.scales =
      st.format == moment_format::q8 ? reinterpret_cast<std::uint8_t*>(moment_base() + st.scales) : nullptr;
  ms.origin = st.begin;
  return ms;
}

void state_storage::add_ranges(std::vector<byte_range>& ranges, int kind) const {
  if (flat_moments_) {
    ranges.push_back(range_of(params(), 3 * size_ * sizeof(float), true, kind, 0));
    return;
  }
  ranges.push_back(range_of(params(), size_ * sizeof(float), true, kind, 0));
  if (moments_used_) ranges.push_back(range_of(moment_base(), moments_used_, true, kind, 1));
}

std::size_t state_storage::bytes() const {
  if (flat_moments_) return 3 * size_ * sizeof(float);
  std::size_t bytes = size_ * sizeof(float);
  for (const group_store& st : stores_) bytes += moment_bytes(st.format, st.end - st.begin);
  return bytes;
}

} // namespace hostopt::detail
