#pragma once
// Realistic tensor lists for `hostopt-bench model`: GPT-2 small/medium, a Llama-7B-shaped
// list truncated to a parameter budget, or a file of shapes.

#include <cstddef>
#include <string>
#include <vector>

#include "hostopt/optimizer.hpp"

namespace bench {

/// Names of the built-in presets.
std::vector<std::string> preset_names();

/// The preset's tensors; presets larger than `max_params` keep whole layers while they
/// fit (the embeddings always stay). Throws std::invalid_argument for an unknown name.
std::vector<hostopt::tensor_spec> preset_tensors(const std::string& name, std::size_t max_params);

/// Reads lines "name d0 d1 ..." ('#' starts a comment); throws std::runtime_error naming
/// the file and line for anything else.
std::vector<hostopt::tensor_spec> read_shapes_file(const std::string& path);

std::size_t count_params(const std::vector<hostopt::tensor_spec>& tensors);

} // namespace bench
