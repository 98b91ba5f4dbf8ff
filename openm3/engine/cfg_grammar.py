"""Context-free grammars for outputs (vLLM's `guided_grammar` / `structured_outputs.grammar`), for
`GrammarConstraint`:

    grammar = CfgGrammar('start: expr\\nexpr: NUMBER ("+" NUMBER)*\\n%import common.NUMBER')
    state = grammar.advance(grammar.start, b"1+")   # not None: some sentence begins this way
    grammar.complete(grammar.advance(state, b"2"))  # True

Two notations are read: Lark's EBNF (rules `name: ...`, the start rule `start`; "literals", "literals"i ignoring
case, /regexes/ with the flags i, s, x (and u, the default), "a".."z" ranges, ( ), [ ] and ? optional, * and +
repetition, `~ n` and `~ n..m`, `%import common.NAME` for Lark's common terminals, `%ignore TERMINAL` (or a
literal or regex): what it names may stand before every terminal a rule holds, and at the end; also `%import
common (A, B)`, `%import common.A -> B`, `%extend rule: ...` and `%override rule: ...`; `-> alias` and `name.2`
priorities are read and have no effect on which texts are sentences) and llama.cpp's
GBNF (`name ::= ...`, the start rule `root`; "literals", [character classes], . for any character, ( ), ?, *, +,
{m}, {m,n}, {m,}). Regexes
and classes use the syntax of `openm3.engine.regex_nfa`, and Lark's templates (`_sep{x, s}: x (s x)*`, used as
`_sep{item, ","}`). Left recursion (`expr: expr "+" term | term`, also through other rules) is rewritten into the
same language without it. Not supported (a ValueError naming it): the regex flags m and l, other directives, and
left recursion behind a part that can be empty (`a: b a "x"` with `b` optional).

Sentences are recognised character by character with a set of parse stacks (a nondeterministic pushdown
automaton): a stack is the rule positions still open, innermost first, and a state is the set of stacks after the
text (a stack ends where its innermost rule waits on a terminal: a literal and how far into it, or a regex and
its automaton's states). Texts that lead to the same set share it, and with it `TransitionCache`'s masks. Every
stack in a state can still be completed (rules are checked productive), so decoding never paints itself into a
corner. A token may end inside a multi-byte character (a byte-level tokenizer splits rare characters over byte
tokens): the state then holds the character's first bytes beside the set of stacks before it, and takes them when
some character that starts with them (a range of code points, `openm3.engine.utf8`) moves some stack: a literal
waiting on a character of the range, or a regex some character of it keeps alive (`Nfa.step_range`). The
character is stepped once whole, and the text is not `complete` while one is open.
"""

from __future__ import annotations

import bisect
import collections
import re
from typing import Iterator

from .regex_nfa import Nfa, compile_nfa, strong_components
from .utf8 import SplitCharacters, utf8_length

__all__ = ["CfgGrammar"]

MAX_STACKS = 4096  # stacks in one state: past it the grammar is too ambiguous to follow this way

_COMMON = {  # Lark's common.lark terminals, as regexes
    "DIGIT": r"[0-9]", "HEXDIGIT": r"[a-fA-F0-9]", "INT": r"[0-9]+", "SIGNED_INT": r"[+-]?[0-9]+",
    "DECIMAL": r"[0-9]+\.[0-9]*|\.[0-9]+",
    "FLOAT": r"[0-9]+[eE][+-]?[0-9]+|([0-9]+\.[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?",
    "NUMBER": r"[0-9]+[eE][+-]?[0-9]+|([0-9]+\.[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?|[0-9]+",
    "SIGNED_NUMBER": r"[+-]?([0-9]+[eE][+-]?[0-9]+|([0-9]+\.[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?|[0-9]+)",
    "LCASE_LETTER": r"[a-z]", "UCASE_LETTER": r"[A-Z]", "LETTER": r"[a-zA-Z]", "WORD": r"[a-zA-Z]+",
    "CNAME": r"[_a-zA-Z][_a-zA-Z0-9]*", "ESCAPED_STRING": r'"([^"\\]|\\.)*"', "WS_INLINE": r"[ \t]+",
    "WS": r"[ \t\f\r\n]+", "CR": r"\r", "LF": r"\n", "NEWLINE": r"(\r?\n)+",
}

_TOKEN = r"""
    (?P<space>[ \t\r\n]+) | (?P<comment>(//|\#)[^\n]*) |
    (?P<string>"(?:[^"\\]|\\.)*"i?) | (?P<regex>/(?:[^/\\\n]|\\.)+/[imsux]*) | {brackets} |
    (?P<define>::=|:) | (?P<range>\.\.) | (?P<repeat>\{{\s*\d+\s*(?:,\s*\d*\s*)?\}}) | (?P<brace>{braces}) |
    (?P<tilde>~\s*\d+(?:\s*\.\.\s*\d+)?) | (?P<alias>->\s*[A-Za-z_][A-Za-z_0-9]*) |
    (?P<op>[|()?*+]) | (?P<name>[?!]?[A-Za-z_][A-Za-z_0-9]*(?:\.[A-Za-z_0-9]+)*(?:\.-\d+)?) | (?P<directive>%[a-z]+)
"""
# GBNF's [ ] is a character class; Lark's is an optional group (its brackets are operators, so groups nest), and
# Lark's { , } write templates
_TOKENS = {True: re.compile(_TOKEN.format(brackets=r"(?P<cls>\[(?:[^\]\\]|\\.)*\]) | (?P<any>\.(?!\.))",
                                          braces="(?!)"), re.VERBOSE),
           False: re.compile(_TOKEN.format(brackets=r"(?P<bracket>[\[\]])", braces="[{},]"), re.VERBOSE)}
_PRIORITY = re.compile(r"\.-?\d+$")
_MAX_TEMPLATE_DEPTH = 16  # templates expanded inside templates (a template that uses itself never ends)
_MAX_REPEATED = 1 << 14  # elements that counted repetitions ({m,n}, ~ m..n) may write out in one grammar


def _tokens(text: str, gbnf: bool) -> Iterator[tuple[str, str, int]]:
    pos = 0
    while pos < len(text):
        m = _TOKENS[gbnf].match(text, pos)
        if m is None:
            raise ValueError(f"grammar: cannot read {text[pos:pos + 20]!r} (at character {pos})")
        kind = m.lastgroup
        if kind == "name" and not gbnf and _PRIORITY.search(m.group()):  # Lark's `name.2` priority: no effect on
            yield kind, _PRIORITY.sub("", m.group()), pos  # which texts are sentences, so it is dropped
        elif kind not in ("space", "comment"):
            yield kind, m.group(), pos
        pos = m.end()


def _unquote(literal: str) -> str:
    body, out, i = literal[1:literal.rindex('"')], [], 0
    escapes = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "0": "\0", "\\": "\\", '"': '"', "'": "'",
               "/": "/", "b": "\b"}
    while i < len(body):
        ch = body[i]
        if ch != "\\":
            out.append(ch)
            i += 1
            continue
        nxt = body[i + 1]
        if nxt in "xuU":
            width = {"x": 2, "u": 4, "U": 8}[nxt]
            out.append(chr(int(body[i + 2:i + 2 + width], 16)))
            i += 2 + width
        elif nxt in escapes:
            out.append(escapes[nxt])
            i += 2
        else:
            raise ValueError(f"grammar: unknown escape \\{nxt} in {literal}")
    return "".join(out)


class _Compiler:
    """Grammar text -> rules: each a list of alternatives, each a tuple of elements ("lit", str), ("re", Nfa) or
    ("ref", rule index). Groups and repetitions become rules of their own."""

    def __init__(self, text: str):
        self.rules: list[list[tuple]] = []
        self.names: dict[str, int] = {}
        self.gbnf = "::=" in text
        self.defined: set[str] = set()
        self.terminals: set[int] = set()  # rules of Lark's terminals (uppercase names) and the groups inside them
        self.ignored: list[tuple] = []  # %ignore's elements
        self.repeated = 0  # elements written out for counted repetitions (`_MAX_REPEATED`)
        toks = self._expand_templates(list(_tokens(text, self.gbnf)))
        starts = [i for i in range(len(toks) - 1)
                  if toks[i][0] == "name" and toks[i + 1][0] == "define"]
        directives = [i for i, t in enumerate(toks) if t[0] == "directive"]
        for i in directives:
            self._directive(toks, i)
        ends = sorted(starts[1:] + directives + [len(toks)])
        changes = {i: toks[i - 1][1] for i in starts if i > 0 and toks[i - 1][:2] in (("directive", "%extend"),
                                                                                     ("directive", "%override"))}
        for i in [i for i in starts if i not in changes] + sorted(changes):  # definitions, then Lark's changes
            name = toks[i][1].lstrip("?!")
            if i in changes and name not in self.defined:
                raise ValueError(f"grammar: {changes[i]} {name}: no rule {name!r} is defined to change")
            if i not in changes and name in self.defined:
                raise ValueError(f"grammar: rule {name!r} is defined twice")
            self.defined.add(name)
            end = ends[bisect.bisect_right(ends, i)]  # (ends holds len(toks), past every start)
            body = toks[i + 2:end]
            first = len(self.rules)
            alternatives, j = self._alternatives(body, 0, name)
            if j != len(body):
                raise ValueError(f"grammar: rule {name!r}: unexpected {body[j][1]!r}")
            if changes.get(i) == "%extend":  # more alternatives for the rule
                alternatives = self.rules_of(name) + alternatives
            self.rules_of(name)[:] = alternatives  # (%override: these instead)
            if not self.gbnf and name.isupper():
                self.terminals |= set(range(first, len(self.rules))) | {self.names[name]}
        undefined = sorted(set(self.names) - self.defined)
        if undefined:
            raise ValueError(f"grammar: rules used but not defined: {undefined}")
        self.start = "root" if self.gbnf else "start"
        if self.start not in self.names:
            raise ValueError(f"grammar: no start rule (expected {self.start!r})")
        if self.ignored:
            self._ignore()

    def _expand_templates(self, toks: list) -> list:
        """Lark's templates: `name{a, b}: body` defines one, `name{x, "y"}` uses it. Each use becomes the body in a
        group, with every parameter replaced by its argument (in a group too): the same language as Lark's rule per
        instance. The definitions are taken out of the token list."""
        templates: dict[str, tuple[list[str], list]] = {}
        out, i = [], 0
        while i < len(toks):
            kind, text, pos = toks[i]
            close = self._brace_end(toks, i + 1) if kind == "name" else None
            if close is not None and close + 1 < len(toks) and toks[close + 1][0] == "define":
                params = [a for a in self._arguments(toks, i + 1, close)]
                if any(len(a) != 1 or a[0][0] != "name" for a in params):
                    raise ValueError(f"grammar: template {text!r}: its parameters must be names (at character {pos})")
                end = next((j for j in range(close + 2, len(toks))
                            if toks[j][0] == "directive" or (toks[j][0] == "name" and j + 1 < len(toks)
                                                             and toks[j + 1][0] in ("define", "brace")
                                                             and self._is_definition(toks, j))), len(toks))
                name = text.lstrip("?!")
                if name in templates:
                    raise ValueError(f"grammar: template {name!r} is defined twice")
                templates[name] = ([a[0][1] for a in params], toks[close + 2:end])
                i = end
                continue
            out.append(toks[i])
            i += 1
        return self._instantiate(out, templates, 0)

    def _is_definition(self, toks: list, j: int) -> bool:
        """Whether toks[j] (a name) starts a rule or template definition."""
        if toks[j + 1][0] == "define":
            return True
        close = self._brace_end(toks, j + 1)
        return close is not None and close + 1 < len(toks) and toks[close + 1][0] == "define"

    @staticmethod
    def _brace_end(toks: list, i: int) -> int | None:
        """The index of the } closing the { at toks[i] (None: no { there, or not closed)."""
        if i >= len(toks) or toks[i][:2] != ("brace", "{"):
            return None
        depth = 0
        for j in range(i, len(toks)):
            if toks[j][0] == "brace" and toks[j][1] in "{}":
                depth += 1 if toks[j][1] == "{" else -1
                if depth == 0:
                    return j
        return None

    @staticmethod
    def _arguments(toks: list, open_: int, close: int) -> list[list]:
        """The comma-separated token lists between toks[open_] ({) and toks[close] (})."""
        args, cur, depth = [], [], 0
        for tok in toks[open_ + 1:close]:
            if tok[0] == "brace" and tok[1] == "," and depth == 0:
                args.append(cur)
                cur = []
                continue
            if tok[0] == "brace":
                depth += 1 if tok[1] == "{" else -1 if tok[1] == "}" else 0
            cur.append(tok)
        return args + [cur]

    def _instantiate(self, toks: list, templates: dict, depth: int) -> list:
        """Every use of a template in `toks` replaced by its body (recursively, up to `_MAX_TEMPLATE_DEPTH`)."""
        out, i = [], 0
        while i < len(toks):
            kind, text, pos = toks[i]
            close = self._brace_end(toks, i + 1) if kind == "name" else None
            if close is None:  # (a stray { } or , is refused where a rule's body is read)
                out.append(toks[i])
                i += 1
                continue
            if text not in templates:
                raise ValueError(f"grammar: template {text!r} is used but not defined (at character {pos})")
            if depth >= _MAX_TEMPLATE_DEPTH:
                raise ValueError(f"grammar: template {text!r} expands more than {_MAX_TEMPLATE_DEPTH} levels deep "
                                 f"(does it use itself?)")
            params, body = templates[text]
            args = self._arguments(toks, i + 1, close)
            if len(args) != len(params) or any(not a for a in args):
                raise ValueError(f"grammar: template {text!r} takes {len(params)} arguments "
                                 f"({', '.join(params)}), got {len(args)} (at character {pos})")
            given = dict(zip(params, args))
            group = [("op", "(", pos)]
            for tok in body:
                if tok[0] == "name" and tok[1] in given:
                    group += [("op", "(", tok[2]), *given[tok[1]], ("op", ")", tok[2])]
                else:
                    group.append(tok)
            out += self._instantiate(group + [("op", ")", pos)], templates, depth + 1)
            i = close + 1
        return out

    def _ignore(self) -> None:
        """Lark's %ignore: what it names may stand before every terminal of a rule (not inside a terminal) and at
        the end of the text: a rule IGNORED* goes before each terminal element of each non-terminal rule."""
        unknown = [e for e in self.ignored if isinstance(e, str) and e not in self.defined]
        if unknown:
            raise ValueError(f"grammar: %ignore names terminals that are not defined: {unknown}")
        many = len(self.rules)
        elements = [("ref", self._ref(e)) if isinstance(e, str) else e for e in self.ignored]
        self.rules.append([(e, ("ref", many)) for e in elements] + [()])
        skip = ("ref", many)
        for r in range(many):
            if r in self.terminals:
                continue
            alternatives = []
            for alt in self.rules[r]:
                out: list[tuple] = []
                for e in alt:
                    if e[0] != "ref" or e[1] in self.terminals:
                        out.append(skip)
                    out.append(e)
                alternatives.append(tuple(out))
            self.rules[r] = alternatives
        root = self.names[self.start]
        self.rules[root] = [alt + (skip,) for alt in self.rules[root]]

    def rules_of(self, name: str) -> list:
        if name not in self.names:
            self.names[name] = len(self.rules)
            self.rules.append([])
        return self.rules[self.names[name]]

    def _directive(self, toks, i: int) -> None:
        word = toks[i][1]
        if word in ("%extend", "%override") and i + 2 < len(toks) and toks[i + 2][0] == "define":
            return  # (read with the rules: the definition after it changes an earlier one)
        if word == "%import" and i + 1 < len(toks) and toks[i + 1][0] == "name":
            path = toks[i + 1][1]
            if i + 2 < len(toks) and toks[i + 2][:2] == ("op", "("):  # %import common (A, B, ...)
                close = next((j for j in range(i + 3, len(toks)) if toks[j][:2] == ("op", ")")), None)
                inner = toks[i + 3:close] if close is not None else []
                if not inner or len(inner) % 2 == 0 or any(t[0] != "name" for t in inner[0::2]) \
                        or any(t[1] != "," for t in inner[1::2]):
                    raise ValueError(f"grammar: %import {path} (...): expected names separated by commas")
                for _, name, _ in inner[0::2]:
                    self._import(f"{path}.{name}", name)
                return
            alias = toks[i + 2][1][2:].strip() if i + 2 < len(toks) and toks[i + 2][0] == "alias" else None
            self._import(path, alias or path.rpartition(".")[2])  # %import common.NAME [-> ALIAS]
            return
        if word == "%ignore" and not self.gbnf and i + 1 < len(toks):
            kind, text, _ = toks[i + 1]
            if kind == "name" and text.isupper():
                self.ignored.append(text)
                return
            if kind in ("string", "regex"):
                atom, _ = self._atom(toks, i + 1, "%ignore")
                if atom is not None:
                    self.ignored.append(atom)
                return
        raise ValueError(f"grammar: {word} {toks[i + 1][1] if i + 1 < len(toks) else ''} is not supported")

    def _import(self, path: str, name: str) -> None:
        """Lark's `%import common.X` (as `name`): common.lark's terminal X."""
        module, _, terminal = path.rpartition(".")
        if module != "common" or terminal not in _COMMON:
            raise ValueError(f"grammar: %import {path}: only common.{{{', '.join(sorted(_COMMON))}}} are known")
        if name in self.defined:
            raise ValueError(f"grammar: rule {name!r} is defined twice")
        self.defined.add(name)
        self.rules_of(name)[:] = [(("re", self._nfa(_COMMON[terminal])),)]
        self.terminals.add(self.names[name])

    def _nfa(self, pattern: str) -> Nfa:
        nfa = compile_nfa(pattern, search=False)
        if nfa is None:
            raise ValueError(f"grammar: the regex {pattern!r} uses syntax the automaton lacks (or is too large)")
        if not nfa.live(nfa.start):  # a terminal nothing can match: its rules could start and never end
            raise ValueError(f"grammar: the regex {pattern!r} matches no text")
        return nfa

    def _anonymous(self, alternatives: list[tuple]) -> tuple:
        index = len(self.rules)
        self.rules.append(alternatives)
        return ("ref", index)

    def _alternatives(self, toks, i: int, rule: str, close: str | None = None) -> tuple[list[tuple], int]:
        """The alternatives (element tuples) from toks[i] up to `close` (or the end); returns them and the index
        of `close` (or the end)."""
        alternatives, seq = [], []
        while i < len(toks):
            kind, text, _ = toks[i]
            if kind in ("op", "bracket") and text == close:
                break
            if kind == "op" and text == "|":
                alternatives.append(tuple(seq))
                seq, i = [], i + 1
                continue
            if kind == "alias":  # Lark's `-> name` names the alternative's tree node: nothing to follow
                i += 1
                continue
            atom, i = self._atom(toks, i, rule)
            atom, i = self._postfix(toks, i, atom)
            if atom is not None:
                seq.append(atom)
        alternatives.append(tuple(seq))
        return alternatives, i

    def _atom(self, toks, i: int, rule: str) -> tuple[tuple | None, int]:
        kind, text, pos = toks[i]
        if kind == "string":
            literal = _unquote(text)
            if i + 2 < len(toks) and toks[i + 1][0] == "range" and toks[i + 2][0] == "string":
                high = _unquote(toks[i + 2][1])
                if len(literal) != 1 or len(high) != 1:
                    raise ValueError(f"grammar: a range takes single characters, got {text}..{toks[i + 2][1]}")
                return ("re", self._nfa(f"[{re.escape(literal)}-{re.escape(high)}]")), i + 3
            if text.endswith("i") and literal:  # Lark's case-insensitive literal: each letter either case
                return ("re", self._nfa("".join(f"[{re.escape(c.lower())}{re.escape(c.upper())}]" if c.lower()
                                                != c.upper() else re.escape(c) for c in literal))), i + 1
            if any(0xD800 <= ord(c) <= 0xDFFF for c in literal):  # no (UTF-8) text holds one
                raise ValueError(f"grammar: the literal {text} holds a lone surrogate, which no text can")
            return (("lit", literal) if literal else None), i + 1
        if kind == "regex":  # Lark's /body/flags: the flags i, s and x as `re`'s, u (unicode) is the default
            body, _, flags = text[1:].rpartition("/")
            unknown = sorted(set(flags) - set("isxu"))
            if unknown:
                raise ValueError(f"grammar: regex flag {unknown[0]!r} ({text}) is not supported (i, s, x, u are)")
            scoped = "".join(f for f in "isx" if f in flags)
            end = "\n)" if "x" in flags else ")"  # (a verbose pattern's closing comment must not take the ")")
            return ("re", self._nfa(f"(?{scoped}:{body}{end}" if scoped else body)), i + 1
        if kind == "cls" and self.gbnf:
            return ("re", self._nfa(text)), i + 1
        if kind == "any":  # GBNF's . : any one character
            return ("re", self._nfa(r"[\s\S]")), i + 1
        if kind == "name":
            return ("ref", self._ref(text)), i + 1
        if kind == "op" and text == "(":
            alternatives, j = self._alternatives(toks, i + 1, rule, ")")
            if j >= len(toks):
                raise ValueError(f"grammar: rule {rule!r}: a ( is not closed")
            return self._anonymous(alternatives), j + 1
        if kind == "bracket" and text == "[":  # Lark's [ ... ]: optional
            alternatives, j = self._alternatives(toks, i + 1, rule, "]")
            if j >= len(toks):
                raise ValueError(f"grammar: rule {rule!r}: a [ is not closed")
            return self._anonymous(alternatives + [()]), j + 1
        raise ValueError(f"grammar: rule {rule!r}: unexpected {text!r} (at character {pos})")

    def _ref(self, name: str) -> int:
        self.rules_of(name)
        return self.names[name]

    def _many(self, atom: tuple) -> tuple:
        """A rule for `atom*`, right-recursive: atom atom* | (nothing)."""
        many = len(self.rules)
        self.rules.append([(atom, ("ref", many)), ()])
        return ("ref", many)

    def _postfix(self, toks, i: int, atom: tuple | None) -> tuple[tuple | None, int]:
        while i < len(toks) and (toks[i][0] in ("repeat", "tilde") or toks[i][0] == "op" and toks[i][1] in "?*+"):
            text = toks[i][1]
            if toks[i][0] == "tilde":  # Lark's `item ~ n` and `item ~ n..m`: as {n} and {n,m}
                low, _, high = text[1:].replace(" ", "").partition("..")
                text = f"{{{low},{high}}}" if high else f"{{{low}}}"
            i += 1
            if atom is None:
                continue
            if text == "?":
                atom = self._anonymous([(atom,), ()])
            elif text in "*+":
                many = self._many(atom)
                atom = many if text == "*" else self._anonymous([(atom, many)])
            else:
                low, _, high = text[1:-1].replace(" ", "").partition(",")
                least = int(low)
                most = least if "," not in text else (int(high) if high else None)
                if most is not None and most < least:
                    raise ValueError(f"grammar: repetition {text} has its maximum below its minimum")
                self.repeated += least + 1 if most is None else most  # (each is written out: a bound on that)
                if self.repeated > _MAX_REPEATED:
                    raise ValueError(f"grammar: repetition {text} takes the counted repetitions past "
                                     f"{_MAX_REPEATED} elements in all; expected smaller counts (or * and +)")
                seq = [atom] * least
                if most is None:
                    seq.append(self._many(atom))
                else:
                    tail: tuple = ()
                    for _ in range(most - least):  # nested optionals: (atom (atom ...)?)?
                        tail = (self._anonymous([(atom,) + tail, ()]),)
                    seq += list(tail)
                atom = self._anonymous([tuple(seq)])
        return atom, i


class CfgGrammar:
    """Outputs a context-free grammar derives (see the module docstring); ValueError naming the problem for a
    grammar that cannot be read or followed."""

    def __init__(self, text: str):
        if not isinstance(text, str) or not text.strip():
            raise ValueError("grammar: expected the grammar's text")
        compiled = _Compiler(text)
        self.rules = [[tuple(alt) for alt in alts] for alts in compiled.rules]
        self.root = compiled.names[compiled.start]
        self._names = {i: n for n, i in compiled.names.items()}  # for errors: groups have none
        self._check_productive()
        self._remove_left_recursion()
        self._check_left_recursion()
        self._steps: dict = {}
        self._ranges: dict = {}  # (state, lo, hi) -> whether some character of the range moves a stack
        self._split = SplitCharacters(lambda state, ch: self._step(state, ch) or None,
                                      self._takes_range)  # data that ends inside a character
        self.start = self._closure([((self.root, a, 0), None, None) for a in range(len(self.rules[self.root]))])
        if not self.start:
            raise ValueError("grammar: the start rule derives nothing")

    # --------------------------------------------------------------------------------------------- checks

    def _rule_name(self, r: int) -> str:
        return self._names.get(r, f"<group {r}>")

    def _rules_where(self, holds) -> set[int]:
        """The least set of rules with an alternative whose every element holds: `holds(element)` for a terminal,
        being in the set for a reference to a rule. A worklist over the references: time linear in the grammar
        (sweeping the rules until nothing changes is quadratic on a long chain of rules)."""
        waiting: dict[int, list] = {}  # rule -> the alternatives that refer to it, once per reference
        left: dict[tuple[int, int], int] = {}  # alternative -> its references to rules not yet in the set
        found: set[int] = set()
        todo: list[int] = []
        for r, alts in enumerate(self.rules):
            for a, alt in enumerate(alts):
                if not all(e[0] == "ref" or holds(e) for e in alt):
                    continue
                refs = [e[1] for e in alt if e[0] == "ref"]
                left[r, a] = len(refs)
                for t in refs:
                    waiting.setdefault(t, []).append((r, a))
                if not refs:
                    todo.append(r)
        while todo:
            r = todo.pop()
            if r in found:
                continue
            found.add(r)
            for key in waiting.get(r, ()):
                left[key] -= 1
                if not left[key]:
                    todo.append(key[0])
        return found

    def _check_productive(self) -> None:
        """Every rule must derive some text (else a stack could wait forever)."""
        productive = self._rules_where(lambda e: True)
        dead = sorted(self._rule_name(r) for r in range(len(self.rules)) if r not in productive)
        if dead:
            raise ValueError(f"grammar: rules that derive no text: {dead}")

    @staticmethod
    def _empty(element: tuple, nullable: set[int]) -> bool:
        kind, value = element
        if kind == "ref":
            return value in nullable
        if kind == "re":
            return value.matched(value.start)
        return value == ""

    def _first_refs(self) -> dict[int, set[int]]:
        """rule -> the rules that can start it (reached before reading a character: through nullable elements)."""
        nullable = self._rules_where(lambda e: self._empty(e, set()))
        first: dict[int, set[int]] = {r: set() for r in range(len(self.rules))}
        for r, alts in enumerate(self.rules):
            for alt in alts:
                for e in alt:
                    if e[0] == "ref":
                        first[r].add(e[1])
                    if not self._empty(e, nullable):
                        break
        return first

    def _remove_left_recursion(self) -> None:
        """Rewrites left recursion that starts an alternative (`expr: expr "+" term | term`, or through other rules:
        `a: b "x" | "y"`, `b: a "z" | "w"`) into the same language without it, as textbooks do (Paull's algorithm
        over the rules on such cycles): alternatives that start with an earlier rule of the cycle take that rule's
        alternatives in its place, then `A: A x | y` becomes `A: y A'`, `A': x A' | (nothing)`. Recursion hidden
        behind a part that can be empty (`a: b a "x"` with `b` optional) stays, and `_check_left_recursion` names
        it."""
        cyclic = self._left_cycles()
        for i, a in enumerate(cyclic):
            for b in cyclic[:i]:  # a's alternatives that start with an earlier rule b: b's alternatives instead
                alts: list[tuple] = []
                for alt in self.rules[a]:
                    for new in ([beta + alt[1:] for beta in self.rules[b]] if alt[:1] == (("ref", b),) else [alt]):
                        if new not in alts:
                            alts.append(new)
                self.rules[a] = alts
            self.rules[a] = [alt for alt in self.rules[a] if alt != (("ref", a),)]  # `a: a` adds no sentence
            again = [alt[1:] for alt in self.rules[a] if alt[:1] == (("ref", a),)]
            if not again:
                continue
            rest = len(self.rules)
            self.rules[a] = [alt + (("ref", rest),) for alt in self.rules[a] if alt[:1] != (("ref", a),)]
            self.rules.append([alt + (("ref", rest),) for alt in again] + [()])
            self._names[rest] = f"{self._rule_name(a)}'"

    def _left_cycles(self) -> list[int]:
        """The rules that can reach themselves before reading a character (in order): those in a strongly connected
        component of `_first_refs` of more than one rule, or that start themselves."""
        first = self._first_refs()
        component = strong_components([sorted(first[r]) for r in range(len(self.rules))])
        sizes = collections.Counter(component)
        return [r for r in range(len(self.rules)) if sizes[component[r]] > 1 or r in first[r]]

    def _check_left_recursion(self) -> None:
        """A rule that can reach itself before reading a character would expand forever."""
        cyclic = self._left_cycles()
        if cyclic:
            raise ValueError(f"grammar: rule {self._rule_name(cyclic[0])!r} is left-recursive behind a part that "
                             f"can be empty (write repetition with * or +)")

    # ------------------------------------------------------------------------------------------ recognising

    def _closure(self, stacks) -> frozenset:
        """Stacks whose innermost rule waits on a terminal (or the accepting None), from stacks at any position:
        rules referenced are opened, rules finished return to their parent."""
        out: set = set()
        seen: set = set()
        todo = list(stacks)
        while todo:
            stack = todo.pop()
            if stack in seen:
                continue
            seen.add(stack)
            if len(seen) > 16 * MAX_STACKS:
                raise ValueError("grammar: too ambiguous to follow (too many parses at once)")
            (rule, alt, pos), sub, parent = stack
            seq = self.rules[rule][alt]
            if pos == len(seq):
                if parent is None:
                    out.add(None)  # the whole text is a sentence
                else:
                    todo.append(parent)
                continue
            kind, value = seq[pos]
            after = ((rule, alt, pos + 1), None, parent)
            if kind == "ref":
                # a rule that ends an alternative returns straight to its parent (a tail call): repetition (`x*`,
                # `x{0,n}`, right-recursive rules) then keeps stacks as deep as they were, so its states repeat
                into = after if pos + 1 < len(seq) else parent
                for a in range(len(self.rules[value])):
                    todo.append(((value, a, 0), None, into))
            elif kind == "lit":
                out.add(((rule, alt, pos), 0, parent))
            else:
                out.add(((rule, alt, pos), value.start, parent))
                if value.matched(value.start):
                    todo.append(after)
        if len(out) > MAX_STACKS:
            raise ValueError("grammar: too ambiguous to follow (too many parses at once)")
        return frozenset(out)

    def _step(self, state: frozenset, ch: str) -> frozenset:
        key = (state, ch)
        found = self._steps.get(key)
        if found is not None:
            return found
        moved = []
        for stack in state:
            if stack is None:
                continue
            (rule, alt, pos), sub, parent = stack
            kind, value = self.rules[rule][alt][pos]
            if kind == "lit":
                if value[sub] != ch:
                    continue
                if sub + 1 < len(value):
                    moved.append(((rule, alt, pos), sub + 1, parent))
                else:
                    moved.append(((rule, alt, pos + 1), None, parent))
            else:
                states = value.step(sub, ch)
                if not value.live(states):
                    continue
                moved.append(((rule, alt, pos), states, parent))
                if value.matched(states):
                    moved.append(((rule, alt, pos + 1), None, parent))
        result = self._expand(moved)
        if len(self._steps) >= 1 << 16:  # states hold their stacks: a bound on the memory they keep
            self._steps.clear()
        self._steps[key] = result
        return result

    def _expand(self, moved) -> frozenset:
        """`_closure` of stacks just moved: those still inside a terminal are kept as they are."""
        inside = [s for s in moved if s[1] is not None]
        rest = self._closure([s for s in moved if s[1] is None]) if len(inside) < len(moved) else frozenset()
        return rest | frozenset(inside)

    def _takes_range(self, state: frozenset, lo: int, hi: int) -> bool:
        """Whether some character of code points lo..hi moves some stack of `state` (its step is then not empty:
        every stack moved closes into stacks again); memoised (at most 2**16 questions, then cleared)."""
        key = (state, lo, hi)
        found = self._ranges.get(key)
        if found is None:
            found = False
            for stack in state:
                if stack is None:
                    continue
                (rule, alt, pos), sub, _ = stack
                kind, value = self.rules[rule][alt][pos]
                if lo <= ord(value[sub]) <= hi if kind == "lit" else value.live(value.step_range(sub, lo, hi)):
                    found = True
                    break
            if len(self._ranges) >= 1 << 16:
                self._ranges.clear()
            self._ranges[key] = found
        return found

    def advance(self, state, data: bytes):
        """The state after `data` (None: no sentence starts with the text then): a set of stacks, or (set of
        stacks, held) inside a character whose first bytes `held` are."""
        if type(state) is tuple:  # inside a character: its first bytes come first
            state, held = state
            data = held + data
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:  # it ends inside a character (or is not UTF-8)
            return self._split.cut(state, data, e.start)
        for ch in text:
            state = self._step(state, ch)
            if not state:
                return None
        return state

    @staticmethod
    def complete(state) -> bool:
        return type(state) is not tuple and None in state

    # split characters are taken: `TransitionCache` walks a character per trie edge where a token holds it whole
    character_steps = True
    character_length = staticmethod(utf8_length)  # a character's bytes at data[i] (0: data ends inside it)

    @staticmethod
    def can_continue(state) -> bool:
        return type(state) is tuple or any(s is not None for s in state)
