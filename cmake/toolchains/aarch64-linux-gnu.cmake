# Cross build for aarch64 (Grace-class hosts) with Debian's cross toolchain
# (g++-aarch64-linux-gnu); tests run under qemu-user (qemu-aarch64). The header-only
# dependencies (xsimd, nlohmann-json, Catch2, CLI11) are architecture-independent: their
# host packages are used, through an include directory that holds only them (see
# HostoptDependencies.cmake), never the host's /usr/include.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE BOTH) # the header-only packages' configs are the host's
set(CMAKE_CROSSCOMPILING_EMULATOR qemu-aarch64 -L /usr/aarch64-linux-gnu)
# xsimd's config sits in the build host's multiarch directory (e.g. x86_64-linux-gnu).
set(xsimd_DIR /usr/lib/${CMAKE_HOST_SYSTEM_PROCESSOR}-linux-gnu/cmake/xsimd CACHE PATH
    "xsimd (header-only) from the host package")
