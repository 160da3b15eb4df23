#pragma once
// Realistic tensor lists for `hostopt-bench model`: GPT-2 small/medium, a Llama-7B-shaped
// list (always whole: `model` refuses one over --max-params), or a file of shapes.

#include <cstddef>
#include <string>
#include <vector>

#include "hostopt/optimizer.hpp"

namespace bench {

/// Names of the built-in presets.
std::vector<std::string> preset_names();

/// The preset's tensors, every layer. Throws std::invalid_argument for an unknown name.
std::vector<hostopt::tensor_spec> preset_tensors(const std::string& name);

/// The preset's tensors when it has at most `max_params` parameters (`max_text`: how the
/// user wrote it); else std::invalid_argument saying what --max-params runs it whole.
std::vector<hostopt::tensor_spec> preset_tensors_within(const std::string& name, const std::string& max_text,
                                                        std::size_t max_params);

/// Reads lines "name d0 d1 ..." ('#' starts a comment); throws std::invalid_argument naming
/// the file and line for anything else (std::runtime_error when it cannot be opened).
std::vector<hostopt::tensor_spec> read_shapes_file(const std::string& path);

std::size_t count_params(const std::vector<hostopt::tensor_spec>& tensors);

} // namespace bench
