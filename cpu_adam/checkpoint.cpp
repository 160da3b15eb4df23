// safetensors checkpoints of the optimizer state: what a checkpoint holds (each tensor's
// entries, the counts and hyper-parameters in __metadata__) and applying it. Writing is
// atomic (atomic_file.hpp) from a locked and consistent state; reading verifies the whole
// file (safetensors_header.hpp, then a streaming checksum pass) before anything is applied.
// See include/hostopt/checkpoint.hpp.
#include "hostopt/checkpoint.hpp"

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "atomic_file.hpp"
#include "checkpoint_io.hpp"
#include "checksum.hpp"
#include "exclusive_state.hpp"
#include "q8_exponents.hpp"
#include "safetensors_header.hpp"

namespace hostopt::detail {

namespace {

using json = nlohmann::json;

constexpr const char* format_name = "hostopt";
// Version 2: the checksum covers the header too (version 1 covered only the data).
constexpr const char* format_version = "2";
constexpr std::size_t io_block = std::size_t(4) << 20; // staging for checksum + write/read

// A tensor's entries: the f32 master, the moments (in its group's format) and, for 8-bit
// moments, the block exponents ([blocks, 2] bytes: exp_avg's, exp_avg_sq's).
const char* const kinds[] = {"param", "exp_avg", "exp_avg_sq", "moment_scales"};
constexpr int kind_exp_avg_sq = 2, kind_scales = 3;

int kinds_of(moment_format f) { return f == moment_format::q8 ? 4 : 3; }

std::uint64_t blocks_of(std::size_t n) { return (std::uint64_t(n) + q8_block - 1) / q8_block; }

// Bytes of entry k for n elements (8-bit entries start on a block).
std::uint64_t entry_bytes(int k, moment_format f, std::size_t n) {
  if (k == kind_scales) return 2 * blocks_of(n);
  return std::uint64_t(n) * (k == 0 ? 4 : moment_code_bytes(f));
}

const char* entry_dtype(int k, moment_format f) {
  if (k == kind_scales) return "U8";
  if (k == 0 || f == moment_format::f32) return "F32";
  return f == moment_format::bf16 ? "BF16" : "U8";
}

json entry_shape(int k, const json& elements, std::size_t n) {
  return k == kind_scales ? json::array({blocks_of(n), 2}) : elements;
}

json config_json(const adam_config& c) {
  json j = json::object();
  for_each_field(c, [&](const char* name, const auto& v) {
    if constexpr (std::is_same_v<std::decay_t<decltype(v)>, adam_mode>)
      j[name] = mode_name(v);
    else
      j[name] = v;
  });
  if (!c.maximize) j.erase("maximize"); // added later: written only when set, so older files stay valid
  return j;
}

adam_config config_from(const json& j) {
  adam_config c;
  for_each_field(c, [&](const char* name, auto& v) {
    using T = std::decay_t<decltype(v)>;
    if (std::string_view(name) == "maximize" && !j.contains(name)) return; // absent: false
    const json& x = j.at(name);
    if constexpr (std::is_same_v<T, adam_mode>)
      v = parse_mode(x.get<std::string>());
    else if constexpr (std::is_same_v<T, bool>)
      v = x.get<bool>();
    else if (!x.is_number())
      throw std::invalid_argument(std::string(name) + " is not a number");
    else
      v = x.get<double>();
  });
  return c;
}

// A count as written by std::to_string: decimal digits only, no sign, space, prefix,
// fraction or leading zero, at most max_step_count.
std::int64_t parse_count(const std::string& path, const char* key, const std::string& s) {
  const bool digits = !s.empty() && s.size() <= 19 &&
                      std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
  if (!digits || (s.size() > 1 && s[0] == '0'))
    fail_checkpoint(path,
                    std::string("__metadata__ '") + key + "' = \"" + s + "\": expected a decimal count");
  const std::uint64_t v = std::stoull(s);
  if (v > std::uint64_t(max_step_count))
    fail_checkpoint(path, std::string("__metadata__ '") + key + "' = " + s +
                              ": above hostopt::max_step_count (" + std::to_string(max_step_count) + ")");
  return std::int64_t(v);
}

// Whether the bits of an f32 or bf16 exp_avg_sq value are negative: below -0.0, up to
// -inf (NaN excluded). No step produces one — v starts at +0 and only ever adds g*g >= +0
// to beta2 * v, so a negative v comes from a crafted file or a buggy writer, and would turn
// its parameter NaN a step later (sqrt of it). Accepted: +inf (a finite gradient whose
// square overflows, with skip_nonfinite off), NaN (a NaN gradient with skip_nonfinite off:
// what a step writes, and what the jax/torch fronts load) and -0.0, which no step writes
// either but which equals zero in every use (sqrt(-0) + eps = eps) and which the views
// and write_moments take as zero (refusing it would refuse files hostopt itself wrote).
constexpr bool negative_bits(std::uint32_t x) { return x > 0x80000000u && x <= 0xFF800000u; }
constexpr bool negative_bits(std::uint16_t x) { return x > 0x8000u && x <= 0xFF80u; }

// An element of an exp_avg_sq entry, as the number it is.
float value_of_bits(std::uint32_t x, unsigned width) {
  if (width == 2) x <<= 16;
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}

// The index of the first of `count` width-byte values at p whose bits are negative, or count.
template <class Bits> std::size_t first_negative(const unsigned char* p, std::size_t count) {
  for (std::size_t j = 0; j < count; ++j) {
    Bits x;
    std::memcpy(&x, p + j * sizeof(Bits), sizeof(Bits));
    if (negative_bits(x)) return j;
  }
  return count;
}

// The first negative value among `count` f32 (width 4) or bf16 (width 2) exp_avg_sq values
// at p, as "tensor 'w' exp_avg_sq[3] = -1" (element `first` of the tensor at p), or "".
std::string negative_second_moment(const unsigned char* p, std::size_t count, unsigned width,
                                   const std::string& tensor, std::size_t first) {
  const std::size_t j =
      width == 4 ? first_negative<std::uint32_t>(p, count) : first_negative<std::uint16_t>(p, count);
  if (j == count) return {};
  std::uint32_t bits = 0;
  std::memcpy(&bits, p + j * width, width);
  char value[32];
  std::snprintf(value, sizeof value, "%.9g", double(value_of_bits(bits, width)));
  return "tensor '" + tensor + "' exp_avg_sq[" + std::to_string(first + j) + "] = " + value;
}

// The part of tensor `s` that lies in arena range `r`, in tensor coordinates [a, b).
struct piece_of {
  std::size_t a = 0, b = 0;
  bool held = false;  // the file or optimizer holds an entry for it
  bool whole = false; // the entry is the whole tensor (its own shape)
};

// A file or optimizer holding range `r` of a layout whose arena ends at `end` holds an entry
// for every tensor overlapping it; a whole one (r = [0, end)) for every tensor, empty ones too.
piece_of piece_in(const segment& s, arena_range r, std::size_t end) {
  piece_of p;
  if (r.begin == 0 && r.end == end) return {0, s.size, true, true};
  const std::size_t lo = std::max(r.begin, s.offset), hi = std::min(r.end, s.offset + s.size);
  if (lo >= hi) return p;
  p = {lo - s.offset, hi - s.offset, true, lo == s.offset && hi == s.offset + s.size};
  return p;
}

std::string range_text(arena_range r) { return std::to_string(r.begin) + ":" + std::to_string(r.end); }

// ---- Saving ----

// Bytes of the data section in file order: an entry of the state (or the part of one the
// optimizer's range holds), read from the arena as it is written.
struct data_chunk {
  const char* src;
  std::uint64_t bytes;
  const segment* tensor = nullptr; // an f32/bf16 exp_avg_sq: checked for negative values
  std::size_t first = 0;           // its first element in the tensor
  unsigned width = 0;              // bytes per value (4 or 2)
};

// The header's tensor entries and the data they describe, for the range the optimizer holds.
struct saved_data {
  json entries = json::object();
  json pieces = json::object(); // tensors the range cuts: name -> [a, b)
  std::vector<data_chunk> chunks;
  std::uint64_t bytes = 0;
  // Per tensor: where each kind's entry begins in the data section (where a piece written
  // out of order goes).
  std::vector<std::array<std::uint64_t, 4>> entry_begin;
};

checkpoint_description describe(const exclusive_state& st) {
  return {st.segments(), st.range(), st.formats(), st.configs(), st.seeds(), st.step_count(), st.skipped_steps(),
          st.tensor_lags()};
}

// The entries of `d`'s tensors, with the chunks of `st`'s arena where one is given (a save
// from RAM; a streamed save writes the pieces where entry_begin says).
saved_data lay_out_data(const checkpoint_description& d, const exclusive_state* st) {
  const auto segs = d.segs;
  const arena_range held = d.range;
  const std::vector<moment_format>& formats = d.formats;
  const std::size_t end = arena_end(segs);
  saved_data out;
  out.entry_begin.assign(segs.size(), {});
  for (std::size_t i = 0; i < segs.size(); ++i) {
    const segment& s = segs[i];
    const piece_of p = piece_in(s, held, end);
    if (!p.held) continue;
    const std::size_t n = p.b - p.a;
    const json shape = p.whole ? json(s.shape) : json::array({n});
    if (!p.whole) out.pieces[s.name] = {p.a, p.b};
    const moment_format f = formats[s.group];
    for (int k = 0; k < kinds_of(f); ++k) {
      const std::uint64_t bytes = entry_bytes(k, f, n);
      out.entries[s.name + "." + kinds[k]] =
          entry_json(entry_dtype(k, f), entry_shape(k, shape, n), out.bytes, out.bytes + bytes);
      out.entry_begin[i][std::size_t(k)] = out.bytes;
      out.bytes += bytes;
      if (!n || !st) continue;
      data_chunk c{st->data_at(k, s.group, s.offset + p.a - held.begin), bytes};
      if (k == kind_exp_avg_sq && f != moment_format::q8) {
        c.tensor = &s;
        c.first = p.a;
        c.width = f == moment_format::f32 ? 4u : 2u;
      }
      out.chunks.push_back(c);
    }
  }
  return out;
}

// __metadata__: hostopt's own entries (the checksum as its placeholder), then the caller's.
json saved_metadata(const checkpoint_description& st, const json& pieces, const checkpoint_metadata& extra) {
  const auto segs = st.segs;
  const std::vector<moment_format>& formats = st.formats;
  json groups = json::array(), tensor_groups = json::object();
  for (const auto& c : st.configs) groups.push_back(config_json(c));
  for (const auto& s : segs) tensor_groups[s.name] = s.group;
  json meta = {{"format", format_name},
               {"version", format_version},
               {"step", std::to_string(st.step_count)},
               {"skipped_steps", std::to_string(st.skipped_steps)},
               {"groups", groups.dump()},
               {"tensor_groups", tensor_groups.dump()},
               {"arena", std::to_string(arena_end(segs))},
               {"range", range_text(st.range)},
               {"checksum", checksum_placeholder}};
  if (!pieces.empty()) meta["pieces"] = pieces.dump();
  if (std::any_of(formats.begin(), formats.end(), [](moment_format f) { return f != moment_format::f32; })) {
    json names = json::array(), seeds = json::array(); // written only then: f32 files stay as they were
    for (const moment_format f : formats) names.push_back(std::string(moment_format_name(f)));
    for (const std::uint64_t seed : st.seeds) seeds.push_back(std::to_string(seed));
    meta["moments"] = names.dump();
    meta["rounding_seeds"] = seeds.dump();
  }
  // Tensors behind the shared count (torch's per-parameter steps) have their own.
  if (const auto& lags = st.tensor_lags; !lags.empty()) {
    json own = json::object();
    for (std::size_t i = 0; i < segs.size(); ++i)
      if (lags[i]) own[segs[i].name] = std::to_string(st.step_count - lags[i]);
    meta["tensor_steps"] = own.dump();
  }
  for (const auto& [k, v] : extra) {
    if (meta.contains(k)) throw std::logic_error("checkpoint metadata key '" + k + "' is hostopt's own");
    meta[k] = v;
  }
  return meta;
}

// A negative second moment (written through a view: no step or write_moments makes one)
// would be refused by load: refused before anything is written, and again in the bytes
// written (a view written meanwhile). `p` holds `bytes` of chunk c from byte `done` of it.
void refuse_negative_second_moment(const std::string& path, const unsigned char* p, std::uint64_t bytes,
                                   const data_chunk& c, std::uint64_t done) {
  if (!c.width) return;
  const std::string bad = negative_second_moment(p, std::size_t(bytes / c.width), c.width, c.tensor->name,
                                                 c.first + std::size_t(done / c.width));
  if (!bad.empty())
    throw std::invalid_argument(
        "save_checkpoint '" + path + "': " + bad +
        ": a second moment is never negative (one written through a view; no step writes "
        "one, and load refuses it): nothing saved");
}

// The file's bytes: length, header and data, checksummed as written; then the checksum's
// digits into their slot at byte `checksum_pos`.
void write_checkpoint(file_writer& out, const std::string& path, const std::string& text,
                      const saved_data& data, std::uint64_t checksum_pos) {
  checksum64 sum = checksum_of_head(text);
  const auto len = length_prefix(text.size());
  out.write(len.data(), len.size());
  out.write(text.data(), text.size());
  // The data goes out through one staging block: the bytes checksummed are the bytes
  // written, whatever another thread does to the arena through a view.
  std::vector<unsigned char> block(std::min<std::uint64_t>(io_block, std::max<std::uint64_t>(data.bytes, 1)));
  for (const auto& c : data.chunks)
    for (std::uint64_t done = 0; done < c.bytes;) {
      const std::size_t len_now = std::size_t(std::min<std::uint64_t>(block.size(), c.bytes - done));
      std::memcpy(block.data(), c.src + done, len_now);
      refuse_negative_second_moment(path, block.data(), len_now, c, done);
      sum.add(block.data(), len_now);
      out.write(block.data(), len_now);
      done += len_now;
    }
  const std::string digits = sum.digits();
  out.write_at(digits.data(), digits.size(), checksum_pos, "cannot write the checksum");
}

// ---- Loading: reading a file's header ----

// One checkpoint file, opened and verified in structure (everything but the checksum).
struct source_file {
  explicit source_file(file_reader f) : file(std::move(f)) {}
  const std::string& path() const { return file.path(); }

  file_reader file;
  std::uint64_t data_start = 0, data_size = 0;
  checksum64 head; // over the length and the header with its checksum digits zeroed
  std::string stored_checksum;
  arena_range range;
  std::vector<adam_config> configs;
  std::int64_t step = 0, skipped = 0;
  std::vector<std::int64_t> lags;     // per layout tensor, behind `step`; empty: none
  std::vector<moment_format> formats; // per group, as the file stores its moments
  std::vector<std::uint64_t> seeds;   // per group (all 0 in a file of f32 moments)
  struct entry {
    std::size_t tensor;
    int kind;
    std::size_t a, b;    // tensor elements [a, b)
    std::uint64_t begin; // byte offset in the data section
    std::uint64_t bytes;
  };
  std::vector<entry> entries;
};

// Format and version: hostopt's, and one this hostopt reads.
void check_format(const header_metadata& meta) {
  const std::string& path = meta.path;
  if (meta.value("format") != format_name)
    fail_checkpoint(path, "format '" + meta.value("format") + "': expected 'hostopt'");
  if (meta.value("version") != format_version)
    fail_checkpoint(path,
                    "version '" + meta.value("version") + "' is unknown: this hostopt reads version " +
                        format_version +
                        (meta.value("version") == "1" ? " (version 1 files, whose checksum did not cover the "
                                                        "header, are no longer trusted)"
                                                      : ""));
}

// The caller's entries: those of `expected` must match; those of `read_back` are read.
void match_metadata(const header_metadata& meta, const checkpoint_metadata& expected,
                    checkpoint_metadata* read_back) {
  for (const auto& [k, v] : expected)
    if (meta.value(k) != v)
      fail_checkpoint(meta.path,
                      "__metadata__ '" + k + "' = \"" + meta.value(k) + "\": expected \"" + v + "\"");
  if (read_back)
    for (auto& [k, v] : *read_back) v = meta.value(k);
}

// How many parameter groups the file has (their contents are read later).
std::size_t count_groups(const header_metadata& meta) {
  const std::string& path = meta.path;
  try {
    const json groups = parse_json_unique(path, "__metadata__ 'groups'", meta.value("groups"));
    if (!groups.is_array()) fail_checkpoint(path, "__metadata__ 'groups' is not a list");
    return groups.size();
  } catch (const std::runtime_error&) {
    throw;
  } catch (const std::exception& e) {
    fail_checkpoint(path, std::string("__metadata__ 'groups' is not valid JSON: ") + e.what());
  }
}

// The file's moment formats and rounding seeds (absent: f32 moments, written before
// compressed ones existed), one per group of the `groups` it has.
void read_moment_formats(source_file& src, const header_metadata& meta, std::size_t groups) {
  const std::string& path = src.path();
  const json& m = meta.entries;
  src.formats.assign(groups, moment_format::f32);
  src.seeds.assign(groups, 0);
  if (!m.contains("moments") && !m.contains("rounding_seeds")) return;
  try {
    if (!m.contains("moments") || !m.contains("rounding_seeds") || !m["moments"].is_string() ||
        !m["rounding_seeds"].is_string())
      fail_checkpoint(path, "__metadata__ has one of 'moments' and 'rounding_seeds' without the other");
    const json names = parse_json_unique(path, "__metadata__ 'moments'", m["moments"].get<std::string>());
    const json seeds =
        parse_json_unique(path, "__metadata__ 'rounding_seeds'", m["rounding_seeds"].get<std::string>());
    if (!names.is_array() || names.size() != groups || !seeds.is_array() || seeds.size() != groups)
      fail_checkpoint(path, "__metadata__ 'moments' and 'rounding_seeds' must list one entry per group (" +
                                std::to_string(groups) + ")");
    for (std::size_t g = 0; g < groups; ++g) {
      src.formats[g] = parse_moment_format(names[g].get<std::string>());
      const std::string seed = seeds[g].get<std::string>();
      const bool digits = !seed.empty() && seed.size() <= 20 &&
                          std::all_of(seed.begin(), seed.end(), [](char c) { return c >= '0' && c <= '9'; });
      if (!digits || (seed.size() > 1 && seed[0] == '0') ||
          (seed.size() == 20 && seed > "18446744073709551615"))
        fail_checkpoint(path, "rounding_seeds[" + std::to_string(g) + "] = \"" + seed +
                                  "\": expected a 64-bit decimal count");
      src.seeds[g] = std::stoull(seed);
    }
  } catch (const std::runtime_error&) {
    throw;
  } catch (const std::exception& e) {
    fail_checkpoint(path, std::string("bad 'moments' or 'rounding_seeds' metadata: ") + e.what());
  }
}

// The file's groups and their moment formats against the optimizer's (`want`: its
// formats, empty to take any). Checked before the tensors: a file of other formats has
// another layout too, and the user should hear that (with the way to convert), not "a
// different model".
void check_groups_match(const source_file& src, std::span<const segment> segs,
                        std::span<const moment_format> want) {
  const std::string& path = src.path();
  const std::size_t file_groups = src.formats.size();
  if (!want.empty() && want.size() != file_groups)
    fail_checkpoint(path, std::to_string(file_groups) + " parameter groups, the optimizer has " +
                              std::to_string(want.size()) + " (a different model)");
  for (std::size_t g = 0; g < want.size(); ++g)
    if (src.formats[g] != want[g])
      fail_checkpoint(
          path, "group " + std::to_string(g) + " stores its moments as " +
                    std::string(moment_format_name(src.formats[g])) + ", the optimizer's as " +
                    std::string(moment_format_name(want[g])) +
                    ": a load never converts formats (lossy); load it into an optimizer with the file's "
                    "formats, then convert explicitly (read_moments / write_moments)");
  for (const auto& s : segs)
    if (s.group >= file_groups)
      fail_checkpoint(path, "tensor '" + s.name + "' belongs to a group the file does not have");
}

arena_range parse_range(const std::string& path, const std::string& text, std::size_t end) {
  const auto colon = text.find(':');
  auto digits = [](const std::string& x) {
    return !x.empty() && x.size() <= 19 &&
           std::all_of(x.begin(), x.end(), [](char c) { return c >= '0' && c <= '9'; });
  };
  if (colon == std::string::npos || !digits(text.substr(0, colon)) || !digits(text.substr(colon + 1)))
    fail_checkpoint(path, "__metadata__ 'range' = \"" + text + "\": expected BEGIN:END");
  const arena_range r{std::stoull(text.substr(0, colon)), std::stoull(text.substr(colon + 1))};
  if (r.begin > r.end || r.end > end)
    fail_checkpoint(path, "__metadata__ 'range' = \"" + text + "\" lies outside the arena [0, " +
                              std::to_string(end) + ")");
  return r;
}

// The arena the file was saved from (the optimizer's, `end` elements) and the range of it
// the file holds, which cuts no 8-bit block.
void read_range(source_file& src, const header_metadata& meta, std::size_t end) {
  const std::string& path = src.path();
  const bool file_q8 =
      std::find(src.formats.begin(), src.formats.end(), moment_format::q8) != src.formats.end();
  if (meta.value("arena") != std::to_string(end))
    fail_checkpoint(path, "it holds an arena of " + meta.value("arena") + " elements, the optimizer's has " +
                              std::to_string(end) + " (a different model)");
  src.range = parse_range(path, meta.value("range"), end);
  if (file_q8 && (src.range.begin % q8_block || (src.range.end % q8_block && src.range.end != end)))
    fail_checkpoint(path, "range " + range_text(src.range) +
                              " cuts 8-bit blocks (its ends must be multiples of 32)");
}

// The entries the file's range must have: every tensor it overlaps, each of its kinds.
using wanted_entries =
    std::map<std::string, std::pair<std::size_t, int>, std::less<>>; // "name.kind" -> (tensor, kind)

wanted_entries entries_wanted(const source_file& src, std::span<const segment> segs, std::size_t end) {
  wanted_entries wanted;
  for (std::size_t i = 0; i < segs.size(); ++i)
    if (piece_in(segs[i], src.range, end).held)
      for (int k = 0; k < kinds_of(src.formats[segs[i].group]); ++k)
        wanted.emplace(segs[i].name + "." + kinds[k], std::make_pair(i, k));
  return wanted;
}

// Refuses a tensor in the header that the file's range should not hold, saying why.
void refuse_unwanted_entries(const source_file& src, const json& header, const wanted_entries& wanted,
                             std::span<const segment> segs, std::size_t end) {
  for (const auto& item : header.items()) {
    const std::string& name = item.key(); // (a plain reference: clang 14 cannot capture bindings)
    if (name == "__metadata__" || wanted.count(name)) continue;
    const auto owner = std::find_if(segs.begin(), segs.end(), [&](const segment& s) {
      for (const char* k : kinds)
        if (name == s.name + "." + k) return true;
      return false;
    });
    std::string why = "is not in the optimizer (different tensor names)";
    if (owner != segs.end())
      why = piece_in(*owner, src.range, end).held
                ? "is not an entry of a tensor whose group stores " +
                      std::string(moment_format_name(src.formats[owner->group])) + " moments"
                : "lies outside the file's range " + range_text(src.range);
    fail_checkpoint(src.path(), "tensor '" + name + "' " + why);
  }
}

// Entry `name` (kind k of tensor s) as the header declares it: dtype, shape, the piece of
// the tensor it is (`pieces` lists those the range cuts) and its bytes of the data section.
source_file::entry read_entry(const source_file& src, const json& header, const json& pieces,
                              const std::string& name, std::size_t tensor, int k, const segment& s,
                              std::size_t end) {
  const std::string& path = src.path();
  if (!header.contains(name))
    fail_checkpoint(path, "tensor '" + name + "' is missing (the optimizer has '" + s.name + "')");
  const json& t = header[name];
  const moment_format f = src.formats[s.group];
  const piece_of p = piece_in(s, src.range, end);
  check_entry_type(path, name, t, entry_dtype(k, f),
                   entry_shape(k, p.whole ? json(s.shape) : json::array({p.b - p.a}), p.b - p.a));
  const bool listed = pieces.is_object() && pieces.contains(s.name);
  if (listed != !p.whole || (listed && pieces[s.name] != json::array({p.a, p.b})))
    fail_checkpoint(path, "tensor '" + s.name + "': its piece does not match the file's range " +
                              range_text(src.range));
  const byte_span span = entry_data_span(path, name, t, src.data_size);
  if (span.end - span.begin != entry_bytes(k, f, p.b - p.a))
    fail_checkpoint(path, "tensor '" + name + "': " + std::to_string(span.end - span.begin) + " bytes for " +
                              std::to_string(p.b - p.a) + " elements of dtype " + entry_dtype(k, f));
  return {tensor, k, p.a, p.b, span.begin, span.end - span.begin};
}

// The tensors' entries: exactly those the file's range holds, tiling the data section.
void read_entries(source_file& src, const json& header, const header_metadata& meta,
                  std::span<const segment> segs, std::size_t end) {
  json pieces = json::object();
  if (meta.has("pieces"))
    pieces = parse_json_unique(src.path(), "__metadata__ 'pieces'", meta.value("pieces"));
  const wanted_entries wanted = entries_wanted(src, segs, end);
  refuse_unwanted_entries(src, header, wanted, segs, end);
  std::vector<byte_span> spans;
  for (const auto& [name, tk] : wanted) {
    src.entries.push_back(read_entry(src, header, pieces, name, tk.first, tk.second, segs[tk.first], end));
    spans.push_back({src.entries.back().begin, src.entries.back().begin + src.entries.back().bytes});
  }
  check_entries_tile(src.path(), std::move(spans), src.data_size);
}

// The groups' hyper-parameters, and every tensor in the group the optimizer has it in.
void read_groups(source_file& src, const header_metadata& meta, std::span<const segment> segs) {
  const std::string& path = src.path();
  try {
    const json groups = parse_json_unique(path, "__metadata__ 'groups'", meta.value("groups"));
    if (!groups.is_array()) fail_checkpoint(path, "__metadata__ 'groups' is not a list");
    for (const auto& g : groups) src.configs.push_back(config_from(g));
    const json tensor_groups =
        parse_json_unique(path, "__metadata__ 'tensor_groups'", meta.value("tensor_groups"));
    for (const auto& s : segs)
      if (!tensor_groups.contains(s.name) || !tensor_groups[s.name].is_number_unsigned() ||
          tensor_groups[s.name].get<std::size_t>() != s.group)
        fail_checkpoint(path, "tensor '" + s.name + "' belongs to another group in the file");
  } catch (const std::runtime_error&) {
    throw;
  } catch (const std::exception& e) {
    fail_checkpoint(path, std::string("bad metadata: ") + e.what());
  }
}

// The tensors' own step counts (tensor_steps, when some are behind the shared count), as
// lags behind src.step.
void read_tensor_steps(source_file& src, const header_metadata& meta, std::span<const segment> segs) {
  const std::string& path = src.path();
  if (!meta.has("tensor_steps")) return;
  const json own = parse_json_unique(path, "__metadata__ 'tensor_steps'", meta.value("tensor_steps"));
  if (!own.is_object()) fail_checkpoint(path, "__metadata__ 'tensor_steps' is not an object of tensor names");
  src.lags.assign(segs.size(), 0);
  std::size_t found = 0;
  for (std::size_t i = 0; i < segs.size(); ++i) {
    if (!own.contains(segs[i].name)) continue;
    ++found;
    if (!own[segs[i].name].is_string())
      fail_checkpoint(path, "tensor_steps['" + segs[i].name + "'] is not a string");
    const std::string key = "tensor_steps['" + segs[i].name + "']";
    const std::int64_t t = parse_count(path, key.c_str(), own[segs[i].name].get<std::string>());
    if (t > src.step)
      fail_checkpoint(path, "tensor_steps['" + segs[i].name + "'] = " + std::to_string(t) +
                                " exceeds the step count " + std::to_string(src.step));
    src.lags[i] = src.step - t;
  }
  if (found != own.size())
    fail_checkpoint(path, "__metadata__ 'tensor_steps' names a tensor the layout does not have");
  if (std::all_of(src.lags.begin(), src.lags.end(), [](std::int64_t x) { return x == 0; }))
    src.lags.clear(); // every tensor at the shared count: the same as no entry
}

// The step and skipped-step counts and the tensors' own counts, parsed strictly.
void read_counts(source_file& src, const header_metadata& meta, std::span<const segment> segs) {
  src.step = parse_count(src.path(), "step", meta.value("step"));
  src.skipped = parse_count(src.path(), "skipped_steps", meta.value("skipped_steps"));
  read_tensor_steps(src, meta, segs);
}

// The groups' hyper-parameters, valid as adam_config requires.
void validate_groups(const source_file& src) {
  for (std::size_t g = 0; g < src.configs.size(); ++g) {
    try {
      validate(src.configs[g], "groups[" + std::to_string(g) + "]");
    } catch (const std::invalid_argument& e) {
      fail_checkpoint(src.path(), e.what());
    }
  }
}

// The checksum stored, and the checksum of the file's head: the length and the header with
// its own digits read as zeros (the data is added by the passes that stream it).
void start_checksum(source_file& src, const header_metadata& meta, std::string text) {
  src.stored_checksum = meta.value("checksum");
  const std::size_t at = checksum_digits_at(text, src.stored_checksum);
  if (src.stored_checksum.size() != 16 || at == std::string::npos)
    fail_checkpoint(src.path(), "the checksum entry is malformed");
  text.replace(at, 16, checksum_placeholder);
  src.head = checksum_of_head(text);
}

// Opens a checkpoint of layout `segs` and verifies its structure: everything but the
// checksum, which the streaming passes check. `want`, `expected` and `read_back`: see
// check_groups_match and match_metadata.
source_file open_source(const std::string& path, std::span<const segment> segs,
                        std::span<const moment_format> want, const checkpoint_metadata& expected,
                        checkpoint_metadata* read_back) {
  source_file src(file_reader(checkpoint_owner, path,
                              {"checkpoint", "cannot open", "cannot stat",
                               "not a regular file (a device, fifo, socket or directory): refused"}));
  std::string text = read_header_text(src.file);
  const json header = parse_header(path, text);
  const header_metadata meta{path, header["__metadata__"]};
  check_format(meta);
  match_metadata(meta, expected, read_back);
  read_moment_formats(src, meta, count_groups(meta));
  check_groups_match(src, segs, want);
  const std::size_t end = arena_end(segs);
  read_range(src, meta, end);
  src.data_start = 8 + text.size();
  src.data_size = src.file.size() - src.data_start;
  read_entries(src, header, meta, segs, end);
  read_groups(src, meta, segs);
  read_counts(src, meta, segs);
  validate_groups(src);
  start_checksum(src, meta, std::move(text));
  return src;
}

// ---- Loading: verifying and applying the data ----

// The 8-bit block exponents of a file, checked against those the encoder writes as the
// data streams by: a crafted file with a valid checksum would otherwise load blocks that
// decode as NaN.
class exponent_scan {
public:
  exponent_scan(const source_file& s, std::span<const segment> layout) : layout_(layout) {
    for (const auto& e : s.entries)
      if (e.kind == kind_scales) scales_.push_back(&e);
    std::sort(scales_.begin(), scales_.end(), [](auto* a, auto* b) { return a->begin < b->begin; });
  }

  // Data bytes [done, done + n), at `block`: the first exponent byte the encoder never
  // writes, described, or "".
  std::string scan(const unsigned char* block, std::uint64_t done, std::uint64_t n) {
    for (std::size_t i = next_; i < scales_.size() && scales_[i]->begin < done + n; ++i) {
      const source_file::entry& e = *scales_[i];
      const std::uint64_t end = e.begin + e.bytes;
      for (std::uint64_t at = std::max(e.begin, done); at < std::min(end, done + n); ++at) {
        const std::uint8_t base = block[std::size_t(at - done)];
        const bool v = (at - e.begin) % 2 == 1;
        if (q8_base_is_written(base, v)) continue;
        return "tensor '" + layout_[e.tensor].name + "' moment_scales block " +
               std::to_string(e.a / q8_block + (at - e.begin) / 2) + ": " + (v ? "exp_avg_sq" : "exp_avg") +
               " exponent byte " + std::to_string(base) + " is one the 8-bit encoder never writes (at most " +
               std::to_string(v ? q8_v_max_base : q8_m_max_base) + ", or " +
               std::to_string(q8_poisoned_base) + " for a NaN block): the file was not written by hostopt";
      }
      if (end <= done + n && i == next_) ++next_;
    }
    return {};
  }

private:
  std::span<const segment> layout_;
  std::vector<const source_file::entry*> scales_; // in data order
  std::size_t next_ = 0;                          // the first not yet scanned to its end
};

// The f32/bf16 exp_avg_sq values of a file, checked against those a step writes as the
// data streams by: a negative one would make its parameter NaN a step later.
class second_moment_scan {
public:
  second_moment_scan(const source_file& s, std::span<const segment> layout) : layout_(layout) {
    for (const auto& e : s.entries) {
      const moment_format f = s.formats[layout[e.tensor].group];
      if (e.kind == kind_exp_avg_sq && e.bytes && f != moment_format::q8)
        entries_.push_back({&e, f == moment_format::f32 ? 4u : 2u});
    }
    std::sort(entries_.begin(), entries_.end(),
              [](const auto& a, const auto& b) { return a.e->begin < b.e->begin; });
  }

  // Data bytes [done, done + n), at `block`: the first negative value, described, or "".
  std::string scan(const unsigned char* block, std::uint64_t done, std::uint64_t n) {
    for (std::size_t i = next_; i < entries_.size() && entries_[i].e->begin < done + n; ++i) {
      const source_file::entry& e = *entries_[i].e;
      const unsigned w = entries_[i].width;
      const std::uint64_t end = e.begin + e.bytes, hi = std::min(end, done + n);
      std::uint64_t found = e.bytes; // byte offset in the entry of the first negative value
      for (std::uint64_t at = std::max(e.begin, done); at < hi && found == e.bytes;) {
        const unsigned k = unsigned((at - e.begin) % w); // byte of its value
        if (k == 0 && at + w <= hi) {                    // whole values
          const std::size_t count = std::size_t((hi - at) / w);
          const unsigned char* p = block + (at - done);
          const std::size_t j =
              w == 4 ? first_negative<std::uint32_t>(p, count) : first_negative<std::uint16_t>(p, count);
          if (j < count) {
            partial_ = 0;
            std::memcpy(&partial_, p + j * w, w);
            found = at - e.begin + j * w;
          }
          at += std::uint64_t(count) * w;
          continue;
        }
        if (k == 0) partial_ = 0;
        partial_ |= std::uint32_t(block[std::size_t(at - done)]) << (8 * k);
        if (k == w - 1 && (w == 4 ? negative_bits(partial_) : negative_bits(std::uint16_t(partial_))))
          found = at + 1 - w - e.begin;
        ++at;
      }
      if (found != e.bytes) {
        char value[32];
        std::snprintf(value, sizeof value, "%.9g", double(value_of_bits(partial_, w)));
        return "tensor '" + layout_[e.tensor].name + "' exp_avg_sq[" + std::to_string(e.a + found / w) +
               "] = " + value +
               ": a second moment is never negative (no step produces one, and the parameter would be NaN a "
               "step "
               "later): refused";
      }
      if (end <= done + n && i == next_) ++next_;
    }
    return {};
  }

private:
  struct second_moment {
    const source_file::entry* e;
    unsigned width; // bytes per value: 4 (f32) or 2 (bf16)
  };
  std::span<const segment> layout_;
  std::vector<second_moment> entries_; // in data order
  std::size_t next_ = 0;               // the first not yet scanned to its end
  std::uint32_t partial_ = 0;          // the bytes so far of a value that a block boundary cuts
};

// Pass 1: the whole file against its checksum, streamed through `block`, with the values
// no step writes refused (exponent_scan, second_moment_scan) once the checksum holds.
void verify_checksum(const source_file& s, std::span<const segment> layout,
                     std::vector<unsigned char>& block) {
  exponent_scan exponents(s, layout);
  second_moment_scan second_moments(s, layout);
  std::string bad; // the first value no step writes
  checksum64 sum = s.head;
  for (std::uint64_t done = 0; done < s.data_size;) {
    const std::uint64_t n = std::min<std::uint64_t>(block.size(), s.data_size - done);
    s.file.read_at(block.data(), n, s.data_start + done);
    sum.add(block.data(), std::size_t(n));
    if (bad.empty()) bad = exponents.scan(block.data(), done, n);
    if (bad.empty()) bad = second_moments.scan(block.data(), done, n);
    done += n;
  }
  if (sum.digits() != s.stored_checksum)
    fail_checkpoint(s.path(), "checksum mismatch (file " + s.stored_checksum + ", contents " + sum.digits() +
                                  "): the header or the data is corrupted");
  if (!bad.empty()) fail_checkpoint(s.path(), bad);
}

bool same_config(const adam_config& a, const adam_config& b) {
  return a.lr == b.lr && a.beta1 == b.beta1 && a.beta2 == b.beta2 && a.eps == b.eps &&
         a.eps_root == b.eps_root && a.weight_decay == b.weight_decay && a.mode == b.mode &&
         a.bias_correction == b.bias_correction && a.nesterov == b.nesterov && a.maximize == b.maximize;
}

// The files `paths` opened and verified in structure against the optimizer's layout and
// moment formats; expected[f] (when given) against file f's metadata.
std::vector<source_file> open_sources(std::span<const std::string> paths, std::span<const segment> layout,
                                      std::span<const moment_format> formats,
                                      std::span<const checkpoint_metadata> expected,
                                      checkpoint_metadata* read_back) {
  std::vector<source_file> sources;
  for (std::size_t f = 0; f < paths.size(); ++f)
    sources.push_back(open_source(paths[f], layout, formats,
                                  f < expected.size() ? expected[f] : checkpoint_metadata{},
                                  f == 0 ? read_back : nullptr));
  if (sources.empty()) throw std::invalid_argument("load_checkpoint: no file given");
  return sources;
}

// The files are of one save: the same counts, hyper-parameters and seeds everywhere.
void check_one_save(std::span<const source_file> sources) {
  const source_file& first = sources.front();
  for (const auto& s : sources) {
    bool same = s.step == first.step && s.skipped == first.skipped &&
                s.configs.size() == first.configs.size() && s.lags == first.lags && s.seeds == first.seeds;
    for (std::size_t g = 0; same && g < s.configs.size(); ++g)
      same = same_config(s.configs[g], first.configs[g]);
    if (!same)
      fail_checkpoint(s.path(), "its step, skipped steps, hyper-parameters or rounding seeds differ from '" +
                                    first.path() + "': files of different saves");
  }
}

// The save fits the locked optimizer: its groups, and per-tensor counts only for a whole one.
void check_fits(const source_file& first, const exclusive_state& state, std::span<const segment> layout) {
  if (first.configs.size() != state.configs().size())
    fail_checkpoint(first.path(), std::to_string(first.configs.size()) +
                                      " parameter groups, the optimizer has " +
                                      std::to_string(state.configs().size()));
  const arena_range held = state.range();
  if (!first.lags.empty() && (held.begin != 0 || held.end != arena_end(layout)))
    fail_checkpoint(first.path(),
                    "its tensors have step counts of their own (tensor_steps: a per-tensor step skipped "
                    "some), which an optimizer holding a range of the arena (a shard) cannot take");
}

// Which part of the `held` range each file provides: files in range order, each element
// from the first file that has it; together they must cover the held range.
std::vector<arena_range> ranges_provided(std::span<const source_file> sources, arena_range held) {
  std::vector<std::size_t> order(sources.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(),
            [&](std::size_t a, std::size_t b) { return sources[a].range.begin < sources[b].range.begin; });
  std::vector<arena_range> provides(sources.size());
  std::size_t reach = held.begin;
  for (const std::size_t i : order) {
    const arena_range r = sources[i].range;
    if (r.begin > reach) break; // a gap
    provides[i] = {reach, std::min(held.end, std::max(reach, r.end))};
    reach = std::max(reach, std::min(held.end, r.end));
  }
  if (reach < held.end)
    fail_checkpoint(sources.front().path(), "the files hold no state for arena elements [" +
                                                std::to_string(reach) + ", " + std::to_string(held.end) +
                                                ") that this optimizer holds (range " + range_text(held) +
                                                ")");
  return provides;
}

// Pass 2 for one file: streams it again, checksumming, and copies the elements of range
// `provides` into the locked state.
void copy_into_state(const source_file& s, arena_range provides, std::span<const segment> layout,
                     std::span<const moment_format> formats, const exclusive_state& state,
                     std::vector<unsigned char>& block) {
  struct copy {
    std::uint64_t begin, end; // data-section bytes
    char* dst;
  };
  const std::size_t held_begin = state.range().begin; // where the optimizer's arrays start
  std::vector<copy> copies;
  for (const auto& e : s.entries) {
    const segment& seg = layout[e.tensor];
    // The arena elements this entry holds, clipped to what this file provides.
    const std::size_t lo = std::max(provides.begin, seg.offset + e.a);
    const std::size_t hi = std::min(provides.end, seg.offset + e.b);
    if (lo >= hi) continue;
    // Bytes from the entry's start to element lo, and of [lo, hi): ranges of files and
    // optimizers with 8-bit groups cut no block, so lo starts one.
    const moment_format fmt = formats[seg.group];
    const std::uint64_t from = e.begin + entry_bytes(e.kind, fmt, lo - seg.offset - e.a);
    copies.push_back(
        {from, from + entry_bytes(e.kind, fmt, hi - lo), state.data_at(e.kind, seg.group, lo - held_begin)});
  }
  std::sort(copies.begin(), copies.end(), [](const copy& a, const copy& b) { return a.begin < b.begin; });
  checksum64 sum = s.head;
  std::size_t next = 0;
  for (std::uint64_t done = 0; done < s.data_size;) {
    const std::uint64_t n = std::min<std::uint64_t>(block.size(), s.data_size - done);
    s.file.read_at(block.data(), n, s.data_start + done);
    sum.add(block.data(), std::size_t(n));
    // Copies overlapping [done, done + n).
    for (std::size_t c = next; c < copies.size() && copies[c].begin < done + n; ++c) {
      const std::uint64_t a = std::max(copies[c].begin, done), b = std::min(copies[c].end, done + n);
      if (a < b)
        std::memcpy(reinterpret_cast<char*>(copies[c].dst) + (a - copies[c].begin), block.data() + (a - done),
                    std::size_t(b - a));
      if (copies[c].end <= done + n && c == next) ++next;
    }
    done += n;
  }
  if (sum.digits() != s.stored_checksum)
    fail_checkpoint(s.path(), "the file changed while it was being loaded");
}

} // namespace

void save_checkpoint(const optimizer& opt, const std::string& path, const checkpoint_metadata& extra) {
  check_path(path, "checkpoint");
  // The whole save sees one state: no step, load or chunked step runs meanwhile.
  const exclusive_state st(opt, "save_checkpoint");
  const checkpoint_description d = describe(st);
  saved_data data = lay_out_data(d, &st);
  json header = std::move(data.entries);
  header["__metadata__"] = saved_metadata(d, data.pieces, extra);
  const std::string text = header_text(header);
  const std::size_t digits_at = checksum_digits_at(text, checksum_placeholder);
  if (digits_at == std::string::npos)
    throw std::logic_error("checkpoint header: the checksum slot is not unique");
  for (const auto& c : data.chunks)
    refuse_negative_second_moment(path, reinterpret_cast<const unsigned char*>(c.src), c.bytes, c, 0);
  replace_file_atomically(checkpoint_owner, path, "checkpoint",
                          [&](file_writer& out) { write_checkpoint(out, path, text, data, 8 + digits_at); });
}

void save_checkpoint_streamed(const checkpoint_description& d, const std::string& path,
                              const std::function<void(const checkpoint_put&)>& fill,
                              const checkpoint_metadata& extra) {
  check_path(path, "checkpoint");
  const saved_data data = lay_out_data(d, nullptr);
  json header = data.entries;
  header["__metadata__"] = saved_metadata(d, data.pieces, extra);
  const std::string text = header_text(header);
  const std::size_t digits_at = checksum_digits_at(text, checksum_placeholder);
  if (digits_at == std::string::npos)
    throw std::logic_error("checkpoint header: the checksum slot is not unique");
  const std::uint64_t data_at = 8 + text.size();
  const std::size_t end = arena_end(d.segs);
  replace_file_atomically(checkpoint_owner, path, "checkpoint", [&](file_writer& out) {
    const auto len = length_prefix(text.size());
    out.write(len.data(), len.size());
    out.write(text.data(), text.size());
    std::uint64_t put_bytes = 0;
    fill([&](std::size_t tensor, int kind, std::size_t first, const void* bytes, std::size_t n) {
      const segment& s = d.segs[tensor];
      const moment_format f = d.formats[s.group];
      const piece_of held = piece_in(s, d.range, end);
      const std::size_t from = first - held.a; // (the entry starts at the range's first element of it)
      if (!held.held || kind < 0 || kind >= kinds_of(f) || first < held.a || (kind == kind_scales && from % q8_block))
        throw std::logic_error("save_checkpoint_streamed: a piece of tensor '" + s.name + "' that no entry holds");
      const std::uint64_t begin = data.entry_begin[tensor][std::size_t(kind)];
      const std::uint64_t at = begin + entry_bytes(kind, f, from);
      if (at + n > begin + entry_bytes(kind, f, held.b - held.a))
        throw std::logic_error("save_checkpoint_streamed: a piece of tensor '" + s.name + "' past its entry's end");
      if (n) out.write_at(bytes, n, data_at + at, "write failed");
      put_bytes += n;
    });
    if (put_bytes != data.bytes)
      throw std::logic_error("save_checkpoint_streamed: " + std::to_string(put_bytes) + " bytes of data put, the " +
                             "entries hold " + std::to_string(data.bytes));
    // The checksum, over the file in its order: read back once.
    checksum64 sum = checksum_of_head(text);
    std::vector<unsigned char> block(std::min<std::uint64_t>(io_block, std::max<std::uint64_t>(data.bytes, 1)));
    for (std::uint64_t done = 0; done < data.bytes;) {
      const std::size_t n = std::size_t(std::min<std::uint64_t>(block.size(), data.bytes - done));
      out.read_at(block.data(), n, data_at + done);
      sum.add(block.data(), n);
      done += n;
    }
    const std::string digits = sum.digits();
    out.write_at(digits.data(), digits.size(), 8 + digits_at, "cannot write the checksum");
  });
}

void load_checkpoint(optimizer& opt, std::span<const std::string> paths,
                     std::span<const checkpoint_metadata> expected, checkpoint_metadata* read_back) {
  try {
    const std::vector<segment> layout(opt.segments().begin(), opt.segments().end()); // fixed at construction
    std::vector<moment_format> formats; // fixed at construction too
    for (std::size_t g = 0; g < opt.num_groups(); ++g) formats.push_back(opt.group_moments(g));
    std::vector<source_file> sources = open_sources(paths, layout, formats, expected, read_back);
    check_one_save(sources);
    const source_file& first = sources.front();
    // Everything below runs with the optimizer locked; a load may replace a failed state.
    exclusive_state state(opt, "load_checkpoint", true);
    check_fits(first, state, layout);
    const std::vector<arena_range> provides = ranges_provided(sources, state.range());
    // Pass 1 verifies every file, streaming (no second copy of the state in memory).
    std::vector<unsigned char> block(io_block);
    for (const auto& s : sources) verify_checksum(s, layout, block);
    // Pass 2 streams each file again, checksumming, and scatters what the optimizer holds
    // (each element from the first file that has it). A file changed between the passes
    // leaves a half-loaded state, which is marked failed, never used as if it were whole.
    try {
      for (std::size_t f = 0; f < sources.size(); ++f)
        copy_into_state(sources[f], provides[f], layout, formats, state, block);
    } catch (const std::exception& e) {
      state.mark_failed(std::string("load_checkpoint stopped midway: ") + e.what());
      throw;
    }
    state.set_counters(first.configs, first.step, first.skipped);
    state.set_tensor_lags(first.lags);
    state.set_seeds(first.seeds);
    state.clear_failure();
  } catch (const std::bad_alloc&) {
    throw std::runtime_error("checkpoint '" + (paths.empty() ? std::string() : paths[0]) +
                             "': out of memory while loading it");
  }
}

void read_checkpoint_metadata(const std::string& path, std::span<const segment> layout,
                              checkpoint_metadata& values, bool verify) {
  source_file s = open_source(path, layout, {}, {}, &values);
  if (verify) {
    std::vector<unsigned char> block(io_block);
    verify_checksum(s, layout, block);
  }
}

void load_checkpoint(optimizer& opt, const std::string& path, const checkpoint_metadata& expected,
                     checkpoint_metadata* read_back) {
  load_checkpoint(opt, std::span<const std::string>(&path, 1),
                  std::span<const checkpoint_metadata>(&expected, 1), read_back);
}

} // namespace hostopt::detail

namespace hostopt {

void save_checkpoint(const optimizer& opt, const std::string& path) {
  detail::save_checkpoint(opt, path, {});
}

void load_checkpoint(optimizer& opt, const std::string& path) { detail::load_checkpoint(opt, path, {}); }

} // namespace hostopt
