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


def run_model(model: M3TextModel, ids, cu, backend: str):
    """Logits, indexer KL and parameter gradients (fp32 copies) of one training forward/backward."""
    model.zero_grad(set_to_none=True)
    with msa.use_backend(backend):
        out = model(ids, cu_seqlens=cu, return_kl=True)
        (out.logits.float().logsumexp(-1).mean() + out.indexer_kl).backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.float().detach(), out.indexer_kl.float().detach(), grads


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def test_triton_backend_matches_reference_on_gpu_fp32():
    """The model on CUDA in fp32: the Triton MSA kernels give the reference's logits, KL and gradients."""
    torch.manual_seed(0)
    model = M3TextModel(tiny(index_topk_blocks=2)).to("cuda").train()
    ids, cu = (t.cuda() for t in packed_ids([150, 93], 128, seed=8))
    ref_logits, ref_kl, ref_grads = run_model(model, ids, cu, "reference")
    logits, kl, grads = run_model(model, ids, cu, "triton")
    assert rel(logits, ref_logits) < 1e-3
    assert abs(kl.item() - ref_kl.item()) <= 1e-3 * max(1.0, abs(ref_kl.item()))
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert rel(g, ref_grads[name]) < 1e-2, name


def test_triton_backend_bf16_error_within_twice_bf16_pytorch():
    """bf16 model with the Triton kernels vs the fp32 model: error at most 2x that of the same bf16 model run with
    the PyTorch reference ops (the issue's bound), for logits and the KL."""
    torch.manual_seed(0)
    model = M3TextModel(tiny(index_topk_blocks=2)).to("cuda").train()
    ids, cu = (t.cuda() for t in packed_ids([150, 93], 128, seed=8))
    exact_logits, exact_kl, _ = run_model(model, ids, cu, "reference")
    model = model.to(torch.bfloat16)
    ref_logits, ref_kl, _ = run_model(model, ids, cu, "reference")
    logits, kl, _ = run_model(model, ids, cu, "triton")
    err_ref, err_tri = rel(ref_logits, exact_logits), rel(logits, exact_logits)
    print(f"bf16 logits rel err vs fp32: reference ops {err_ref:.3g}, triton {err_tri:.3g}")
    assert err_tri <= 2 * err_ref + 1e-3
    assert abs(kl.item() - exact_kl.item()) <= 2 * abs(ref_kl.item() - exact_kl.item()) + 1e-3 * abs(exact_kl.item())


def test_load_pretrained_on_gpu_matches_cpu(tmp_path):
    torch.manual_seed(0)
    model = M3TextModel(tiny()).eval()
    model.save_pretrained(tmp_path / "ckpt")
    ids, cu = packed_ids([75, 110], 128, seed=9)
    with torch.no_grad():
        cpu = load_pretrained(tmp_path / "ckpt")(ids, cu_seqlens=cu).logits
        gpu = load_pretrained(tmp_path / "ckpt", device="cuda")(ids.cuda(), cu_seqlens=cu.cuda()).logits.cpu()
    torch.testing.assert_close(gpu, cpu, atol=2e-3, rtol=0)


def test_vl_model_with_a_compiled_tower_matches_eager_bf16():
    """`apply_compile` (Inductor) on the VL model compiles the vision tower's blocks around their eager segment
    attention: the visual tokens and their gradients on CUDA in bf16 match the eager model's."""
    import copy

    from openm3.models.multimodal import M3ForConditionalGeneration, M3VLConfig
    from openm3.train.distributed import apply_compile

    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = M3ForConditionalGeneration(M3VLConfig.from_name("m3-tiny", image_token_index=7,
                                                            video_token_index=8)).cuda().to(torch.bfloat16)
    compiled = copy.deepcopy(eager)
    apply_compile(compiled)
    grid = torch.tensor([[1, 8, 8], [1, 4, 6]])
    pixels = torch.randn(64 + 24, 3 * 2 * 14 * 14, device="cuda", dtype=torch.bfloat16)
    outs = []
    for model in (eager, compiled):
        x = pixels.clone().requires_grad_(True)
        tokens = model.visual_tokens(x, grid)
        tokens.float().square().mean().backward()
        outs.append((tokens.float(), x.grad.float()))
    assert rel(outs[1][0], outs[0][0]) < 3e-2 and rel(outs[1][1], outs[0][1]) < 6e-2  # bf16, fused vs not
    torch._dynamo.reset()


def test_checkpointed_layers_reuse_selection_and_kl_on_gpu(monkeypatch):
    """Activation checkpointing with the Triton kernels on CUDA (fp32): the recomputation takes the forward's
    selection and skips the KL (each runs once per MSA layer), and the gradients equal the unchecked run's up to
    the kernels' atomic-add ordering."""
    torch.manual_seed(0)
    model = M3TextModel(tiny(index_topk_blocks=2)).to("cuda").train()
    ids, cu = (t.cuda() for t in packed_ids([150, 93], 128, seed=8))
    from call_counts import count_calls

    calls = count_calls(monkeypatch, select=[(msa, "select_blocks")], kl=[(msa, "indexer_kl")])
    n_msa = sum(t == "minimax_m3_sparse" for t in model.config.layer_types)
    results = []
    for flag in (False, True):
        model.gradient_checkpointing = flag
        calls.update(select=0, kl=0)
        results.append(run_model(model, ids, cu, "triton"))
        assert calls == {"select": n_msa, "kl": n_msa}, (flag, calls)
    (logits0, kl0, g0), (logits1, kl1, g1) = results
    assert torch.equal(logits0, logits1) and abs(kl0.item() - kl1.item()) <= 1e-6 * max(1.0, abs(kl0.item()))
    assert g0.keys() == g1.keys()
    for name, g in g1.items():
        assert rel(g, g0[name]) < 1e-5, name
