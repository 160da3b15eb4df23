#pragma once
/// \file checkpoint.hpp
/// Crash-safe checkpoints of the whole optimizer state as safetensors files.
///
/// The file is standard safetensors (8-byte little-endian header length, JSON header,
/// raw little-endian tensors), so any safetensors reader opens it: for each tensor NAME
/// there are "NAME.param", "NAME.exp_avg" and "NAME.exp_avg_sq" (F32, its shape; the
/// moments BF16 or U8 codes in a group with compressed moments, whose 8-bit tensors add
/// "NAME.moment_scales", U8 [blocks, 2]: each group's format and rounding seed are in the
/// metadata as "moments" and "rounding_seeds", written when a group is not f32). The
/// header's "__metadata__" holds format "hostopt", version "2", the step and skipped-step
/// counts, the groups' hyper-parameters, the tensors' groups, and a 64-bit checksum of the
/// whole file — length, header (with the checksum's own 16 digits read as zeros) and data —
/// so no byte of it can change unnoticed.

#include <string>

#include "hostopt/optimizer.hpp"

namespace hostopt {

/// Writes `opt` to `path` atomically: a temporary file with a unique name in the same
/// directory, fsync, rename over `path`, fsync of the directory. A crash at any point
/// leaves either the old file or the new one, never a torn one; temporary files left by a
/// writer that was killed are removed by the next save to the same path.
///
/// The state is locked for the whole save (a concurrent step waits, or the save waits for
/// it), and the bytes are checksummed as they are written. Refused (std::runtime_error, the
/// old file untouched): a path that exists and is not a regular file — a device such as
/// /dev/null, a fifo, a socket, a directory, or a symbolic link (a link is not followed:
/// save to its target) — and an optimizer that is not usable (optimizer::usable()).
/// std::invalid_argument for an empty path or one holding a NUL byte. Other failures
/// throw std::runtime_error naming the path and the system error.
void save_checkpoint(const optimizer& opt, const std::string& path);

/// Loads a checkpoint into `opt`, which must have the same tensors (names, shapes) in the
/// same groups, with the same moment formats (a load never converts: that is lossy; load
/// into an optimizer of the file's formats and convert with read_moments/write_moments).
/// The groups' rounding seeds become the file's. Everything is verified first — a regular file (a fifo or device is refused
/// without blocking), header size, JSON, format and version, tensor names, dtypes, shapes,
/// offsets that tile the data section exactly (trailing bytes are refused), no key twice in
/// any JSON object of the header (a JSON reader would keep one silently), strictly parsed
/// counts, valid hyper-parameters, and the checksum over the whole file, computed in a
/// streaming pass (no second copy of the state in memory) that also refuses values no step
/// writes: 8-bit exponent bytes the encoder never writes, and a negative f32/bf16
/// exp_avg_sq (named by tensor and index; NaN, +inf and -0.0 load) — and std::runtime_error
/// names the first problem, with `opt` unchanged. Then the data is read into place. If the file
/// changes or a read fails during that second pass, `opt` is left not usable (see
/// optimizer::usable()) rather than half-loaded and silent. A successful load makes a
/// not-usable optimizer usable again.
void load_checkpoint(optimizer& opt, const std::string& path);

} // namespace hostopt
