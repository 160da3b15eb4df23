#pragma once
// A 64-bit checksum of bytes kept on drives (a checkpoint file, a slot of the state store),
// fed in pieces of any length (a file is checksummed as it streams through a staging block).

#include <cstddef>
#include <cstdint>
#include <string>

namespace hostopt::detail {

/// A fast 64-bit checksum: 8-byte words mixed by multiply and rotate. Not cryptographic: it
/// catches torn and corrupted files.
class checksum64 {
public:
  /// Feeds the next `n` bytes.
  void add(const void* data, std::size_t n);
  /// The checksum of everything fed so far (more may be fed after).
  std::uint64_t finish() const;
  /// finish() as 16 lowercase hexadecimal digits, as a checkpoint stores it.
  std::string digits() const;

private:
  void mix_word(const unsigned char* b);

  std::uint64_t h_ = 0x9E3779B97F4A7C15ull;
  std::uint64_t length_ = 0;
  unsigned char pending_[8] = {}; // the bytes of a word that a piece left open
  std::size_t pending_n_ = 0;
};

} // namespace hostopt::detail
