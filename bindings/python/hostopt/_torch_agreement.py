"""The ranks that hold an optimizer's DTensor shards agreeing before they act: one all-reduce
(a sum) of a few numbers, with each rank's refusal, so that a step (or a load) refused on any
rank is refused on every rank, with that rank's error, and no rank waits in a collective the
others never reach.

The collective runs over process groups that already exist (no group is made in a step: a
new group is itself a collective, and one made by some ranks only shifts the names of groups
made later): the default group where the shards' ranks are all of its ranks, else the mesh's
own groups, one per mesh dimension (a sum along each dimension in turn is the sum over the
mesh). Parameters on several meshes must together cover the default group.
"""

from typing import List, Optional

import torch

MESSAGE_BYTES = 2048  # of a refusing rank's error, told to the others


class Agreement:
  def __init__(self, meshes: list):
    import torch.distributed as dist
    self._dist = dist
    world = dist.get_world_size()
    ranks = sorted({int(r) for m in meshes for r in m.mesh.flatten().tolist()})
    if ranks == list(range(world)):
      self._groups: List = [dist.group.WORLD]
      self.members = list(range(world))
    elif all(m is meshes[0] or m == meshes[0] for m in meshes):
      mesh = meshes[0]
      self._groups = [mesh.get_group(i) for i in range(mesh.ndim)]
      self.members = [int(r) for r in mesh.mesh.flatten().tolist()]
    else:
      raise ValueError(f"the DTensor parameters are on {len(meshes)} device meshes whose ranks ({ranks}) are not the "
                       f"whole default process group ({world} ranks): hostopt agrees across the ranks of one mesh, "
                       "or of the whole group; make one optimizer per mesh")
    self.size = len(self.members)
    self.index = self.members.index(dist.get_rank())
    device_type = meshes[0].device_type
    self._device = (torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else
                    torch.device(device_type))

  def _sum(self, values: torch.Tensor) -> torch.Tensor:
    values = values.to(self._device)
    for group in self._groups:
      self._dist.all_reduce(values, op=self._dist.ReduceOp.SUM, group=group)
    return values.cpu()

  def reduce(self, refusal: Optional[BaseException], numbers: List[float], what: str) -> torch.Tensor:
    """The sum over the ranks of `numbers` (float64), once every rank has said whether it
    refused `what`. Where any rank refused, raises on every rank: its own error on a refusing
    rank, elsewhere the same type (ValueError, TypeError, else RuntimeError) naming the first
    refusing rank and its message; nothing is summed then."""
    told = torch.zeros(self.size + len(numbers), dtype=torch.float64)
    told[self.index] = float(refusal is not None)
    if numbers:
      told[self.size:] = torch.tensor(numbers, dtype=torch.float64)
    told = self._sum(told)
    refused = [k for k in range(self.size) if told[k] > 0]
    if not refused:
      return told[self.size:]
    # Their first one's error, told to every rank (a second sum, only when refused).
    message = torch.zeros(MESSAGE_BYTES, dtype=torch.float64)
    if refusal is not None and self.index == refused[0]:
      mine = f"{type(refusal).__name__}: {refusal}".encode("utf-8", "replace")[:MESSAGE_BYTES]
      message[:len(mine)] = torch.tensor(list(mine), dtype=torch.float64)
    message = self._sum(message)
    if refusal is not None:
      raise refusal
    told_text = bytes(int(b) for b in message.tolist() if b).decode("utf-8", "replace")
    kind = told_text.split(":", 1)[0]
    error = {"ValueError": ValueError, "TypeError": TypeError}.get(kind, RuntimeError)
    others = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
    # (the step on the drives: told after the other ranks committed it, so nothing is claimed)
    done = {"the step": "; nothing was stepped on any rank", "the load": "; nothing was loaded on any rank",
            "the step on the drives": ""}.get(what, "; nothing was changed on any rank")
    raise error(f"{what} was refused on rank {self.members[refused[0]]}{others} ({told_text}){done}")
