#pragma once
// The parts of hostopt._core, one topic each, in the order PYBIND11_MODULE (module.cpp)
// calls them: a class is registered before a signature that names it (AdamConfig before
// optax_update_leaves, StepResult before the steps and waits that return one).
#include <pybind11/pybind11.h>

namespace hostopt::bindings {

// config_bindings.cpp: AdamConfig.
void bind_adam_config(pybind11::module_& m);
// kernel_bindings.cpp: the kernels, the one-buffer and optax steps, accumulate, convert.
void bind_kernels(pybind11::module_& m);
// compressed_moment_bindings.cpp: moment formats, the 8-bit constants, steps and codecs over codes.
void bind_compressed_moments(pybind11::module_& m);
// sharded_bindings.cpp: shard_of, ShardedStepRefused, ShardedOptimizer.
void bind_sharded(pybind11::module_& m);
// optimizer_bindings.cpp: StepResult, Optimizer.
void bind_optimizer(pybind11::module_& m);
// stored_optimizer_bindings.cpp: StoredOptimizer (the state on a drive).
void bind_stored_optimizer(pybind11::module_& m);
// pipeline_bindings.cpp: CopyEngine, PipelineHandle, OffloadPipeline.
void bind_pipeline(pybind11::module_& m);
// hyperparameter_bindings.cpp: refused_fields (C++'s rule for a config, asked by the fronts), MAX_STEP_COUNT.
void bind_hyperparameters(pybind11::module_& m);

} // namespace hostopt::bindings
