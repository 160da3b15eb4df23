// Cross-architecture determinism: a fixed-seed run of every dtype mix and mode, on every
// kernel this CPU supports, hashed into one digest per kernel; and a checkpoint written on
// x86-64 loaded here, trained on, and saved again. The digests and bytes must equal the
// golden ones in tests/data (made on x86-64), whatever the architecture, kernel or thread
// count: that is DESIGN's "bitwise identical across CPU architectures".
//
//   determinism_digest --check DATA_DIR   compare with DATA_DIR/determinism_digest.txt
//   determinism_digest --write DATA_DIR   regenerate the golden files (on x86-64 only)
//
// Inputs come from a counter-based generator written here (no std distributions, whose
// algorithms are the standard library's choice), so every platform sees the same bits.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include <unistd.h>

#include "hostopt/hostopt.hpp"

using namespace hostopt;

namespace {

// splitmix64: element i of stream `seed`.
std::uint64_t mix(std::uint64_t seed, std::uint64_t i) {
  std::uint64_t x = seed * 0x9E3779B97F4A7C15ull + i;
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// A value in about [-scale, scale) made exactly of 24 random bits: identical everywhere.
float value(std::uint64_t seed, std::uint64_t i, float scale) {
  const std::int32_t r = std::int32_t(mix(seed, i) >> 40) - (1 << 23);
  return float(r) * (scale / float(1 << 23));
}

// 16-bit gradient bits made from x by bit operations alone (portable): bf16 by truncation,
// f16 from x's sign, a clamped exponent and its top mantissa bits (finite, subnormals too).
std::uint16_t to_half(float x, dtype t) {
  std::uint32_t u;
  std::memcpy(&u, &x, 4);
  if (t == dtype::bf16) return std::uint16_t(u >> 16);
  const std::uint32_t sign = (u >> 16) & 0x8000u, mant = (u >> 13) & 0x3FFu;
  const int e = int((u >> 23) & 0xFF) - 127 + 15;
  const std::uint32_t exp = std::uint32_t(e < 0 ? 0 : e > 30 ? 30 : e);
  return std::uint16_t(sign | (exp << 10) | mant);
}

struct fnv {
  std::uint64_t h = 0xcbf29ce484222325ull;
  void add(const void* p, std::size_t n) {
    const auto* b = static_cast<const unsigned char*>(p);
    for (std::size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 0x100000001b3ull;
  }
};

std::string hex(std::uint64_t x) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", (unsigned long long)x);
  return buf;
}

std::vector<adam_config> configs() {
  std::vector<adam_config> cs;
  adam_config c;
  c.lr = 1e-2;
  c.weight_decay = 0.05;
  cs.push_back(c); // adamw
  c.mode = adam_mode::adam;
  cs.push_back(c); // adam, coupled L2
  c.weight_decay = 0;
  c.nesterov = true;
  cs.push_back(c); // nadam
  c.mode = adam_mode::adamw;
  c.weight_decay = 0.1;
  c.eps_root = 1e-8;
  cs.push_back(c); // nadamw, eps_root
  c.nesterov = false;
  c.bias_correction = false;
  c.beta1 = 0.5;
  c.beta2 = 0.75;
  cs.push_back(c); // no bias correction
  adam_config plain;
  plain.lr = 3e-3;
  cs.push_back(plain); // adamw without decay: no decay, no nesterov
  plain.mode = adam_mode::adam;
  plain.weight_decay = 0.02;
  plain.nesterov = true;
  cs.push_back(plain); // adam, coupled decay, nesterov
  return cs;
}

const std::vector<param_group>& model() {
  static const std::vector<param_group> groups = [] {
    const auto cs = configs();
    return std::vector<param_group>{{cs[0], {{"w", {37, 29}}, {"tail", {33}}}},
                                    {cs[1], {{"b", {17}}, {"empty", {0}}}},
                                    {cs[2], {{"s", {}}}},
                                    {cs[3], {{"v", {101}}}},
                                    {cs[4], {{"u", {64}}}},
                                    {cs[5], {{"x", {19}}}},
                                    {cs[6], {{"y", {40}}}}};
  }();
  return groups;
}

// Five checked, clipped steps of every gradient dtype and copy-out on one kernel, plus the
// optax form over many leaves; every state and output byte hashed.
std::string kernel_digest(const std::string& kernel) {
  fnv h;
  const dtype types[] = {dtype::f32, dtype::bf16, dtype::f16};
  for (int gt = 0; gt < 3; ++gt)
    for (int out = -1; out < 3; ++out) {
      optimizer opt(model(), {2, kernel});
      const std::size_t n = opt.arena_size();
      std::vector<float> init(n);
      for (std::size_t i = 0; i < n; ++i) init[i] = value(1, i, 1.0f);
      for (const auto& s : opt.segments())
        opt.set_params(s.name, {init.data() + s.offset, s.size, dtype::f32});
      std::vector<float> g32(n);
      std::vector<std::uint16_t> g16(n), o16(n);
      std::vector<float> o32(n);
      for (int t = 0; t < 5; ++t) {
        for (std::size_t i = 0; i < n; ++i) {
          g32[i] = value(100 + std::uint64_t(t) * 7 + std::uint64_t(gt), i, 2.0f);
          g16[i] = to_half(g32[i], types[gt]);
        }
        const const_view g = types[gt] == dtype::f32 ? const_view{g32.data(), n, dtype::f32}
                                                     : const_view{g16.data(), n, types[gt]};
        mut_view o{};
        if (out == 0) o = {o32.data(), n, dtype::f32};
        if (out > 0) o = {o16.data(), n, types[out]};
        step_options so;
        so.max_grad_norm = t % 2 ? 3.0 : 0.0;
        so.grad_scale = 0.75f;
        if (t == 2) so.known_grad_norm = std::nan(""); // the skip path: nothing may change
        if (t == 4) { // unchecked, with an inf gradient: NaN results, canonical on every CPU
          so.skip_nonfinite = false;
          so.max_grad_norm = 0.0;
          if (types[gt] == dtype::f32) g32[5] = INFINITY;
          else g16[5] = types[gt] == dtype::bf16 ? 0x7F80 : 0x7C00;
        }
        const bool applied = opt.step(g, o, so).applied;
        h.add(&applied, 1);
        if (out == 0) h.add(o32.data(), n * 4);
        if (out > 0) h.add(o16.data(), n * 2);
      }
      h.add(opt.params().data(), n * 4);
      h.add(opt.exp_avg().data(), n * 4);
      h.add(opt.exp_avg_sq().data(), n * 4);
    }
  // The chunked step with an accumulator (the pipeline's path): two micro-batches summed
  // by accumulate_range, then the step over chunks of 48; and convert_params' rounding.
  for (int gt = 0; gt < 3; ++gt) {
    optimizer opt(model(), {2, kernel});
    const std::size_t n = opt.arena_size();
    std::vector<float> acc(n), g32(n), out(n);
    std::vector<std::uint16_t> g16(n), conv(n);
    for (int mb = 0; mb < 2; ++mb) {
      for (std::size_t i = 0; i < n; ++i) {
        g32[i] = value(900 + std::uint64_t(mb) + 10 * std::uint64_t(gt), i, 1.5f);
        g16[i] = to_half(g32[i], types[gt]);
      }
      const void* g = types[gt] == dtype::f32 ? static_cast<const void*>(g32.data()) : g16.data();
      if (mb == 0) opt.accumulate_range(0, n, acc.data(), g, types[gt], true);
      else {
        chunk_step_options co;
        co.grad_type = types[gt];
        co.copy_out = true;
        co.accumulator = true;
        opt.begin_step(co);
        const std::size_t es = dtype_size(types[gt]);
        for (std::size_t lo = 0; lo < n; lo += 48) {
          const std::size_t hi = std::min(n, lo + 48);
          opt.update_range(lo, hi, static_cast<const char*>(g) + lo * es, out.data() + lo, acc.data() + lo);
        }
        opt.finish_step();
      }
    }
    h.add(acc.data(), n * 4);
    h.add(out.data(), n * 4);
    h.add(opt.exp_avg_sq().data(), n * 4);
    if (types[gt] != dtype::f32) {
      convert_params(opt.params().data(), {conv.data(), n, types[gt]}, {1, kernel});
      h.add(conv.data(), n * 2);
    }
  }
  // The optax form over leaves of different sizes and configs, in one call.
  const auto cs = configs();
  for (int gt = 0; gt < 3; ++gt) {
    const std::size_t sizes[] = {1, 15, 16, 17, 1000};
    std::vector<std::vector<float>> p, m, v, u32;
    std::vector<std::vector<std::uint16_t>> g16, u16;
    std::vector<std::vector<float>> g32;
    std::vector<update_leaf> leaves;
    for (std::size_t l = 0; l < 5; ++l) {
      const std::size_t n = sizes[l];
      p.emplace_back(n);
      m.emplace_back(n);
      v.emplace_back(n);
      g32.emplace_back(n);
      g16.emplace_back(n);
      u32.emplace_back(n);
      u16.emplace_back(n);
      for (std::size_t i = 0; i < n; ++i) {
        p[l][i] = value(7, l * 4096 + i, 1.0f);
        m[l][i] = value(8, l * 4096 + i, 0.1f);
        v[l][i] = std::fabs(value(9, l * 4096 + i, 0.01f));
        g32[l][i] = value(10 + std::uint64_t(gt), l * 4096 + i, 1.0f);
        g16[l][i] = to_half(g32[l][i], types[gt]);
      }
    }
    for (std::size_t l = 0; l < 5; ++l) {
      const std::size_t n = sizes[l];
      const const_view g = types[gt] == dtype::f32 ? const_view{g32[l].data(), n, dtype::f32}
                                                   : const_view{g16[l].data(), n, types[gt]};
      const mut_view u = types[gt] == dtype::f32 ? mut_view{u32[l].data(), n, dtype::f32}
                                                 : mut_view{u16[l].data(), n, types[gt]};
      leaves.push_back({p[l].data(), m[l].data(), v[l].data(), g, u, l % cs.size()});
    }
    adam_update(leaves, cs, 3, 1.0f, {2, kernel});
    for (std::size_t l = 0; l < 5; ++l) {
      h.add(m[l].data(), sizes[l] * 4);
      h.add(v[l].data(), sizes[l] * 4);
      if (types[gt] == dtype::f32) h.add(u32[l].data(), sizes[l] * 4);
      else h.add(u16[l].data(), sizes[l] * 2);
    }
  }
  return hex(h.h);
}

// Compressed moments (bf16 and 8-bit): five steps of bf16 gradients with a bf16 copy-out
// on one kernel, two threads, over values spanning 2^40 (so 8-bit blocks use their
// subnormal codes), a block with a NaN gradient, and a tail that ends inside a block; then
// an explicit encode and decode. Every code, exponent byte, parameter and copy-out hashed.
std::string compressed_digest(const std::string& kernel) {
  fnv h;
  const std::size_t n = 32 * 37 + 13;
  for (moment_format f : {moment_format::bf16, moment_format::q8}) {
    const std::size_t code_bytes = f == moment_format::bf16 ? 2 : 1;
    std::vector<unsigned char> m(n * code_bytes), v(n * code_bytes), scales(moment_scale_bytes(f, n));
    const compressed_moments mo{f, m.data(), v.data(), scales.empty() ? nullptr : scales.data()};
    std::vector<float> p(n), m32(n), v32(n);
    for (std::size_t i = 0; i < n; ++i) p[i] = value(600, i, 1.0f);
    std::vector<std::uint16_t> g(n), out(n);
    adam_config c;
    c.weight_decay = 0.01;
    for (int t = 1; t <= 5; ++t) {
      for (std::size_t i = 0; i < n; ++i) {
        const float scale = std::ldexp(1.0f, -int(mix(700, i) % 40)); // 1 .. 2^-39
        g[i] = to_half(value(700 + std::uint64_t(t), i, scale), dtype::bf16);
      }
      if (t == 4) g[5 * 32 + 7] = 0x7FC0; // a NaN gradient poisons its 8-bit block
      adam_step(p.data(), mo, n, {g.data(), n, dtype::bf16}, {out.data(), n, dtype::bf16}, c, t, 1.0f, {11, 0},
                {2, kernel});
      h.add(out.data(), n * 2);
    }
    h.add(p.data(), n * 4);
    h.add(m.data(), m.size());
    h.add(v.data(), v.size());
    h.add(scales.data(), scales.size());
    decode_moments(mo, n, m32.data(), v32.data());
    h.add(m32.data(), n * 4);
    h.add(v32.data(), n * 4);
    for (std::size_t i = 0; i < n; ++i) { // encode finite moments again, with another seed
      m32[i] = std::isnan(m32[i]) ? 0.0f : m32[i] * 0.75f;
      v32[i] = std::isnan(v32[i]) ? 0.0f : v32[i] * 0.75f;
    }
    encode_moments(m32.data(), v32.data(), mo, n, {12, 0});
    h.add(m.data(), m.size());
    h.add(v.data(), v.size());
    h.add(scales.data(), scales.size());
  }
  return hex(h.h);
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

// The golden checkpoint: the model after 3 steps on the default kernel.
void make_checkpoint(const std::string& path) {
  optimizer opt(model(), {1, ""});
  const std::size_t n = opt.arena_size();
  std::vector<float> g(n);
  for (int t = 0; t < 3; ++t) {
    for (std::size_t i = 0; i < n; ++i) g[i] = value(500 + std::uint64_t(t), i, 1.0f);
    opt.step({g.data(), n, dtype::f32});
  }
  save_checkpoint(opt, path);
}

// Loads the checkpoint (written on x86-64), saves it again (the same bytes?) and trains 3
// more steps: a digest of the result.
std::string resume_digest(const std::string& golden, const std::string& scratch, const std::string& kernel,
                          bool* same_bytes) {
  optimizer opt(model(), {1, kernel});
  load_checkpoint(opt, golden);
  save_checkpoint(opt, scratch);
  *same_bytes = read_file(scratch) == read_file(golden);
  std::remove(scratch.c_str());
  const std::size_t n = opt.arena_size();
  std::vector<float> g(n);
  for (int t = 3; t < 6; ++t) {
    for (std::size_t i = 0; i < n; ++i) g[i] = value(500 + std::uint64_t(t), i, 1.0f);
    opt.step({g.data(), n, dtype::f32});
  }
  fnv h;
  h.add(opt.params().data(), n * 4);
  h.add(opt.exp_avg().data(), n * 4);
  h.add(opt.exp_avg_sq().data(), n * 4);
  return hex(h.h);
}

} // namespace

int main(int argc, char** argv) {
  if (argc != 3 || (std::string(argv[1]) != "--check" && std::string(argv[1]) != "--write")) {
    std::printf("usage: determinism_digest --check|--write DATA_DIR\n");
    return 2;
  }
  const bool write = std::string(argv[1]) == "--write";
  const std::string dir = argv[2];
#if !defined(__x86_64__)
  if (write) {
    std::printf("--write: the golden files are made on x86-64 (the reference architecture)\n");
    return 2;
  }
#endif
  const std::string golden_ckpt = dir + "/x86_64_checkpoint.safetensors";
  const std::string digest_file = dir + "/determinism_digest.txt";
  const std::string scratch = "determinism_digest_scratch_" + std::to_string(::getpid()) + ".safetensors";
  try {
    if (write) make_checkpoint(golden_ckpt);
    // One digest for all kernels: each kernel's must be the same, and equal the golden.
    std::map<std::string, std::string> got, got_compressed;
    for (const auto& k : kernels())
      if (k.supported) {
        got[k.name] = kernel_digest(k.name);
        got_compressed[k.name] = compressed_digest(k.name);
      }
    bool same_bytes = true;
    const std::string resumed = resume_digest(golden_ckpt, scratch, "", &same_bytes);
    if (write) {
      std::ofstream f(digest_file);
      f << "steps " << got.begin()->second << "\nresume " << resumed << "\ncompressed "
        << got_compressed.begin()->second << "\n";
      std::printf("wrote %s and %s\n", digest_file.c_str(), golden_ckpt.c_str());
    }
    std::string want_steps, want_resume, want_compressed, word;
    std::ifstream f(digest_file);
    f >> word >> want_steps >> word >> want_resume >> word >> want_compressed;
    int bad = 0;
    for (const auto& [name, d] : got) {
      const bool ok = d == want_steps;
      bad += !ok;
      std::printf("kernel %-7s steps digest %s %s\n", name.c_str(), d.c_str(), ok ? "== golden" : "!= golden");
    }
    for (const auto& [name, d] : got_compressed) {
      const bool ok = d == want_compressed;
      bad += !ok;
      std::printf("kernel %-7s compressed moments digest %s %s\n", name.c_str(), d.c_str(),
                  ok ? "== golden" : "!= golden");
    }
    std::printf("checkpoint from x86-64: %s; resumed digest %s %s\n",
                same_bytes ? "loads and saves to the same bytes" : "SAVES TO OTHER BYTES", resumed.c_str(),
                resumed == want_resume ? "== golden" : "!= golden");
    bad += !same_bytes + (resumed != want_resume);
    std::printf(bad ? "determinism: MISMATCH with the x86-64 golden digests\n"
                    : "determinism: every kernel here gives the x86-64 bits\n");
    return bad ? 1 : 0;
  } catch (const std::exception& e) {
    std::printf("error: %s\n", e.what());
    return 1;
  }
}
