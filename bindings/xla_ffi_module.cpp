// hostopt._xla_ffi: the optax-form Adam update as an XLA FFI handler, so that
// hostopt.optax runs under jax.jit without a Python callback: XLA calls straight into
// hostopt::adam_update with the buffers it owns, and mu/nu are updated in place (the
// caller aliases them to the outputs).
//
// Written against XLA FFI's versioned C API (xla/ffi/api/c_api.h, from any jaxlib >= 0.4.34
// at build time; pip's isolated build takes it from the jaxlib build requirement) rather than
// its C++ wrapper, whose spelling changes between releases. One build serves every jaxlib
// whose FFI is API 0.1 or newer, whichever jaxlib it was built with:
//   - the handlers read only what API 0.1 fixed and later versions kept in place: the call
//     frame (args, rets, attrs, stage), buffers, and XLA_FFI_Api's first function,
//     XLA_FFI_Error_Create (later versions inserted functions further down the table);
//   - XLA asks each handler which API version it speaks (the metadata extension) when it is
//     registered and refuses one outside its range, so the handler answers the newest version
//     that both its headers and the asking XLA know: the XLA's own, where it says (current
//     XLA passes its API table), else 0.1 (older XLA passes none; 0.1 is their oldest).
// API 0.0 (jaxlib < 0.4.34) laid out XLA_FFI_Api and the stages differently: hostopt.optax
// never registers the handlers there (hostopt/_xla.py).
//
// Call "hostopt_adam_update" (see hostopt/optax.py, which builds it):
//   operands: count s32[]  (optax's count; bias correction uses t = count + 1, saturating)
//             hp f32[k]|f64[k] (the traced hyper-parameters, in field order lr, b1, b2,
//                               eps, eps_root, wd, those whose bit is set in `traced`)
//             then per leaf: g (f32|bf16|f16), mu f32, nu f32, and p f32 if the leaf decays
//   results:  per leaf: u (g's dtype), mu, nu (aliased to g, mu and nu: the kernel may
//             write the update over the gradient, hostopt::adam_update allows exactly that)
//   attributes: lr b1 b2 eps eps_root wd (f64, static values), traced (i64 bit mask),
//               nesterov, threads (i64), decays (string, one '0'/'1' per leaf)
//
// Call "hostopt_adam_update_compressed": the same over compressed moments
// (hostopt::compressed_update_leaf), one leaf, or one shard of it, per operand group:
//   operands: count, hp, check (s32[3]: row -2, the call checks the exponent bytes it
//             holds; else, for a call run per shard, row, column and value of the first
//             byte of the whole scales array that the 8-bit encoder never writes, or row
//             -1, computed by XLA, so that every shard refuses it alike),
//             then per leaf: g, mu, nu (bf16 values, or u8 8-bit codes), p f32
//             if the leaf decays, piece (u32[1]: which of its leaf's equal pieces along
//             dim 0 this buffer is; 0 for the whole leaf), and for 8-bit the exponent
//             bytes of its 32-element blocks (u8 [ceil(n / 32), 2])
//   results:  per leaf: u, mu, nu, then its exponent bytes (8-bit); aliased to the operands
//   attributes: as above, plus moments ("bf16" or "8bit"), seed_lo, seed_hi (i64: the
//               rounding seed's low and high 32 bits) and firsts (string: each leaf's
//               first rounding index, decimal, comma-separated)
//   A buffer of n elements starts its rounding indices at its leaf's first + piece * n: a
//   shard of an even cut along dim 0 (8-bit: on a block) rounds as the whole leaf does, so
//   the update is a function of the leaves alone, however they are sharded.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "xla/ffi/api/c_api.h"

#if XLA_FFI_API_MAJOR != 0 || XLA_FFI_API_MINOR < 1
#error "hostopt's XLA FFI handlers need the FFI headers of jaxlib 0.4.34 or newer (XLA FFI API 0.1+)"
#endif

#include "hostopt/adam_config.hpp"
#include "hostopt/kernels.hpp"
#include "hostopt/moment_format.hpp"

#include "../cpu_adam/q8_exponents.hpp" // the exponent bytes the 8-bit encoder writes

namespace py = pybind11;

namespace {

using hostopt::adam_config;

XLA_FFI_Error* make_error(const XLA_FFI_Api* api, XLA_FFI_Error_Code code, const std::string& message) {
  XLA_FFI_Error_Create_Args args{};
  args.struct_size = XLA_FFI_Error_Create_Args_STRUCT_SIZE;
  args.message = message.c_str(); // XLA copies it into its status
  args.errc = code;
  return api->XLA_FFI_Error_Create(&args);
}

std::size_t element_count(const XLA_FFI_Buffer* b) {
  std::size_t n = 1;
  for (int64_t i = 0; i < b->rank; ++i) n *= static_cast<std::size_t>(b->dims[i]);
  return n;
}

hostopt::dtype grad_dtype(XLA_FFI_DataType t, const std::string& what) {
  switch (t) {
  case XLA_FFI_DataType_F32: return hostopt::dtype::f32;
  case XLA_FFI_DataType_BF16: return hostopt::dtype::bf16;
  case XLA_FFI_DataType_F16: return hostopt::dtype::f16;
  default: throw std::invalid_argument(what + ": dtype code " + std::to_string(int(t)) + " is not float32, bfloat16 or float16");
  }
}

struct call_attributes {
  double values[6] = {1e-3, 0.9, 0.999, 1e-8, 0.0, 0.0}; // lr, b1, b2, eps, eps_root, wd
  int64_t traced = 0;
  int64_t nesterov = 0;
  int64_t threads = 0;
  int64_t seed_lo = 0, seed_hi = 0;
  std::string decays;
  std::string moments;
  std::string firsts;
};

call_attributes read_attributes(const XLA_FFI_Attrs& attrs) {
  static constexpr const char* names[6] = {"lr", "b1", "b2", "eps", "eps_root", "wd"};
  call_attributes out;
  for (int64_t i = 0; i < attrs.size; ++i) {
    const std::string_view name(attrs.names[i]->ptr, attrs.names[i]->len);
    if (attrs.types[i] == XLA_FFI_AttrType_STRING) {
      const auto* s = static_cast<const XLA_FFI_ByteSpan*>(attrs.attrs[i]);
      if (name == "decays") out.decays.assign(s->ptr, s->len);
      if (name == "moments") out.moments.assign(s->ptr, s->len);
      if (name == "firsts") out.firsts.assign(s->ptr, s->len);
      continue;
    }
    if (attrs.types[i] != XLA_FFI_AttrType_SCALAR) continue;
    const auto* s = static_cast<const XLA_FFI_Scalar*>(attrs.attrs[i]);
    for (int k = 0; k < 6; ++k)
      if (name == names[k]) {
        if (s->dtype != XLA_FFI_DataType_F64) throw std::invalid_argument(std::string("attribute ") + names[k] + " is not f64");
        std::memcpy(&out.values[k], s->value, sizeof(double));
      }
    int64_t* target = name == "traced" ? &out.traced : name == "nesterov" ? &out.nesterov
                      : name == "threads" ? &out.threads : name == "seed_lo" ? &out.seed_lo
                      : name == "seed_hi" ? &out.seed_hi : nullptr;
    if (target != nullptr) {
      if (s->dtype != XLA_FFI_DataType_S64) throw std::invalid_argument("attribute " + std::string(name) + " is not i64");
      std::memcpy(target, s->value, sizeof(int64_t));
    }
  }
  return out;
}

const XLA_FFI_Buffer* arg(const XLA_FFI_CallFrame* frame, int64_t i) {
  if (i >= frame->args.size) throw std::invalid_argument("too few operands (" + std::to_string(frame->args.size) + ")");
  if (frame->args.types[i] != XLA_FFI_ArgType_BUFFER) throw std::invalid_argument("operand " + std::to_string(i) + " is not a buffer");
  return static_cast<const XLA_FFI_Buffer*>(frame->args.args[i]);
}

const XLA_FFI_Buffer* ret(const XLA_FFI_CallFrame* frame, int64_t i) {
  if (i >= frame->rets.size) throw std::invalid_argument("too few results (" + std::to_string(frame->rets.size) + ")");
  if (frame->rets.types[i] != XLA_FFI_RetType_BUFFER) throw std::invalid_argument("result " + std::to_string(i) + " is not a buffer");
  return static_cast<const XLA_FFI_Buffer*>(frame->rets.rets[i]);
}

// What both calls share: the step number from optax's count and the two configs (no
// decay, decayed) from the static and traced hyper-parameters.
struct call_setup {
  std::int64_t step = 1;
  adam_config configs[2];
};

// x as Python's repr writes a float (shortest round trip; "1.0", "nan", "inf"), so the
// handler names a value as the Python checks do.
std::string number(double x) {
  if (std::isnan(x)) return "nan";
  char buf[40];
  const auto end = std::to_chars(buf, buf + sizeof buf, x).ptr;
  std::string s(buf, end);
  if (std::isfinite(x) && s.find_first_of(".e") == std::string::npos) s += ".0";
  return s;
}

// The hyper-parameters hostopt.optax takes (the same rule as its Python checks, which
// refuse concrete values before the call): a traced one outside it is refused here, before
// anything is written, naming it. eps and eps_root may be +inf: Adam's term is then 0, as
// optax's arithmetic gives.
void check_hyperparameters(const double (&v)[6]) {
  static constexpr const char* names[6] = {"learning_rate", "b1", "b2", "eps", "eps_root", "weight_decay"};
  for (int k = 0; k < 6; ++k) {
    const bool ok = k == 1 || k == 2   ? v[k] >= 0 && v[k] < 1
                    : k == 3 || k == 4 ? v[k] >= 0
                                       : std::isfinite(v[k]);
    if (!ok)
      throw std::invalid_argument(std::string(names[k]) + " = " + number(v[k]) + ": expected " +
                                  (k == 1 || k == 2   ? "a value in [0, 1)"
                                   : k == 3 || k == 4 ? "a value >= 0 (+inf included)"
                                                      : "a finite value") +
                                  " (hostopt.optax refuses a hyper-parameter outside its range, traced or not)");
  }
}

call_setup setup_call(const XLA_FFI_CallFrame* frame, const call_attributes& at) {
  call_setup out;
  const XLA_FFI_Buffer* count = arg(frame, 0);
  if (count->dtype != XLA_FFI_DataType_S32 || element_count(count) != 1)
    throw std::invalid_argument("count must be an int32 scalar");
  int32_t c = 0;
  std::memcpy(&c, count->data, sizeof c);
  if (c < 0) throw std::invalid_argument("count = " + std::to_string(c) + " is negative");
  out.step = c == INT32_MAX ? int64_t(INT32_MAX) : int64_t(c) + 1; // optax's safe increment

  double values[6];
  std::memcpy(values, at.values, sizeof values);
  const XLA_FFI_Buffer* hp = arg(frame, 1);
  std::size_t next_hp = 0;
  for (int k = 0; k < 6; ++k) {
    if (!(at.traced >> k & 1)) continue;
    if (next_hp >= element_count(hp)) throw std::invalid_argument("hp has fewer values than traced bits");
    if (hp->dtype == XLA_FFI_DataType_F32)
      values[k] = static_cast<const float*>(hp->data)[next_hp++];
    else if (hp->dtype == XLA_FFI_DataType_F64)
      values[k] = static_cast<const double*>(hp->data)[next_hp++];
    else
      throw std::invalid_argument("hp must be float32 or float64");
  }
  adam_config base;
  base.lr = values[0];
  base.beta1 = values[1];
  base.beta2 = values[2];
  base.eps = values[3];
  base.eps_root = values[4];
  base.mode = hostopt::adam_mode::adamw;
  base.nesterov = at.nesterov != 0;
  adam_config decayed = base;
  decayed.weight_decay = values[5];
  check_hyperparameters(values);
  out.configs[0] = base;
  out.configs[1] = decayed;
  return out;
}

// One leaf's operands and results, in both calls' order: g, mu, nu, p (when it decays)
// from operand `next` on (advanced); u, mu, nu as the leaf's first results (`per_leaf`
// results each).
struct leaf_buffers {
  const XLA_FFI_Buffer *g, *mu, *nu, *p, *u, *mu_out, *nu_out;
  hostopt::dtype grad_type;
  std::size_t n;
};

leaf_buffers leaf_at(const XLA_FFI_CallFrame* frame, int64_t& next, std::size_t i, bool decays,
                     std::size_t per_leaf = 3) {
  leaf_buffers b{};
  b.g = arg(frame, next++);
  b.mu = arg(frame, next++);
  b.nu = arg(frame, next++);
  b.p = decays ? arg(frame, next++) : nullptr;
  b.u = ret(frame, int64_t(per_leaf * i));
  b.mu_out = ret(frame, int64_t(per_leaf * i + 1));
  b.nu_out = ret(frame, int64_t(per_leaf * i + 2));
  b.grad_type = grad_dtype(b.g->dtype, "leaf " + std::to_string(i) + " gradient");
  b.n = element_count(b.g);
  if (b.u->dtype != b.g->dtype || element_count(b.u) != b.n)
    throw std::invalid_argument("leaf " + std::to_string(i) + ": the update must have the gradient's dtype and size");
  if (b.p != nullptr && (b.p->dtype != XLA_FFI_DataType_F32 || element_count(b.p) != b.n))
    throw std::invalid_argument("leaf " + std::to_string(i) + ": params must be float32 of the gradient's size");
  return b;
}

// The whole call: validates everything before the first write, then one
// hostopt::adam_update (one parallel region) per gradient dtype.
void adam_update_call(const XLA_FFI_CallFrame* frame) {
  const call_attributes at = read_attributes(frame->attrs);
  const call_setup setup = setup_call(frame, at);
  const adam_config* configs = setup.configs;
  const std::size_t leaves = at.decays.size();
  std::vector<hostopt::update_leaf> by_dtype[3];
  int64_t next = 2;
  for (std::size_t i = 0; i < leaves; ++i) {
    const bool decays = at.decays[i] == '1';
    const auto [g, mu, nu, p, u, mu_out, nu_out, gt, n] = leaf_at(frame, next, i, decays);
    for (const XLA_FFI_Buffer* b : {mu, nu, mu_out, nu_out})
      if (b->dtype != XLA_FFI_DataType_F32 || element_count(b) != n)
        throw std::invalid_argument("leaf " + std::to_string(i) + ": mu and nu must be float32 of the gradient's size");
    // The moments are updated in place in the results; XLA aliases them to the operands,
    // so the copy below happens only if a caller did not.
    if (mu_out->data != mu->data) std::memcpy(mu_out->data, mu->data, n * sizeof(float));
    if (nu_out->data != nu->data) std::memcpy(nu_out->data, nu->data, n * sizeof(float));
    by_dtype[int(gt)].push_back({p ? static_cast<const float*>(p->data) : nullptr, static_cast<float*>(mu_out->data),
                                 static_cast<float*>(nu_out->data), {g->data, n, gt}, {u->data, n, gt},
                                 decays ? std::size_t(1) : std::size_t(0)});
  }
  if (next != frame->args.size || int64_t(3 * leaves) != frame->rets.size)
    throw std::invalid_argument("operand or result count does not match the leaves");
  for (auto& group : by_dtype)
    if (!group.empty())
      hostopt::adam_update(group, std::span<const adam_config>(configs, 2), setup.step, 1.0f,
                           {static_cast<int>(at.threads), ""});
}

// The `firsts` attribute: one index per leaf.
std::vector<std::uint64_t> parse_firsts(const std::string& text, std::size_t leaves) {
  std::vector<std::uint64_t> out;
  for (std::size_t at = 0; at < text.size() && out.size() <= leaves;) {
    const std::size_t end = std::min(text.find(',', at), text.size());
    std::uint64_t v = 0;
    if (end == at) throw std::invalid_argument("firsts: an empty entry in '" + text + "'");
    for (std::size_t i = at; i < end; ++i) {
      if (text[i] < '0' || text[i] > '9' || v > (UINT64_MAX - 9) / 10)
        throw std::invalid_argument("firsts: '" + text + "' is not comma-separated decimal indices");
      v = v * 10 + std::uint64_t(text[i] - '0');
    }
    out.push_back(v);
    at = end + 1;
  }
  if (out.size() != leaves)
    throw std::invalid_argument("firsts has " + std::to_string(out.size()) + " entries for " + std::to_string(leaves) +
                                " leaves");
  return out;
}

// Where a buffer of n elements starts its rounding indices: its leaf's first, plus its
// piece's index times n (the pieces of an even cut along dim 0 are all n long). One number
// per buffer, not one per row: a row array as long as a 1-D leaf cost 4 bytes per element
// every step.
std::uint64_t buffer_first(const XLA_FFI_Buffer* piece, std::uint64_t leaf_first, std::size_t n, std::size_t i) {
  const std::string at = "leaf " + std::to_string(i) + ": piece";
  if (piece->dtype != XLA_FFI_DataType_U32 || piece->rank != 1 || element_count(piece) != 1)
    throw std::invalid_argument(at + " must be uint32 [1] (which of the leaf's equal pieces this buffer is)");
  std::uint32_t k = 0;
  std::memcpy(&k, piece->data, sizeof k);
  if (n == 0) return leaf_first;
  if (k != 0 && n > UINT64_MAX / k) throw std::invalid_argument(at + ": its rounding indices overflow");
  const std::uint64_t offset = std::uint64_t(k) * n;
  if (leaf_first > UINT64_MAX - n || offset > UINT64_MAX - n - leaf_first)
    throw std::invalid_argument(at + ": its rounding indices overflow");
  return leaf_first + offset;
}

// The message refusing an exponent byte the 8-bit encoder never writes (a corrupt or foreign
// state, which would decode as NaN forever after): leaf, its block, which moment, the byte.
std::string bad_exponent(std::size_t leaf, std::uint64_t block, bool v, int byte) {
  using namespace hostopt::detail;
  return "leaf " + std::to_string(leaf) + ": block " + std::to_string(block) + "'s " + (v ? "exp_avg_sq" : "exp_avg") +
         " exponent byte is " + std::to_string(byte) + ": the 8-bit encoder writes at most " +
         std::to_string(v ? q8_v_max_base : q8_m_max_base) + " (or " + std::to_string(q8_poisoned_base) +
         " for a non-finite block): the state is corrupt or not hostopt's";
}

// A buffer's exponent bytes (m's, v's per block; its first block is the leaf's block
// `first_block`), when the call holds whole leaves.
void check_exponents(const std::uint8_t* pairs, std::size_t blocks, std::uint64_t first_block, std::size_t leaf) {
  using namespace hostopt::detail;
  bool bad = false; // a branch-free pass first (every step reads them): the message only when needed
  for (std::size_t b = 0; b < blocks; ++b)
    bad |= (pairs[2 * b] > q8_m_max_base && pairs[2 * b] != q8_poisoned_base) |
           (pairs[2 * b + 1] > q8_v_max_base && pairs[2 * b + 1] != q8_poisoned_base);
  if (!bad) return;
  for (std::size_t b = 0; b < blocks; ++b)
    for (int k = 0; k < 2; ++k)
      if (!q8_base_is_written(pairs[2 * b + std::size_t(k)], k == 1))
        throw std::invalid_argument(bad_exponent(leaf, first_block + b, k == 1, pairs[2 * b + std::size_t(k)]));
}

// The `check` operand (s32[3]): row -2, the call checks the exponent bytes it holds (whole
// leaves); else the answer XLA found over the whole scales array for a call run per shard,
// handed to every shard so that all refuse together (one shard refusing alone would leave
// the others waiting in the next collective): row -1, none; else (row, column, byte) of
// the first bad byte, refused naming the leaf (the last whose first block is at or before
// the row) and its block. Returns whether the call checks its own bytes.
bool read_exponent_check(const XLA_FFI_Buffer* check, const std::vector<std::uint64_t>& firsts) {
  if (check->dtype != XLA_FFI_DataType_S32 || element_count(check) != 3)
    throw std::invalid_argument("check must be int32 [3] (row, column, byte of a bad exponent byte, or row -1 or -2)");
  std::int32_t c[3];
  std::memcpy(c, check->data, sizeof c);
  if (c[0] == -2) return true;
  if (c[0] < 0) return false;
  if (firsts.empty()) throw std::invalid_argument("check names exponent row " + std::to_string(c[0]) + " of no leaf");
  const std::uint64_t row = std::uint64_t(c[0]);
  std::size_t leaf = 0;
  for (std::size_t i = 0; i < firsts.size(); ++i)
    if (firsts[i] / hostopt::q8_block <= row) leaf = i;
  throw std::invalid_argument(bad_exponent(leaf, row - firsts[leaf] / hostopt::q8_block, c[1] == 1, c[2]));
}

// The call over compressed moments: validated completely (the kernel's own checks too),
// then one hostopt::adam_update of compressed_update_leaf per gradient dtype.
void adam_update_compressed_call(const XLA_FFI_CallFrame* frame) {
  const call_attributes at = read_attributes(frame->attrs);
  const call_setup setup = setup_call(frame, at);
  const hostopt::moment_format format = hostopt::parse_moment_format(at.moments);
  if (format == hostopt::moment_format::f32) throw std::invalid_argument("moments = f32: use hostopt_adam_update");
  const bool q8 = format == hostopt::moment_format::q8;
  const XLA_FFI_DataType code_type = q8 ? XLA_FFI_DataType_U8 : XLA_FFI_DataType_BF16;
  if (at.seed_lo < 0 || at.seed_lo > INT64_C(0xFFFFFFFF) || at.seed_hi < 0 || at.seed_hi > INT64_C(0xFFFFFFFF))
    throw std::invalid_argument("seed_lo and seed_hi must each be in [0, 2^32)");
  const std::uint64_t seed = std::uint64_t(at.seed_lo) | std::uint64_t(at.seed_hi) << 32;
  const std::size_t leaves = at.decays.size();
  const std::vector<std::uint64_t> firsts = parse_firsts(at.firsts, leaves);
  const bool check_here = read_exponent_check(arg(frame, 2), firsts);
  const std::size_t per_leaf = q8 ? 4 : 3;
  std::vector<hostopt::compressed_update_leaf> by_dtype[3];
  struct copy_in { const XLA_FFI_Buffer *from, *to; std::size_t bytes; };
  std::vector<copy_in> copies; // operands to their results where XLA did not alias them
  int64_t next = 3; // after count, hp and check
  for (std::size_t i = 0; i < leaves; ++i) {
    const bool decays = at.decays[i] == '1';
    const auto [g, mu, nu, p, u, mu_out, nu_out, gt, n] = leaf_at(frame, next, i, decays, per_leaf);
    for (const XLA_FFI_Buffer* b : {mu, nu, mu_out, nu_out})
      if (b->dtype != code_type || element_count(b) != n)
        throw std::invalid_argument("leaf " + std::to_string(i) + ": mu and nu must be " +
                                    (q8 ? "uint8 codes" : "bfloat16") + " of the gradient's size");
    const std::uint64_t first = buffer_first(arg(frame, next++), firsts[i], n, i);
    const std::size_t code_bytes = n * hostopt::moment_code_bytes(format);
    copies.push_back({mu, mu_out, code_bytes});
    copies.push_back({nu, nu_out, code_bytes});
    std::uint8_t* scales = nullptr;
    if (q8) {
      const XLA_FFI_Buffer* in = arg(frame, next++);
      const XLA_FFI_Buffer* out = ret(frame, int64_t(per_leaf * i + 3));
      const std::size_t bytes = hostopt::moment_scale_bytes(format, n);
      for (const XLA_FFI_Buffer* b : {in, out})
        if (b->dtype != XLA_FFI_DataType_U8 || element_count(b) != bytes)
          throw std::invalid_argument("leaf " + std::to_string(i) + ": its exponent bytes must be uint8 [" +
                                      std::to_string(bytes / 2) + ", 2] (one pair per 32-element block)");
      if (check_here)
        check_exponents(static_cast<const std::uint8_t*>(in->data), bytes / 2, (first - firsts[i]) / hostopt::q8_block, i);
      copies.push_back({in, out, bytes});
      scales = static_cast<std::uint8_t*>(out->data);
    }
    by_dtype[int(gt)].push_back({p ? static_cast<const float*>(p->data) : nullptr,
                                 {format, mu_out->data, nu_out->data, scales}, {g->data, n, gt}, {u->data, n, gt},
                                 decays ? std::size_t(1) : std::size_t(0), first});
  }
  if (next != frame->args.size || int64_t(per_leaf * leaves) != frame->rets.size)
    throw std::invalid_argument("operand or result count does not match the leaves");
  for (const copy_in& c : copies)
    if (c.to->data != c.from->data) std::memcpy(c.to->data, c.from->data, c.bytes);
  for (auto& group : by_dtype)
    if (!group.empty())
      hostopt::adam_update(group, std::span<const adam_config>(setup.configs, 2), setup.step, 1.0f, seed,
                           {static_cast<int>(at.threads), ""});
}

// One FFI handler around `call`: the metadata query of newer XLA, errors as XLA errors.
// The FFI version a handler answers XLA's metadata query with (see the top of this file).
XLA_FFI_Api_Version answered_api_version(const XLA_FFI_Api* asking) {
  constexpr int oldest_with_this_layout = 1;
  int minor = oldest_with_this_layout;
  const std::size_t version_end = offsetof(XLA_FFI_Api, api_version) + sizeof(XLA_FFI_Api_Version);
  if (asking != nullptr && asking->struct_size >= version_end && asking->api_version.major_version == 0)
    minor = std::clamp(asking->api_version.minor_version, oldest_with_this_layout, XLA_FFI_API_MINOR);
  return XLA_FFI_Api_Version{XLA_FFI_Api_Version_STRUCT_SIZE, nullptr, XLA_FFI_API_MAJOR, minor};
}

template <void (*Call)(const XLA_FFI_CallFrame*)>
XLA_FFI_Error* handle(XLA_FFI_CallFrame* frame, const char* name) {
  if (frame->extension_start != nullptr && frame->extension_start->type == XLA_FFI_Extension_Metadata) {
    auto* extension = reinterpret_cast<XLA_FFI_Metadata_Extension*>(frame->extension_start);
    extension->metadata->api_version = answered_api_version(frame->api);
    extension->metadata->traits = 0;
    return nullptr;
  }
  if (frame->stage != XLA_FFI_ExecutionStage_EXECUTE) return nullptr; // nothing to instantiate or prepare
  try {
    Call(frame);
    return nullptr;
  } catch (const std::invalid_argument& e) {
    return make_error(frame->api, XLA_FFI_Error_Code_INVALID_ARGUMENT, std::string(name) + ": " + e.what());
  } catch (const std::exception& e) {
    return make_error(frame->api, XLA_FFI_Error_Code_INTERNAL, std::string(name) + ": " + e.what());
  }
}

extern "C" XLA_FFI_Error* hostopt_adam_update(XLA_FFI_CallFrame* frame) {
  return handle<adam_update_call>(frame, "hostopt_adam_update");
}

extern "C" XLA_FFI_Error* hostopt_adam_update_compressed(XLA_FFI_CallFrame* frame) {
  return handle<adam_update_compressed_call>(frame, "hostopt_adam_update_compressed");
}

} // namespace

PYBIND11_MODULE(_xla_ffi, m) {
  m.doc() = "XLA FFI handlers of hostopt.optax (for every jaxlib whose XLA FFI is API 0.1 or newer).";
  m.attr("BUILT_WITH_JAXLIB") = HOSTOPT_JAXLIB_VERSION; // the headers' jaxlib: a diagnostic, never a requirement
  m.attr("FFI_API_VERSION") = py::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
  m.def("targets", [] {
    py::dict d;
    d["hostopt_adam_update"] = py::capsule(reinterpret_cast<void*>(&hostopt_adam_update));
    d["hostopt_adam_update_compressed"] = py::capsule(reinterpret_cast<void*>(&hostopt_adam_update_compressed));
    return d;
  }, "Name -> PyCapsule of each FFI handler, for jax.ffi.register_ffi_target(platform='cpu').");
}
