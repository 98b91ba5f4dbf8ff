"""Speculative decoding with n-gram drafts (`openm3.engine.speculative`): the lookup, the configuration, the
verification rule (greedy and sampled: the sampled rule's output distribution is checked by counting), and
`generate` / `BatchedGenerator` with speculation giving plain decoding's greedy tokens while drafts are kept and
rejected, stop tokens fall inside a step's drafts, and prefix caching files the pages such steps wrote; the
adaptive gate (`openm3.engine.spec_gate`): its decision from the kept-draft rate and the step times, shadow drafts
settled by the tokens plain steps give, and the engines speculating where the drafts are right and not where they
never are."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import openm3.engine.speculative as speculative
from openm3.engine import generate
from openm3.engine.batching import BatchedGenerator
from openm3.engine.sampling import SamplingParams, filter_logits
from openm3.engine.spec_gate import SpeculationGate
from openm3.engine.speculative import SpeculativeConfig, TokenHistory, ngram_drafts, step_drafts, verify

from batching_utils import random_prompts, tiny_model, run_concurrently


@pytest.fixture(scope="module")
def model():
    return tiny_model()


_prompts = random_prompts


# ---------------------------------------------------------------------------------------------- lookup, config

def test_ngram_drafts_take_the_latest_longest_match():
    cfg = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1)
    t = np.array([5, 6, 7, 1, 2, 9, 6, 7, 3, 4, 8, 6, 7])
    assert ngram_drafts(t, 3, cfg) == [3, 4, 8]  # "6 7" twice before: the later one wins
    t = np.array([1, 6, 7, 2, 2, 5, 7, 9, 9, 9, 1, 6, 7])
    assert ngram_drafts(t, 2, cfg) == [2, 2]  # "1 6 7" (3 tokens) beats the later "7" alone
    assert ngram_drafts(np.array([1, 2, 3, 4]), 3, cfg) == []
    assert ngram_drafts(np.array([4]), 3, cfg) == []
    # a match closer than k tokens back continues through its own drafts: a repeating pattern
    assert ngram_drafts(np.array([8, 1, 2, 1, 2]), 5, cfg) == [1, 2, 1, 2, 1]
    strict = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=2)
    assert ngram_drafts(np.array([3, 4, 5, 9, 5]), 2, strict) == []  # only one token matches


def test_step_drafts_pad_and_fall_back_to_plain_steps():
    cfg = SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=2, prompt_lookup_min=1)
    hits = TokenHistory(torch.tensor([4, 5, 6, 4]), 8)
    misses = TokenHistory(torch.tensor([1, 2, 3]), 8)
    assert step_drafts([hits, misses], [5, 5], cfg) == [[5, 6], [3, 3]]  # padded with its last token
    assert step_drafts([misses, misses], [5, 5], cfg) is None  # nobody has a draft: a plain step
    assert step_drafts([hits, misses], [5, 1], cfg) is None  # one has no room for 2 drafts
    hits.append(5)
    assert hits.view().tolist() == [4, 5, 6, 4, 5]


def test_config_reads_vllm_json_and_names_bad_fields():
    cfg = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}')
    assert (cfg.num_speculative_tokens, cfg.prompt_lookup_max, cfg.prompt_lookup_min) == (5, 3, 2)
    assert SpeculativeConfig.parse({"num_speculative_tokens": 1, "prompt_lookup_min": 6}).prompt_lookup_max == 6
    bad = [("{", "not valid JSON"), ("[1]", "JSON object"), ('{"method": "ngram"}', "num_speculative_tokens"),
           ('{"num_speculative_tokens": 8}', r"num_speculative_tokens must be an int in \[1, 7\]"),
           ('{"num_speculative_tokens": 2, "method": "eagle"}', "only 'ngram'"),
           ('{"num_speculative_tokens": 2, "model": "x"}', r"unknown keys \['model'\]"),
           ('{"num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}',
            r"prompt_lookup_max must be an int >= 3"),
           ('{"num_speculative_tokens": true}', "num_speculative_tokens")]
    for text, match in bad:
        with pytest.raises(ValueError, match=match):
            SpeculativeConfig.parse(text)


# ---------------------------------------------------------------------------------------------- verification

def test_greedy_verify_keeps_the_agreeing_drafts_and_one_more():
    logits = torch.full((4, 6), -1.0)
    for row, best in enumerate([2, 3, 5, 1]):
        logits[row, best] = 1.0
    assert verify(logits, [2, 3, 0], SamplingParams()) == [2, 3, 5]
    assert verify(logits, [2, 3, 5], SamplingParams()) == [2, 3, 5, 1]
    assert verify(logits, [4, 3, 5], SamplingParams()) == [2]
    assert verify(logits, [2, 3, 5], SamplingParams(), argmax=[2, 0, 0, 0]) == [2, 0]
    with pytest.raises(ValueError, match="len\\(drafts\\) \\+ 1"):
        verify(logits, [1], SamplingParams())


def test_sampled_verify_keeps_the_target_distribution():
    """Counting 40,000 steps with two drafts over a 5-token vocabulary: the first token follows p0 (filtered by
    temperature and top-k), the second, after the first draft was kept, follows p1, and the third, after both,
    p2; the share of kept drafts is p0(d0)."""
    torch.manual_seed(0)
    logits = torch.randn(3, 5) * 1.5
    params = SamplingParams(temperature=0.8, top_k=4)
    p = filter_logits(logits, params).softmax(-1)
    drafts = [int(p[0].argsort()[-2]), int(p[1].argmax())]  # a likely and a very likely draft
    gen = torch.Generator().manual_seed(1)
    n = 40_000
    first = torch.zeros(5)
    second, third, kept_both = torch.zeros(5), torch.zeros(5), 0
    for _ in range(n):
        out = verify(logits, drafts, params, gen)
        first[out[0]] += 1
        if out[0] == drafts[0] and len(out) > 1:
            second[out[1]] += 1
            if out[1] == drafts[1]:
                third[out[2]] += 1
                kept_both += 1
        assert len(out) == 3 or out[-1] != drafts[len(out) - 1]  # a kept draft never ends a step
    assert (first / n - p[0]).abs().max() < 0.01
    assert (second / second.sum() - p[1]).abs().max() < 0.015
    assert (third / third.sum() - p[2]).abs().max() < 0.02
    assert abs(kept_both / n - p[0, drafts[0]] * p[1, drafts[1]]) < 0.01
    assert first[int(p[0].argmin())] == 0  # top-k removed it


# ---------------------------------------------------------------------------------------------- in the engine

def _oracle(monkeypatch, answers: dict[tuple, list[int]], wrong_every: int = 3):
    """Replaces the n-gram lookup by drafts from the known greedy answers (a random model copies nothing, so
    real lookups are rarely right): each sequence's next answer tokens, with the second one wrong every
    `wrong_every`-th step and a made-up tail past the answer's end, so steps keep 0, some or all drafts."""
    calls = []

    def drafts(tokens, k, config):
        for prompt, answer in answers.items():
            if tuple(tokens[:len(prompt)].tolist()) == prompt:
                done = len(tokens) - len(prompt)
                d = answer[done:done + k] + [7] * max(0, k - len(answer[done:]))
                calls.append(len(calls))
                if len(calls) % wrong_every == 0 and k > 1:
                    d[1] = (d[1] + 1) % 97
                return d
        return []

    monkeypatch.setattr(speculative, "ngram_drafts", drafts)
    return calls


def test_generate_greedy_with_speculation_equals_plain(model, monkeypatch):
    """Greedy `generate` with 4 drafts per step: the same tokens as without, in fewer steps; a stop token inside a
    step's kept drafts ends the sequence there; max_new_tokens cuts a step's tokens."""
    prompts = _prompts(model, [70, 23, 41])
    plain, _ = generate(model, prompts, max_new_tokens=30)
    answers = {tuple(p): r.tokens for p, r in zip(prompts, plain)}
    stop = plain[1].tokens[17]  # sequence 1 stops on it (or earlier, where the token first comes)
    want, _ = generate(model, prompts, max_new_tokens=30, stop_tokens=[stop])
    _oracle(monkeypatch, answers)
    got, stats = generate(model, prompts, max_new_tokens=30, stop_tokens=[stop],
                          speculative=SpeculativeConfig(num_speculative_tokens=4))
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert [r.finish_reason for r in got] == [r.finish_reason for r in want]
    assert want[1].finish_reason == "stop"
    assert stats.spec_steps == stats.decode_steps and 0 < stats.accepted_tokens < stats.draft_tokens
    assert stats.decode_steps < 29  # plain greedy takes 29 steps for the longest
    assert "drafts kept" in stats.summary()


def test_speculation_through_the_triton_decode_kernels(model, monkeypatch):
    """The same with the Triton decode kernels (q_len = 4 queries per sequence; TRITON_INTERPRET=1 on CPU)."""
    from openm3.ops.msa import use_backend

    prompts = _prompts(model, [45, 20])
    with use_backend("triton"):
        plain, _ = generate(model, prompts, max_new_tokens=10)
        _oracle(monkeypatch, {tuple(p): r.tokens for p, r in zip(prompts, plain)})
        got, stats = generate(model, prompts, max_new_tokens=10,
                              speculative=SpeculativeConfig(num_speculative_tokens=3))
    assert [r.tokens for r in got] == [r.tokens for r in plain]
    assert 0 < stats.accepted_tokens < stats.draft_tokens


def test_generate_speculation_with_real_lookups_equals_plain(model):
    """With the real n-gram lookup (1-token matches allowed, so a random model's answer finds some): the same
    greedy tokens as plain decoding."""
    prompts = _prompts(model, [90, 35])
    plain, _ = generate(model, prompts, max_new_tokens=40)
    cfg = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1)
    got, stats = generate(model, prompts, max_new_tokens=40, speculative=cfg)
    assert [r.tokens for r in got] == [r.tokens for r in plain]
    assert stats.spec_steps > 0


def test_generate_sampled_speculation_keeps_likely_drafts(model, monkeypatch):
    """Sampling from a peaked copy of the model (its output layer scaled up, so its greedy token has most of the
    probability), with drafts that are the greedy continuation of each step's tokens (full forwards): most are
    kept, and the answer keeps its length."""
    import copy

    peaked = copy.deepcopy(model)
    with torch.no_grad():
        peaked.lm_head.weight.mul_(40.0)

    def greedy_rollout(tokens, k, _config):
        seq = tokens.tolist()
        with torch.no_grad():
            for _ in range(k):
                cu = torch.tensor([0, len(seq)], dtype=torch.int32)
                seq.append(int(peaked(torch.tensor(seq), cu_seqlens=cu).logits[-1].argmax()))
        return seq[len(tokens):]

    monkeypatch.setattr(speculative, "ngram_drafts", greedy_rollout)
    prompts = _prompts(model, [50])
    got, stats = generate(peaked, prompts, max_new_tokens=20, sampling=SamplingParams(temperature=1.0), seed=3,
                          speculative=SpeculativeConfig(num_speculative_tokens=3))
    assert len(got[0].tokens) == 20 and stats.spec_steps > 0
    assert stats.accepted_tokens > stats.draft_tokens / 2


def test_batched_generator_with_speculation_equals_generate(model, monkeypatch):
    """Three concurrent greedy requests (one sampled beside them) with speculation: the greedy ones give
    `generate`'s tokens; every page comes back; a later request whose prompt is an earlier prompt + its answer
    reads the cached pages (written by speculative steps) and still gives `generate`'s tokens."""
    prompts = _prompts(model, [40, 9, 75, 30])
    new = [25, 14, 20, 10]
    plain = [generate(model, [p], max_new_tokens=n)[0][0].tokens for p, n in zip(prompts, new)]
    follow = prompts[2] + plain[2] + _prompts(model, [5], seed=9)[0]
    follow_plain = generate(model, [follow], max_new_tokens=12)[0][0].tokens
    _oracle(monkeypatch, {**{tuple(p): a for p, a in zip(prompts, plain)}, tuple(follow): follow_plain})
    gen = BatchedGenerator(model, token_budget=2048, max_batch=4, chunk_size=32,
                           speculative=SpeculativeConfig(num_speculative_tokens=3))
    got = [[] for _ in prompts]
    sampling = [SamplingParams()] * 3 + [SamplingParams(temperature=0.7)]
    calls = [lambda i=i: gen(prompts[i], max_new_tokens=new[i], sampling=sampling[i], seed=i,
                             on_token=got[i].append) for i in range(4)]
    results = run_concurrently(calls)
    assert results == ["length"] * 4
    assert got[:3] == plain[:3] and len(got[3]) == new[3]
    assert gen.spec_steps > 0 and 0 < gen.accepted_tokens < gen.draft_tokens
    cached = []
    out = []
    assert gen(follow, max_new_tokens=12, on_token=out.append, on_cached=cached.append) == "length"
    assert out == follow_plain and cached[0] >= 16 * ((len(prompts[2]) + len(plain[2]) - 1) // 16 - 1)
    metrics = {name: value for name, _, _, value in gen.metrics()}
    assert metrics["spec_decode_accepted_tokens_total"] == gen.accepted_tokens
    gen.close()
    assert gen.cache.free_pages == gen.plan.num_pages


def test_speculative_option_errors_name_the_flag():
    from openm3.engine.generate import main

    with pytest.raises(SystemExit, match="--speculative-config: num_speculative_tokens must be"):
        main(["--preset", "m3-tiny", "--prompt-ids", "1,2", "--speculative-config", '{"num_speculative_tokens": 0}'])
    with pytest.raises(ValueError, match="speculative must be a SpeculativeConfig"):
        BatchedGenerator(torch.nn.Linear(1, 1), token_budget=16, speculative={"num_speculative_tokens": 2})


def test_a_predicted_output_is_a_draft_source(model):
    """A request's predicted output (`draft_contexts` / `draft_context`: OpenAI's `prediction`) is looked up
    for drafts too: with the plain answer as the prediction, the real n-gram lookup keeps far more drafts and
    the greedy tokens stay plain decoding's, through `generate` and `BatchedGenerator`; a prediction that is
    wrong changes nothing but the drafts."""
    prompts = _prompts(model, [60, 25])
    plain, _ = generate(model, prompts, max_new_tokens=30)
    answers = [r.tokens for r in plain]
    cfg = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=2)
    alone, alone_stats = generate(model, prompts, max_new_tokens=30, speculative=cfg)
    told, stats = generate(model, prompts, max_new_tokens=30, speculative=cfg, draft_contexts=answers)
    wrong, _ = generate(model, prompts, max_new_tokens=30, speculative=cfg,
                        draft_contexts=[list(reversed(a)) for a in answers])
    assert [r.tokens for r in alone] == [r.tokens for r in told] == [r.tokens for r in wrong] == answers
    assert stats.accepted_tokens >= 40 > alone_stats.accepted_tokens and stats.decode_steps < 20
    with pytest.raises(ValueError, match="draft_contexts"):
        generate(model, prompts, max_new_tokens=2, speculative=cfg, draft_contexts=[answers[0]])
    gen = BatchedGenerator(model, token_budget=1024, max_batch=2, speculative=cfg)
    out: list[int] = []
    assert gen(prompts[0], max_new_tokens=30, on_token=out.append, draft_context=answers[0]) == "length"
    assert out == answers[0] and gen.accepted_tokens >= 20
    gen.close()


def test_a_predicted_output_speculates_without_a_speculative_config(model, monkeypatch):
    """Without `speculative`, a sequence with a predicted output looks drafts up with `PREDICTION_DRAFTS`
    (adaptive) and one without looks nothing up: the greedy tokens stay plain decoding's, the predicted answer
    is confirmed several tokens per step; through `BatchedGenerator` too, where `prediction_speculative=None`
    turns it off."""
    steady_gates(monkeypatch)
    prompts = _prompts(model, [60, 25])
    plain, _ = generate(model, prompts, max_new_tokens=30)
    answers = [r.tokens for r in plain]
    told, stats = generate(model, prompts, max_new_tokens=30, draft_contexts=[answers[0], None])
    assert [r.tokens for r in told] == answers
    assert stats.spec_steps > 0 and stats.accepted_tokens >= 20 and "predicted outputs" in stats.speculative
    assert stats.draft_tokens == 2 * 4 * stats.spec_steps  # both sequences fed 4 tokens per speculative step
    _, none = generate(model, prompts, max_new_tokens=30, draft_contexts=[None, []])
    assert none.spec_steps == 0 and none.speculative == ""

    for setting, kept in ((speculative.PREDICTION_DRAFTS, 20), (None, 0)):
        gen = BatchedGenerator(model, token_budget=1024, max_batch=2, prediction_speculative=setting)
        out: list[int] = []
        assert gen(prompts[1], max_new_tokens=30, on_token=out.append) == "length"
        assert out == answers[1] and gen.spec_steps == 0  # no prediction: no lookup
        out = []
        assert gen(prompts[0], max_new_tokens=30, on_token=out.append, draft_context=answers[0]) == "length"
        assert out == answers[0] and (gen.accepted_tokens >= kept if kept else gen.accepted_tokens == 0)
        gen.close()


# ---------------------------------------------------------------------------------------------------- the gate

def test_the_gate_learns_the_kept_rate_from_shadow_drafts():
    """Nothing known: plain, and the drafts become shadows; tokens that repeat a shadow's drafts settle it at the
    number matched (over several steps, up to its length or the first miss). A shadow still matching counts
    for its matches so far where that is enough to speculate."""
    gate = SpeculationGate(prior_ratio=4.0)  # a speculative step costs 4 plain ones
    assert not gate.speculate(["a"], [[5, 6, 7]]) and gate.kept_rate is None
    gate.record(["a"], [[5]], None, speculative=False)
    assert gate.kept_rate is None  # 1 matched, more may follow
    assert not gate.speculate(["a"], [[9, 9, 9]])  # 1 + 1 < 4; a shadow is pending: these drafts are not taken
    gate.record(["a"], [[6]], None, speculative=False)
    gate.record(["a"], [[1]], None, speculative=False)  # the third draft missed: 2 kept
    assert gate.kept_rate == 2.0
    assert not gate.speculate(["a"], [[3, 4, 5]])  # 1 + 2 < 4
    for token in (3, 4, 5):
        gate.record(["a"], [[token]], None, speculative=False)
    assert gate.kept_rate == pytest.approx(2.0 + (3.0 - 2.0) / 16)  # all 3 matched
    gate.kept_rate = 3.5
    assert gate.speculate(["a"], [[3, 4, 5]])  # 1 + 3.5 > 4
    gate.record(["a"], [[3, 4, 8]], None, speculative=True, accepted=2)
    assert gate.kept_rate == pytest.approx(3.5 + (2.0 - 3.5) / 16)

    gate = SpeculationGate(prior_ratio=1.5)
    assert not gate.speculate(["a"], [[5, 6, 7]])
    gate.record(["a"], [[5]], None, speculative=False)
    assert gate.speculate(["a"], [[6, 7, 8]]) and gate.kept_rate == 1.0  # settled early at 1: 1 + 1 > 1.5

    gate = SpeculationGate(weight=1.0)
    gate.speculate(["a", "b"], [[1, 2], [3, 4]])
    gate.record(["a", "b"], [[7], [3, 4]], None, speculative=False)  # a missed at once; b matched both
    assert gate.kept_rate == 2.0  # b last (weight 1: the latest observation)
    gate.speculate(["b"], [[1]])  # a left the batch: its shadow is dropped
    assert not gate.speculate(["b"], [[]]) and gate.said_yes == 1


def test_the_gate_declines_drafts_that_do_not_pay_for_the_step():
    """The decision: (B + m a) * t_plain > B * t_spec, with measured step times (the first of each kind and
    batch size and untimed steps left out) or the prior ratio."""
    gate = SpeculationGate(prior_ratio=1.5, weight=1.0)
    gate.speculate(["a"], [[1]])
    gate.record(["a"], [[2]], None, speculative=False)
    assert gate.kept_rate == 0.0 and not gate.speculate(["a"], [[1]])  # never right: plain
    gate.kept_rate = 0.6
    assert gate.ratio(1, 1) == 1.5 and gate.speculate(["a"], [[1]])  # 1.6 > 1.5
    for seconds in (9.0, 1.0, 1.0):  # the first plain step is left out
        gate.record(["a"], [[4]], seconds, speculative=False)
    gate.record(["a"], [[4, 5]], 0.5, speculative=True, accepted=0)  # the first speculative step is left out
    gate.kept_rate = 0.6
    gate.record(["a"], [[4, 5]], 1.8, speculative=True, accepted=0)
    gate.kept_rate = 0.6
    gate.record(["a"], [[4, 5]], None, speculative=True, accepted=0)  # untimed: a capture
    assert gate.ratio(1, 1) == pytest.approx(1.8) and gate.ratio(2, 1) == 1.5  # batch sizes apart
    gate.kept_rate = 0.6
    assert not gate.speculate(["a"], [[1]])  # 1.6 < 1.8
    gate.kept_rate = 0.9
    assert gate.speculate(["a"], [[1]])
    # a batch of 4 where one sequence has drafts: 4 + 0.9 tokens against 4 x 1.5
    assert not gate.speculate(["a", "b", "c", "d"], [[1], [], [], []])
    assert gate.speculate(["a", "b", "c", "d"], [[1], [2], [3], [4]])  # 4 + 3.6 > 6
    with pytest.raises(ValueError, match="prior_ratio"):
        SpeculationGate(prior_ratio=0.5)
    with pytest.raises(ValueError, match="weight"):
        SpeculationGate(weight=0.0)
    with pytest.raises(ValueError, match="probe_every"):
        SpeculationGate(probe_every=0)


def test_the_prior_cost_grows_with_the_drafts():
    """Before a speculative step is timed the gate assumes t_spec / t_plain = 1 + 0.06 K (K drafts per sequence,
    as measured on an H100): drafts kept 0.44 per step pay at K = 4 (1.24) but not at K = 8 (1.48); once both
    times are measured they decide."""
    gate = SpeculationGate(weight=1.0)
    assert gate.prior(4) == pytest.approx(1.24) and gate.prior(8) == pytest.approx(1.48)
    gate.kept_rate = 0.44
    assert gate.speculate(["a"], [[1, 2, 3, 4]])
    assert not gate.speculate(["a"], [[1, 2, 3, 4, 5, 6, 7, 8]])
    assert gate.speculate(["a", "b"], [[1, 2, 3, 4], []]) is False  # 2 + 0.44 < 2 x 1.24
    for seconds in (1.0, 1.0, 1.0):
        gate.record(["a"], [[1]], seconds, speculative=False)
    for seconds in (1.6, 1.6):  # the first is left out
        gate.record(["a"], [[1, 2]], seconds, speculative=True, accepted=0)
    gate.kept_rate = 0.44
    assert gate.ratio(1, 4) == pytest.approx(1.6) and not gate.speculate(["a"], [[1, 2, 3, 4]])
    with pytest.raises(ValueError, match="prior_ratio"):
        SpeculationGate(prior_ratio=0.9)


def test_the_gate_times_steps_by_their_median_and_probes_a_cost_measured_high():
    """A step time is the median of the recent ones (one slow step on a busy host does not move it); where only
    the measured cost says no, every probe_every-th such step speculates, and a lower cost measured then opens
    the gate again."""
    gate = SpeculationGate(prior_ratio=1.5, weight=1.0, probe_every=4)
    for seconds in (5.0, 1.0, 1.0, 1.1):
        gate.record(["a"], [[1]], seconds, speculative=False)
    for seconds in (5.0, 1.2, 1.2, 60.0):
        gate.record(["a"], [[1, 2]], seconds, speculative=True, accepted=0)
    assert gate.step_s(1, False) == 1.0 and gate.ratio(1, 1) == pytest.approx(1.2)
    for seconds in (3.0, 3.0, 3.0):
        gate.record(["a"], [[1, 2]], seconds, speculative=True, accepted=0)
    assert gate.ratio(1, 1) == pytest.approx(3.0)  # now most recent steps were slow: 1 + 1 < 3
    gate.kept_rate = 1.0
    said = [gate.speculate(["a"], [[1]]) for _ in range(8)]
    assert said == [False, False, False, True] * 2  # 1 + 1 > 1.5 (the prior): probed every 4th
    for _ in range(5):
        gate.record(["a"], [[1, 2]], 1.1, speculative=True, accepted=1)
    assert gate.ratio(1, 1) == pytest.approx(1.1) and gate.speculate(["a"], [[1]])
    gate.kept_rate = 0.1  # 1.1 < 1.5: the kept rate says no, no probe
    assert not any(gate.speculate(["a"], [[1]]) for _ in range(8))


def test_adaptive_is_read_from_the_json_config():
    assert SpeculativeConfig.parse('{"num_speculative_tokens": 3, "adaptive": true}').adaptive
    assert not SpeculativeConfig.parse('{"num_speculative_tokens": 3}').adaptive
    with pytest.raises(ValueError, match="adaptive must be true or false"):
        SpeculativeConfig.parse('{"num_speculative_tokens": 3, "adaptive": "yes"}')
    assert "adaptive" in SpeculativeConfig(adaptive=True).describe()


# ------------------------------------------------------------------------------------------ gate in the engines

def steady_gates(monkeypatch) -> None:
    """The engines' gates keep the prior cost ratio whatever the steps took on this (maybe busy) host, so the
    tests' decisions depend on the kept drafts only; the step times are still recorded (checked below)."""
    import importlib

    for name in ("openm3.engine.batching", "openm3.engine.generate"):
        module = importlib.import_module(name)
        monkeypatch.setattr(module, "SpeculationGate", lambda: SpeculationGate(use_times=False))


def _scripted(monkeypatch, answers: dict[tuple, list[int]], right: bool):
    """Drafts from the known greedy answers: each sequence's next answer tokens (right), or each of them plus
    one (never right)."""
    def drafts(tokens, k, config):
        for prompt, answer in answers.items():
            if tuple(tokens[:len(prompt)].tolist()) == prompt:
                done = len(tokens) - len(prompt)
                d = answer[done:done + k] + [7] * max(0, k - len(answer[done:]))
                return d if right else [(t + 1) % 97 for t in d]
        return []

    monkeypatch.setattr(speculative, "ngram_drafts", drafts)


@pytest.mark.parametrize("right", [True, False], ids=["right", "wrong"])
def test_generate_adaptive_speculates_only_on_drafts_that_are_right(model, monkeypatch, right):
    """Right drafts: after the first plain steps (whose shadows show them right) every step speculates; drafts
    that are never right: no speculative step at all. The greedy tokens are plain decoding's in both."""
    steady_gates(monkeypatch)
    prompts = _prompts(model, [70, 23])
    plain, _ = generate(model, prompts, max_new_tokens=30)
    _scripted(monkeypatch, {tuple(p): r.tokens for p, r in zip(prompts, plain)}, right)
    got, stats = generate(model, prompts, max_new_tokens=30,
                          speculative=SpeculativeConfig(num_speculative_tokens=4, adaptive=True))
    assert [r.tokens for r in got] == [r.tokens for r in plain]
    if right:
        assert stats.spec_steps >= stats.decode_steps - 2 and stats.decode_steps <= 10
    else:
        assert stats.spec_steps == 0 and stats.decode_steps == 29
    assert "speculation gate" in stats.summary()


@pytest.mark.parametrize("right", [True, False], ids=["right", "wrong"])
def test_batched_generator_adaptive_speculates_only_on_drafts_that_are_right(model, monkeypatch, right):
    steady_gates(monkeypatch)
    prompts = _prompts(model, [40, 9])
    plain = [generate(model, [p], max_new_tokens=20)[0][0].tokens for p in prompts]
    _scripted(monkeypatch, {tuple(p): a for p, a in zip(prompts, plain)}, right)
    gen = BatchedGenerator(model, token_budget=1024, max_batch=2, chunk_size=64,
                           speculative=SpeculativeConfig(num_speculative_tokens=3, adaptive=True))
    for prompt, want in zip(prompts, plain):
        out = []
        assert gen(prompt, max_new_tokens=20, on_token=out.append) == "length"
        assert out == want
    metrics = {name: value for name, _, _, value in gen.metrics()}
    if right:
        assert gen.spec_steps >= gen.steps - 4 and gen.steps <= 16
    else:
        assert gen.spec_steps == 0 and metrics["spec_decode_gate_declined_total"] >= 30
    assert gen.gate.step_s(1, right) is not None  # the engine times its steps for the gate
    gen.close()
