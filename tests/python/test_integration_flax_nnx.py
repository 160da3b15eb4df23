"""hostopt.optax inside a Flax NNX training loop: nnx.Optimizer(model, hostopt.optax.adamw(...),
wrt=nnx.Param) under nnx.jit, side by side with optax.adamw, and the optimizer's state
checkpointed and restored into fresh objects (float32 and 8-bit moments).

"The float noise floor" is measured here, never assumed: optax.adamw run again with its
learning rate moved by 2e-7 relative (about two float32 ulps) both ways, and, for the
default b2 = 0.999, with b2 moved by one float32 ulp both ways; the larger difference.
hostopt computes Adam's bias corrections in float64 from b2 = 0.999; optax rounds b2 to
float32 (0.99900001287) inside 1 - b2**t but not inside its moment's (1 - b2) factor, which
moves its update by ~6e-6 relative: more than a 2e-7 learning-rate perturbation does
(measured: 15x that floor), as much as a one-ulp b2 perturbation does. With b2 = 0.95
(float32 rounding 2.4e-7 relative in 1 - b2) the learning-rate floor alone bounds the
difference."""
import pickle

import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx")
jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402

import hostopt.optax as hoptax  # noqa: E402

jax.config.update("jax_platform_name", "cpu")

STEPS = 300
LR, WD = 1e-3, 1e-2
MULTIPLE = 4  # the hostopt-vs-optax difference may be this multiple of the measured floor


class MLP(nnx.Module):
  """A small MLP with a LayerNorm (scale and bias Params): 5,441 parameters in 8 leaves."""

  def __init__(self, rngs):
    self.l1 = nnx.Linear(16, 64, rngs=rngs)
    self.norm = nnx.LayerNorm(64, rngs=rngs)
    self.l2 = nnx.Linear(64, 64, rngs=rngs)
    self.l3 = nnx.Linear(64, 1, rngs=rngs)

  def __call__(self, x):
    h = jax.nn.gelu(self.norm(self.l1(x)))
    return self.l3(jax.nn.gelu(self.l2(h)))


def data():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((256, 16)).astype(np.float32)
  y = np.sin(x @ rng.standard_normal((16, 1)).astype(np.float32))
  return jnp.asarray(x), jnp.asarray(y)


X, Y = data()


def batch(i):
  b = (i * 64) % 256
  return X[b:b + 64], Y[b:b + 64]


@nnx.jit
def train_step(model, optimizer, x, y):
  def loss_fn(model):
    return jnp.mean((model(x) - y) ** 2)
  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return loss


def fresh(tx, seed=0):
  model = MLP(nnx.Rngs(seed))
  return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


def train(model, optimizer, start, stop):
  return [train_step(model, optimizer, *batch(i)) for i in range(start, stop)]


def losses(tx, steps=STEPS):
  model, optimizer = fresh(tx)
  return np.asarray(jax.device_get(train(model, optimizer, 0, steps)), np.float64)


def max_diff(a, b):
  return float(np.max(np.abs(a - b)))


@pytest.mark.parametrize("b2", [0.95, 0.999])
def test_losses_equal_optax_adamw_within_the_measured_float_noise_floor(b2):
  ref = losses(optax.adamw(LR, b2=b2, weight_decay=WD))
  floor_lr = max(max_diff(ref, losses(optax.adamw(LR * (1 + d), b2=b2, weight_decay=WD))) for d in (2e-7, -2e-7))
  ours = losses(hoptax.adamw(LR, b2=b2, weight_decay=WD))
  diff = max_diff(ref, ours)
  floor = floor_lr
  if b2 == 0.999:  # optax's own float32 rounding of b2 (module docstring): one ulp of b2 either way, measured
    b2_ulps = [float(np.nextafter(np.float32(b2), np.float32(to))) for to in (1, 0)]
    floor = max([floor_lr] + [max_diff(ref, losses(optax.adamw(LR, b2=b, weight_decay=WD))) for b in b2_ulps])
  guard = float(np.spacing(np.float32(np.max(ref))))  # one ulp of the largest loss, for a floor of 0
  print(f"b2={b2}: {STEPS} steps, floor(lr*(1+-2e-7)) {floor_lr:.3g}, floor {floor:.3g}, hostopt-vs-optax {diff:.3g}, "
        f"losses {ref[0]:.4f} -> {ref[-1]:.3g}")
  assert ref[-1] < 0.1 * ref[0]  # it trains
  assert floor > 0  # the floor is a measurement: the perturbed runs did differ
  assert diff <= MULTIPLE * floor + guard, (b2, diff, floor_lr, floor)


def _pure(obj):
  """The NNX state of `obj` as a pure dict of numpy arrays (what a checkpoint holds)."""
  return jax.tree_util.tree_map(np.asarray, nnx.to_pure_dict(nnx.state(obj)))


def _same_bits(a, b):
  la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
  assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
  return all(x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
             for x, y in zip(map(np.asarray, la), map(np.asarray, lb)))


@pytest.mark.parametrize("make", [lambda: hoptax.adamw(LR, weight_decay=WD),
                                  lambda: hoptax.adamw_8bit(LR, weight_decay=WD, rounding_seed=7)],
                         ids=["f32", "8bit"])
def test_checkpoint_round_trip_of_the_nnx_optimizer_is_bitwise_identical_to_not_stopping(tmp_path, make):
  total, stop = 200, 80
  # Straight through.
  model, optimizer = fresh(make())
  straight = train(model, optimizer, 0, total)
  want = (_pure(model), _pure(optimizer))

  # Stopped at `stop`: model and optimizer states pickled as pure numpy trees...
  model, optimizer = fresh(make())
  first = train(model, optimizer, 0, stop)
  path = tmp_path / "ckpt.pkl"
  path.write_bytes(pickle.dumps({"model": _pure(model), "optimizer": _pure(optimizer)}))
  del model, optimizer
  # ...restored into fresh objects (another init, so the restore must overwrite everything).
  ckpt = pickle.loads(path.read_bytes())
  model, optimizer = fresh(make(), seed=1)
  for obj, pure in ((model, ckpt["model"]), (optimizer, ckpt["optimizer"])):
    state = nnx.state(obj)
    nnx.replace_by_pure_dict(state, jax.tree_util.tree_map(jnp.asarray, pure))
    nnx.update(obj, state)
  assert int(optimizer.step[...]) == stop
  resumed = first + train(model, optimizer, stop, total)

  assert _same_bits(straight, resumed)
  assert _same_bits(want, (_pure(model), _pure(optimizer)))
  pure_state = nnx.as_pure(optimizer.opt_state)
  if isinstance(pure_state[0], hoptax.ScaleByAdam8bitState):
    assert int(hoptax.poisoned_blocks(pure_state)) == 0
  losses_ = np.asarray(jax.device_get(resumed))
  assert losses_[-1] < 0.1 * losses_[0]  # it trains


def test_8bit_moments_train_in_nnx_like_optax_adamw():
  # The 8-bit state is hostopt's ScaleByAdam8bitState inside nnx.Optimizer's opt_state: the
  # codes have the params' shapes, the exponent bytes are one [blocks, 2] array.
  model, optimizer = fresh(hoptax.adamw_8bit(LR, weight_decay=WD))
  state = nnx.as_pure(optimizer.opt_state)[0]
  assert isinstance(state, hoptax.ScaleByAdam8bitState)
  params = jax.tree_util.tree_leaves(nnx.as_pure(nnx.state(model, nnx.Param)))
  assert [x.shape for x in jax.tree_util.tree_leaves(state.mu_codes)] == [x.shape for x in params]
  assert state.scales.shape == (sum(-(-x.size // 32) for x in params), 2) and state.scales.dtype == jnp.uint8
  ours = np.asarray(jax.device_get(train(model, optimizer, 0, STEPS)), np.float64)
  assert np.all(np.isfinite(ours)) and int(hoptax.poisoned_blocks(nnx.as_pure(optimizer.opt_state))) == 0
  ref_model, ref_optimizer = fresh(optax.adamw(LR, weight_decay=WD))
  train(ref_model, ref_optimizer, 0, STEPS)
  full = lambda m: float(jnp.mean((m(X) - Y) ** 2))  # the loss on all the data, after training
  start = full(MLP(nnx.Rngs(0)))
  print(f"8-bit: full-data loss {start:.4g} -> {full(model):.4g} after {STEPS} steps; "
        f"optax.adamw {full(ref_model):.4g}")
  assert full(model) < 0.01 * start
  assert full(model) <= 1.05 * full(ref_model)  # 8-bit moments cost nothing here (measured: 0.91x optax's)
