"""The core's arena as the fronts read it: where each tensor lies in it."""

from typing import Any, List, NamedTuple


class Segment(NamedTuple):
  """One tensor of an arena, as the core lists them (_core.Optimizer.segments())."""
  name: str
  shape: List[int]
  offset: int  # its first element in the arena
  size: int  # its elements (without padding)
  group: int  # its parameter group


def segments(core: Any) -> List[Segment]:
  """A _core.Optimizer's tensors, in arena order."""
  return [Segment(*s) for s in core.segments()]
