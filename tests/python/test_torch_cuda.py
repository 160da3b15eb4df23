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


@pytest.mark.parametrize("overlap", [False, True])
def test_cuda_parameters_train_like_torch_on_the_gpu(overlap):
  torch.manual_seed(0)
  ours = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 10)).cuda()
  theirs = copy.deepcopy(ours)
  oo = htorch.AdamW(ours.parameters(), lr=1e-3, weight_decay=0.1, offload_chunk=4096, overlap=overlap)
  ot = torch.optim.AdamW(theirs.parameters(), lr=1e-3, weight_decay=0.1)
  g = torch.Generator(device="cuda").manual_seed(1)
  for _ in range(20):
    x = torch.randn(32, 64, device="cuda", generator=g)
    for m, o in ((ours, oo), (theirs, ot)):
      o.zero_grad()
      m(x).pow(2).mean().backward()
      o.step()
  torch.cuda.synchronize()
  for a, b in zip(ours.parameters(), theirs.parameters()):
    assert a.is_cuda
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
