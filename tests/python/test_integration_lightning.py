"""hostopt.torch inside PyTorch Lightning: configure_optimizers, accumulate_grad_batches,
gradient_clip_val and Lightning's own checkpoints (ModelCheckpoint, fit(ckpt_path=...)).

A small GPT-2 from transformers' config class (random weights, no download), 200 optimizer
steps of 2 micro-batches. hostopt's losses equal the same module with torch.optim.AdamW
within the float noise floor (integration_support); a resume from Lightning's checkpoint at
the end of an epoch continues bit for bit, f32 and 8-bit moments.
"""
import logging
import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
L = pytest.importorskip("lightning")

import hostopt.torch as ht  # noqa: E402
from integration_support import assert_within_floor, noise_floor  # noqa: E402

logging.getLogger("lightning").setLevel(logging.ERROR)
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
transformers.logging.set_verbosity_error()
STEPS, LR = 200, 3e-3
# No dropout: Lightning restores no RNG state at a resume (the Trainer test keeps dropout on).
CONFIG = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                                 embd_pdrop=0.0, attn_pdrop=0.0)


def loader():
  g = torch.Generator().manual_seed(0)
  rows = torch.randint(0, CONFIG.vocab_size, (64, 16), generator=g)
  # In order: Lightning restores no sampler state, so a resumed shuffle would repeat epoch 0's.
  return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(rows), batch_size=4)


class LM(L.LightningModule):
  def __init__(self, optimizer, lr=LR, moments="f32"):
    super().__init__()
    torch.manual_seed(0)
    self.net = transformers.GPT2LMHeadModel(CONFIG)
    self.optimizer, self.lr, self.moments = optimizer, lr, moments
    self.losses = []

  def training_step(self, batch, _):
    (rows,) = batch
    loss = self.net(input_ids=rows, labels=rows).loss
    self.losses.append(float(loss.detach()))
    return loss

  def configure_optimizers(self):
    decay = [p for n, p in self.net.named_parameters() if p.ndim >= 2]
    rest = [p for n, p in self.net.named_parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}]
    if self.optimizer == "torch":
      opt = torch.optim.AdamW(groups, lr=self.lr)
    else:
      opt = ht.AdamW(groups, lr=self.lr, moments=self.moments)
    scheduler = transformers.get_linear_schedule_with_warmup(opt, 10, STEPS)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def fit(module, root, ckpt_path=None, every=None):
  L.seed_everything(0, verbose=False)
  callbacks = []
  if every:
    # Taken at the last batch of an epoch: Lightning resumes a plain DataLoader exactly only
    # there (elsewhere it replays data, with torch.optim as with hostopt).
    callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=str(root / "ckpt"), every_n_train_steps=every,
                                                         save_top_k=-1, filename="{step}"))
  trainer = L.Trainer(max_steps=STEPS, accumulate_grad_batches=2, gradient_clip_val=1.0, accelerator="cpu",
                      devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=bool(every), callbacks=callbacks, default_root_dir=str(root),
                      deterministic=True)
  trainer.fit(module, loader(), ckpt_path=ckpt_path)
  return trainer


def test_lightning_with_hostopt_equals_torch_adamw_within_the_noise_floor(tmp_path):
  reference = LM("torch")
  fit(reference, tmp_path / "torch")
  assert len(reference.losses) == 2 * STEPS
  ours = LM("hostopt")
  trainer = fit(ours, tmp_path / "hostopt")
  assert isinstance(trainer.optimizers[0], ht.AdamW)
  assert trainer.global_step == STEPS

  def perturbed(lr):
    module = LM("torch", lr=lr)
    fit(module, tmp_path / f"torch-{lr}")
    return module.losses

  floor = noise_floor(perturbed, LR, reference.losses)
  assert_within_floor(ours.losses, reference.losses, floor, "Lightning, hostopt.torch.AdamW vs torch.optim.AdamW")


@pytest.mark.parametrize("moments", ["f32", "8bit"])
def test_lightning_checkpoint_resume_is_exact(tmp_path, moments):
  whole = LM("hostopt", moments=moments)
  whole_trainer = fit(whole, tmp_path / "whole", every=96)  # 12 epochs of 8 steps
  checkpoint = tmp_path / "whole" / "ckpt" / "step=96.ckpt"
  assert checkpoint.exists(), os.listdir(tmp_path / "whole" / "ckpt")
  resumed = LM("hostopt", moments=moments)
  resumed_trainer = fit(resumed, tmp_path / "resumed", ckpt_path=str(checkpoint))
  assert resumed_trainer.global_step == STEPS
  assert resumed.losses == whole.losses[2 * 96:]
  assert all(torch.equal(p, q) for p, q in zip(whole.parameters(), resumed.parameters()))
  a, b = whole_trainer.optimizers[0].state_dict(), resumed_trainer.optimizers[0].state_dict()
  assert a["param_groups"] == b["param_groups"] and a["state"].keys() == b["state"].keys()
  for k, st in a["state"].items():
    for key, value in st.items():
      other = b["state"][k][key]
      assert torch.equal(value, other) if torch.is_tensor(value) else value == other, (k, key)
