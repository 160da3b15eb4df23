// safetensors checkpoints: writing (atomic, from a locked and consistent state) and reading
// (verified completely before anything is applied). See include/hostopt/checkpoint.hpp.
#include "hostopt/checkpoint.hpp"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <dirent.h>
#include <map>
#include <signal.h>
#include <stdexcept>
#include <string>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "checkpoint_io.hpp"
#include "exclusive_state.hpp"

namespace hostopt {

namespace {

using json = nlohmann::json;

constexpr const char* format_name = "hostopt";
// Version 2: the checksum covers the header too (version 1 covered only the data).
constexpr const char* format_version = "2";
constexpr std::uint64_t max_header_bytes = std::uint64_t(100) << 20; // a header is names and shapes
constexpr std::size_t io_block = std::size_t(4) << 20;                // staging for checksum + write/read
constexpr const char* checksum_placeholder = "0000000000000000";

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw std::runtime_error("checkpoint '" + path + "': " + what);
}

[[noreturn]] void fail_errno(const std::string& path, const std::string& what) {
  fail(path, what + ": " + std::strerror(errno));
}

// A fast 64-bit checksum: 8-byte words mixed by multiply and rotate (not cryptographic: it
// catches torn and corrupted files). Pieces of any length may be fed in.
struct checksum64 {
  std::uint64_t h = 0x9E3779B97F4A7C15ull;
  std::uint64_t length = 0;
  void add(const void* data, std::size_t n) {
    const auto* p = static_cast<const unsigned char*>(data);
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
  std::uint64_t finish() const {
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
  auto number = [&](const char* key) {
    const json& v = j.at(key);
    if (!v.is_number()) throw std::invalid_argument(std::string(key) + " is not a number");
    return v.get<double>();
  };
  c.lr = number("lr");
  c.beta1 = number("beta1");
  c.beta2 = number("beta2");
  c.eps = number("eps");
  c.eps_root = number("eps_root");
  c.weight_decay = number("weight_decay");
  const std::string mode = j.at("mode").get<std::string>();
  if (mode != "adam" && mode != "adamw") throw std::invalid_argument("mode '" + mode + "'");
  c.mode = mode == "adam" ? adam_mode::adam : adam_mode::adamw;
  c.bias_correction = j.at("bias_correction").get<bool>();
  c.nesterov = j.at("nesterov").get<bool>();
  return c;
}

// A count as written by std::to_string: decimal digits only, no sign, space, prefix,
// fraction or leading zero, at most max_step_count.
std::int64_t parse_count(const std::string& path, const char* key, const std::string& s) {
  const bool digits = !s.empty() && s.size() <= 19 && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
  if (!digits || (s.size() > 1 && s[0] == '0'))
    fail(path, std::string("__metadata__ '") + key + "' = \"" + s + "\": expected a decimal count");
  const std::uint64_t v = std::stoull(s);
  if (v > std::uint64_t(max_step_count))
    fail(path, std::string("__metadata__ '") + key + "' = " + s + ": above hostopt::max_step_count (" +
                   std::to_string(max_step_count) + ")");
  return std::int64_t(v);
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

void read_all_at(int fd, void* dst, std::uint64_t n, std::uint64_t at, const std::string& path) {
  char* p = static_cast<char*>(dst);
  while (n) {
    const ssize_t r = ::pread(fd, p, std::size_t(std::min<std::uint64_t>(n, io_block)), off_t(at));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) fail_errno(path, "read failed");
    if (r == 0) fail(path, "truncated: the file ends at byte " + std::to_string(at));
    p += r;
    n -= std::uint64_t(r);
    at += std::uint64_t(r);
  }
}

std::string directory_of(const std::string& path) {
  const auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

std::string base_of(const std::string& path) {
  const auto slash = path.find_last_of('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0 || !buf[0]) return "localhost";
  std::string h(buf);
  for (char& c : h)
    if (c == '/' || c == '.') c = '_';
  return h;
}

// Temp files are "<name>.hostopt-tmp.<host>.<pid>.<n>": unique per call (pid and a
// process-wide counter), and attributable, so a later save can remove a dead writer's.
std::string temp_prefix(const std::string& path) { return base_of(path) + ".hostopt-tmp." + host_name() + "."; }

std::string unique_temp_path(const std::string& path) {
  static std::atomic<std::uint64_t> counter{0};
  return directory_of(path) + "/" + temp_prefix(path) + std::to_string(::getpid()) + "." +
         std::to_string(counter.fetch_add(1));
}

// Removes temp files of this path left by writers on this host that no longer run (a
// kill -9 mid-save). Best effort: a failure here never fails the save.
void remove_stale_temps(const std::string& path) {
  const std::string dir = directory_of(path), prefix = temp_prefix(path);
  DIR* d = ::opendir(dir.c_str());
  if (!d) return;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    const std::string rest = name.substr(prefix.size()); // "<pid>.<n>"
    const auto dot = rest.find('.');
    if (dot == 0 || dot == std::string::npos) continue;
    const std::string pid_text = rest.substr(0, dot);
    if (pid_text.size() > 9 || !std::all_of(pid_text.begin(), pid_text.end(), [](char c) { return c >= '0' && c <= '9'; }))
      continue;
    const pid_t pid = pid_t(std::stol(pid_text));
    if (pid <= 0 || pid == ::getpid()) continue;
    if (::kill(pid, 0) == 0 || errno != ESRCH) continue; // alive (or not ours to judge)
    ::unlinkat(::dirfd(d), name.c_str(), 0);
  }
  ::closedir(d);
}

// What may be replaced: nothing (a new file) or a regular file. Devices, fifos, sockets,
// directories and symbolic links are refused: as root a save to /dev/null would otherwise
// replace the device node.
void check_replaceable(const std::string& path, const std::string& what) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return;
    fail_errno(path, "cannot stat " + what);
  }
  if (S_ISREG(st.st_mode)) return;
  if (S_ISLNK(st.st_mode))
    fail(path, what + " is a symbolic link: hostopt replaces files atomically by renaming over them and will not "
                      "replace a link or write through it; save to the link's target instead");
  fail(path, what + " exists and is not a regular file (a device, fifo, socket or directory): refusing to replace it");
}

void fsync_directory(const std::string& path) {
  const int dfd = ::open(directory_of(path).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) { // make the rename itself durable
    ::fsync(dfd);
    ::close(dfd);
  }
}

// Creates a unique temp file beside `path`, lets `fill` write it, fsyncs, renames it over
// `path` and fsyncs the directory. On any error the temp file is removed.
template <class Fill>
void replace_atomically(const std::string& path, const std::string& what, Fill&& fill) {
  detail::check_path(path, what);
  check_replaceable(path, what);
  remove_stale_temps(path);
  const std::string tmp = unique_temp_path(path);
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd < 0) fail_errno(tmp, "cannot create the temporary file");
  try {
    fill(fd, tmp);
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
  try {
    check_replaceable(path, what); // it may have been replaced while we wrote
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    errno = err;
    fail_errno(path, "cannot rename the temporary file over it");
  }
  fsync_directory(path);
}

} // namespace

namespace detail {

void check_path(const std::string& path, const std::string& what) {
  if (path.empty()) throw std::invalid_argument(what + ": the path is empty");
  if (path.find('\0') != std::string::npos)
    throw std::invalid_argument(what + " '" + std::string(path.c_str()) +
                                "...': the path holds a NUL byte (it would be cut there): refused");
}

std::string read_small_file(const std::string& path, const std::string& what, std::size_t limit) {
  check_path(path, what);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) fail_errno(path, "cannot open " + what);
  struct closer {
    int fd;
    ~closer() { ::close(fd); }
  } guard{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) fail_errno(path, "cannot stat " + what);
  if (!S_ISREG(st.st_mode)) fail(path, what + " is not a regular file: refused");
  if (std::uint64_t(st.st_size) > limit)
    fail(path, what + " has " + std::to_string(st.st_size) + " bytes: more than the " + std::to_string(limit) + " expected");
  std::string text(std::size_t(st.st_size), '\0');
  read_all_at(fd, text.data(), text.size(), 0, path);
  return text;
}

void write_file_atomically(const std::string& path, const std::string& text, const std::string& what) {
  replace_atomically(path, what, [&](int fd, const std::string& tmp) { write_all(fd, text.data(), text.size(), tmp); });
}

void save_checkpoint(const optimizer& opt, const std::string& path, const checkpoint_metadata& extra) {
  check_path(path, "checkpoint");
  // The whole save sees one state: no step, load or chunked step runs meanwhile.
  const exclusive_state st(opt, "save_checkpoint");
  const auto segs = st.segments();
  json header = json::object();
  std::uint64_t offset = 0;
  json groups = json::array(), tensor_groups = json::object();
  for (const auto& c : st.configs()) groups.push_back(config_json(c));
  for (const auto& s : segs) {
    tensor_groups[s.name] = s.group;
    for (int k = 0; k < 3; ++k) {
      const std::uint64_t bytes = std::uint64_t(s.size) * 4;
      header[s.name + "." + kinds[k]] = {{"dtype", "F32"}, {"shape", s.shape}, {"data_offsets", {offset, offset + bytes}}};
      offset += bytes;
    }
  }
  json meta = {{"format", format_name},
               {"version", format_version},
               {"step", std::to_string(st.step_count())},
               {"skipped_steps", std::to_string(st.skipped_steps())},
               {"groups", groups.dump()},
               {"tensor_groups", tensor_groups.dump()},
               {"checksum", checksum_placeholder}};
  for (const auto& [k, v] : extra) {
    if (meta.contains(k)) throw std::logic_error("checkpoint metadata key '" + k + "' is hostopt's own");
    meta[k] = v;
  }
  header["__metadata__"] = meta;
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' '); // data section 8-byte aligned
  const std::string slot = std::string("\"checksum\":\"") + checksum_placeholder + "\"";
  const std::size_t at = text.find(slot);
  if (at == std::string::npos || text.find(slot, at + 1) != std::string::npos)
    throw std::logic_error("checkpoint header: the checksum slot is not unique");
  const std::uint64_t checksum_pos = 8 + at + 12; // file offset of the 16 hex digits

  replace_atomically(path, "checkpoint", [&](int fd, const std::string& tmp) {
    checksum64 sum;
    unsigned char len[8];
    for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(std::uint64_t(text.size()) >> (8 * i));
    sum.add(len, 8);
    sum.add(text.data(), text.size());
    write_all(fd, len, 8, tmp);
    write_all(fd, text.data(), text.size(), tmp);
    // The data goes out through one staging block: the bytes checksummed are the bytes
    // written, whatever another thread does to the arena through a view.
    std::vector<unsigned char> block(std::min<std::uint64_t>(io_block, std::max<std::uint64_t>(offset, 1)));
    for (const auto& s : segs)
      for (int k = 0; k < 3; ++k) {
        const auto* src = reinterpret_cast<const unsigned char*>(st.array(k) + s.offset);
        for (std::size_t done = 0, n = s.size * 4; done < n;) {
          const std::size_t len_now = std::min(block.size(), n - done);
          std::memcpy(block.data(), src + done, len_now);
          sum.add(block.data(), len_now);
          write_all(fd, block.data(), len_now, tmp);
          done += len_now;
        }
      }
    const std::string digits = hex(sum.finish());
    if (::pwrite(fd, digits.data(), digits.size(), off_t(checksum_pos)) != ssize_t(digits.size()))
      fail_errno(tmp, "cannot write the checksum");
  });
}

void load_checkpoint(optimizer& opt, const std::string& path, const checkpoint_metadata& expected,
                     checkpoint_metadata* read_back) {
  check_path(path, "checkpoint");
  // Non-blocking open: a fifo would otherwise block here forever; it is refused below.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) fail_errno(path, "cannot open");
  struct closer {
    int fd;
    ~closer() { ::close(fd); }
  } guard{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) fail_errno(path, "cannot stat");
  if (!S_ISREG(st.st_mode)) fail(path, "not a regular file (a device, fifo, socket or directory): refused");
  const std::uint64_t file_size = std::uint64_t(st.st_size);
  if (file_size < 8) fail(path, "truncated: " + std::to_string(file_size) + " bytes, not even a header length");
  unsigned char len[8];
  read_all_at(fd, len, 8, 0, path);
  std::uint64_t header_len = 0;
  for (int i = 0; i < 8; ++i) header_len |= std::uint64_t(len[i]) << (8 * i);
  if (header_len > max_header_bytes)
    fail(path, "header length " + std::to_string(header_len) + " is absurd (limit " + std::to_string(max_header_bytes) +
                   " bytes): not a hostopt checkpoint, or corrupted");
  if (header_len > file_size - 8)
    fail(path, "truncated: the header claims " + std::to_string(header_len) + " bytes but the file has " +
                   std::to_string(file_size - 8) + " after the length");
  std::string text(header_len, '\0');
  read_all_at(fd, text.data(), header_len, 8, path);
  json header;
  try {
    header = json::parse(text);
  } catch (const std::exception& e) {
    fail(path, std::string("the header is not valid JSON: ") + e.what());
  }
  if (!header.is_object() || !header.contains("__metadata__") || !header["__metadata__"].is_object())
    fail(path, "the header has no __metadata__: not a hostopt checkpoint");
  const json& meta = header["__metadata__"];
  auto meta_string = [&](const std::string& key) -> std::string {
    if (!meta.contains(key) || !meta[key].is_string()) fail(path, "__metadata__ lacks '" + key + "'");
    return meta[key].get<std::string>();
  };
  if (meta_string("format") != format_name) fail(path, "format '" + meta_string("format") + "': expected 'hostopt'");
  if (meta_string("version") != format_version)
    fail(path, "version '" + meta_string("version") + "' is unknown: this hostopt reads version " + format_version +
                   (meta_string("version") == "1" ? " (version 1 files, whose checksum did not cover the header, "
                                                    "are no longer trusted)"
                                                  : ""));
  for (const auto& [k, v] : expected)
    if (meta_string(k) != v) fail(path, "__metadata__ '" + k + "' = \"" + meta_string(k) + "\": expected \"" + v + "\"");
  if (read_back)
    for (auto& [k, v] : *read_back) v = meta_string(k);

  // Everything below runs with the optimizer locked; a load may replace a failed state.
  detail::exclusive_state state(opt, "load_checkpoint", true);
  const std::uint64_t data_start = 8 + header_len;
  const std::uint64_t data_size = file_size - data_start;
  const auto segs = state.segments();
  // Every tensor of the optimizer, with the right dtype and shape, inside the file.
  std::size_t expected_entries = 0;
  struct piece {
    std::uint64_t begin, end;
    float* dst;
  };
  std::vector<piece> pieces;
  std::uint64_t total = 0;
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
      pieces.push_back({b, e, state.array(k) + s.offset});
      total += e - b;
    }
  if (header.size() - 1 != expected_entries)
    fail(path, "it holds " + std::to_string(header.size() - 1) + " tensors, the optimizer expects " +
                   std::to_string(expected_entries) + " (different tensor names)");
  std::vector<piece> by_offset = pieces;
  std::sort(by_offset.begin(), by_offset.end(), [](const piece& a, const piece& b) { return a.begin < b.begin; });
  for (std::size_t i = 1; i < by_offset.size(); ++i)
    if (by_offset[i].begin < by_offset[i - 1].end) fail(path, "two tensors overlap in the data section");
  // No overlap and a matching total: the tensors tile the data section exactly.
  if (total != data_size)
    fail(path, std::to_string(data_size - std::min(total, data_size)) +
                   " bytes in the data section belong to no tensor (trailing or interleaved bytes): refused");

  // Groups, tensor groups, counts: parsed strictly.
  std::vector<adam_config> configs;
  std::int64_t step = 0, skipped = 0;
  try {
    const json groups = json::parse(meta_string("groups"));
    if (!groups.is_array()) fail(path, "__metadata__ 'groups' is not a list");
    for (const auto& g : groups) configs.push_back(config_from(g));
    const json tensor_groups = json::parse(meta_string("tensor_groups"));
    for (const auto& s : segs)
      if (!tensor_groups.contains(s.name) || !tensor_groups[s.name].is_number_unsigned() ||
          tensor_groups[s.name].get<std::size_t>() != s.group)
        fail(path, "tensor '" + s.name + "' belongs to another group in the file");
  } catch (const std::runtime_error&) {
    throw;
  } catch (const std::exception& e) {
    fail(path, std::string("bad metadata: ") + e.what());
  }
  step = parse_count(path, "step", meta_string("step"));
  skipped = parse_count(path, "skipped_steps", meta_string("skipped_steps"));
  if (configs.size() != state.configs().size())
    fail(path, std::to_string(configs.size()) + " parameter groups, the optimizer has " +
                   std::to_string(state.configs().size()));
  for (std::size_t g = 0; g < configs.size(); ++g) {
    try {
      validate(configs[g], "groups[" + std::to_string(g) + "]");
    } catch (const std::invalid_argument& e) {
      fail(path, e.what());
    }
  }

  // The checksum covers the length, the header (its own digits read as zeros) and the data.
  const std::string stored = meta_string("checksum");
  const std::string slot = "\"checksum\":\"" + stored + "\"";
  const std::size_t at = text.find(slot);
  if (stored.size() != 16 || at == std::string::npos || text.find(slot, at + 1) != std::string::npos)
    fail(path, "the checksum entry is malformed");
  std::string zeroed = text;
  zeroed.replace(at + 12, 16, checksum_placeholder);
  checksum64 head;
  head.add(len, 8);
  head.add(zeroed.data(), zeroed.size());

  // Pass 1 verifies the file, streaming (no second copy of the state in memory).
  {
    checksum64 sum = head;
    std::vector<unsigned char> block(std::min<std::uint64_t>(io_block, std::max<std::uint64_t>(data_size, 1)));
    for (std::uint64_t done = 0; done < data_size;) {
      const std::uint64_t n = std::min<std::uint64_t>(block.size(), data_size - done);
      read_all_at(fd, block.data(), n, data_start + done, path);
      sum.add(block.data(), std::size_t(n));
      done += n;
    }
    if (hex(sum.finish()) != stored)
      fail(path, "checksum mismatch (file " + stored + ", contents " + hex(sum.finish()) +
                     "): the header or the data is corrupted");
  }
  // Pass 2 reads into place, checksumming again: a file changed between the passes leaves
  // a half-loaded state, which is then marked failed (never used as if it were whole).
  checksum64 sum = head;
  try {
    for (const auto& p : by_offset) {
      read_all_at(fd, p.dst, p.end - p.begin, data_start + p.begin, path);
      sum.add(p.dst, std::size_t(p.end - p.begin));
    }
    if (hex(sum.finish()) != stored) fail(path, "the file changed while it was being loaded");
  } catch (const std::exception& e) {
    state.mark_failed(std::string("load_checkpoint stopped midway: ") + e.what());
    throw;
  }
  state.set_counters(std::move(configs), step, skipped);
  state.clear_failure();
}

} // namespace detail

void save_checkpoint(const optimizer& opt, const std::string& path) { detail::save_checkpoint(opt, path, {}); }

void load_checkpoint(optimizer& opt, const std::string& path) { detail::load_checkpoint(opt, path, {}); }

} // namespace hostopt
