"""Periodic evaluation: held-out bits per byte per text corpus, image and video QA accuracy, indexer recall.

- **bits per byte** of a corpus: summed next-token cross-entropy (nats) over windows of held-out documents,
  divided by ln 2 and by the UTF-8 bytes those tokens decode to, so it is comparable across tokenizers.
- **QA accuracy**: the answer whose tokens (plus end-of-turn) have the highest log-likelihood among the task's
  candidates, on samples drawn from a seed stream disjoint from training; next to it, the accuracy of the best
  predictor that sees only the question (`tasks.text_only_baseline`); a task whose samples have kinds
  (`video_qa:direction`, ...) also gets each kind's accuracy (`video_qa/direction/accuracy`).
- **indexer recall**: share of dense attention mass inside the selected blocks (`openm3.analysis.attention`),
  per MSA layer and averaged, on the held-out text windows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..models.vision import DEFAULT_FRAMES_PER_CLIP, check_frames_per_clip
from .tasks import QASample, qa_samples, text_only_baseline

# training samples behind each task's text-only baseline in the reports (`openm3 demo`, `openm3 eval`,
# experiments/): enough that the baseline has seen every question of the task many times
BASELINE_SAMPLES = {"colour_qa": 3000, "video_qa": 400}


@dataclass
class Window:
    corpus: str
    ids: torch.Tensor  # [n] int64, starts with BOS
    n_bytes: int  # UTF-8 bytes of ids[1:]


@dataclass
class ScoredQA:
    sample: QASample
    prompt: list[int]
    candidates: list[list[int]]
    vision: dict[str, torch.Tensor]


def packed(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sequences -> (`input_ids [T]`, `position_ids [T]`, `cu_seqlens int32 [B+1]`)."""
    lens = torch.tensor([len(s) for s in seqs])
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lens, 0)
    return torch.cat(seqs), torch.cat([torch.arange(n) for n in lens.tolist()]), cu


def model_logits(model: nn.Module, seqs: list[torch.Tensor], vision: dict | None = None, device="cpu",
                 **kwargs):
    """Forward a list of token sequences packed together (inference mode: sparse MSA, no KL)."""
    ids, pos, cu = packed(seqs)
    vision = {k: v.to(device) for k, v in (vision or {}).items()}
    return model(input_ids=ids.to(device), position_ids=pos.to(device), cu_seqlens=cu.to(device),
                 msa_stage="sparse", return_kl=False, **vision, **kwargs), cu


def heldout_windows(tokenizer, corpora: list[str], per_corpus: int, seq_len: int) -> list[Window]:
    """The first `per_corpus` held-out documents of each corpus (hashed order), one window of `seq_len` tokens each."""
    import hashlib

    from ..data.corpora import load_corpus

    out = []
    for corpus in corpora:
        docs = sorted(load_corpus(corpus, "heldout"), key=lambda d: hashlib.sha256(d.doc_id.encode()).digest())
        docs = [d for d in docs if len(d.text) >= 200][:per_corpus]
        if not docs:
            raise ValueError(f"corpus {corpus!r} has no held-out documents to evaluate on")
        for doc in docs:
            ids = [tokenizer.bos_id] + tokenizer.encode(doc.text[:seq_len * 8])[:seq_len - 1]
            n_bytes = len(tokenizer.decode(ids[1:]).encode("utf-8"))
            out.append(Window(corpus, torch.tensor(ids), n_bytes))
    return out


def baseline_train_samples(task: str, n: int, **sizes) -> list[QASample]:
    """The `n` training-like samples of `task` the question-only baseline learns from (a fixed stream, disjoint
    from the evaluation's)."""
    import numpy as np

    from .tasks import TASKS

    return [TASKS[task].sample(np.random.default_rng([0, 104729, i]), **sizes) for i in range(n)]


def score_candidates(model: nn.Module, qa: ScoredQA, device) -> int:
    """Index of the candidate with the highest summed log-likelihood."""
    seqs = [torch.tensor(qa.prompt + c) for c in qa.candidates]
    vision = {k: torch.cat([v] * len(seqs)) for k, v in qa.vision.items()}
    out, cu = model_logits(model, seqs, vision, device)
    logp = out.logits.float().log_softmax(-1)
    scores = []
    for i, cand in enumerate(qa.candidates):
        start = int(cu[i]) + len(qa.prompt)
        rows = logp[start - 1:start - 1 + len(cand)]
        scores.append(float(rows.gather(1, torch.tensor(cand, device=rows.device)[:, None]).sum()))
    return max(range(len(scores)), key=scores.__getitem__)


class Evaluator:
    """Callable `(trainer, step) -> dict` for `Trainer(evaluator=...)`; `evaluate(model, device)` works alone."""

    def __init__(self, tokenizer, *, seq_len: int = 512, corpora: list[str] | None = None, windows: int = 2,
                 qa: dict[str, int] | None = None, seed: int = 10_000, image_size: int = 56, video_size: int = 56,
                 baseline_samples: int | dict[str, int] = 400, recall: bool = True,
                 frames_per_clip: int | None = DEFAULT_FRAMES_PER_CLIP):
        from ..data.corpora import CORPORA

        self.tokenizer = tokenizer
        self.windows = heldout_windows(tokenizer, list(CORPORA if corpora is None else corpora), windows, seq_len)
        self.recall = recall
        self.frames_per_clip = check_frames_per_clip(frames_per_clip)
        self.qa: dict[str, list[ScoredQA]] = {}
        self.baseline: dict[str, float] = {}
        sizes = dict(image_size=image_size, video_size=video_size)
        for task, n in (qa or {}).items():
            test = qa_samples(task, n, seed, **sizes)
            self.qa[task] = [self._prepare(s) for s in test]
            n_train = baseline_samples[task] if isinstance(baseline_samples, dict) else baseline_samples
            self.baseline[task] = text_only_baseline(baseline_train_samples(task, n_train, **sizes), test)

    def _prepare(self, s: QASample) -> ScoredQA:
        from ..data.chat import render_segments
        from ..data.packing import Example, tokenize_example
        from ..data.tokenizer import EOS
        from .data import processor_layout, vision_inputs

        example = Example(render_segments(s.messages(), add_generation_prompt=True), s.images, s.videos)
        prompt = tokenize_example(example, self.tokenizer, processor_layout).input_ids.tolist()
        candidates = [self.tokenizer.encode(c + EOS) for c in s.candidates]
        return ScoredQA(s, prompt, candidates, vision_inputs(s.images, s.videos, self.frames_per_clip))

    def __call__(self, trainer, step: int) -> dict:
        return self.evaluate(trainer.model, trainer.info.device)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, device="cpu") -> dict:
        was_training = model.training
        model.eval()
        try:
            result = self._text(model, device)
            for task, items in self.qa.items():
                right = [score_candidates(model, qa, device) == qa.sample.candidates.index(qa.sample.answer)
                         for qa in items]
                result[f"{task}/accuracy"] = sum(right) / len(items)
                result[f"{task}/text_only_baseline"] = self.baseline[task]
                by_kind: dict[str, list[bool]] = {}  # `video_qa:direction` -> video_qa/direction/accuracy
                for qa, ok in zip(items, right):
                    if ":" in qa.sample.task:
                        by_kind.setdefault(qa.sample.task.split(":", 1)[1], []).append(ok)
                for kind, oks in sorted(by_kind.items()):
                    result[f"{task}/{kind}/accuracy"] = sum(oks) / len(oks)
        finally:
            model.train(was_training)
        return result

    def _text(self, model: nn.Module, device) -> dict:
        from ..analysis.attention import capture_attention, indexer_recall

        nats: dict[str, float] = {}
        n_bytes: dict[str, int] = {}
        recall_sum: dict[int, float] = {}
        recall_n: dict[int, int] = {}
        for w in self.windows:
            with capture_attention(model) as layers:
                out, _ = model_logits(model, [w.ids], None, device, return_block_idx=self.recall)
            ce = nn.functional.cross_entropy(out.logits[:-1].float(), w.ids[1:].to(device), reduction="sum")
            nats[w.corpus] = nats.get(w.corpus, 0.0) + float(ce)
            n_bytes[w.corpus] = n_bytes.get(w.corpus, 0) + w.n_bytes
            if self.recall and out.block_idx is not None:
                for rec, block_idx in zip(layers, out.block_idx):
                    if block_idx is None or not rec.is_sparse:
                        continue
                    block_size = _block_size(model)
                    s, n = indexer_recall(rec.q, rec.k, block_idx, rec.cu_seqlens, block_size)
                    recall_sum[rec.layer_idx] = recall_sum.get(rec.layer_idx, 0.0) + s
                    recall_n[rec.layer_idx] = recall_n.get(rec.layer_idx, 0) + n
        result = {f"bpb/{c}": nats[c] / math.log(2) / n_bytes[c] for c in nats}
        if recall_n:
            per_layer = {i: recall_sum[i] / recall_n[i] for i in recall_n}
            result.update({f"indexer_recall/layer{i}": v for i, v in sorted(per_layer.items())})
            result["indexer_recall"] = sum(per_layer.values()) / len(per_layer)
        return result


def _block_size(model: nn.Module) -> int:
    from ..layers.attention import Attention

    for m in model.modules():
        if isinstance(m, Attention) and m.is_sparse:
            return m.block_size
    raise ValueError("model has no MSA layer")
