"""One rank of test_integration_deepspeed: DeepSpeed ZeRO-Offload (stage 1 and 2, optimizer on
the CPU) on DeepSpeed's CPU accelerator over gloo, with hostopt.torch.AdamW as its client
optimizer beside torch.optim.AdamW. Writes this rank's losses and checks to a JSON file.

  python deepspeed_worker.py OUT_DIR RANK WORLD_SIZE PORT
"""
import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
out_dir, rank, world, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), LOCAL_RANK=str(rank),
                  WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))

import deepspeed  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

import hostopt.torch as ht  # noqa: E402

torch.set_num_threads(1)  # two ranks on two cores

transformers.logging.set_verbosity_error()
STEPS, LR, MICRO = 200, 3e-3, 4
CONFIG = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                                 embd_pdrop=0.0, attn_pdrop=0.0)
g = torch.Generator().manual_seed(0)
ROWS = torch.randint(0, CONFIG.vocab_size, (64, 16), generator=g)


def engine(optimizer, stage, lr=LR, moments="f32", bf16=False):
  torch.manual_seed(0)
  net = transformers.GPT2LMHeadModel(CONFIG)
  decay = [p for p in net.parameters() if p.ndim >= 2]
  rest = [p for p in net.parameters() if p.ndim < 2]
  groups = [{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}]
  if optimizer == "hostopt":
    opt = ht.AdamW(groups, lr=lr, moments=moments, threads=1)
  else:
    opt = torch.optim.AdamW(groups, lr=lr)
  config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
            "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"}},
            # hostopt in ZeRO-Offload's place of DeepSpeedCPUAdam: the one line a user changes.
            "zero_force_ds_cpu_optimizer": False, "zero_allow_untested_optimizer": True,
            "bf16": {"enabled": bf16}, "steps_per_print": 1 << 30, "wall_clock_breakdown": False}
  eng, _, _, _ = deepspeed.initialize(model=net, optimizer=opt, config=config)
  return eng


def train(eng, first, last):
  """Steps first..last-1: each rank its own micro-batches (data parallel), 2 per step."""
  losses = []
  for step in range(first, last):
    for micro in range(2):
      at = ((step * 2 + micro) * world + rank) * MICRO % len(ROWS)
      rows = ROWS[at:at + MICRO]
      loss = eng(input_ids=rows, labels=rows).loss
      eng.backward(loss)
      eng.step()
      losses.append(float(loss.detach()))
  return losses


def master_weights(eng):
  """This rank's fp32 partitions, as ZeRO keeps them (what the optimizer steps)."""
  return [t.detach().clone() for t in eng.optimizer.single_partition_of_fp32_groups]


def optimizer_state(eng):
  return eng.optimizer.optimizer.state_dict()


def same_state(a, b):
  if a["state"].keys() != b["state"].keys():
    return False
  return all(torch.equal(v, b["state"][k][key]) if torch.is_tensor(v) else v == b["state"][k][key]
             for k, st in a["state"].items() for key, v in st.items())


result = {"rank": rank}
for stage in (1, 2):
  runs = {name: train(engine(*args), 0, STEPS) for name, args in {
      "torch": ("torch", stage), "torch+": ("torch", stage, LR * (1 + 2e-7)), "torch-": ("torch", stage, LR * (1 - 2e-7)),
  }.items()}
  ours = engine("hostopt", stage)
  runs["hostopt"] = train(ours, 0, STEPS)
  assert type(ours.optimizer.optimizer) is ht.AdamW, type(ours.optimizer.optimizer)
  result[f"stage{stage}"] = runs
for stage, moments, bf16 in ((2, "f32", False), (1, "8bit", False), (2, "8bit", True)):
  name = f"resume stage{stage} {moments}{' bf16' if bf16 else ''}"
  whole = engine("hostopt", stage, moments=moments, bf16=bf16)
  losses = train(whole, 0, STEPS)
  first = engine("hostopt", stage, moments=moments, bf16=bf16)
  head = train(first, 0, 100)
  ckpt = os.path.join(out_dir, name.replace(" ", "-"))
  first.save_checkpoint(ckpt, tag="step100")
  resumed = engine("hostopt", stage, moments=moments, bf16=bf16)
  resumed.load_checkpoint(ckpt, tag="step100")
  tail = train(resumed, 100, STEPS)
  result[name] = {
      "losses_equal": head + tail == losses,
      "masters_equal": all(torch.equal(a, b) for a, b in zip(master_weights(whole), master_weights(resumed))),
      "state_equal": same_state(optimizer_state(whole), optimizer_state(resumed)),
      "state_keys": sorted(next(iter(optimizer_state(resumed)["state"].values())).keys()),
  }
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
  json.dump(result, f)
