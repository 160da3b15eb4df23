"""hostopt.torch's offloaded path, apart from the optimizer: the flat device buffers of one
dtype's parameters and the pipeline between them and the arena (DeviceBuffers, the twin of
hostopt.jax's DeviceStep), the chunks as the backward completes them (ChunkEvents), and the
post-accumulate-grad hooks that report them (grad_hook)."""

import dataclasses
from typing import Any, List, Optional, Set

import torch


@dataclasses.dataclass
class DeviceBuffers:
  """One dtype's offloaded parameters: flat device buffers in the arena's layout, the
  pipeline's two ends (each parameter is a view of `params`, its gradient gathered into
  `grads`), the pipeline itself, and, with overlap_backward, the per-chunk events."""
  params: torch.Tensor  # n elements, the parameters' dtype, on the device
  grads: torch.Tensor  # the gradients, likewise
  n: int  # elements of both (the arena's size)
  pipe: Any  # the _core.OffloadPipeline between them and the arena
  chunks: Optional["ChunkEvents"]  # None without overlap_backward
  hooked: Set[int] = dataclasses.field(default_factory=set)  # tracked parameters with a grad hook


class ChunkEvents:
  """The offload pipeline's chunks as the backward completes them (overlap_backward=True).

  A post-accumulate-grad hook reports each parameter whose gradient is complete. A chunk is
  complete when every parameter overlapping it has reported as often as the one reported
  most (in every backward since the last step, so accumulation over micro-batches and
  reentrant checkpointing count right); an event is then recorded on the reporting stream,
  and the step lets that chunk's copy and CPU update start once the device is past it. A
  report that leaves a chunk incomplete cancels its event (its gradients changed after it).
  Events stand only if the flat gradient buffer's version is what it was when the last
  backward ended: a write through torch in place (clipping, p.grad.mul_) sends every chunk
  back to the whole stream. Writes that bypass the version counter (.data, numpy,
  collectives such as all_reduce) are not seen: the documented contract."""

  def __init__(self, engine, chunks: int, chunk_elems: int):
    self.engine = engine
    self.chunk = chunk_elems  # the pipeline's cut (OffloadPipeline.chunk_elems)
    self.events = []
    for _ in range(chunks):
      self.events.append(engine.create_event())
    self.chunks_of: List[range] = []
    self.tensors_in = [0] * chunks
    self.callback_queued = False
    self.forget()

  def cover(self, segments, seg_of) -> None:
    """The chunks each tracked parameter overlaps (segments: the core's (offset, size))."""
    self.chunks_of = []
    self.tensors_in = [0] * len(self.events)
    for si in seg_of:
      off, size = segments[si]
      span = range(off // self.chunk, (off + size - 1) // self.chunk + 1) if size else range(0)
      self.chunks_of.append(span)
      for c in span:
        self.tensors_in[c] += 1
    self.forget()

  def forget(self) -> None:
    """A new step's window: no reports, no events."""
    self.reports = [0] * len(self.chunks_of)
    self.top = [0] * len(self.events)  # the most reports of a tensor in the chunk
    self.at_top = [0] * len(self.events)  # tensors of the chunk with that many
    self.recorded = [False] * len(self.events)
    self.version = None

  def hooked(self, k: int, stream: int, grads: torch.Tensor) -> None:
    """Tracked parameter k's gradient is complete (in the flat buffer) on `stream`."""
    self.reports[k] += 1
    x = self.reports[k]
    for c in self.chunks_of[k]:
      if x > self.top[c]:
        self.top[c], self.at_top[c] = x, 1
      elif x == self.top[c]:
        self.at_top[c] += 1
      self.recorded[c] = self.at_top[c] == self.tensors_in[c]
      if self.recorded[c]:
        self.engine.record_event(self.events[c], stream)
    self.version = None
    if not self.callback_queued:  # the version is read when this backward ends
      self.callback_queued = True
      torch.autograd.Variable._execution_engine.queue_callback(lambda: self._backward_done(grads))

  def _backward_done(self, grads: torch.Tensor) -> None:
    self.callback_queued = False
    self.version = grads._version  # any later write through torch changes it

  def ready_events(self, grads: torch.Tensor) -> list:
    """One event handle per chunk (0: none) for the step about to read `grads`; then a
    new window starts."""
    valid = self.version is not None and not self.callback_queued and grads._version == self.version
    events = [e if valid and r else 0 for e, r in zip(self.events, self.recorded)]
    self.forget()
    self.callback_queued = False  # a backward that failed midway never ran its callback
    return events

  def __del__(self):
    for e in getattr(self, "events", []):
      try:
        self.engine.destroy_event(e)
      except Exception:  # interpreter shutdown
        pass


def remove_handles(handles: list) -> None:
  """Removes hook handles in place (also when the optimizer is collected: weakref.finalize)."""
  for handle in handles:
    handle.remove()
  handles.clear()


def grad_hook(opt_ref, tag: str, k: int):
  """Runs when parameter k's gradient is complete in a backward: moves it into the flat
  device gradient buffer at once (later backwards then accumulate in place there) and
  reports it, so that the pipeline may start on its chunk."""

  @torch.no_grad()
  def hook(p: torch.Tensor) -> None:
    opt = opt_ref()
    layout = None if opt is None or opt._layout is None else opt._layout.get(tag)
    if layout is None or k >= len(layout.tracked) or layout.tracked[k].param is not p:
      return  # an optimizer gone or being rebuilt: the step gathers the gradients itself
    dev = layout.dev
    take_grad(p, layout.tracked[k].grad_view, dev.chunks, k, opt._stream(), dev.grads)

  return hook


def take_grad(p: torch.Tensor, view: torch.Tensor, chunks: ChunkEvents, k: int, stream: int,
              grads: torch.Tensor) -> None:
  """Parameter p's complete gradient moved into `view`, its place in the flat gradient buffer
  `grads` (later backwards accumulate there), and reported to `chunks` as tensor k's on
  `stream` (the in-RAM path's grad_hook and the store's)."""
  g = p.grad
  if g is None or g.is_sparse or g.requires_grad or g.dtype != p.dtype or g.device != view.device:
    return  # create_graph=True keeps its differentiable .grad: the step gathers it (no event)
  if g.data_ptr() != view.data_ptr():
    view.copy_(g.reshape(-1))  # on the backward's stream
    p.grad = view.view(p.shape)
  chunks.hooked(k, stream, grads)
