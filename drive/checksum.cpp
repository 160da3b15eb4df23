// The checkpoint checksum. See checksum.hpp.
#include "checksum.hpp"

#include <algorithm>
#include <cstdio>
#include <cstring>

namespace hostopt::detail {

void checksum64::add(const void* data, std::size_t n) {
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
  length_ += n;
}

std::uint64_t checksum64::finish() const {
  unsigned char last[8] = {};
  std::memcpy(last, pending_, pending_n_);
  std::uint64_t w;
  std::memcpy(&w, last, 8);
  std::uint64_t x = h_ ^ (w + length_);
  x ^= x >> 33;
  x *= 0xFF51AFD7ED558CCDull;
  x ^= x >> 33;
  return x;
}

std::string checksum64::digits() const {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", (unsigned long long)finish());
  return buf;
}

void checksum64::mix_word(const unsigned char* b) {
  std::uint64_t w;
  std::memcpy(&w, b, 8);
  h_ = (h_ ^ w) * 0x100000001B3ull;
  h_ = (h_ << 31) | (h_ >> 33);
}

} // namespace hostopt::detail
