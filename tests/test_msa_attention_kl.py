"""`sparse_attention_with_kl`: the sparse attention with the indexer KL computed in its backward, on the teacher
probabilities the dk/dv kernel stores on the way. Against the two separate calls (`sparse_attention`, then
`indexer_kl` with its lse) and the reference; the layers' and the trainer's switch (`kl_in_backward`).

Without a GPU the kernels run under TRITON_INTERPRET=1 on CPU tensors (fp32); with one, on CUDA tensors.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of a Triton kernel module

import pytest  # noqa: E402

from openm3.layers.attention import kl_in_backward  # noqa: E402
from openm3.models.config import M3TextConfig  # noqa: E402
from openm3.models.text import M3TextModel  # noqa: E402
from openm3.ops import msa  # noqa: E402
from openm3.ops.msa import reference  # noqa: E402
from openm3.ops.msa.triton_attention import _backward, sparse_attention  # noqa: E402
from openm3.ops.msa.triton_attention_kl import sparse_attention_with_kl  # noqa: E402
from openm3.ops.msa.triton_kl import _teacher_pass, indexer_kl  # noqa: E402
from test_msa_triton_select_kl import cu, rel_err  # noqa: E402
from test_recompute import _counting  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def make_case(lens, klens, hq, hkv, seed, d=32, di=16, block=16, topk=3):
    """fp32 leaves q, k, v, qi, ki, a reference selection, cu_seqlens (and cu_seqlens_k or None)."""
    gen = torch.Generator().manual_seed(seed)
    t, tk = sum(lens), sum(klens or lens)

    def leaf(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE).requires_grad_()

    q, k, v = leaf(t, hq, d), leaf(tk, hkv, d), leaf(tk, hkv, d)
    qi, ki = leaf(t, hkv, di), leaf(tk, di)
    cu_q, cu_k = cu(lens), None if klens is None else cu(klens)
    block_idx = reference.select_blocks(qi.detach(), ki.detach(), cu_q, block_size=block, topk=topk,
                                        local_blocks=1, cu_seqlens_k=cu_k)
    return q, k, v, qi, ki, block_idx, cu_q, cu_k


def grads(loss, leaves):
    return torch.autograd.grad(loss, leaves, allow_unused=True)


# (query lens, key lens or None, Hq, Hkv): groups 1, 4, 16; lengths not multiples of the block; a key prefix
CASES = [([40, 23], None, 2, 2), ([70, 5, 33], None, 8, 2), ([50, 37], None, 16, 1), ([20, 37], [45, 60], 4, 1)]


@pytest.mark.parametrize("lens,klens,hq,hkv", CASES, ids=lambda c: str(c))
def test_equals_the_separate_calls(lens, klens, hq, hkv):
    """o and lse identical; dq, dk, dv identical (same kernels); the KL's value (written by the backward) and its
    gradients within 1e-5 of `indexer_kl` after `sparse_attention`, which recomputes the teacher."""
    q, k, v, qi, ki, block_idx, cu_q, cu_k = make_case(lens, klens, hq, hkv, seed=len(lens) + hq)
    leaves = (q, k, v, qi, ki)
    o, lse = sparse_attention(q, k, v, block_idx, cu_q, block_size=16, cu_seqlens_k=cu_k)
    kl = indexer_kl(q, k, qi, ki, block_idx, cu_q, block_size=16, lse=lse.detach(), cu_seqlens_k=cu_k)
    w = torch.randn(o.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    want = grads((o * w).sum() + 0.7 * kl, leaves)

    o2, lse2, kl2 = sparse_attention_with_kl(q, k, v, qi, ki, block_idx, cu_q, block_size=16, cu_seqlens_k=cu_k)
    assert torch.equal(o2, o) and torch.equal(lse2, lse)
    assert kl2.item() == 0.0  # not computed yet
    got = grads((o2 * w).sum() + 0.7 * kl2, leaves)
    assert rel_err(kl2.detach(), kl.detach()) < 1e-5, (kl2.item(), kl.item())
    for name, a, b in zip("q k v qi ki".split(), got, want):
        assert rel_err(a, b) < 1e-5, name
    # and the reference (the spec) for the KL's value
    ref = reference.indexer_kl(q.detach(), k.detach(), qi.detach(), ki.detach(), block_idx, cu_q, block_size=16,
                               cu_seqlens_k=cu_k)
    assert rel_err(kl2.detach(), ref) < 1e-4


@pytest.mark.parametrize("launch", ["", "teacher_mean=2"], ids=["sum", "dot"])
@pytest.mark.parametrize("lens,klens,hq,hkv", [([100, 37, 63], None, 16, 4), ([20, 37], [45, 60], 4, 1)])
def test_dkdv_kernel_stores_the_teacher_of_each_entry(lens, klens, hq, hkv, launch, monkeypatch):
    """The teacher rows the dk/dv kernel stores equal `_teacher_pass`'s on every used entry (both leave the rows
    of unused slots alone), also beyond the block's end and the query's causal limit (zeros); in both layouts of
    the head mean (`teacher_mean`)."""
    monkeypatch.setenv("OPENM3_ATTN_LAUNCH", launch)
    q, k, v, _, _, block_idx, cu_q, cu_k = make_case(lens, klens, hq, hkv, seed=3, topk=4)
    cu_k = cu_q if cu_k is None else cu_k
    with torch.no_grad():
        o, lse = sparse_attention(q, k, v, block_idx, cu_q, block_size=16, cu_seqlens_k=cu_k)
        do = torch.randn_like(o)
        scale = q.shape[-1] ** -0.5
        *_, teacher = _backward(do, q, k, v, o, lse, block_idx, cu_q, cu_k, 16, scale, torch.float32)
        want = _teacher_pass(q, k, lse, block_idx, cu_q, cu_k, 16, scale)
    used = block_idx >= 0
    assert used.sum() > 0 and teacher.shape == want.shape
    assert rel_err(teacher[used], want[used]) < 1e-5


def test_only_one_output_used():
    """Only the KL in the loss: q, k, v get no gradient, qi and ki the KL's. Only o: the KL is not run (its
    value stays 0) and qi, ki get none."""
    q, k, v, qi, ki, block_idx, cu_q, _ = make_case([40, 30], None, 8, 2, seed=9)
    _, lse = sparse_attention(q, k, v, block_idx, cu_q, block_size=16)
    kl = indexer_kl(q, k, qi, ki, block_idx, cu_q, block_size=16, lse=lse.detach())
    want = grads(kl, (qi, ki))

    _, _, kl2 = sparse_attention_with_kl(q, k, v, qi, ki, block_idx, cu_q, block_size=16)
    got = grads(kl2, (q, k, v, qi, ki))
    assert all(g is None or not g.any() for g in got[:3])
    assert rel_err(got[3], want[0]) < 1e-5 and rel_err(got[4], want[1]) < 1e-5
    assert rel_err(kl2.detach(), kl.detach()) < 1e-5

    o3, _, kl3 = sparse_attention_with_kl(q, k, v, qi, ki, block_idx, cu_q, block_size=16)
    got = grads(o3.sum(), (q, qi, ki))
    assert got[0] is not None and got[1] is None and got[2] is None and kl3.item() == 0.0


def test_without_a_backward_to_come_the_kl_is_computed_at_once():
    q, k, v, qi, ki, block_idx, cu_q, _ = make_case([40, 30], None, 4, 1, seed=11)
    with torch.no_grad():
        _, lse = sparse_attention(q, k, v, block_idx, cu_q, block_size=16)
        want = indexer_kl(q, k, qi, ki, block_idx, cu_q, block_size=16, lse=lse)
        _, _, kl = sparse_attention_with_kl(q, k, v, qi, ki, block_idx, cu_q, block_size=16)
    assert kl.item() != 0.0 and rel_err(kl, want) < 1e-6
    _, _, kl = sparse_attention_with_kl(q, k, v, qi.detach(), ki.detach(), block_idx, cu_q, block_size=16)
    assert rel_err(kl.detach(), want) < 1e-6


def test_public_dispatch_and_checks():
    """The reference backend computes the two calls at once (value ready in the forward); bad inputs fail with
    the attention's or the KL's message."""
    q, k, v, qi, ki, block_idx, cu_q, _ = make_case([40, 30], None, 4, 1, seed=12)
    with msa.use_backend("reference"):
        o, lse, kl = msa.sparse_attention_with_kl(q, k, v, qi, ki, block_idx, cu_q, block_size=16)
        o_ref, lse_ref = reference.sparse_attention(q, k, v, block_idx, cu_q, block_size=16)
        kl_ref = reference.indexer_kl(q.detach(), k.detach(), qi, ki, block_idx, cu_q, block_size=16)
    assert torch.equal(o, o_ref) and torch.equal(lse, lse_ref) and rel_err(kl.detach(), kl_ref.detach()) < 1e-6
    with msa.use_backend("triton"):
        _, _, kl = msa.sparse_attention_with_kl(q, k, v, qi, ki, block_idx, cu_q, block_size=16)
        assert kl.item() == 0.0  # written by the backward
        with pytest.raises(ValueError, match="qi"):
            msa.sparse_attention_with_kl(q, k, v, qi[:, :, :8].transpose(0, 1), ki, block_idx, cu_q, block_size=16)
        with pytest.raises(ValueError, match="block_idx"):
            msa.sparse_attention_with_kl(q, k, v, qi, ki, block_idx[:, :5], cu_q, block_size=16)


def _model_step(model, ids, cu_q, defer: bool):
    model.zero_grad(set_to_none=True)
    if defer:
        with kl_in_backward() as values:
            out = model(ids, cu_seqlens=cu_q, msa_stage="sparse", return_kl=True)
        before = [v.item() for v in values]
    else:
        out, values, before = model(ids, cu_seqlens=cu_q, msa_stage="sparse", return_kl=True), None, None
    (out.logits.float().logsumexp(-1).mean() + 0.5 * out.indexer_kl).backward()
    kl = torch.stack(values).mean() if defer else out.indexer_kl.detach()
    return kl, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, before


def _tiny_case():
    """m3-tiny (2 blocks per query) on DEVICE, two packed sequences: (model, ids, cu_seqlens, MSA layers)."""
    cfg = M3TextConfig.from_name("m3-tiny", vocab_size=128, index_topk_blocks=2)
    torch.manual_seed(0)
    model = M3TextModel(cfg).train().to(DEVICE)
    ids = torch.randint(0, 128, (75,), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    return model, ids, cu([40, 35]), sum(t == "minimax_m3_sparse" for t in cfg.layer_types)


def _assert_same(kl1, g1, kl0, g0):
    assert rel_err(kl1, kl0) < 1e-5
    assert g0.keys() == g1.keys()
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], atol=1e-6, rtol=1e-5, msg=name)


def test_layers_run_the_kl_in_the_backward_inside_kl_in_backward():
    """m3-tiny on the Triton kernels: inside `kl_in_backward` every MSA layer hands its KL value over, filled by
    the backward; the mean and every gradient equal a run without it."""
    model, ids, cu_q, n_msa = _tiny_case()
    with msa.use_backend("triton"):
        kl0, g0, _ = _model_step(model, ids, cu_q, defer=False)
        kl1, g1, before = _model_step(model, ids, cu_q, defer=True)
    assert before == [0.0] * n_msa and n_msa > 0 and kl0.item() > 0  # deferred: written by the backward
    _assert_same(kl1, g1, kl0, g0)


def test_checkpointed_layers_run_the_kl_in_the_backward(monkeypatch):
    """With activation checkpointing (the model's, through `recompute.reuse_contexts`) inside `kl_in_backward`:
    the recomputation replays the forward's choice, so no layer runs `indexer_kl` (the teacher comes from dk/dv),
    each selects once, the values are written by the backward into the forward's KL outputs, and the KL and
    every gradient equal a run without checkpointing and without the deferral."""
    model, ids, cu_q, n_msa = _tiny_case()
    calls = _counting(monkeypatch)
    with msa.use_backend("triton"):
        kl0, g0, _ = _model_step(model, ids, cu_q, defer=False)
        assert calls == {"select": n_msa, "kl": n_msa}
        calls.update(select=0, kl=0)
        model.gradient_checkpointing = True
        kl1, g1, before = _model_step(model, ids, cu_q, defer=True)
    assert calls == {"select": n_msa, "kl": 0}, calls
    assert before == [0.0] * n_msa and kl0.item() > 0
    _assert_same(kl1, g1, kl0, g0)
    # the reference backend computes the KL in the forward: checkpointed, it keeps `_kl_once` (one KL per layer)
    calls.update(select=0, kl=0)
    with msa.use_backend("reference"):
        kl2, g2, before = _model_step(model, ids, cu_q, defer=True)
    assert calls == {"select": n_msa, "kl": n_msa}, calls
    assert all(b > 0 for b in before) and rel_err(kl2, kl0) < 1e-4


@pytest.mark.parametrize("ckpt", [False, True], ids=["plain", "checkpointed"])
def test_trainer_switch_keeps_the_logged_kl(tmp_path, ckpt):
    """`TrainConfig.kl_in_backward` on the Triton kernels, with and without activation checkpointing: the same
    loss, KL and gradient norm with and without it; the CLI's `--no-kl-in-backward`."""
    from openm3.train.cli import build_config, parse_args
    from openm3.train.trainer import Trainer
    from test_train_compile import PackedRows, tiny_cfg

    runs = {}
    with msa.use_backend("triton"):
        for defer in (True, False):
            mcfg = M3TextConfig.from_name("m3-tiny")
            cfg = tiny_cfg(tmp_path, f"defer{defer}", kl_in_backward=defer, steps=1, msa_switch_step=0,
                           activation_checkpointing=ckpt)
            trainer = Trainer(cfg, lambda: M3TextModel(mcfg), PackedRows(mcfg.vocab_size))
            runs[defer] = [trainer.train_step()]
            trainer.close()
    for a, b in zip(runs[True], runs[False]):
        assert a["msa_stage"] == b["msa_stage"] == "sparse"
        assert a["indexer_kl"] > 0
        for key in ("loss", "indexer_kl", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
    assert build_config(parse_args([])).kl_in_backward is True
    assert build_config(parse_args(["--no-kl-in-backward"])).kl_in_backward is False
