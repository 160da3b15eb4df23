"""The fronts' ``store=``, ``store_options=`` and ``resume=`` (hostopt.jax, hostopt.torch):
checked alike before anything is made, so a refused call leaves no store behind."""
from typing import Optional

OPTION_KEYS = ("staging_bytes", "buffers", "chunk_elements", "sync", "io", "kernel")


def check(store, store_options: Optional[dict], resume: bool) -> dict:
  """store_options as a dict of hostopt.StoredOptimizer's keywords ({} without a store)."""
  if not isinstance(resume, bool):
    raise TypeError(f"resume: expected a bool, got {type(resume).__name__}")
  if store is None:
    if store_options is not None or resume:
      raise ValueError(f"{'store_options' if store_options is not None else 'resume=True'} without store=: name "
                       "the store's directory (or directories, one per drive)")
    return {}
  options = dict(store_options or {})
  unknown = set(options) - set(OPTION_KEYS)
  if unknown:
    raise ValueError(f"store_options: unknown {sorted(unknown)}; expected some of {sorted(OPTION_KEYS)} "
                     "(hostopt.StoredOptimizer's keywords)")
  if resume and "chunk_elements" in options:
    raise ValueError("store_options['chunk_elements'] with resume=True: a store keeps the chunking it was created "
                     "with")
  return options


def exists_hint(e: RuntimeError) -> RuntimeError:
  """Creating a store where one is: the error, told how to continue it."""
  if "a store exists" not in str(e):
    return e
  return RuntimeError(f"{e} (resume=True continues it)")
