#pragma once
// The one clock of the pipeline's timelines and the engines' copy timings: nanoseconds of
// std::chrono::steady_clock, so every span of a timeline is comparable.

#include <chrono>
#include <cstdint>

namespace hostopt::detail {

inline std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

} // namespace hostopt::detail
