"""hostopt.torch as DeepSpeed's ZeRO-Offload optimizer (offload_optimizer: cpu, stage 1 and 2),
two ranks on DeepSpeed's CPU accelerator over gloo (deepspeed_worker.py is one rank).

The one line a DeepSpeed user changes: `optimizer=hostopt.torch.AdamW(...)` in
deepspeed.initialize, with "zero_force_ds_cpu_optimizer": false (and
"zero_allow_untested_optimizer": true: DeepSpeed lists its own optimizers only). ZeRO steps
its fp32 partitions one param group at a time (param_groups set to [group i] around each
step()): hostopt steps that group alone, with no rebuild of its layout. Each rank's losses
equal the same engine with torch.optim.AdamW within the float noise floor, and a resume from
DeepSpeed's own checkpoint (save_checkpoint/load_checkpoint: ZeRO's per-rank optimizer files
carry hostopt's state_dict) continues bit for bit: f32 and 8-bit moments, fp32 and bf16 models.
"""
import json
import os
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("deepspeed")

from integration_support import assert_within_floor, free_port, max_difference, run_ranks  # noqa: E402

WORLD = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
  out = tmp_path_factory.mktemp("deepspeed")
  port = str(free_port())
  env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
             TORCH_EXTENSIONS_DIR=str(out / "torch_extensions"))  # DeepSpeed builds its CPU ops here
  worker = os.path.join(os.path.dirname(__file__), "deepspeed_worker.py")
  logs = [open(out / f"rank{r}.log", "w+") for r in range(WORLD)]
  codes = run_ranks([[sys.executable, worker, str(out), str(r), str(WORLD), port] for r in range(WORLD)], env, logs,
                    hang_net_s=900, stop_at_first_failure=True)
  for r, (code, log) in enumerate(zip(codes, logs)):
    log.seek(0)
    assert code == 0, f"rank {r} exited {code} (-9: stopped after another rank failed or a hang):\n" \
                              f"{log.read()[-4000:]}"
  return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_offload_with_hostopt_equals_torch_adamw_within_the_noise_floor(ranks, stage):
  for result in ranks:
    runs = result[f"stage{stage}"]
    assert len(runs["hostopt"]) == 2 * 200
    floor = max(max_difference(runs["torch"], runs["torch+"]), max_difference(runs["torch"], runs["torch-"]))
    assert_within_floor(runs["hostopt"], runs["torch"], floor,
                        f"DeepSpeed ZeRO-{stage} offload, rank {result['rank']}, hostopt vs torch.optim.AdamW")


@pytest.mark.parametrize("name", ["resume stage2 f32", "resume stage1 8bit", "resume stage2 8bit bf16"])
def test_zero_checkpoint_resume_is_exact(ranks, name):
  for result in ranks:
    checks = result[name]
    assert checks["losses_equal"] and checks["masters_equal"] and checks["state_equal"], (result["rank"], checks)
    if "8bit" in name:
      assert "exp_avg_codes" in checks["state_keys"]
