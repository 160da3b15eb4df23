#pragma once
/// \file kernels.hpp
/// The SIMD kernels compiled into this build, which one runs, and the one-buffer step.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "hostopt/adam_config.hpp"
#include "hostopt/dtype.hpp"
#include "hostopt/moment_format.hpp"

namespace hostopt {

/// One kernel (instruction set) compiled into this build.
struct kernel_info {
  std::string name;        ///< "avx512", "avx2", "sse2", "neon" or "scalar"
  bool supported;          ///< this CPU and OS can run it
  std::string description; ///< what it is, e.g. "AVX2: 8 floats per vector, F16C conversions"
  std::string required;    ///< the CPU features it needs (what "supported" checked)
};

/// Every kernel compiled in, best first.
std::vector<kernel_info> kernels();

/// Name of the kernel used when none is asked for: the best supported one, or the one
/// named by the environment variable HOSTOPT_FORCE_ARCH. Decided on first call; throws
/// std::invalid_argument for an unknown forced name and std::runtime_error for a forced
/// kernel this CPU cannot run (never a silent fallback).
std::string active_kernel();

/// The most worker threads a step may ask for: 4 x the hardware threads, at most 1024.
/// More is refused with std::invalid_argument (threading runtimes crash or abort on huge
/// counts; no step gains from oversubscription).
int max_threads();

/// How a step runs. Results are bitwise identical for every choice here.
struct execution_options {
  /// Worker threads, in [0, max_threads()]; 0 means the threading runtime's default.
  int threads = 0;
  std::string kernel; ///< kernel name from kernels(); empty means active_kernel()
};

/// One fused Adam/AdamW step (docs/design.md, "The update rule") over `n` contiguous f32 elements owned by the
/// caller: reads grad (f32/bf16/f16), updates params/exp_avg/exp_avg_sq in place and,
/// when `out.data` is set, writes the new parameters to `out` in its dtype, in one pass.
/// `step` is the 1-based step number t used for bias correction; `grad_scale` multiplies
/// the gradient first (1/loss_scale times the clip coefficient).
/// Throws std::invalid_argument (nothing written) for null, overlapping or mis-sized
/// buffers, an unknown dtype, bad hyper-parameters or step < 1.
void adam_step(float* params, float* exp_avg, float* exp_avg_sq, std::size_t n,
               const_view grad, mut_view out, const adam_config& config, std::int64_t step,
               float grad_scale = 1.0f, const execution_options& exec = {});

/// Adam moments of n elements stored compressed (moment_format.hpp), in buffers the caller
/// owns: exp_avg and exp_avg_sq hold n bf16 values or n 8-bit codes each; for 8-bit,
/// `scales` holds 2 bytes (the two moments' block exponents) per started block of
/// q8_block elements. Zero bytes everywhere are zero moments.
struct compressed_moments {
  moment_format format = moment_format::bf16; ///< bf16 or q8 (f32 moments: the float* overload)
  void* exp_avg = nullptr;
  void* exp_avg_sq = nullptr;
  std::uint8_t* scales = nullptr; ///< q8 only (null for bf16)
};
/// Bytes of compressed_moments::scales for n elements (0 for bf16).
std::size_t moment_scale_bytes(moment_format format, std::size_t n);
/// Where the stochastic rounding of compressed moments draws from: the random bits of
/// element i at step t are a function of (seed, t, first_index + i) and nothing else, so the
/// same state steps to the same bits whatever the kernel, threads or chunking. When the
/// buffers are part of a larger state stepped in pieces, first_index is the piece's
/// offset in it (a multiple of q8_block for 8-bit) and each piece rounds as the whole.
///
/// An 8-bit block's exponents are shared by its 32 elements, so a piece must end on a
/// block or where the state ends: state_size (0: this piece ends the state) says where.
/// A piece ending inside a block anywhere else is refused (it would re-scale elements it
/// does not hold).
struct rounding_stream {
  std::uint64_t seed = 0;
  std::uint64_t first_index = 0;
  std::uint64_t state_size = 0;
};
/// adam_step with compressed moments: decode, update (the bits the f32 step gives for the
/// decoded moments), re-encode with stochastic rounding, copy-out, in one pass.
/// Throws std::invalid_argument (nothing written) as adam_step does, for format f32 or an
/// unknown one, null or overlapping moment buffers, or first_index not on a block (8-bit).
void adam_step(float* params, const compressed_moments& moments, std::size_t n, const_view grad, mut_view out,
               const adam_config& config, std::int64_t step, float grad_scale = 1.0f,
               const rounding_stream& rounding = {}, const execution_options& exec = {});
/// Lossy conversion of f32 moments to a compressed format (stochastic rounding keyed on
/// rounding.seed with step 0 and the element indices; pieces as for adam_step). Throws
/// std::invalid_argument like adam_step for bad buffers, and for a negative exp_avg_sq.
void encode_moments(const float* exp_avg, const float* exp_avg_sq, const compressed_moments& out, std::size_t n,
                    const rounding_stream& rounding = {});
/// Compressed moments to f32 (exact: every code is an f32 value). Throws like adam_step.
void decode_moments(const compressed_moments& in, std::size_t n, float* exp_avg, float* exp_avg_sq);
/// The optax form of the step, for frameworks that apply updates themselves: `params` is
/// only read (for weight decay; it may be null when weight_decay is 0), the moments are
/// updated in place, and `update` — in the gradient's dtype — receives
/// new_params - params = -(Adam step) - lr * wd * params, in the same single pass.
/// `update` may be `grad` itself (the update overwrites the gradient, in place); any other
/// overlap between the buffers is refused. As in optax, lr and weight_decay may be negative
/// here (a negative learning rate ascends), and eps or eps_root may be +inf (Adam's term is
/// then 0: the update is the decay term alone); adam_step and the optimizer refuse both.
/// Throws std::invalid_argument like adam_step, and when update's dtype is not grad's.
void adam_update(const float* params, float* exp_avg, float* exp_avg_sq, std::size_t n, const_view grad,
                 mut_view update, const adam_config& config, std::int64_t step, float grad_scale = 1.0f,
                 const execution_options& exec = {});

/// One array of an optax-form update over many (a pytree's leaves): see adam_update.
struct update_leaf {
  const float* params = nullptr; ///< read for weight decay; may be null when its config has none
  float* exp_avg = nullptr;      ///< updated in place
  float* exp_avg_sq = nullptr;   ///< updated in place
  const_view grad;               ///< the gradient (its size is the leaf's)
  mut_view update;               ///< receives new_p - p, in the gradient's dtype
  std::size_t config = 0;        ///< index of its hyper-parameters in `configs`
};

/// adam_update over many leaves in one call and one parallel region: the leaves' elements
/// are split across threads as one range (a pytree of a thousand small leaves costs one
/// region, not a thousand), each leaf with its config's kernel and per-step scalars,
/// computed once per config. Every leaf is validated before anything is written
/// (std::invalid_argument naming "leaves[i]"); one gradient dtype for all leaves.
void adam_update(std::span<const update_leaf> leaves, std::span<const adam_config> configs, std::int64_t step,
                 float grad_scale = 1.0f, const execution_options& exec = {});

/// One leaf of an optax-form update whose moments are compressed (bf16 or 8-bit): each
/// leaf is a whole state of its own (its last 8-bit block may end early).
struct compressed_update_leaf {
  const float* params = nullptr; ///< read for weight decay; may be null when its config has none
  compressed_moments moments;    ///< updated in place (codes and, 8-bit, block exponents)
  const_view grad;               ///< the gradient (its size is the leaf's)
  mut_view update;               ///< receives new_p - p, in the gradient's dtype
  std::size_t config = 0;        ///< index of its hyper-parameters in `configs`
  /// Where its stochastic rounding's element indices start (rounding_stream::first_index;
  /// a multiple of q8_block for 8-bit): distinct leaves should not share indices.
  std::uint64_t first_index = 0;
};

/// adam_update over leaves with compressed moments: each leaf's update is the bits the f32
/// form gives for its decoded moments, and its moments are re-encoded as adam_step with
/// compressed moments does (stochastic rounding keyed on `rounding_seed`, the step and
/// first_index + i), whatever the threads. One parallel region; no 8-bit block is split
/// between threads. Validated like the f32 adam_update, nothing written on error.
void adam_update(std::span<const compressed_update_leaf> leaves, std::span<const adam_config> configs,
                 std::int64_t step, float grad_scale = 1.0f, std::uint64_t rounding_seed = 0,
                 const execution_options& exec = {});

/// Gradient accumulation across micro-batches, in f32: acc = grad when `first`, else
/// acc = grad + acc. grad may be f32, bf16 or f16; n = grad.size elements of acc.
/// Throws std::invalid_argument for null or overlapping buffers or a bad dtype.
void accumulate_gradient(float* acc, const_view grad, bool first, const execution_options& exec = {});

/// Converts n = out.size f32 values to out's dtype (round to nearest even for bf16/f16),
/// the rounding of the step's copy-out. Throws std::invalid_argument for bad buffers.
void convert_params(const float* in, mut_view out, const execution_options& exec = {});

} // namespace hostopt
