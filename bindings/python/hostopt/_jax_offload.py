"""hostopt.jax's path for parameters that live on an accelerator: the offload pipeline.

Only the gradients go down to the host and the new parameters come up: one jitted gather
puts the gradient leaves into one flat device buffer in the arena's layout (its sum of
squares too, when clipping or the non-finite check need the norm), the pipeline's copy
engine streams it to pinned host memory chunk by chunk while the CPU updates the chunks
before it (fused copy-out to param_dtype), the new parameters stream back into a flat
device buffer, and one jitted split hands them out as the tree's leaves. JAX-side memory
is the parameters and gradients (plus the two flat buffers); the f32 masters and moments
stay in host memory.

JAX does not lend its CUDA stream: the gather is waited for on the host before the
pipeline's copies start, and the split is waited for before the flat parameter buffer is
written again, so the step is synchronous with the device. With offload="host", CPU arrays
stand in for device arrays through the host engine: the same code, tested without a GPU.
"""

import functools
from typing import Any, Dict, List, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from . import _core
from ._arena import segments
from ._dtypes import kernel_tag


def _pow2(k):
  """2^k as float32 for integer k in [-126, 127], exactly (built from its bits)."""
  return jax.lax.bitcast_convert_type(((k + 127) << 23).astype(jnp.int32), jnp.float32)


class DeviceStep:
  """The pipeline between one device's flat buffers and a hostopt optimizer."""

  def __init__(self, core, kind: str, device, grad_dtype, names: Sequence[str], shapes: Sequence[tuple],
               out_dtype, chunk_elems: int):
    """`kind`, `device` and `grad_dtype` as hostopt.jax's _offload_target checked them."""
    self.device = device
    self.accumulated_ever = False  # the pipeline's f32 accumulator exists from the first accumulation
    # The CUDA ordinal in this process (device.id is JAX's global id across processes).
    ordinal = getattr(device, "local_hardware_id", None)
    self.engine = (_core.CopyEngine.cuda(device.id if ordinal is None else ordinal) if kind == "cuda"
                   else _core.CopyEngine.host())
    self.stream = self.engine.create_stream()  # the gradients are ready (waited for) before each call
    self.grad_dtype, self.out_dtype = np.dtype(grad_dtype), np.dtype(out_dtype)
    self.pipe = _core.OffloadPipeline(core, self.engine, int(chunk_elems), 2, kernel_tag(self.grad_dtype),
                                      kernel_tag(self.out_dtype))
    self.n = core.arena_size
    arena = segments(core)
    index = {s.name: i for i, s in enumerate(arena)}
    self.segment_of = [index[n] for n in names]
    self.leaf_segments = [arena[i] for i in self.segment_of]  # where each leaf lies in the arena
    self.shapes = list(shapes)
    self.micro_batches = 0
    self._gathers: Dict[Any, Any] = {}  # (leaves with a gradient, with norm) -> jitted gather, the latest few
    # (Jitted functions that hold no reference to self: a cycle through them would keep the
    # pipeline, and a store's lock, alive after the optimizer is dropped, until a collection.)
    pieces = tuple((s.offset, s.size, tuple(shape)) for s, shape in zip(self.leaf_segments, self.shapes))
    self._split = jax.jit(functools.partial(_split_flat, pieces))
    self._params_flat = None  # the device buffer the pipeline writes, allocated on first use

  # --- device-side gather and split ----------------------------------------------------
  def _gather_fn(self, present: tuple, with_norm: bool):
    leaf_segments, n, gdt = self.leaf_segments, self.n, self.grad_dtype  # (no self in the closure)
    order = sorted(range(len(leaf_segments)), key=lambda i: leaf_segments[i].offset)

    def gather(leaves):
      by_leaf = dict(zip(present, leaves))
      parts, pos = [], 0
      for i in order:
        off, size = leaf_segments[i].offset, leaf_segments[i].size
        if off > pos:
          parts.append(jnp.zeros(off - pos, gdt))  # padding between tensors: never read
        g = by_leaf.get(i)
        parts.append(jnp.zeros(size, gdt) if g is None else g.reshape(-1).astype(gdt))
        pos = off + size
      if n > pos:
        parts.append(jnp.zeros(n - pos, gdt))
      flat = jnp.concatenate(parts) if parts else jnp.zeros(n, gdt)
      if not with_norm or not leaves:
        return flat, jnp.zeros((0,), jnp.float32), jnp.zeros((0,), jnp.int32), jnp.zeros((0,), jnp.float32)
      # Per leaf: the binary exponent e of its largest magnitude and the sum of squares of
      # the leaf scaled by 2^-e (exact, two normal factors: XLA flushes subnormals), so no
      # square overflows f32; the host combines them in float64. A non-finite largest
      # magnitude is passed on as it is (the norm is then non-finite).
      peaks, exps, sums = [], [], []
      for g in leaves:
        x = g.astype(jnp.float32)
        m = jnp.max(jnp.abs(x)) if x.size else jnp.zeros((), jnp.float32)
        e = jnp.where(jnp.isfinite(m), jnp.frexp(m)[1], 0).astype(jnp.int32)
        h = e // 2
        y = x * _pow2(-h) * _pow2(h - e)
        peaks.append(m)
        exps.append(e)
        sums.append(jnp.sum(jnp.square(y)))
      return flat, jnp.stack(peaks), jnp.stack(exps), jnp.stack(sums)

    return jax.jit(gather)

  def gather(self, grads: List[Optional[jax.Array]], with_norm: bool):
    """The gradients (None: no gradient) as one flat device buffer, ready, and their
    global norm (float64 on the host, from per-leaf pieces taken on the device) when asked,
    else None."""
    present = tuple(i for i, g in enumerate(grads) if g is not None)
    for leaf in grads:
      if leaf is None:
        continue
      g = np.dtype(leaf.dtype)
      if g != self.grad_dtype and self.grad_dtype != np.float32:  # only widening to f32 is exact
        raise TypeError(f"a gradient of dtype {g} for a pipeline of {self.grad_dtype} gradients (the params' and "
                        "param_dtype's): hostopt never converts gradients inexactly")
    key = (present, with_norm)
    gather = self._gathers.pop(key, None) or self._gather_fn(present, with_norm)
    self._gathers[key] = gather  # most recent last; a few kept
    while len(self._gathers) > 8:
      self._gathers.pop(next(iter(self._gathers)))
    with jax.default_device(self.device):
      flat, peaks, exps, sums = gather([jax.device_put(grads[i], self.device) for i in present])
    flat.block_until_ready()  # JAX's stream is not ours: the copies start once it is written
    norm = None
    if with_norm:
      m = np.asarray(peaks, np.float64)
      if not np.all(np.isfinite(m)):
        norm = float(np.sum(m))  # inf, or NaN when a NaN is there
      else:
        scale = np.ldexp(1.0, np.asarray(exps, np.int64).astype(np.int32))  # exact in float64
        norm = float(np.sqrt(np.sum(scale * scale * np.asarray(sums, np.float64)))) if m.size else 0.0
    return flat, norm

  def memory(self) -> dict:
    """Bytes held: the pipeline's pinned buffers, its f32 accumulator (from the first
    accumulation on), the flat device parameter buffer (from the first step on); and the
    flat gradient buffer each step takes on the device while it runs."""
    return {"pinned_bytes": self.pipe.pinned_bytes, "accumulator_bytes": 4 * self.n if self.accumulated_ever else 0,
            "device_buffer_bytes": self.n * self.out_dtype.itemsize if self._params_flat is not None else 0,
            "device_step_bytes": self.n * self.grad_dtype.itemsize}

  def _params_buffer(self):
    if self._params_flat is None:
      buf = jax.device_put(jnp.zeros(self.n, self.out_dtype), self.device)
      buf.block_until_ready()
      self._params_flat = buf
    return self._params_flat


  # --- operations ----------------------------------------------------------------------
  def accumulate(self, flat) -> None:
    h = self.pipe.accumulate_async(flat.unsafe_buffer_pointer(), kernel_tag(self.grad_dtype), self.n,
                                   grads_stream=self.stream)
    self.accumulated_ever = True
    h.wait()
    self.micro_batches += 1

  def step(self, flat, *, without: List[int], max_grad_norm: float, skip_nonfinite: bool,
           known_grad_norm: Optional[float]):
    """One pipeline step with the flat gradients (None: the accumulated micro-batches
    alone); returns (StepResult, the new parameter leaves as device arrays)."""
    if flat is None:  # the pipeline adds its accumulator to the gradients: zeros, for this step only
      flat = jax.device_put(jnp.zeros(self.n, self.grad_dtype), self.device)
      flat.block_until_ready()
      scale = 1.0 / self.micro_batches
    else:
      scale = 1.0 / (self.micro_batches + 1)
    params = self._params_buffer()
    # Refused options raise here, before anything moves (the micro-batches stay).
    h = self.pipe.step_async(flat.unsafe_buffer_pointer(), kernel_tag(self.grad_dtype), params.unsafe_buffer_pointer(),
                             kernel_tag(self.out_dtype), self.n, grads_stream=self.stream, grad_scale=scale,
                             max_grad_norm=max_grad_norm, skip_nonfinite=skip_nonfinite,
                             known_grad_norm=-1.0 if known_grad_norm is None else known_grad_norm,
                             tensors_without_grad=[] if self.micro_batches else [self.segment_of[i] for i in without])
    try:
      result = h.wait()
    except RuntimeError as e:  # (the pipeline's advice is for its C++ callers: here each step rewrites the buffer)
      told = str(e).replace("call push_params()", "hostopt.jax's next step rewrites them (the arrays it handed "
                            "out hold the last completed step)").replace("then push_params()", "then step again")
      raise RuntimeError(told) from e
    finally:
      # Applied, skipped or failed: the micro-batches went with this step, except where a
      # failed step over a store kept them (the store holds the step before: a retry takes them).
      self.micro_batches = self.pipe.accumulated_micro_batches
    leaves = self._split(params)
    jax.block_until_ready(leaves)  # the next step rewrites the flat buffer they are read from
    return result, leaves


def _split_flat(pieces: tuple, flat):
  """The leaves of a flat buffer: (offset, size, shape) each."""
  return [flat[offset:offset + size].reshape(shape) for offset, size, shape in pieces]
