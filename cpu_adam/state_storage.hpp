#pragma once
// The memory of an optimizer's state: the f32 master parameters of the held elements and
// each group's moments in its format. When every group is f32 the moments are two more
// flat arrays in the parameters' allocation (params | exp_avg | exp_avg_sq); otherwise each
// group has its own part of one moment allocation, covering the flat span of its held
// pieces (whole blocks for 8-bit), every array 64-byte aligned.

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "aligned_buffer.hpp"
#include "buffer_checks.hpp"
#include "held_layout.hpp"
#include "hostopt/kernels.hpp"
#include "hostopt/moment_format.hpp"
#include "update_engine.hpp"

namespace hostopt::detail {

class state_storage {
public:
  /// Storage for the elements `layout` holds, group g's moments in formats[g]. Not
  /// zeroed: see first_touch.
  state_storage(std::span<const moment_format> formats, const held_layout& layout);
  /// The same layout in caller-owned memory (the state store's staging buffers): nothing is
  /// allocated; bind() points it at contiguous_bytes() bytes, 64-byte aligned, before use.
  struct external_memory {};
  state_storage(std::span<const moment_format> formats, const held_layout& layout, external_memory);
  /// Bytes of the whole state in one block: params, then the moments (64-byte aligned).
  std::size_t contiguous_bytes() const;
  /// Points external storage at `memory` (contiguous_bytes() bytes, 64-byte aligned).
  void bind(std::byte* memory);

  /// Zeroes params and moments, each slice by the thread (and the partition) that will
  /// update it, so that its pages are first touched there.
  void first_touch(int threads);

  float* params() const { return params_; }
  /// Whether every group's moments are f32: the flat arrays of flat_array(1 and 2).
  bool flat_moments() const { return flat_moments_; }
  /// Array k of the flat layout: 0 params, 1 exp_avg, 2 exp_avg_sq; the moments are empty
  /// (null) unless flat_moments().
  std::span<float> flat_array(int k) const {
    if (k > 0 && !flat_moments_) return {};
    return {params_ + std::size_t(k) * size_, size_};
  }
  moment_format format(std::size_t group) const { return stores_[group].format; }
  std::vector<moment_format> formats() const;

  /// Group `group`'s moment storage at held flat element `flat`: array k (1 exp_avg,
  /// 2 exp_avg_sq, 3 the 8-bit block exponents, where `flat` starts a block), bytes.
  char* moment_at(int k, std::size_t group, std::size_t flat) const;
  /// A compressed group's codes from flat element `flat` on (a block start for 8-bit).
  compressed_moments codes_at(std::size_t group, std::size_t flat) const;
  /// An f32 group's moments k (1 exp_avg, 2 exp_avg_sq) of `n` elements from `flat`; with
  /// n = 0 an empty span at a valid address (callers may memcmp it), `flat` unread.
  std::span<float> f32_moments(int k, std::size_t group, std::size_t flat, std::size_t n) const;
  /// Where the group's kernels find its moments (all null for the flat arrays).
  moment_storage kernel_storage(std::size_t group, std::uint64_t seed) const;

  /// This memory as byte ranges of `kind`, for the checks that no caller buffer overlaps it.
  void add_ranges(std::vector<byte_range>& ranges, int kind) const;
  /// Bytes held for params and moments (optimizer::state_bytes).
  std::size_t bytes() const;

private:
  // Where one group's moments live in moments_: flat elements [begin, end).
  struct group_store {
    moment_format format = moment_format::f32;
    std::size_t begin = 0, end = 0;
    std::size_t m = 0, v = 0, scales = 0; // byte offsets in moments_
  };
  void lay_out_group_moments(std::span<const update_piece> pieces);
  char* moment_base() const { return moments_base_; }

  std::size_t size_;
  std::vector<group_store> stores_;
  bool flat_moments_ = true;
  aligned_floats state_;   // params, then (flat_moments_) exp_avg and exp_avg_sq, each size_ floats
  aligned_floats moments_; // the groups' moment storage (not flat_moments_)
  std::size_t moments_used_ = 0;
  float* params_ = nullptr;      // state_'s, or the bound external memory
  char* moments_base_ = nullptr; // moments_', or in the bound external memory after the params
};

} // namespace hostopt::detail
