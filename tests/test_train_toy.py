"""Stand-in model and data source with the trainer's contracts, for the training-system tests (no tests here).

`ToyLM.forward(input_ids, position_ids, cu_seqlens, msa_stage, return_kl, return_aux)` mirrors the openm3 model
contract: packed varlen attention, an index branch trained by a KL against the (detached) attention, whose input
is detached in the sparse stage, and a 4-expert top-1 MoE returning a load-balancing loss.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
from torch import nn

from openm3.train.batches import IGNORE, Row
from openm3.train.losses import load_balancing_loss

VOCAB = 64


def packed_causal_mask(cu_seqlens: torch.Tensor, T: int) -> torch.Tensor:
    doc = torch.repeat_interleave(torch.arange(len(cu_seqlens) - 1), (cu_seqlens[1:] - cu_seqlens[:-1]).long())
    pos = torch.arange(T)
    return (doc[:, None] == doc[None, :]) & (pos[:, None] >= pos[None, :])


class Block(nn.Module):
    def __init__(self, d: int, heads: int = 2, experts: int = 4):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.qi, self.ki = nn.Linear(d, 8), nn.Linear(d, 8)
        self.router = nn.Linear(d, experts)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
                                     for _ in range(experts))

    def forward(self, x, mask, stage):
        T, d = x.shape
        h = self.norm1(x)
        q, k, v = self.qkv(h).view(T, 3, self.heads, d // self.heads).unbind(1)
        s = torch.einsum("thd,shd->hts", q, k) / (d // self.heads) ** 0.5
        p = s.masked_fill(~mask, float("-inf")).softmax(-1)
        x = x + self.o(torch.einsum("hts,shd->thd", p, v).reshape(T, d))
        hi = h.detach() if stage == "sparse" else h
        r = (self.qi(hi) @ self.ki(hi).T).masked_fill(~mask, float("-inf")).log_softmax(-1)
        teacher = p.detach().mean(0)
        kl = (teacher * (teacher.clamp_min(1e-30).log() - r.masked_fill(~mask, 0))).sum(-1).mean()
        h = self.norm2(x)
        probs = self.router(h).softmax(-1)
        top = probs.argmax(-1, keepdim=True)
        y = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            sel = top[:, 0] == e
            if sel.any():
                y[sel] = expert(h[sel]) * probs[sel, e:e + 1]
        return x + y, kl, load_balancing_loss(probs, top)


@dataclass
class ToyOutput:
    logits: torch.Tensor
    indexer_kl: torch.Tensor | None
    aux_loss: torch.Tensor | None


class ToyLM(nn.Module):
    def __init__(self, d: int = 32, n_layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.pos = nn.Embedding(128, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(n_layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)

    def forward(self, input_ids, position_ids, cu_seqlens, msa_stage="sparse", return_kl=False, return_aux=False):
        x = self.embed(input_ids) + self.pos(position_ids)
        mask = packed_causal_mask(cu_seqlens.cpu(), input_ids.numel()).to(x.device)
        kls, auxs = [], []
        for layer in self.layers:
            x, kl, aux = layer(x, mask, msa_stage)
            kls.append(kl)
            auxs.append(aux)
        return ToyOutput(self.head(self.norm(x)), torch.stack(kls).mean() if return_kl else None,
                         torch.stack(auxs).mean() if return_aux else None)


class ToySource:
    """Deterministic rows of a learnable toy language: each document counts up modulo VOCAB from a random start."""

    def __init__(self, seq_len: int = 24, seed: int = 0):
        self.seq_len, self.seed = seq_len, seed

    def rows(self, kind: str, step: int, count: int) -> list[Row]:
        g = torch.Generator().manual_seed(zlib.crc32(f"{self.seed}/{kind}/{step}".encode()))
        out = []
        for _ in range(count):
            cut = int(torch.randint(4, self.seq_len - 4, (1,), generator=g))
            doc_lens = [cut, self.seq_len - cut]
            ids, labels = [], []
            for n in doc_lens:
                start = int(torch.randint(0, VOCAB, (1,), generator=g))
                doc = (start + torch.arange(n)) % VOCAB
                ids.append(doc)
                labels.append(torch.cat([doc[1:], torch.tensor([IGNORE])]))
            out.append(Row(torch.cat(ids), torch.cat(labels), doc_lens, kind=kind, corpus=f"toy-{kind}"))
        return out
