// drive/chunk_store: a committed step is what opens, bit for bit, whatever happened since —
// an unfinished step, a corrupt slot or record, another shape, a second opener, and kill -9 at
// random moments of a process stepping it — on every I/O backend this machine has.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "chunk_store.hpp"
#include "temp_dir.hpp"

namespace fs = std::filesystem;
using namespace hostopt::drive;

namespace {

using hostopt_test::temp_dir;

std::vector<io_backend> backends_here() {
  std::vector<io_backend> out{io_backend::threads};
  if (uring_unavailable_reason().empty()) out.push_back(io_backend::uring);
  else WARN("io_uring not tested here: " << uring_unavailable_reason());
  return out;
}

// The bytes of chunk k at step t: every chunk and step differ.
void content(std::byte* p, std::size_t n, std::uint64_t k, std::uint64_t t) {
  std::uint64_t x = (k + 1) * 0x9E3779B97F4A7C15ull ^ (t + 7) * 0xC2B2AE3D27D4EB4Full;
  for (std::size_t i = 0; i < n; i += 8) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    std::memcpy(p + i, &x, 8);
  }
}

// Writes every chunk of next_step() with its content and commits; `depth` buffers in flight.
void write_step(chunk_store& s, std::size_t depth) {
  const std::uint64_t t = s.next_step();
  std::vector<chunk_store::staging> bufs;
  for (std::size_t i = 0; i < depth; ++i) bufs.push_back(s.make_staging());
  for (std::uint64_t k = 0; k < s.shape().chunks; ++k) {
    if (s.in_flight() == depth) s.finish(s.in_flight()); // (then every buffer is free again)
    content(bufs[k % depth].payload(), s.shape().chunk_bytes, k, t);
    s.start_write(k, bufs[k % depth]);
  }
  s.finish(s.in_flight());
  s.commit();
}

// Whether every chunk reads back as step t's content.
bool holds_step(chunk_store& s, std::uint64_t t) {
  auto got = s.make_staging(), want = s.make_staging();
  for (std::uint64_t k = 0; k < s.shape().chunks; ++k) {
    s.start_read(k, got);
    s.finish(1);
    content(want.payload(), s.shape().chunk_bytes, k, t);
    if (std::memcmp(got.payload(), want.payload(), s.shape().chunk_bytes) != 0) return false;
  }
  return true;
}

void flip_byte(const fs::path& file, std::uint64_t offset) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(std::streamoff(offset));
  char c = 0;
  f.read(&c, 1);
  c = char(c ^ 0x40);
  f.seekp(std::streamoff(offset));
  f.write(&c, 1);
}

const store_shape shape{5, 3 * direct_alignment, 0xC0FFEE};
constexpr std::uint64_t slot_bytes = 4 * direct_alignment; // (the stamp's page, then 3 pages of bytes)

} // namespace

TEST_CASE("chunk_store: each commit is what opens, on every backend") {
  for (io_backend backend : backends_here()) {
    INFO("backend " << to_string(backend));
    temp_dir dir{"chunk_store"};
    {
      chunk_store s = chunk_store::create(dir.str(), shape, durability::sync, 3, backend);
      CHECK(s.committed_step() == chunk_store::no_step);
      CHECK(s.next_step() == 0);
      CHECK(s.backend() == backend);
      for (int t = 0; t < 4; ++t) write_step(s, 3);
      CHECK(s.committed_step() == 3);
      CHECK(holds_step(s, 3));
    }
    chunk_store s = chunk_store::open(dir.str(), shape, durability::none, 2, backend);
    CHECK(s.committed_step() == 3);
    CHECK(holds_step(s, 3));
    write_step(s, 1);
    CHECK(holds_step(s, 4));
  }
}

TEST_CASE("chunk_store: an unfinished step is never committed, the one before stays") {
  temp_dir dir{"chunk_store"};
  {
    chunk_store s = chunk_store::create(dir.str(), shape, durability::none);
    write_step(s, 2);
    write_step(s, 2);
    auto b = s.make_staging();
    for (std::uint64_t k : {0, 1, 3}) { // step 2: chunks 2 and 4 never written
      content(b.payload(), shape.chunk_bytes, k, 99);
      s.start_write(k, b);
      s.finish(1);
    }
    CHECK_THROWS_WITH(s.commit(), Catch::Contains("chunk 2 was not written for step 2") &&
                                      Catch::Contains("nothing committed"));
    CHECK(s.committed_step() == 1);
    CHECK(holds_step(s, 1)); // (the committed slots were not the ones written)
    s.start_write(2, b);
    CHECK_THROWS_WITH(s.commit(), Catch::Contains("in flight"));
    s.finish(1);
  }
  chunk_store s = chunk_store::open(dir.str(), shape, durability::none);
  CHECK(s.committed_step() == 1);
  CHECK(holds_step(s, 1));
}

TEST_CASE("chunk_store: a fallback whose erasure is deferred never erases a later commit") {
  // open(erase_fallback = false) keeps the bad commit's record until erase_fallen_back(); a
  // commit made first takes that record's place, and the erasure then leaves it alone.
  temp_dir dir{"chunk_store"};
  {
    chunk_store s = chunk_store::create(dir.str(), shape, durability::none);
    for (int t = 0; t < 3; ++t) write_step(s, 4); // (step 2's slots: slot 0)
  }
  flip_byte(dir.path / "chunks", (2 * 3 + 0) * slot_bytes + direct_alignment + 77); // step 2's chunk 3
  {
    chunk_store s = chunk_store::open(dir.str(), shape, durability::none, 8, io_backend::automatic, false);
    CHECK(s.committed_step() == 1);
    CHECK_THAT(s.fell_back(), Catch::Contains("commit 2 could not be opened"));
  }
  { // not erased: the next open falls back again, and erases it
    chunk_store s = chunk_store::open(dir.str(), shape, durability::none, 8, io_backend::automatic, false);
    CHECK_FALSE(s.fell_back().empty());
    s.erase_fallen_back();
  }
  {
    chunk_store s = chunk_store::open(dir.str(), shape, durability::none, 8, io_backend::automatic, false);
    CHECK(s.committed_step() == 1);
    CHECK(s.fell_back().empty());
    write_step(s, 4); // a new step 2
  }
  flip_byte(dir.path / "chunks", (2 * 3 + 0) * slot_bytes + direct_alignment + 77); // that one's chunk 3 bad too
  flip_byte(dir.path / "chunks", (2 * 3 + 0) * slot_bytes + direct_alignment + 77); // (and repaired)
  {
    chunk_store s = chunk_store::open(dir.str(), shape, durability::none);
    CHECK(s.committed_step() == 2);
    CHECK(holds_step(s, 2));
  }
  // Deferred, then a commit, then the erasure: the new commit stays.
  flip_byte(dir.path / "chunks", (2 * 3 + 0) * slot_bytes + direct_alignment + 77);
  {
    chunk_store s = chunk_store::open(dir.str(), shape, durability::none, 8, io_backend::automatic, false);
    REQUIRE(s.committed_step() == 1);
    write_step(s, 4);
    s.erase_fallen_back();
  }
  chunk_store s = chunk_store::open(dir.str(), shape, durability::none);
  CHECK(s.committed_step() == 2);
  CHECK(s.fell_back().empty());
  CHECK(holds_step(s, 2));
}

TEST_CASE("chunk_store: corruption, another shape, a second opener and misuse are refused by name") {
  temp_dir dir{"chunk_store"};
  { // (steps 0..2 committed: step 2's slots are slot 0, step 1's slot 1)
    chunk_store s = chunk_store::create(dir.str(), shape, durability::sync);
    for (int t = 0; t < 3; ++t) write_step(s, 4);
    CHECK_THROWS_WITH(chunk_store::open(dir.str(), shape, durability::none), Catch::Contains("open elsewhere"));
    CHECK_THROWS_WITH(chunk_store::create(dir.str(), shape, durability::none), Catch::Contains("open elsewhere"));
    auto b = s.make_staging();
    CHECK_THROWS_AS(s.start_read(5, b), std::out_of_range);
    CHECK(s.in_flight() == 0);
  }
  CHECK_THROWS_WITH(chunk_store::create(dir.str(), shape, durability::none), Catch::Contains("a store exists"));
  CHECK_THROWS_WITH(chunk_store::open(dir.str(), store_shape{5, 3 * direct_alignment, 1}, durability::none),
                    Catch::Contains("another model, layout or format") && Catch::Contains("fingerprint 12648430"));
  CHECK_THROWS_WITH(chunk_store::open(dir.str(), store_shape{6, 3 * direct_alignment, 0xC0FFEE}, durability::none),
                    Catch::Contains("5 chunks of 12288 bytes"));
  CHECK_THROWS_WITH(chunk_store::open((dir.path / "nothing").string(), shape, durability::none),
                    Catch::Contains("no store in"));
  CHECK_THROWS_AS(chunk_store::create(dir.str(), store_shape{1, 1000, 0}, durability::none), std::invalid_argument);
  // A byte of chunk 3 flipped in both its slots (step 2: slot 0, step 1: slot 1): refused at
  // open, named, with the step before it.
  const std::uint64_t chunk3_slot0 = (2 * 3 + 0) * slot_bytes, chunk3_slot1 = (2 * 3 + 1) * slot_bytes;
  for (const std::uint64_t at : {chunk3_slot0, chunk3_slot1}) flip_byte(dir.path / "chunks", at + direct_alignment + 77);
  CHECK_THROWS_WITH(chunk_store::open(dir.str(), shape, durability::none),
                    Catch::Contains("chunk 3 of the store") && Catch::Contains("checksum") &&
                        Catch::Contains("the step before it cannot be opened either"));
  for (const std::uint64_t at : {chunk3_slot0, chunk3_slot1}) flip_byte(dir.path / "chunks", at + direct_alignment + 77);
  // Its stamps flipped: refused too.
  for (const std::uint64_t at : {chunk3_slot0, chunk3_slot1}) flip_byte(dir.path / "chunks", at + 20);
  CHECK_THROWS_WITH(chunk_store::open(dir.str(), shape, durability::none), Catch::Contains("chunk 3 of the store"));
  for (const std::uint64_t at : {chunk3_slot0, chunk3_slot1}) flip_byte(dir.path / "chunks", at + 20);
  // Step 2's commit record torn: the store opens at step 1, whose slots step 2 never wrote.
  flip_byte(dir.path / "commit", 0 * direct_alignment + 30);
  {
    chunk_store s = chunk_store::open(dir.str(), shape, durability::none);
    CHECK(s.committed_step() == 1);
    CHECK(s.fell_back().empty());
    CHECK(holds_step(s, 1));
  }
  flip_byte(dir.path / "commit", 0 * direct_alignment + 30);
  // Step 2's chunk 3 bad alone (a power loss took a write its record outlived): the store
  // opens at step 1 and says so; step 2's record is erased, so it never comes back.
  flip_byte(dir.path / "chunks", chunk3_slot0 + direct_alignment + 77);
  {
    chunk_store s = chunk_store::open(dir.str(), shape, durability::none);
    CHECK(s.committed_step() == 1);
    CHECK_THAT(s.fell_back(), Catch::Contains("commit 2 could not be opened") && Catch::Contains("chunk 3"));
    CHECK(holds_step(s, 1));
  }
  flip_byte(dir.path / "chunks", chunk3_slot0 + direct_alignment + 77);
  {
    chunk_store s = chunk_store::open(dir.str(), shape, durability::none);
    CHECK(s.committed_step() == 1);
    CHECK(s.fell_back().empty());
  }
  flip_byte(dir.path / "commit", 1 * direct_alignment + 30); // both records gone
  CHECK_THROWS_WITH(chunk_store::open(dir.str(), shape, durability::none), Catch::Contains("no committed step"));
  flip_byte(dir.path / "commit", 1 * direct_alignment + 30);
  // A truncated chunks file.
  fs::resize_file(dir.path / "chunks", 7 * slot_bytes);
  CHECK_THROWS_WITH(chunk_store::open(dir.str(), shape, durability::none), Catch::Contains("truncated"));
}

TEST_CASE("chunk_store: kill -9 at random moments of a stepping process leaves step t or t-1, bit for bit") {
  // The assertion holds whenever the kill lands (before the first commit, in a write, between
  // the writes and the record, in the record): the random delays only spread where it lands.
  std::mt19937 rng(2026);
  int opened_at_a_step = 0;
  for (int round = 0; round < 24; ++round) {
    temp_dir dir{"chunk_store"};
    int told[2];
    REQUIRE(::pipe(told) == 0);
    const pid_t child = ::fork();
    REQUIRE(child >= 0);
    if (child == 0) { // step forever, telling each committed step, until killed
      ::close(told[0]);
      try {
        chunk_store s = chunk_store::create(dir.str(), shape, round % 2 ? durability::sync : durability::none, 4);
        for (;;) {
          write_step(s, 4);
          const std::uint64_t t = s.committed_step();
          if (::write(told[1], &t, sizeof t) != ssize_t(sizeof t)) ::_exit(4);
        }
      } catch (...) {
        ::_exit(3);
      }
    }
    ::close(told[1]);
    std::this_thread::sleep_for(std::chrono::microseconds(rng() % 30000));
    ::kill(child, SIGKILL);
    int status = 0;
    ::waitpid(child, &status, 0);
    REQUIRE(WIFSIGNALED(status)); // (not an error exit of the child)
    // The last step it told committed: t - 1, t being the step it was in when killed (its
    // commit may have landed before it could tell).
    std::uint64_t last = chunk_store::no_step, t = 0;
    while (::read(told[0], &t, sizeof t) == ssize_t(sizeof t)) last = t;
    ::close(told[0]);
    const std::uint64_t in_progress = last == chunk_store::no_step ? 0 : last + 1;
    try {
      chunk_store s = chunk_store::open(dir.str(), shape, durability::none);
      INFO("round " << round << ": told " << last << ", opened at step " << s.committed_step());
      CHECK((s.committed_step() == in_progress || s.committed_step() == last));
      CHECK(holds_step(s, s.committed_step()));
      ++opened_at_a_step;
    } catch (const std::runtime_error& e) { // killed before its first commit (or before the files existed)
      const std::string what = e.what();
      INFO("round " << round << ": " << what);
      CHECK(last == chunk_store::no_step);
      CHECK((what.find("no committed step") != std::string::npos || what.find("no store") != std::string::npos));
    }
  }
  WARN(opened_at_a_step << " of 24 kills left a committed step (the others landed before the first commit)");
}
