#include "hyperparameter_record.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>
#include <type_traits>

#include "checksum.hpp"
#include "direct_file.hpp"

namespace hostopt::detail {
namespace {

// A place: magic, version, step, commit id, groups, fields per group, the groups' fields
// (8 bytes each, in for_each_field's order), then a checksum of all of it; padded to 4 KiB.
constexpr char magic[8] = {'h', 'o', 's', 't', 'o', 'p', 'h', 'p'};
constexpr std::uint64_t version = 1, head_words = 6;
constexpr std::size_t page = drive::direct_alignment;

// Fields per group: adam_config's, counted (a field added later changes the records' size
// and is told apart by this count, never written past a place).
std::uint64_t fields() {
  static const std::uint64_t n = [] {
    adam_config c;
    std::uint64_t k = 0;
    for_each_field(c, [&](const char*, auto&) { ++k; });
    return k;
  }();
  return n;
}

std::size_t place_bytes(std::size_t groups) {
  const std::size_t bytes = std::size_t(head_words + groups * fields() + 1) * 8;
  return (bytes + page - 1) / page * page;
}

std::string path_of(const std::string& dir) { return (std::filesystem::path(dir) / "hyperparameters").string(); }

[[noreturn]] void fail(int error, const std::string& what) {
  throw std::system_error(error, std::generic_category(), what);
}

std::uint64_t word_at(const std::vector<unsigned char>& b, std::size_t i) {
  std::uint64_t w;
  std::memcpy(&w, b.data() + i * 8, 8);
  return w;
}

// A new file's directory entry made durable (the chunk store does the same for its files).
void sync_directory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) fail(errno, "cannot open the directory " + dir);
  const int rc = ::fsync(fd);
  const int error = errno;
  ::close(fd);
  if (rc != 0) fail(error, "cannot make the hyper-parameters file's entry in " + dir + " durable");
}

} // namespace

void write_hyperparameters(const std::string& dir, std::uint64_t step, std::uint64_t commit_id,
                           const std::vector<adam_config>& configs, bool sync) {
  // O_DIRECT, as the chunks and commit records: on the drive once written, never behind them
  // in the page cache.
  const std::size_t bytes = place_bytes(configs.size());
  drive::direct_buffer page_buf = drive::make_direct_buffer(bytes);
  unsigned char* b = reinterpret_cast<unsigned char*>(page_buf.get());
  std::memset(b, 0, bytes);
  std::size_t at = 0;
  auto put = [&](std::uint64_t w) {
    std::memcpy(b + at, &w, 8);
    at += 8;
  };
  std::uint64_t m;
  std::memcpy(&m, magic, 8);
  for (const std::uint64_t w : {m, version, step, commit_id, std::uint64_t(configs.size()), fields()}) put(w);
  for (adam_config c : configs)
    for_each_field(c, [&](const char*, auto& v) {
      using T = std::remove_cvref_t<decltype(v)>;
      if constexpr (std::is_same_v<T, double>) put(std::bit_cast<std::uint64_t>(v));
      else put(std::uint64_t(v)); // (adam_mode, bool)
    });
  checksum64 sum;
  sum.add(b, at);
  put(sum.finish());
  const std::string path = path_of(dir);
  const bool made = !std::filesystem::exists(path);
  drive::direct_file f = made ? drive::direct_file::create(path, 2 * bytes) : drive::direct_file::open(path);
  if (made && sync) sync_directory(dir);
  const off_t offset = off_t(step % 2) * off_t(bytes);
  std::size_t done = 0;
  while (done < bytes) {
    const ssize_t n = ::pwrite(f.fd(), b + done, bytes - done, offset + off_t(done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) fail(n < 0 ? errno : EIO, "cannot write the hyper-parameters of step " + std::to_string(step) +
                                                " to " + path);
    done += std::size_t(n);
  }
  if (sync && ::fdatasync(f.fd()) != 0)
    fail(errno, "cannot make the hyper-parameters of step " + std::to_string(step) + " durable in " + path);
}

std::optional<std::vector<adam_config>> read_hyperparameters(const std::string& dir, std::uint64_t step,
                                                             std::uint64_t commit_id, std::size_t groups,
                                                             std::string& problem) {
  problem.clear();
  const std::string path = path_of(dir);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno != ENOENT) problem = path + ": " + std::strerror(errno);
    return std::nullopt;
  }
  std::vector<unsigned char> b(place_bytes(groups), 0);
  const off_t offset = off_t(step % 2) * off_t(b.size());
  std::size_t done = 0;
  while (done < b.size()) {
    const ssize_t n = ::pread(fd, b.data() + done, b.size() - done, offset + off_t(done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    done += std::size_t(n);
  }
  ::close(fd);
  const std::string where = path + ", commit " + std::to_string(step) + ": ";
  std::uint64_t m;
  std::memcpy(&m, magic, 8);
  const std::size_t values = std::size_t(head_words + groups * fields());
  if (done < b.size() || word_at(b, 0) != m) {
    problem = where + "no record (never written, or torn)";
    return std::nullopt;
  }
  checksum64 sum;
  sum.add(b.data(), values * 8);
  if (word_at(b, 1) != version || word_at(b, 5) != fields()) {
    problem = where + "a record of another hostopt version, or a corrupt one (version " +
              std::to_string(word_at(b, 1)) + ", " + std::to_string(word_at(b, 5)) + " fields per group)";
    return std::nullopt;
  }
  if (word_at(b, values) != sum.finish()) {
    problem = where + "a corrupt record (its checksum)";
    return std::nullopt;
  }
  if (word_at(b, 2) != step || word_at(b, 3) != commit_id) {
    problem = where + "the record of another commit (" + std::to_string(word_at(b, 2)) + ")";
    return std::nullopt;
  }
  if (word_at(b, 4) != groups) {
    problem = where + "a record of " + std::to_string(word_at(b, 4)) + " groups, not " + std::to_string(groups);
    return std::nullopt;
  }
  std::vector<adam_config> configs(groups);
  std::size_t i = head_words;
  bool ok = true;
  for (adam_config& c : configs)
    for_each_field(c, [&](const char*, auto& v) {
      using T = std::remove_cvref_t<decltype(v)>;
      const std::uint64_t w = word_at(b, i++);
      if constexpr (std::is_same_v<T, double>) v = std::bit_cast<double>(w);
      else if (w > 1) ok = false;
      else v = T(w);
    });
  if (!ok) {
    problem = where + "a record with a flag that is neither 0 nor 1";
    return std::nullopt;
  }
  return configs;
}

} // namespace hostopt::detail
