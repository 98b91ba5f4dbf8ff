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


def test_causal_lm_loss_on_cuda_matches_aligned_token_losses_and_no_target_gives_zero_gradients():
    """The models' `labels=` loss through the compiled kernel: the packed shift on the device equals the trainer's
    aligned losses, and a batch with no target is NaN with exactly-zero (not NaN) gradients."""
    from openm3.ops.losses import IGNORE_INDEX, causal_lm_loss
    from openm3.train.losses import token_losses

    gen = torch.Generator(device="cuda").manual_seed(1)
    lengths = [700, 1, 1300]
    logits = (3 * torch.randn(sum(lengths), 4096, device="cuda", generator=gen)).bfloat16().requires_grad_(True)
    labels = torch.randint(0, 4096, (sum(lengths),), device="cuda", generator=gen)
    labels[100:140] = IGNORE_INDEX
    cu = torch.tensor([0, 700, 701, 2001], device="cuda", dtype=torch.int32)
    aligned = torch.cat([labels[1:], labels.new_tensor([IGNORE_INDEX])])
    aligned[cu[1:].long() - 1] = IGNORE_INDEX  # each sequence's last token has no target
    got = causal_lm_loss(logits, labels, cu)
    per_token = token_losses(logits, aligned)
    want = per_token.sum() / (aligned != IGNORE_INDEX).sum()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    (g_got,) = torch.autograd.grad(got, logits)
    (g_want,) = torch.autograd.grad(want, logits)
    torch.testing.assert_close(g_got.float(), g_want.float(), atol=1e-6, rtol=1e-2)

    none = torch.full_like(labels, IGNORE_INDEX)
    loss = causal_lm_loss(logits, none, cu)
    (grad,) = torch.autograd.grad(loss, logits)
    assert torch.isnan(loss) and torch.isfinite(grad).all() and (grad == 0).all()
