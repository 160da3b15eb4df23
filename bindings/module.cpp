// hostopt._core: a thin pybind11 layer over the C++ API. Arrays arrive as numpy arrays
// with an explicit hostopt dtype (the Python package turns torch/jax/ml_dtypes arrays into
// zero-copy numpy views first); they are checked for type, contiguity, writability and
// size (argument_conversion.hpp), never copied. Steps run with the GIL released. Each topic
// adds its names in its own file (module_parts.hpp).
#include <pybind11/pybind11.h>

#include "module_parts.hpp"

#include "hostopt/version.hpp"

PYBIND11_MODULE(_core, m) {
  using namespace hostopt::bindings;
  m.doc() = "hostopt's C++ core: SIMD Adam/AdamW on host memory";
  m.attr("__version__") = hostopt::library_version();
  bind_adam_config(m); // before bind_kernels: optax_update_leaves takes AdamConfig structs
  bind_kernels(m);
  bind_compressed_moments(m);
  bind_sharded(m);
  bind_optimizer(m); // StepResult before the pipeline's waits return one
  bind_stored_optimizer(m);
  bind_pipeline(m);
  bind_hyperparameters(m);
}
