"""Logit bias, penalties, min_tokens and min_p (`openm3.engine.penalties`): each adjustment against its formula
written out token by token, and greedy decoding under them through `generate` (with and without speculative
steps), `BatchedGenerator` (beside a plain request) and a grammar constraint, against an oracle that runs the
full forward at every step."""

from __future__ import annotations

import collections
import math

import pytest
import torch

from openm3.engine import generate
from openm3.engine.batching import BatchedGenerator
from openm3.engine.constrained import GrammarConstraint, TokenBytes, TransitionCache
from openm3.engine.penalties import Penalties, PenalizedPicker
from openm3.engine.sampling import SamplingParams
from openm3.engine.speculative import SpeculativeConfig

from batching_utils import run_concurrently
from test_engine_constrained import Words
from test_engine_speculative import _oracle as scripted_drafts, _prompts, model  # noqa: F401 - the fixture
from test_serve import tok  # noqa: F401 - the fixture


def reference(row: list[float], prompt: list[int], out: list[int], p: Penalties, stop: list[int]) -> list[float]:
    """The adjusted row, one token at a time (vLLM's order: bias and min_tokens, repetition, frequency, presence)."""
    row = list(row)
    for t, b in p.logit_bias:
        row[t] += b
    if p.allowed is not None:
        row = [v if t in p.allowed else -math.inf for t, v in enumerate(row)]
    if len(out) < p.min_tokens:
        for t in stop:
            row[t] = -math.inf
    for word in p.bad_words:  # its last token, where the output ends with the rest
        if len(word) == 1 or tuple(out[len(out) - len(word) + 1:]) == word[:-1]:
            row[word[-1]] = -math.inf
    counts = collections.Counter(out)
    for t in range(len(row)):
        if t in counts or t in prompt:
            row[t] = row[t] / p.repetition if row[t] > 0 else row[t] * p.repetition
        row[t] -= p.frequency * counts[t] + p.presence * (counts[t] > 0)
    return row


SETTINGS = [Penalties(presence=1.5), Penalties(frequency=0.7), Penalties(repetition=1.8),
            Penalties(logit_bias=((3, 5.0), (9, -100.0)), min_tokens=2),
            Penalties(presence=-0.5, frequency=0.3, repetition=0.7, logit_bias=((4, 2.5),), min_tokens=1),
            Penalties(allowed=(0, 3, 4, 9), repetition=1.3),
            Penalties(bad_words=((3,), (4, 9), (9, 4), (2, 2, 5), (4, 4)), presence=-1.0)]


@pytest.mark.parametrize("penalties", SETTINGS, ids=range(len(SETTINGS)))
def test_adjustments_follow_their_formulas(penalties):
    gen = torch.Generator().manual_seed(0)
    prompt, stop = [1, 2, 2, 5], [0, 7]
    picker = PenalizedPicker(penalties, prompt, stop)
    out = []
    for _ in range(6):
        row = torch.randn(12, generator=gen) * 3
        want = reference(row.tolist(), prompt, out, penalties, stop)
        assert picker.adjust(row).tolist() == pytest.approx(want, abs=1e-5)
        token = picker.pick(row, SamplingParams())  # greedy: the adjusted row's argmax
        assert token == max(range(12), key=lambda t: want[t])
        out.append(token)


def test_min_p_drops_the_unlikely_tokens():
    row = torch.tensor([2.0, 1.0, 0.0, -1.0, 2.0])
    picker = PenalizedPicker(Penalties(min_p=0.3), [], [])
    for temperature in (0.5, 1.0, 2.0):
        probs = (row / temperature).softmax(-1)
        kept = picker.adjust(row, SamplingParams(temperature)) > -math.inf
        assert kept.tolist() == (probs >= 0.3 * probs.max()).tolist()
    assert (picker.adjust(row, SamplingParams()) > -math.inf).all()  # greedy: nothing to drop
    gen = torch.Generator().manual_seed(0)
    assert {picker.pick(row, SamplingParams(1.0), gen) for _ in range(200)} == {0, 1, 4}


def test_bad_settings_name_the_field():
    for kwargs, match in (({"presence": 2.5}, "presence penalty"), ({"frequency": float("nan")}, "frequency"),
                          ({"repetition": 0}, "repetition"), ({"logit_bias": ((-1, 1.0),)}, "logit_bias"),
                          ({"logit_bias": ((1, 101.0),)}, "logit_bias"), ({"min_tokens": -1}, "min_tokens"),
                          ({"min_p": 1.5}, "min_p"), ({"allowed": ()}, "allowed_token_ids"),
                          ({"allowed": (1, -2)}, "allowed_token_ids"), ({"bad_words": ((),)}, "bad_words"),
                          ({"bad_words": ((1, -1),)}, "bad_words")):
        with pytest.raises(ValueError, match=match):
            Penalties(**kwargs)


def oracle(model, prompt: list[int], penalties: Penalties, stop: list[int], steps: int) -> list[int]:
    """Greedy tokens under the adjustments, each step a full forward over prompt + answer."""
    out: list[int] = []
    for _ in range(steps):
        ids = torch.tensor(prompt + out)
        with torch.no_grad():
            row = model(ids, cu_seqlens=torch.tensor([0, len(ids)], dtype=torch.int32)).logits[-1].float()
        adjusted = reference(row.tolist(), prompt, out, penalties, stop)
        out.append(max(range(len(adjusted)), key=lambda t: adjusted[t]))
        if out[-1] in stop:
            break
    return out


def test_greedy_decoding_under_penalties_equals_the_oracle(model, monkeypatch):
    """A random model repeats itself when greedy: the penalties change its answers, and `generate` (plain and with
    speculative steps) and `BatchedGenerator` (beside a plain request) give the oracle's tokens; min_tokens holds a
    stop token back that a large bias would pick at once."""
    prompts = _prompts(model, [30, 45])
    stop = [11]
    cases = [Penalties(repetition=1.6, frequency=0.4), Penalties(presence=1.2, logit_bias=((11, 60.0),), min_tokens=5)]
    plain, _ = generate(model, prompts, max_new_tokens=14, stop_tokens=stop)
    want = [oracle(model, p, c, stop, 14) for p, c in zip(prompts, cases)]
    assert want[0] != plain[0].tokens and want[1] == want[1][:5] + [11] and len(want[1]) == 6
    answers = {tuple(p): w for p, w in zip(prompts, want)}
    for spec in (None, SpeculativeConfig(num_speculative_tokens=3)):
        if spec is not None:
            scripted_drafts(monkeypatch, answers)
        pickers = [PenalizedPicker(c, p, stop) for p, c in zip(prompts, cases)]
        got, stats = generate(model, prompts, max_new_tokens=14, stop_tokens=stop, constraints=pickers,
                              speculative=spec)
        assert [r.tokens for r in got] == want
        assert spec is None or 0 < stats.accepted_tokens < stats.draft_tokens
    batcher = BatchedGenerator(model, token_budget=1024, max_batch=3)
    outputs: list[list[int]] = [[], [], []]

    def job(k: int, prompt: list[int], picker):
        return lambda: batcher(prompt, max_new_tokens=14, stop_tokens=stop, on_token=outputs[k].append,
                               constraint=picker)

    finishes = run_concurrently([job(k, p, PenalizedPicker(c, p, stop)) for k, (p, c) in enumerate(zip(prompts, cases))]
                                + [job(2, prompts[0], None)])
    batcher.close()
    assert finishes == ["length", "stop", "length"] and outputs == want + [plain[0].tokens]


def test_bad_words_are_never_completed(model, monkeypatch):
    """A two-token word of the plain greedy answer as a bad word: the answer parts where it would complete it,
    never holds it, and `generate` (plain and speculative) gives the full-forward oracle's tokens."""
    prompts = _prompts(model, [40])
    plain = generate(model, prompts, max_new_tokens=16)[0][0].tokens
    word = (plain[5], plain[6])
    cases = Penalties(bad_words=(word, (plain[0] + 1,)))
    want = oracle(model, prompts[0], cases, [], 16)
    assert want[:6] == plain[:6] and want[6] != plain[6]
    assert all((a, b) != word for a, b in zip(want, want[1:])) and plain[0] + 1 not in want
    for spec in (None, SpeculativeConfig(num_speculative_tokens=3)):
        if spec is not None:
            scripted_drafts(monkeypatch, {tuple(prompts[0]): plain})  # drafts that run into the bad word
        got, _ = generate(model, prompts, max_new_tokens=16, constraints=[PenalizedPicker(cases, prompts[0])],
                          speculative=spec)
        assert got[0].tokens == want


def test_a_thinking_budget_ends_the_think_block_and_keeps_it_shut():
    """Think-block tokens (start 10, end 11) under a budget, greedy over random rows whose argmax is planted:
    inside a block opened by the prompt, the first `budget` picks are the rows' own and the next is the end
    token however unlikely; then the start token is masked; budget 0 masks the start from the first pick; a
    block the output opens counts the same; picks outside a block are never touched before the budget is spent."""
    gen = torch.Generator().manual_seed(0)

    def rows(argmaxes):
        out = []
        for t in argmaxes:
            row = torch.randn(16, generator=gen)
            row[t] = 10.0
            row[11] = -50.0  # the end token, far less likely than any other
            out.append(row)
        return out

    think = (10, 11)
    picker = PenalizedPicker(Penalties(think=think, think_budget=3), [1, 2, 11, 10], [0])  # the prompt opens one
    picks = [picker.pick(r, SamplingParams()) for r in rows([4, 5, 6, 7, 10, 8])]
    assert picks[:4] == [4, 5, 6, 11] and picks[4] != 10 and picks[5] == 8  # 7's turn went to the end token
    closed = PenalizedPicker(Penalties(think=think, think_budget=3), [1, 10, 2, 11], [0])  # the prompt's is shut
    assert [closed.pick(r, SamplingParams()) for r in rows([4, 10, 5, 6, 7, 8])] == [4, 10, 5, 6, 7, 11]
    off = PenalizedPicker(Penalties(think=think, think_budget=0), [1, 2], [0])
    assert 10 not in [off.pick(r, SamplingParams()) for r in rows([10, 10, 3])]
    opened = PenalizedPicker(Penalties(think=think, think_budget=0), [1, 10], [0])
    assert opened.pick(rows([3])[0], SamplingParams()) == 11  # closed at once
    for kwargs, match in (({"think_budget": -1, "think": think}, "think_budget"), ({"think_budget": 2}, "think")):
        with pytest.raises(ValueError, match=match):
            Penalties(**kwargs)


def test_penalties_around_a_grammar_constraint(model, tok):
    """A grammar constraint inside the picker picks from the adjusted row: the tokens of greedy constrained
    decoding of the adjusted rows (a bias towards a refused token changes nothing; one towards an allowed token
    wins)."""
    vocab = TokenBytes(TokenBytes.from_tokenizer(tok).pieces + [None] * (model.config.vocab_size - tok.vocab_size))
    prompt = _prompts(model, [20])[0]
    space = tok.encode(" ")[0]
    refused = next(t for t, p in enumerate(vocab.pieces) if p and p[:1].isupper())
    for bias in (((refused, 90.0),), ((space, 90.0),)):
        picker = PenalizedPicker(Penalties(logit_bias=bias), prompt, [tok.eos_id],
                                 inner=GrammarConstraint(TransitionCache(Words(), vocab), [tok.eos_id]))
        got, _ = generate(model, [prompt], max_new_tokens=6, stop_tokens=[tok.eos_id], constraints=[picker])
        tokens = got[0].tokens
        assert refused not in tokens
        text = b"".join(vocab.pieces[t] for t in tokens if t != tok.eos_id)
        assert text and set(text) <= Words.ALLOWED
        if bias[0][0] == space:
            assert tokens[:5] == [space] * 5  # the grammar takes spaces; the bias wins each step


def test_min_p_around_a_grammar_applies_after_its_mask(tok):
    """With a grammar inside, min_p keeps the allowed tokens within min_p of the best allowed one (vLLM applies it
    after the grammar's mask): a refused token far more likely than every allowed one does not empty the choice,
    and an allowed token much less likely than the best allowed one is never drawn."""
    vocab = TokenBytes(TokenBytes.from_tokenizer(tok).pieces)
    allowed = [t for t, p in enumerate(vocab.pieces) if p and set(p) <= Words.ALLOWED]
    refused = next(t for t, p in enumerate(vocab.pieces) if p and p[:1].isupper())
    best, weak = allowed[0], allowed[1]
    row = torch.full((len(vocab),), -30.0)
    row[refused], row[best], row[weak] = 20.0, 0.0, math.log(0.05)  # weak: 0.05 x best's probability
    sampling, drawn = SamplingParams(1.0), set()
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        picker = PenalizedPicker(Penalties(min_p=0.1), [], [tok.eos_id],
                                 inner=GrammarConstraint(TransitionCache(Words(), vocab), [tok.eos_id]))
        drawn.add(picker.pick(row, sampling, gen))
    assert drawn == {best}  # weak is below 0.1 x best; the refused token never counts
    for _ in range(300):
        picker = PenalizedPicker(Penalties(min_p=0.01), [], [tok.eos_id],
                                 inner=GrammarConstraint(TransitionCache(Words(), vocab), [tok.eos_id]))
        drawn.add(picker.pick(row, sampling, gen))
    assert weak in drawn  # at 0.01 it is kept (drawn ~5% of the time)
