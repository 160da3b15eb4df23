#include "bench_common.hpp"

#include "hostopt/kernels.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <stdexcept>
#include <unistd.h>

#include "half_conversion.hpp"
#include "parallel.hpp"

namespace bench {

std::size_t parse_size(const std::string& text, const std::string& flag) {
  const std::string expected = "expected a count like 1000, 64M or 1G (K, M, G = 2^10, 2^20, 2^30)";
  if (text.empty()) throw std::invalid_argument(flag + " '': " + expected);
  std::size_t pos = 0;
  double value = 0;
  try {
    value = std::stod(text, &pos);
  } catch (const std::exception&) {
    throw std::invalid_argument(flag + " '" + text + "': " + expected);
  }
  double mult = 1;
  const std::string suffix = text.substr(pos);
  if (suffix == "K" || suffix == "k") mult = 1024.0;
  else if (suffix == "M" || suffix == "m") mult = 1024.0 * 1024;
  else if (suffix == "G" || suffix == "g") mult = 1024.0 * 1024 * 1024;
  else if (!suffix.empty())
    throw std::invalid_argument(flag + " '" + text + "': unknown suffix '" + suffix + "', " + expected);
  const double n = value * mult;
  if (!(n >= 0) || n > 1e15 || n != std::floor(n))
    throw std::invalid_argument(flag + " '" + text + "': " + expected + " (a whole, non-negative number of elements)");
  if (n == 0) throw std::invalid_argument(flag + " '" + text + "': expected at least 1 (a size of 0 has nothing to time)");
  return std::size_t(n);
}

std::string format_size(std::size_t n) {
  const std::size_t K = 1024, M = K * K, G = M * K;
  if (n >= G && n % G == 0) return std::to_string(n / G) + "G";
  if (n >= M && n % M == 0) return std::to_string(n / M) + "M";
  if (n >= K && n < M && n % K == 0) return std::to_string(n / K) + "K";
  if (n < M) return std::to_string(n);
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1fM", double(n) / double(M));
  return buf;
}

std::size_t available_memory_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  std::size_t kb = 0;
  std::string unit;
  while (in >> key >> kb >> unit)
    if (key == "MemAvailable:") return kb * 1024;
  return 0;
}

void check_memory(std::size_t bytes, const std::string& what) {
  const std::size_t avail = available_memory_bytes();
  if (avail == 0 || bytes <= avail / 10 * 9) return;
  std::ostringstream os;
  os.precision(3);
  os << what << " needs " << double(bytes) / (1 << 30) << " GiB but only " << double(avail) / (1 << 30)
     << " GiB of memory is available: use a smaller size (--size, or a smaller model or shapes file), or fewer threads";
  throw std::runtime_error(os.str());
}

float_buffer::float_buffer(std::size_t n, int threads) : size(n) {
  if (n == 0) return;
  const std::size_t bytes = (n * sizeof(float) + 63) / 64 * 64;
  void* p = nullptr;
  if (posix_memalign(&p, std::size_t(2) << 20, bytes) != 0)
    throw std::runtime_error("cannot allocate " + std::to_string(bytes) + " bytes");
  data = static_cast<float*>(p);
  float* d = data;
  auto touch = [d, n](int tid, int nt) {
    const auto [lo, hi] = hostopt::detail::partition(0, n, tid, nt);
    if (lo < hi) std::memset(d + lo, 0, (hi - lo) * sizeof(float));
  };
  hostopt::detail::run_parallel(threads, touch);
}

float_buffer::~float_buffer() { std::free(data); }
float_buffer::float_buffer(float_buffer&& o) noexcept : data(o.data), size(o.size) {
  o.data = nullptr;
  o.size = 0;
}
float_buffer& float_buffer::operator=(float_buffer&& o) noexcept {
  std::swap(data, o.data);
  std::swap(size, o.size);
  return *this;
}

float_buffer typed_buffer(std::size_t n, hostopt::dtype t, int threads) {
  return float_buffer((n * hostopt::dtype_size(t) + 3) / 4, threads);
}

namespace {
// Cheap deterministic generator per slice (values need only look like training data).
struct lcg {
  std::uint64_t s;
  float next() {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return float(std::int32_t(s >> 32)) * (1.0f / 2147483648.0f);
  }
};
} // namespace

void fill_random(float* x, std::size_t n, float scale, bool positive, int threads) {
  auto body = [=](int tid, int nt) {
    const auto [lo, hi] = hostopt::detail::partition(0, n, tid, nt);
    lcg r{lo * 2654435761u + 1};
    for (std::size_t i = lo; i < hi; ++i) {
      const float u = r.next() * scale;
      x[i] = positive ? std::fabs(u) : u;
    }
  };
  hostopt::detail::run_parallel(threads, body);
}

void fill_random_half(std::uint16_t* x, std::size_t n, hostopt::dtype t, int threads) {
  auto body = [=](int tid, int nt) {
    const auto [lo, hi] = hostopt::detail::partition(0, n, tid, nt);
    lcg r{lo * 40503u + 7};
    for (std::size_t i = lo; i < hi; ++i) {
      const float u = r.next() * 0.01f;
      x[i] = t == hostopt::dtype::bf16 ? hostopt::detail::f32_to_bf16(u) : hostopt::detail::f32_to_f16(u);
    }
  };
  hostopt::detail::run_parallel(threads, body);
}

timing summarize(std::vector<double> s) {
  if (s.empty()) return {};
  std::sort(s.begin(), s.end());
  const std::size_t k = s.size();
  const double median = k % 2 ? s[k / 2] : 0.5 * (s[k / 2 - 1] + s[k / 2]);
  return {median, s.front()};
}

progress::progress(std::size_t total, bool enabled)
    : total_(total), enabled_(enabled), tty_(isatty(STDERR_FILENO)), start_(now_seconds()) {}

void progress::update(std::size_t done, const std::string& what) {
  if (!enabled_) return;
  const double t = now_seconds();
  if (t - start_ < 3.0 || (!tty_ && t - last_ < 10.0)) return;
  last_ = t;
  shown_ = true;
  std::fprintf(stderr, "%s[%zu/%zu] %s (%.0f s)%s", tty_ ? "\r\033[K" : "", done + 1, total_, what.c_str(),
               t - start_, tty_ ? "" : "\n");
  std::fflush(stderr);
}

void progress::finish() {
  if (enabled_ && shown_ && tty_) std::fprintf(stderr, "\r\033[K");
}

int hardware_threads() { return hostopt::detail::default_threads(); }

std::vector<int> parse_threads(const std::string& text) {
  std::vector<int> out;
  if (text == "all") {
    const int hw = hardware_threads();
    for (int t = 1; t < hw; t *= 2) out.push_back(t);
    out.push_back(hw);
    return out;
  }
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    char* end = nullptr;
    const long t = std::strtol(item.c_str(), &end, 10);
    const int most = hostopt::max_threads(); // the core's bound, named here before anything runs
    if (item.empty() || *end != '\0' || t < 1 || t > most)
      throw std::invalid_argument("threads '" + text + "': expected a list like 1,2,4 of counts in [1, " +
                                  std::to_string(most) + "], or 'all'");
    out.push_back(int(t));
  }
  if (out.empty()) throw std::invalid_argument("threads '': expected a list like 1,2,4 or 'all'");
  return out;
}

} // namespace bench
