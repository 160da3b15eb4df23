"""One process of tests/python/test_integration_jax_multiprocess.py: multi-process JAX on CPU
(jax.distributed over gloo, 2 CPU devices per process), hostopt's optimizers on each
process's shards of one global model.

  python jax_multiprocess_worker.py MODE PROCESS_ID NUM_PROCESSES PORT OUT_DIR [LR_SCALE]

NUM_PROCESSES 1 runs the same global model and data in this one process, on one device
(no jax.distributed): the reference. A process that succeeds writes
OUT_DIR/MODE-PROCESS_ID.npz and prints "process N: done"; one that fails prints its error
and exits 1 at once (os._exit: a plain exit would wait in jax.distributed's shutdown
barrier for processes that are themselves waiting in a collective, minutes). Modes:

  train   1. hostopt.optax.adamw after optax.clip_by_global_norm, one jitted step, params
             and state sharded over a mesh of every process's devices: STEPS steps, and one
             update of a fixed gradient (bits compared with the reference's).
          2. hostopt.jax.adamw, one optimizer per process over that process's own shards
             (its state in that process's host memory), the global norm for clipping
             computed under jit and passed as grad_norm: STEPS steps, and one step of a
             fixed gradient. Also records what hostopt.jax says to a global array.
  exponent  8-bit moments (hostopt.optax.adamw_8bit), the exponent bytes sharded like the
          codes; process 1 alone restores a corrupt byte into its shard: every process must
          refuse the step with hostopt's message.
  shape_late  two good steps, then process 1 alone hands the optimizer a gradient of
          another shape (refused by hostopt there, at trace time).
"""
import os
import sys
import traceback

MODE, PID, NPROC, PORT, OUT = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
LR_SCALE = float(sys.argv[6]) if len(sys.argv) > 6 else 1.0
LOCAL_DEVICES = 2 if NPROC > 1 else 1
STEPS = 200

import jax  # noqa: E402

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", LOCAL_DEVICES)
if NPROC > 1:
  # gloo is jax 0.10's default for CPU collectives; named so that an older default (none)
  # cannot silently leave the processes without cross-process collectives.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{PORT}", num_processes=NPROC, process_id=PID,
                             initialization_timeout=100)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import hostopt.jax  # noqa: E402
import hostopt.optax  # noqa: E402

LR = 3e-3 * LR_SCALE
WD = 1e-2
mesh = Mesh(np.array(jax.devices()), ("x",))  # every process's devices, process after process
assert mesh.size == LOCAL_DEVICES * NPROC and len(jax.local_devices()) == LOCAL_DEVICES

# The same global model and data in every process (and in the one-process reference).
rng = np.random.default_rng(0)
HOST = {"w1": (0.3 * rng.standard_normal((16, 64))).astype(np.float32), "b1": np.zeros(64, np.float32),
        "w2": (0.3 * rng.standard_normal((64, 4))).astype(np.float32), "b2": np.zeros(4, np.float32)}
SPECS = {"w1": P(None, "x"), "b1": P("x"), "w2": P("x", None), "b2": P("x")}  # model parallel over x
X = rng.standard_normal((256, 16)).astype(np.float32)
Y = np.sin(X @ rng.standard_normal((16, 4)).astype(np.float32))


def global_array(host, spec):
  """A global jax.Array of `host`'s value, each process placing its own devices' pieces."""
  sharding = NamedSharding(mesh, spec)
  return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def gathered(tree):
  """The whole arrays of a tree of global arrays, in every process."""
  return jax.tree_util.tree_map(np.asarray, multihost_utils.process_allgather(tree, tiled=True))


def scalar(x):
  """A replicated scalar's value (its local copy)."""
  return np.asarray(x.addressable_data(0))


params = {k: global_array(v, SPECS[k]) for k, v in HOST.items()}
fresh_params = lambda: {k: global_array(v, SPECS[k]) for k, v in HOST.items()}  # for a donating step
x, y = global_array(X, P("x")), global_array(Y, P("x"))  # the batch: data parallel over x too


def loss_fn(p, x, y):
  h = jnp.tanh(x @ p["w1"] + p["b1"])
  return jnp.mean((h @ p["w2"] + p["b2"] - y) ** 2)


def save(**arrays):
  np.savez(os.path.join(OUT, f"{MODE}-{PID}.npz"), **arrays)


def run_optax():
  """hostopt.optax over the global arrays."""
  adam = hostopt.optax.adamw(LR, weight_decay=WD)
  tx = optax.chain(optax.clip_by_global_norm(1.0), adam)

  def train_step(p, state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(p, x, y)
    updates, state = tx.update(grads, state, p)
    return optax.apply_updates(p, updates), state, loss

  # One update of a fixed gradient by hostopt's adamw alone (no reduction anywhere: the clip's
  # global norm, summed in another order over 4 shards, may differ from one device's by an ulp):
  # its bits are compared with the one-process run's.
  probe_g = {k: global_array(np.cos(3 * v + 1).astype(np.float32), SPECS[k]) for k, v in HOST.items()}
  probe = jax.jit(adam.update)(probe_g, jax.jit(adam.init)(params), params)
  # The FFI call's operands are each device's shards: w1's is [16, 64 / devices].
  state = jax.jit(tx.init)(params)
  step = jax.jit(train_step, donate_argnums=(0, 1))
  hlo = step.lower(params, state, x, y).compile().as_text()
  calls = [line for line in hlo.splitlines() if 'custom_call_target="hostopt_adam_update"' in line]
  assert len(calls) == 1 and f"f32[16,{64 // mesh.size}]" in calls[0], calls
  if mesh.size > 1:
    assert "f32[16,64]" not in calls[0], calls
  losses = []
  p = fresh_params()  # donated
  for _ in range(STEPS):
    p, state, loss = step(p, state, x, y)
    losses.append(scalar(loss))
  for k, v in p.items():  # the params keep their shardings
    assert v.sharding.is_equivalent_to(NamedSharding(mesh, SPECS[k]), v.ndim), (k, v.sharding)
  mu = state[1][0].mu
  for k, v in mu.items():
    assert v.sharding.is_equivalent_to(NamedSharding(mesh, SPECS[k]), v.ndim), (k, v.sharding)
  flat = lambda tree, tag: {f"{tag}_{k}": v for k, v in gathered(tree).items()}
  return dict(losses=np.array(losses, np.float32), **flat(p, "p"), **flat(mu, "mu"), **flat(probe[0], "probe_u"),
              **flat(probe[1][0].nu, "probe_nu"))


def run_hostjax():
  """hostopt.jax, one optimizer per process over its own shards."""
  if NPROC > 1:
    # hostopt.jax copies the params into its own arena: a global array spanning other
    # processes' devices cannot be read by this one.
    try:
      hostopt.jax.adamw(params, LR)
      refusal = "taken"
    except Exception as e:  # noqa: BLE001 - recorded for the test to check
      refusal = f"{type(e).__name__}: {e}"
  else:
    refusal = ""
  # One optimizer per process, over this process's own shards: each leaf a list of its
  # addressable shards, in device order.
  def local(tree):
    return {k: [s.data for s in sorted(v.addressable_shards, key=lambda s: s.device.id)] for k, v in tree.items()}

  def to_global(shards, like):
    return {k: jax.make_array_from_single_device_arrays(
        like[k].shape, like[k].sharding,
        [jax.device_put(a, s.device) for a, s in zip(shards[k], sorted(like[k].addressable_shards,
                                                                     key=lambda s: s.device.id))])
            for k in like}

  opt = hostopt.jax.adamw(local(params), LR, weight_decay=WD, max_grad_norm=1.0)

  @jax.jit
  def grads_step(p, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(p, x, y)
    # Cut like the params (XLA would pick its own layout for them), so that each process's
    # shards of the gradients are those of its optimizer's params.
    grads = jax.lax.with_sharding_constraint(grads, {k: NamedSharding(mesh, s) for k, s in SPECS.items()})
    return loss, grads, optax.global_norm(grads)  # the norm over every process's shards

  losses, p = [], params
  for _ in range(STEPS):
    loss, grads, norm = grads_step(p, x, y)
    p = to_global(opt.step(local(grads), grad_norm=float(scalar(norm))), p)
    losses.append(scalar(loss))
  assert opt.last_step.applied and opt.step_count == STEPS
  # One step of a fixed gradient from a fresh optimizer: its bits are compared with the
  # reference's (hostopt.jax's step is elementwise: per process or whole, the same bits).
  probe_g = {k: global_array(np.cos(3 * v + 1).astype(np.float32), SPECS[k]) for k, v in HOST.items()}
  probe = to_global(hostopt.jax.adamw(local(params), LR, weight_decay=WD).step(local(probe_g)), params)
  return dict(losses=np.array(losses, np.float32), refusal=np.array(refusal),
              **{f"p_{k}": v for k, v in gathered(p).items()},
              **{f"probe_p_{k}": v for k, v in gathered(probe).items()})


def run_train():
  save(**{f"optax_{k}": v for k, v in run_optax().items()}, **{f"hostjax_{k}": v for k, v in run_hostjax().items()})


def run_exponent():
  tx = hostopt.optax.adamw_8bit(LR)
  # 64 x 64 on 4 devices: 1024 elements, 32 blocks of 32, on each; the exponent bytes, one
  # [128, 2] array, are cut alike (as a sharded checkpoint restores them).
  w = {"w": global_array(np.cos(np.arange(64 * 64, dtype=np.float32)).reshape(64, 64), P("x"))}
  state = jax.jit(tx.init)(w)
  host_scales = np.zeros((128, 2), np.uint8)  # this process's copy of the checkpoint's exponent bytes
  if PID == 1:
    host_scales[101, 1] = 230  # in process 1's part (rows 64..127): nu's bytes never exceed 223
  state = (state[0]._replace(scales=global_array(host_scales, P("x", None))),) + tuple(state[1:])
  u, _ = jax.jit(tx.update)(w, state, w)
  jax.block_until_ready(u)
  save(taken=np.array(True))


def run_shape_late():
  # Two good steps (the processes' collectives set up), then process 1 alone hands the
  # optimizer a gradient of another shape.
  tx = optax.chain(optax.clip_by_global_norm(1.0), hostopt.optax.adamw(LR))

  def train_step(p, state, x, y, bad):
    loss, grads = jax.value_and_grad(loss_fn)(p, x, y)
    if bad:
      grads = dict(grads, b1=grads["b1"][:32])
    updates, state = tx.update(grads, state, p)
    return optax.apply_updates(p, updates), state, loss

  step = jax.jit(train_step, static_argnums=4)
  state, p = jax.jit(tx.init)(params), params
  for t in range(4):
    p, state, loss = step(p, state, x, y, t >= 2 and PID == 1)
    jax.block_until_ready(loss)
  save(taken=np.array(True))


try:
  {"train": run_train, "exponent": run_exponent, "shape_late": run_shape_late}[MODE]()
except Exception:  # noqa: BLE001 - one clear error, then a nonzero exit
  traceback.print_exc()
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(1)  # not sys.exit: jax.distributed's shutdown barrier would wait for the other processes
print(f"process {PID}: done")
