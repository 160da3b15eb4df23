#pragma once
/// \file hostopt.hpp
/// Everything public in one include.

#include "hostopt/adam_config.hpp"
#include "hostopt/checkpoint.hpp"
#include "hostopt/dtype.hpp"
#include "hostopt/gradient_checks.hpp"
#include "hostopt/kernels.hpp"
#include "hostopt/optimizer.hpp"
#include "hostopt/sharding.hpp"
#include "hostopt/version.hpp"
