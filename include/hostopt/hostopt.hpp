#pragma once
/// \file hostopt.hpp
/// Everything public in one include.

#include "hostopt/adam_config.hpp"
#include "hostopt/checkpoint.hpp"
#include "hostopt/chunk_updater.hpp"
#include "hostopt/copy_engine.hpp"
#include "hostopt/dtype.hpp"
#include "hostopt/gradient_checks.hpp"
#include "hostopt/kernels.hpp"
#include "hostopt/offload_pipeline.hpp"
#include "hostopt/optimizer.hpp"
#include "hostopt/sharding.hpp"
#include "hostopt/step_options.hpp"
#include "hostopt/version.hpp"
