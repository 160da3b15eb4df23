"""Reading optax-style per-leaf trees (weight-decay masks, group labels), shared by
hostopt.optax and hostopt.jax."""

from typing import List

import jax


def per_leaf(prefix, tree, treedef) -> list:
  """One value per leaf of `tree` (flattened by `treedef`) from `prefix`, a tree whose
  structure is a prefix of `tree`'s (each of its leaves covers a whole subtree), or a
  callable of `tree` giving one — as optax.masked and optax.multi_transform read theirs."""
  values = prefix(tree) if callable(prefix) else prefix
  full = jax.tree_util.tree_map(lambda v, sub: jax.tree_util.tree_map(lambda _: v, sub), values, tree)
  return list(treedef.flatten_up_to(full))


def mask_flags(mask, tree, treedef) -> List[bool]:
  """One bool per leaf of `tree`, as optax.masked reads a mask: None decays everything, a
  callable is called with `tree` (optax passes the params in init and the updates in
  update), and a tree of bools may be a prefix of `tree`'s."""
  if mask is None:
    return [True] * treedef.num_leaves
  return [bool(x) for x in per_leaf(mask, tree, treedef)]
