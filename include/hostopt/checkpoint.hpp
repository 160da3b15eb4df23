#pragma once
/// \file checkpoint.hpp
/// Crash-safe checkpoints of the whole optimizer state as safetensors files.
///
/// The file is standard safetensors (8-byte little-endian header length, JSON header,
/// raw little-endian tensors), so any safetensors reader opens it: for each tensor NAME
/// there are "NAME.param", "NAME.exp_avg" and "NAME.exp_avg_sq" (F32, its shape). The
/// header's "__metadata__" holds format "hostopt", version "1", the step and skipped-step
/// counts, the groups' hyper-parameters, the tensors' groups, and a 64-bit checksum of the
/// data section.

#include <string>

#include "hostopt/optimizer.hpp"

namespace hostopt {

/// Writes `opt` to `path` atomically: a temporary file in the same directory, fsync,
/// rename over `path`, fsync of the directory. A crash at any point leaves either the old
/// file or the new one, never a torn one. Throws std::runtime_error naming the path and
/// the system error.
void save_checkpoint(const optimizer& opt, const std::string& path);

/// Loads a checkpoint into `opt`, which must have the same tensors (names, shapes) in the
/// same groups. Everything is read and verified first — header size, JSON, format and
/// version, tensor names, dtypes, shapes, offsets inside the file, the checksum — and
/// std::runtime_error names the first problem; only then are the params, moments, step
/// count and hyper-parameters replaced. On error `opt` is unchanged.
void load_checkpoint(optimizer& opt, const std::string& path);

} // namespace hostopt
