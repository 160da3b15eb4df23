#pragma once
// The function table each instruction set exports. SIMD-free: the registry, the
// optimizer and the benchmark see only plain function pointers.

#include <cstddef>
#include <optional>

#include "hostopt/dtype.hpp"
#include "hostopt/moment_format.hpp"

#include "step_scalars.hpp"

namespace hostopt::detail {

/// Fused Adam step over n contiguous elements (p, m, v updated in place; grad in the
/// table's grad dtype; out in the table's out dtype, ignored for "no copy-out").
using adam_fn = void (*)(const step_scalars& s, float* p, float* m, float* v, const void* grad,
                         void* out, std::size_t n) noexcept;

/// The roofline kernel: the same loads and stores as adam_fn, no arithmetic (each stream
/// writes back what it read; out <- p), so its time is the memory system's limit.
using roofline_fn = void (*)(float* p, float* m, float* v, const void* grad, void* out,
                             std::size_t n) noexcept;

/// Converts n floats to a 16-bit dtype (round to nearest even): the separate cast pass
/// of a two-pass step, which the benchmark measures against the fused kernel.
using cast_fn = void (*)(const float* in, void* out, std::size_t n) noexcept;

/// dst = decode(grad) + acc, or dst = decode(grad) when acc is null (dst may be acc):
/// gradient accumulation across micro-batches in f32.
using add_grad_fn = void (*)(float* dst, const float* acc, const void* grad, std::size_t n) noexcept;

/// Sum of squares of n <= stats_block gradient elements, in double, in an order that is
/// the same for every instruction set (16 fixed lanes, then a fixed pairwise tree).
using sumsq_fn = double (*)(const void* grad, std::size_t n) noexcept;

/// Elements per block of the gradient statistics (block sums are added in block order).
inline constexpr std::size_t stats_block = 4096;

/// One call of a compressed-moment kernel: the step's constants and variant (runtime
/// flags: the kernel is memory-bound, and 6 variants per table cell would double the
/// compile time), the step's rounding key and the arena index of the call's first element
/// (a multiple of q8_block for the 8-bit format).
struct compressed_call {
  step_scalars s;
  decay_kind decay = decay_kind::none;
  bool nesterov = false;
  std::uint64_t key = 0;
  std::uint64_t first = 0;
};

/// What a compressed kernel's encode saw in the 8-bit blocks of its call (zero for bf16).
/// Integer counts of whole blocks (no block is split between calls), so any split of the
/// work (threads, chunks, shards) sums to the same totals. No member functions: per-arch
/// translation units include this (ODR, STYLE.md).
struct block_counts {
  std::uint64_t poisoned = 0;  ///< blocks whose moments are NaN after the call (base 255)
  std::uint64_t saturated = 0; ///< blocks whose range the encode exceeded (moment_codec::saturated)
};

/// Fused step over compressed moments (cpu_adam/compressed_kernel.hpp): m and v point at
/// the call's first element's codes, `scales` at its block's exponent bytes (8-bit only).
/// Returns what the encode saw (block_counts).
using adam_compressed_fn = block_counts (*)(const compressed_call& call, float* p, void* m, void* v, std::uint8_t* scales,
                                    const void* grad, void* out, std::size_t n) noexcept;
/// Its roofline twin: the same loads and stores, no arithmetic.
using roofline_compressed_fn = void (*)(float* p, void* m, void* v, std::uint8_t* scales, const void* grad,
                                        void* out, std::size_t n) noexcept;

/// f32 moments -> a compressed format, rounded stochastically with `key` (a step key) from
/// arena index `first` on (a multiple of q8_block for 8-bit): lossy.
using encode_moments_fn = void (*)(const float* m, const float* v, void* m_codes, void* v_codes, std::uint8_t* scales,
                                   std::size_t n, std::uint64_t key, std::uint64_t first) noexcept;
/// A compressed format -> f32 moments (exact: every code is an f32 value).
using decode_moments_fn = void (*)(const void* m_codes, const void* v_codes, const std::uint8_t* scales, float* m,
                                   float* v, std::size_t n) noexcept;

inline constexpr int num_grad_types = 3; // dtype f32, bf16, f16
inline constexpr int num_out_types = 4;  // none, then dtype f32, bf16, f16
inline constexpr int num_decay_kinds = 3;

/// The raw function table an instruction set fills (cpu_adam/adam_kernel.hpp). Nothing
/// outside kernel_set indexes it: callers use kernel_set's typed accessors.
struct kernel_table {
  adam_fn adam[num_grad_types][num_out_types][num_decay_kinds][2];
  // optax form: p read only (for weight decay; may be null without it), `out` in the
  // gradient's dtype receives the update new_p - p.
  adam_fn delta[num_grad_types][num_decay_kinds][2];
  roofline_fn roofline[num_grad_types][num_out_types];
  cast_fn cast[num_out_types]; // indexed like the out column; [0] and [1] are null
  add_grad_fn add_grad[num_grad_types];
  sumsq_fn sumsq[num_grad_types];
  // [format - 1]: bf16, q8.
  adam_compressed_fn adam_compressed[2][num_grad_types][num_out_types];
  // The optax form over compressed moments (update in the gradient's dtype; p read only).
  adam_compressed_fn delta_compressed[2][num_grad_types];
  roofline_compressed_fn roofline_compressed[2][num_grad_types][num_out_types];
  encode_moments_fn encode_moments[2];
  decode_moments_fn decode_moments[2];
};

/// One instruction set's kernels, simdjson's `implementation`: a name, a description, the
/// instruction sets the CPU (and OS) must support, and typed access to every kernel.
class kernel_set {
public:
  constexpr kernel_set(const char* name, const char* description, const char* required, const kernel_table& table)
      : name_(name), description_(description), required_(required), table_(table) {}

  /// "avx512", "avx2", "sse2", "neon" or "scalar".
  constexpr const char* name() const { return name_; }
  constexpr const char* description() const { return description_; }
  /// The CPU features its translation unit is compiled for (what the registry checks).
  constexpr const char* required_instruction_sets() const { return required_; }

  /// The fused step for gradients in `grad`, a copy-out in `out` (none when empty).
  adam_fn adam(dtype grad, std::optional<dtype> out, decay_kind decay, bool nesterov) const noexcept {
    return table_.adam[int(grad)][out_column(out)][int(decay)][nesterov];
  }
  /// The optax form (update = new_p - p, in the gradient's dtype).
  adam_fn delta(dtype grad, decay_kind decay, bool nesterov) const noexcept {
    return table_.delta[int(grad)][int(decay)][nesterov];
  }
  /// The roofline twin of adam(grad, out, ...): the same loads and stores, no arithmetic.
  roofline_fn roofline(dtype grad, std::optional<dtype> out) const noexcept {
    return table_.roofline[int(grad)][out_column(out)];
  }
  /// f32 -> a 16-bit dtype, round to nearest even (null for f32: a memcpy).
  cast_fn cast(dtype out) const noexcept { return table_.cast[out_column(out)]; }
  /// The fused step over moments stored as `format` (not f32: adam() is that one).
  adam_compressed_fn adam_compressed(moment_format format, dtype grad, std::optional<dtype> out) const noexcept {
    return table_.adam_compressed[int(format) - 1][int(grad)][out_column(out)];
  }
  /// The optax form over moments stored as `format` (update = new_p - p, in grad's dtype).
  adam_compressed_fn delta_compressed(moment_format format, dtype grad) const noexcept {
    return table_.delta_compressed[int(format) - 1][int(grad)];
  }
  roofline_compressed_fn roofline_compressed(moment_format format, dtype grad, std::optional<dtype> out) const noexcept {
    return table_.roofline_compressed[int(format) - 1][int(grad)][out_column(out)];
  }
  encode_moments_fn encode_moments(moment_format format) const noexcept {
    return table_.encode_moments[int(format) - 1];
  }
  decode_moments_fn decode_moments(moment_format format) const noexcept {
    return table_.decode_moments[int(format) - 1];
  }
  add_grad_fn add_grad(dtype grad) const noexcept { return table_.add_grad[int(grad)]; }
  sumsq_fn sumsq(dtype grad) const noexcept { return table_.sumsq[int(grad)]; }

private:
  static constexpr int out_column(std::optional<dtype> out) { return out ? 1 + int(*out) : 0; }
  const char* name_;
  const char* description_;
  const char* required_;
  kernel_table table_;
};

// One per instruction set compiled in (defined in cpu_adam/arch_*.cpp).
extern const kernel_set kernel_set_avx512;
extern const kernel_set kernel_set_avx2;
extern const kernel_set kernel_set_sse2;
extern const kernel_set kernel_set_neon;
extern const kernel_set kernel_set_scalar;

} // namespace hostopt::detail
