# The layer picture, checked: transfer/ sees the chunk_updater interface and its own files,
# never the optimizer side (cpu_adam/ internals or the Adam-facing public headers); and
# public headers stay free of SIMD, CUDA and pybind types (and of the drive layer). Run with -DSOURCE_DIR=<repo>.
set(forbidden_in_transfer
  "hostopt/optimizer.hpp" "hostopt/kernels.hpp" "hostopt/adam_config.hpp" "hostopt/gradient_checks.hpp"
  "hostopt/checkpoint.hpp" "hostopt/sharding.hpp" "hostopt/hostopt.hpp"
  "kernel_set.hpp" "kernel_registry.hpp" "update_engine.hpp" "step_plan.hpp" "step_scalars.hpp" "parallel.hpp"
  "adam_kernel.hpp" "../cpu_adam")
file(GLOB transfer_files ${SOURCE_DIR}/transfer/*.cpp ${SOURCE_DIR}/transfer/*.hpp
     ${SOURCE_DIR}/include/hostopt/offload_pipeline.hpp ${SOURCE_DIR}/include/hostopt/copy_engine.hpp
     ${SOURCE_DIR}/include/hostopt/chunk_updater.hpp ${SOURCE_DIR}/include/hostopt/step_options.hpp)
set(bad "")
foreach(f IN LISTS transfer_files)
  file(STRINGS ${f} includes REGEX "^[ \t]*#[ \t]*include")
  foreach(line IN LISTS includes)
    foreach(name IN LISTS forbidden_in_transfer)
      string(FIND "${line}" "${name}" at)
      if(NOT at EQUAL -1)
        string(APPEND bad "  ${f}: ${line}\n")
      endif()
    endforeach()
  endforeach()
endforeach()
# Appends to `bad` each include line of `files` that matches `forbidden`.
function(forbid_includes files forbidden)
  foreach(f IN LISTS files)
    file(STRINGS ${f} includes REGEX "^[ \t]*#[ \t]*include")
    foreach(line IN LISTS includes)
      if(line MATCHES "${forbidden}")
        string(APPEND bad "  ${f}: ${line}\n")
      endif()
    endforeach()
  endforeach()
  set(bad "${bad}" PARENT_SCOPE)
endfunction()
# drive/ moves bytes between RAM and drives: it includes nothing of hostopt's (neither the
# optimizer side nor transfer/), so the state store built on it says what the bytes are.
file(GLOB drive_files ${SOURCE_DIR}/drive/*.cpp ${SOURCE_DIR}/drive/*.hpp)
forbid_includes("${drive_files}" "hostopt/|cpu_adam|transfer/|kernel_|optimizer")
file(GLOB public_headers ${SOURCE_DIR}/include/hostopt/*.hpp ${SOURCE_DIR}/include/hostopt/detail/*.hpp)
forbid_includes("${public_headers}" "xsimd|cuda|pybind|torch|immintrin|arm_neon|liburing|chunk_store|io_queue")
if(bad)
  message(FATAL_ERROR "layering violated:\n${bad}")
endif()
list(LENGTH transfer_files n)
list(LENGTH drive_files nd)
message(STATUS "layers hold: ${n} transfer files include nothing of the optimizer side, ${nd} drive files nothing of hostopt's")
