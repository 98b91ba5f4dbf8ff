"""Structured outputs for `openm3 serve`: `response_format` (Chat Completions, Completions) and `text.format`
(Responses) of type `json_object` or `json_schema`, Anthropic's `output_config.format`, and vLLM's
`structured_outputs` / `guided_json` / `guided_choice` / `guided_regex` / `guided_grammar` turn into a token
constraint per choice (`openm3.engine.constrained.GrammarConstraint` over `openm3.engine.json_grammar`,
`ChoiceGrammar`, `openm3.engine.regex_grammar` or `openm3.engine.cfg_grammar`), so the answer is JSON that follows
the schema, one of the given strings, text the pattern matches, or a sentence of the grammar, as with vLLM's
structured outputs. A forced
tool call (`tool_choice` 'required' or a named function; Anthropic's `any` / `tool`) constrains the answer to a
tool-call block in M3's markup (`openm3.engine.tool_grammar`); with `openm3 serve --constrain-tool-calls`, an
unforced answer's text stays free and each tool-call block the model opens follows the same grammar (a custom tool's
input its own). A chat answer may still open with its think block: the grammar applies after it (the reasoning
parser splits it off as usual).

Compiling a schema and the memo of its token transitions are kept for the last `max_grammars` schemas, so an agent
that sends the same schema with every request pays the checks once.
"""

from __future__ import annotations

import collections
import json
import threading
from typing import Callable

from ..data.tokenizer import THINK_END, THINK_START, TOOL_CALL_END, TOOL_CALL_START
from ..engine.constrained import ChoiceGrammar, GrammarConstraint, TokenBytes, TransitionCache
from ..engine.json_grammar import compile_schema
from ..engine.cfg_grammar import CfgGrammar
from ..engine.regex_grammar import RegexGrammar
from ..engine.tool_grammar import END, START, ToolCallGrammar
from .schemas import OutputSpec


class StructuredOutputs:
    """Per-choice constraints for response formats over one tokenizer (its token bytes are read once, at the first
    structured request)."""

    def __init__(self, tokenizer, max_grammars: int = 16):
        self.tokenizer, self.max_grammars = tokenizer, max_grammars
        self._vocab: TokenBytes | None = None
        self._grammars: collections.OrderedDict[str, TransitionCache] = collections.OrderedDict()
        self._lock = threading.Lock()

    def factory(self, spec: OutputSpec, *, think: bool = False, thinking: bool = False, field: str | None = None
                ) -> Callable[[], GrammarConstraint]:
        """A maker of fresh constraints (one per choice) for answers that `spec` allows. think: the answer may open
        with a think block first; thinking: the prompt opened it already; field: the request's field that asked
        for it (named where decoding finds no token to go on with, `GrammarDeadEnd`). ValueError naming the
        problem for a schema the grammar cannot honour."""
        transitions = self._transitions(spec)
        grammar = transitions.grammar
        if getattr(grammar, "dead_ends", False) and not grammar.complete(grammar.start) \
                and not bool(transitions.full_mask(grammar.start).any()):  # (the mask is memoised)
            raise ValueError(f"regex {spec.regex!r}: no token of the vocabulary starts a match (lookaround and other "
                             "syntax the automaton lacks are checked by the `regex` package, a whole character at "
                             "a time)")
        ids = self.tokenizer.special_ids
        pair = (ids[THINK_START], ids[THINK_END]) if think else None
        eos = self.tokenizer.eos_id
        trigger = ids[TOOL_CALL_START] if spec.triggered else None
        return lambda: GrammarConstraint(transitions, [eos], think=pair, thinking=thinking, trigger=trigger,
                                         field=field)

    def _transitions(self, spec: OutputSpec) -> TransitionCache:
        key = json.dumps([spec.schema, spec.strict, spec.choices, spec.regex, spec.grammar, spec.tools,
                          spec.tool_name, spec.max_calls], sort_keys=True)
        with self._lock:
            if key in self._grammars:
                self._grammars.move_to_end(key)
                return self._grammars[key]
        # Each raises ValueError (the caller's 400) for what no answer could follow, so decoding finds no token to
        # go on with only under the request's own masks or a pattern left to the `regex` package (`GrammarDeadEnd`):
        # a pattern or grammar that matches no text, a tool whose parameters are malformed.
        if spec.tools is not None:
            grammar = ToolCallGrammar(json.loads(spec.tools), spec.tool_name, spec.max_calls)
        elif spec.choices is not None:
            grammar = ChoiceGrammar(spec.choices)
        elif spec.regex is not None:
            grammar = RegexGrammar(spec.regex)  # ValueError for a pattern that does not compile or matches nothing
        elif spec.grammar is not None:
            grammar = CfgGrammar(spec.grammar)  # ValueError for a grammar it cannot read or follow
        else:
            grammar = compile_schema(spec.schema, strict=spec.strict)  # ValueError for what it cannot honour
        with self._lock:
            if self._vocab is None:  # the tool-call tokens as the tool grammar's marker bytes
                ids = self.tokenizer.special_ids
                self._vocab = TokenBytes.from_tokenizer(self.tokenizer, markers={ids[TOOL_CALL_START]: START,
                                                                                 ids[TOOL_CALL_END]: END})
            transitions = self._grammars.setdefault(key, TransitionCache(grammar, self._vocab))
            while len(self._grammars) > self.max_grammars:
                self._grammars.popitem(last=False)
            return transitions
