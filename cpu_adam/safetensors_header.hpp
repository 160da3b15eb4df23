#pragma once
// The safetensors container of a checkpoint: an 8-byte little-endian header length, a JSON
// header — one entry {"dtype", "shape", "data_offsets"} per tensor and "__metadata__", a
// map of strings — and the data section the entries tile. Writing it, and reading it with
// every check a reader needs: a length the file can hold, every key once in every object,
// entries whose offsets lie in the data section with no overlap and no byte left over. The
// checksum's entry in __metadata__ lives here too: the header is checksummed with its own
// 16 digits read as zeros.

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "atomic_file.hpp"
#include "checksum.hpp"

namespace hostopt::detail {

/// Checkpoint errors name their file "checkpoint '<path>': <problem>": the owner (see
/// atomic_file.hpp) of every file of a checkpoint, the sharded index too.
inline constexpr std::string_view checkpoint_owner = "checkpoint";

/// Throws std::runtime_error "checkpoint '<path>': <problem>".
[[noreturn]] inline void fail_checkpoint(const std::string& path, const std::string& problem) {
  fail_file(checkpoint_owner, path, problem);
}

/// JSON `text` read from `path`, refused (std::runtime_error naming `what`) unless valid and
/// with every object's keys unique: a JSON reader keeps only one of two equal keys.
nlohmann::json parse_json_unique(const std::string& path, const std::string& what, const std::string& text);

/// The longest header read: a header is names and shapes.
inline constexpr std::uint64_t max_header_bytes = std::uint64_t(100) << 20;

/// The 8 bytes that open the file: the header's length in bytes, little-endian.
std::array<unsigned char, 8> length_prefix(std::uint64_t header_bytes);

/// `header` as the file holds it: padded with spaces so that the data section starts
/// 8-byte aligned.
std::string header_text(const nlohmann::json& header);

/// The header text of `file`, its length checked against max_header_bytes and the file's
/// size. The data section starts at byte 8 + its size.
std::string read_header_text(const file_reader& file);

/// The header of the file at `path`: an object with a __metadata__ object, every key once.
nlohmann::json parse_header(const std::string& path, const std::string& text);

/// A header's __metadata__ (safetensors metadata maps names to strings), read for the file
/// at `path`. A view: both must outlive it.
struct header_metadata {
  const std::string& path;
  const nlohmann::json& entries;

  bool has(const std::string& key) const { return entries.contains(key); }
  /// The string under `key`; refused ("__metadata__ lacks 'key'") when absent or not a string.
  std::string value(const std::string& key) const;
};

/// A tensor's entry: its dtype, its shape and its bytes [begin, end) of the data section.
nlohmann::json entry_json(const char* dtype, const nlohmann::json& shape, std::uint64_t begin,
                          std::uint64_t end);

/// Refuses tensor `name`'s entry unless it has dtype, shape and data_offsets, with the
/// dtype and shape expected.
void check_entry_type(const std::string& path, const std::string& name, const nlohmann::json& entry,
                      const char* dtype, const nlohmann::json& shape);

/// Bytes [begin, end) of the data section.
struct byte_span {
  std::uint64_t begin = 0, end = 0;
};

/// Tensor `name`'s data_offsets, refused unless two byte offsets, in order, within a data
/// section of `data_size` bytes.
byte_span entry_data_span(const std::string& path, const std::string& name, const nlohmann::json& entry,
                          std::uint64_t data_size);

/// Refuses entries (every tensor's data span) that overlap or leave bytes of the data
/// section to no tensor: together they must tile it exactly.
void check_entries_tile(const std::string& path, std::vector<byte_span> spans, std::uint64_t data_size);

/// The checksum's value in __metadata__ while the header is written or checksummed.
inline constexpr const char* checksum_placeholder = "0000000000000000";

/// Where the 16 digits of the entry "checksum":"<digits>" start in header `text`, or npos
/// unless it is there exactly once.
std::size_t checksum_digits_at(const std::string& text, const std::string& digits);

/// The checksum of what opens a file: the length prefix and the header `text` (its
/// checksum digits as the placeholder). The data section follows.
checksum64 checksum_of_head(const std::string& text);

} // namespace hostopt::detail
