"""hostopt.torch with CUDA parameters (the offload pipeline on the CUDA engine) against
torch.optim.AdamW on the GPU. Skipped without a CUDA device; .ci/gpu runs it where torch
with CUDA is installed."""
import copy

import pytest

torch = pytest.importorskip("torch")
import hostopt  # noqa: E402
import hostopt.torch as htorch  # noqa: E402

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and hostopt._core.CopyEngine.cuda_available()),
                                reason="no CUDA device (or hostopt built without CUDA)")


def mlp_twice():
  torch.manual_seed(0)
  m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 10)).cuda()
  return m, copy.deepcopy(m)


def train(pairs, steps, written_after=None):
  """(model, optimizer) pairs stepped on the same batches; a first layer written after one step."""
  g = torch.Generator(device="cuda").manual_seed(1)
  for step in range(steps):
    x = torch.randn(32, 64, device="cuda", generator=g)
    for m, o in pairs:
      o.zero_grad()
      m(x).pow(2).mean().backward()
      o.step()
      if step == written_after:
        with torch.no_grad():
          m[0].weight.mul_(0.5)


@pytest.mark.parametrize("overlap", [False, True])
def test_cuda_parameters_train_like_torch_on_the_gpu(overlap):
  ours, theirs = mlp_twice()
  oo = htorch.AdamW(ours.parameters(), lr=1e-3, weight_decay=0.1, offload_chunk=4096, overlap=overlap)
  ot = torch.optim.AdamW(theirs.parameters(), lr=1e-3, weight_decay=0.1)
  train(((ours, oo), (theirs, ot)), 20)
  torch.cuda.synchronize()
  for a, b in zip(ours.parameters(), theirs.parameters()):
    assert a.is_cuda
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"), reason="torch < 2.1")
def test_gradients_stream_to_the_host_during_the_backward_and_train_like_torch():
  # A deeper model so the backward is long: with hooks, each chunk's copy waits only on
  # the event its last gradient recorded. Wrong ordering would read gradients the backward
  # had not written yet and depart from torch; clipping in place and a frozen layer make
  # the step fall back to the whole stream for the chunks concerned.
  torch.manual_seed(0)
  layers = []
  for _ in range(6):
    layers += [torch.nn.Linear(512, 512), torch.nn.GELU()]
  ours = torch.nn.Sequential(*layers, torch.nn.Linear(512, 8)).cuda()
  theirs = copy.deepcopy(ours)
  oo = htorch.AdamW(ours.parameters(), lr=1e-3, weight_decay=0.1, offload_chunk=1 << 16, overlap_backward=True)
  ot = torch.optim.AdamW(theirs.parameters(), lr=1e-3, weight_decay=0.1)
  g = torch.Generator(device="cuda").manual_seed(2)
  streamed = []
  for step in range(24):
    x = torch.randn(256, 512, device="cuda", generator=g)
    for m, o in ((ours, oo), (theirs, ot)):
      o.zero_grad(set_to_none=True)
      if step % 8 == 5:
        m[0].weight.requires_grad_(False)
      m(x).pow(2).mean().backward()
      m[0].weight.requires_grad_(True)
      if step % 8 == 3:
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.01)
      o.step()
    streamed.append(oo._last_chunk_events)
  torch.cuda.synchronize()
  chunks = oo._layout["f32"].dev.pipe.num_chunks
  assert chunks > 8
  assert streamed[1] == streamed[2] == chunks  # plain steps: every chunk on its own event
  assert streamed[3] == 0 and 0 < streamed[5] < chunks
  for a, b in zip(ours.parameters(), theirs.parameters()):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_store_under_cuda_parameters_steps_to_the_in_ram_bits(tmp_path, overlap):
  # store= with CUDA parameters: the pipeline streams the store's chunks. With overlap, step()
  # returns without waiting for the drives, the stream waits for the new parameters, and a
  # write made while the step is in flight is adopted at the next step, as in RAM.
  ours, theirs = mlp_twice()
  oo = htorch.AdamW(ours.parameters(), lr=1e-3, weight_decay=0.1, offload_chunk=4096, overlap=overlap,
                    store=tmp_path, store_options={"sync": False, "chunk_elements": 4096})
  ot = htorch.AdamW(theirs.parameters(), lr=1e-3, weight_decay=0.1, offload_chunk=4096)
  train(((ours, oo), (theirs, ot)), 12, written_after=6)
  oo.state_dict()  # (ends the step in flight)
  torch.cuda.synchronize()
  assert oo.store.step_count == 12
  for a, b in zip(ours.parameters(), theirs.parameters()):
    assert a.is_cuda and torch.equal(a, b)
  oo.close()
