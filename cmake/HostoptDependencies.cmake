# Third-party dependencies, all from Debian packages (never vendored).

# find_package(<name> <args>...), or a configure (and so `pip install .`) that stops with one
# line naming what to install, not find_package's page about <name>Config.cmake.
macro(hostopt_require name what install)
  find_package(${name} ${ARGN} QUIET)
  if(NOT ${name}_FOUND)
    message(FATAL_ERROR "hostopt needs ${what}: ${install}")
  endif()
endmacro()

hostopt_require(xsimd "xsimd 8 or newer (SIMD headers)" "apt-get install libxsimd-dev" 8 CONFIG)
find_package(Threads REQUIRED)
# Checkpoint headers (header-only, used privately).
hostopt_require(nlohmann_json "nlohmann/json 3 (JSON headers)" "apt-get install nlohmann-json3-dev" 3 CONFIG)

# Cross builds use the host's header-only packages. Their targets point at the host's
# /usr/include, which would put the host's C library headers before the target's: give
# them an include directory that holds only their own headers instead.
function(hostopt_isolate_headers target)
  if(NOT CMAKE_CROSSCOMPILING OR NOT TARGET ${target})
    return()
  endif()
  get_target_property(dirs ${target} INTERFACE_INCLUDE_DIRECTORIES)
  set(overlay ${CMAKE_BINARY_DIR}/host-headers/${target})
  string(REPLACE "::" "_" overlay "${overlay}")
  file(MAKE_DIRECTORY ${overlay})
  foreach(sub IN LISTS ARGN)
    foreach(dir IN LISTS dirs)
      if(EXISTS ${dir}/${sub})
        file(CREATE_LINK ${dir}/${sub} ${overlay}/${sub} SYMBOLIC)
      endif()
    endforeach()
  endforeach()
  set_target_properties(${target} PROPERTIES INTERFACE_INCLUDE_DIRECTORIES ${overlay})
endfunction()
hostopt_isolate_headers(xsimd xsimd)
hostopt_isolate_headers(nlohmann_json::nlohmann_json nlohmann)

if(HOSTOPT_THREADING STREQUAL "openmp")
  hostopt_require(OpenMP "OpenMP (HOSTOPT_THREADING=openmp)"
                  "g++ has it (libgomp); clang needs apt-get install libomp-dev; or configure with -DHOSTOPT_THREADING=threads"
                  COMPONENTS CXX)
  set(HOSTOPT_THREADING_TARGET OpenMP::OpenMP_CXX)
elseif(HOSTOPT_THREADING STREQUAL "tbb")
  hostopt_require(TBB "oneTBB (HOSTOPT_THREADING=tbb)" "apt-get install libtbb-dev" CONFIG)
  set(HOSTOPT_THREADING_TARGET TBB::tbb)
elseif(HOSTOPT_THREADING STREQUAL "threads")
  # std::thread per parallel region: for ThreadSanitizer builds (the tsan preset).
  set(HOSTOPT_THREADING_TARGET Threads::Threads)
else()
  message(FATAL_ERROR "HOSTOPT_THREADING='${HOSTOPT_THREADING}': expected openmp, tbb or threads")
endif()

set(HOSTOPT_HAVE_CUDA OFF)
# HOSTOPT_CUDA_DOUBLE (tests only, preset cuda-double): the CUDA code is built against the
# toolkit's headers and linked with tests/cuda_double instead of libcudart; no device code
# is compiled (the double runs test kernels as its own device work).
option(HOSTOPT_CUDA_DOUBLE "Link the CUDA code with the test-only CUDA runtime double (tests/cuda_double)" OFF)
set(HOSTOPT_CUDART CUDA::cudart)
if(HOSTOPT_CUDA_DOUBLE)
  find_package(CUDAToolkit REQUIRED)
  if(HOSTOPT_INSTALL)
    message(FATAL_ERROR "HOSTOPT_CUDA_DOUBLE=ON is a test build: configure it with HOSTOPT_INSTALL=OFF")
  endif()
  set(HOSTOPT_HAVE_CUDA ON)
  set(HOSTOPT_CUDART hostopt_cuda_double)
elseif(NOT HOSTOPT_WITH_CUDA STREQUAL "OFF")
  find_package(CUDAToolkit QUIET)
  if(CUDAToolkit_FOUND)
    set(HOSTOPT_HAVE_CUDA ON)
  elseif(HOSTOPT_WITH_CUDA STREQUAL "ON")
    message(FATAL_ERROR "HOSTOPT_WITH_CUDA=ON but the CUDA toolkit was not found (set CUDAToolkit_ROOT)")
  endif()
endif()
# Device code (the examples' toy model, hostopt-gpu-bench, the CUDA tests' kernels) needs a
# CUDA compiler; the library does not (runtime API only, built by the host compiler). The
# language is enabled here, at the top level, so every directory sees it.
set(HOSTOPT_HAVE_CUDA_COMPILER OFF)
if(HOSTOPT_HAVE_CUDA AND NOT HOSTOPT_CUDA_DOUBLE AND NOT CMAKE_CROSSCOMPILING)
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES AND NOT DEFINED ENV{CUDAARCHS})
      # T4 (sm_75), A100 and H100/H200 natively, PTX for anything newer. Nothing older:
      # CUDA 13 dropped sm_70 (V100), and a list must build with every toolkit we accept.
      set(CMAKE_CUDA_ARCHITECTURES "75-real;80-real;90" CACHE STRING "CUDA architectures of hostopt's device code")
    endif()
    enable_language(CUDA)
    # C++17: CMake before 3.26 knows no C++20 flag for nvcc, so .cu files hold kernels and
    # C++17 headers only (copy_engine.hpp, not optimizer.hpp).
    set(CMAKE_CUDA_STANDARD 17)
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    set(CMAKE_CUDA_EXTENSIONS OFF)
    set(HOSTOPT_HAVE_CUDA_COMPILER ON)
  endif()
endif()
message(STATUS "hostopt: threading=${HOSTOPT_THREADING} cuda=${HOSTOPT_HAVE_CUDA} cuda compiler=${HOSTOPT_HAVE_CUDA_COMPILER} cuda double=${HOSTOPT_CUDA_DOUBLE}")
