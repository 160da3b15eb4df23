#pragma once
// Chunks of bytes kept on a drive so that after every committed step what is on the drive IS
// that step, verified. Each chunk has two slots: a step writes the slot that does not hold the
// committed state, each slot stamped with (store, chunk, step, checksum of its bytes); then a
// commit record names the step, written last into one of two places (the other keeps the
// previous record). Killed at any moment, the store opens at step t or t-1, bit for bit, never
// a mix (SQLite's and LMDB's rule: never overwrite the only copy; the commit is one small
// write). It knows nothing of what the bytes are: the optimizer's state store builds on it.
//
// Files in its directory: chunks (2 slots per chunk, each a 4 KiB stamp then the chunk's
// bytes), commit (two 4 KiB records), lock (held while open: one process at a time).

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "direct_file.hpp"
#include "io_queue.hpp"

namespace hostopt::drive {

/// What a store holds: `chunks` chunks of `chunk_bytes` each (a multiple of 4 KiB), and the
/// caller's fingerprint of their meaning (a model's layout and formats): a store opened with
/// another shape is refused.
/// A chunk read back whose stamp or checksum is not the committed step's (corrupt, torn,
/// another attempt's or another store's): what open's fallback to the step before answers.
/// I/O errors are std::runtime_error (std::system_error), never this.
class bad_chunk : public std::runtime_error {
public:
  using std::runtime_error::runtime_error;
};

struct store_shape {
  std::uint64_t chunks = 0;
  std::size_t chunk_bytes = 0;
  std::uint64_t fingerprint = 0;
  bool operator==(const store_shape&) const = default;
};

/// sync: each commit is durable (fdatasync of the chunks, then of the record): a power loss
/// keeps it too. none: a killed process keeps every commit (O_DIRECT writes are the drive's
/// once done), a power loss may take the last ones (the store still opens at an earlier step).
enum class durability { sync, none };

class chunk_store {
public:
  static constexpr std::uint64_t no_step = ~std::uint64_t(0);

  /// A new store in the existing directory `dir` (refused where one is; a creation
  /// interrupted before its first commit is made again), space reserved for every slot.
  /// Nothing is committed until the first commit(); a failed create leaves no files.
  static chunk_store create(const std::string& dir, const store_shape& shape, durability d, unsigned depth = 8,
                            io_backend backend = io_backend::automatic);
  /// The store in `dir` at its last committed step, every chunk of it read and verified
  /// first — or, where a chunk of that step is bad (a power loss without durability, a
  /// corrupt slot), at the step before when all of it verifies (fell_back() says so; the
  /// later record is erased). std::runtime_error naming the problem: no store, another
  /// shape, a store open in another process, nothing committed, a chunk whose stamp or
  /// checksum is wrong in both steps.
  /// With `erase_fallback` false the later record of a fallback stays until
  /// erase_fallen_back() (a caller with checks of its own to make first); until then a
  /// later open falls back again.
  static chunk_store open(const std::string& dir, const store_shape& expected, durability d, unsigned depth = 8,
                          io_backend backend = io_backend::automatic, bool erase_fallback = true);

  chunk_store(chunk_store&&) noexcept;
  chunk_store& operator=(chunk_store&&) noexcept;
  ~chunk_store();

  const store_shape& shape() const { return shape_; }
  /// The last committed step (no_step: none yet), and the step writes are for.
  std::uint64_t committed_step() const { return committed_; }
  std::uint64_t next_step() const { return committed_ == no_step ? 0 : committed_ + 1; }
  io_backend backend() const { return queue_->backend(); }
  /// How the checksums of chunks' bytes are computed in parallel: `run(pieces, body)` calls
  /// body(i) once for every i < pieces, from any threads, and returns when all are done. The
  /// sum is the same however it runs (a checksum of the checksums of 1 MiB pieces); the
  /// default runs the pieces in order on the calling thread.
  using parallel_runner = std::function<void(std::size_t pieces, const std::function<void(std::size_t)>& body)>;
  void set_parallel_runner(parallel_runner run) { run_ = std::move(run); }

  /// Pages of the chunks file in the page cache (direct_file::cached_pages: 0 when bypassed).
  std::uint64_t cached_pages() const { return chunks_.cached_pages(); }

  /// One chunk's staging memory: its stamp, then its bytes (payload()), aligned for O_DIRECT.
  class staging {
  public:
    std::byte* payload() const { return memory_.get() + direct_alignment; }

  private:
    friend class chunk_store;
    direct_buffer memory_;
  };
  staging make_staging() const;

  /// Starts reading chunk `chunk` of the committed step into `s` (checked by finish()).
  void start_read(std::uint64_t chunk, staging& s);
  /// Reads chunk `chunk` of the committed step into `s` now, on the calling thread, beside
  /// the requests in flight (which it neither waits for nor finishes: a step's writes go to
  /// the other slots, so it reads the committed bytes whatever the step has written).
  /// Verified as finish() verifies a read; the same errors.
  void read_committed(std::uint64_t chunk, staging& s) const;
  /// Starts writing `s`'s payload as chunk `chunk` of next_step() (stamped now).
  void start_write(std::uint64_t chunk, staging& s);
  /// Waits for at least min(at_least, in flight) started requests; returns their chunks.
  /// std::runtime_error naming the chunk on an I/O error, a short transfer, or a read whose
  /// stamp or checksum is not the committed step's.
  std::vector<std::uint64_t> finish(std::size_t at_least = 1);
  std::size_t in_flight() const { return queue_->in_flight(); }

  /// Refuses (std::runtime_error) when the store's files were removed or replaced while it
  /// was open: commits would go to unlinked files.
  void check_still_there() const;
  /// Why this store refuses to write or commit ("" while it may): a failed commit record.
  const std::string& broken() const { return broken_; }

  /// Waits for every request in flight, dropping their errors (after a failure: their
  /// buffers are the caller's). Where the queue fails outright the store is left broken.
  void drain() noexcept;

  /// Forgets the chunks written for next_step() (after a step that failed midway: a retry
  /// must write every chunk again before it can commit). Nothing may be in flight.
  void forget_writes();

  /// Words the caller keeps with each commit (e.g. its own counters), at most max_words.
  static constexpr std::size_t max_words = 16;
  /// Commits next_step() with the caller's `words`: every chunk written for it and finished,
  /// nothing in flight (std::logic_error naming a missing chunk otherwise, nothing changed).
  void commit(const std::vector<std::uint64_t>& words = {});
  /// Whether the store can go back to the step before the committed one: that step's commit
  /// record there and every chunk of it verified (read and checked); returns that record's
  /// words. Changes nothing on the drive. std::runtime_error naming the problem where it
  /// cannot: the step before stays on the drive only until a later step starts writing over
  /// its slots (a step that failed or was killed midway did), and after a fallback or a
  /// roll-back there is none. Steps are the chunk store's commit numbers.
  std::vector<std::uint64_t> verify_previous();
  /// Goes back to the step before the committed one, for good: verified as verify_previous
  /// (unless that just did it), then the later commit record erased and made durable whatever
  /// the durability (an undone step never comes back); the next step writes over the undone
  /// step's slots under a new attempt's id. Nothing may be in flight or written for
  /// next_step(). A failed erasure leaves this object broken (reopen the store).
  void roll_back();
  /// Erases the record a fallback left (open with erase_fallback false); nothing otherwise.
  void erase_fallen_back();
  /// What open found when the last step could not be opened and it opened the one before
  /// ("" otherwise).
  const std::string& fell_back() const { return fell_back_; }

  /// The words of the committed step (empty before the first commit).
  const std::vector<std::uint64_t>& committed_words() const { return words_; }

  /// What the last commit record of the store in `dir` says (nothing verified, no lock
  /// taken: for a caller that derives the expected shape from it). std::runtime_error as
  /// open() for no store or no committed step.
  struct head {
    store_shape shape;
    std::uint64_t step = 0;
    std::vector<std::uint64_t> words;
  };
  static head peek(const std::string& dir);

private:
  struct request {
    std::uint64_t chunk;
    bool write;
    staging* s;
  };
  chunk_store(std::string dir, const store_shape& shape, durability d, unsigned depth, io_backend backend,
              int lock_fd, direct_file chunks, direct_file commits);
  std::uint64_t slot_offset(std::uint64_t chunk, std::uint64_t step) const;
  void check_stamp(const request& r, std::int64_t result) const;
  void erase_record(std::uint64_t step, bool durable = false);
  struct previous_step; // (the record verify_previous found)
  previous_step find_previous(const char* what);

  std::uint64_t verify_all(); // open's check of every committed chunk
  std::uint64_t payload_sum(const std::byte* p) const;

  std::string dir_;
  store_shape shape_;
  durability durability_;
  int lock_fd_ = -1;
  direct_file chunks_, commits_;
  std::unique_ptr<io_queue> queue_;
  std::uint64_t store_id_ = 0; // the committed step's id (its slots and record carry it)
  std::uint64_t write_id_ = 0; // this attempt's, stamped on what it writes
  std::uint64_t committed_ = no_step;
  std::vector<std::uint64_t> words_;
  std::vector<request> requests_;     // by tag (slot in flight)
  std::vector<std::uint64_t> free_;   // free request tags
  std::vector<bool> written_;         // chunks written for next_step()
  std::uint64_t written_count_ = 0;
  parallel_runner run_;
  std::string broken_;    // why this object refuses to write or commit ("" while it may)
  std::string fell_back_; // open's note when the last step could not be opened
  bool previous_verified_ = false; // verify_previous passed, and nothing was written or committed since
  std::uint64_t fallen_back_from_ = no_step; // a fallback's later record, not erased yet
};

} // namespace hostopt::drive
