#pragma once
// A small file beside a state store's chunks that keeps something of each committed step (its
// hyper-parameters, its tensors' own step counts): two places, one per step parity like the
// chunks' slots, so writing step t+1's never touches step t's. Each place holds a magic, a
// version, its step, its commit (the id every stripe's commit record carries), the words, and
// a checksum of all of it; padded to 4 KiB. Written, and made durable when the store syncs,
// before any commit record of its step.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace hostopt::detail {

/// One kind of record: its file's name (in the store's first directory), its magic and
/// version, and how many words each place holds (fixed for a store: the file's two places
/// are laid out by it).
struct step_record_kind {
  const char* file;
  char magic[8];
  std::uint64_t version;
  std::size_t words;
  /// What the messages call it ("the hyper-parameters").
  const char* what;
};

/// The file's path in `dir`.
std::string step_record_path(const step_record_kind& kind, const std::string& dir);

/// Writes `words` (kind.words of them) as step `step`'s record, committed with `commit_id`,
/// into `dir`'s file (made if missing); fdatasync when `sync`. O_DIRECT, as the chunks and
/// commit records. std::system_error naming the file on an I/O error.
void write_step_record(const step_record_kind& kind, const std::string& dir, std::uint64_t step,
                       std::uint64_t commit_id, const std::vector<std::uint64_t>& words, bool sync);

/// The words `dir`'s file holds for (step, commit_id). nullopt with `problem` empty: no
/// file; nullopt with `problem` saying what: a torn, corrupt, other version's or other
/// commit's record.
std::optional<std::vector<std::uint64_t>> read_step_record(const step_record_kind& kind, const std::string& dir,
                                                           std::uint64_t step, std::uint64_t commit_id,
                                                           std::string& problem);

} // namespace hostopt::detail
