#include "model_presets.hpp"

#include "bench_common.hpp"

#include <cstdio>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace bench {

namespace {

using hostopt::tensor_spec;
using shape = std::vector<std::int64_t>;

std::size_t numel(const tensor_spec& t) {
  std::size_t n = 1;
  for (auto d : t.shape) n *= std::size_t(d);
  return n;
}

// GPT-2 as Hugging Face names it: token/position embeddings, per layer two LayerNorms,
// fused QKV, attention projection and the MLP, then the final LayerNorm.
std::vector<tensor_spec> gpt2(int layers, std::int64_t d) {
  const std::int64_t vocab = 50257, ctx = 1024;
  std::vector<tensor_spec> t{{"wte", {vocab, d}}, {"wpe", {ctx, d}}};
  std::vector<tensor_spec> tail{{"ln_f.weight", {d}}, {"ln_f.bias", {d}}};
  for (int l = 0; l < layers; ++l) {
    const std::string p = "h." + std::to_string(l) + ".";
    std::vector<tensor_spec> layer{{p + "ln_1.weight", {d}},          {p + "ln_1.bias", {d}},
                                   {p + "attn.c_attn.weight", {d, 3 * d}}, {p + "attn.c_attn.bias", {3 * d}},
                                   {p + "attn.c_proj.weight", {d, d}},     {p + "attn.c_proj.bias", {d}},
                                   {p + "ln_2.weight", {d}},          {p + "ln_2.bias", {d}},
                                   {p + "mlp.c_fc.weight", {d, 4 * d}},    {p + "mlp.c_fc.bias", {4 * d}},
                                   {p + "mlp.c_proj.weight", {4 * d, d}},  {p + "mlp.c_proj.bias", {d}}};
    t.insert(t.end(), layer.begin(), layer.end());
  }
  t.insert(t.end(), tail.begin(), tail.end());
  return t;
}

// Llama-7B: 32000 x 4096 embeddings and LM head, per layer q/k/v/o (4096^2), gate/up/down
// (4096 x 11008) and two RMSNorms; 32 layers (6.7B parameters).
std::vector<tensor_spec> llama7b() {
  const std::int64_t d = 4096, ff = 11008, vocab = 32000;
  std::vector<tensor_spec> t{{"model.embed_tokens.weight", {vocab, d}}};
  for (int l = 0; l < 32; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    std::vector<tensor_spec> layer{{p + "self_attn.q_proj.weight", {d, d}}, {p + "self_attn.k_proj.weight", {d, d}},
                                   {p + "self_attn.v_proj.weight", {d, d}}, {p + "self_attn.o_proj.weight", {d, d}},
                                   {p + "mlp.gate_proj.weight", {ff, d}},   {p + "mlp.up_proj.weight", {ff, d}},
                                   {p + "mlp.down_proj.weight", {d, ff}},   {p + "input_layernorm.weight", {d}},
                                   {p + "post_attention_layernorm.weight", {d}}};
    t.insert(t.end(), layer.begin(), layer.end());
  }
  t.push_back({"model.norm.weight", {d}});
  t.push_back({"lm_head.weight", {vocab, d}});
  return t;
}

} // namespace

std::vector<std::string> preset_names() { return {"gpt2-small", "gpt2-medium", "llama-7b"}; }

std::vector<tensor_spec> preset_tensors(const std::string& name) {
  if (name == "gpt2-small") return gpt2(12, 768);
  if (name == "gpt2-medium") return gpt2(24, 1024);
  if (name == "llama-7b") return llama7b();
  throw std::invalid_argument("preset '" + name + "': unknown, expected gpt2-small, gpt2-medium or llama-7b");
}

std::vector<tensor_spec> read_shapes_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("shapes file '" + path + "': cannot open it");
  std::vector<tensor_spec> out;
  std::string line;
  int number = 0;
  while (std::getline(in, line)) {
    ++number;
    if (const auto hash = line.find('#'); hash != std::string::npos) line.resize(hash);
    std::istringstream ss(line);
    tensor_spec t;
    if (!(ss >> t.name)) continue;
    std::string tok;
    while (ss >> tok) {
      char* end = nullptr;
      const long long d = std::strtoll(tok.c_str(), &end, 10);
      if (*end != '\0' || d < 0)
        throw std::invalid_argument("shapes file '" + path + "' line " + std::to_string(number) + ": extent '" + tok +
                                 "' of '" + t.name + "': expected 'name d0 d1 ...' with extents >= 0");
      t.shape.push_back(d);
    }
    out.push_back(std::move(t));
  }
  if (out.empty()) throw std::invalid_argument("shapes file '" + path + "': no tensors (expected lines 'name d0 d1 ...')");
  std::size_t total = 0;
  for (const auto& t : out) total += numel(t);
  if (total == 0) // as a size of 0: nothing to step, nothing to time
    throw std::invalid_argument("shapes file '" + path + "': every tensor has 0 elements (nothing to step)");
  return out;
}

std::size_t count_params(const std::vector<tensor_spec>& tensors) {
  std::size_t n = 0;
  for (const auto& t : tensors) n += numel(t);
  return n;
}

std::vector<tensor_spec> preset_tensors_within(const std::string& name, const std::string& max_text,
                                               std::size_t max_params) {
  auto tensors = preset_tensors(name);
  const std::size_t full = count_params(tensors);
  if (full <= max_params) return tensors;
  // Never a silent cut: the user asked for this model, so say what running it whole takes.
  // The flag to pass: whole G from 1G up, whole M below.
  const std::size_t M = std::size_t(1) << 20, G = M << 10;
  const std::string enough = full >= G ? std::to_string((full + G - 1) / G) + "G" : std::to_string((full + M - 1) / M) + "M";
  char billions[32];
  std::snprintf(billions, sizeof billions, "%.2f", double(full) / 1e9);
  throw std::invalid_argument("preset '" + name + "' has " + billions + " billion parameters (" + format_size(full) +
                              "), more than --max-params " + max_text + ": pass --max-params " + enough +
                              " to run it whole");
}

} // namespace bench
