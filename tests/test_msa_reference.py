"""The MSA reference (`openm3.ops.msa.reference`) against explicit dense formulas, brute force and transformers.

Shape ids spell the case: B (sequences), T (query tokens), Tk (key tokens when queries are only the tail of each
sequence), Hq/Hkv heads, D head dim, Di index head dim, bs block size, k top-k, L local blocks.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from openm3.ops.msa import reference as ref


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These tests run many small ops; on a shared 2-core machine intra-op threads only add contention."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@dataclass(frozen=True)
class Case:
    q_lens: tuple[int, ...]
    hq: int
    hkv: int
    d: int
    di: int
    bs: int
    topk: int
    local: int = 1
    k_lens: tuple[int, ...] | None = None  # None: keys == queries

    @property
    def id(self) -> str:
        tk = f"-Tk{sum(self.k_lens)}" if self.k_lens else ""
        return (f"B{len(self.q_lens)}-T{sum(self.q_lens)}{tk}-Hq{self.hq}-Hkv{self.hkv}-D{self.d}-Di{self.di}"
                f"-bs{self.bs}-k{self.topk}-L{self.local}")

    @property
    def kv_lens(self) -> tuple[int, ...]:
        return self.k_lens or self.q_lens


def _cu(lens) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def make_inputs(case: Case, dtype=torch.float32, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    t, tk = sum(case.q_lens), sum(case.kv_lens)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype)

    return dict(q=rnd(t, case.hq, case.d), k=rnd(tk, case.hkv, case.d), v=rnd(tk, case.hkv, case.d),
                qi=rnd(t, case.hkv, case.di), ki=rnd(tk, case.di), cu_seqlens=_cu(case.q_lens),
                cu_seqlens_k=None if case.k_lens is None else _cu(case.k_lens))


def segments(case: Case):
    """(query start, key start, query count, key count) per sequence."""
    qs, ks = 0, 0
    for lq, lk in zip(case.q_lens, case.kv_lens):
        yield qs, ks, lq, lk
        qs, ks = qs + lq, ks + lk


def select(x: dict, case: Case, topk: int | None = None) -> torch.Tensor:
    return ref.select_blocks(x["qi"], x["ki"], x["cu_seqlens"], block_size=case.bs, topk=topk or case.topk,
                             local_blocks=case.local, cu_seqlens_k=x["cu_seqlens_k"])


def key_sets(block_idx: torch.Tensor | None, case: Case, qs: int, lq: int, lk: int) -> torch.Tensor:
    """Bool [Hkv, lq, lk]: the keys each (index head, query) of one sequence attends to (selected and causal)."""
    qpos = torch.arange(lk - lq, lk)
    causal = torch.arange(lk)[None, :] <= qpos[:, None]
    if block_idx is None:
        return causal.expand(case.hkv, lq, lk)
    chosen = torch.zeros(case.hkv, lq, -(-lk // case.bs) + 1, dtype=torch.bool)
    idx = block_idx[:, qs:qs + lq].long()
    chosen.scatter_(-1, idx.masked_fill(idx < 0, chosen.shape[-1] - 1), True)
    keys_in = chosen[..., :-1].repeat_interleave(case.bs, dim=-1)[..., :lk]
    return keys_in & causal


# --- sparse_attention ----------------------------------------------------------------------------------------

DENSE_CASES = [
    Case((300, 77), 8, 2, 16, 8, 32, 3),
    Case((129,), 4, 4, 8, 8, 16, 2),
    Case((50, 1, 64), 6, 1, 16, 8, 16, 2, local=2),
    Case((40, 3, 100), 4, 2, 16, 8, 32, 2, k_lens=(90, 3, 230)),
]


@pytest.mark.parametrize("case", DENSE_CASES, ids=lambda c: c.id)
def test_sparse_attention_full_topk_equals_dense(case):
    x = make_inputs(case)
    full_topk = max(-(-lk // case.bs) for lk in case.kv_lens)
    block_idx = select(x, case, topk=full_topk)
    o, lse = ref.sparse_attention(x["q"], x["k"], x["v"], block_idx, x["cu_seqlens"], block_size=case.bs,
                                  cu_seqlens_k=x["cu_seqlens_k"])
    assert o.dtype == x["q"].dtype and lse.dtype == torch.float32
    assert o.shape == x["q"].shape and lse.shape == x["q"].shape[:2]
    group = case.hq // case.hkv
    for qs, ks, lq, lk in segments(case):
        q = x["q"][qs:qs + lq].transpose(0, 1)
        k = x["k"][ks:ks + lk].repeat_interleave(group, dim=1).transpose(0, 1)
        v = x["v"][ks:ks + lk].repeat_interleave(group, dim=1).transpose(0, 1)
        allowed = torch.arange(lk)[None, :] <= torch.arange(lk - lq, lk)[:, None]  # bottom-right causal
        dense_o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed).transpose(0, 1)
        dense_lse = ((q @ k.transpose(-1, -2)) / math.sqrt(case.d)).masked_fill(~allowed, -math.inf).logsumexp(-1)
        torch.testing.assert_close(o[qs:qs + lq], dense_o, atol=1e-5, rtol=0)
        torch.testing.assert_close(lse[qs:qs + lq], dense_lse.T, atol=1e-5, rtol=0)


def masked_dense_attention(x: dict, block_idx, case: Case, scale: float):
    """Explicit dense attention with a [Hq, lq, lk] mask built from block_idx; differentiable by autograd."""
    outs, lses = [], []
    group = case.hq // case.hkv
    for qs, ks, lq, lk in segments(case):
        keep = key_sets(block_idx, case, qs, lq, lk).repeat_interleave(group, dim=0)
        q = x["q"][qs:qs + lq].transpose(0, 1)
        k = x["k"][ks:ks + lk].repeat_interleave(group, dim=1).transpose(0, 1)
        v = x["v"][ks:ks + lk].repeat_interleave(group, dim=1).transpose(0, 1)
        s = ((q @ k.transpose(-1, -2)) * scale).masked_fill(~keep, -math.inf)
        outs.append((s.softmax(-1) @ v).transpose(0, 1))
        lses.append(s.logsumexp(-1).T)
    return torch.cat(outs), torch.cat(lses)


SPARSE_CASES = [
    Case((300, 77), 8, 2, 16, 8, 32, 3),
    Case((200,), 4, 1, 16, 16, 16, 4, local=2),
    Case((33, 120), 4, 2, 8, 8, 8, 3, local=3, k_lens=(70, 150)),
]


@pytest.mark.parametrize("shared_range", [0, 1, ref.SHARED_RANGE_MAX], ids=lambda r: f"shared{r}")
@pytest.mark.parametrize("workspace", [ref.DEFAULT_WORKSPACE, 4096], ids=["ws-default", "ws4096"])
@pytest.mark.parametrize("case", SPARSE_CASES, ids=lambda c: c.id)
def test_sparse_attention_equals_masked_dense(case, workspace, shared_range, monkeypatch):
    """Every query gathering its blocks (0), the queries below topk * block_size (1) or below the default multiple
    of it scanning a range shared by their chunk, the rest gathering: the same outputs and gradients."""
    monkeypatch.setattr(ref, "SHARED_RANGE_MAX", shared_range)
    x = make_inputs(case, seed=1)
    block_idx = select(x, case)
    assert any(-(-lk // case.bs) > case.topk for lk in case.kv_lens)  # really sparse
    for name in ("q", "k", "v"):
        x[name].requires_grad_()
    o, lse = ref.sparse_attention(x["q"], x["k"], x["v"], block_idx, x["cu_seqlens"], block_size=case.bs,
                                  scale=0.3, cu_seqlens_k=x["cu_seqlens_k"], workspace=workspace)
    want_o, want_lse = masked_dense_attention(x, block_idx, case, 0.3)
    torch.testing.assert_close(o, want_o, atol=1e-5, rtol=0)
    torch.testing.assert_close(lse, want_lse.detach(), atol=1e-5, rtol=0)
    do = torch.randn_like(o)
    got = torch.autograd.grad(o, (x["q"], x["k"], x["v"]), do)
    want = torch.autograd.grad(want_o, (x["q"], x["k"], x["v"]), do)
    for name, a, b in zip("qkv", got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m: f"d{name}: {m}")


GRAD_CASES = [
    Case((9, 6, 5), 4, 2, 3, 4, 4, 2),
    Case((9, 13), 2, 1, 4, 4, 3, 3, local=2),
    Case((5, 6), 4, 2, 3, 4, 4, 2, k_lens=(14, 6)),
]


@pytest.mark.parametrize("case", GRAD_CASES, ids=lambda c: c.id)
def test_sparse_attention_gradcheck_fp64(case):
    x = make_inputs(case, dtype=torch.float64, seed=2)
    block_idx = select(x, case)
    inputs = tuple(x[n].requires_grad_() for n in ("q", "k", "v"))

    def fn(q, k, v):
        return ref.sparse_attention(q, k, v, block_idx, x["cu_seqlens"], block_size=case.bs,
                                    cu_seqlens_k=x["cu_seqlens_k"], workspace=100)[0]  # several chunks

    assert torch.autograd.gradcheck(fn, inputs)


def test_sparse_attention_empty_selection_gives_zero_output():
    case = Case((6,), 2, 1, 4, 4, 2, 2)
    x = make_inputs(case)
    block_idx = torch.full((1, 6, 2), -1, dtype=torch.int32)
    block_idx[0, 3, 0] = 1
    q = x["q"].requires_grad_()
    o, lse = ref.sparse_attention(q, x["k"], x["v"], block_idx, x["cu_seqlens"], block_size=2)
    assert torch.isneginf(lse[[0, 1, 2, 4, 5]]).all() and torch.isfinite(lse[3]).all()
    assert (o[[0, 1, 2, 4, 5]] == 0).all() and (o[3] != 0).all()
    o.sum().backward()
    assert torch.isfinite(q.grad).all() and (q.grad[[0, 1, 2, 4, 5]] == 0).all()


# --- indexer_kl ----------------------------------------------------------------------------------------------


def explicit_kl(x: dict, block_idx, case: Case, scale: float, index_scale: float) -> torch.Tensor:
    """The formula, densely: mean over (g, t) of sum_j p_j (log p_j - log r_j) over each key set."""
    total = x["qi"].new_zeros(())
    group = case.hq // case.hkv
    for qs, ks, lq, lk in segments(case):
        keep = key_sets(block_idx, case, qs, lq, lk)  # [Hkv, lq, lk]
        q = x["q"][qs:qs + lq].detach().transpose(0, 1).unflatten(0, (case.hkv, group))  # [Hkv, G, lq, D]
        k = x["k"][ks:ks + lk].detach().transpose(0, 1)[:, None]  # [Hkv, 1, lk, D]
        a = ((q @ k.transpose(-1, -2)) * scale).masked_fill(~keep[:, None], -math.inf)
        p = a.softmax(-1).mean(1)  # [Hkv, lq, lk]
        z = (x["qi"][qs:qs + lq].transpose(0, 1) @ x["ki"][ks:ks + lk].T) * index_scale
        log_r = z.masked_fill(~keep, -math.inf).log_softmax(-1)
        terms = torch.where(keep, torch.special.xlogy(p, p) - p * log_r.masked_fill(~keep, 0.0), 0.0)
        total = total + terms.sum()
    return total / (sum(case.q_lens) * case.hkv)


KL_CASES = [
    Case((150, 37), 8, 2, 16, 8, 16, 3),
    Case((64,), 4, 1, 8, 16, 8, 2, local=2),
    Case((20, 45), 4, 2, 8, 8, 8, 2, k_lens=(50, 90)),
]


@pytest.mark.parametrize("shared_range", [0, 1, ref.SHARED_RANGE_MAX], ids=lambda r: f"shared{r}")
@pytest.mark.parametrize("workspace", [ref.DEFAULT_WORKSPACE, 2048], ids=["ws-default", "ws2048"])
@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "dense"])
@pytest.mark.parametrize("case", KL_CASES, ids=lambda c: c.id)
def test_indexer_kl_matches_explicit_formula(case, sparse, workspace, shared_range, monkeypatch):
    """Selected keys gathered per query (0) or scanned as a range shared by the chunk (below 1x or the default
    multiple of topk * block_size), and the dense warm-up: the same loss and gradients."""
    monkeypatch.setattr(ref, "SHARED_RANGE_MAX", shared_range)
    x = make_inputs(case, dtype=torch.float64, seed=3)
    block_idx = select(x, case) if sparse else None
    for name in ("q", "k", "qi", "ki"):
        x[name].requires_grad_()
    loss = ref.indexer_kl(x["q"], x["k"], x["qi"], x["ki"], block_idx, x["cu_seqlens"], block_size=case.bs,
                          scale=0.4, index_scale=0.7, cu_seqlens_k=x["cu_seqlens_k"], workspace=workspace)
    want = explicit_kl(x, block_idx, case, 0.4, 0.7)
    assert loss.ndim == 0 and loss.item() > 0
    torch.testing.assert_close(loss, want, atol=1e-10, rtol=1e-10)
    got = torch.autograd.grad(loss, (x["qi"], x["ki"]))
    expected = torch.autograd.grad(want, (x["qi"], x["ki"]))
    torch.testing.assert_close(got[0], expected[0], atol=1e-10, rtol=1e-8)
    torch.testing.assert_close(got[1], expected[1], atol=1e-10, rtol=1e-8)
    loss = ref.indexer_kl(x["q"], x["k"], x["qi"], x["ki"], block_idx, x["cu_seqlens"], block_size=case.bs,
                          cu_seqlens_k=x["cu_seqlens_k"], workspace=workspace)
    loss.backward()
    assert x["q"].grad is None and x["k"].grad is None  # the teacher is detached
    assert x["qi"].grad.abs().sum() > 0 and x["ki"].grad.abs().sum() > 0


KL_GRAD_CASES = [
    Case((7, 6), 4, 2, 4, 4, 4, 2),
    Case((11,), 2, 1, 3, 4, 3, 3, local=2),
    Case((4, 5), 2, 1, 3, 4, 3, 2, k_lens=(9, 5)),
]


@pytest.mark.parametrize("shared_range", [0, ref.SHARED_RANGE_MAX], ids=lambda r: f"shared{r}")
@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "dense"])
@pytest.mark.parametrize("case", KL_GRAD_CASES, ids=lambda c: c.id)
def test_indexer_kl_gradcheck_fp64(case, sparse, shared_range, monkeypatch):
    monkeypatch.setattr(ref, "SHARED_RANGE_MAX", shared_range)
    x = make_inputs(case, dtype=torch.float64, seed=4)
    block_idx = select(x, case) if sparse else None

    def fn(qi, ki):
        return ref.indexer_kl(x["q"], x["k"], qi, ki, block_idx, x["cu_seqlens"], block_size=case.bs,
                              cu_seqlens_k=x["cu_seqlens_k"], workspace=100)  # several chunks and key tiles

    assert torch.autograd.gradcheck(fn, (x["qi"].requires_grad_(), x["ki"].requires_grad_()))


def test_a_second_derivative_is_refused_not_wrong():
    """The backwards use the forward's saved o / lse, so differentiating them again gave wrong Hessian-vector
    products with no error (sparse attention: off by ~1x the gradient's scale): they refuse, as the Triton path
    and PyTorch's fused attention do, also where the loss reaches the input by another path too (a gradient
    penalty beside the loss: the second-order part was dropped without a word); first derivatives with
    create_graph=True stay right."""
    case = GRAD_CASES[0]
    x = make_inputs(case, dtype=torch.float64, seed=2)
    block_idx = select(x, case)
    q, qi = x["q"].requires_grad_(), x["qi"].requires_grad_()
    o, _ = ref.sparse_attention(q, x["k"], x["v"], block_idx, x["cu_seqlens"], block_size=case.bs,
                                cu_seqlens_k=x["cu_seqlens_k"])
    kl = ref.indexer_kl(x["q"].detach(), x["k"], qi, x["ki"], block_idx, x["cu_seqlens"], block_size=case.bs,
                        cu_seqlens_k=x["cu_seqlens_k"])
    for out, wrt, name in (((o ** 2).sum(), q, "sparse_attention"), (kl, qi, "indexer_kl")):
        (grad,) = torch.autograd.grad(out, wrt, create_graph=True, retain_graph=True)
        (plain,) = torch.autograd.grad(out, wrt, retain_graph=True)
        assert torch.equal(grad.detach(), plain)
        with pytest.raises(RuntimeError, match=f"^{name}: its gradient cannot be differentiated again"):
            torch.autograd.grad(out + (grad ** 2).sum(), wrt)


def test_indexer_kl_uses_lse_from_sparse_attention():
    case = Case((150, 37), 8, 2, 16, 8, 16, 3)
    x = make_inputs(case, seed=5)
    block_idx = select(x, case)
    _, lse = ref.sparse_attention(x["q"], x["k"], x["v"], block_idx, x["cu_seqlens"], block_size=case.bs)
    with_lse = ref.indexer_kl(x["q"], x["k"], x["qi"], x["ki"], block_idx, x["cu_seqlens"], block_size=case.bs,
                              lse=lse)
    without = ref.indexer_kl(x["q"], x["k"], x["qi"], x["ki"], block_idx, x["cu_seqlens"], block_size=case.bs)
    torch.testing.assert_close(with_lse, without, atol=1e-6, rtol=1e-6)
    # A wrong normaliser changes the teacher, so the argument is really used.
    shifted = ref.indexer_kl(x["q"], x["k"], x["qi"], x["ki"], block_idx, x["cu_seqlens"], block_size=case.bs,
                             lse=lse + 0.5)
    assert (shifted - without).abs() > 1e-3


@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "dense"])
def test_indexer_kl_zero_when_student_equals_teacher(sparse):
    # Every head of a group has the same query and every KV head the index key, so with scale == index_scale the
    # group's mean attention is exactly the student's distribution.
    case = Case((70, 33), 4, 2, 8, 8, 8, 3)
    x = make_inputs(case, seed=6)
    qi = x["qi"]
    q = qi.repeat_interleave(case.hq // case.hkv, dim=1)
    k = x["ki"][:, None].expand(-1, case.hkv, -1)
    block_idx = select(x, case) if sparse else None
    loss = ref.indexer_kl(q, k, qi, x["ki"], block_idx, x["cu_seqlens"], block_size=case.bs, scale=0.5,
                          index_scale=0.5)
    assert abs(loss.item()) < 1e-6
    other = ref.indexer_kl(q, k, qi, x["ki"], block_idx, x["cu_seqlens"], block_size=case.bs, scale=0.5,
                           index_scale=0.2)
    assert other.item() > 1e-3


# --- select_blocks -------------------------------------------------------------------------------------------


def brute_force_select(x: dict, case: Case, scale: float) -> torch.Tensor:
    """Per query, in Python: forced local blocks (own first), then the other causal blocks by descending score."""
    out = torch.full((case.hkv, sum(case.q_lens), case.topk), -1, dtype=torch.int32)
    for qs, ks, lq, lk in segments(case):
        s_all = (x["qi"][qs:qs + lq].transpose(0, 1) @ x["ki"][ks:ks + lk].T) * scale  # [Hkv, lq, lk]
        for i in range(lq):
            p = lk - lq + i
            own = p // case.bs
            forced = [own - d for d in range(case.local) if own - d >= 0]
            for g in range(case.hkv):
                score = {j: s_all[g, i, j * case.bs:min((j + 1) * case.bs, p + 1)].max().item()
                         for j in range(own + 1) if j not in forced}
                chosen = (forced + sorted(score, key=score.get, reverse=True))[:case.topk]
                out[g, qs + i, :len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
    return out


SELECT_CASES = [
    Case((150, 37), 4, 2, 8, 8, 16, 3),
    Case((100,), 4, 1, 8, 16, 8, 5, local=2),
    Case((1, 60, 7), 4, 4, 8, 4, 4, 4, local=4),
    Case((30, 41), 4, 2, 8, 8, 8, 3, local=2, k_lens=(100, 41)),
    Case((50,), 2, 1, 8, 8, 8, 2, local=0),
]


@pytest.mark.parametrize("workspace", [ref.DEFAULT_WORKSPACE, 256], ids=["ws-default", "ws256"])
@pytest.mark.parametrize("case", SELECT_CASES, ids=lambda c: c.id)
def test_select_blocks_equals_brute_force(case, workspace):
    x = make_inputs(case, seed=7)
    got = ref.select_blocks(x["qi"], x["ki"], x["cu_seqlens"], block_size=case.bs, topk=case.topk,
                            local_blocks=case.local, cu_seqlens_k=x["cu_seqlens_k"], workspace=workspace)
    assert got.dtype == torch.int32 and got.shape == (case.hkv, sum(case.q_lens), case.topk)
    torch.testing.assert_close(got, brute_force_select(x, case, case.di ** -0.5), rtol=0, atol=0)


@pytest.mark.parametrize("case", SELECT_CASES, ids=lambda c: c.id)
def test_select_blocks_invariants(case):
    x = make_inputs(case, seed=8)
    got = select(x, case).long()
    pos = torch.cat([torch.arange(lk - lq, lk) for _, _, lq, lk in segments(case)])
    own = pos // case.bs
    valid = got >= 0
    assert not (~valid[..., :-1] & valid[..., 1:]).any(), "-1 only in trailing slots"
    assert (valid.sum(-1) == torch.clamp(own + 1, max=case.topk)).all(), "every slot filled while blocks remain"
    ordered = got.sort(-1).values
    assert not ((ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)).any(), "no duplicates"
    assert (got <= own[None, :, None]).all(), "only causally visible blocks"
    for d in range(case.local):
        want = own - d
        present = (got == want[None, :, None]).any(-1) | (want < 0)[None]
        assert present.all(), f"local block own-{d} always kept"
        assert (got[:, want >= 0, d] == want[want >= 0]).all(), "local blocks come first, own block first"


def hf_select(qi: torch.Tensor, ki: torch.Tensor, bs: int, topk: int, local: int) -> torch.Tensor:
    """transformers' MiniMaxM3VLIndexer on one sequence, its projections replaced by the given index q/k.

    Forward hooks on the indexer's q_norm / k_norm return qi [T, Hi, Di] / ki [T, Di]; cos = 1, sin = 0 makes its
    RoPE the identity, so everything after (scores, causal mask, block max, local boost, top-k) is HF's own code.
    """
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLTextConfig
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLIndexer

    t, hi, di = qi.shape
    config = MiniMaxM3VLTextConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2 * hi,
                                   num_key_value_heads=hi, head_dim=8, index_n_heads=hi, index_head_dim=di,
                                   index_block_size=bs, index_topk_blocks=topk, index_local_blocks=local,
                                   layer_types=["minimax_m3_sparse"], mlp_layer_types=["dense"])
    indexer = MiniMaxM3VLIndexer(config, layer_idx=0)
    indexer.q_norm.register_forward_hook(lambda mod, args, out: qi[None].to(out.dtype))
    indexer.k_norm.register_forward_hook(lambda mod, args, out: ki[None, :, None].to(out.dtype))
    cos, sin = torch.ones(1, t, di), torch.zeros(1, t, di)
    with torch.no_grad():
        got = indexer(torch.zeros(1, t, 16), (cos, sin), None, torch.arange(t)[None])[0]  # [Hi, T, k']
    return F.pad(got, (0, topk - got.shape[-1]), value=-1).to(torch.int32)


HF_CASES = [
    Case((77,), 4, 1, 8, 16, 16, 3),
    Case((100,), 4, 2, 8, 8, 32, 5, local=2),
    Case((129,), 4, 4, 8, 8, 16, 3, local=2),
    Case((45,), 4, 2, 8, 8, 8, 5, local=1),
]


@pytest.mark.parametrize("case", HF_CASES, ids=lambda c: c.id)
def test_select_blocks_matches_transformers_indexer(case):
    x = make_inputs(case, seed=9)
    want = hf_select(x["qi"], x["ki"], case.bs, case.topk, case.local)
    got = select(x, case)
    # HF's local blocks tie at +inf, so their order among themselves is unspecified: compare sets there, the
    # rest (descending score) exactly.
    n_local = torch.clamp(torch.arange(sum(case.q_lens)) // case.bs + 1, max=case.local)
    for t in range(got.shape[1]):
        m = int(n_local[t])
        assert (got[:, t, :m].sort(-1).values == want[:, t, :m].sort(-1).values).all(), f"query {t}"
        assert (got[:, t, m:] == want[:, t, m:]).all(), f"query {t}"


def test_public_functions_dispatch_to_reference_on_cpu():
    import openm3.ops.msa as msa

    case = Case((40, 3, 100), 4, 2, 16, 8, 32, 2, k_lens=(90, 3, 230))
    x = make_inputs(case, seed=12)
    kw = dict(block_size=case.bs, cu_seqlens_k=x["cu_seqlens_k"])
    with msa.use_backend("reference"):
        block_idx = msa.select_blocks(x["qi"], x["ki"], x["cu_seqlens"], topk=case.topk, local_blocks=2, **kw)
        o, lse = msa.sparse_attention(x["q"], x["k"], x["v"], block_idx, x["cu_seqlens"], scale=0.3, **kw)
        loss = msa.indexer_kl(x["q"], x["k"], x["qi"], x["ki"], block_idx, x["cu_seqlens"], scale=0.3,
                              index_scale=0.2, lse=lse, **kw)
    want_idx = ref.select_blocks(x["qi"], x["ki"], x["cu_seqlens"], topk=case.topk, local_blocks=2, **kw)
    want_o, want_lse = ref.sparse_attention(x["q"], x["k"], x["v"], want_idx, x["cu_seqlens"], scale=0.3, **kw)
    want_loss = ref.indexer_kl(x["q"], x["k"], x["qi"], x["ki"], want_idx, x["cu_seqlens"], scale=0.3,
                               index_scale=0.2, **kw)
    assert torch.equal(block_idx, want_idx) and torch.equal(o, want_o) and torch.equal(lse, want_lse)
    torch.testing.assert_close(loss, want_loss)


# --- memory ------------------------------------------------------------------------------------------------


class LargestAllocation(TorchDispatchMode):
    """Largest storage (in elements) produced by any op while active."""

    def __init__(self):
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.elements = max(self.elements, t.untyped_storage().nbytes() // t.element_size())
        return out


def test_chunk_workspace_is_bounded_at_4k():
    case = Case((4096,), 4, 1, 32, 32, 64, 8)
    x = make_inputs(case, seed=10)
    workspace = 1 << 18
    t = sum(case.q_lens)
    io = max(t * case.hq * case.d, case.hkv * t * case.topk)  # q / o and block_idx themselves
    with LargestAllocation() as sel:
        block_idx = ref.select_blocks(x["qi"], x["ki"], x["cu_seqlens"], block_size=case.bs, topk=case.topk,
                                      workspace=workspace)
    with LargestAllocation() as att:
        o, _ = ref.sparse_attention(x["q"], x["k"], x["v"], block_idx, x["cu_seqlens"], block_size=case.bs,
                                    workspace=workspace)
    x["qi"].requires_grad_()
    with LargestAllocation() as kl:
        ref.indexer_kl(x["q"], x["k"], x["qi"], x["ki"], None, x["cu_seqlens"], block_size=case.bs,
                       workspace=workspace).backward()
    for name, m in (("select_blocks", sel), ("sparse_attention", att), ("indexer_kl dense", kl)):
        assert m.elements <= max(workspace, io), f"{name}: largest intermediate {m.elements} elements"
        assert m.elements * 64 < case.hq * t * t  # far from any [H, T, T]
    assert torch.isfinite(o).all()


@pytest.mark.slow
def test_64k_forward_runs_in_bounded_memory():
    """select + sparse_attention forward on one 64K-token sequence; peak RSS of a fresh process under 8 GiB."""
    script = textwrap.dedent("""
        import resource, torch
        from openm3.ops.msa import reference as ref
        torch.manual_seed(0)
        t = 65536
        q, k, v = torch.randn(t, 4, 32), torch.randn(t, 1, 32), torch.randn(t, 1, 32)
        qi, ki = torch.randn(t, 1, 32), torch.randn(t, 32)
        cu = torch.tensor([0, t], dtype=torch.int32)
        idx = ref.select_blocks(qi, ki, cu, block_size=64, topk=8)
        o, lse = ref.sparse_attention(q, k, v, idx, cu, block_size=64)
        assert idx.shape == (1, t, 8) and bool((idx[0, -1] >= 0).all()) and bool(torch.isfinite(o).all())
        print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stderr
    peak_kib = int(run.stdout.split()[-1])
    assert peak_kib < 8 * 1024 * 1024, f"peak RSS {peak_kib / 1024:.0f} MiB"


# --- bad inputs ----------------------------------------------------------------------------------------------


def _base():
    case = Case((10, 6), 4, 2, 8, 8, 4, 2)
    x = make_inputs(case, seed=11)
    x["block_idx"] = select(x, case)
    return x


def _attn(x, **kw):
    args = dict(block_size=4) | kw
    return ref.sparse_attention(x["q"], x["k"], x["v"], x["block_idx"], x["cu_seqlens"], **args)


def _sel(x, **kw):
    args = dict(block_size=4, topk=2) | kw
    return ref.select_blocks(x["qi"], x["ki"], x["cu_seqlens"], **args)


def _kl(x, **kw):
    args = dict(block_size=4) | kw
    return ref.indexer_kl(x["q"], x["k"], x["qi"], x["ki"], x["block_idx"], x["cu_seqlens"], **args)


def _with(**changes):
    def build():
        x = _base()
        for key, fn in changes.items():
            x[key] = fn(x)
        return x
    return build


def _set_block(t, j, value):
    def fn(x):
        b = x["block_idx"].clone()
        b[0, t, j] = value
        return b
    return fn


BAD = [
    # (id, build inputs, call, expected message fragment)
    ("q-rank", _with(q=lambda x: x["q"][None]), _attn, "q must have shape"),
    ("k-rank", _with(k=lambda x: x["k"][..., 0]), _attn, "k must have shape"),
    ("v-shape", _with(v=lambda x: x["v"][:, :1]), _attn, "v must have"),
    ("qi-rank", _with(qi=lambda x: x["qi"][:, 0]), _sel, "qi must have shape"),
    ("ki-rank", _with(ki=lambda x: x["ki"][:, None]), _sel, "ki must have shape"),
    ("heads-not-multiple", _with(q=lambda x: x["q"][:, :3]), _attn, "q heads Hq=3"),
    ("Hi-ne-Hkv", _with(qi=lambda x: x["qi"][:, :1]), _kl, "Hi == Hkv"),
    ("head-dim-k", _with(k=lambda x: x["k"][..., :4], v=lambda x: x["v"][..., :4]), _attn, "k must have shape"),
    ("index-dim", _with(ki=lambda x: x["ki"][:, :4]), _sel, "ki must have shape"),
    ("dtype-qkv", _with(k=lambda x: x["k"].double()), _attn, "q, k, v must share one dtype"),
    ("dtype-index", _with(ki=lambda x: x["ki"].half()), _sel, "qi and ki must share one dtype"),
    ("dtype-int-q", _with(q=lambda x: x["q"].long(), k=lambda x: x["k"].long(), v=lambda x: x["v"].long()),
     _attn, "q must be a floating tensor"),
    ("cu-int64", _with(cu_seqlens=lambda x: x["cu_seqlens"].long()), _attn, "cu_seqlens must be an int32"),
    ("cu-2d", _with(cu_seqlens=lambda x: x["cu_seqlens"][None]), _sel, "cu_seqlens must have shape"),
    ("cu-start", _with(cu_seqlens=lambda x: torch.tensor([1, 10, 16], dtype=torch.int32)), _sel,
     "cu_seqlens must start at 0"),
    ("cu-decreasing", _with(cu_seqlens=lambda x: torch.tensor([0, 12, 10, 16], dtype=torch.int32)), _attn,
     "cu_seqlens must be non-decreasing"),
    ("cu-end", _with(cu_seqlens=lambda x: torch.tensor([0, 10, 15], dtype=torch.int32)), _kl,
     "cu_seqlens must end at the number of tokens 16"),
    ("cu-k-short", lambda: _base() | {"k": torch.randn(20, 2, 8), "v": torch.randn(20, 2, 8)}, _attn,
     "cu_seqlens_k is required"),
    ("block-idx-int64", _with(block_idx=lambda x: x["block_idx"].long()), _attn, "block_idx must be an int32"),
    ("block-idx-shape", _with(block_idx=lambda x: x["block_idx"][:, :5]), _attn, "block_idx must have shape"),
    ("block-idx-lt-minus1", _with(block_idx=_set_block(3, 1, -2)), _attn, "block_idx entries must be -1"),
    ("block-idx-out-of-range", _with(block_idx=_set_block(15, 0, 2)), _attn, "out of range"),
    ("block-idx-future", _with(block_idx=_set_block(2, 1, 1)), _kl, "causally invisible"),
    ("block-idx-duplicate", _with(block_idx=_set_block(9, 1, 2)), _attn, "at most once"),
    ("block-idx-gap", _with(block_idx=_set_block(9, 0, -1)), _attn, "only in trailing slots"),
    ("block-size", _base, lambda x: _attn(x, block_size=0), "block_size must be an int >= 1"),
    ("topk", _base, lambda x: _sel(x, topk=0), "topk must be an int >= 1"),
    ("local-gt-topk", _base, lambda x: _sel(x, local_blocks=3), "local_blocks must be <= topk"),
    ("local-negative", _base, lambda x: _sel(x, local_blocks=-1), "local_blocks must be an int >= 0"),
    ("scale", _base, lambda x: _attn(x, scale=-1.0), "scale must be None or a finite positive"),
    ("lse-shape", _base, lambda x: _kl(x, lse=torch.zeros(16, 2)), "lse must have shape"),
    ("cu-k-more-queries", _base, lambda x: _attn(x, cu_seqlens_k=torch.tensor([0, 9, 16], dtype=torch.int32)),
     "sequence 0 has 10 queries but only 9 keys"),
    ("workspace", _base, lambda x: _sel(x, workspace=0), "workspace must be an int >= 1"),
]


@pytest.mark.parametrize("build, call, message", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_inputs_raise_value_error(build, call, message):
    x = build()
    with pytest.raises(ValueError, match=re.escape(message)):
        call(x)


def test_valid_base_inputs_pass():
    """The inputs every bad case starts from are themselves accepted (so each ValueError is the intended one)."""
    x = _base()
    _attn(x)
    _sel(x)
    _kl(x)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_validate_block_idx_false_skips_only_the_value_checks(backend):
    """`validate_block_idx=False` (what the model passes for indices straight from select_blocks) skips the value
    checks of block_idx in both backends, not its shape/dtype checks or the cu_seqlens checks."""
    from openm3.ops import msa

    case = Case((40, 24), 4, 2, 8, 8, 16, 2)  # blocks of 16 keys: the Triton kernels take multiples of 16
    x = make_inputs(case, seed=11)
    x["block_idx"] = select(x, case)
    dup = _set_block(39, 1, 2)(x)  # a duplicated block (the own one): invalid values, harmless to read
    common = dict(block_size=16)
    with msa.use_backend(backend):
        with pytest.raises(ValueError, match="at most once"):
            msa.sparse_attention(x["q"], x["k"], x["v"], dup, x["cu_seqlens"], **common)
        with pytest.raises(ValueError, match="at most once"):
            msa.indexer_kl(x["q"], x["k"], x["qi"], x["ki"], dup, x["cu_seqlens"], **common)
        o, _ = msa.sparse_attention(x["q"], x["k"], x["v"], dup, x["cu_seqlens"], validate_block_idx=False, **common)
        assert torch.isfinite(o).all()
        kl = msa.indexer_kl(x["q"], x["k"], x["qi"], x["ki"], dup, x["cu_seqlens"], validate_block_idx=False,
                            **common)
        assert torch.isfinite(kl)
        with pytest.raises(ValueError, match="block_idx must be an int32"):
            msa.sparse_attention(x["q"], x["k"], x["v"], dup.long(), x["cu_seqlens"], validate_block_idx=False,
                                 **common)
        with pytest.raises(ValueError, match="cu_seqlens must end"):
            msa.indexer_kl(x["q"], x["k"], x["qi"], x["ki"], dup, torch.tensor([0, 40, 63], dtype=torch.int32),
                           validate_block_idx=False, **common)


def test_host_list_reads_cpu_tensors_directly():
    from openm3.ops.host import host_list, to_device

    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    assert host_list(cu) == [0, 3, 7]
    cu[1] = 4  # CPU tensors are read every time (no cache to go stale)
    assert host_list(cu) == [0, 4, 7]
    grid = torch.tensor([[1, 4, 6], [2, 2, 2]])
    assert host_list(grid) == [[1, 4, 6], [2, 2, 2]]
    assert to_device(grid, "cpu", remember=True) is grid  # nothing to copy, nothing to remember


def test_copy_from_host_between_cpu_tensors_is_a_plain_copy():
    from openm3.ops.host import copy_from_host

    dst = torch.zeros(3, dtype=torch.int64)
    copy_from_host(dst, torch.tensor([5, 6, 7], dtype=torch.int32))  # cast as copy_ casts
    assert dst.tolist() == [5, 6, 7] and dst.dtype == torch.int64
