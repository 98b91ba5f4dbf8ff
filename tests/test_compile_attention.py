"""Per-layer `torch.compile` (`apply_compile`) traces the attention layer's own work: q/k/v projections, QK-norm,
partial RoPE, the indexer's projections, norms and RoPE, and o_proj. Only `Attention.attend` (the varlen dense and
MSA ops, or the inference cache, which read `cu_seqlens` on the host) runs eagerly.

The compiled model gives the eager loss, indexer KL and every gradient (sparse stage with the KL, dense warm-up,
with and without activation checkpointing); a recording backend checks which parameters the compiled graphs read
and how many graphs one layer forward runs, so the projections cannot silently fall out of the graph again; a new
packing recompiles once, later ones reuse it. CPU runs use `aot_eager` (Dynamo + AOTAutograd without code
generation); one case runs Inductor's C++ backend (~35 s on one core).
"""

import copy
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.backends.debugging import aot_eager

from openm3.layers.attention import Attention
from openm3.models.config import M3TextConfig
from openm3.models.text import M3TextModel
from openm3.train.distributed import apply_activation_checkpointing, apply_compile
from test_train_compile import _graph_break_reasons, fresh_dynamo  # noqa: F401  (fresh_dynamo: autouse fixture)

# Packed batches (token count, cu_seqlens): m3-tiny has key blocks of 16 and top-4 blocks, so sequences above 64
# tokens make the MSA layers really sparse.
PACKINGS = [(128, [0, 100, 128]), (128, [0, 128]), (96, [0, 30, 70, 96]), (112, [0, 112]),
            (128, [0, 20, 60, 128])]


def tiny_model(**overrides) -> M3TextModel:
    """m3-tiny (layer 0 dense attention + dense MLP, layers 1-3 MSA + MoE) with non-zero norm weights, so the
    norms' scales take part in the numbers compared."""
    torch.manual_seed(0)
    model = M3TextModel(M3TextConfig.from_name("m3-tiny", **overrides)).train()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.2)
    return model


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    t, cu = PACKINGS[i]
    ids = torch.randint(0, 4096, (t + 1,), generator=torch.Generator().manual_seed(i))
    return ids, torch.tensor(cu, dtype=torch.int32)


def step(model: M3TextModel, i: int, stage: str) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Loss (next-token CE + indexer KL + 0.01 aux) of batch i; returns (loss, kl, {parameter name: grad})."""
    ids, cu = batch(i)
    out = model(ids[:-1], cu_seqlens=cu, msa_stage=stage, return_kl=True, return_aux=True)
    loss = F.cross_entropy(out.logits.float(), ids[1:]) + out.indexer_kl + 0.01 * out.aux_loss
    loss.backward()
    grads = {name.replace("_checkpoint_wrapped_module.", ""): p.grad for name, p in model.named_parameters()
             if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), out.indexer_kl.detach(), grads


def assert_same_steps(eager: M3TextModel, compiled: M3TextModel, stage: str, steps: int = 2) -> None:
    for i in range(steps):
        want_loss, want_kl, want = step(eager, i, stage)
        got_loss, got_kl, got = step(compiled, i, stage)
        torch.testing.assert_close(got_loss, want_loss, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_kl, want_kl, atol=1e-5, rtol=1e-5)
        assert want_kl > 0
        assert got.keys() == want.keys()
        # every attention parameter (main and index branch) of every layer is trained in both stages
        attn = {n for n, _ in eager.named_parameters() if ".self_attn." in n}
        assert attn <= want.keys(), sorted(attn - want.keys())
        for name in want:
            torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("ac", [False, True], ids=["plain", "activation_checkpointing"])
@pytest.mark.parametrize("stage", ["sparse", "dense"], ids=["sparse_kl", "dense_warmup"])
def test_compiled_attention_matches_eager(stage, ac):
    eager = tiny_model()
    compiled = copy.deepcopy(eager)
    if ac:
        apply_activation_checkpointing(compiled)
    assert apply_compile(compiled, backend="aot_eager") == 4
    assert_same_steps(eager, compiled, stage)


def test_compiled_attention_matches_eager_inductor():
    eager = tiny_model()
    compiled = copy.deepcopy(eager)
    apply_compile(compiled, backend="inductor")
    assert_same_steps(eager, compiled, "sparse")


def test_nested_graph_breaks_match_eager():
    """`torch._dynamo.config.nested_graph_breaks` (off by default) merges the layer into two graphs around
    `attend`; the numbers stay the eager ones."""
    eager = tiny_model()
    compiled = copy.deepcopy(eager)
    apply_compile(compiled, backend="aot_eager")
    with torch._dynamo.config.patch(nested_graph_breaks=True):
        assert_same_steps(eager, compiled, "sparse")


class Recorder:
    """A Dynamo backend (aot_eager underneath) that records, per compiled graph, the parameters it reads (relative
    to their decoder layer: `self_attn.q_proj.weight`), and logs every run of a compiled forward graph."""

    def __init__(self, model: nn.Module):
        self.names = {id(p): re.sub(r"^layers\.\d+\.", "", n.replace("_checkpoint_wrapped_module.", ""))
                      for n, p in model.named_parameters()}
        self.graphs: list[set[str]] = []
        self.events: list[str] = []

    def __call__(self, gm, example_inputs):
        self.graphs.append({self.names[id(t)] for t in example_inputs if id(t) in self.names})
        compiled = aot_eager(gm, example_inputs)

        def run(*args):
            self.events.append("graph")
            return compiled(*args)

        return run


@pytest.mark.parametrize("nested", [False, True], ids=["default", "nested_graph_breaks"])
def test_projections_norms_rope_and_o_proj_are_compiled(monkeypatch, nested):
    """Dense MLPs (the CPU MoE reference experts are an eager region of their own) so that one layer forward runs
    an exact sequence: Dynamo graph-breaks at the call of `self_attn` and inside it at `attend`, so by default four
    graphs run per layer (input norm | projections + norms + RoPE | o_proj | residual + MLP) around the one eager
    call; with nested graph breaks two. The projections' graph reads every parameter of the main and index
    branches, o_proj is compiled, and nothing else breaks the graph."""
    model = tiny_model(mlp_layer_types=["dense"] * 4)
    original = Attention.attend
    recorder = Recorder(model)

    @torch.compiler.disable
    def attend(self, *args, **kwargs):
        recorder.events.append("attend")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Attention, "attend", attend)
    apply_compile(model, backend=recorder)
    with torch._dynamo.config.patch(nested_graph_breaks=nested):
        ids, cu = batch(0)
        model(ids[:-1], cu_seqlens=cu, msa_stage="sparse", return_kl=True)

    per_layer = ["graph", "attend", "graph"] if nested else ["graph", "graph", "attend", "graph", "graph"]
    assert recorder.events == per_layer * 4
    layer_params = {recorder.names[id(p)] for p in model.layers[1].parameters()}
    assert set().union(*recorder.graphs) == layer_params  # every parameter of the layer is read by a graph
    main = {f"self_attn.{m}.weight" for m in ("q_proj", "k_proj", "v_proj", "q_norm", "k_norm")}
    index = {f"self_attn.indexer.{m}.weight" for m in ("q_proj", "k_proj", "q_norm", "k_norm")}
    assert any(main <= g and not index & g for g in recorder.graphs)  # the dense layer's projections, one graph
    assert any(main | index <= g for g in recorder.graphs)  # the MSA layer's main and index branches, in one graph
    assert any("self_attn.o_proj.weight" in g for g in recorder.graphs)
    reasons = _graph_break_reasons()  # only the (wrapped) `attend`
    assert reasons and all(re.search(r"<function \S*\.attend at ", r) for r in reasons), reasons


def test_new_packings_recompile_once():
    """A new packing (number of documents) recompiles each graph at most once, a new token count at most once
    more; after that packings and token counts reuse the compiled graphs. The MoE layers run their CPU reference
    experts eagerly; the only graph breaks are the two eager regions."""
    model = tiny_model()
    recorder = Recorder(model)
    apply_compile(model, backend=recorder)
    new = []
    for i in range(len(PACKINGS)):
        before = len(recorder.graphs)
        step(model, i, "sparse")
        new.append(len(recorder.graphs) - before)
    first = new[0]
    assert first > 0
    assert new[1] <= first and new[2] <= first, f"graphs compiled per step: {new}"
    assert new[3:] == [0] * (len(PACKINGS) - 3), f"recompiles after the first packing and size change: {new}"
    names = {recorder.names[id(p)] for p in model.layers.parameters()}
    compiled = set().union(*recorder.graphs)
    assert compiled == {n for n in names if not n.startswith("mlp.experts.")}
    reasons = _graph_break_reasons()
    assert reasons and all("Attention.attend" in r or "Experts._reference_eager" in r for r in reasons), reasons
