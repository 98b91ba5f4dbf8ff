"""Context-free output grammars (`openm3.engine.cfg_grammar`) against Lark's own Earley parser as the oracle:
every string over each grammar's characters up to a length is a sentence exactly when Lark parses it, every
prefix of a sentence is live, and every live prefix can be finished into a sentence Lark parses; GBNF grammars
against their Lark equivalents; constrained decoding and the server's `guided_grammar` write sentences; grammars
that cannot be followed are refused by name."""

from __future__ import annotations

import itertools
import random

import lark
import pytest
import torch

from openm3.engine.cfg_grammar import CfgGrammar

GRAMMARS = {  # name: (Lark text, the characters strings are drawn from, longest string tried exhaustively)
    "sum": ('start: expr\nexpr: NUMBER ("+" NUMBER)*\n%import common.NUMBER', "12.+e", 5),
    "sql": ('start: "SELECT " col " FROM t" [" WHERE " col "=" INT]\ncol: "a" | "b" | "ab"\n'
            '%import common.INT', None, 0),
    "nested": ('start: list\nlist: "[" [item ("," item)*] "]"\nitem: list | /[a-c]+/', "[],ab", 7),
    "optional": ('start: "x"? ("y" | "yz")+ "z"*', "xyz", 6),
    "ranges": ('start: ("a".."c")+ /[0-9]{2}/ | "q"', "abd09q", 5),
    "nocase": ('start: "Ab"i "c" | "x"i+', "aAbBcxX", 4),
    "regex_flags": ('start: /ab+/i "," /.c/s | /a b/x "c"', "aAbB\nc,", 5),
    "aliases_priorities": ('start: pair ("," pair)* -> pairs\n | "x" -> ex\npair: KEY "=" VAL\nKEY.2: /[ab]+/\n'
                           'VAL.-1: /[0-9]/', "ab1,=x", 5),
    "imports": ('start: WORD "=" NUM ("," INT)*\n%import common (WORD, INT)\n%import common.NUMBER -> NUM',
                "ab=1.,", 5),
    "extend_override": ('start: a\na: "x"\n%extend a: "y" | "z" a\n%override start: a a\nB: "b"\n'
                        '%extend B: "c"\n%extend start: B', "xyzbc", 5),
    "counted": ('start: "a" ~ 2 ("b" | "c") ~ 1..3 | "c" ~ 0..1', "abc", 6),
    "left_recursion": ('start: expr\nexpr: expr "+" term | term\nterm: term "*" factor | factor\n'
                       'factor: "a" | "(" expr ")"', "a+*()", 6),
    "indirect_left_recursion": ('start: a ";"\na: b "x" | "y"\nb: a "z" | "w" | b "v"', "xyzwv;", 6),
    "templates": ('start: _sep{item, ","} ";" pair{"x"}\n_sep{x, s}: x (s x)*\npair{v}: v v | _sep{v, "-"}\n'
                  'item: "a" | pair{"b"}', "ab,;x-", 6),
    "brackets": ('start: "a" ["b" ["c"]] "]" ["[" "x"]', "abc[]x", 6),
    "ignore": ('start: "(" item ("," item)* ")"\nitem: WORD | start\nWORD: "a".."b"+\n%ignore " "', "(),a ", 7),
    "ignore_ws": ('start: pair+\npair: KEY "=" VALUE ";"\nKEY: /[ab]+/\nVALUE: DIGIT+\n%import common.DIGIT\n'
                  '%import common.WS_INLINE\n%ignore WS_INLINE', "a=1; \t", 6),
}


def sentence(g: CfgGrammar, text: str) -> bool:
    state = g.advance(g.start, text.encode())
    return state is not None and g.complete(state)


def live(g: CfgGrammar, text: str) -> bool:
    return g.advance(g.start, text.encode()) is not None


def parses(parser: lark.Lark, text: str) -> bool:
    try:
        parser.parse(text)
    except lark.exceptions.LarkError:
        return False
    return True


def finish(g: CfgGrammar, text: str, alphabet: str, limit: int = 40) -> str | None:
    """Some sentence that starts with `text` (breadth first over `alphabet`, one text per distinct state), None
    within `limit` more characters."""
    frontier = {g.advance(g.start, text.encode()): text}
    for _ in range(limit + 1):
        for state, t in frontier.items():
            if g.complete(state):
                return t
        nxt = {}
        for state, t in frontier.items():
            for c in alphabet:
                after = g.advance(state, c.encode())
                if after is not None and after not in nxt:
                    nxt[after] = t + c
        frontier = nxt
    return None


def samples(g: CfgGrammar, alphabet: str, rng: random.Random, count: int = 60) -> list[str]:
    """Sentences from random walks that keep the text live and stop at random where it is a sentence."""
    out = []
    for _ in range(count * 5):
        text = ""
        for _ in range(30):
            if sentence(g, text) and rng.random() < 0.3:
                break
            options = [c for c in alphabet if live(g, text + c)]
            if not options:
                break
            text += rng.choice(options)
        if sentence(g, text):
            out.append(text)
        if len(out) == count:
            break
    return out


@pytest.mark.parametrize("name", GRAMMARS)
def test_sentences_and_prefixes_agree_with_lark(name):
    text, alphabet, longest = GRAMMARS[name]
    g, parser = CfgGrammar(text), lark.Lark(text, parser="earley", lexer="dynamic")
    alphabet = alphabet or "".join(sorted({c for c in text if c.isprintable() and c not in '"|:\n[]()'}))
    for n in range(longest + 1):
        for chars in itertools.product(alphabet, repeat=n):
            t = "".join(chars)
            assert sentence(g, t) == parses(parser, t), t
            if live(g, t):  # a live text can be finished into a sentence
                done = finish(g, t, alphabet)
                assert done is not None and parses(parser, done), (t, done)
    rng = random.Random(0)
    found = samples(g, alphabet, rng)
    assert len(found) >= 10
    for t in found:
        assert parses(parser, t), t
        assert all(live(g, t[:i]) for i in range(len(t))), t


def test_gbnf_grammars_match_their_lark_equivalents():
    pairs = [
        (r'''root ::= "[" ws ( item ( "," ws item )* )? "]"
             item ::= [a-c]+ | "\"" [^"]* "\""
             ws ::= [ ]*''',
         r'''start: "[" ws (item ("," ws item)*)? "]"
             item: /[a-c]+/ | "\"" /[^"]/* "\""
             ws: " "*''', '[]a, "'),
        (r'root ::= "a"{2,3} "b"? | "c"{2,}', 'start: "a" "a" "a"? "b"? | "c" "c" "c"*', "abc"),
        (r'root ::= "<" . . ">" | "x" .*', r'start: "<" /./s /./s ">" | "x" /./s*', "<>x\n"),
    ]
    for gbnf, equivalent, alphabet in pairs:
        g, parser = CfgGrammar(gbnf), lark.Lark(equivalent, parser="earley", lexer="dynamic")
        for n in range(7):
            for chars in itertools.product(alphabet, repeat=n):
                t = "".join(chars)
                assert sentence(g, t) == parses(parser, t), (gbnf, t)


def test_a_rule_that_is_its_own_alternative_adds_nothing():
    g = CfgGrammar('start: a\na: a | a "x" | "y" | b\nb: a "z"')
    for text, ok in [("y", True), ("yx", True), ("yzx", True), ("yzzx", True), ("x", False), ("", False)]:
        assert sentence(g, text) == ok, text
    g = CfgGrammar('start: a\na: a | "y"')  # (no other left recursion)
    assert sentence(g, "y") and not sentence(g, "yy")


def test_a_verbose_regex_may_end_in_a_comment():
    g = CfgGrammar('start: /a b  # the b/x "c" /d/xis')
    assert sentence(g, "abcd") and sentence(g, "abcD") and not sentence(g, "a bcd")


@pytest.mark.parametrize("text,match", [
    ('start: a\na: b a "x" | "y"\nb: "z"?', "rule 'a' is left-recursive behind a part that can be empty"),
    ('start: a\na: "x" a', "derive no text"),
    ('start: "a"\n%declare FOO', "%declare"),
    ('start: "a"\n%ignore WS', "not defined"),
    ('start: b', "not defined"),
    ('start: /a/m', "regex flag 'm'"),
    ('start: "a"\n%import common.FOO', "common"),
    ('rule: "a"', "start rule"),
    ('start: /a(?=b)/', "automaton lacks"),
    ('start: t{"a"}', "template 't' is used but not defined"),
    ('start: t{"a"}\nt{x, y}: x y', r"template 't' takes 2 arguments \(x, y\), got 1"),
    ('start: t{"a", }\nt{x, y}: x y', "takes 2 arguments"),
    ('start: t{"a"}\nt{x}: x t{x}', "more than 16 levels deep"),
    ('start: t{"a"}\nt{"x"}: "b"', "parameters must be names"),
    ('start: t{"a"}\nt{x}: x\nt{y}: y', "template 't' is defined twice"),
    ('start: "a" }', "unexpected '}'"),
    ('start: "a"\n%extend b: "c"', "no rule 'b' is defined to change"),
    ('start: WORD\n%import common (WORD INT)', "expected names separated by commas"),
    ('start: WORD\n%import common (WORD, ', "expected names separated by commas"),
    ('start: NUMBER\n%import common.NUMBER\n%import common.INT -> NUMBER', "rule 'NUMBER' is defined twice"),
])
def test_grammars_it_cannot_follow_are_refused(text, match):
    with pytest.raises(ValueError, match=match):
        CfgGrammar(text)


@pytest.mark.parametrize("name,pieces", [
    ("nested", [b"[", b"]", b",", b"a", b"b", b"c", b"ab", b"[a", b"],", b"[]", b"x", b"]]"]),
    ("left_recursion", [b"a", b"+", b"*", b"(", b")", b"a+", b"a*a", b"(a", b")+", b"((", b"x"]),
])
def test_constrained_decoding_writes_sentences(name, pieces):
    """`GrammarConstraint` over the grammar with a made-up vocabulary and random logits: every sampled answer
    that ends is a sentence Lark parses (the stop token is allowed only there)."""
    from openm3.engine.constrained import GrammarConstraint, TokenBytes, TransitionCache
    from openm3.engine.sampling import SamplingParams

    text = GRAMMARS[name][0]
    parser = lark.Lark(text, parser="earley", lexer="dynamic")
    pieces = pieces + [b"<eos>"]
    eos = len(pieces) - 1
    vocab = TokenBytes([p if i != eos else None for i, p in enumerate(pieces)])
    transitions = TransitionCache(CfgGrammar(text), vocab)
    gen = torch.Generator().manual_seed(0)
    ended = 0
    for _ in range(20):
        constraint = GrammarConstraint(transitions, [eos])
        out = []
        for _ in range(30):
            logits = torch.randn(len(pieces), generator=gen)
            logits[eos] += 2.0  # (the stop token likelier where it is allowed: more answers end)
            token = constraint.pick(logits, SamplingParams(1.0), gen)
            if token == eos:
                ended += 1
                assert parses(parser, b"".join(out).decode()), out
                break
            out.append(pieces[token])
    assert ended >= 10


@pytest.mark.parametrize("text,before,taken", [
    ('start: "😀" WORD | "中文"\nWORD: /[\\u4e00-\\u9fff]+/', "", 2),
    ('start: "😀" WORD | "中文"\nWORD: /[\\u4e00-\\u9fff]+/', "😀", 4608),
    ('start: "é"i "x" | "ä" "y" | /[^\\W\\d_a-z]/i "z"', "", None),
    ('start: a | b\na: "中" "x"\nb: /[\\u4e00-\\u4e3f]/ "y" | "\\U0010ffff"', "", 65),
    ('root ::= [^a-z\\u0100-\\U0010ffff] "x" | "中"', "", 129),
], ids=["literals", "class", "nocase-category", "ambiguous", "gbnf-negated"])
def test_a_character_s_first_bytes_are_taken_when_some_completion_is(text, before, taken):
    """Every lead byte and longer prefix of a character, down to whole characters (`check_split_characters`):
    literals of 3 and 4 bytes, regex classes (ignore-case, negated, a category), several stacks at once waiting on
    different terminals; `taken`: how many of the whole characters checked (those of 2 bytes, and those of 3 and 4
    under `DEEP`) may come there (None: many)."""
    from test_regex_grammar import check_split_characters

    g = CfgGrammar(text)
    got = check_split_characters(g.advance, g.advance(g.start, before.encode()))
    assert got == taken if taken is not None else got > 100


@pytest.mark.parametrize("text,written", [('start: "😀" WORD\nWORD: /[\\u4e00-\\u9fff]+/', "😀中文"),
                                          ('start: "a" ("中" | /[😀é]/)*', "a中😀é"),
                                          ('root ::= [^\\x00-\\x7f]+ | "x"', "é中😀")])
def test_characters_no_token_holds_are_written_through_byte_tokens(text, written):
    """A vocabulary whose only tokens of non-ASCII text are single bytes: greedy picks write literals' and
    classes' characters byte by byte, the stop token refused inside a character (where the text before it is a
    sentence too) and `complete` false there."""
    from openm3.engine.constrained import TokenBytes, TransitionCache
    from test_regex_grammar import BYTES_ONLY, write

    write(TransitionCache(CfgGrammar(text), TokenBytes(BYTES_ONLY)), written.encode())
