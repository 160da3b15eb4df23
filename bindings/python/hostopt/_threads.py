"""How many worker threads a step gets: one default for every front (hostopt.Optimizer,
hostopt.adam_step, hostopt.jax, hostopt.optax, hostopt.torch).

``threads=0`` (and hostopt.torch's default, None) means :func:`default_threads`:
``OMP_NUM_THREADS`` when it is set (the knob torch, DeepSpeed and numpy's BLAS users already
set), else the physical cores of the CPUs this process may run on. A step streams memory,
and SMT siblings share a core's load/store units, so a hyper-threaded host gains nothing
from its second hardware threads. Any other count is taken as given (at most
``hostopt._core.max_threads()``; each front checks its own range).
"""

import functools
import os
from typing import FrozenSet

from ._core import max_threads


@functools.lru_cache(maxsize=8)
def _physical_cores(cpus: FrozenSet[int]) -> int:
  """Distinct (package, core) pairs among `cpus` (sysfs' topology), read once per CPU set."""
  cores = set()
  for c in cpus:
    try:
      with open(f"/sys/devices/system/cpu/cpu{c}/topology/core_id") as f:
        core = f.read().strip()
      with open(f"/sys/devices/system/cpu/cpu{c}/topology/physical_package_id") as f:
        package = f.read().strip()
    except OSError:  # no topology to read: every CPU counts
      return max(1, len(cpus))
    cores.add((package, core))
  return max(1, len(cores))


def _omp_num_threads() -> int:
  """OMP_NUM_THREADS's first entry (OpenMP allows a list, one per nesting level), or 0 when
  it is unset or not a positive integer (OpenMP ignores such a value too)."""
  first = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
  return int(first) if first.isdigit() and int(first) > 0 else 0


def default_threads() -> int:
  """OMP_NUM_THREADS when set (at most ``hostopt._core.max_threads()``), else the physical cores among the CPUs this process may run
  on (SMT siblings share a core's load/store units, so a memory-bound step gains nothing
  from them)."""
  omp = _omp_num_threads()
  if omp:  # never above what a step accepts: an environment must not make every step refuse
    return min(omp, max_threads())
  try:
    cpus = os.sched_getaffinity(0)
  except AttributeError:
    return os.cpu_count() or 1
  return _physical_cores(frozenset(cpus))


def resolve(threads: int) -> int:
  """A checked thread count as a step takes it: 0 is default_threads()."""
  return default_threads() if threads == 0 else threads
