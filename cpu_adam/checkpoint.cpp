// safetensors checkpoints: writing (atomic) and reading (verified before anything is
// applied). See include/hostopt/checkpoint.hpp for the format.
#include "hostopt/checkpoint.hpp"

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

namespace hostopt {

namespace {

using json = nlohmann::json;

constexpr const char* format_name = "hostopt";
constexpr const char* format_version = "1";
constexpr std::uint64_t max_header_bytes = std::uint64_t(100) << 20; // a header is names and shapes

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw std::runtime_error("checkpoint '" + path + "': " + what);
}

[[noreturn]] void fail_errno(const std::string& path, const std::string& what) {
  fail(path, what + ": " + std::strerror(errno));
}

// A fast 64-bit checksum of the data section: 8-byte words mixed by multiply and rotate
// (not cryptographic: it catches torn and corrupted files).
struct checksum64 {
  std::uint64_t h = 0x9E3779B97F4A7C15ull;
  std::uint64_t length = 0;
  void add(const void* data, std::size_t n) {
    const auto* p = static_cast<const unsigned char*>(data);
    // Assumes the stream is fed in multiples of 8 bytes except at the very end (every
    // tensor is f32, so each piece is a multiple of 4; pieces are joined below).
    std::size_t i = 0;
    if (pending_n_) { // complete the word a previous piece left open
      i = std::min<std::size_t>(8 - pending_n_, n);
      std::memcpy(pending_ + pending_n_, p, i);
      pending_n_ += i;
      if (pending_n_ == 8) {
        mix_word(pending_);
        pending_n_ = 0;
      }
    }
    for (; i + 8 <= n; i += 8) mix_word(p + i);
    for (; i < n; ++i) pending_[pending_n_++] = p[i];
    length += n;
  }
  std::uint64_t finish() {
    unsigned char last[8] = {};
    std::memcpy(last, pending_, pending_n_);
    std::uint64_t w;
    std::memcpy(&w, last, 8);
    std::uint64_t x = h ^ (w + length);
    x ^= x >> 33;
    x *= 0xFF51AFD7ED558CCDull;
    x ^= x >> 33;
    return x;
  }

private:
  void mix_word(const unsigned char* b) {
    std::uint64_t w;
    std::memcpy(&w, b, 8);
    h = (h ^ w) * 0x100000001B3ull;
    h = (h << 31) | (h >> 33);
  }
  unsigned char pending_[8] = {};
  std::size_t pending_n_ = 0;
};

std::string hex(std::uint64_t x) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", (unsigned long long)x);
  return buf;
}

const char* const kinds[] = {"param", "exp_avg", "exp_avg_sq"};

json config_json(const adam_config& c) {
  return {{"lr", c.lr},
          {"beta1", c.beta1},
          {"beta2", c.beta2},
          {"eps", c.eps},
          {"eps_root", c.eps_root},
          {"weight_decay", c.weight_decay},
          {"mode", c.mode == adam_mode::adam ? "adam" : "adamw"},
          {"bias_correction", c.bias_correction},
          {"nesterov", c.nesterov}};
}

adam_config config_from(const json& j) {
  adam_config c;
  c.lr = j.at("lr").get<double>();
  c.beta1 = j.at("beta1").get<double>();
  c.beta2 = j.at("beta2").get<double>();
  c.eps = j.at("eps").get<double>();
  c.eps_root = j.at("eps_root").get<double>();
  c.weight_decay = j.at("weight_decay").get<double>();
  const std::string mode = j.at("mode").get<std::string>();
  if (mode != "adam" && mode != "adamw") throw std::invalid_argument("mode '" + mode + "'");
  c.mode = mode == "adam" ? adam_mode::adam : adam_mode::adamw;
  c.bias_correction = j.at("bias_correction").get<bool>();
  c.nesterov = j.at("nesterov").get<bool>();
  return c;
}

void write_all(int fd, const void* data, std::size_t n, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (n) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      fail_errno(path, "write failed");
    }
    p += w;
    n -= std::size_t(w);
  }
}

std::string directory_of(const std::string& path) {
  const auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

} // namespace

void save_checkpoint(const optimizer& opt, const std::string& path) {
  const auto segs = opt.segments();
  const float* arrays[] = {opt.params().data(), opt.exp_avg().data(), opt.exp_avg_sq().data()};
  // Header: tensors in arena order, kinds interleaved per tensor; offsets contiguous.
  json header = json::object();
  std::uint64_t offset = 0;
  checksum64 sum;
  json groups = json::array(), tensor_groups = json::object();
  for (std::size_t g = 0; g < opt.num_groups(); ++g) groups.push_back(config_json(opt.group_config(g)));
  for (const auto& s : segs) {
    tensor_groups[s.name] = s.group;
    for (int k = 0; k < 3; ++k) {
      const std::uint64_t bytes = std::uint64_t(s.size) * 4;
      header[s.name + "." + kinds[k]] = {{"dtype", "F32"}, {"shape", s.shape}, {"data_offsets", {offset, offset + bytes}}};
      sum.add(arrays[k] + s.offset, bytes);
      offset += bytes;
    }
  }
  header["__metadata__"] = {{"format", format_name},
                            {"version", format_version},
                            {"step", std::to_string(opt.step_count())},
                            {"skipped_steps", std::to_string(opt.skipped_steps())},
                            {"groups", groups.dump()},
                            {"tensor_groups", tensor_groups.dump()},
                            {"checksum", hex(sum.finish())}};
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' '); // data section 8-byte aligned
  const std::uint64_t header_len = text.size();

  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail_errno(tmp, "cannot create the temporary file");
  try {
    unsigned char len[8];
    for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(header_len >> (8 * i));
    write_all(fd, len, 8, tmp);
    write_all(fd, text.data(), text.size(), tmp);
    for (const auto& s : segs)
      for (int k = 0; k < 3; ++k) write_all(fd, arrays[k] + s.offset, s.size * 4, tmp);
    if (::fsync(fd) != 0) fail_errno(tmp, "fsync failed");
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  if (::close(fd) != 0) {
    ::unlink(tmp.c_str());
    fail_errno(tmp, "close failed");
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    errno = err;
    fail_errno(path, "cannot rename the temporary file over it");
  }
  const std::string dir = directory_of(path);
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) { // make the rename itself durable
    ::fsync(dfd);
    ::close(dfd);
  }
}

void load_checkpoint(optimizer& opt, const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail_errno(path, "cannot open");
  struct closer {
    int fd;
    ~closer() { ::close(fd); }
  } guard{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) fail_errno(path, "cannot stat");
  const std::uint64_t file_size = std::uint64_t(st.st_size);
  auto read_at = [&](void* dst, std::uint64_t n, std::uint64_t at) {
    char* p = static_cast<char*>(dst);
    while (n) {
      const ssize_t r = ::pread(fd, p, n, off_t(at));
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) fail_errno(path, "read failed");
      if (r == 0) fail(path, "truncated: the file ends at byte " + std::to_string(at));
      p += r;
      n -= std::uint64_t(r);
      at += std::uint64_t(r);
    }
  };
  if (file_size < 8) fail(path, "truncated: " + std::to_string(file_size) + " bytes, not even a header length");
  unsigned char len[8];
  read_at(len, 8, 0);
  std::uint64_t header_len = 0;
  for (int i = 0; i < 8; ++i) header_len |= std::uint64_t(len[i]) << (8 * i);
  if (header_len > max_header_bytes)
    fail(path, "header length " + std::to_string(header_len) + " is absurd (limit " + std::to_string(max_header_bytes) +
                   " bytes): not a hostopt checkpoint, or corrupted");
  if (header_len > file_size - 8)
    fail(path, "truncated: the header claims " + std::to_string(header_len) + " bytes but the file has " +
                   std::to_string(file_size - 8) + " after the length");
  std::string text(header_len, '\0');
  read_at(text.data(), header_len, 8);
  json header;
  try {
    header = json::parse(text);
  } catch (const std::exception& e) {
    fail(path, std::string("the header is not valid JSON: ") + e.what());
  }
  if (!header.is_object() || !header.contains("__metadata__") || !header["__metadata__"].is_object())
    fail(path, "the header has no __metadata__: not a hostopt checkpoint");
  const json& meta = header["__metadata__"];
  auto meta_string = [&](const char* key) -> std::string {
    if (!meta.contains(key) || !meta[key].is_string()) fail(path, std::string("__metadata__ lacks '") + key + "'");
    return meta[key].get<std::string>();
  };
  if (meta_string("format") != format_name) fail(path, "format '" + meta_string("format") + "': expected 'hostopt'");
  if (meta_string("version") != format_version)
    fail(path, "version '" + meta_string("version") + "' is unknown: this hostopt reads version " + format_version);

  const std::uint64_t data_start = 8 + header_len;
  const std::uint64_t data_size = file_size - data_start;
  const auto segs = opt.segments();
  // Every tensor of the optimizer, with the right dtype and shape, inside the file.
  std::size_t expected_entries = 0;
  struct piece {
    std::uint64_t begin, end;
    float* dst;
  };
  std::vector<piece> pieces;
  float* arrays[] = {opt.params().data(), opt.exp_avg().data(), opt.exp_avg_sq().data()};
  for (const auto& s : segs)
    for (int k = 0; k < 3; ++k) {
      const std::string name = s.name + "." + kinds[k];
      ++expected_entries;
      if (!header.contains(name)) fail(path, "tensor '" + name + "' is missing (the optimizer has '" + s.name + "')");
      const json& t = header[name];
      if (!t.is_object() || !t.contains("dtype") || !t.contains("shape") || !t.contains("data_offsets"))
        fail(path, "tensor '" + name + "' has no dtype/shape/data_offsets");
      if (t["dtype"] != "F32") fail(path, "tensor '" + name + "' has dtype " + t["dtype"].dump() + ": expected F32");
      if (!t["shape"].is_array() || t["shape"] != json(s.shape))
        fail(path, "tensor '" + name + "' has shape " + t["shape"].dump() + ": expected " + json(s.shape).dump());
      const json& off = t["data_offsets"];
      if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned())
        fail(path, "tensor '" + name + "': data_offsets " + off.dump() + " are not two byte offsets");
      const std::uint64_t b = off[0].get<std::uint64_t>(), e = off[1].get<std::uint64_t>();
      if (b > e || e > data_size)
        fail(path, "tensor '" + name + "': data_offsets [" + std::to_string(b) + ", " + std::to_string(e) +
                       ") lie outside the " + std::to_string(data_size) + "-byte data section (truncated file?)");
      if (e - b != std::uint64_t(s.size) * 4)
        fail(path, "tensor '" + name + "': " + std::to_string(e - b) + " bytes for " + std::to_string(s.size) +
                       " f32 elements");
      pieces.push_back({b, e, arrays[k] + s.offset});
    }
  if (header.size() - 1 != expected_entries)
    fail(path, "it holds " + std::to_string(header.size() - 1) + " tensors, the optimizer expects " +
                   std::to_string(expected_entries) + " (different tensor names)");

  // Groups, tensor groups, counts.
  std::vector<adam_config> configs;
  std::int64_t step = 0, skipped = 0;
  try {
    const json groups = json::parse(meta_string("groups"));
    for (const auto& g : groups) configs.push_back(config_from(g));
    const json tensor_groups = json::parse(meta_string("tensor_groups"));
    for (const auto& s : segs)
      if (!tensor_groups.contains(s.name) || tensor_groups[s.name].get<std::size_t>() != s.group)
        fail(path, "tensor '" + s.name + "' belongs to another group in the file");
    step = std::stoll(meta_string("step"));
    skipped = std::stoll(meta_string("skipped_steps"));
  } catch (const std::runtime_error&) {
    throw;
  } catch (const std::exception& e) {
    fail(path, std::string("bad metadata: ") + e.what());
  }
  if (configs.size() != opt.num_groups())
    fail(path, std::to_string(configs.size()) + " parameter groups, the optimizer has " + std::to_string(opt.num_groups()));
  for (std::size_t g = 0; g < configs.size(); ++g) {
    try {
      validate(configs[g], "groups[" + std::to_string(g) + "]");
    } catch (const std::invalid_argument& e) {
      fail(path, e.what());
    }
  }
  if (step < 0 || skipped < 0) fail(path, "negative step counts");

  // The data, in file order, into a staging buffer: verified before anything is applied.
  std::vector<piece> by_offset = pieces;
  std::sort(by_offset.begin(), by_offset.end(), [](const piece& a, const piece& b) { return a.begin < b.begin; });
  for (std::size_t i = 1; i < by_offset.size(); ++i)
    if (by_offset[i].begin < by_offset[i - 1].end) fail(path, "two tensors overlap in the data section");
  std::vector<float> staging(data_size / 4);
  if (data_size % 4) fail(path, "the data section is not a whole number of f32 values");
  read_at(staging.data(), data_size, data_start);
  checksum64 sum;
  for (const auto& p : pieces) sum.add(reinterpret_cast<const char*>(staging.data()) + p.begin, p.end - p.begin);
  if (hex(sum.finish()) != meta_string("checksum"))
    fail(path, "checksum mismatch (file " + meta_string("checksum") + ", data " + hex(sum.finish()) +
                   "): the data is corrupted");

  // Apply.
  for (const auto& p : pieces)
    if (p.end > p.begin) std::memcpy(p.dst, reinterpret_cast<const char*>(staging.data()) + p.begin, p.end - p.begin);
  for (std::size_t g = 0; g < configs.size(); ++g) opt.set_group_config(g, configs[g]);
  opt.set_step_count(step);
  opt.set_skipped_steps(skipped);
}

} // namespace hostopt
