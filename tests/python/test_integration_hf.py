"""hostopt.torch inside Hugging Face transformers' Trainer and accelerate's Accelerator.

A small GPT-2 from transformers' own config class (random weights, no download), trained 200
optimizer steps with gradient accumulation, clipping, warmup and decay/no-decay groups as the
Trainer makes them. hostopt's losses must equal the Trainer's default AdamW (torch's fused
AdamW) within the float noise floor (integration_support), and a resume from the Trainer's
own checkpoint (optimizer.pt, scheduler.pt, rng state) must continue bit for bit.
"""
import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

import hostopt.torch as ht  # noqa: E402
from integration_support import assert_within_floor, noise_floor  # noqa: E402

transformers.logging.set_verbosity_error()
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

STEPS, LR = 200, 3e-3
CONFIG = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)


def dataset():
  g = torch.Generator().manual_seed(0)
  rows = [torch.randint(0, CONFIG.vocab_size, (16,), generator=g) for _ in range(64)]
  return [{"input_ids": r, "labels": r} for r in rows]


class RecordingTrainer(transformers.Trainer):
  """The Trainer, recording every micro-batch's loss unrounded (its logs round to 4 digits)."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.losses = []

  def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
    result = super().compute_loss(model, inputs, return_outputs, **kwargs)
    self.losses.append(float((result[0] if return_outputs else result).detach()))
    return result


def arguments(out, lr=LR, save_steps=None, steps=STEPS):
  return transformers.TrainingArguments(
      str(out), max_steps=steps, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_grad_norm=1.0,
      learning_rate=lr, weight_decay=0.01, warmup_steps=10, logging_steps=10_000, report_to=[], use_cpu=True,
      seed=0, disable_tqdm=True, save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500)


def model():
  torch.manual_seed(0)
  return transformers.GPT2LMHeadModel(CONFIG)


def train(out, lr=LR, optimizer_kwargs=None, optimizers=None, save_steps=None, resume=None, net=None):
  net = net or model()
  kwargs = {}
  if optimizer_kwargs is not None:
    kwargs["optimizer_cls_and_kwargs"] = (ht.AdamW, dict(optimizer_kwargs, lr=lr))
  if optimizers is not None:
    kwargs["optimizers"] = optimizers(net)
  trainer = RecordingTrainer(model=net, args=arguments(out, lr, save_steps), train_dataset=dataset(), **kwargs)
  trainer.train(resume_from_checkpoint=resume)
  return trainer


def state_equal(a, b):
  assert a["param_groups"] == b["param_groups"]
  assert a["state"].keys() == b["state"].keys()
  for k, st in a["state"].items():
    assert st.keys() == b["state"][k].keys(), k
    for key, value in st.items():
      other = b["state"][k][key]
      assert torch.equal(value, other) if torch.is_tensor(value) else value == other, (k, key)


def params_equal(a, b):
  return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_trainer_with_hostopt_equals_its_default_adamw_within_the_noise_floor(tmp_path):
  reference = train(tmp_path / "default")
  assert reference.args.optim in ("adamw_torch_fused", "adamw_torch")  # the Trainer's default AdamW
  ours = train(tmp_path / "hostopt", optimizer_kwargs={})
  assert isinstance(ours.optimizer.optimizer if hasattr(ours.optimizer, "optimizer") else ours.optimizer, ht.AdamW)
  assert len(ours.losses) == 2 * STEPS  # two micro-batches per step
  # The decay/no-decay groups the Trainer built reach hostopt: biases and LayerNorms undecayed.
  decays = sorted(g["weight_decay"] for g in ours.optimizer.param_groups)
  assert decays == [0.0, 0.01]
  floor = noise_floor(lambda lr: train(tmp_path / f"default-{lr}", lr=lr).losses, LR, reference.losses)
  assert_within_floor(ours.losses, reference.losses, floor, "Trainer, hostopt.torch.AdamW vs adamw_torch_fused")


def test_trainer_takes_a_ready_optimizer_and_scheduler(tmp_path):
  """optimizers=(hostopt.torch.AdamW(...), scheduler), built by the user from the Trainer's own
  grouping: the same bits as the Trainer building hostopt itself."""
  built = train(tmp_path / "built", optimizer_kwargs={})

  def ready(net):
    decay = set(transformers.Trainer.get_decay_parameter_names(None, net))
    groups = [{"params": [p for n, p in net.named_parameters() if n in decay], "weight_decay": 0.01},
              {"params": [p for n, p in net.named_parameters() if n not in decay], "weight_decay": 0.0}]
    opt = ht.AdamW(groups, lr=LR)
    return opt, transformers.get_linear_schedule_with_warmup(opt, 10, STEPS)

  given = train(tmp_path / "given", optimizers=ready)
  assert given.losses == built.losses


@pytest.mark.parametrize("moments", ["f32", "8bit"])
def test_trainer_checkpoint_resume_is_exact(tmp_path, moments):
  whole = train(tmp_path / "whole", optimizer_kwargs={"moments": moments}, save_steps=100)
  checkpoint = tmp_path / "whole" / "checkpoint-100"
  assert (checkpoint / "optimizer.pt").exists() and (checkpoint / "scheduler.pt").exists()
  resumed = train(tmp_path / "resumed", optimizer_kwargs={"moments": moments}, save_steps=100, resume=str(checkpoint))
  assert resumed.state.global_step == STEPS
  assert resumed.losses == whole.losses[2 * 100:]
  assert params_equal(whole.model, resumed.model)
  state_equal(whole.optimizer.state_dict(), resumed.optimizer.state_dict())
  if moments == "8bit":
    assert "exp_avg_codes" in next(iter(resumed.optimizer.state_dict()["state"].values()))


# --- accelerate ---------------------------------------------------------------------------
def accelerate_run(make_optimizer, lr=LR, stop_at=None, resume_from=None, save_to=None):
  """accelerate's loop: prepare, accumulate (2 micro-batches), clip_grad_norm_, a warmup schedule;
  save_state at `stop_at` (then stop), or load_state from `resume_from` and go on."""
  accelerate.utils.set_seed(0)
  net = model()
  opt = make_optimizer(net, lr)
  scheduler = transformers.get_linear_schedule_with_warmup(opt, 10, STEPS)
  loader = torch.utils.data.DataLoader(dataset(), batch_size=4, shuffle=True,
                                       generator=torch.Generator().manual_seed(0))
  accelerator = accelerate.Accelerator(gradient_accumulation_steps=2, cpu=True)
  net, opt, loader, scheduler = accelerator.prepare(net, opt, loader, scheduler)
  start = 0
  if resume_from is not None:
    accelerator.load_state(str(resume_from))
    start = 100
  losses, step = [], 0
  batches = iter(())
  while step < STEPS:
    for _ in range(2):
      batch = next(batches, None)
      if batch is None:
        batches = iter(loader)
        batch = next(batches)
      if step < start:
        continue
      with accelerator.accumulate(net):
        loss = net(**batch).loss
        accelerator.backward(loss)
        if accelerator.sync_gradients:
          accelerator.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        scheduler.step()
        opt.zero_grad()
      losses.append(float(loss.detach()))
    step += 1
    if step == stop_at:
      accelerator.save_state(str(save_to))
      return losses, net, opt
  return losses, net, opt


def hostopt_adamw(net, lr, **kwargs):
  return ht.AdamW(net.parameters(), lr=lr, weight_decay=0.01, **kwargs)


def torch_adamw(net, lr):
  return torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.01)


def test_accelerate_with_hostopt_equals_torch_adamw_within_the_noise_floor():
  reference, _, _ = accelerate_run(torch_adamw)
  ours, _, opt = accelerate_run(hostopt_adamw)
  assert isinstance(opt.optimizer, ht.AdamW)  # accelerate's AcceleratedOptimizer wraps hostopt's
  floor = noise_floor(lambda lr: accelerate_run(torch_adamw, lr)[0], LR, reference)
  assert_within_floor(ours, reference, floor, "accelerate, hostopt.torch.AdamW vs torch.optim.AdamW")


@pytest.mark.parametrize("moments", ["f32", "8bit"])
def test_accelerate_save_state_load_state_is_exact(tmp_path, moments):
  def make(net, lr):
    return hostopt_adamw(net, lr, moments=moments)

  whole, whole_net, whole_opt = accelerate_run(make)
  first, _, _ = accelerate_run(make, stop_at=100, save_to=tmp_path / "state")
  assert first == whole[:200]
  rest, net, opt = accelerate_run(make, resume_from=tmp_path / "state")
  assert rest == whole[200:]
  assert params_equal(whole_net, net)
  state_equal(whole_opt.state_dict(), opt.state_dict())


def test_accelerate_with_the_state_on_a_drive_steps_as_in_ram(tmp_path):
  # prepare() reloads the optimizer's own state_dict: a store takes it; the steps are the in-RAM bits.
  in_ram, in_ram_net, _ = accelerate_run(hostopt_adamw)
  stored, net, opt = accelerate_run(lambda net, lr: hostopt_adamw(net, lr, store=tmp_path,
                                                                   store_options={"sync": False}))
  assert opt.optimizer.store.step_count == STEPS
  assert stored == in_ram
  assert params_equal(in_ram_net, net)
