"""Reading an optax-style weight-decay mask, shared by hostopt.optax and hostopt.jax."""

from typing import List

import jax


def mask_flags(mask, tree, treedef) -> List[bool]:
  """One bool per leaf of `tree` (flattened by `treedef`), as optax.masked reads a mask:
  None decays everything, a callable is called with `tree` (optax passes the params in
  init and the updates in update), and a tree of bools may be a prefix of `tree`'s."""
  if mask is None:
    return [True] * treedef.num_leaves
  flags = mask(tree) if callable(mask) else mask
  full = jax.tree_util.tree_map(lambda m, sub: jax.tree_util.tree_map(lambda _: bool(m), sub), flags, tree)
  return [bool(x) for x in treedef.flatten_up_to(full)]
