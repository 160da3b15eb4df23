// The layout of the arena (where each tensor of the groups lives) and the part of it one
// optimizer holds.
#include "held_layout.hpp"

#include <algorithm>
#include <stdexcept>

namespace hostopt {

using namespace detail;

namespace {

// Elements the arena may hold: 3 f32 arrays within max_state_bytes. Every product and sum
// below stays under it, so none can overflow.
constexpr std::size_t max_arena_elems = std::size_t(max_state_bytes / (3 * sizeof(float)));

[[noreturn]] void too_large(const std::string& what) {
  throw std::invalid_argument(what + ": the optimizer state would exceed " + std::to_string(max_state_bytes) +
                              " bytes (hostopt::max_state_bytes, the addressable memory of a process)");
}

std::size_t element_count(const tensor_spec& t) {
  for (std::size_t d = 0; d < t.shape.size(); ++d)
    if (t.shape[d] < 0)
      throw std::invalid_argument("tensor '" + t.name + "': shape[" + std::to_string(d) +
                                  "] = " + std::to_string(t.shape[d]) + ": expected an extent >= 0");
  for (const std::int64_t e : t.shape) // any zero extent makes the tensor empty
    if (e == 0) return 0;
  std::size_t n = 1;
  for (const std::int64_t e : t.shape) {
    if (std::uint64_t(e) > max_arena_elems / n) too_large("tensor '" + t.name + "'");
    n *= std::size_t(e);
  }
  return n;
}

} // namespace

std::vector<segment> arena_layout(const std::vector<param_group>& groups) {
  std::vector<segment> segs;
  std::map<std::string, std::size_t, std::less<>> seen;
  std::size_t offset = 0;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    validate(groups[g].config, "groups[" + std::to_string(g) + "].config");
    try {
      moment_format_name(groups[g].moments);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument("groups[" + std::to_string(g) + "].moments: " + e.what());
    }
    const std::size_t unit = block_unit(groups[g].moments); // 8-bit tensors start on a block
    for (const auto& t : groups[g].tensors) {
      if (t.name.empty())
        throw std::invalid_argument("groups[" + std::to_string(g) +
                                    "]: a tensor has an empty name: expected a unique name");
      const std::size_t n = element_count(t);
      if (!seen.emplace(t.name, segs.size()).second)
        throw std::invalid_argument("tensor name '" + t.name + "': registered twice, expected unique names");
      if (align_up(offset, unit) > max_arena_elems)
        too_large("tensor '" + t.name + "' (the sum of the tensor sizes)");
      offset = align_up(offset, unit);
      if (n > max_arena_elems - offset || align_up(offset + n) > max_arena_elems)
        too_large("tensor '" + t.name + "' (the sum of the tensor sizes)");
      segs.push_back({t.name, t.shape, offset, n, g});
      offset = align_up(offset + n);
    }
  }
  return segs;
}

std::size_t arena_end(std::span<const segment> layout) {
  return layout.empty() ? 0 : align_up(layout.back().offset + layout.back().size);
}

namespace detail {

namespace {
// `unit`: 16, or 32 when a group has 8-bit moments (a range never cuts a block).
void check_range(arena_range r, std::size_t end, std::size_t unit) {
  if (r.begin > r.end || r.end > end || (r.begin % unit) || (r.end % unit && r.end != end))
    throw std::invalid_argument(
        "range [" + std::to_string(r.begin) + ", " + std::to_string(r.end) + "): expected a range of [0, " +
        std::to_string(end) + ") whose ends are multiples of " + std::to_string(unit) +
        " (or the arena's end)" +
        (unit > align_elems ? ": a group has 8-bit moments, whose 32-element blocks a range "
                              "may not cut"
                            : ""));
}
} // namespace

held_layout::held_layout(const std::vector<param_group>& groups, arena_range held)
    : segs_(arena_layout(groups)), held_(held), unit_(range_unit(groups)) {
  check_range(held, arena_end(segs_), unit_);
  for (std::size_t i = 0; i < segs_.size(); ++i) {
    const segment& seg = segs_[i];
    by_name_.emplace(seg.name, i);
    names_.push_back(seg.name);
    const std::size_t lo = std::max(held.begin, seg.offset), hi = std::min(held.end, seg.offset + seg.size);
    if (!whole() && lo >= hi) continue;
    piece_tensor_.push_back(i);
    num_params_ += whole() ? seg.size : hi - lo;
  }
}

std::size_t held_layout::index_of(std::string_view name) const {
  const auto it = by_name_.find(name);
  if (it == by_name_.end())
    throw std::invalid_argument("tensor name '" + std::string(name) + "': unknown, expected one of the " +
                                std::to_string(segs_.size()) + " registered tensors");
  return it->second;
}

const segment& held_layout::whole_tensor(std::string_view name) const {
  const segment& s = segs_[index_of(name)];
  if (s.size && (s.offset < held_.begin || s.offset + s.size > held_.end))
    throw std::invalid_argument("tensor '" + s.name + "' is not held whole by this optimizer (it holds [" +
                                std::to_string(held_.begin) + ", " + std::to_string(held_.end) +
                                ") of the arena): use the flat views");
  return s;
}

std::vector<update_piece> held_layout::pieces() const {
  std::vector<update_piece> pieces;
  pieces.reserve(piece_tensor_.size());
  for (const std::size_t t : piece_tensor_) {
    const segment& seg = segs_[t];
    if (whole()) {
      pieces.push_back({seg.offset, seg.size, seg.group, nullptr, nullptr});
      continue;
    }
    const std::size_t lo = std::max(held_.begin, seg.offset), hi = std::min(held_.end, seg.offset + seg.size);
    pieces.push_back({lo - held_.begin, hi - lo, seg.group, nullptr, nullptr});
  }
  return pieces;
}

} // namespace detail

} // namespace hostopt
