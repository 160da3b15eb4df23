#include "step_record_file.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>

#include "checksum.hpp"
#include "direct_file.hpp"

namespace hostopt::detail {
namespace {

constexpr std::size_t head_words = 4; // magic, version, step, commit id
constexpr std::size_t page = drive::direct_alignment;

std::size_t place_bytes(const step_record_kind& kind) {
  const std::size_t bytes = (head_words + kind.words + 1) * 8;
  return (bytes + page - 1) / page * page;
}

[[noreturn]] void fail(int error, const std::string& what) {
  throw std::system_error(error, std::generic_category(), what);
}

std::uint64_t word_at(const unsigned char* b, std::size_t i) {
  std::uint64_t w;
  std::memcpy(&w, b + i * 8, 8);
  return w;
}

std::uint64_t magic_of(const step_record_kind& kind) {
  std::uint64_t m;
  std::memcpy(&m, kind.magic, 8);
  return m;
}

// A new file's directory entry made durable (the chunk store does the same for its files).
void sync_directory(const std::string& dir, const step_record_kind& kind) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) fail(errno, "cannot open the directory " + dir);
  const int rc = ::fsync(fd);
  const int error = errno;
  ::close(fd);
  if (rc != 0) fail(error, std::string("cannot make the entry of the file of ") + kind.what + " in " + dir + " durable");
}

} // namespace

std::string step_record_path(const step_record_kind& kind, const std::string& dir) {
  return (std::filesystem::path(dir) / kind.file).string();
}

void write_step_record(const step_record_kind& kind, const std::string& dir, std::uint64_t step,
                       std::uint64_t commit_id, const std::vector<std::uint64_t>& words, bool sync) {
  const std::size_t bytes = place_bytes(kind);
  drive::direct_buffer page_buf = drive::make_direct_buffer(bytes);
  unsigned char* b = reinterpret_cast<unsigned char*>(page_buf.get());
  std::memset(b, 0, bytes);
  std::size_t at = 0;
  auto put = [&](std::uint64_t w) {
    std::memcpy(b + at, &w, 8);
    at += 8;
  };
  for (const std::uint64_t w : {magic_of(kind), kind.version, step, commit_id}) put(w);
  for (std::size_t i = 0; i < kind.words; ++i) put(i < words.size() ? words[i] : 0);
  checksum64 sum;
  sum.add(b, at);
  put(sum.finish());
  const std::string path = step_record_path(kind, dir);
  const bool made = !std::filesystem::exists(path);
  drive::direct_file f = made ? drive::direct_file::create(path, 2 * bytes) : drive::direct_file::open(path);
  if (made && sync) sync_directory(dir, kind);
  const off_t offset = off_t(step % 2) * off_t(bytes);
  std::size_t done = 0;
  while (done < bytes) {
    const ssize_t n = ::pwrite(f.fd(), b + done, bytes - done, offset + off_t(done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0)
      fail(n < 0 ? errno : EIO, std::string("cannot write ") + kind.what + " of step " + std::to_string(step) +
                                    " to " + path);
    done += std::size_t(n);
  }
  if (sync && ::fdatasync(f.fd()) != 0)
    fail(errno, std::string("cannot make ") + kind.what + " of step " + std::to_string(step) + " durable in " + path);
}

std::optional<std::vector<std::uint64_t>> read_step_record(const step_record_kind& kind, const std::string& dir,
                                                           std::uint64_t step, std::uint64_t commit_id,
                                                           std::string& problem) {
  problem.clear();
  const std::string path = step_record_path(kind, dir);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno != ENOENT) problem = path + ": " + std::strerror(errno);
    return std::nullopt;
  }
  std::vector<unsigned char> buf(place_bytes(kind), 0);
  const off_t offset = off_t(step % 2) * off_t(buf.size());
  std::size_t done = 0;
  while (done < buf.size()) {
    const ssize_t n = ::pread(fd, buf.data() + done, buf.size() - done, offset + off_t(done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    done += std::size_t(n);
  }
  ::close(fd);
  const unsigned char* b = buf.data();
  const std::string where = path + ", commit " + std::to_string(step) + ": ";
  const std::size_t values = head_words + kind.words;
  if (done < buf.size() || word_at(b, 0) != magic_of(kind)) {
    problem = where + "no record (never written, or torn)";
    return std::nullopt;
  }
  if (word_at(b, 1) != kind.version) {
    problem = where + "a record of another hostopt version, or a corrupt one (version " +
              std::to_string(word_at(b, 1)) + ")";
    return std::nullopt;
  }
  checksum64 sum;
  sum.add(b, values * 8);
  if (word_at(b, values) != sum.finish()) {
    problem = where + "a corrupt record (its checksum)";
    return std::nullopt;
  }
  if (word_at(b, 2) != step || word_at(b, 3) != commit_id) {
    problem = where + "the record of another commit (" + std::to_string(word_at(b, 2)) + ")";
    return std::nullopt;
  }
  std::vector<std::uint64_t> words(kind.words);
  for (std::size_t i = 0; i < kind.words; ++i) words[i] = word_at(b, head_words + i);
  return words;
}

} // namespace hostopt::detail
