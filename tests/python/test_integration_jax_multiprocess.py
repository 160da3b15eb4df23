"""hostopt under multi-process JAX on CPU: 2 processes (jax.distributed, gloo collectives, 2 CPU
devices each) train one global model whose params and optimizer state are sharded over all
4 devices, against the same model and data in one process on one device
(tests/python/jax_multiprocess_worker.py is one process).

- hostopt.optax.adamw under jit: its FFI call runs on each device's shards (the call's
  operands in the compiled step are the shards), and one update of a fixed gradient by adamw
  alone is bit for bit the one-process update (Adam is elementwise; the clip, whose global
  norm is summed in another order over the shards, is left out of that probe). After 200 steps the results differ from the one-process run's only
  through the gradients' reductions: no more than 4x the float noise floor, measured as the
  one-process run against itself with the learning rate moved by 2e-7 relative, both ways.
- hostopt.jax: its arena cannot take a global array spanning other processes' devices (it
  copies the params into host memory it owns: JAX refuses to fetch them, and says so); one
  optimizer per process over that process's own shards, given the global norm, works, and is
  held to the same measures.
- A bad input on one process: a corrupt 8-bit exponent byte in process 1's shard of the
  state is refused by every process with hostopt's one message (XLA reduces the check over
  every shard); a gradient of another shape on process 1 alone is refused there by hostopt,
  and the other process's next collective fails as process 1 exits.

Each process is given HANG_NET_S: a safety net that turns a hang into a failure, never a
bound on speed."""
import os
import subprocess
import sys
import time

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("optax")

from hostopt import _xla  # noqa: E402
from integration_support import free_port  # noqa: E402

if not _xla._SHARDY or not hasattr(jax.config, "jax_num_cpu_devices"):
  pytest.skip(f"jax {jax.__version__}: per-shard calls need Shardy and jax_num_cpu_devices (jax >= 0.5)",
              allow_module_level=True)

HANG_NET_S = 120
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jax_multiprocess_worker.py")
MULTIPLE = 4


def launch(tmp_path, mode, *, references=()):
  """Runs MODE on 2 processes, and the one-process reference at each LR_SCALE in
  `references`, side by side. Returns {name: (returncode, output, npz or None)}."""
  env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)
  port = free_port()
  runs = {}
  for pid in (0, 1):
    out = tmp_path / f"multi-{mode}"
    out.mkdir(exist_ok=True)
    runs[f"process {pid}"] = (out, pid, [sys.executable, WORKER, mode, str(pid), "2", str(port), str(out)])
  for scale in references:
    out = tmp_path / f"single-{mode}-{scale}"
    out.mkdir()
    runs[f"single {scale}"] = (out, 0, [sys.executable, WORKER, mode, "0", "1", "0", str(out), repr(scale)])
  procs = {name: subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for name, (_, _, cmd) in runs.items()}
  deadline = time.monotonic() + HANG_NET_S
  results, hung = {}, []
  for name, p in procs.items():
    try:
      output, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      p.kill()
      output, _ = p.communicate()
      hung.append(name)
    out, pid, _ = runs[name]
    npz = out / f"{mode}-{pid}.npz"
    results[name] = (p.returncode, output, dict(np.load(npz)) if npz.exists() else None)
  assert not hung, f"{hung} still running after {HANG_NET_S} s: " + "\n".join(
      f"--- {n}\n{results[n][1][-2000:]}" for n in hung)
  return results


def succeeded(results):
  for name, (rc, output, npz) in results.items():
    assert rc == 0 and npz is not None, f"{name} exited with {rc}:\n{output[-4000:]}"
  return {name: npz for name, (_, _, npz) in results.items()}


def max_diff(a, b, keys):
  return max(float(np.max(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64)))) for k in keys)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  scales = (1 + 2e-7, 1 - 2e-7)
  return succeeded(launch(tmp_path_factory.mktemp("train"), "train", references=(1.0,) + scales)), scales


@pytest.mark.parametrize("front", ["optax", "hostjax"])
def test_two_processes_train_like_one_within_the_measured_float_noise_floor(trained, front):
  out, scales = trained
  multi, other, single = out["process 0"], out["process 1"], out["single 1.0"]
  keys = sorted(k for k in multi if k.startswith(front + "_") and k != "hostjax_refusal")
  for k in keys:  # every process gathered the same global arrays
    assert np.array_equal(multi[k], other[k]), k
  probe = [k for k in keys if "_probe_" in k]
  assert probe and all(np.array_equal(multi[k], single[k]) for k in probe), "one update is not bit for bit"
  for what in ("losses", "p_"):
    ks = [k for k in keys if k.startswith(f"{front}_{what}")]
    floor = max(max_diff(single, out[f"single {scale}"], ks) for scale in scales)
    diff = max_diff(single, multi, ks)
    guard = float(np.spacing(np.float32(max(np.max(np.abs(single[k])) for k in ks))))
    print(f"{front} {what}: 200 steps, floor {floor:.3g}, two processes vs one {diff:.3g}")
    assert floor > 0 and diff <= MULTIPLE * floor + guard, (front, what, diff, floor)
  losses = single[f"{front}_losses"]
  assert losses[-1] < 0.2 * losses[0]  # it trains


def test_hostopt_jax_cannot_take_a_global_array_spanning_processes(trained):
  out, _ = trained
  refusal = str(out["process 0"]["hostjax_refusal"])
  assert refusal.startswith("RuntimeError: Fetching value for `jax.Array` that spans non-addressable"), refusal


def test_a_corrupt_state_shard_on_one_process_is_refused_by_every_process(tmp_path):
  results = launch(tmp_path, "exponent")
  want = "leaf 0: block 101's exp_avg_sq exponent byte is 230: the 8-bit encoder writes at most 223"
  for name, (rc, output, npz) in results.items():
    assert rc != 0 and npz is None, f"{name} took the step:\n{output[-3000:]}"
    assert want in output, f"{name}:\n{output[-3000:]}"
    assert "Gloo" not in output.split("Traceback")[-1], output[-3000:]  # hostopt's refusal, not a dead peer's


def test_a_gradient_refused_on_one_process_fails_every_process(tmp_path):
  results = launch(tmp_path, "shape_late")
  for name, (rc, output, npz) in results.items():
    assert rc != 0 and npz is None, f"{name} went on:\n{output[-3000:]}"
  refused = results["process 1"][1].split("Traceback")[-1]
  assert "ValueError: mu[0] has shape (64,): expected (32,) like updates[0]" in refused, refused[-3000:]
  # Process 0 is told by JAX's runtime: its next collective with process 1 fails.
  waited = results["process 0"][1].split("Traceback")[-1]
  assert "JaxRuntimeError" in waited and "Connection closed by peer" in waited, waited[-3000:]
