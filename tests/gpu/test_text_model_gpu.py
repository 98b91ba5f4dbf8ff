"""The text model on CUDA (no transformers import: the GPU machine has an older transformers without M3)."""

from __future__ import annotations

import pytest
import torch

from openm3.models import M3TextConfig, M3TextModel, load_pretrained
from openm3.ops import msa

pytestmark = pytest.mark.gpu


def tiny(**overrides) -> M3TextConfig:
    return M3TextConfig.from_name("m3-tiny", vocab_size=128, **overrides)


def packed_ids(lengths: list[int], vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.cat([torch.randint(0, vocab, (n,), generator=gen) for n in lengths])
    cu = torch.cumsum(torch.tensor([0] + lengths), 0).to(torch.int32)
    return ids, cu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_backend_matches_reference_on_gpu(dtype):
    """The model on CUDA: the Triton MSA kernels give the reference's logits, KL and gradients."""
    torch.manual_seed(0)
    model = M3TextModel(tiny(index_topk_blocks=2)).to("cuda", dtype).train()
    ids, cu = packed_ids([150, 93], 128, seed=8)
    ids, cu = ids.cuda(), cu.cuda()
    results = {}
    for backend in ("reference", "triton"):
        model.zero_grad(set_to_none=True)
        with msa.use_backend(backend):
            out = model(ids, cu_seqlens=cu, return_kl=True)
            (out.logits.float().logsumexp(-1).mean() + out.indexer_kl).backward()
        grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
        results[backend] = (out.logits.float(), out.indexer_kl.float(), grads)
    (ref_logits, ref_kl, ref_grads), (logits, kl, grads) = results["reference"], results["triton"]
    tol = 1e-3 if dtype == torch.float32 else 3e-2
    assert ((logits - ref_logits).norm() / ref_logits.norm()).item() < tol
    assert abs(kl.item() - ref_kl.item()) <= tol * max(1.0, abs(ref_kl.item()))
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert ((g - ref_grads[name]).norm() / ref_grads[name].norm().clamp_min(1e-12)).item() < 10 * tol, name


def test_load_pretrained_on_gpu_matches_cpu(tmp_path):
    torch.manual_seed(0)
    model = M3TextModel(tiny()).eval()
    model.save_pretrained(tmp_path / "ckpt")
    ids, cu = packed_ids([75, 110], 128, seed=9)
    with torch.no_grad():
        cpu = load_pretrained(tmp_path / "ckpt")(ids, cu_seqlens=cu).logits
        gpu = load_pretrained(tmp_path / "ckpt", device="cuda")(ids.cuda(), cu_seqlens=cu.cuda()).logits.cpu()
    torch.testing.assert_close(gpu, cpu, atol=2e-3, rtol=0)
