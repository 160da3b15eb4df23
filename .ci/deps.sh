#!/usr/bin/env bash
# Installs the Debian packages hostopt needs that are missing (sourced by .ci/bench,
# .ci/test, .ci/run and .ci/gpu). Needs root, or sudo. Safe to run again: it installs nothing
# when everything is there.
set -euo pipefail

# What building the C++ library, tests, examples and benchmarks needs (.ci/gpu installs
# only these).
HOSTOPT_BUILD_PACKAGES=(
  # build
  g++ cmake ninja-build pkg-config
  # C++ libraries (header-only or shared; never vendored)
  libxsimd-dev libtbb-dev catch2 libcli11-dev nlohmann-json3-dev
  # optional: io_uring for hostopt-bench disk (a thread pool does the I/O without it)
  liburing-dev
)

HOSTOPT_DEBIAN_PACKAGES=(
  "${HOSTOPT_BUILD_PACKAGES[@]}"
  # Python package and its tests (torch stays Debian's: PyPI's wheels pull CUDA libraries)
  python3-dev python3-venv pybind11-dev python3-numpy python3-pytest python3-torch
  # distributed: the MPI example and its tests
  libopenmpi-dev openmpi-bin
)

# The aarch64 lane of .ci/test: Debian's cross toolchain and qemu-user (installed there).
HOSTOPT_CROSS_PACKAGES=(g++-aarch64-linux-gnu qemu-user)

hostopt_install_packages() {
  local missing=()
  local p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  local sudo=""
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || { echo "hostopt: need root (or sudo) to install: ${missing[*]}" >&2; return 1; }
    sudo="sudo"
  fi
  echo "hostopt: installing ${missing[*]}" >&2
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# HOSTOPT_DEPS_INSTALL=none: define the lists and the function, install nothing yet.
if [ "${HOSTOPT_DEPS_INSTALL:-all}" != none ]; then
  hostopt_install_packages "${HOSTOPT_DEBIAN_PACKAGES[@]}"
fi
