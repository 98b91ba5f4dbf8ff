"""Tests for openm3.engine.json_grammar, with `jsonschema` as the independent oracle: valid documents in several
spellings and chunkings are accepted and complete exactly at their end; invalid ones are rejected at the first byte
no valid document can continue; random walks over the accepted bytes end in documents that validate; schemas the
matcher cannot honour raise ValueError naming the pointer and the keyword."""

import json
import random
import time
from dataclasses import dataclass, field

import jsonschema
import pytest

from openm3.engine.json_grammar import JsonGrammar, compile_schema

# Seconds a step that once took 8 s to minutes may take now (~0.5 s at most idle; CI's loaded 2 cores: ~1.4 s)
FAST = 5.0

# ---------------------------------------------------------------------------------------------------------------
# Schemas, each with valid instances (`literal` ones only in the compact unicode spelling, which is the only one an
# enum/const or an exactly-spelled key accepts) and the schema the oracle validates against.


@dataclass
class Case:
    name: str
    schema: object
    valid: list
    literal: list = field(default_factory=list)
    strict: bool = False
    oracle: object = None

    def __post_init__(self):
        if self.oracle is None:
            self.oracle = {"type": "object"} if self.schema is None else self.schema


def strict_oracle(schema):
    """The schema strict mode means: objects that declare properties take no others unless they say so."""
    if isinstance(schema, dict):
        out = {k: strict_oracle(v) for k, v in schema.items()}
        if ("properties" in schema or schema.get("type") == "object") and "additionalProperties" not in schema:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict_oracle(v) for v in schema]
    return schema


POINT = {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}}, "required": ["x", "y"],
         "additionalProperties": False}
STRICT_SCHEMA = {"type": "object", "required": ["a"], "properties": {
    "a": {"type": "integer"}, "o": {"type": "object", "properties": {"x": {"type": "string"}}}}}

CASES = [
    Case("flat", {"type": "object", "required": ["name", "age"], "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}, "score": {"type": "number"},
        "ok": {"type": "boolean"}, "note": {"type": ["string", "null"]}}},
        [{"name": "Ann", "age": 31}, {"age": 0, "name": "", "score": -1.5e-3, "ok": True, "note": None},
         {"name": "x", "age": -7, "note": "n", "extra": [1, {"y": 2}]}]),
    Case("nested", {"type": "object", "required": ["user"], "properties": {"user": {
        "type": "object", "required": ["id", "address"], "properties": {
            "id": {"type": "integer"},
            "address": {"type": "object", "required": ["city"], "additionalProperties": False,
                        "properties": {"city": {"type": "string"}, "zip": {"type": "string"}}}}}}},
        [{"user": {"id": 1, "address": {"city": "Oslo"}}},
         {"user": {"address": {"zip": "0150", "city": "Bergen"}, "id": 22, "more": False}}]),
    Case("array", {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
         [[1, 2], [0, -1, 20, 300], [5, 6, 7]]),
    Case("prefix", {"type": "array", "prefixItems": [{"type": "string"}, {"type": "number"}, {"type": "boolean"}],
                    "items": False, "minItems": 1},
         [["a"], ["a", 1.5], ["é", 2, False]]),
    Case("prefix_then_items", {"type": "array", "prefixItems": [{"type": "string"}], "items": {"type": "null"}},
         [[], ["x"], ["x", None, None]]),
    Case("enum", {"enum": ["red", "grün", 1, 12, 2.5, True, None, {"a": [1]}, [1, "x"]]},
         ["red", 1, 12, 2.5, True, None], literal=["grün", {"a": [1]}, [1, "x"]]),
    Case("enum_in_object", {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "greenish"]}, "n": {"enum": [1, 12, 123]}}},
        [{"color": "green", "n": 12}, {"n": 1}, {"n": 123, "color": "greenish"}]),
    Case("const", {"type": "object", "required": ["kind", "r"], "properties": {
        "kind": {"const": "circle"}, "r": {"type": "number"}}},
        [{"kind": "circle", "r": 2}, {"r": 0.5, "kind": "circle"}]),
    Case("any_of_shapes", {"anyOf": [
        {"type": "object", "required": ["kind", "r"], "additionalProperties": False,
         "properties": {"kind": {"const": "circle"}, "r": {"type": "number"}}},
        {"type": "object", "required": ["kind", "w", "h"], "additionalProperties": False,
         "properties": {"kind": {"const": "rect"}, "w": {"type": "number"}, "h": {"type": "number"}}},
        {"type": "null"}]},
        [{"kind": "circle", "r": 1}, {"w": 2, "kind": "rect", "h": 3}, None]),
    Case("defs_refs", {"$defs": {"point": POINT}, "definitions": {"point2": {"allOf": [{"$ref": "#/$defs/point"}],
                                                                             "description": "the same"}},
                       "type": "object", "required": ["a"], "properties": {
                           "a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/definitions/point2"},
                           "path": {"type": "array", "items": {"$ref": "#/$defs/point"}}}},
         [{"a": {"x": 1, "y": 2}}, {"b": {"y": 0, "x": -1}, "a": {"x": 1.5, "y": 2}, "path": [{"x": 0, "y": 0}]}]),
    Case("tree", {"type": "object", "required": ["name"], "additionalProperties": False, "properties": {
        "name": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#"}}}},
        [{"name": "root"}, {"name": "r", "children": [{"name": "a", "children": []},
                                                      {"name": "b", "children": [{"name": "c"}]}]}]),
    Case("strings", {"type": "object", "additionalProperties": False, "properties": {
        "short": {"type": "string", "maxLength": 3}, "long": {"type": "string", "minLength": 2, "maxLength": 6},
        "any": {"type": "string"}}},
        [{"short": "né", "long": "日本語"}, {"short": "😀ab", "long": "a\"\\b"}, {"long": "😀😀"},
         {"any": "tab\t new\n ☃ \u0001 \U0001F600 \\u / \u2028"}]),
    Case("numbers", {"type": "object", "additionalProperties": False, "properties": {
        "i": {"type": "integer"}, "n": {"type": "number"}}},
        [{"i": 0, "n": 0}, {"i": -12, "n": 1.25e-7}, {"i": 10 ** 20, "n": -0.0}, {"n": 1e300}, {"n": 12.5}]),
    Case("additional_false", {"type": "object", "additionalProperties": False, "properties": {
        "a": {"type": "integer"}, "ab": {"type": "string"}}},
        [{}, {"a": 1}, {"ab": "x", "a": 2}]),
    Case("additional_schema", {"type": "object", "required": ["a"], "properties": {"a": {"type": "integer"}},
                               "additionalProperties": {"type": "string"}},
         [{"a": 1, "b": "x", "é": "y"}, {"a": 2}]),
    Case("strict", STRICT_SCHEMA, [{"a": 1}, {"a": 1, "o": {"x": "y"}}, {"o": {}, "a": 2}], strict=True,
         oracle=strict_oracle(STRICT_SCHEMA)),
    Case("property_counts", {"type": "object", "required": ["c"], "minProperties": 2, "maxProperties": 2,
                             "properties": {"a": {"type": "integer"}, "b": {"type": "integer"},
                                            "c": {"type": "integer"}}},
         [{"a": 1, "c": 2}, {"c": 1, "b": 2}, {"c": 1, "z": None}]),
    Case("patterns", {"type": "object", "additionalProperties": False, "properties": {
        "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "ab": {"type": "string", "pattern": "^[aé]b?$"}, "tab": {"type": "string", "pattern": "^x\\t[😀\\\\]$"},
        "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]*$"},
        "ci": {"type": "string", "pattern": "(?i)^ab+$"},  # a flag the automaton follows
        "la": {"type": "string", "pattern": "^(?=a)ab+$"}}},  # lookahead: the regex package's search
        [{"date": "2024-01-31", "ab": "éb"}, {"ab": "a", "tab": "x\t😀"}, {"tab": "x\t\\", "code": "AB"},
         {"date": "0000-00-00", "code": "XY0123", "ci": "aBb", "la": "abb"}]),
    Case("bounded_patterns", {"type": "object", "additionalProperties": False, "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]*$", "maxLength": 5},
        "word": {"type": "string", "pattern": "ab", "minLength": 4, "maxLength": 6},
        "tail": {"type": "string", "pattern": "}$", "minLength": 3},     # `$` also before a final newline
        "even": {"type": "string", "pattern": "^(aa)+$", "maxLength": 5},  # 2 or 4 characters
        "emoji": {"type": "string", "pattern": "^😀+é$", "minLength": 3, "maxLength": 3}}},
        [{"code": "AB12", "word": "xaby", "tail": "ab}", "even": "aaaa"}, {"code": "AB", "even": "aa"},
         {"word": "abab12", "tail": "}}\n", "emoji": "😀😀é"}, {"word": "\u00e9\u00e9ab", "tail": "}\u00e9}"}]),
    Case("json_object", None, [{}, {"a": [1, 2, {"b": None}]}]),
    Case("any", True, [1, "x", [], {"a": {"b": [True, None, -1.5]}}, -0.5e10, 0]),
]
CASE = {c.name: c for c in CASES}

STYLES = {
    "compact": dict(separators=(",", ":"), ensure_ascii=False),
    "compact_ascii": dict(separators=(",", ":")),
    "default": {},
    "default_unicode": dict(ensure_ascii=False),
    "indent": dict(indent=2, ensure_ascii=False),
    "indent_ascii": dict(indent=2),
}


def grammar(case: Case, **kwargs):
    return compile_schema(case.schema, strict=case.strict, **kwargs)


def is_valid_document(doc: bytes, case: Case) -> bool:
    """Per the oracle (a key given twice counts as invalid: the matcher refuses it)."""
    try:
        value = json.loads(doc, object_pairs_hook=no_duplicate_keys)
    except (ValueError, AssertionError):
        return False
    return jsonschema.Draft202012Validator(case.oracle).is_valid(value)


def feed_bytes(g, doc: bytes):
    """States after each byte of doc, fed one at a time, but a whole character at a time where the state lies
    between whole characters (`whole_characters_at`: inside a string with a pattern), the state after it then
    standing for each of its bytes (stops at the first rejection: the list is shorter)."""
    states, state, k = [], g.start, 0
    between = getattr(g, "whole_characters_at", None)
    while k < len(doc):
        step = g.character_length(doc, k) if between is not None and between(state) else 1
        state = g.advance(state, doc[k:k + step]) if step else None
        if state is None:
            break
        states += [state] * step
        k += step
    return states


def feed_chunks(g, doc: bytes, rng: random.Random):
    """The state after doc fed in random chunks of 1-8 bytes (a cut inside a pattern string's character moves to
    its end)."""
    state, k = g.start, 0
    while k < len(doc) and state is not None:
        step = rng.randint(1, 8)
        nxt = g.advance(state, doc[k:k + step])
        while nxt is None and hasattr(g, "whole_characters_at") and k + step < len(doc) and step < 20:
            step += 1
            nxt = g.advance(state, doc[k:k + step])
        state, k = nxt, k + step
    return state


def first_rejection(g, doc: bytes):
    """Index of the first byte of doc that no valid document can have there (None if all are accepted)."""
    states = feed_bytes(g, doc)
    return None if len(states) == len(doc) else len(states)


def documents():
    for case in CASES:
        for value in case.valid:
            for style, kwargs in STYLES.items():
                yield case, value, style, json.dumps(value, **kwargs).encode()
        for value in case.literal:
            yield case, value, "compact", json.dumps(value, **STYLES["compact"]).encode()


DOCUMENTS = list(documents())


# ---------------------------------------------------------------------------------------------------------------
# 1. Valid documents


def test_oracle_agrees_the_instances_are_valid():
    for case, value, _, _ in DOCUMENTS:
        jsonschema.validate(value, case.oracle, cls=jsonschema.Draft202012Validator)


@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_valid_documents_are_accepted_byte_by_byte_and_complete_only_at_the_end(name):
    case = CASE[name]
    g = grammar(case)
    for _, value, style, doc in DOCUMENTS:
        if _ is not case:
            continue
        states = feed_bytes(g, doc)
        assert len(states) == len(doc), f"{style}: rejected at byte {len(states)} of {doc!r}"
        for k, state in enumerate(states[:-1]):
            # a strict prefix is complete only where it is itself a valid document (a top-level number)
            assert g.complete(state) == is_valid_document(doc[:k + 1], case), (style, doc[:k + 1])
            assert g.can_continue(state)
        assert g.complete(states[-1]), (style, doc)
        hash(states[-1])


@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_valid_documents_are_accepted_in_random_chunks(name):
    case = CASE[name]
    g = grammar(case)
    rng = random.Random(name)
    for _, value, style, doc in DOCUMENTS:
        if _ is not case:
            continue
        by_bytes = feed_bytes(g, doc)[-1]
        for _ in range(4):
            state = feed_chunks(g, doc, rng)
            assert state is not None and g.complete(state), (style, doc)
            assert state == by_bytes, "the state must not depend on how the bytes were cut"
        assert g.advance(g.start, doc) == by_bytes


def test_whitespace_around_the_document_and_its_limit():
    g = compile_schema({"type": "object"}, max_whitespace=3)
    state = g.advance(g.start, b'   {"a" :\t1 }\n\r ')
    assert g.complete(state) and not g.can_continue(state)
    assert g.advance(state, b" ") is None
    state = g.advance(g.start, b"{}")
    assert g.complete(state) and g.can_continue(state)
    g0 = compile_schema(True, max_whitespace=0)
    state = g0.advance(g0.start, b"[1,2]")
    assert g0.complete(state) and not g0.can_continue(state)
    assert g0.advance(g0.start, b"[ 1]") is None


def test_top_level_number_is_complete_and_may_continue():
    g = compile_schema({"type": "number"})
    for prefix, complete in [(b"-", False), (b"-1", True), (b"-1.", False), (b"-1.5", True), (b"-1.5e", False),
                             (b"-1.5e+", False), (b"-1.5e+3", True), (b"-1.5e+3 ", True)]:
        state = g.advance(g.start, prefix)
        assert state is not None and g.complete(state) == complete and g.can_continue(state), prefix
    g = compile_schema({"enum": [1, 12]})
    state = g.advance(g.start, b"1")
    assert g.complete(state) and g.can_continue(state)
    state = g.advance(state, b"2")
    assert g.complete(state)


def test_key_spelled_with_escapes_takes_the_declared_schema():
    g = grammar(CASE["additional_schema"])
    assert g.complete(g.advance(g.start, b'{"\\u0061":1}'))
    assert first_rejection(g, b'{"\\u0061":"x"}') == len(b'{"\\u0061":')
    doc = b'{"a":1,"\\u0061":2}'
    assert first_rejection(g, doc) == doc.index(b'":2')  # the same key twice: refused at its closing quote


def test_states_are_hashable_and_alternatives_collapse():
    g = grammar(CASE["any_of_shapes"])
    state = g.advance(g.start, b"{")
    assert isinstance(state, frozenset) and len(state) == 2
    memo = {(state, b'"kind":"c'): g.advance(state, b'"kind":"c')}
    narrowed = g.advance(state, b'"kind":"c')
    assert isinstance(narrowed, tuple) and memo[(state, b'"kind":"c')] == narrowed
    assert g.advance(g.start, b"n") == g.advance(g.start, b"n")
    assert g.advance(g.start, b"") == g.start


# ---------------------------------------------------------------------------------------------------------------
# 2. Invalid documents: rejected at the first byte no valid document can continue (marked by `at`)

RULE = "valid JSON for the schema, refused by a documented rule"
REJECTIONS = [
    # (case, document, the bytes that start at the first rejected byte[, RULE])
    ("flat", b'{"name":"x"}', b"}"),                                          # missing required key
    ("flat", b'{"name":1}', b"1}"),                                           # wrong type
    ("flat", b'{"name":"x","age":1.5}', b".5}"),                              # integer, not number
    ("flat", b'{"name":"x","age":1}x', b"x"),                                 # trailing garbage
    ("flat", b'{"name":"x","age":1} {', b"{"),
    ("flat", b'{"name":"x","name":"y","age":1}', b'":"y"'),                   # duplicate key
    # "city" was given, so no key may start with "c" any more
    ("nested", b'{"user":{"id":1,"address":{"city":"a","country":"b"}}}', b'country'),
    ("array", b"[1,2,3,4,5]", b",5]"),                                        # too many items
    ("array", b"[1]", b"]"),                                                  # too few
    ("array", b'[1,"2"]', b'"2"]'),
    ("prefix", b'["a",1,true,null]', b",null]"),
    ("prefix", b"[]", b"]"),
    ("prefix", b'[1]', b"1]"),
    ("enum", b'"rex"', b'x"'),
    ("enum", b"13", b"3"),
    ("enum", b'{"a": [1]}', b" [1]}", RULE),                                  # valid, but enum values must be compact
    ("enum_in_object", b'{"color":"greenish","n":124}', b"4}"),
    ("const", b'{"kind":"circlx","r":1}', b'x"'),
    ("any_of_shapes", b'{"kind":"circle","w":1}', b'w"'),
    ("any_of_shapes", b'{"kind":"rect","w":1}', b"}"),
    ("tree", b'{"name":"r","children":[{"children":[]}]}', b"}]}"),
    ("tree", b'{"name":"r","children":[1]}', b"1]}"),
    ("strings", b'{"long":"a"}', b'"}'),                                      # too short
    ("strings", b'{"short":"abcd"}', b'd"}'),                                 # too long
    ("strings", b'{"short":"\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9"}', b'\xc3\xa9"}'),
    ("strings", b'{"short":"\\n\\n\\n\\n"}', b'\\n"}'),
    ("strings", b'{"any":"\\x"}', b'x"}'),                                    # bad escape
    ("strings", b'{"any":"\\u12g4"}', b'g4"}'),
    ("strings", b'{"any":"\\udc00"}', b'c00"}', RULE),                        # lone low surrogate
    ("strings", b'{"any":"\\ud83dx"}', b'x"}', RULE),                         # high surrogate without its low one
    ("strings", b'{"any":"\xff"}', b'\xff"}'),                                # invalid UTF-8
    ("strings", b'{"any":"\x80"}', b'\x80"}'),
    ("strings", b'{"any":"\xc3\x28"}', b'\x28"}'),
    ("strings", b'{"any":"\xed\xa0\x80"}', b'\xa0\x80"}', RULE),              # an encoded surrogate
    ("strings", b'{"any":"\xe6\x97"}', b'"}'),                                # cut short
    ("strings", b'{"any":"a\nb"}', b'\nb"}'),                                 # raw control byte
    ("patterns", b'{"date":"2024-1x"}', b'x"}'),                              # no match can begin this way
    ("bounded_patterns", b'{"code":"AB1234"}', b'4"}'),                       # maxLength
    ("bounded_patterns", b'{"code":"A1"}', b'1"}'),
    ("bounded_patterns", b'{"even":"aaa"}', b'"}'),                           # a match not reached yet
    ("bounded_patterns", b'{"even":"aaaaa"}', b'a"}'),                        # the only longer match is too long
    ("bounded_patterns", b'{"word":"xxxxx"}', b'x"}'),                        # "ab" no longer fits in 6
    ("bounded_patterns", b'{"word":"xxxxa"}', b'"}'),                           # "ab" needs the sixth
    ("bounded_patterns", b'{"word":"ab"}', b'"}'),                            # minLength
    ("bounded_patterns", b'{"tail":"}}"}', b'"}'),
    ("bounded_patterns", b'{"tail":"}}a"}', b'"}'),                           # long enough, no match
    ("bounded_patterns", b'{"emoji":"\xf0\x9f\x98\x80\xf0\x9f\x98\x80\xf0\x9f\x98\x80"}', b'\xf0\x9f\x98\x80"}'),
    ("patterns", b'{"date":"2024-01"}', b'"}'),                                 # a match not reached yet
    ("patterns", b'{"ab":"abb"}', b'b"}'),
    ("patterns", b'{"ab":"b"}', b'b"}'),
    ("patterns", b'{"ab":"\\u00e9bb"}', b'b"}'),                               # escapes are read as their text
    ("patterns", b'{"tab":"x\\t\\ud83d\\ude00!"}', b'!"}'),
    ("patterns", b'{"code":"A\xc3\xa9"}', b'\xc3\xa9"}'),
    ("patterns", b'{"ci":"Abc"}', b'c"}'),
    ("numbers", b'{"i":01}', b"1}"),
    ("numbers", b'{"n":1.}', b"}"),
    ("numbers", b'{"n":-}', b"}"),
    ("numbers", b'{"n":.5}', b".5}"),
    ("numbers", b'{"n":1e}', b"}"),
    ("additional_false", b'{"ac":1}', b'c":1}'),                              # extra key
    ("additional_false", b'{"b":1}', b'b":1}'),
    ("additional_false", b'{"a":1,"a":2}', b'":2}'),
    ("additional_false", b'{"a":1,"ab":"x",}', b",}"),                        # no key left to give
    ("additional_schema", b'{"a":1,"b":2}', b"2}"),
    ("strict", b'{"a":1,"z":1}', b'z":1}'),
    ("strict", b'{"a":1,"o":{"y":1}}', b'y":1}}'),
    ("property_counts", b'{"a":1,"b":2}', b'b":2}'),
    ("property_counts", b'{"c":1}', b"}"),
    ("property_counts", b'{"c":1,"a":2,', b","),
    ("json_object", b"[1]", b"[1]"),
    ("json_object", b'"x"', b'"x"'),
    ("any", b"[1,]", b"]"),
    ("any", b"{,}", b",}"),
    ("any", b"tru ", b" "),
    ("any", b"12a", b"a"),
    ("any", b" " * 21 + b"1", b" 1", RULE),                                   # whitespace run over the limit (20)
    ("any", b"[1," + b"\n" * 21 + b"2]", b"\n2]", RULE),
    ("any", b"1" + b"\t" * 21, b"\t", RULE),
]


@pytest.mark.parametrize("name,doc,at,why", [r + (None,) * (4 - len(r)) for r in REJECTIONS],
                         ids=[f"{r[0]}-{i}" for i, r in enumerate(REJECTIONS)])
def test_invalid_documents_are_rejected_at_the_first_bad_byte(name, doc, at, why):
    case = CASE[name]
    g = grammar(case)
    assert is_valid_document(doc, case) == (why == RULE)
    assert first_rejection(g, doc) == doc.rindex(at), doc
    assert g.advance(g.start, doc) is None


# ---------------------------------------------------------------------------------------------------------------
# 3. Random walks over the accepted bytes end in documents the oracle validates

CANDIDATES = ([bytes([b]) for b in range(256)]
              + ["é".encode(), "中".encode(), "😀".encode()]
              + [b'{"', b'":', b'",', b'": "', b"},", b"],", b"true", b"null", b"  ", b"\\u00e9", b"\\ud83d\\ude00",
                 b"\\n", b"\\t", b"12", b"-0.5e3"])
FINISHERS = [b'"', b"}", b"]", b",", b"0", b"n", b"f", b"t"]


def key_tokens(schema) -> list:
    """Every property name the schema declares, as a quoted key: random bytes would seldom spell a required one."""
    names = set()

    def visit(node):
        if isinstance(node, dict):
            names.update(node.get("properties", {}) if isinstance(node.get("properties"), dict) else ())
            for v in node.values():
                visit(v)
        elif isinstance(node, list):
            for v in node:
                visit(v)

    visit(schema)
    return [json.dumps(n, ensure_ascii=False).encode() for n in sorted(names)]


def random_walk(g, rng: random.Random, keys: list) -> bytes:
    """A document built by picking, each step, a random candidate the grammar accepts; past a few dozen bytes the
    walk prefers declared keys and bytes that close things, and it stops at a complete document when a coin says
    so."""
    state, doc = g.start, b""
    while True:
        if g.complete(state) and (not g.can_continue(state) or rng.random() < 0.3):
            return doc
        assert g.can_continue(state), doc
        order = rng.sample(CANDIDATES, len(CANDIDATES))
        if rng.random() < min(0.95, len(doc) / 60):
            order = rng.sample(keys, len(keys)) + FINISHERS + order
        for token in order:
            nxt = g.advance(state, token)
            if nxt is not None:
                break
        else:
            raise AssertionError(f"stuck after {doc!r}")
        state, doc = nxt, doc + token
        assert len(doc) < 4000, doc


def no_duplicate_keys(pairs):
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)), keys
    return dict(pairs)


@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_random_walks_validate(name):
    case = CASE[name]
    g = grammar(case)
    validator = jsonschema.Draft202012Validator(case.oracle)
    rng = random.Random(f"walk-{name}")
    keys = key_tokens(case.schema)
    for _ in range(25):
        doc = random_walk(g, rng, keys)
        value = json.loads(doc, object_pairs_hook=no_duplicate_keys)
        errors = list(validator.iter_errors(value))
        assert not errors, (doc, errors[0].message)


# ---------------------------------------------------------------------------------------------------------------
# 4. Schemas the matcher cannot honour

BAD_SCHEMAS = [
    ({"type": "string", "pattern": "^(aa)+\\Z", "minLength": 3, "maxLength": 3},
     ["schema at #", "matches no string of 3 to 3 characters"]),
    ({"type": "object", "properties": {"a": {"allOf": [{"type": "string"}, {"minLength": 1}]}}},
     ["#/properties/a", "'allOf' with 2 subschemas is not supported"]),
    ({"$ref": "#/definitions/X"}, ["schema at #", "$ref '#/definitions/X' not found"]),
    ({"properties": {"a": {"$ref": "other.json#/x"}}}, ["#/properties/a", "$ref 'other.json#/x'"]),
    ({"patternProperties": {"^a": {}}}, ["schema at #", "'patternProperties' is not supported"]),
    ({"properties": {"a~b/c": {"not": {"type": "null"}}}}, ["#/properties/a~0b~1c", "'not'"]),
    ({"items": {"if": {}, "then": {}}}, ["#/items", "'if'"]),
    ({"type": "array", "contains": {"type": "null"}}, ["'contains'"]),
    ({"dependentRequired": {"a": ["b"]}}, ["'dependentRequired'"]),
    ({"properties": {"a": {"type": "string", "foo": 1}}}, ["#/properties/a", "unknown keyword 'foo'"]),
    (False, ["schema at # is false"]),
    ({"properties": {"a": {"items": False, "minItems": 1}}}, ["#/properties/a", "'minItems'"]),
    ({"anyOf": [False, False]}, ["'anyOf' has no satisfiable subschema"]),
    ({"type": "strin"}, ["schema at #", "'type'"]),
    ({"enum": []}, ["'enum'"]),
    ({"type": "string", "enum": [1, 2]}, ["'enum'"]),
    ({"enum": [1], "const": 2}, ["'const'"]),
    ({"enum": [float("nan")]}, ["not a JSON value"]),
    ({"type": "string", "minLength": 5, "maxLength": 2}, ["'minLength' 5 exceeds 'maxLength' 2"]),
    ({"minLength": -1}, ["'minLength' must be an int >= 0"]),
    ({"type": "object", "required": ["b"], "properties": {"a": {}}, "additionalProperties": False},
     ["'required' names 'b'"]),
    ({"type": "object", "required": ["a"], "properties": {"a": False}}, ["'required' names 'a'"]),
    ({"$defs": {"A": {"$ref": "#/$defs/A"}}, "$ref": "#/$defs/A"}, ["refers back to itself"]),
    ({"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}, ["no finite object"]),
    ({"items": [{}]}, ["'items' as a list"]),
    ({"type": "object", "required": ["a", "b"], "maxProperties": 1}, ["'maxProperties'"]),
    ({"type": "integer", "allOf": [{"type": "string"}]}, ["'type'", "no type in common"]),
    ({"properties": {"a": 3}}, ["#/properties/a", "must be an object or a boolean"]),
]


@pytest.mark.parametrize("schema,needles", BAD_SCHEMAS, ids=[str(i) for i in range(len(BAD_SCHEMAS))])
def test_bad_schemas_raise_with_pointer_and_keyword(schema, needles):
    with pytest.raises(ValueError) as err:
        compile_schema(schema)
    for needle in needles:
        assert needle in str(err.value), str(err.value)


@pytest.mark.parametrize("value", [-1, 2.0, "3", True, None])
def test_bad_max_whitespace(value):
    with pytest.raises(ValueError, match="max_whitespace"):
        compile_schema(True, max_whitespace=value)


def test_unenforced_and_annotation_keywords_are_accepted():
    g = compile_schema({"title": "t", "description": "d", "$schema": "x", "$comment": "c", "type": "object",
                        "properties": {"s": {"type": "string", "pattern": "(?=a)", "maxLength": 9, "format": "date",
                                             "default": "a"},
                                       "n": {"type": "number", "minimum": 0, "multipleOf": 2, "examples": [2]},
                                       "l": {"type": "array", "uniqueItems": True, "deprecated": True}}})
    assert g.complete(g.advance(g.start, b'{"s":"b","n":-1,"l":[1,1]}'))  # not enforced, as documented


def test_a_bounded_pattern_takes_python_s_dollar():
    """`$` also matches before a final newline (Python's `re`, as `jsonschema` checks): with exactly 3 characters
    `^(aa)+$` takes "aa\\n" and nothing else."""
    g = compile_schema({"type": "string", "pattern": "^(aa)+$", "minLength": 3, "maxLength": 3})
    assert g.complete(g.advance(g.start, b'"aa\\n"'))
    assert g.advance(g.start, b'"aaa') is None and g.advance(g.start, b'"aa"') is None


def test_any_of_siblings_and_single_all_of_are_folded_in():
    g = compile_schema({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                        "additionalProperties": False, "anyOf": [{"required": ["a"]}, {"required": ["b"]}]})
    assert g.complete(g.advance(g.start, b'{"b":1}'))
    assert g.advance(g.start, b"{}") is None
    g = compile_schema({"allOf": [{"$ref": "#/$defs/s"}], "$defs": {"s": {"type": "string", "maxLength": 1}}})
    assert g.complete(g.advance(g.start, b'"x"')) and g.advance(g.start, b'"xy') is None


# ---------------------------------------------------------------------------------------------------------------
# 5. Throughput


def test_advance_throughput():
    """Decoder-like workload: each document cut into 1-4 byte tokens; at each step three other candidates (most of
    them refused) are tried before the right one, four advances per step, as a decoder going down its probability
    order does."""
    rng = random.Random(0)
    work = []
    for case in (CASE["flat"], CASE["tree"], CASE["strings"], CASE["any_of_shapes"]):
        g = grammar(case)
        for value in case.valid:
            doc = json.dumps(value, indent=2, ensure_ascii=False).encode()
            cuts, k = [], 0
            while k < len(doc):
                step = rng.randint(1, 4)
                cuts.append(doc[k:k + step])
                k += step
            work.append((g, cuts))
    wrong = [b"}", b"xyz", b"\x01"]
    advances = 0
    begin = time.perf_counter()
    for _ in range(20):
        for g, cuts in work:
            state = g.start
            for token in cuts:
                for candidate in wrong:
                    g.advance(state, candidate)
                state = g.advance(state, token)
                advances += 4
            assert g.complete(state)
    rate = advances / (time.perf_counter() - begin)
    print(f"\njson_grammar: {rate:,.0f} advances/s ({advances} advances, tokens of 1-4 bytes)")
    assert rate > 5_000  # loose: the measured figure is printed above


PLAIN = [b"a", b"abc def", "é漢😀".encode(), b"~!#", b" "]
NOT_PLAIN = [b'"', b"a\\", b"\n", "é".encode()[:1], b"\x01"]


def test_plain_text_is_taken_wherever_the_grammar_says_so():
    """Wherever `takes_plain_text` holds along the valid documents, every plain run is accepted; it holds inside
    unbounded strings and any-string keys, not inside bounded strings (where the length decides)."""
    assert all(JsonGrammar.is_plain_text(p) for p in PLAIN)
    assert not any(JsonGrammar.is_plain_text(p) for p in NOT_PLAIN)
    said = 0
    for case, _, _, doc in DOCUMENTS:
        g = grammar(case)
        for state in feed_bytes(g, doc):
            if g.takes_plain_text(state):
                said += 1
                assert all(g.advance(state, p) is not None for p in PLAIN), (case.name, doc)
    assert said > 100
    bounded = compile_schema({"type": "string", "maxLength": 40})
    assert not bounded.takes_plain_text(bounded.advance(bounded.start, b'"ab'))
    free = compile_schema({"type": "string"})
    assert free.takes_plain_text(free.advance(free.start, b'"ab'))
    assert not free.takes_plain_text(free.advance(free.start, b'"a\\'))


# ---------------------------------------------------------------------------------------------------------------
# 6. Large numbers, large schemas and malformed ones

HUGE = [10 ** 9, 10 ** 18]


def huge_schemas(n: int) -> list:
    """(schema, pieces of a document that grows toward its count)"""
    items, strings, keys = [b"[", b'"a"', b",", b"1", b",", b"null"], [b'"', b"aa", b"a"], [b"{", b'"k"', b":", b"1"]
    return [({"type": "array", "minItems": n}, items), ({"type": "array", "maxItems": n}, items),
            ({"type": "array", "minItems": n, "maxItems": n, "items": {"type": "integer"}}, [b"[", b"7", b",", b"8"]),
            ({"type": "array", "prefixItems": [{"type": "string"}] * 3, "minItems": n},
             [b'["a"', b",", b'"b"', b',"c"', b",", b"1"]),
            ({"type": "string", "minLength": n}, strings), ({"type": "string", "maxLength": n}, strings),
            ({"type": "string", "minLength": n, "maxLength": n}, strings),
            ({"type": "string", "minLength": n, "pattern": "^[a-z]+$"}, strings),
            ({"type": "string", "maxLength": n, "pattern": "^(a{256}){8}$"}, strings),
            ({"type": "string", "minLength": n, "maxLength": n, "pattern": "^((a?){64}){16}$"}, strings),
            ({"type": "object", "minProperties": n}, keys), ({"type": "object", "maxProperties": n}, keys),
            ({"type": "object", "minProperties": n, "maxProperties": n}, keys),
            ({"type": "object", "required": ["a"], "properties": {"a": {"type": "array", "minItems": n, "items": {
                "$ref": "#/$defs/leaf"}}}, "$defs": {"leaf": {"anyOf": [{"type": "null"}, {"$ref": "#"}]}}},
             [b'{"a":[', b"null", b",", b'{"a":[null', b",null"])]


@pytest.mark.parametrize("n", HUGE)
def test_huge_counts_compile_at_once_and_decode_in_constant_steps(n):
    """A count of 10**9 or 10**18 (minItems, maxLength, minProperties, ..., beside a pattern too) compiles in well
    under a second (minItems once cost a loop over every item: minutes), and the matcher still reads documents
    that grow toward it."""
    for schema, pieces in huge_schemas(n):
        started = time.perf_counter()
        g = compile_schema(schema)
        assert time.perf_counter() - started < FAST, schema
        state = g.start
        for piece in pieces:
            state = g.advance(state, piece)
            assert state is not None, (schema, piece)
        assert not g.complete(state) or "maxItems" in schema or "maxProperties" in schema, schema


@pytest.mark.parametrize("minimum", [0, 1, 2, 3, 4, 5])
def test_small_min_items_still_hold_with_prefix_items(minimum):
    """minItems after prefixItems: the closing bracket comes only once there are enough items, whichever node they
    take (the finiteness check looks at the prefix and one item past it: the rest share that node)."""
    schema = {"type": "array", "prefixItems": [{"type": "string"}, {"type": "boolean"}], "items": {"type": "integer"},
              "minItems": minimum}
    g = compile_schema(schema)
    docs = ["[]", '["a"]', '["a",true]', '["a",true,1]', '["a",true,1,2]', '["a",true,1,2,3]']
    for doc in docs:
        ok = len(json.loads(doc)) >= minimum
        assert (g.advance(g.start, doc.encode()) is not None) == ok, doc
        jsonschema.validate(json.loads(doc), schema) if ok else None


def test_min_items_that_reach_a_node_without_an_end_are_refused():
    """An array whose items past its prefix are that array again ends only while minItems stays within the prefix
    (the finiteness check looks at the prefix and one item past it: every later item shares that node)."""
    for k in range(3):
        schema = {"type": "array", "prefixItems": [{"type": "null"}] * k, "items": {"$ref": "#"}, "minItems": k}
        g = compile_schema(schema)
        assert g.complete(g.advance(g.start, json.dumps([None] * k).encode()))
        for minimum in (k + 1, k + 2, 10 ** 18):
            started = time.perf_counter()
            with pytest.raises(ValueError, match="no finite array"):
                compile_schema({**schema, "minItems": minimum})
            assert time.perf_counter() - started < FAST
    with pytest.raises(ValueError, match="no finite array"):  # the prefix itself recurses
        compile_schema({"type": "array", "prefixItems": [{"type": "null"}, {"$ref": "#"}], "minItems": 2})


def test_long_enum_values_and_keys_take_little_memory():
    """Enum/const strings and declared keys are matched through their sorted spellings, not a table of every
    prefix (quadratic: 20,000 characters once took 200 MB, 100,000 gigabytes); many values compile at once too."""
    import tracemalloc

    long = "é" + "a" * 20_000
    tracemalloc.start()
    try:
        g = compile_schema({"type": "object", "additionalProperties": False, "required": [long], "properties": {
            long: {"enum": [long, long + "b", "x"]}}})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 20_000_000, peak
    key = json.dumps(long, ensure_ascii=False).encode()
    state = g.advance(g.start, b"{" + key[:9000])
    state = g.advance(state, key[9000:] + b":" + key[:-1])
    assert state is not None and g.advance(state, b"c") is None
    assert g.complete(g.advance(state, b'"}')) and g.complete(g.advance(state, b'b"}'))
    assert g.advance(g.start, b"{" + key[:-2] + b'b"') is None
    started = time.perf_counter()
    many = compile_schema({"enum": [str(k) for k in range(20_000)]})  # (a pairwise prefix check: minutes)
    assert time.perf_counter() - started < FAST
    assert many.complete(many.advance(many.start, b'"19999"')) and many.advance(many.start, b'"20000') is None


@pytest.mark.parametrize("pattern", ["[^\\x00-\\U0010ffff]", "[^\\s\\S]x", "\\ud800", "(?i)[^\\d\\D]"])
def test_a_pattern_that_matches_no_string_is_refused(pattern):
    """(The automaton knows; `regex`'s partial search, where such classes once went, says the empty text could
    still grow into a match, and a started string then had no way on.)"""
    with pytest.raises(ValueError, match="matches no string"):
        compile_schema({"type": "string", "pattern": pattern})


def test_a_fallback_pattern_with_huge_counts_is_refused_at_once():
    """A pattern left to the `regex` package (a lookahead, or counts past the automaton's) whose counted repeats
    `regex` would write out (`a{1000000000}`: minutes) is refused, naming the keyword."""
    for pattern in ["(?=a)a{1000000000}", "a{100000}", "((a{100}){100}){100}"]:
        started = time.perf_counter()
        with pytest.raises(ValueError, match="'pattern'.*counted repeats"):
            compile_schema({"type": "string", "pattern": pattern})
        assert time.perf_counter() - started < FAST
    compile_schema({"type": "string", "pattern": "(?=a)a{1000}"})  # (smaller counts are fine)


MALFORMED = [
    ({"type": "nonsense"}, "schema at #: 'type' must be one of"),
    ({"properties": 5}, "schema at #: 'properties' must be an object"),
    ({"type": "object", "required": "a"}, "schema at #: 'required' must be a list of strings"),
    ({"properties": {"a": {"$ref": "#/$defs/missing"}}}, "schema at #/properties/a: $ref '#/$defs/missing' not found"),
    ({"items": {"minItems": -1}}, "schema at #/items: 'minItems' must be an int >= 0"),
    ({"anyOf": [{"type": "string", "maxLength": 1, "minLength": 2}]}, "'minLength' 2 exceeds 'maxLength' 1"),
    ({"properties": {"a": {"pattern": "[a-"}}}, "schema at #/properties/a: 'pattern' '[a-' does not compile"),
    ({"oneOf": []}, "'oneOf' must be a non-empty list of schemas"),
    ({"prefixItems": [{}, 3]}, "schema at #/prefixItems/1 must be an object or a boolean"),
    ({"$defs": {"a": {"enum": 3}}, "properties": {"x": {"$ref": "#/$defs/a"}}}, "schema at #/$defs/a: 'enum' must be"),
    ({"items": [{"type": "strin"}]}, "schema at #/items/0: 'type' must be one of"),
]
UNSUPPORTED_BUT_VALID = [  # (older drafts' forms say so: the oracle checks each against its own draft)
    {"$schema": "http://json-schema.org/draft-03/schema#", "type": "object", "properties": {
        "a": {"type": "string", "required": True, "nullable": True}}},  # draft 3's required, OpenAPI's nullable
    {"not": {"type": "string"}, "patternProperties": {"^x": {"type": "integer"}}, "if": {"minLength": 3}},
    {"allOf": [{"type": "object"}, {"required": ["a"]}]},
    {"$schema": "http://json-schema.org/draft-07/schema#", "items": [{"type": "string"}, True]},
    {"$ref": "https://example.com/schema.json"}, {"$ref": "#anchor"}, {"type": "string", "pattern": "(?<=a)b"},
    {"type": "integer", "enum": ["a"]},
]


@pytest.mark.parametrize("schema,message", MALFORMED, ids=[str(i) for i in range(len(MALFORMED))])
def test_malformed_schemas_are_refused_alike_by_validate_schema_and_compile_schema(schema, message):
    """`validate_schema` (what a forced tool call's parameters get) refuses what `compile_schema` (a
    response_format's schema) refuses as malformed, with the same message."""
    from openm3.engine.json_grammar import validate_schema

    for check in (validate_schema, compile_schema):
        with pytest.raises(ValueError) as err:
            check(schema)
        assert message in str(err.value), (check.__name__, str(err.value))


@pytest.mark.parametrize("schema", UNSUPPORTED_BUT_VALID, ids=[str(i) for i in range(len(UNSUPPORTED_BUT_VALID))])
def test_valid_schemas_pass_validate_schema_whatever_compile_schema_supports(schema):
    from openm3.engine.json_grammar import validate_schema

    validate_schema(schema)
    jsonschema.validators.validator_for(schema).check_schema(schema)  # the oracle agrees it is valid


def _escape(c: int, rng: random.Random) -> bytes:
    """The `\\uXXXX` escape of code point c (a surrogate pair past U+FFFF), its hex digits in random case."""
    units = [c] if c < 0x10000 else [0xD800 + ((c - 0x10000) >> 10), 0xDC00 + ((c - 0x10000) & 0x3FF)]
    text = "".join(f"\\u{u:04x}" for u in units)
    return "".join(ch.upper() if ch in "abcdef" and rng.random() < 0.5 else ch for ch in text).encode()


def test_held_escapes_stand_for_the_characters_they_start():
    """`_held_ranges` of the first bytes of an escape (`\\`, `\\u`, hex digits, a high surrogate and its pair so
    far): it holds every character whose escape starts so, the characters at and inside its ranges' edges start
    so, those just outside do not; whole escapes and bytes that start none give None."""
    from openm3.engine.json_grammar import _held_ranges

    rng = random.Random(0)

    def starts(c: int, prefix: bytes) -> bool:
        return not 0xD800 <= c <= 0xDFFF and 0 <= c <= 0x10FFFF and (
            prefix in (b"\\", b"\\u") or _escape(c, rng).lower().startswith(prefix.lower()))

    for _ in range(3000):
        c = rng.choice([rng.randrange(0xD800), rng.randrange(0xE000, 0x110000), 0x10FFFF, 0x10000, 0xFFFF])
        data = _escape(c, rng)
        for k in range(1, len(data)):
            ranges = _held_ranges(data[:k])
            assert ranges is not None and any(lo <= c <= hi for lo, hi in ranges), (data[:k], hex(c))
            for lo, hi in ranges:
                for d in (lo, hi, rng.randint(lo, hi)):
                    assert starts(d, data[:k]) or 0xD800 <= d <= 0xDFFF, (data[:k], hex(d))
                for d in (lo - 1, hi + 1):
                    if not any(a <= d <= b for a, b in ranges):
                        assert not starts(d, data[:k]), (data[:k], hex(d))
    for data in (b"\\n", b"\\u0041", b"\\ud83d\\ude00", b"\\x", b"\\udc", b"\\ud83d\\n", b"\\ud83d\\ud8", b"\\u00g"):
        assert _held_ranges(data) is None, data
    assert _held_ranges(b"\\uD") == ((0xD000, 0xD7FF), (0x10000, 0x10FFFF))


PATTERN_STATES = [  # (schema, [(the text before, how many characters `check_split_characters` finds taken there
    # of those it checks whole: None, many)])
    ({"type": "string", "pattern": "^[a-zé中😀]+$"}, [('"a', 3)]),
    ({"type": "string", "pattern": "^[a-zé中😀]+$", "maxLength": 3}, [('"ab', 3), ('"abc', 0)]),
    ({"type": "string", "pattern": "^[a-z]*中\\Z", "minLength": 3}, [('"ab', 1), ('"a', 0)]),  # 中 too soon
    ({"type": "string", "pattern": "^[a-z]*中$", "minLength": 3}, [('"a', 1)]),  # ($: a newline may follow)
    ({"type": "string", "pattern": "(?i)^[^\\W\\d_]é$"}, [('"', None)]),
    ({"type": "string", "pattern": "é|\\d"}, [('"', None)]),  # a match anywhere: any character may come
]


@pytest.mark.parametrize("schema,states", PATTERN_STATES, ids=range(len(PATTERN_STATES)))
def test_a_pattern_string_takes_a_character_s_first_bytes_when_some_completion_fits(schema, states):
    """Inside a string with a pattern (an automaton, with length bounds too): every lead byte and longer prefix,
    down to whole characters (`check_split_characters`), is taken exactly when some character that starts with it
    keeps a match possible within the bounds."""
    from test_regex_grammar import check_split_characters

    g = compile_schema(schema)
    for before, taken in states:
        got = check_split_characters(g.advance, g.advance(g.start, before.encode()))
        assert got == taken if taken is not None else got > 100, before


@pytest.mark.parametrize("schema,before", [({"type": "string", "pattern": "^[a-z中😀]$"}, '"'),
                                           ({"type": "string", "pattern": "^x*[\\n中😀é]$", "maxLength": 2}, '"x'),
                                           ({"type": "string", "pattern": "^[\\u0000-\\u4e2d]+$"}, '"')])
def test_a_pattern_string_takes_an_escape_s_first_bytes_when_some_completion_fits(schema, before):
    """Inside a string with a pattern: the first bytes of an escape (`\\`, `\\u`, hex digits, a high surrogate and
    its pair so far) are taken exactly when some whole escape that starts with them is (those on the way to
    `\\u4e2d`, `\\u0061`, `\\u000a`, `\\u00e9`, `\\ud83d\\ude00` checked down to the whole escapes, each hex digit
    in both cases; the other prefixes answer for themselves, the shorter ones checked against them)."""
    g = compile_schema(schema)
    state = g.advance(g.start, before.encode())
    ways = (b"\\u4e2d", b"\\u0061", b"\\u000a", b"\\u00e9", b"\\ud83d\\ude00")
    deep = {q[:k] for q in ways for k in range(1, len(q))}
    taken = []

    def answer(p: bytes) -> bool:
        got = g.advance(state, p) is not None
        try:
            text = json.loads(b'"' + p + b'"')
            whole = not any(0xD800 <= ord(ch) <= 0xDFFF for ch in text)
        except ValueError:
            whole = False
        if whole:
            taken.append(p) if got else None
            return got
        if p.lower() not in deep:
            return got
        kids = [p + bytes((b,)) for b in b'"\\/bfnrtux0123456789abcdefABCDEF']
        want = any([answer(k) for k in kids])
        assert got == want, p
        return want

    assert answer(b"\\")
    assert len(taken) > 3
