// A checkpoint's safetensors header: written, read and checked. See safetensors_header.hpp.
#include "safetensors_header.hpp"

#include <algorithm>
#include <set>
#include <utility>

namespace hostopt::detail {

using json = nlohmann::json;

// json::parse keeps the last of two equal keys silently, so a header with "step" twice in
// __metadata__ (or a tensor listed twice) would load whichever came last.
json parse_json_unique(const std::string& path, const std::string& what, const std::string& text) {
  struct level {
    std::set<std::string> keys;
    std::string name, last_key; // the key this object is the value of; its latest key
  };
  std::vector<level> open;  // the objects being parsed, outermost first
  std::string twice, where; // the first repeated key, and the object it is in
  bool repeated = false;    // a key seen twice ("" is a key too: twice.empty() says nothing)
  json j;
  try {
    j = json::parse(text, [&](int, json::parse_event_t event, json& parsed) {
      if (event == json::parse_event_t::object_start) {
        open.push_back({{}, open.empty() ? std::string() : open.back().last_key, {}});
      } else if (event == json::parse_event_t::object_end) {
        open.pop_back();
      } else if (event == json::parse_event_t::key && !open.empty()) {
        level& l = open.back();
        l.last_key = parsed.get<std::string>();
        if (!l.keys.insert(l.last_key).second && !repeated) {
          repeated = true;
          twice = l.last_key;
          where = l.name.empty() ? std::string() : " in '" + l.name + "'";
        }
      }
      return true;
    });
  } catch (const std::exception& e) {
    fail_checkpoint(path, what + " is not valid JSON: " + e.what());
  }
  if (repeated)
    fail_checkpoint(path, what + " holds the key '" + twice + "' twice" + where +
                              " (a JSON reader keeps only one of them): refused");
  return j;
}

std::array<unsigned char, 8> length_prefix(std::uint64_t header_bytes) {
  std::array<unsigned char, 8> bytes;
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<unsigned char>(header_bytes >> (8 * i));
  return bytes;
}

std::string header_text(const json& header) {
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  return text;
}

std::string read_header_text(const file_reader& file) {
  const std::string& path = file.path();
  const std::uint64_t file_size = file.size();
  if (file_size < 8)
    fail_checkpoint(path, "truncated: " + std::to_string(file_size) + " bytes, not even a header length");
  unsigned char len[8];
  file.read_at(len, 8, 0);
  std::uint64_t header_len = 0;
  for (int i = 0; i < 8; ++i) header_len |= std::uint64_t(len[i]) << (8 * i);
  if (header_len > max_header_bytes)
    fail_checkpoint(path, "header length " + std::to_string(header_len) + " is absurd (limit " +
                              std::to_string(max_header_bytes) +
                              " bytes): not a hostopt checkpoint, or corrupted");
  if (header_len > file_size - 8)
    fail_checkpoint(path, "truncated: the header claims " + std::to_string(header_len) +
                              " bytes but the file has " + std::to_string(file_size - 8) +
                              " after the length");
  std::string text(header_len, '\0');
  file.read_at(text.data(), header_len, 8);
  return text;
}

json parse_header(const std::string& path, const std::string& text) {
  json header = parse_json_unique(path, "the header", text);
  if (!header.is_object() || !header.contains("__metadata__") || !header["__metadata__"].is_object())
    fail_checkpoint(path, "the header has no __metadata__: not a hostopt checkpoint");
  return header;
}

std::string header_metadata::value(const std::string& key) const {
  if (!entries.contains(key) || !entries[key].is_string())
    fail_checkpoint(path, "__metadata__ lacks '" + key + "'");
  return entries[key].get<std::string>();
}

json entry_json(const char* dtype, const json& shape, std::uint64_t begin, std::uint64_t end) {
  return {{"dtype", dtype}, {"shape", shape}, {"data_offsets", {begin, end}}};
}

void check_entry_type(const std::string& path, const std::string& name, const json& entry, const char* dtype,
                      const json& shape) {
  if (!entry.is_object() || !entry.contains("dtype") || !entry.contains("shape") ||
      !entry.contains("data_offsets"))
    fail_checkpoint(path, "tensor '" + name + "' has no dtype/shape/data_offsets");
  if (entry["dtype"] != dtype)
    fail_checkpoint(path, "tensor '" + name + "' has dtype " + entry["dtype"].dump() + ": expected " + dtype);
  if (!entry["shape"].is_array() || entry["shape"] != shape)
    fail_checkpoint(path, "tensor '" + name + "' has shape " + entry["shape"].dump() + ": expected " +
                              shape.dump());
}

byte_span entry_data_span(const std::string& path, const std::string& name, const json& entry,
                          std::uint64_t data_size) {
  const json& off = entry["data_offsets"];
  if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned())
    fail_checkpoint(path, "tensor '" + name + "': data_offsets " + off.dump() + " are not two byte offsets");
  const std::uint64_t b = off[0].get<std::uint64_t>(), e = off[1].get<std::uint64_t>();
  if (b > e || e > data_size)
    fail_checkpoint(path, "tensor '" + name + "': data_offsets [" + std::to_string(b) + ", " +
                              std::to_string(e) + ") lie outside the " + std::to_string(data_size) +
                              "-byte data section (truncated file?)");
  return {b, e};
}

void check_entries_tile(const std::string& path, std::vector<byte_span> spans, std::uint64_t data_size) {
  std::uint64_t total = 0;
  for (const byte_span& s : spans) total += s.end - s.begin;
  // Non-empty spans must not overlap; with a matching total they tile the data exactly.
  std::erase_if(spans, [](const byte_span& s) { return s.begin == s.end; });
  std::sort(spans.begin(), spans.end(), [](const byte_span& a, const byte_span& b) {
    return std::pair(a.begin, a.end) < std::pair(b.begin, b.end);
  });
  for (std::size_t i = 1; i < spans.size(); ++i)
    if (spans[i].begin < spans[i - 1].end) fail_checkpoint(path, "two tensors overlap in the data section");
  if (total != data_size)
    fail_checkpoint(
        path, std::to_string(data_size - std::min(total, data_size)) +
                  " bytes in the data section belong to no tensor (trailing or interleaved bytes): refused");
}

std::size_t checksum_digits_at(const std::string& text, const std::string& digits) {
  const std::string slot = "\"checksum\":\"" + digits + "\"";
  const std::size_t at = text.find(slot);
  if (at == std::string::npos || text.find(slot, at + 1) != std::string::npos) return std::string::npos;
  return at + 12; // past "checksum":"
}

checksum64 checksum_of_head(const std::string& text) {
  checksum64 sum;
  const auto len = length_prefix(text.size());
  sum.add(len.data(), len.size());
  sum.add(text.data(), text.size());
  return sum;
}

} // namespace hostopt::detail
