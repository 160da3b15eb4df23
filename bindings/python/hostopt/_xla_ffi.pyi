# Type stubs of the extension hostopt._xla_ffi (bindings/xla_ffi_module.cpp), built when
# jaxlib's XLA FFI headers are found. pybind11-stubgen's output (the command at the top of
# _core.pyi, with hostopt._xla_ffi) fixed by hand: it types targets() as a bare dict and
# FFI_API_VERSION as a bare tuple, and writes the build's values as the constants' defaults.
# Checked with mypy by .ci/typecheck.
"""XLA FFI handlers of hostopt.optax (for every jaxlib whose XLA FFI is API 0.1 or newer)."""

import typing

# The version of the jaxlib whose XLA FFI headers the module was built with ("headers" when
# CMake was given a header directory alone): a diagnostic, never a requirement.
BUILT_WITH_JAXLIB: str
# The XLA FFI API version (major, minor) of those headers.
FFI_API_VERSION: tuple[int, int]

def targets() -> dict[str, typing.Any]:
  """Name -> PyCapsule of each FFI handler, for jax.ffi.register_ffi_target(platform='cpu')."""
