"""Constrained decoding (`openm3.engine.constrained`): each pick is the sampler's choice over the logits with every
token the grammar refuses masked out, checked against a brute-force mask of the whole vocabulary: the same
tokens for greedy, top-k and top-p (same generator, same draws), the same distribution for temperature alone
(Gumbel-max, counted); stop tokens only at a whole document; a reasoning block before the grammar; the token
bytes of the trained tokenizer."""

from __future__ import annotations

import math

import pytest
import torch

from openm3.data.tokenizer import THINK_END, THINK_START, TokenizerSettings, get_tokenizer
from openm3.engine.constrained import GrammarConstraint, GrammarDeadEnd, TokenBytes, TransitionCache, draw
from openm3.engine.regex_grammar import RegexGrammar
from openm3.engine.sampling import SamplingParams, filter_logits

EOS, T0, T1 = 0, 1, 2  # the toy vocabulary's special tokens: end, think start, think end
PIECES = [None, None, None, b"0", b"1", b"12", b"a", b"3a", b"45", b"6", b" ", b"789", b"9", b"x9", b"00000"]


class Digits:
    """A toy grammar: 1 to `most` ASCII digits. State: how many were read."""

    def __init__(self, most: int):
        self.most, self.start = most, 0

    def advance(self, state: int, data: bytes) -> int | None:
        n = state + len(data)
        return n if data.isdigit() and n <= self.most else None

    def complete(self, state: int) -> bool:
        return state >= 1

    def can_continue(self, state: int) -> bool:
        return state < self.most


def constraint(most: int = 5, think: bool = False, lazy_checks: int = 512) -> GrammarConstraint:
    return GrammarConstraint(TransitionCache(Digits(most), TokenBytes(PIECES)), [EOS],
                             think=(T1 - 1, T1) if think else None, lazy_checks=lazy_checks)


def brute_mask(c: GrammarConstraint) -> torch.Tensor:
    """bool [V]: every token checked against the grammar."""
    ok = torch.zeros(len(PIECES), dtype=torch.bool)
    for t, piece in enumerate(PIECES):
        if t == EOS:
            ok[t] = c.grammar.complete(c.state)
        elif piece is not None:
            ok[t] = c.grammar.advance(c.state, piece) is not None
    return ok


def oracle_pick(masked: torch.Tensor, sampling: SamplingParams, gen: torch.Generator, min_p: float = 0.0) -> int:
    """The pick from a row with every refused token masked: argmax, or `draw` over the whole row (min_p: the
    allowed tokens below the best one's logit + temperature x log(min_p) masked too, as vLLM does after a
    grammar's mask)."""
    if sampling.greedy:
        return int(masked.argmax())
    if min_p:
        masked = masked.masked_fill(masked < masked.max() + sampling.temperature * math.log(min_p), float("-inf"))
    return draw(masked, sampling, gen)


def test_draw_samples_the_filtered_distribution():
    """(And under top-k, rows beyond the k most likely change nothing; under top-p that takes the settled nucleus
    of `GrammarConstraint`, tested by the picks below.)"""
    row = torch.randn(40, generator=torch.Generator().manual_seed(0)) * 2
    for sampling in (SamplingParams(0.9, top_p=0.8), SamplingParams(1.2, top_k=5)):
        want = filter_logits(row[None], sampling).softmax(-1)[0]
        gen = torch.Generator().manual_seed(1)
        counts = torch.bincount(torch.tensor([draw(row, sampling, gen) for _ in range(20_000)]), minlength=40)
        assert (counts / 20_000 - want).abs().sum() < 0.03
        if not sampling.top_k:
            continue
        top = row.argsort(descending=True)[:sampling.top_k + 3]  # the filtered set and a few more
        for seed in range(50):
            a = draw(row, sampling, torch.Generator().manual_seed(seed))
            b = int(top[draw(row[top], sampling, torch.Generator().manual_seed(seed))])
            assert a == b


MODES = {"greedy": SamplingParams(), "top_k-3": SamplingParams(0.9, top_k=3),
         "top_p-0.7": SamplingParams(1.3, top_p=0.7), "top_k-top_p": SamplingParams(0.7, top_p=0.8, top_k=4),
         "top_k-min_p": (SamplingParams(0.9, top_k=4), 0.2), "top_p-min_p": (SamplingParams(1.3, top_p=0.95), 0.2),
         "greedy-min_p": (SamplingParams(), 0.5)}


def mode_of(name: str) -> tuple[SamplingParams, float]:
    """(sampling, min_p) of a MODES entry."""
    return MODES[name] if isinstance(MODES[name], tuple) else (MODES[name], 0.0)


@pytest.mark.parametrize("lazy_checks", [512, 1], ids=["lazy", "full-mask"])
@pytest.mark.parametrize("mode", list(MODES))
def test_picks_equal_sampling_from_the_brute_force_mask(mode, lazy_checks):
    sampling, min_p = mode_of(mode)
    full_masks, below = 0, 0
    for trial in range(150):
        c = constraint(most=5, lazy_checks=lazy_checks)
        gen_a, gen_b = torch.Generator().manual_seed(trial), torch.Generator().manual_seed(trial)
        logits = torch.randn(8, len(PIECES), generator=torch.Generator().manual_seed(1000 + trial)) * 3
        for step in range(8):
            masked = logits[step].masked_fill(~brute_mask(c), float("-inf"))
            want = oracle_pick(masked, sampling, gen_b, min_p)
            if min_p and not sampling.greedy:  # how often min_p leaves out a token top-k / top-p would keep
                plain = oracle_pick(masked, sampling, torch.Generator().manual_seed(trial * 8 + step))
                floor = float(masked.max()) + sampling.temperature * math.log(min_p)
                below += float(masked[plain]) < floor
            got = c.pick(logits[step], sampling, gen_a, min_p=min_p)
            assert got == want, (trial, step)
            if got == EOS:
                break
        assert c.complete or got != EOS
        full_masks += c.full_masks
    assert (full_masks > 20) if lazy_checks == 1 else full_masks == 0  # which path decided the picks
    assert below > 10 or not min_p or sampling.greedy  # min_p changed what would have been drawn


@pytest.mark.parametrize("min_p", [0.0, 0.3], ids=["plain", "min_p"])
@pytest.mark.parametrize("lazy_checks", [512, 1], ids=["lazy", "full-mask"])
def test_temperature_alone_samples_the_masked_distribution(lazy_checks, min_p):
    sampling = SamplingParams(0.8)
    logits = torch.randn(len(PIECES), generator=torch.Generator().manual_seed(3)) * 2
    c = constraint(most=5, lazy_checks=lazy_checks)
    c.state = 3  # two more digits at most: '45', '0', '1', '12', '6', '9' and the end are allowed
    masked = logits.masked_fill(~brute_mask(c), float("-inf"))
    if min_p:
        masked = masked.masked_fill(masked < masked.max() + sampling.temperature * math.log(min_p), float("-inf"))
        assert 1 < int((masked > float("-inf")).sum()) < int(brute_mask(c).sum())  # it leaves some out
    want = filter_logits(masked[None], sampling).softmax(-1)[0]
    gen, draws = torch.Generator().manual_seed(0), 20_000
    counts = torch.zeros(len(PIECES))
    for _ in range(draws):
        c.state = 3
        counts[c.pick(logits, sampling, gen, min_p=min_p)] += 1
    assert (counts / draws - want).abs().sum() < 0.03  # total variation
    assert counts[brute_mask(c) == 0].sum() == 0 or c.state != 3


def test_the_end_comes_only_with_a_whole_document_and_then_must_come():
    logits = torch.zeros(len(PIECES))
    logits[EOS] = 50.0  # the model wants to stop at once
    c = constraint(most=3)
    assert c.pick(logits, SamplingParams()) != EOS  # nothing read yet: not a document
    logits = torch.zeros(len(PIECES))
    logits[PIECES.index(b"12")] = 50.0  # then wants more digits than allowed
    tokens = [c.pick(logits, SamplingParams()) for _ in range(3)]
    assert c.grammar.complete(c.state) and tokens[-1] == EOS


def test_a_reasoning_block_comes_before_the_grammar():
    sampling = SamplingParams()
    c = constraint(think=True)
    want = [T0, PIECES.index(b"a"), T1, PIECES.index(b"6")]  # 'a' is free text inside the block
    picks = []
    for token in want:
        logits = torch.zeros(len(PIECES))
        logits[token] = 10.0
        picks.append(c.pick(logits, sampling))
    assert picks == want and c.state == 1
    c = constraint(think=True)
    logits = torch.zeros(len(PIECES))
    logits[PIECES.index(b"a")] = 10.0  # outside the block 'a' is refused
    assert c.pick(logits, sampling) != PIECES.index(b"a")


def test_a_reasoning_block_cannot_end_the_output_before_the_answer():
    """A stop token is refused inside the think block while the grammar owes a document (a forced tool call must
    come), for every sampler; a grammar that takes an empty document lets a stop end the block."""
    for sampling, min_p in [(SamplingParams(), 0.0), (SamplingParams(temperature=1.0), 0.0),
                            (SamplingParams(temperature=1.0, top_k=2), 0.5)]:
        c = constraint(think=True)
        logits = torch.zeros(len(PIECES))
        logits[T0] = 10.0
        assert c.pick(logits, sampling) == T0
        gen = torch.Generator().manual_seed(0)
        for _ in range(20):
            logits = torch.zeros(len(PIECES))
            logits[EOS], logits[PIECES.index(b"a")] = 30.0, 5.0  # the model wants to stop in the block
            assert c.pick(logits, sampling, gen, min_p=min_p) != EOS
        assert c.phase == "thinking"

    class Optional(Digits):
        def complete(self, state: int) -> bool:
            return True

    c = GrammarConstraint(TransitionCache(Optional(3), TokenBytes(PIECES)), [EOS], think=(T0, T1), thinking=True)
    logits = torch.zeros(len(PIECES))
    logits[EOS] = 30.0
    assert c.pick(logits, SamplingParams()) == EOS


class Bracketed:
    """A toy grammar: `[`, 1 to 3 digits, `]`. State: None before `[`, then the digits read, then "done"."""

    start = "open"

    def advance(self, state, data: bytes):
        for b in data:
            if state == "open":
                state = 0 if b == ord("[") else None
            elif isinstance(state, int) and chr(b).isdigit() and state < 3:
                state += 1
            elif isinstance(state, int) and b == ord("]") and state >= 1:
                state = "done"
            else:
                return None
        return state

    def complete(self, state) -> bool:
        return state == "done"

    def can_continue(self, state) -> bool:
        return state != "done"


def test_a_trigger_token_opens_the_grammar_each_time_and_text_around_is_free():
    """With `trigger` the text is free (stops too) until the trigger is sampled; from it the grammar holds (no stop,
    refused tokens masked) until its document is whole; then free again, and the next trigger opens it anew."""
    pieces = [None, None, None, b"[", b"]", b"1", b"12", b"a", b" "]
    ids = {p: t for t, p in enumerate(pieces)}
    c = GrammarConstraint(TransitionCache(Bracketed(), TokenBytes(pieces)), [EOS], think=(T0, T1),
                          trigger=ids[b"["])
    sampling = SamplingParams()

    def pick(*wanted: int) -> int:  # the model's preferences, most wanted first
        logits = torch.zeros(len(pieces))
        for rank, token in enumerate(wanted):
            logits[token] = 50.0 - rank
        return c.pick(logits, sampling)

    assert pick(ids[b"a"]) == ids[b"a"] and c.phase == "free" and c.complete
    assert pick(T0) == T0 and pick(ids[b"["]) == ids[b"["] and c.phase == "thinking"  # reasoning: no grammar
    assert pick(T1) == T1 and c.phase == "free"
    for _ in range(2):  # two calls, text between them
        assert pick(ids[b"["]) == ids[b"["] and c.phase == "grammar" and not c.complete
        assert pick(EOS, ids[b"a"], ids[b"]"], ids[b"12"]) == ids[b"12"]  # no stop, no text, no empty call
        assert pick(ids[b"12"], ids[b"]"]) == ids[b"]"]  # a fourth digit is refused
        assert c.phase == "free" and c.complete
        assert pick(ids[b" "]) == ids[b" "]
    assert pick(EOS) == EOS  # outside a call a stop ends the output
    with pytest.raises(ValueError, match="does not begin with token"):
        GrammarConstraint(TransitionCache(Bracketed(), TokenBytes(pieces)), [EOS], trigger=ids[b"a"]).pick(
            torch.nn.functional.one_hot(torch.tensor(ids[b"a"]), len(pieces)).float() * 50, sampling)


def test_a_constraint_needs_a_stop_token():
    with pytest.raises(ValueError, match="stop_tokens"):
        GrammarConstraint(TransitionCache(Digits(2), TokenBytes(PIECES)), [])


def test_no_token_left_ends_a_whole_document_else_is_a_grammar_dead_end():
    """When no allowed token has a finite logit, a whole document ends on the stop token (min_tokens held it back:
    -inf); otherwise `GrammarDeadEnd` names the constraint's field and why: the grammar's own dead end (the
    automaton's where no token holds its character, the `regex` package's after a start no match continues; they
    behave the same) or the logits' (every token it allows at -inf: allowed_token_ids)."""
    vocab, greedy = TokenBytes(PIECES), SamplingParams()
    flat = torch.zeros(len(PIECES))
    c = GrammarConstraint(TransitionCache(Digits(1), vocab), [EOS])
    assert c.pick(flat.index_fill(0, torch.tensor([3]), 1.0), greedy) == 3
    assert c.pick(flat.index_fill(0, torch.tensor([EOS]), float("-inf")), greedy) == EOS  # min_tokens gives way
    for pattern in ("é", "(?=é)é"):  # no token writes é: the automaton's dead end, and the `regex` package's
        c = GrammarConstraint(TransitionCache(RegexGrammar(pattern), vocab), [EOS], field="guided_regex")
        with pytest.raises(GrammarDeadEnd, match="^guided_regex: the answer cannot be finished: no token continues"):
            c.pick(flat, greedy)
    c = GrammarConstraint(TransitionCache(RegexGrammar("a(?=b)"), vocab), [EOS], field="f")
    assert c.pick(flat, greedy) == PIECES.index(b"a")  # a start no match continues
    with pytest.raises(GrammarDeadEnd, match="no token continues the text so far") as caught:
        c.pick(flat, greedy)
    assert caught.value.field == "f" and isinstance(caught.value, RuntimeError)
    digits_out = flat.masked_fill(torch.tensor([p is not None and p.isdigit() for p in PIECES]), float("-inf"))
    c = GrammarConstraint(TransitionCache(RegexGrammar("[0-9]+"), vocab), [EOS])
    with pytest.raises(GrammarDeadEnd, match="^constrained decoding: .* logit of -inf"):
        c.pick(digits_out, greedy)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return get_tokenizer(TokenizerSettings(vocab_size=1024, chars_per_corpus=150_000), tmp_path_factory.mktemp("tok"))


SCHEMA = {"type": "object", "required": ["name", "n"], "additionalProperties": False,
          "properties": {"name": {"type": "string"}, "n": {"type": "integer"}, "kind": {"enum": ["a", "bc"]},
                         "notes": {"type": "array", "items": {"type": "string", "maxLength": 6}}}}


@pytest.mark.parametrize("lazy_checks", [512, 4], ids=["lazy", "full-mask"])
@pytest.mark.parametrize("mode", list(MODES))
def test_json_picks_over_a_real_vocabulary_equal_the_brute_force_mask(tok, mode, lazy_checks):
    """The JSON grammar over the trained tokenizer's 1,024 tokens (plain-text tokens inside strings taken
    without checks): every pick equals sampling from a mask that checks each token."""
    from openm3.engine.json_grammar import compile_schema

    vocab, (sampling, min_p) = TokenBytes.from_tokenizer(tok), mode_of(mode)
    transitions = TransitionCache(compile_schema(SCHEMA, max_whitespace=2), vocab)
    plain_steps = 0
    for trial in range(6):
        c = GrammarConstraint(transitions, [tok.eos_id], lazy_checks=lazy_checks)
        gen_a, gen_b = torch.Generator().manual_seed(trial), torch.Generator().manual_seed(trial)
        noise = torch.Generator().manual_seed(100 + trial)
        for _ in range(40):
            logits = torch.randn(len(vocab), generator=noise) * 4
            grammar = c.grammar
            ok = torch.tensor([(t == tok.eos_id and grammar.complete(c.state)) or
                               (p is not None and grammar.advance(c.state, p) is not None)
                               for t, p in enumerate(vocab.pieces)])
            plain_steps += transitions.takes_plain_text(c.state)
            want = oracle_pick(logits.masked_fill(~ok, float("-inf")), sampling, gen_b, min_p)
            assert c.pick(logits, sampling, gen_a, min_p=min_p) == want
            if want == tok.eos_id:
                break
    assert plain_steps > 5


def test_token_bytes_of_the_trained_tokenizer(tok):
    vocab = TokenBytes.from_tokenizer(tok)
    assert len(vocab) == tok.vocab_size
    assert all(vocab.pieces[tok.token_id(s)] is None for s in (THINK_START, THINK_END))
    assert vocab.pieces[tok.eos_id] is None and int(vocab.first_byte[tok.eos_id]) == 256
    text = 'def f(x):\n    return {"naïve": [1, 2.5e-3, null], "€": "\\u00e9"}  # 😀\t'
    ids = tok.encode(text)
    assert b"".join(vocab.pieces[t] for t in ids) == text.encode("utf-8")
    assert all(p is None or max(p) < 0xF8 for p in vocab.pieces)  # no token can write a marker byte...
    start = tok.token_id("<minimax:tool_call>")
    marked = TokenBytes.from_tokenizer(tok, markers={start: b"\xff\x01"})
    assert marked.pieces[start] == b"\xff\x01" and int(marked.first_byte[start]) == 0xFF  # ...but its own token


def test_choice_grammar():
    from openm3.engine.constrained import ChoiceGrammar

    g = ChoiceGrammar(["yes", "no", "no way"])
    s = g.advance(g.start, b"no")
    assert g.complete(s) and g.can_continue(s) and g.advance(s, b" w") == b"no w"
    assert g.advance(g.start, b"ye") == b"ye" and not g.complete(b"ye") and g.advance(b"ye", b"p") is None
    assert not g.can_continue(b"yes")
    with pytest.raises(ValueError, match="choices"):
        ChoiceGrammar(["a", ""])


def test_long_choices_take_little_memory():
    """The choices are searched sorted, not through a table of every prefix (quadratic in their length: a choice
    of 100,000 characters once took gigabytes); prefixes, ends and what may follow come out as before."""
    import tracemalloc

    from openm3.engine.constrained import ChoiceGrammar

    long = "é" * 50_000
    tracemalloc.start()
    try:
        g = ChoiceGrammar([long, long + "!", "ab", "a\xff"])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 5_000_000, peak
    half = g.advance(g.start, long.encode()[:30_001])
    assert half is not None and g.can_continue(half) and not g.complete(half)
    whole = g.advance(half, long.encode()[30_001:])
    assert g.complete(whole) and g.can_continue(whole) and g.complete(g.advance(whole, b"!"))
    assert g.advance(whole, b"?") is None and not g.can_continue(whole + b"!")
    assert g.advance(g.start, b"a") == b"a" and g.can_continue(b"a") and not g.complete(b"a")
    assert g.complete(g.advance(b"a", "\xff".encode())) and g.advance(g.start, b"b") is None


TWIN_DOCS = ['{"naïve": ["a\\"b", {"k\\u00e9y": "v €", "": 1}], "k2": "x\\\\y", "n": "😀"}',
             '{"name": "a\\nb", "n": 3, "extra": {"deep": ["s", "t\\"u"]}, "kind": "bc"}']
TWIN_SCHEMA = {"type": "object", "required": ["name"],
               "properties": {"name": {"type": "string", "maxLength": 5}, "n": {"type": "integer"}},
               "additionalProperties": {"type": ["string", "object", "array", "integer"]}}
# keys closed into: a forbidden name, a declared one, a required one falling to additionalProperties, a limit
CLOSE_SCHEMA = {"type": "object", "required": ["k", "must"], "maxProperties": 4,
                "properties": {"bad": False, "n": {"type": "integer"}, "k": {"type": "string"}},
                "additionalProperties": {"type": ["string", "integer", "object"]}}
CLOSE_DOCS = ['{"k": "a\\"b", "n": 1, "must": "y", "x": {"ki": 2, "k": "z"}}',
              '{"kk": 1, "k": "\\u00e9", "must": {"must": "m", "mu": 3}, "n": 2}']
# tokens that close a key or string: into names seen before, declared, required or forbidden, then what may follow
CLOSING = [b'k":', b'k": "', b'k" : 1', b'i": 2', b'ust": "', b'ad":', b'bad": 1', b'": 1}', b'":{"', b'": [',
           b'" :', b'":  ', b'",', b'"]', b'", ', b'"  ,', b'":1,', b'xtra": {"', b'ind"', b'ame": "', b'2":', b'"',
           b'k2"}', b'e":{}}']


@pytest.mark.parametrize("schema,docs", [(None, TWIN_DOCS), (TWIN_SCHEMA, TWIN_DOCS[1:]), (CLOSE_SCHEMA, CLOSE_DOCS),
                                         (None, CLOSE_DOCS)], ids=["json_object", "schema", "closing", "closing-any"])
def test_full_masks_through_quote_free_twins_equal_the_brute_force_mask(tok, schema, docs):
    """Inside strings and any-string keys the tokens without a `"` take a twin state's shared mask, and the tokens
    that close the string (plain text, `"`, no other `"`) the mask of what may follow the quote: at every byte of
    documents with escapes, multi-byte characters, nested and repeated keys, declared, required and forbidden
    names, the full mask equals checking each token (a vocabulary with quotes inside tokens added), also when the
    masks are evicted (max_masks 2); the twin refuses exactly the quote-free byte strings the state refuses, and
    `quote_close` answers for closing byte strings as it says."""
    from openm3.engine.json_grammar import compile_schema

    extra = [b'a"', b'":', b'\\"', b'"}', b'x":{"', b'", "', b'e"]', b'\xc3', b'\xa9"', b'\\u00', b'\\\\', b'\n"']
    vocab = TokenBytes([*TokenBytes.from_tokenizer(tok).pieces, *extra, *CLOSING])
    grammar = compile_schema(schema, max_whitespace=2)
    transitions = TransitionCache(grammar, vocab, max_masks=2)
    probes = [b"a", b"\\", b"\\u", b"\\u00e9", b"\xc3", b"\xa9", b"\n", b"\xe2\x82", b"ab c", b"\\n}"]
    twins = closes = 0
    for doc in docs:
        data = doc.encode()
        state = grammar.start
        for i in range(len(data)):
            twin = grammar.quote_free_twin(state)
            close = grammar.quote_close(state)
            if twin is not None:
                twins += 1
                for probe in probes:
                    assert (grammar.advance(state, probe) is None) == (grammar.advance(twin, probe) is None)
            if close is not None:
                closes += 1
                after, tails = close
                for piece in CLOSING:
                    head, _, tail = piece.partition(b'"')
                    if head not in tails and b'"' not in tail:
                        assert (grammar.advance(state, piece) is None) == \
                            (after is None or grammar.advance(after, tail) is None), (doc, i, piece)
            if twin is not None and (close is not None or i % 3 == 0):  # walks of the 1K vocabulary
                want = torch.tensor([p is not None and grammar.advance(state, p) is not None for p in vocab.pieces])
                assert torch.equal(transitions.full_mask(state), want), (doc, i)
            state = grammar.advance(state, data[i:i + 1])
            assert state is not None, (doc, i)
    assert twins > 15 * len(docs) and transitions._twin_masks and closes > 10 * len(docs)


PATTERN_SCHEMA = {"type": "object", "additionalProperties": False, "properties": {
    "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}$"},
    "word": {"type": "string", "pattern": "^[a-zé日]+$"},
    "esc": {"type": "string", "pattern": "^\\t?[😀\\\\x]*$"}, "free": {"type": "string"},
    "ci": {"type": "string", "pattern": "(?i)^[a-cé]+$"},  # a flag the automaton follows
    "la": {"type": "string", "pattern": "^(?=a)[a-c]+$"},  # lookahead, outside the automaton: the regex package
    "short": {"type": "string", "pattern": "é|日", "minLength": 2, "maxLength": 3},  # with lengths: automaton
    "long": {"type": "string", "pattern": "^[a-zé]+$", "minLength": 3, "maxLength": 300}}}  # length twins
ANY_KEY_PATTERN = {"type": "object", "additionalProperties": {"type": "string", "pattern": "^[a-zé日]+$"}}
PATTERN_DOCS = ['{"date": "2024-06", "word": "abé日", "esc": "\\t😀\\\\x", "free": "é", "ci": "aÉB", "la": "ab",'
                ' "short": "a日b", "long": "abcdefghijéklmnopqrstuvwxyzabcdefghij"}',
                '{"word": "\\u00e9t\\u00e9", "esc": "\\ud83d\\ude00x", "short": "\\u00e9x"}']


def test_length_twins_share_masks_and_check_the_long_tokens(tok):
    """A bounded pattern string's positions past its minimum take a shared twin's mask for the tokens of at most
    `room` bytes (`length_twin`) and check the longer ones themselves: at every position up to the maximum the full
    mask equals checking each token, with letter runs of every length among the tokens (a room that forgets the
    five characters a match still needs lets a run take them)."""
    from openm3.engine.json_grammar import compile_schema

    base = TokenBytes.from_tokenizer(tok).pieces
    longest = max(len(p) for p in base if p)
    vocab = TokenBytes([*base, *(b"ab" * n for n in range(1, longest // 2 + 1)), b"abc" * 3])  # long letter runs
    most = longest + 14
    grammar = compile_schema({"type": "string", "pattern": "^[a-z]+x{5}$", "minLength": 6, "maxLength": most})
    transitions = TransitionCache(grammar, vocab)
    state, rooms = grammar.advance(grammar.start, b'"'), []
    for k in range(most):
        want = torch.tensor([p is not None and grammar.advance(state, p) is not None for p in vocab.pieces])
        assert torch.equal(transitions.full_mask(state), want), k
        found = grammar.length_twin(state)
        rooms.append(None if found is None else found[1])
        state = grammar.advance(state, b"a" if k < most - 5 else b"x")
    assert grammar.complete(grammar.advance(state, b'"'))
    assert rooms[:6] == [None] * 6 and rooms[6] >= longest and rooms[-1] is None
    room = [r for r in rooms if r is not None]
    assert room == list(range(room[0], room[0] - len(room), -1))  # one byte less per character
    assert sum(key[1][2] is None for key in transitions._full) >= 1  # twins (hi None) served those positions


def test_full_masks_inside_pattern_strings_equal_the_brute_force_mask(tok):
    """Strings with a `pattern` are walked a byte per trie edge (a character or an escape per edge where the
    `regex` package searches them, `whole_characters_at`): at every byte of documents with multi-byte characters
    and escapes (every character of the `regex` package's strings), inside characters and escapes too, the full
    mask equals checking each token whole (a vocabulary with whole and split characters and escapes added), and a
    greedy pick takes a multi-byte token there."""
    from openm3.engine.json_grammar import _HSTR, _LSTR, _NSTR, _PSTR, compile_schema

    extra = ["é".encode(), "é".encode()[:1], "日".encode(), "日".encode()[:2], "😀".encode(), "😀".encode()[:3],
             b"\\t", b"\\", b"\\u00", b"\\u00e9", b"\\ud83d", b"\\ud83d\\ude00", b'\\\\x"', b'06"', "é\"".encode(),
             b"20", b"24-", b'abc"', "日é".encode(), b'": "2', '": "é'.encode(), '": "日本'.encode(),
             '": "aé'.encode()[:-1], b'ord": "a', b', "word": "', b'", "esc": "\\t',  # into a pattern string
             b"\\u", b"\\u00e", b"\\ud83d\\u", b"\\ude", b"00", b"\xa9", b"\xe6\x97", b"\x97\xa5"]
    vocab = TokenBytes([*TokenBytes.from_tokenizer(tok).pieces, *extra])
    checked, kinds, twins = 0, set(), 0
    for schema, doc in [(PATTERN_SCHEMA, d) for d in PATTERN_DOCS] + [(ANY_KEY_PATTERN, '{"k": "aé", "kk": "日"}')]:
        grammar = compile_schema(schema)
        transitions = TransitionCache(grammar, vocab)
        data, state, k = doc.encode(), grammar.start, 0
        between = getattr(grammar, "whole_characters_at", None)
        while k < len(data):
            whole = between is not None and between(state)
            step = grammar.character_length(data, k) if whole else 1
            if type(state) is tuple and state[0] in (_NSTR, _PSTR, _LSTR, _HSTR):
                kinds.add(state[0])
                twins += grammar.length_twin(state) is not None
            # every state, those whose tokens walk into a pattern string (closing a key first) included
            want = torch.tensor([p is not None and grammar.advance(state, p) is not None for p in vocab.pieces])
            assert torch.equal(transitions.full_mask(state), want), (doc, k)
            checked += 1
            state = grammar.advance(state, data[k:k + step])
            assert state is not None, (doc, k)
            k += step
        assert grammar.complete(state)
    assert checked > 20 and kinds == {_NSTR, _PSTR, _LSTR, _HSTR}  # automata (lengths, inside a character too)
    assert twins > 20  # positions of "long" that took a shared length twin's mask
    ids = {p: t for t, p in enumerate(vocab.pieces)}
    transitions = TransitionCache(compile_schema(PATTERN_SCHEMA), vocab)
    c = GrammarConstraint(transitions, [tok.eos_id])
    c.read(b'{"word": "a')
    row = torch.zeros(len(vocab))
    row[ids["日é".encode()]] = 5.0
    assert c.pick(row, SamplingParams()) == ids["日é".encode()]


@pytest.mark.parametrize("schema,doc", [
    ({"type": "string", "pattern": "^[中😀]+$"}, '"😀中"'),
    ({"type": "string", "pattern": "^[中😀]+$", "minLength": 2, "maxLength": 3}, '"中\\ud83d\\ude00\\u4E2D"'),
    ({"type": "object", "properties": {"k": {"type": "string", "pattern": "é|\\d"}}}, '{"k": "\\u0660\\u00e9é"}'),
], ids=["pattern", "lengths", "escapes"])
def test_pattern_string_characters_no_token_holds_are_written_through_byte_tokens(schema, doc):
    """A vocabulary whose only tokens are single bytes: greedy picks write a pattern string's characters, and
    escapes, byte by byte (a byte-level tokenizer splits rare characters and `\\uXXXX` escapes)."""
    from openm3.engine.json_grammar import compile_schema
    from test_regex_grammar import BYTES_ONLY, write

    write(TransitionCache(compile_schema(schema), TokenBytes(BYTES_ONLY)), doc.encode())


SPLIT_TEXT = "ab é中文 😀x 日本 \u212a ſé 中😀ab"
OTHER_TEXT = "Ωж中b 9€ 😃x 丁 ab"  # (tokens from it too: many refused)


@pytest.mark.parametrize("kind", ["regex-class", "regex-word", "lark", "json-pattern", "tool-text"])
def test_full_masks_with_tokens_cut_anywhere_equal_the_brute_force_mask(kind):
    """Tokens cut from multilingual text at random byte offsets (so they start and end inside characters) and
    every single byte: at every byte of a text, inside characters too, the full mask (a character per trie edge
    where a token holds it whole, its first bytes where it ends inside one) equals checking each token, and the
    first-byte mask lets through the first byte of every allowed token."""
    import random

    from openm3.engine.cfg_grammar import CfgGrammar
    from openm3.engine.json_grammar import compile_schema
    from openm3.engine.regex_grammar import RegexGrammar
    from openm3.engine.tool_grammar import START, ToolCallGrammar

    rng = random.Random(kind)
    data = SPLIT_TEXT.encode()
    pieces = {bytes((b,)) for b in range(0xF8)}
    for text in (data, OTHER_TEXT.encode()):
        for _ in range(2000):
            i = rng.randrange(len(text))
            pieces.add(text[i:i + rng.randint(1, 9)])
    vocab = TokenBytes(sorted(pieces))
    grammar, head = {
        "regex-class": (lambda: RegexGrammar("[a-zé中文日本😀 \u212aſ]+"), b""),
        "regex-word": (lambda: RegexGrammar("([\\w😀]+ )*[\\w😀]+"), b""),
        "lark": (lambda: CfgGrammar('start: item (" " item)*\nitem: /[a-zé中文日本\u212aſ]+/ | "😀x" | /中😀[a-z]+/'),
                 b""),
        "json-pattern": (lambda: compile_schema({"type": "string", "pattern": "(?i)^[a-zé中文日本😀 ſ]+$",
                                                 "maxLength": 40}), b'"'),
        "tool-text": (lambda: ToolCallGrammar([{"name": "t", "text_grammar": {"parameter": "q", "syntax": "regex",
                                                "definition": "[a-z é中文😀日本\u212aſ]+"},
                                                "parameters": {"type": "object", "properties": {"q": {}}}}], "t"),
                      START + b'\n<invoke name="t">\n<parameter name="q">'),
    }[kind]
    grammar = grammar()
    transitions = TransitionCache(grammar, vocab)
    state, checked = grammar.advance(grammar.start, head), 0
    for k in range(len(data) + 1):
        want = torch.tensor([p is not None and grammar.advance(state, p) is not None for p in vocab.pieces])
        assert torch.equal(transitions.full_mask(state), want), (kind, data[:k])
        firsts = transitions.first_bytes(state)
        assert bool(firsts[vocab.first_byte[want]].all()), (kind, data[:k])
        checked += int(want.sum())
        if k < len(data):
            state = grammar.advance(state, data[k:k + 1])
            assert state is not None, (kind, data[:k + 1])
    assert 1000 < checked < 0.8 * len(vocab) * (len(data) + 1)
