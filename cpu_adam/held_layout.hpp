#pragma once
// An optimizer's tensors: the whole layout (every tensor in arena order, found by name) and
// the part of it the optimizer holds, all of it or a shard's range. Flat element i of the
// optimizer's arrays is layout element range().begin + i. Fixed at construction.

#include <algorithm>
#include <cstddef>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "hostopt/moment_format.hpp"
#include "hostopt/optimizer.hpp"
#include "parallel.hpp"
#include "update_engine.hpp"

namespace hostopt::detail {

inline std::size_t align_up(std::size_t x, std::size_t unit = align_elems) {
  return (x + unit - 1) / unit * unit;
}

/// Where a group's tensors start and its moment storage ends: on an 8-bit block, else on
/// the 64-byte unit.
inline std::size_t block_unit(moment_format f) { return f == moment_format::q8 ? q8_block : align_elems; }

/// Where ranges (shards) and pipeline chunks of these groups' layout may end: on an 8-bit
/// block when any group has 8-bit moments (a block is never split), else on the 64-byte unit.
inline std::size_t range_unit(const std::vector<param_group>& groups) {
  std::size_t unit = align_elems;
  for (const param_group& g : groups) unit = std::max(unit, block_unit(g.moments));
  return unit;
}

class held_layout {
public:
  /// The groups' layout (arena_layout), holding `held`: std::invalid_argument as
  /// arena_layout throws, or for a range whose ends are not multiples of unit() (or the
  /// layout's end).
  held_layout(const std::vector<param_group>& groups, arena_range held);

  std::span<const segment> segments() const { return segs_; }
  /// The tensors' names in layout order (what the overlap checks name a view by).
  const std::vector<std::string>& names() const { return names_; }
  /// The tensor called `name`; std::invalid_argument naming it when unknown.
  std::size_t index_of(std::string_view name) const;
  /// A tensor held whole: its segment (flat offset = segment offset - range().begin).
  const segment& whole_tensor(std::string_view name) const;

  arena_range range() const { return held_; }
  /// Flat elements held, padding included.
  std::size_t size() const { return held_.size(); }
  /// Whether the whole layout is held (not a shard's range).
  bool whole() const { return held_.begin == 0 && held_.end == arena_end(segs_); }
  /// Ranges and chunks end on multiples of this: 16, or 32 where 8-bit blocks may not be cut.
  std::size_t unit() const { return unit_; }
  /// Tensor elements held, padding excluded.
  std::size_t num_params() const { return num_params_; }

  /// The held part of each tensor in flat coordinates, each piece of its tensor's group. A
  /// whole layout has one piece per tensor (empty ones too: per-tensor steps index them);
  /// a range has pieces of the tensors it overlaps.
  std::vector<update_piece> pieces() const;
  /// Which tensor each piece belongs to.
  std::span<const std::size_t> piece_tensor() const { return piece_tensor_; }

private:
  std::vector<segment> segs_;
  std::vector<std::string> names_;
  std::map<std::string, std::size_t, std::less<>> by_name_;
  arena_range held_;
  std::size_t unit_;
  std::vector<std::size_t> piece_tensor_;
  std::size_t num_params_ = 0;
};

} // namespace hostopt::detail
