"""The trainer's cross-entropy on CUDA (one compiled kernel) against the eager PyTorch loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("tokens", [4096, 3001])
def test_compiled_token_losses_match_eager(tokens):
    from openm3.train.batches import IGNORE
    from openm3.train.losses import token_losses

    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (3 * torch.randn(tokens, 32768, device="cuda", generator=gen)).bfloat16().requires_grad_(True)
    labels = torch.randint(0, 32768, (tokens,), device="cuda", generator=gen)
    labels[::7] = IGNORE
    got = token_losses(logits, labels)
    (g_got,) = torch.autograd.grad(got.sum(), logits)
    want = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE, reduction="none")
    (g_want,) = torch.autograd.grad(want.sum(), logits)
    assert got.dtype == torch.float32 and (got[::7] == 0).all()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(g_got.float(), g_want.float(), atol=1e-3, rtol=1e-2)  # bf16 gradients
