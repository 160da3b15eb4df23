#include "hostopt/dtype.hpp"

#include <stdexcept>
#include <string>

#include "hostopt/version.hpp"

namespace hostopt {

namespace {
[[noreturn]] void bad_dtype(dtype t) {
  throw std::invalid_argument("dtype: value " + std::to_string(int(t)) +
                              " is not a dtype (expected f32=0, bf16=1 or f16=2)");
}
} // namespace

std::size_t dtype_size(dtype t) {
  switch (t) {
  case dtype::f32: return 4;
  case dtype::bf16: return 2;
  case dtype::f16: return 2;
  }
  bad_dtype(t);
}

std::string_view dtype_name(dtype t) {
  switch (t) {
  case dtype::f32: return "f32";
  case dtype::bf16: return "bf16";
  case dtype::f16: return "f16";
  }
  bad_dtype(t);
}

dtype parse_dtype(std::string_view name) {
  if (name == "f32" || name == "float32" || name == "fp32") return dtype::f32;
  if (name == "bf16" || name == "bfloat16") return dtype::bf16;
  if (name == "f16" || name == "float16" || name == "fp16") return dtype::f16;
  throw std::invalid_argument("dtype: unknown name '" + std::string(name) +
                              "', expected f32, bf16 or f16");
}

const char* library_version() { return version_string; }

} // namespace hostopt
