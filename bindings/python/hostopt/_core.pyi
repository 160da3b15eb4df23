# Type stubs of the extension hostopt._core (bindings/module.cpp and the *_bindings.cpp it calls).
#
# A checked-in file, written from pybind11-stubgen's output and then fixed by hand.
# Regenerate after a change to the bindings (pybind11-stubgen 3.0.0; the generator imports
# the built module, so give it a build's package directory):
#
#   /usr/bin/python3 -m venv --system-site-packages /tmp/stubvenv
#   /tmp/stubvenv/bin/pip install pybind11-stubgen mypy
#   PYTHONPATH=build/release/python /tmp/stubvenv/bin/pybind11-stubgen hostopt._core hostopt._xla_ffi \
#     -o /tmp/stubout --numpy-array-use-type-var
#   diff -u bindings/python/hostopt/_core.pyi /tmp/stubout/hostopt/_core.pyi
#
# then carry the differences over by hand, keeping the fixes below (the generator sees only
# pybind11's signatures, not what the C++ bodies check): arguments the bindings take as
# py::handle and check as numpy arrays are NDArray (float32 where only float32 is taken,
# NDArray[Any] where a dtype tag says f32/bf16-as-uint16/f16); integers converted by
# integer_of or pybind11's int caster are SupportsIndex (an int or a numpy integer, never a
# float); the lists and tuples the bindings build are given their element types; generated
# positional names (arg0, ...) get the C++ parameters' names. .ci/typecheck checks this file
# with mypy, together with the package and the examples.
"""hostopt's C++ core: SIMD Adam/AdamW on host memory"""

import collections.abc
import typing

import numpy
import numpy.typing

__version__: str
# The 8-bit moment format: elements per block, the largest exponent byte the encoder writes
# for (exp_avg, exp_avg_sq), and the byte of a poisoned (NaN) block.
Q8_BLOCK: int
Q8_MAX_EXPONENT_BYTES: tuple[int, int]
Q8_POISONED_EXPONENT_BYTE: int
# The largest step count (hostopt::max_step_count): a resumed count, a per-tensor step.
MAX_STEP_COUNT: int

_F32 = numpy.typing.NDArray[numpy.float32]
# float32, float16, or bfloat16 as its uint16 bits: the dtype tag beside it ("f32", "f16",
# "bf16") says which.
_Tagged = numpy.typing.NDArray[typing.Any]
# Moment codes: uint16 (bf16 bits) or uint8 (8-bit codes), as the format argument says.
_Codes = numpy.typing.NDArray[typing.Any]
_Int = typing.SupportsIndex
_Mode = typing.Literal["adam", "adamw"]
# One tensor of an arena: (name, shape, offset, size, group).
_Segment = tuple[str, list[int], int, int, int]


# A group's hyper-parameters: adam_config's fields (include/hostopt/adam_config.hpp), any of
# lr, beta1, beta2, eps, eps_root, weight_decay (reals), mode ("adam" or "adamw"),
# bias_correction, nesterov, maximize (bools); an unknown key is a ValueError.
_ConfigDict = collections.abc.Mapping[str, typing.Any]
# A parameter group as Optimizer and ShardedOptimizer take it (hostopt.Optimizer builds them):
# {"config": _ConfigDict, "tensors": [(name, shape), ...]} and optionally "moments" ("f32",
# "bf16", "8bit") and "rounding_seed" (an integer in [0, 2**64)).
_GroupSpec = dict[str, typing.Any]


class AdamConfig:
  """Hyper-parameters of a group (hostopt::adam_config), as a struct."""

  def __init__(self, *, lr: float = ..., beta1: float = ..., beta2: float = ..., eps: float = ...,
               eps_root: float = ..., weight_decay: float = ..., mode: _Mode = ..., bias_correction: bool = ...,
               nesterov: bool = ..., maximize: bool = ...) -> None: ...
  def as_dict(self) -> dict[str, typing.Any]: ...
  def __repr__(self) -> str: ...


class ShardedStepRefused(RuntimeError):
  """A sharded step refused on some rank: raised on every rank, nothing applied."""


class StepResult:
  """What a step did (hostopt::step_result)."""

  @property
  def applied(self) -> bool: ...
  @property
  def step(self) -> int: ...
  @property
  def grad_norm(self) -> float:
    """The global norm of the scaled gradients; -1 when the step neither checked nor clipped them."""
  @property
  def applied_scale(self) -> float: ...
  @property
  def skipped_steps(self) -> int: ...
  @property
  def poisoned_blocks(self) -> int: ...
  @property
  def saturated_blocks(self) -> int: ...
  def __repr__(self) -> str: ...


class ShardedOptimizer:
  """One rank's shard of the optimizer state (see hostopt.ShardedOptimizer)."""

  def __init__(self, groups: list[_GroupSpec], world_size: _Int, rank: _Int, threads: _Int = 0) -> None: ...
  @property
  def arena_size(self) -> int: ...
  @property
  def shard(self) -> tuple[int, int]: ...
  @property
  def step_count(self) -> int: ...
  @property
  def state_bytes(self) -> int: ...
  def segments(self) -> list[_Segment]: ...
  def group_config(self, group: _Int, /) -> dict[str, typing.Any]: ...
  def set_group_config(self, group: _Int, config: _ConfigDict, /) -> None: ...
  def set_params(self, name: str, values: _F32, /) -> None: ...
  def shard_sum_squares(self, shard_grad: _Tagged, grad_dtype: str = "f32") -> float: ...
  def step(self, shard_grad: _Tagged, grad_dtype: str = "f32", shard_params: _Tagged | None = None,
           params_dtype: str = "f32", grad_scale: float = 1.0, known_grad_norm: float = -1.0,
           max_grad_norm: float = 0.0, skip_nonfinite: bool = True) -> tuple[bool, int]:
    """Steps the shard (sharded_optimizer::step); returns (applied, step). With a norm reduction and a checked or
    clipping step, the ranks agree first: a step refused on any rank raises ShardedStepRefused on every rank,
    nothing applied."""
  def check_step(self, shard_grad: _Tagged, grad_dtype: str = "f32", shard_params: _Tagged | None = None,
                 params_dtype: str = "f32", grad_scale: float = 1.0, known_grad_norm: float = -1.0,
                 max_grad_norm: float = 0.0, skip_nonfinite: bool = True) -> None:
    """Raises what step would refuse on this rank, given the global norm (known_grad_norm may still be -1),
    changing nothing and calling no reduction: fold its verdict into the norm's all-reduce."""
  def agree_step(self, shard_grad: _Tagged, grad_dtype: str = "f32", shard_params: _Tagged | None = None,
                 params_dtype: str = "f32", grad_scale: float = 1.0, known_grad_norm: float = -1.0,
                 max_grad_norm: float = 0.0, skip_nonfinite: bool = True, *,
                 sum_across_ranks: collections.abc.Callable[[float], float]) -> None:
    """The agreement a reducing step makes, through sum_across_ranks (collective: every rank, before a step given
    known_grad_norm): ShardedStepRefused on every rank when any rank would refuse the step."""
  def save(self, dir: str, save_id: str) -> None: ...
  def commit_save(self, dir: str, save_id: str) -> None: ...
  def set_norm_reduction(self, sum_across_ranks: collections.abc.Callable[[float], float]) -> None:
    """sum_across_ranks(local) -> total across every rank (e.g. torch.distributed.all_reduce in float64): a checked
    or clipping step calls it twice, for the ranks' refusals and for the sums of squares."""
  def load(self, dir: str) -> None: ...


class Optimizer:
  """Flat-arena Adam/AdamW state (see hostopt.Optimizer)."""

  def __init__(self, groups: list[_GroupSpec], threads: _Int = 0, kernel: str = "") -> None: ...
  @property
  def arena_size(self) -> int: ...
  @property
  def num_params(self) -> int: ...
  @property
  def state_bytes(self) -> int: ...
  @property
  def chunk_unit(self) -> int:
    """Elements that chunks and shard cuts are multiples of: 16, or 32 with an 8-bit group"""
  @property
  def num_groups(self) -> int: ...
  @property
  def step_count(self) -> int: ...
  @step_count.setter
  def step_count(self, value: _Int, /) -> None: ...
  @property
  def tensor_steps(self) -> list[int]:
    """Each tensor's own step count (torch's per-parameter step), in segments() order"""
  @tensor_steps.setter
  def tensor_steps(self, steps: collections.abc.Sequence[_Int], /) -> None: ...
  @property
  def threads(self) -> int: ...
  @property
  def skipped_steps(self) -> int: ...
  @skipped_steps.setter
  def skipped_steps(self, value: _Int, /) -> None: ...
  @property
  def usable(self) -> bool: ...
  @property
  def failure_reason(self) -> str: ...
  def segments(self) -> list[_Segment]: ...
  def group_config(self, group: _Int, /) -> dict[str, typing.Any]: ...
  def set_group_config(self, group: _Int, config: _ConfigDict, /) -> None: ...
  def save(self, path: str) -> None: ...
  def load(self, path: str) -> None: ...
  def params(self) -> _F32: ...
  def exp_avg(self) -> _F32: ...
  def exp_avg_sq(self) -> _F32: ...
  def moment_views(self, name: str) -> tuple[_F32, _F32]:
    """float32 views of the moments of a tensor of an f32 group (any arena)."""
  def group_rounding_seed(self, group: _Int) -> int: ...
  def set_group_rounding_seed(self, group: _Int, seed: _Int) -> None: ...
  def group_moments(self, group: _Int, /) -> typing.Literal["f32", "bf16", "8bit"]:
    """How group g stores its moments: 'f32', 'bf16' or '8bit'."""
  def read_moments(self, name: str) -> tuple[_F32, _F32]:
    """One tensor's moments as new float32 arrays (exact), whatever its group's format."""
  def write_moments(self, name: str, exp_avg: _F32, exp_avg_sq: _F32) -> None:
    """Sets one tensor's moments from float32 arrays (encoded, lossy, for a compressed group)."""
  def moment_codes(self, name: str) -> (
      tuple[numpy.typing.NDArray[numpy.uint16], numpy.typing.NDArray[numpy.uint16], None]
      | tuple[numpy.typing.NDArray[numpy.uint8], numpy.typing.NDArray[numpy.uint8], numpy.typing.NDArray[numpy.uint8]]):
    """Views of one tensor's compressed moments: (exp_avg, exp_avg_sq, scales) as uint16 bf16 bits, or uint8 codes
    with (blocks, 2) exponent bytes (8-bit; None for bf16)."""
  def step_flat(self, grad: _Tagged, grad_dtype: str = "f32", out: _Tagged | None = None, out_dtype: str = "f32",
                grad_scale: float = 1.0, max_grad_norm: float = 0.0, skip_nonfinite: bool = False,
                known_grad_norm: float = -1.0) -> StepResult: ...
  def step_tensors(self, grads: list[_Tagged | None], grad_dtype: str = "f32", outs: list[_Tagged] = ...,
                   out_dtype: str = "f32", grad_scale: float = 1.0, max_grad_norm: float = 0.0,
                   skip_nonfinite: bool = False, known_grad_norm: float = -1.0) -> StepResult: ...
  def reset_failure(self) -> None: ...


def arena_layout(groups: list[_GroupSpec]) -> tuple[list[_Segment], int]:
  """(segments, arena size) of the groups' layout, without allocating any state."""


class StoredOptimizer:
  """Optimizer state on a drive (see hostopt.StoredOptimizer)."""

  @staticmethod
  def create(groups: list[_GroupSpec], dirs: list[str], staging_bytes: _Int, buffers: _Int, chunk_elements: _Int,
             sync: bool, io: str, threads: _Int, kernel: str, initial_params: _Tagged | None,
             range: tuple[_Int, _Int] | None = None) -> StoredOptimizer: ...
  @staticmethod
  def open(groups: list[_GroupSpec], dirs: list[str], staging_bytes: _Int, buffers: _Int, chunk_elements: _Int,
           sync: bool, io: str, threads: _Int, kernel: str, range: tuple[_Int, _Int] | None = None,
           previous: bool = False) -> StoredOptimizer: ...
  @staticmethod
  def import_state(ram: Optimizer | ShardedOptimizer, groups: list[_GroupSpec], dirs: list[str], staging_bytes: _Int,
                   buffers: _Int, chunk_elements: _Int, sync: bool, io: str) -> StoredOptimizer: ...
  def step_flat(self, grad: _Tagged, grad_dtype: str, out: _Tagged | None, out_dtype: str, grad_scale: float,
                max_grad_norm: float, skip_nonfinite: bool, known_grad_norm: float) -> StepResult: ...
  def adopt_at_next_step(self, adopt: collections.abc.Sequence[tuple[_Int, _Int]], values: _F32) -> None: ...
  @property
  def pending_adoption(self) -> int: ...
  def read_params_range(self, begin: _Int, end: _Int, out: _Tagged, out_dtype: str) -> None: ...
  def copy_state_to(self, ram: Optimizer | ShardedOptimizer) -> None: ...
  def step_flat_adopting(self, grad: _Tagged, grad_dtype: str, out: _Tagged | None, out_dtype: str, grad_scale: float,
                         max_grad_norm: float, skip_nonfinite: bool, known_grad_norm: float, params: _Tagged | None,
                         adopt: list[tuple[_Int, _Int]],
                         tensors_without_grad: collections.abc.Sequence[_Int] = ...) -> StepResult: ...
  def copy_params_to(self, out: _Tagged, out_dtype: str) -> None: ...
  def save(self, path: str) -> None: ...
  def save_shard(self, dir: str, save_id: str, world_size: _Int, rank: _Int) -> None: ...
  def commit_shard_save(self, dir: str, save_id: str, world_size: _Int) -> None: ...
  def close(self) -> None: ...
  @property
  def step_count(self) -> int: ...
  @property
  def skipped_steps(self) -> int: ...
  @property
  def tensor_steps(self) -> list[int]: ...
  @property
  def arena_size(self) -> int: ...
  @property
  def range(self) -> tuple[int, int]: ...
  @property
  def num_groups(self) -> int: ...
  @property
  def chunks(self) -> int: ...
  @property
  def chunk_elements(self) -> int: ...
  @property
  def chunk_bytes(self) -> int: ...
  @property
  def staging_bytes(self) -> int: ...
  @property
  def stripes(self) -> int: ...
  @property
  def recovery(self) -> str: ...
  @property
  def step_io_bytes(self) -> int: ...
  @property
  def io_backend(self) -> str: ...
  @property
  def cached_pages(self) -> int: ...
  def segments(self) -> list[_Segment]: ...
  def group_config(self, group: _Int, /) -> dict[str, typing.Any]: ...
  def set_group_config(self, group: _Int, config: _ConfigDict, /) -> None: ...

class CopyEngine:
  """A device behind the offload pipeline (cuda or host). Streams and events are opaque handles (ints)."""

  @staticmethod
  def host(bandwidth_gbps: float = 0.0) -> CopyEngine: ...
  @staticmethod
  def cuda(device: _Int = 0) -> CopyEngine: ...
  @staticmethod
  def cuda_available() -> bool: ...
  @property
  def name(self) -> str: ...
  @property
  def flag_mechanism(self) -> str: ...
  @property
  def sticky_error(self) -> str: ...
  def create_stream(self) -> int: ...
  def destroy_stream(self, stream: _Int, /) -> None: ...
  def create_event(self) -> int: ...
  def destroy_event(self, event: _Int, /) -> None: ...
  def record_event(self, event: _Int, stream: _Int, /) -> None: ...
  def stream_wait_event(self, stream: _Int, event: _Int, /) -> None: ...
  def synchronize_event(self, event: _Int, /) -> None: ...
  def synchronize_stream(self, stream: _Int, /) -> None: ...
  def event_done(self, event: _Int, /) -> bool: ...


class PipelineHandle:
  """A step or accumulation in flight."""

  def wait(self) -> StepResult: ...
  def done(self) -> bool: ...
  @property
  def grads_consumed(self) -> int: ...
  @property
  def params_ready(self) -> int: ...


class OffloadPipeline:
  """offload_pipeline over an Optimizer or a StoredOptimizer: device gradients in, device parameters out. Device
  buffers, streams and events are addresses/handles (ints); dtypes are "f32", "bf16" or "f16"."""

  def __init__(self, optimizer: Optimizer | StoredOptimizer, engine: CopyEngine, chunk_elems: _Int = 4194304, depth: _Int = 2,
               grad_type: str = "f32", param_type: str = "f32") -> None: ...
  def step_async(self, grads: _Int, grad_type: str, params: _Int, param_type: str, size: _Int,
                 grads_stream: _Int = 0, grads_event: _Int = 0, params_stream: _Int = 0, params_event: _Int = 0,
                 grad_scale: float = 1.0, max_grad_norm: float = 0.0, skip_nonfinite: bool = False,
                 known_grad_norm: float = -1.0, chunk_grads_events: collections.abc.Sequence[_Int] = ...,
                 tensors_without_grad: collections.abc.Sequence[_Int] = ...) -> PipelineHandle: ...
  def accumulate_async(self, grads: _Int, grad_type: str, size: _Int, grads_stream: _Int = 0,
                       grads_event: _Int = 0) -> PipelineHandle: ...
  def push_params(self, params: _Int, param_type: str, size: _Int) -> None: ...
  @property
  def copy_in_stream(self) -> int: ...
  @property
  def usable(self) -> bool: ...
  @property
  def failure_reason(self) -> str: ...
  @property
  def num_chunks(self) -> int: ...
  @property
  def chunk_elems(self) -> int: ...
  @property
  def pinned_bytes(self) -> int: ...
  @property
  def accumulated_micro_batches(self) -> int:
    """Micro-batches in the accumulator, for the next step (a failed step over a store keeps them)."""
  def last_timeline(self) -> dict[str, typing.Any]:
    """wall_seconds and each stage's busy seconds (copy_in, update, copy_out, accumulate) as floats, and
    chrome_trace (a JSON string)."""


def active_kernel() -> str:
  """Name of the kernel used by default (HOSTOPT_FORCE_ARCH overrides)."""
def kernels() -> list[tuple[str, bool]]:
  """(name, supported) for every kernel compiled in, best first."""
def max_threads() -> int:
  """The most worker threads a step may ask for (hostopt::max_threads)."""
def refused_fields(config: AdamConfig, signed_rates: bool = False) -> list[str]:
  """The fields of an AdamConfig that C++'s rule refuses, in its field order ([]: valid): hostopt::validate's, or
  with signed_rates the optax form's (adam_update: lr and weight_decay of either sign, eps and eps_root +inf
  allowed)."""
def moment_format(name: str) -> typing.Literal["f32", "bf16", "8bit"]:
  """The canonical name of a moment format ('f32', 'bf16', '8bit'); ValueError naming an unknown one."""
def moment_scale_bytes(format: str, n: _Int, /) -> int:
  """Bytes of block exponents the format needs for n elements (hostopt::moment_scale_bytes)."""
def adam_step(params: _F32, exp_avg: _F32, exp_avg_sq: _F32, grad: _Tagged, grad_dtype: str = "f32",
              out: _Tagged | None = None, out_dtype: str = "f32", config: _ConfigDict = ..., step: _Int = 1,
              grad_scale: float = 1.0, threads: _Int = 0, kernel: str = "") -> None:
  """One fused Adam/AdamW step in place over float32 numpy arrays (see hostopt.adam_step)."""
def adam_step_compressed(params: _F32, exp_avg: _Codes, exp_avg_sq: _Codes, scales: numpy.typing.NDArray[numpy.uint8],
                         format: str, grad: _Tagged, grad_dtype: str = "f32", out: _Tagged | None = None,
                         out_dtype: str = "f32", config: _ConfigDict = ..., step: _Int = 1, grad_scale: float = 1.0,
                         seed: _Int = 0, first_index: _Int = 0, state_size: _Int = 0, threads: _Int = 0,
                         kernel: str = "") -> None:
  """One fused Adam/AdamW step over compressed moments (see hostopt.CompressedMoments)."""
def encode_moments(exp_avg: _F32, exp_avg_sq: _F32, exp_avg_codes: _Codes, exp_avg_sq_codes: _Codes,
                   scales: numpy.typing.NDArray[numpy.uint8], format: str, seed: _Int, /) -> None:
  """f32 moments -> compressed (lossy)."""
def decode_moments(exp_avg_codes: _Codes, exp_avg_sq_codes: _Codes, scales: numpy.typing.NDArray[numpy.uint8],
                   format: str, exp_avg: _F32, exp_avg_sq: _F32, /) -> None:
  """compressed -> f32 moments (exact)."""
def optax_update_leaves(params: list[_F32 | None], exp_avg: list[_F32], exp_avg_sq: list[_F32],
                        grads: list[_Tagged], grad_dtype: str, updates: list[_Tagged],
                        configs: collections.abc.Sequence[AdamConfig], config_of: collections.abc.Sequence[_Int],
                        step: _Int, grad_scale: float = 1.0, threads: _Int = 0) -> None:
  """The optax form over many leaves (hostopt::adam_update over update_leaf), one call, one parallel region, GIL
  released; configs are AdamConfig structs, config_of[i] indexes leaf i's."""
def accumulate(acc: _F32, grad: _Tagged, grad_dtype: str, first: bool, threads: _Int = 0) -> None:
  """acc = grad (first) or acc + grad, in f32 (hostopt::accumulate_gradient), GIL released."""
def convert(in_: _F32, /, out: _Tagged, out_dtype: str, threads: _Int = 0) -> None:
  """float32 -> out_dtype with round-to-nearest-even (the step's copy-out rounding). (The first argument, "in" in
  the binding, is a Python keyword: pass it by position.)"""
def shard_of(arena_size: _Int, world_size: _Int, rank: _Int, unit: _Int = 16) -> tuple[int, int]:
  """[begin, end) of the arena owned by `rank` (hostopt::shard_of): cut on multiples of `unit` (16; 32 when a group
  has 8-bit moments, as ShardedOptimizer and Optimizer.chunk_unit use)."""
def shard_of_groups(groups: list[_GroupSpec], world_size: _Int, rank: _Int) -> tuple[int, int]:
  """[begin, end) of the groups' layout owned by `rank` (hostopt::shard_of(groups, ...)): the unit is 32 when a
  group has 8-bit moments, else 16."""
