// hostopt_drive: O_DIRECT files and the queue of reads and writes in flight, on every backend
// this machine has (the thread pool always; io_uring where the kernel allows it).
#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <random>
#include <set>
#include <system_error>

#include "direct_file.hpp"
#include "temp_dir.hpp"
#include "io_queue.hpp"

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

bool honours_o_direct(const fs::path& dir) { // tmpfs caches whatever O_DIRECT asks
  struct statfs st {};
  return ::statfs(dir.c_str(), &st) == 0 && st.f_type != 0x01021994; // TMPFS_MAGIC
}

void fill(std::byte* p, std::size_t n, std::uint64_t block) {
  for (std::size_t i = 0; i < n; ++i) p[i] = std::byte((block * 2654435761u + i * 40503u) >> 7);
}

} // namespace

TEST_CASE("drive: blocks written, read and mixed with many in flight come back bit for bit") {
  temp_dir dir{"drive"};
  constexpr std::size_t block = 3 * direct_alignment, blocks = 40;
  for (io_backend backend : backends_here()) {
    for (unsigned depth : {1u, 3u, 16u}) {
      INFO("backend " << to_string(backend) << ", depth " << depth);
      auto q = make_io_queue(depth, backend);
      CHECK(q->backend() == backend);
      CHECK(q->depth() == depth);
      direct_file f = direct_file::create((dir.path / "state").string(), blocks * block);
      CHECK(f.size() == blocks * block);
      std::vector<direct_buffer> buffers;
      for (std::size_t k = 0; k < blocks; ++k) buffers.push_back(make_direct_buffer(block));
      std::vector<std::size_t> order(blocks);
      std::iota(order.begin(), order.end(), 0);
      std::shuffle(order.begin(), order.end(), std::mt19937(depth));
      // Submits `k`'s request for each of `order`, never more than the depth in flight;
      // checks every completion is whole and comes once.
      auto run = [&](auto&& request) {
        std::set<std::uint64_t> seen;
        auto take = [&](std::vector<io_completion> done) {
          for (const auto& c : done) {
            CHECK(c.result == static_cast<std::int64_t>(block));
            CHECK(seen.insert(c.tag).second);
          }
        };
        for (std::size_t k : order) {
          if (q->in_flight() == q->depth()) take(q->wait(1));
          q->submit(request(k));
        }
        take(q->wait(q->in_flight()));
        CHECK(q->in_flight() == 0);
        CHECK(seen.size() == blocks);
      };
      for (std::size_t k = 0; k < blocks; ++k) fill(buffers[k].get(), block, k);
      run([&](std::size_t k) { return io_request{f.fd(), true, buffers[k].get(), block, k * block, k}; });
      std::vector<direct_buffer> back;
      for (std::size_t k = 0; k < blocks; ++k) back.push_back(make_direct_buffer(block));
      run([&](std::size_t k) { return io_request{f.fd(), false, back[k].get(), block, k * block, k}; });
      for (std::size_t k = 0; k < blocks; ++k) CHECK(std::memcmp(back[k].get(), buffers[k].get(), block) == 0);
      // Mixed: even blocks read back, odd ones overwritten with new contents.
      for (std::size_t k = 1; k < blocks; k += 2) fill(buffers[k].get(), block, k + 1000);
      for (std::size_t k = 0; k < blocks; k += 2) std::memset(back[k].get(), 0, block);
      run([&](std::size_t k) {
        return k % 2 ? io_request{f.fd(), true, buffers[k].get(), block, k * block, k}
                     : io_request{f.fd(), false, back[k].get(), block, k * block, k};
      });
      run([&](std::size_t k) { return io_request{f.fd(), false, back[k].get(), block, k * block, k}; });
      for (std::size_t k = 0; k < blocks; ++k) CHECK(std::memcmp(back[k].get(), buffers[k].get(), block) == 0);
      if (honours_o_direct(dir.path)) CHECK(f.cached_pages() == 0); // (the page cache was never filled)
    }
  }
}

TEST_CASE("drive: bad requests and misuse are named, nothing lost") {
  temp_dir dir{"drive"};
  CHECK_THROWS_WITH(make_io_queue(0), Catch::Contains("depth 0"));
  CHECK_THROWS_WITH(make_io_queue(4097), Catch::Contains("1 to 4096"));
  CHECK_THROWS_WITH(parse_io_backend("aio", "--io"), Catch::Contains("--io = 'aio'") && Catch::Contains("threads"));
  CHECK(parse_io_backend("io_uring", "x") == io_backend::uring);
  CHECK_THROWS_AS(direct_file::create((dir.path / "missing" / "f").string(), 4096), std::system_error);
  CHECK_THROWS_WITH(direct_file::open((dir.path / "missing").string()), Catch::Contains("missing"));
  for (io_backend backend : backends_here()) {
    INFO("backend " << to_string(backend));
    auto q = make_io_queue(2, backend);
    CHECK(q->wait(1).empty()); // nothing in flight: nothing to wait for
    direct_file f = direct_file::create((dir.path / "small").string(), 2 * direct_alignment);
    direct_buffer b = make_direct_buffer(4 * direct_alignment);
    // Past the end: a short read (0 bytes), not an error; a bad descriptor: -EBADF.
    q->submit({f.fd(), false, b.get(), direct_alignment, 8 * direct_alignment, 7});
    q->submit({-1, false, b.get(), direct_alignment, 0, 8});
    CHECK_THROWS_AS(q->submit({f.fd(), false, b.get(), direct_alignment, 0, 9}), std::logic_error); // past the depth
    CHECK(q->in_flight() == 2);
    auto done = q->wait(2);
    REQUIRE(done.size() == 2);
    std::sort(done.begin(), done.end(), [](auto& a, auto& c) { return a.tag < c.tag; });
    CHECK(done[0].result == 0);
    CHECK(done[1].result == -EBADF);
    // A queue dropped with requests in flight waits for them (their buffers are the caller's).
    q->submit({f.fd(), true, b.get(), direct_alignment, 0, 1});
    q->submit({f.fd(), true, b.get(), direct_alignment, direct_alignment, 2});
    q.reset();
  }
}
