"""Runs pytest suites once per kernel this CPU supports (HOSTOPT_FORCE_ARCH set for each run),
so the Python fronts' numeric tests cover every kernel as the C++ suites do. Exit status:
pytest's first failure, else 0.

  python tests/python/every_kernel.py tests/python/test_optax_compressed.py ...
"""
import os
import subprocess
import sys


def main(argv):
  from hostopt import _core
  kernels = [name for name, supported in _core.kernels() if supported]
  status = 0
  for kernel in kernels:
    env = dict(os.environ, HOSTOPT_FORCE_ARCH=kernel)
    print(f"== kernel {kernel}", flush=True)
    rc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *argv], env=env).returncode
    if rc not in (0, 5):  # 5: every test skipped (jax or torch not installed)
      status = status or rc
  return status


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
