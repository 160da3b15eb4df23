"""What the integration tests share: the float noise floor of a training run, measured.

Two runs of one engine differ by rounding alone when their arithmetic differs in order; how far
that carries over hundreds of steps depends on the model, the data and the step count, so no
fixed tolerance says whether hostopt "agrees". The floor is measured instead: the engine's own
AdamW run again with its learning rate moved by 2e-7 relative (about two float32 ulps, the size
of a rounding difference), both ways. hostopt's run must stay within a small multiple of the
larger of the two differences; a real defect (a wrong bias correction, a dropped group's decay,
a moment lost at a resume) moves the losses by orders of magnitude more.
"""
import socket
import subprocess
import time
from typing import Callable, List, Sequence

PERTURBATION = 2e-7
FLOOR_MULTIPLE = 4.0


def max_difference(a: Sequence[float], b: Sequence[float]) -> float:
  assert len(a) == len(b) and len(a) > 0, (len(a), len(b))
  return max(abs(x - y) for x, y in zip(a, b))


def noise_floor(run: Callable[[float], Sequence[float]], lr: float, reference: Sequence[float]) -> float:
  """The larger difference from `reference` (the engine's run at `lr`) of its runs at lr(1 +- 2e-7)."""
  return max(max_difference(reference, run(lr * (1 + PERTURBATION))),
             max_difference(reference, run(lr * (1 - PERTURBATION))))


def assert_within_floor(ours: Sequence[float], reference: Sequence[float], floor: float, what: str) -> None:
  difference = max_difference(ours, reference)
  print(f"{what}: {len(ours)} losses, max |hostopt - reference| = {difference:.3g}, noise floor {floor:.3g}")
  assert floor > 0, f"{what}: the perturbed runs equal the reference, so the floor measures nothing"
  assert difference <= FLOOR_MULTIPLE * floor, (
      f"{what}: hostopt's losses differ from the reference by {difference:.3g}, more than {FLOOR_MULTIPLE}x the "
      f"noise floor {floor:.3g}")


def free_port() -> int:
  """A TCP port free now on the loopback (for a process group's rendezvous)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run_ranks(commands: Sequence[Sequence[str]], env: dict, logs: Sequence, hang_net_s: float,
              stop_at_first_failure: bool = False) -> List[int]:
  """Runs one process per command at once, each writing to its log (an open file), and waits
  for them all; returns their exit codes (-9: killed). `hang_net_s` only turns a hang into a
  failure; with `stop_at_first_failure` the others are killed as soon as one fails (they would
  wait for it in a collective), so the failing rank's log is the one that explains."""
  procs = [subprocess.Popen(list(cmd), env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
           for cmd, log in zip(commands, logs)]
  deadline = time.monotonic() + hang_net_s
  try:
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
      if stop_at_first_failure and any(p.poll() not in (None, 0) for p in procs):
        break
      time.sleep(0.2)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  return [p.returncode for p in procs]
