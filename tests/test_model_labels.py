"""transformers-style `labels=` on the openm3 models: `loss` as transformers 5.24.0's `ForCausalLMLoss` computes it
over each packed sequence, its gradient against the trainer's `token_losses`, the VL model's pass-through, and the
checks of `labels` / `num_items_in_batch` (refused before the layers run, naming the argument)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hf_utils import build_hf_causal_lm, pack, random_ids, save_hf
from openm3.models import load_pretrained
from openm3.models.text import check_labels
from openm3.ops import losses as ops_losses
from openm3.ops.losses import IGNORE_INDEX, causal_lm_loss, shift_labels
from openm3.train import batches, losses as train_losses
from openm3.train.losses import token_losses

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

# the `model` and `vl` fixtures (tests/conftest.py): m3-tiny with TINY's overrides, IMG / VID as placeholder ids
TINY = dict(num_hidden_layers=2, vocab_size=64, max_position_embeddings=512)
IMG, VID = 5, 6
LENGTHS = [45, 70]  # two sequences, both past the MSA layers' 3 selected blocks of 16


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny random transformers M3 (MSA and MoE layers) and the same weights loaded in openm3."""
    hf = build_hf_causal_lm(seed=0)
    return hf, load_pretrained(save_hf(hf, tmp_path_factory.mktemp("hf")))


def _batch(vocab: int):
    """Two sequences, their unshifted labels (-100 inside each, never at the second sequence's first token, so a
    shift across the boundary changes the loss), packed."""
    seqs = random_ids(LENGTHS, vocab, seed=7)
    labels = [s.clone() for s in seqs]
    labels[0][10:20] = IGNORE_INDEX
    labels[1][30:36] = IGNORE_INDEX
    assert labels[1][0] != IGNORE_INDEX
    ids, cu = pack(seqs)
    return seqs, labels, ids, torch.cat(labels), cu


def _aligned(labels: list[torch.Tensor]) -> torch.Tensor:
    """The trainer's aligned labels, by hand: each sequence's labels moved one to the left, -100 at its end."""
    return torch.cat([torch.cat([lab[1:], torch.tensor([IGNORE_INDEX])]) for lab in labels])


def _hf_loss(hf, seqs, labels, num_items, **kwargs):
    """Sum over the sequences, one unpadded transformers batch each, of its loss divided by `num_items`."""
    return sum(hf(s[None], labels=lab[None], num_items_in_batch=num_items, **kwargs).loss
               for s, lab in zip(seqs, labels))


# ---------------------------------------------------------------------------------------------- the shift

@pytest.mark.parametrize("cu,want", [
    ([0, 5], [2, 3, 4, 5, -100]),
    ([0, 3, 5], [2, 3, -100, 5, -100]),
    ([0, 3, 3, 5], [2, 3, -100, 5, -100]),  # an empty sequence between
    ([0, 1, 2, 3, 4, 5], [-100] * 5),  # single tokens: nothing to predict
], ids=["B1-T5", "B2-T5", "B3-T5-empty", "B5-T5-single"])
def test_shift_labels_stays_inside_each_sequence(cu, want):
    got = shift_labels(torch.tensor([1, 2, 3, 4, 5], dtype=torch.int32), torch.tensor(cu, dtype=torch.int32))
    assert got.dtype == torch.int64 and got.tolist() == want
    assert shift_labels(torch.zeros(0, dtype=torch.long), torch.tensor([0, 0], dtype=torch.int32)).shape == (0,)


# ---------------------------------------------------------------------------------------------- transformers

@pytest.mark.parametrize("num_items", [None, 71], ids=["mean", "num_items_in_batch"])
def test_packed_loss_matches_transformers(pair, num_items):
    hf, model = pair
    seqs, labels, ids, packed_labels, cu = _batch(hf.config.vocab_size)
    targets = sum(int((lab[1:] != IGNORE_INDEX).sum()) for lab in labels)
    with torch.no_grad():
        out = model(ids, cu_seqlens=cu, labels=packed_labels, num_items_in_batch=num_items)
        # the mean over the packed batch is the sum over its sequences divided by all their targets
        ref = _hf_loss(hf, seqs, labels, targets if num_items is None else num_items)
        # a shift across the boundary (the first sequence's last token predicting the second's first) is caught
        crossing = torch.cat([packed_labels[1:], torch.tensor([IGNORE_INDEX])])
        wrong = token_losses(out.logits, crossing).sum() / (targets + 1 if num_items is None else num_items)
    assert out.loss.dtype == torch.float32 and out.loss.shape == ()
    torch.testing.assert_close(out.loss, ref, atol=1e-5, rtol=0)
    assert (wrong - ref).abs() > 1e-3


def test_one_sequence_matches_transformers_default(pair):
    """transformers' own path (no num_items_in_batch: the mean over the targets), with -100 inside."""
    hf, model = pair
    seqs, labels, *_ = _batch(hf.config.vocab_size)
    with torch.no_grad():
        for seq, lab in zip(seqs, labels):
            torch.testing.assert_close(model(seq, labels=lab).loss, hf(seq[None], labels=lab[None]).loss,
                                       atol=1e-5, rtol=0)


def test_loss_excludes_aux_loss_unlike_transformers_router_logits(pair):
    """Deliberate difference: transformers adds `router_aux_loss_coef * aux_loss` to `loss` when it returns router
    logits; openm3's `loss` stays the language-model loss, `aux_loss` apart."""
    hf, model = pair
    seq, lab = _batch(hf.config.vocab_size)[0][0], _batch(hf.config.vocab_size)[1][0]
    with torch.no_grad():
        plain = model(seq, labels=lab).loss
        out = model(seq, labels=lab, return_aux=True)
        ref = hf(seq[None], labels=lab[None], output_router_logits=True).loss
    assert torch.equal(out.loss, plain)
    torch.testing.assert_close(out.loss + hf.config.router_aux_loss_coef * out.aux_loss, ref, atol=1e-5, rtol=0)
    assert (plain - ref).abs() > 1e-6


def test_gradient_matches_token_losses_and_transformers(pair):
    hf, model = pair
    seqs, labels, ids, packed_labels, cu = _batch(hf.config.vocab_size)
    aligned = _aligned(labels)
    count = int((aligned != IGNORE_INDEX).sum())
    out = model(ids, cu_seqlens=cu, labels=packed_labels)
    ref = token_losses(out.logits, aligned).sum() / count  # what the trainer computes from aligned labels
    torch.testing.assert_close(out.loss, ref, atol=1e-6, rtol=0)
    params = [model.lm_head.weight, model.embed_tokens.weight, model.layers[1].self_attn.q_proj.weight]
    got = torch.autograd.grad(out.loss, [out.logits, *params], retain_graph=True)
    want = torch.autograd.grad(ref, [out.logits, *params])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-8, rtol=1e-6)
    # the boundary token's row gets no gradient: its target would be the next sequence's first token
    assert got[0][LENGTHS[0] - 1].abs().max() == 0 and got[0][LENGTHS[0] - 2].abs().max() > 0

    hf.zero_grad()
    _hf_loss(hf, seqs, labels, count).backward()
    torch.testing.assert_close(got[1], hf.lm_head.weight.grad, atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(got[2], hf.model.embed_tokens.weight.grad, atol=1e-6, rtol=1e-4)


def test_no_target_at_all(pair):
    """Every target ignored: the mean is NaN as transformers' (torch's mean cross-entropy) is, and its gradient is
    0, as theirs is, not NaN; with num_items_in_batch the loss is 0."""
    hf, model = pair
    seq = random_ids([20], hf.config.vocab_size, seed=1)[0]
    lab = torch.full_like(seq, IGNORE_INDEX)
    lab[0] = 3  # the first label is never a target
    ref = hf(seq[None], labels=lab[None]).loss
    out = model(seq, labels=lab)
    assert math.isnan(ref.item()) and math.isnan(out.loss.item())
    (g_logits, g_head) = torch.autograd.grad(out.loss, [out.logits, model.lm_head.weight])
    assert torch.equal(g_logits, torch.zeros_like(g_logits)) and torch.equal(g_head, torch.zeros_like(g_head))
    out = model(seq, labels=lab, num_items_in_batch=4)
    assert out.loss.item() == 0 == hf(seq[None], labels=lab[None], num_items_in_batch=4).loss.item()


# ---------------------------------------------------------------------------------------------- the models

def test_labels_leave_logits_alone_and_every_input_form_gives_one_loss(model):
    seqs = random_ids([17, 9], 64, seed=2)
    ids, cu = pack(seqs)
    with torch.no_grad():
        plain = model(ids, cu_seqlens=cu)
        out = model(ids, cu_seqlens=cu, labels=ids)
        assert plain.loss is None and torch.equal(out.logits, plain.logits)
        for other in (model(inputs_embeds=model.embed_tokens(ids), cu_seqlens=cu, labels=ids),
                      model(ids, cu_seqlens=cu, labels=ids.to(torch.int32)),
                      model(ids, cu_seqlens=cu, labels=ids, num_items_in_batch=np.int64(24)),
                      model(ids, cu_seqlens=cu, labels=ids, num_items_in_batch=torch.tensor(24.0)),
                      model(ids, cu_seqlens=cu, labels=ids, num_items_in_batch=torch.tensor(24, dtype=torch.float64))):
            assert other.loss.dtype == torch.float32
            torch.testing.assert_close(other.loss, out.loss, atol=1e-6, rtol=0)  # 24 targets: 16 + 8


def test_vl_model_passes_labels_through(vl):
    """An image's 4 placeholders and text in the first sequence, text in the second; the loss is the text model's
    over the logits the image shaped."""
    ids = torch.tensor([1, IMG, IMG, IMG, IMG, 7, 8, 9, 10, 11, 12, 13])
    cu = torch.tensor([0, 8, 12], dtype=torch.int32)
    labels = ids.clone()
    labels[ids == IMG] = IGNORE_INDEX
    aligned = _aligned([labels[:8], labels[8:]])
    image = dict(pixel_values=torch.randn(16, 1176, generator=torch.Generator().manual_seed(0)),
                 image_grid_thw=torch.tensor([[1, 4, 4]]))
    with torch.no_grad():
        out = vl(ids, **image, cu_seqlens=cu, labels=labels)
        summed = vl(ids, **image, cu_seqlens=cu, labels=labels, num_items_in_batch=2)
        no_image = vl(ids.masked_fill(ids == IMG, 1), cu_seqlens=cu, labels=labels)
    per_token = token_losses(out.logits, aligned)
    torch.testing.assert_close(out.loss, per_token.sum() / int((aligned != IGNORE_INDEX).sum()), atol=1e-6, rtol=0)
    torch.testing.assert_close(summed.loss, per_token.sum() / 2, atol=1e-6, rtol=0)
    assert (no_image.loss - out.loss).abs() > 1e-6  # the image reached the loss
    with pytest.raises(ValueError, match=r"labels must be an int tensor \[T=12\]"):
        vl(ids, **image, cu_seqlens=cu, labels=labels[:-1])
    with pytest.raises(ValueError, match="num_items_in_batch must be a positive number"):
        vl(ids, **image, cu_seqlens=cu, labels=labels, num_items_in_batch=0)


def test_one_shared_kernel():
    """The trainer's loss is the ops' kernel (one compiled function on CUDA), with the same ignore index."""
    assert train_losses.cross_entropy is ops_losses.cross_entropy
    assert batches.IGNORE == IGNORE_INDEX
    logits = torch.randn(6, 10)
    unshifted = torch.tensor([0, 1, 2, IGNORE_INDEX, 3, 4])  # row i's target is unshifted[i + 1]; none for row 5
    aligned = torch.tensor([1, 2, IGNORE_INDEX, 3, 4, IGNORE_INDEX])
    torch.testing.assert_close(causal_lm_loss(logits, unshifted, torch.tensor([0, 6], dtype=torch.int32)),
                               train_losses.lm_loss_sum(logits, aligned) / 4)


# ---------------------------------------------------------------------------------------------- checks

T = 20
IDS = torch.arange(T) % 64
BAD = {
    "labels-2d": (dict(labels=IDS[None]), r"labels must be an int tensor \[T=20\] .*got torch.int64 \(1, 20\); "
                                          r"for B rows of length T pass labels.flatten\(\)"),
    "labels-short": (dict(labels=IDS[:-1]), r"labels must be an int tensor \[T=20\] packed as input_ids"),
    "labels-float": (dict(labels=IDS.float()), r"labels must be an int tensor \[T=20\].*got torch.float32"),
    "labels-bool": (dict(labels=IDS > 3), r"labels must be an int tensor \[T=20\].*got torch.bool"),
    "labels-list": (dict(labels=IDS.tolist()), r"labels must be an int tensor \[T=20\], got list"),
    "labels-meta": (dict(labels=IDS.to("meta")), r"labels is a meta tensor"),
    "labels-past-vocab": (dict(labels=IDS.clone().fill_(64)), r"labels must be token ids in \[0, vocab_size=64\) "
                                                             r"or -100 \(ignored\), got \[64, 64, 64, 64, 64\]"),
    "labels-negative": (dict(labels=torch.where(IDS == 3, -5, IDS)), r"vocab_size=64\) or -100 .*got \[-5\]"),
    "labels-logits_index": (dict(labels=IDS, logits_index=torch.tensor([T - 1])),
                            r"labels and logits_index: pass one"),
    "num_items-without-labels": (dict(num_items_in_batch=3), r"num_items_in_batch: only used with labels"),
    **{f"num_items-{name}": (dict(labels=IDS, num_items_in_batch=value),
                             r"num_items_in_batch must be a positive number .*got")
       for name, value in (("0", 0), ("-1", -1), ("0.0", 0.0), ("nan", float("nan")), ("True", True),
                           ("str", "3"), ("tensor0", torch.tensor(0)), ("tensor-bool", torch.tensor(True)),
                           ("tensor-2", torch.tensor([1, 2])))},
}


@pytest.mark.parametrize("kwargs,match", BAD.values(), ids=BAD.keys())
def test_bad_labels_are_refused_before_the_layers(model, kwargs, match):
    ran = []
    handle = model.layers[0].register_forward_pre_hook(lambda *_: ran.append(1))
    try:
        with pytest.raises(ValueError, match=match):
            model(IDS, **kwargs)
    finally:
        handle.remove()
    assert not ran


def test_labels_on_another_device_are_refused():
    """(No second device here: the check itself, as the model calls it with its inputs' device.)"""
    with pytest.raises(ValueError, match=r"labels must be on the inputs' device cuda:0, got cpu"):
        check_labels(IDS, T, torch.device("cuda", 0), 64)
    check_labels(IDS, T, torch.device("cpu"), 64)
