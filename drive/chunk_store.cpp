#include "chunk_store.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <stdexcept>
#include <system_error>
#include <utility>

#include "checksum.hpp"

namespace hostopt::drive {

namespace {

namespace fs = std::filesystem;
constexpr std::uint32_t format_version = 2; // 2: commit records carry the caller's words; sums of 1 MiB pieces
constexpr char slot_magic[8] = {'H', 'O', 'S', 'T', 'O', 'P', 'T', 'C'};
constexpr char record_magic[8] = {'H', 'O', 'S', 'T', 'O', 'P', 'T', 'R'};

// The first bytes of each slot: whose chunk of which step it holds, and the checksum of its bytes.
struct slot_stamp {
  char magic[8];
  std::uint32_t version, unused;
  std::uint64_t store_id, chunk, step, bytes, payload_sum, stamp_sum; // stamp_sum: of the fields before it
};
// A commit record (two places in the commit file: step % 2).
struct commit_record {
  char magic[8];
  std::uint32_t version, unused;
  std::uint64_t store_id, step, chunks, chunk_bytes, fingerprint, num_words;
  std::uint64_t words[chunk_store::max_words];
  std::uint64_t record_sum; // of the fields before it
};

std::uint64_t sum_of(const void* p, std::size_t n) {
  hostopt::detail::checksum64 c;
  c.add(p, n);
  return c.finish();
}

[[noreturn]] void fail_errno(int error, const std::string& what) {
  throw std::system_error(error, std::generic_category(), what);
}

int lock_store(const std::string& dir) {
  const std::string path = (fs::path(dir) / "lock").string();
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) fail_errno(errno, "cannot open the store's lock file " + path);
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int error = errno;
    ::close(fd);
    if (error == EWOULDBLOCK)
      throw std::runtime_error("the store in " + dir + " is open elsewhere (its lock file is held): one process, "
                               "one optimizer at a time");
    fail_errno(error, "cannot lock " + path);
  }
  return fd;
}

std::string shape_text(const store_shape& s) {
  return std::to_string(s.chunks) + " chunks of " + std::to_string(s.chunk_bytes) + " bytes, fingerprint " +
         std::to_string(s.fingerprint);
}

// Whether the commit file in `dir` holds anything but zeros (a creation interrupted before its
// first commit leaves zeros, or a short file).
bool ever_committed(const std::string& dir) {
  std::ifstream f(fs::path(dir) / "commit", std::ios::binary);
  char c;
  while (f.get(c))
    if (c != 0) return true;
  return false;
}

// The id stamped on the slots and record of one attempt at a step: fresh for every attempt,
// so that slots an abandoned attempt (or an erased commit) left behind never verify as another
// attempt's, even where a power loss drops some of the later attempt's writes.
std::uint64_t fresh_id() {
  std::random_device rd;
  return (std::uint64_t(rd()) << 32) ^ rd();
}

std::size_t slot_bytes_of(const store_shape& s) { return direct_alignment + s.chunk_bytes; }

void check_shape(const store_shape& s) {
  if (s.chunks == 0 || s.chunk_bytes == 0 || s.chunk_bytes % direct_alignment != 0)
    throw std::invalid_argument("chunk_store: " + shape_text(s) + ": expected at least one chunk of a positive "
                                "multiple of 4096 bytes");
}

} // namespace

chunk_store::chunk_store(std::string dir, const store_shape& shape, durability d, unsigned depth, io_backend backend,
                         int lock_fd, direct_file chunks, direct_file commits)
    : dir_(std::move(dir)), shape_(shape), durability_(d), lock_fd_(lock_fd), chunks_(std::move(chunks)),
      commits_(std::move(commits)), queue_(make_io_queue(depth, backend)), requests_(depth), written_(shape.chunks) {
  for (unsigned i = 0; i < depth; ++i) free_.push_back(depth - 1 - i);
}

chunk_store::chunk_store(chunk_store&& o) noexcept
    : dir_(std::move(o.dir_)), shape_(o.shape_), durability_(o.durability_), lock_fd_(std::exchange(o.lock_fd_, -1)),
      chunks_(std::move(o.chunks_)), commits_(std::move(o.commits_)), queue_(std::move(o.queue_)),
      store_id_(o.store_id_), write_id_(o.write_id_), committed_(o.committed_), words_(std::move(o.words_)), requests_(std::move(o.requests_)), free_(std::move(o.free_)),
      written_(std::move(o.written_)), written_count_(o.written_count_), run_(std::move(o.run_)),
      broken_(std::move(o.broken_)), fell_back_(std::move(o.fell_back_)), previous_verified_(o.previous_verified_),
      fallen_back_from_(o.fallen_back_from_) {}

chunk_store& chunk_store::operator=(chunk_store&& o) noexcept {
  if (this != &o) {
    this->~chunk_store();
    new (this) chunk_store(std::move(o));
  }
  return *this;
}

chunk_store::~chunk_store() {
  queue_.reset(); // (waits for requests in flight: their buffers are the caller's)
  if (lock_fd_ >= 0) ::close(lock_fd_);
}

chunk_store chunk_store::create(const std::string& dir, const store_shape& shape, durability d, unsigned depth,
                                io_backend backend) {
  check_shape(shape);
  if (!fs::is_directory(dir)) throw std::runtime_error("cannot make a store in " + dir + ": not a directory");
  const int lock_fd = lock_store(dir);
  bool made = false;
  try {
    if (fs::exists(fs::path(dir) / "commit") && ever_committed(dir))
      throw std::runtime_error("a store exists in " + dir + " (its commit file): open it, or remove its files first");
    // (a store whose creation was interrupted, never committed, is made again)
    made = true;
    const std::uint64_t bytes = shape.chunks * 2 * slot_bytes_of(shape);
    direct_file chunks = direct_file::create((fs::path(dir) / "chunks").string(), bytes);
    direct_file commits = direct_file::create((fs::path(dir) / "commit").string(), 2 * direct_alignment);
    const std::uint64_t id = fresh_id();
    chunk_store s(dir, shape, d, depth, backend, lock_fd, std::move(chunks), std::move(commits));
    s.store_id_ = s.write_id_ = id;
    return s;
  } catch (...) {
    if (made) { // nothing half-made is left for the next create or open to trip on
      std::error_code ignored;
      fs::remove(fs::path(dir) / "commit", ignored);
      fs::remove(fs::path(dir) / "chunks", ignored);
    }
    ::close(lock_fd);
    throw;
  }
}

namespace {

// The commit record of the highest step whose checksum holds (the other is the step before,
// or a record torn by a crash while it was written), or of step `*at` when given.
commit_record last_record(const std::string& dir, int fd, const std::uint64_t* at = nullptr) {
  direct_buffer buf = make_direct_buffer(2 * direct_alignment);
  const ssize_t got = ::pread(fd, buf.get(), 2 * direct_alignment, 0);
  if (got < 0) fail_errno(errno, "cannot read the commit file of the store in " + dir);
  if (got != ssize_t(2 * direct_alignment)) // (created, and killed before it was sized)
    throw std::runtime_error("the store in " + dir + " holds no committed step (its commit file has " +
                             std::to_string(got) + " bytes: its creation was interrupted, or it was truncated)");
  const commit_record* best = nullptr;
  commit_record records[2];
  for (int i = 0; i < 2; ++i) {
    std::memcpy(&records[i], buf.get() + i * direct_alignment, sizeof(commit_record));
    const commit_record& r = records[i];
    if (std::memcmp(r.magic, record_magic, 8) != 0 || r.version != format_version ||
        r.record_sum != sum_of(&r, offsetof(commit_record, record_sum)) || r.step % 2 != std::uint64_t(i) ||
        r.num_words > chunk_store::max_words)
      continue;
    if (at != nullptr ? r.step == *at : (best == nullptr || r.step > best->step)) best = &r;
  }
  if (best == nullptr && at != nullptr)
    throw std::runtime_error("the store in " + dir + " holds no commit of step " + std::to_string(*at) +
                             " (the stores striped with it are at that step: another run's store?)");
  if (best == nullptr)
    throw std::runtime_error("the store in " + dir + " holds no committed step (its commit records are empty or "
                             "corrupt, or of another version of hostopt)");
  return *best;
}

std::vector<std::uint64_t> words_of(const commit_record& r) { return {r.words, r.words + r.num_words}; }


} // namespace

chunk_store::head chunk_store::peek(const std::string& dir) {
  if (!fs::exists(fs::path(dir) / "commit")) throw std::runtime_error("no store in " + dir + " (no commit file)");
  direct_file commits = direct_file::open((fs::path(dir) / "commit").string());
  const commit_record r = last_record(dir, commits.fd());
  return {store_shape{r.chunks, r.chunk_bytes, r.fingerprint}, r.step, words_of(r)};
}

chunk_store chunk_store::open(const std::string& dir, const store_shape& expected, durability d, unsigned depth,
                              io_backend backend, bool erase_fallback) {
  check_shape(expected);
  if (!fs::exists(fs::path(dir) / "commit")) throw std::runtime_error("no store in " + dir + " (no commit file)");
  const int lock_fd = lock_store(dir);
  bool owned = false;
  try {
    direct_file commits = direct_file::open((fs::path(dir) / "commit").string());
    direct_file chunks = direct_file::open((fs::path(dir) / "chunks").string());
    const commit_record best = last_record(dir, commits.fd());
    const store_shape saved{best.chunks, best.chunk_bytes, best.fingerprint};
    const std::uint64_t before = best.step - 1; // (the step whose slots a failed verification falls back to)
    if (!(saved == expected))
      throw std::runtime_error("the store in " + dir + " holds " + shape_text(saved) + ", not " +
                               shape_text(expected) + " (another model, layout or format)");
    const std::uint64_t bytes = expected.chunks * 2 * slot_bytes_of(expected);
    if (chunks.size() != bytes)
      throw std::runtime_error("the store in " + dir + ": its chunks file has " + std::to_string(chunks.size()) +
                               " bytes, expected " + std::to_string(bytes) + " (truncated?)");
    chunk_store s(dir, expected, d, depth, backend, lock_fd, std::move(chunks), std::move(commits));
    owned = true; // (s closes the lock from here)
    s.store_id_ = best.store_id;
    s.write_id_ = fresh_id();
    s.committed_ = best.step;
    s.words_ = words_of(best);
    try {
      s.verify_all();
    } catch (const bad_chunk& newest) {
      // A chunk of the last step is bad (a power loss without fdatasync took writes the record
      // outlived, or the drive rotted it): the step before, whose slots that step never
      // touched, when its record and every chunk of it verify.
      if (best.step == 0) throw;
      commit_record older{};
      try {
        older = last_record(dir, s.commits_.fd(), &before);
      } catch (const std::runtime_error&) {
        throw newest;
      }
      s.committed_ = older.step;
      s.store_id_ = older.store_id;
      s.words_ = words_of(older);
      try {
        s.verify_all();
      } catch (const std::runtime_error& e) {
        throw std::runtime_error(std::string(newest.what()) + "; the step before it cannot be opened either: " +
                                 e.what());
      }
      s.fell_back_ = std::string("commit ") + std::to_string(best.step) + " could not be opened (" + newest.what() +
                     "): opened at commit " + std::to_string(older.step);
      if (erase_fallback) s.erase_record(best.step);
      else s.fallen_back_from_ = best.step;
      return s;
    }
    return s;
  } catch (...) {
    if (!owned) ::close(lock_fd);
    throw;
  }
}

struct chunk_store::previous_step {
  commit_record record;
};

// The record of the step before the committed one, every chunk of it verified; this object
// is left as it was.
chunk_store::previous_step chunk_store::find_previous(const char* what) {
  if (in_flight() || written_count_)
    throw std::logic_error(std::string("chunk_store::") + what + ": requests in flight or chunks written for the next step");
  if (!broken_.empty()) throw std::runtime_error(broken_);
  if (committed_ == no_step || committed_ == 0)
    throw std::runtime_error("the store in " + dir_ + " stands at the commit it was created with: there is no "
                             "step before it to go back to");
  const std::uint64_t before = committed_ - 1;
  const std::string cannot = "the store in " + dir_ + " cannot go back to its commit " + std::to_string(before) +
                             " (the one before its last, " + std::to_string(committed_) + "): ";
  previous_step found;
  try {
    found.record = last_record(dir_, commits_.fd(), &before);
  } catch (const std::runtime_error&) {
    throw std::runtime_error(cannot + "its commit record is gone (after going back a step, or after a fallback, a "
                                      "store holds only the step it stands at)");
  }
  if (!(store_shape{found.record.chunks, found.record.chunk_bytes, found.record.fingerprint} == shape_))
    throw std::runtime_error(cannot + "its record holds another shape than the store's (a corrupt record)");
  const std::uint64_t later = committed_, later_id = store_id_;
  const std::vector<std::uint64_t> later_words = words_;
  committed_ = found.record.step;
  store_id_ = found.record.store_id;
  words_ = words_of(found.record);
  try {
    verify_all();
  } catch (const std::runtime_error& e) {
    committed_ = later;
    store_id_ = later_id;
    words_ = later_words;
    throw std::runtime_error(cannot + e.what() +
                             " (corrupt, or written over by a step that failed or was killed midway)");
  }
  committed_ = later;
  store_id_ = later_id;
  words_ = later_words;
  return found;
}

void chunk_store::erase_fallen_back() {
  if (fallen_back_from_ == no_step) return;
  erase_record(fallen_back_from_);
  fallen_back_from_ = no_step;
}

std::vector<std::uint64_t> chunk_store::verify_previous() {
  const previous_step p = find_previous("verify_previous");
  previous_verified_ = true;
  return words_of(p.record);
}

void chunk_store::roll_back() {
  commit_record older{};
  if (previous_verified_ && !in_flight() && !written_count_ && broken_.empty() && committed_ != no_step &&
      committed_ > 0) {
    const std::uint64_t before = committed_ - 1;
    older = last_record(dir_, commits_.fd(), &before); // (verified just now: only its words are needed)
  } else {
    older = find_previous("roll_back").record;
  }
  const std::uint64_t later = committed_;
  committed_ = older.step;
  store_id_ = older.store_id;
  words_ = words_of(older);
  write_id_ = fresh_id(); // (never the id of anything this object wrote before)
  previous_verified_ = false;
  try {
    erase_record(later, true);
  } catch (const std::exception& e) {
    broken_ = std::string("going back a step failed (") + e.what() + "): the store holds commit " +
              std::to_string(later) + " or " + std::to_string(older.step) + "; reopen it to go on";
    throw;
  }
}

std::uint64_t chunk_store::verify_all() {
  // Every committed chunk read and checked (finish() checks each read), depth at a time: a
  // buffer is given to the next read only once its own read has finished.
  std::vector<staging> bufs(queue_->depth());
  std::vector<std::size_t> free_bufs, buf_of(shape_.chunks);
  for (std::size_t i = 0; i < bufs.size(); ++i) {
    bufs[i] = make_staging();
    free_bufs.push_back(i);
  }
  auto settle = [&](std::size_t at_least) {
    for (std::uint64_t k : finish(at_least)) free_bufs.push_back(buf_of[k]);
  };
  try {
    for (std::uint64_t k = 0; k < shape_.chunks; ++k) {
      if (free_bufs.empty()) settle(1);
      buf_of[k] = free_bufs.back();
      free_bufs.pop_back();
      start_read(k, bufs[buf_of[k]]);
    }
    settle(in_flight());
  } catch (...) {
    drain(); // the reads still in flight land in bufs: they must finish before bufs go
    if (in_flight() != 0)
      for (staging& b : bufs) (void)b.memory_.release(); // (a failed queue: leaked, never freed under I/O)
    throw;
  }
  return shape_.chunks;
}

std::uint64_t chunk_store::payload_sum(const std::byte* p) const {
  // Pieces of 1 MiB, summed where the runner puts them, then the sum of their sums: the same
  // bits whatever the threads.
  constexpr std::size_t piece = std::size_t(1) << 20;
  const std::size_t n = shape_.chunk_bytes, pieces = (n + piece - 1) / piece;
  std::vector<std::uint64_t> sums(pieces);
  auto body = [&](std::size_t i) { sums[i] = sum_of(p + i * piece, std::min(piece, n - i * piece)); };
  if (run_) run_(pieces, body);
  else
    for (std::size_t i = 0; i < pieces; ++i) body(i);
  return sum_of(sums.data(), pieces * sizeof(std::uint64_t));
}

chunk_store::staging chunk_store::make_staging() const {
  staging s;
  s.memory_ = make_direct_buffer(slot_bytes_of(shape_));
  return s;
}

std::uint64_t chunk_store::slot_offset(std::uint64_t chunk, std::uint64_t step) const {
  return (2 * chunk + step % 2) * slot_bytes_of(shape_);
}

void chunk_store::start_read(std::uint64_t chunk, staging& s) {
  if (chunk >= shape_.chunks) throw std::out_of_range("chunk_store: chunk " + std::to_string(chunk) + " of " +
                                                      std::to_string(shape_.chunks));
  if (committed_ == no_step) throw std::logic_error("chunk_store: nothing committed yet to read");
  if (free_.empty()) throw std::logic_error("chunk_store: the queue is full (finish some first)");
  const std::uint64_t tag = free_.back();
  queue_->submit({chunks_.fd(), false, s.memory_.get(), slot_bytes_of(shape_), slot_offset(chunk, committed_), tag});
  free_.pop_back();
  requests_[tag] = {chunk, false, &s};
}

void chunk_store::read_committed(std::uint64_t chunk, staging& s) const {
  if (chunk >= shape_.chunks) throw std::out_of_range("chunk_store: chunk " + std::to_string(chunk) + " of " +
                                                      std::to_string(shape_.chunks));
  if (committed_ == no_step) throw std::logic_error("chunk_store: nothing committed yet to read");
  const request r{chunk, false, &s};
  check_stamp(r, transfer_now({chunks_.fd(), false, s.memory_.get(), slot_bytes_of(shape_),
                               slot_offset(chunk, committed_), 0}));
}

void chunk_store::check_still_there() const {
  // The directory removed or replaced under a live store: commits would go to unlinked files.
  struct stat by_path{}, by_fd{};
  const std::string path = (fs::path(dir_) / "commit").string();
  if (::stat(path.c_str(), &by_path) != 0 || ::fstat(commits_.fd(), &by_fd) != 0 || by_path.st_ino != by_fd.st_ino ||
      by_path.st_dev != by_fd.st_dev)
    throw std::runtime_error("the store's files in " + dir_ + " were removed or replaced while it was open: nothing "
                             "more is committed there");
}

void chunk_store::start_write(std::uint64_t chunk, staging& s) {
  if (!broken_.empty()) throw std::runtime_error(broken_);
  previous_verified_ = false;          // (this write goes over the previous step's slot)
  fallen_back_from_ = no_step;         // (the next commit takes that record's place)
  if (chunk >= shape_.chunks) throw std::out_of_range("chunk_store: chunk " + std::to_string(chunk) + " of " +
                                                      std::to_string(shape_.chunks));
  if (free_.empty()) throw std::logic_error("chunk_store: the queue is full (finish some first)");
  slot_stamp st{};
  std::memcpy(st.magic, slot_magic, 8);
  st.version = format_version;
  st.store_id = write_id_;
  st.chunk = chunk;
  st.step = next_step();
  st.bytes = shape_.chunk_bytes;
  st.payload_sum = payload_sum(s.payload());
  st.stamp_sum = sum_of(&st, offsetof(slot_stamp, stamp_sum));
  std::memset(s.memory_.get(), 0, direct_alignment);
  std::memcpy(s.memory_.get(), &st, sizeof st);
  const std::uint64_t tag = free_.back();
  queue_->submit({chunks_.fd(), true, s.memory_.get(), slot_bytes_of(shape_), slot_offset(chunk, next_step()), tag});
  free_.pop_back();
  requests_[tag] = {chunk, true, &s};
}

void chunk_store::check_stamp(const request& r, std::int64_t result) const {
  const std::string where = "chunk " + std::to_string(r.chunk) + " of the store in " + dir_;
  if (result < 0)
    throw std::runtime_error(std::string(r.write ? "cannot write " : "cannot read ") + where + ": " +
                             std::strerror(static_cast<int>(-result)));
  if (std::uint64_t(result) != slot_bytes_of(shape_))
    throw std::runtime_error("a short " + std::string(r.write ? "write of " : "read of ") + where + " (" +
                             std::to_string(result) + " of " + std::to_string(slot_bytes_of(shape_)) + " bytes)");
  if (r.write) return;
  slot_stamp st{};
  std::memcpy(&st, r.s->memory_.get(), sizeof st);
  if (std::memcmp(st.magic, slot_magic, 8) != 0 || st.version != format_version ||
      st.stamp_sum != sum_of(&st, offsetof(slot_stamp, stamp_sum)))
    throw bad_chunk(where + ": its slot for step " + std::to_string(committed_) + " has no valid stamp "
                             "(corrupt, or never written)");
  if (st.store_id != store_id_ || st.chunk != r.chunk || st.step != committed_ || st.bytes != shape_.chunk_bytes)
    throw bad_chunk(where + ": its slot holds chunk " + std::to_string(st.chunk) + " of step " +
                             std::to_string(st.step) + ", expected step " + std::to_string(committed_) +
                             " (a torn or foreign slot)");
  if (st.payload_sum != payload_sum(r.s->payload()))
    throw bad_chunk(where + ": its bytes for step " + std::to_string(committed_) + " fail their checksum "
                             "(corrupt)");
}

std::vector<std::uint64_t> chunk_store::finish(std::size_t at_least) {
  std::vector<std::uint64_t> done;
  const auto completions = queue_->wait(at_least);
  std::string error;
  bool bad = false; // the first error is a chunk that does not verify (not an I/O error)
  for (const auto& c : completions) { // (every completion's tag freed, even past an error)
    const request r = requests_[c.tag];
    free_.push_back(c.tag);
    try {
      check_stamp(r, c.result);
    } catch (const std::exception& e) {
      if (error.empty()) {
        error = e.what();
        bad = dynamic_cast<const bad_chunk*>(&e) != nullptr;
      }
      continue;
    }
    if (r.write && !written_[r.chunk]) {
      written_[r.chunk] = true;
      ++written_count_;
    }
    done.push_back(r.chunk);
  }
  if (bad) throw bad_chunk(error);
  if (!error.empty()) throw std::runtime_error(error);
  return done;
}

void chunk_store::erase_record(std::uint64_t step, bool durable) {
  direct_buffer page = make_direct_buffer(direct_alignment); // zeros: no magic, no valid record
  const off_t at = off_t(step % 2) * off_t(direct_alignment);
  ssize_t n;
  do n = ::pwrite(commits_.fd(), page.get(), direct_alignment, at);
  while (n < 0 && errno == EINTR);
  if (n != ssize_t(direct_alignment))
    fail_errno(n < 0 ? errno : EIO, "cannot erase the commit record of step " + std::to_string(step) + " in " + dir_);
  if ((durable || durability_ == durability::sync) && ::fdatasync(commits_.fd()) != 0)
    fail_errno(errno, "cannot make the erasure of step " + std::to_string(step) + "'s commit durable in " + dir_);
}

void chunk_store::drain() noexcept {
  while (in_flight()) {
    const std::size_t before = in_flight();
    try {
      finish(in_flight());
    } catch (...) {
    }
    if (in_flight() == before) { // the queue itself fails: give up on it rather than spin
      broken_ = "the I/O queue of the store in " + dir_ + " failed with requests in flight: reopen the store";
      return;
    }
  }
}

void chunk_store::forget_writes() {
  if (in_flight() != 0)
    throw std::logic_error("chunk_store::forget_writes: " + std::to_string(in_flight()) + " requests still in flight");
  written_.assign(shape_.chunks, false);
  written_count_ = 0;
  write_id_ = fresh_id(); // (the abandoned attempt's slots can never pass for the next one's)
}

void chunk_store::commit(const std::vector<std::uint64_t>& words) {
  if (words.size() > max_words)
    throw std::invalid_argument("chunk_store::commit: " + std::to_string(words.size()) + " words, at most " +
                                std::to_string(max_words));
  if (in_flight() != 0)
    throw std::logic_error("chunk_store::commit: " + std::to_string(in_flight()) + " requests still in flight");
  if (written_count_ != shape_.chunks) {
    std::uint64_t missing = 0;
    while (written_[missing]) ++missing;
    throw std::logic_error("chunk_store::commit: chunk " + std::to_string(missing) + " was not written for step " +
                           std::to_string(next_step()) + " (" + std::to_string(written_count_) + " of " +
                           std::to_string(shape_.chunks) + " were); nothing committed");
  }
  if (!broken_.empty()) throw std::runtime_error(broken_);
  check_still_there();
  const std::uint64_t step = next_step();
  if (durability_ == durability::sync && ::fdatasync(chunks_.fd()) != 0)
    fail_errno(errno, "cannot make the chunks of step " + std::to_string(step) + " durable in " + dir_);
  commit_record r{};
  std::memcpy(r.magic, record_magic, 8);
  r.version = format_version;
  r.store_id = write_id_;
  r.step = step;
  r.chunks = shape_.chunks;
  r.chunk_bytes = shape_.chunk_bytes;
  r.fingerprint = shape_.fingerprint;
  r.num_words = words.size();
  std::copy(words.begin(), words.end(), r.words);
  r.record_sum = sum_of(&r, offsetof(commit_record, record_sum));
  direct_buffer page = make_direct_buffer(direct_alignment);
  std::memcpy(page.get(), &r, sizeof r);
  const off_t at = off_t(step % 2) * off_t(direct_alignment);
  // From here the record may be on the drive whatever the calls report: a failure leaves the
  // store broken (this object refuses to go on: a retry would rewrite slots that a landed
  // record names); reopening finds the step it holds.
  ssize_t n;
  do n = ::pwrite(commits_.fd(), page.get(), direct_alignment, at);
  while (n < 0 && errno == EINTR);
  int error = n == ssize_t(direct_alignment) ? 0 : (n < 0 ? errno : EIO);
  if (!error && durability_ == durability::sync && ::fdatasync(commits_.fd()) != 0) error = errno;
  if (error) {
    broken_ = "the store in " + dir_ + " failed while committing step " + std::to_string(step) + " (" +
              std::strerror(error) + "): whether that step is on the drive is unknown until the store is reopened";
    throw std::runtime_error(broken_);
  }
  committed_ = step;
  previous_verified_ = false;
  fallen_back_from_ = no_step; // (its record's place now holds this commit)
  store_id_ = write_id_;
  write_id_ = fresh_id();
  words_ = words;
  written_.assign(shape_.chunks, false);
  written_count_ = 0;
}

} // namespace hostopt::drive
