"""Activation checkpointing that does not run an MSA layer's selection and indexer KL twice
(`openm3.layers.recompute`): the backward's recomputation takes the forward's selection back and skips the KL,
and every gradient equals the run without checkpointing, on the reference backend and on the Triton kernels
(interpreter on CPU), in the sparse stage and in the dense warm-up; the trainer's switch (`ac_reuse_msa`); and the
selective checkpoint that keeps every layer's attention (`keep_attention`, `ac_keep_attention`)."""

import contextlib
import functools

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from openm3.layers import attention, recompute
from openm3.models.config import M3TextConfig
from openm3.models.text import M3TextModel
from openm3.ops import msa
from openm3.train.trainer import Trainer
from call_counts import attention_entry_points, count_calls
from test_train_compile import PackedRows, tiny_cfg

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _counting(monkeypatch) -> dict:
    return count_calls(monkeypatch, select=[(msa, "select_blocks")], kl=[(msa, "indexer_kl")])


def _grads(model, ids, cu, stage):
    model.zero_grad(set_to_none=True)
    out = model(ids, cu_seqlens=cu, msa_stage=stage, return_kl=True)
    loss = out.logits.float().logsumexp(-1).mean() + out.indexer_kl
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("stage", ["sparse", "dense"])
def test_checkpointed_layers_select_and_run_the_kl_once(monkeypatch, backend, stage):
    if backend == "triton" and torch.cuda.is_available():  # CPU tensors: the kernels need the interpreter here
        pytest.skip("CPU-tensor Triton case (interpreter); on a GPU tests/gpu/test_text_model_gpu.py covers it")
    cfg = M3TextConfig.from_name("m3-tiny", vocab_size=128, index_topk_blocks=2)
    n_msa = sum(t == "minimax_m3_sparse" for t in cfg.layer_types)
    torch.manual_seed(0)
    model = M3TextModel(cfg).train()
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 128, (75,), generator=gen)
    cu = torch.tensor([0, 40, 75], dtype=torch.int32)
    calls = _counting(monkeypatch)
    results = {}
    with msa.use_backend(backend):
        for ckpt in (False, True):
            model.gradient_checkpointing = ckpt
            calls.update(select=0, kl=0)
            results[ckpt] = _grads(model, ids, cu, stage)
            # the dense warm-up selects nothing (dense attention, dense KL); the sparse stage selects once
            assert calls == {"select": n_msa if stage == "sparse" else 0, "kl": n_msa}, (ckpt, calls)
    (loss0, g0), (loss1, g1) = results[False], results[True]
    assert torch.equal(loss0, loss1) and g0.keys() == g1.keys()
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], atol=1e-6, rtol=1e-5, msg=name)


def test_plain_checkpointing_runs_them_twice(monkeypatch):
    """The baseline the reuse removes: without its contexts the recomputation selects and runs the KL again."""
    cfg = M3TextConfig.from_name("m3-tiny", vocab_size=128, index_topk_blocks=2)
    torch.manual_seed(0)
    model = M3TextModel(cfg).train()
    layer = model.layers[1]
    x = torch.randn(60, cfg.hidden_size, requires_grad=True)
    cos, sin = torch.ones(60, cfg.rotary_dim // 2), torch.zeros(60, cfg.rotary_dim // 2)
    cu = torch.tensor([0, 60], dtype=torch.int32)
    calls = _counting(monkeypatch)
    for context_fn, want in ((None, 2), (recompute.reuse_contexts, 1)):
        calls.update(select=0, kl=0)
        kw = {} if context_fn is None else {"context_fn": context_fn}
        out, kl, _, _ = checkpoint(layer, x, cos, sin, cu, True, False, None, False, None, use_reentrant=False,
                                    **kw)
        (out.sum() + kl).backward()
        assert calls == {"select": want, "kl": want}, (context_fn, calls)


def test_reuse_records_and_replays_in_order():
    forward, again = recompute.reuse_contexts()
    assert recompute.current() is None
    with forward:
        reuse = recompute.current()
        reuse.put("a")
        reuse.put("b")
        with pytest.raises(RuntimeError, match="forward recorded"):
            reuse.take()
    assert recompute.current() is None
    with again:
        assert recompute.current() is reuse and reuse.take() == "a" and reuse.take() == "b"
        with pytest.raises(RuntimeError, match="2 taken"):
            reuse.take()
        with pytest.raises(RuntimeError, match="during the recomputation"):
            reuse.put("c")


def test_trainer_switch_keeps_the_losses(tmp_path, monkeypatch):
    """`TrainConfig.ac_reuse_msa` (read at every step): the same losses and gradient norms with and without, and
    half the selection and KL calls with it (the KL in the forward: `kl_in_backward` off, else the sparse stage
    calls no `indexer_kl` at all, tests/test_msa_attention_kl.py)."""
    calls = _counting(monkeypatch)
    runs = {}
    for reuse in (True, False):
        mcfg = M3TextConfig.from_name("m3-tiny")
        cfg = tiny_cfg(tmp_path, f"reuse{reuse}", activation_checkpointing=True, ac_reuse_msa=reuse, steps=2,
                       kl_in_backward=False)
        trainer = Trainer(cfg, lambda: M3TextModel(mcfg), PackedRows(mcfg.vocab_size))
        calls.update(select=0, kl=0)
        runs[reuse] = [trainer.train_step(), trainer.train_step()], dict(calls)
        trainer.close()
    for a, b in zip(runs[True][0], runs[False][0]):
        for key in ("loss", "indexer_kl", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-7), key
    assert runs[False][1]["kl"] == 2 * runs[True][1]["kl"] > 0
    assert runs[False][1]["select"] == 2 * runs[True][1]["select"] > 0


def test_train_cli_flags():
    from openm3.train.cli import build_config, parse_args

    assert build_config(parse_args([])).ac_reuse_msa is True
    assert build_config(parse_args([])).ac_keep_attention is False
    assert build_config(parse_args(["--activation-checkpointing", "--ac-keep-attention"])).ac_keep_attention is True
    cfg = build_config(parse_args(["--activation-checkpointing", "--no-ac-reuse-msa", "--residual-dtype", "float32"]))
    assert cfg.activation_checkpointing and cfg.ac_reuse_msa is False and cfg.residual_dtype == "float32"
    with pytest.raises(ValueError, match="residual_dtype"):
        build_config(parse_args(["--residual-dtype", "bf16"]))


def _count_attention(monkeypatch) -> dict:
    return count_calls(monkeypatch, attention=attention_entry_points())


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("case", ["dense_layer", "sparse", "sparse_kl_in_backward", "dense_warmup"])
def test_kept_attention_runs_once_with_the_same_gradients(monkeypatch, backend, case):
    """`reuse_contexts(keep_attention=True)`: a checkpointed layer's attention (dense, MSA, the MSA layer's dense
    warm-up, the KL in the attention's backward) runs in the forward only, and the output, the KL and every
    gradient equal the unchecked layer's; the plain reuse contexts (the control) run it twice."""
    if backend == "triton" and torch.cuda.is_available():
        pytest.skip("CPU-tensor Triton case (interpreter); on a GPU tests/gpu/test_text_model_gpu.py covers it")
    cfg = M3TextConfig.from_name("m3-tiny", vocab_size=128, index_topk_blocks=2)
    torch.manual_seed(0)
    model = M3TextModel(cfg).train()
    layer = model.layers[0 if case == "dense_layer" else 1]
    gen = torch.Generator().manual_seed(3)
    x0 = torch.randn(75, cfg.hidden_size, generator=gen)
    angles = torch.arange(75.0)[:, None] * 0.1 * torch.arange(1, cfg.rotary_dim // 2 + 1)
    cos, sin = angles.cos(), angles.sin()
    cu = torch.tensor([0, 40, 75], dtype=torch.int32)
    calls = _count_attention(monkeypatch)
    runs = {}
    with msa.use_backend(backend):
        for mode, context_fn in (("plain", None), ("kept", functools.partial(recompute.reuse_contexts,
                                                                              keep_attention=True)),
                                 ("reuse", recompute.reuse_contexts)):
            x = x0.clone().requires_grad_(True)
            layer.zero_grad(set_to_none=True)
            calls["attention"] = 0
            args = (x, cos, sin, cu, case != "dense_layer", case == "dense_warmup", None, False, None)
            with attention.kl_in_backward() if case == "sparse_kl_in_backward" else contextlib.nullcontext():
                if context_fn is None:
                    out, kl, _, _ = layer(*args)
                else:
                    out, kl, _, _ = checkpoint(layer, *args, use_reentrant=False, context_fn=context_fn)
                (out.float().pow(2).mean() + (0 if kl is None else kl)).backward()
            grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
            runs[mode] = out.detach(), None if kl is None else kl.detach(), x.grad.clone(), grads, calls["attention"]
    assert [runs[m][4] for m in ("plain", "kept", "reuse")] == [1, 1, 2]
    (o0, kl0, dx0, g0, _), (o1, kl1, dx1, g1, _) = runs["plain"], runs["kept"]
    assert torch.equal(o0, o1) and (kl0 is None) == (kl1 is None) == (case == "dense_layer")
    if kl0 is not None:
        assert kl0.item() > 0 and torch.equal(kl0, kl1)
    torch.testing.assert_close(dx1, dx0, atol=1e-6, rtol=1e-5)
    assert g0.keys() == g1.keys() and g0
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], atol=1e-6, rtol=1e-5, msg=name)


def test_trainer_keeps_attention_with_the_same_losses(tmp_path, monkeypatch):
    """`TrainConfig.ac_keep_attention` (read at every step): the same losses and gradient norms, half the
    attention calls; with `ac_reuse_msa` off as well the MSA layers still select twice (the flags are apart)."""
    attn_calls, calls = _count_attention(monkeypatch), _counting(monkeypatch)
    runs = {}
    for keep, reuse in ((False, True), (True, True), (True, False)):
        mcfg = M3TextConfig.from_name("m3-tiny")
        cfg = tiny_cfg(tmp_path, f"keep{keep}{reuse}", activation_checkpointing=True, ac_keep_attention=keep,
                       ac_reuse_msa=reuse, steps=2)
        trainer = Trainer(cfg, lambda: M3TextModel(mcfg), PackedRows(mcfg.vocab_size))
        calls.update(select=0, kl=0)
        attn_calls["attention"] = 0
        runs[keep, reuse] = [trainer.train_step(), trainer.train_step()], dict(calls, **attn_calls)
        trainer.close()
    for records, _ in list(runs.values())[1:]:
        for a, b in zip(records, runs[False, True][0]):
            for key in ("loss", "indexer_kl", "grad_norm"):
                assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-7), key
    base, kept, apart = (runs[k][1] for k in ((False, True), (True, True), (True, False)))
    assert base["attention"] == 2 * kept["attention"] == 2 * apart["attention"] > 0
    assert base["select"] == kept["select"] and apart["select"] == 2 * kept["select"] > 0


def test_model_checkpointing_keeps_the_attention(monkeypatch):
    """`M3TextModel.gradient_checkpointing_enable(keep_attention=True)`: one attention call per layer, as without
    checkpointing (twice with plain `gradient_checkpointing_enable()`), and the same loss and gradients."""
    cfg = M3TextConfig.from_name("m3-tiny", vocab_size=128, index_topk_blocks=2)
    torch.manual_seed(0)
    model = M3TextModel(cfg).train()
    ids = torch.randint(0, 128, (75,), generator=torch.Generator().manual_seed(5))
    cu = torch.tensor([0, 40, 75], dtype=torch.int32)
    calls = _count_attention(monkeypatch)
    results, counts = {}, {}
    for mode in ("off", "plain", "keep"):
        model.gradient_checkpointing_disable()
        if mode != "off":
            model.gradient_checkpointing_enable(keep_attention=mode == "keep")
        calls["attention"] = 0
        results[mode] = _grads(model, ids, cu, "sparse")
        counts[mode] = calls["attention"]
    n = cfg.num_hidden_layers
    assert counts == {"off": n, "plain": 2 * n, "keep": n}
    (loss0, g0), (loss1, g1) = results["off"], results["keep"]
    assert torch.equal(loss0, loss1) and g0.keys() == g1.keys()
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], atol=1e-6, rtol=1e-5, msg=name)
