"""The M3 text model: parity with transformers 5.24.0, training-time outputs, the cache hook, config handling."""

from __future__ import annotations

import pytest
import torch
from transformers import MiniMaxM3VLTextConfig

from hf_utils import build_hf_causal_lm, hf_selections, pack, random_ids, save_hf, selection_sets
from openm3.cli import main
from openm3.layers.moe import Router
from openm3.models import M3TextConfig, M3TextModel, load_pretrained
from openm3.ops import msa
from openm3.ops.attention import dense_attention

ALL_FULL = dict(layer_types=["full_attention"] * 4, mlp_layer_types=["dense"] * 4)

# (id, HF config overrides, sequence lengths): lengths are never multiples of the block size.
PARITY_CASES = [
    ("dense-attn-dense-mlp-L45-70", ALL_FULL, [45, 70]),
    ("msa-moe-B16-K3-local1-L75-110", dict(index_block_size=16, index_topk_blocks=3, index_local_blocks=1), [75, 110]),
    ("msa-moe-B16-K5-local2-L70-130", dict(index_block_size=16, index_topk_blocks=5, index_local_blocks=2), [70, 130]),
    ("msa-moe-B32-K3-local2-L150-201", dict(index_block_size=32, index_topk_blocks=3, index_local_blocks=2),
     [150, 201]),
    ("msa-moe-B32-K5-local1-L190-237", dict(index_block_size=32, index_topk_blocks=5, index_local_blocks=1),
     [190, 237]),
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """HF model and its save_pretrained directory per parity case (built once)."""
    made = {}

    def get(case_id: str, overrides: dict):
        if case_id not in made:
            hf = build_hf_causal_lm(seed=len(made), **overrides)
            made[case_id] = (hf, save_hf(hf, tmp_path_factory.mktemp(case_id.replace("-", "_"))))
        return made[case_id]
    return get


@pytest.mark.parametrize("case_id,overrides,lengths", PARITY_CASES, ids=[c[0] for c in PARITY_CASES])
def test_parity_with_transformers(checkpoints, case_id, overrides, lengths):
    hf, path = checkpoints(case_id, overrides)
    model = load_pretrained(path)
    seqs = random_ids(lengths, hf.config.vocab_size, seed=7)
    ids, cu = pack(seqs)
    with torch.no_grad():
        out = model(ids, cu_seqlens=cu, return_block_idx=True)
    captured, handles = hf_selections(hf)
    sparse_layers = [i for i, t in enumerate(hf.config.layer_types) if t == "minimax_m3_sparse"]
    block = hf.config.index_block_size
    try:
        for b, seq in enumerate(seqs):
            lo, hi = int(cu[b]), int(cu[b + 1])
            with torch.no_grad():
                ref = hf(seq[None]).logits[0]
            err = (out.logits[lo:hi] - ref).abs().max().item()
            assert err < 1e-4, f"sequence {b}: max |logits - HF| = {err:.3g}"
            assert sorted(captured) == sparse_layers
            for layer in sparse_layers:
                ours = selection_sets(out.block_idx[layer][:, lo:hi])
                assert ours == selection_sets(captured[layer][0]), f"layer {layer} sequence {b}: selections differ"
    finally:
        for h in handles:
            h.remove()
    if sparse_layers:
        # the case really is sparse: the last query sees more blocks than it may select
        assert -(-max(lengths) // block) > hf.config.index_topk_blocks
        last = int(cu[lengths.index(max(lengths)) + 1]) - 1
        assert len(selection_sets(out.block_idx[sparse_layers[0]][:, last:last + 1])[0][0]) \
            == hf.config.index_topk_blocks
    for layer, sel in enumerate(out.block_idx):
        assert (sel is None) == (layer not in sparse_layers)


def test_router_logits_and_aux_loss_match_transformers(checkpoints):
    case_id, overrides, _ = PARITY_CASES[1]
    hf, path = checkpoints(case_id, overrides)
    model = load_pretrained(path)
    (seq,) = random_ids([53], hf.config.vocab_size, seed=3)
    with torch.no_grad():
        ref = hf(seq[None], output_router_logits=True)
        out = model(seq, return_router_logits=True, return_aux=True)
    assert len(out.router_logits) == len(ref.router_logits) == 2
    for ours, theirs in zip(out.router_logits, ref.router_logits):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.aux_loss, ref.aux_loss.float(), atol=1e-6, rtol=0)


def tiny(**overrides) -> M3TextConfig:
    return M3TextConfig.from_name("m3-tiny", vocab_size=128, **overrides)


def test_packed_batch_equals_separate_sequences():
    torch.manual_seed(0)
    model = M3TextModel(tiny()).eval()
    seqs = random_ids([37, 50, 21], 128, seed=1)
    ids, cu = pack(seqs)
    with torch.no_grad():
        packed = model(ids, cu_seqlens=cu).logits
        for b, seq in enumerate(seqs):
            alone = model(seq).logits
            torch.testing.assert_close(packed[int(cu[b]):int(cu[b + 1])], alone, atol=1e-5, rtol=0)
        embeds = model(inputs_embeds=model.embed_tokens(ids), cu_seqlens=cu).logits
        torch.testing.assert_close(embeds, packed, atol=0, rtol=0)
        last = model(ids, cu_seqlens=cu, logits_index=cu[1:].long() - 1).logits
        torch.testing.assert_close(last, packed[cu[1:].long() - 1], atol=1e-5, rtol=0)


def test_dense_warmup_and_full_topk_equal_dense_attention():
    """MSA layers attend densely in warm-up, and top-k covering every block is dense attention too."""
    torch.manual_seed(0)
    sparse = M3TextModel(tiny(index_topk_blocks=3)).eval()
    dense_cfg = tiny(layer_types=["full_attention"] * 4)
    dense = M3TextModel(dense_cfg).eval()
    missing = dense.load_state_dict(sparse.state_dict(), strict=False)
    assert all(".indexer." in k for k in missing.unexpected_keys) and not missing.missing_keys
    wide = M3TextModel(tiny(index_topk_blocks=16)).eval()
    wide.load_state_dict(sparse.state_dict())
    (ids,) = random_ids([90], 128, seed=2)  # 6 blocks of 16
    with torch.no_grad():
        ref = dense(ids).logits
        warm = sparse(ids, msa_stage="dense", return_kl=True)
        torch.testing.assert_close(warm.logits, ref, atol=1e-5, rtol=0)
        torch.testing.assert_close(wide(ids).logits, ref, atol=1e-5, rtol=0)
        assert (sparse(ids).logits - ref).abs().max() > 1e-3  # top-3 of 6 blocks really is sparse
        assert warm.indexer_kl.item() > 0


def test_indexer_kl_trains_only_the_index_branch():
    torch.manual_seed(0)
    model = M3TextModel(tiny(index_topk_blocks=2)).train()
    (ids,) = random_ids([70], 128, seed=4)
    out = model(ids)  # training mode: the KL comes with the logits
    assert out.indexer_kl is not None and out.indexer_kl.item() > 0
    out.indexer_kl.backward(retain_graph=True)
    for name, p in model.named_parameters():
        if ".indexer." in name:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None or p.grad.abs().sum() == 0, name
    model.zero_grad(set_to_none=True)
    out.logits.logsumexp(-1).mean().backward()
    assert all(p.grad is None for n, p in model.named_parameters() if ".indexer." in n)
    assert model.layers[1].self_attn.q_proj.weight.grad.abs().sum() > 0
    with torch.no_grad():
        assert model.eval()(ids).indexer_kl is None
        zero = M3TextModel(tiny(layer_types=["full_attention"] * 4))(ids, return_kl=True).indexer_kl
        assert zero.item() == 0


def test_index_lse_from_the_selection_gives_the_same_kl(monkeypatch):
    """With the Triton backend (interpreter on CPU) and `OPENM3_SELECT_LAUNCH=index_lse=1` the model hands the
    selection's student normaliser to the KL: same KL and index-branch gradients as without."""
    torch.manual_seed(0)
    model = M3TextModel(tiny(index_topk_blocks=2)).train()
    (ids,) = random_ids([70], 128, seed=4)
    given = []
    original = msa.indexer_kl

    def recording_kl(*args, **kwargs):
        given.append(kwargs.get("index_lse") is not None)
        return original(*args, **kwargs)

    monkeypatch.setattr(msa, "indexer_kl", recording_kl)
    results = []
    for setting in ("", "index_lse=1"):
        monkeypatch.setenv("OPENM3_SELECT_LAUNCH", setting)
        model.zero_grad(set_to_none=True)
        with msa.use_backend("triton"):
            kl = model(ids).indexer_kl
        kl.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if ".indexer." in n}
        results.append((kl.detach(), grads))
    n_msa = len(given) // 2
    assert n_msa > 0 and given == [False] * n_msa + [True] * n_msa  # the second run really handed it over
    assert abs(results[1][0].item() - results[0][0].item()) <= 1e-5 * results[0][0].item()
    for name, g in results[0][1].items():
        assert torch.allclose(results[1][1][name], g, rtol=1e-4, atol=1e-7), name


def test_dense_warmup_kl_also_reaches_the_backbone():
    """DESIGN.md: the indexer input is detached in the sparse stage only; in the dense warm-up the KL's gradient
    reaches the layers below an MSA layer through the indexer's input, but never the teacher's q/k projections
    of the last layer (its teacher is detached and nothing above it reads the KL). `index_input_grad=False`
    detaches it in the warm-up too (TrainConfig.warmup_kl_to_backbone), leaving the index branch's own gradients
    as they were."""
    torch.manual_seed(0)
    model = M3TextModel(tiny(index_topk_blocks=2)).train()
    (ids,) = random_ids([70], 128, seed=4)
    indexer_grads = {}
    for stage, grad, reaches in (("dense", None, True), ("sparse", None, False), ("dense", False, False)):
        model.zero_grad(set_to_none=True)
        model(ids, msa_stage=stage, index_input_grad=grad).indexer_kl.backward()
        below = model.layers[0].self_attn.q_proj.weight.grad
        assert (below is not None and below.abs().sum() > 0) == reaches, (stage, grad)
        assert all(p.grad is None or p.grad.abs().sum() == 0 for n, p in model.named_parameters()
                   if "layers.3.self_attn." in n and ".indexer." not in n), stage
        if stage == "dense":
            indexer_grads[grad] = {n: p.grad.clone() for n, p in model.named_parameters()
                                   if "layers.3.self_attn.indexer." in n}
    assert indexer_grads[None].keys() == indexer_grads[False].keys() and indexer_grads[None]
    for name, g in indexer_grads[None].items():
        torch.testing.assert_close(indexer_grads[False][name], g, msg=name)


def test_gradient_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    model = M3TextModel(tiny(index_topk_blocks=2)).train()
    ids, cu = pack(random_ids([40, 35], 128, seed=6))
    grads = []
    for flag in (False, True):
        model.gradient_checkpointing = flag
        model.zero_grad(set_to_none=True)
        out = model(ids, cu_seqlens=cu)
        (out.logits.logsumexp(-1).mean() + out.indexer_kl).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == len(list(model.parameters()))
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6, rtol=1e-5, msg=name)


def test_smoke_command(capsys):
    assert main(["smoke", "--prompt", "hello", "--topk", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "m3-tiny" in lines[0] and "5 byte-level token ids" in lines[1]
    predictions = [line for line in lines if line.strip()[:2] in ("1.", "2.", "3.")]
    probs = [float(line.rsplit("p=", 1)[1]) for line in predictions]
    assert len(probs) == 3 and probs == sorted(probs, reverse=True) and 0 < probs[0] < 1
    assert main(["smoke", "--topk", "0"]) == 2
    assert "--topk must be >= 1" in capsys.readouterr().err


def test_router_bias_chooses_experts_but_does_not_weight_them():
    torch.manual_seed(0)
    router = Router(hidden_size=8, num_experts=4, top_k=2)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(5, 8)
    router.e_score_correction_bias.copy_(torch.tensor([10.0, 0.0, 0.0, 0.0]))
    logits, weights, experts = router(x)
    assert (experts == 0).any(dim=1).all()
    scores = torch.sigmoid(logits).gather(1, experts)
    torch.testing.assert_close(weights, scores / scores.sum(1, keepdim=True))


class _RecordingCache:
    """A cache for a prefill without history: attends over the new tokens with the MSA / dense ops."""

    def __init__(self):
        self.calls = []

    def attend(self, layer_idx, q, k, v, qi, ki, *, cu_seqlens, scale, block_size, topk, local_blocks):
        self.calls.append((layer_idx, qi is None, block_size))
        if qi is None:
            return dense_attention(q, k, v, cu_seqlens, scale=scale)
        idx = msa.select_blocks(qi, ki, cu_seqlens, block_size=block_size, topk=topk, local_blocks=local_blocks)
        return msa.sparse_attention(q, k, v, idx, cu_seqlens, block_size=block_size, scale=scale)[0]


def test_cache_protocol_prefill_matches_forward():
    torch.manual_seed(0)
    model = M3TextModel(tiny(index_topk_blocks=2)).eval()
    ids, cu = pack(random_ids([40, 61], 128, seed=5))
    positions = torch.cat([torch.arange(40), torch.arange(61)])
    cache = _RecordingCache()
    with torch.no_grad():
        ref = model(ids, cu_seqlens=cu).logits
        got = model(ids, cu_seqlens=cu, position_ids=positions, cache=cache).logits
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    assert cache.calls == [(0, True, None), (1, False, 16), (2, False, 16), (3, False, 16)]


@pytest.mark.parametrize("kwargs,match", [
    (dict(), "exactly one of input_ids"),
    (dict(input_ids=torch.zeros(4, dtype=torch.long), inputs_embeds=torch.zeros(4, 128)), "exactly one"),
    (dict(input_ids=torch.zeros(2, 4, dtype=torch.long)), "input_ids must be an int tensor \\[T\\]"),
    (dict(input_ids=torch.tensor([1, 999])), "vocab_size"),
    (dict(inputs_embeds=torch.zeros(4, 7)), "inputs_embeds must be"),
    (dict(input_ids=torch.zeros(6, dtype=torch.long), cu_seqlens=torch.tensor([0, 4, 2, 6], dtype=torch.int32)),
     "cu_seqlens must start at 0, never decrease"),
    (dict(input_ids=torch.zeros(6, dtype=torch.long), cu_seqlens=torch.tensor([0, 5], dtype=torch.int32)),
     "end at T=6"),
    (dict(input_ids=torch.zeros(6, dtype=torch.long), cu_seqlens=torch.tensor([0, 6])), "cu_seqlens must be int32"),
    (dict(input_ids=torch.zeros(6, dtype=torch.long), position_ids=torch.arange(5)), "position_ids must be"),
    (dict(input_ids=torch.zeros(6, dtype=torch.long), msa_stage="warmup"), "msa_stage must be 'sparse' or 'dense'"),
    (dict(input_ids=torch.zeros(6, dtype=torch.long), cache=_RecordingCache()), "position_ids are required"),
    (dict(input_ids=torch.zeros(6, dtype=torch.long), position_ids=torch.arange(6), cache=_RecordingCache(),
          return_kl=True), "not available with a cache"),
], ids=["none", "both", "ids-rank2", "ids-out-of-vocab", "embeds-width", "cu-decreasing", "cu-short",
        "cu-int64", "positions-shape", "msa-stage", "cache-no-positions", "cache-kl"])
def test_forward_rejects_bad_inputs(kwargs, match):
    model = M3TextModel(tiny()).eval()
    with pytest.raises(ValueError, match=match):
        model(**kwargs)


def test_input_ids_checked_by_caller_skips_the_range_read_inside_and_restores(monkeypatch):
    """Inside the block the model does not read the ids' range back (on a GPU: a device sync per forward; the
    trainer checks its ids on the host instead); outside, out-of-vocabulary ids fail with the usual message."""
    from openm3.models.text import input_ids_checked_by_caller

    model = M3TextModel(tiny()).eval()
    ids = torch.tensor([1, 5, 9])
    with torch.no_grad():
        want = model(ids).logits
        real_aminmax = torch.aminmax
        monkeypatch.setattr(torch, "aminmax", lambda *a, **k: pytest.fail("the range was read"))
        with input_ids_checked_by_caller(model) as vocab:
            assert vocab == 128 and model.input_ids_prechecked
            torch.testing.assert_close(model(ids).logits, want, atol=0, rtol=0)
        assert not model.input_ids_prechecked
        monkeypatch.setattr(torch, "aminmax", real_aminmax)
        with pytest.raises(ValueError, match=r"input_ids must lie in \[0, vocab_size=128\), got \[1, 128\]"):
            model(torch.tensor([1, 128]))


# ------------------------------------------------------------------------------------------------ config
def test_presets():
    m3 = M3TextConfig.from_name("m3")
    assert (m3.num_hidden_layers, m3.hidden_size, m3.num_attention_heads, m3.num_key_value_heads, m3.head_dim) \
        == (60, 6144, 64, 4, 128)
    assert m3.layer_types[:3] == ["full_attention"] * 3 and set(m3.layer_types[3:]) == {"minimax_m3_sparse"}
    assert (m3.rotary_dim, m3.rope_theta, m3.index_n_heads, m3.index_head_dim, m3.index_block_size,
            m3.index_topk_blocks, m3.index_local_blocks) == (64, 5e6, 4, 128, 128, 16, 1)
    assert (m3.num_local_experts, m3.num_experts_per_tok, m3.routed_scaling_factor) == (128, 4, 2.0)
    assert 420e9 < m3.num_parameters() < 435e9  # "428B total"
    small = M3TextConfig.from_name("m3-small")
    assert (small.head_dim, small.index_n_heads, small.index_head_dim, small.index_block_size,
            small.index_topk_blocks) == (128, 4, 128, 128, 16)
    assert 0.8e9 < small.num_parameters() < 1.5e9
    tiny_cfg = M3TextConfig.from_name("m3-tiny")
    assert {"full_attention", "minimax_m3_sparse"} <= set(tiny_cfg.layer_types)
    assert {"dense", "sparse"} <= set(tiny_cfg.mlp_layer_types)
    assert sum(p.numel() for p in M3TextModel(tiny_cfg).parameters()) == tiny_cfg.num_parameters()
    with pytest.raises(ValueError, match="unknown config name 'm4'"):
        M3TextConfig.from_name("m4")


def test_from_dict_reads_published_forms():
    published = {
        "architectures": ["MiniMaxM3SparseForConditionalGeneration"], "model_type": "minimax_m3_vl",
        "tie_word_embeddings": False,
        "text_config": {
            "num_hidden_layers": 4, "hidden_size": 64, "head_dim": 32, "num_attention_heads": 4,
            "num_key_value_heads": 2, "rotary_dim": 16, "rope_theta": 1e6, "vocab_size": 300,
            "sparse_attention_config": {"sparse_attention_freq": [0, 1, 1, 1], "sparse_num_index_heads": 2,
                                        "sparse_index_dim": 16, "sparse_block_size": 8, "sparse_topk_blocks": 6,
                                        "sparse_local_block": 2},
            "moe_layer_freq": [0, 0, 1, 1], "num_experts": 8, "hidden_act": "swigluoai",
        },
    }
    cfg = M3TextConfig.from_dict(published)
    assert cfg.layer_types == ["full_attention"] + ["minimax_m3_sparse"] * 3
    assert cfg.mlp_layer_types == ["dense", "dense", "sparse", "sparse"]
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_block_size, cfg.index_topk_blocks,
            cfg.index_local_blocks, cfg.num_local_experts) == (2, 16, 8, 6, 2, 8)
    assert (cfg.rope_theta, cfg.rotary_dim, cfg.extra["hidden_act"]) == (1e6, 16, "swigluoai")
    # rope_parameters form, and what to_dict writes is read back identically by openm3 and by transformers
    hf_form = M3TextConfig.from_dict({**published["text_config"], "rope_parameters": {
        "rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}})
    assert hf_form.rotary_dim == 16
    again = M3TextConfig.from_dict(cfg.to_dict())
    assert again == cfg
    hf_cfg = MiniMaxM3VLTextConfig(**{k: v for k, v in cfg.to_dict().items() if k not in ("architectures",)})
    assert hf_cfg.rope_parameters["partial_rotary_factor"] * hf_cfg.head_dim == cfg.rotary_dim
    assert hf_cfg.layer_types == cfg.layer_types and hf_cfg.index_local_blocks == 2


@pytest.mark.parametrize("overrides,field", [
    (dict(num_attention_heads=5), "num_attention_heads"),
    (dict(layer_types=["full_attention"] * 3), "layer_types"),
    (dict(mlp_layer_types=["dense", "moe", "dense", "dense"]), "mlp_layer_types"),
    (dict(index_n_heads=4), "index_n_heads"),
    (dict(index_local_blocks=5), "index_local_blocks"),
    (dict(rotary_dim=33), "rotary_dim"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok"),
    (dict(hidden_size=0), "hidden_size"),
    (dict(swiglu_limit=-1.0), "swiglu_limit"),
], ids=["heads-not-multiple", "layer-types-length", "mlp-type-name", "index-heads", "local-gt-topk",
        "rotary-odd", "topk-experts", "hidden-zero", "limit-negative"])
def test_config_validation_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        tiny(**overrides)


@pytest.mark.parametrize("data,match", [
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn' is not supported"),
    ({"rotary_dim": 32, "head_dim": 128, "partial_rotary_factor": 0.5}, "disagrees with partial_rotary_factor"),
    ({"qk_norm_type": "per_layer"}, "qk_norm_type='per_layer' is not supported"),
    ({"text_config": {"scoring_func": "softmax"}}, "scoring_func='softmax' is not supported"),
], ids=["yarn", "rotary-conflict", "per-layer-qk-norm", "softmax-router"])
def test_from_dict_rejects_unsupported(data, match):
    with pytest.raises(ValueError, match=match):
        M3TextConfig.from_dict(data)


def test_quantization_config_describes_the_file_not_the_model():
    """An fp8 release's config.json reads (the checkpoint loader dequantizes, `test_checkpoint_fp8.py`); the model
    config neither keeps nor writes its quantization_config."""
    fp8 = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    for data in ({"quantization_config": fp8}, {"text_config": {}, "quantization_config": fp8}):
        cfg = M3TextConfig.from_dict(data)
        assert "quantization_config" not in cfg.extra and "quantization_config" not in cfg.to_dict()
