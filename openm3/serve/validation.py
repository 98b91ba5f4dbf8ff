"""A request body that fails its schema, as one message naming the field and what was expected.

    message, param = describe_invalid(exc.errors(), exc.body, request.headers.get("content-type"))
    # "input: expected a string or a list of objects, got an integer (5)", "input"

pydantic reports a union's failure once per branch, each error's location holding the branch's label
(`('input', 'str')`, `('input', 'list[dict[str,any]]', 0)`). `describe_invalid` walks the request body along the
first error's location to tell the body's keys and indices from such labels; at a union it follows the one branch
the value's JSON type fits (a list into `list[...]`), else it names every branch: what was expected, and what came.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

# pydantic error types that say the value had the wrong type, and what they expected
_EXPECTED = {"string_type": "a string", "int_type": "an integer", "int_parsing": "an integer",
             "int_from_float": "an integer", "float_type": "a number", "float_parsing": "a number",
             "bool_type": "a boolean", "bool_parsing": "a boolean", "list_type": "a list", "tuple_type": "a list",
             "dict_type": "an object", "model_type": "an object", "model_attributes_type": "an object",
             "none_required": "null"}
_SCALARS = {"str": ("a string", "strings", {"str"}), "int": ("an integer", "integers", {"int"}),
            "float": ("a number", "numbers", {"int", "float"}), "bool": ("a boolean", "booleans", {"bool"}),
            "none": ("null", "nulls", {"null"})}
_OBJECT = ("an object", "objects", {"object"})
_ANY = {"str", "int", "float", "bool", "null", "list", "object"}
_PLACE = re.compile(r"((?:\.\w+|\[\d+\])+): ")  # a validator's message naming a place below its value


def describe_invalid(errors: list[dict], body: Any, content_type: str | None = None) -> tuple[str, str | None]:
    """(message, param) for FastAPI's validation `errors` of a request `body` (the parsed JSON, or the raw bytes of a
    body not sent as JSON); param: the top-level field at fault, None for the body as a whole."""
    first = errors[0]
    if first.get("type") == "json_invalid":
        reason = (first.get("ctx") or {}).get("error", "JSON decode error")
        return f"body: not valid JSON ({reason} at character {first['loc'][-1]})", None
    loc = tuple(first.get("loc", ()))
    if loc[:1] in (("query",), ("path",), ("header",)) and len(loc) > 1:  # a URL's parameter or a header
        return f"{loc[1]}: {_message(first)}", str(loc[1])
    pairs = [(_in_body(tuple(e.get("loc", ()))), e) for e in errors]
    if not pairs[0][0]:  # the body itself
        if isinstance(body, (bytes, bytearray)):
            got = f"content-type {content_type}" if content_type else "no content-type header"
            return f"body: expected a JSON object sent with content-type: application/json, got {got}", None
        if body is None or first.get("type") == "missing":
            return "body: expected a JSON object, got an empty body", None
        if isinstance(body, dict) and first.get("type") == "value_error":  # a check of the object as a whole
            return f"body: {_message(first)}", None
        return f"body: expected a JSON object, got {described(body)}", None
    path, message = _explain(pairs, body, [])
    where = _where(path).lstrip(".") or "body"
    param = next((p for p in path if isinstance(p, str)), None)
    if message.startswith((f"{where}[", f"{where}.")):  # a validator's text that names the place itself
        return message, param
    return f"{where}: {message}", param


def explain(errors: list[dict], value: Any) -> tuple[str, str]:
    """(where, message) of pydantic's `errors` validating `value` (a model's input, as parsed JSON): where is the
    place inside it, `.field[0].key` ('' for the value itself), as `describe_invalid` finds it."""
    path, message = _explain([(tuple(e.get("loc", ())), e) for e in errors], value, [])
    return _where(path), message


def _where(path: list) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)


def _in_body(loc: tuple) -> tuple:
    """A location relative to the body (FastAPI's start with 'body')."""
    return loc[1:] if loc[:1] == ("body",) else loc


def _explain(pairs: list[tuple[tuple, dict]], value: Any, path: list) -> tuple[list, str]:
    """(the data path, the message) of the first error in `pairs` (locations relative to `value`, at `path`)."""
    loc, err = pairs[0]
    if not loc:
        return _below(path, _message(err))
    seg = loc[0]
    if _tag(value, loc):  # a tagged union's label: the branch of the value's "type"
        return _explain([(rest[1:], e) for rest, e in pairs if rest[:1] == (seg,)], value, path)
    if _holds(value, seg) or (err.get("type") == "missing" and len(loc) == 1):
        inner = value[seg] if _holds(value, seg) else None
        return _explain([(rest[1:], e) for rest, e in pairs if rest[:1] == (seg,)], inner, path + [seg])
    branches: dict[str, list[tuple[tuple, dict]]] = {}  # a union: its branches' labels -> their errors
    for rest, e in pairs:
        if rest and isinstance(rest[0], str) and not _holds(value, rest[0]):
            branches.setdefault(rest[0], []).append((rest[1:], e))
    if len(branches) == 1:  # one label alone (as a tagged union reports the branch it picked): no choice to explain
        return _explain(next(iter(branches.values())), value, path)
    kind = _kind(value)
    fits = [label for label in branches if kind in _describe(label)[2]]
    untagged = [label for label in fits if not any(rest == ("type",) and e.get("type") == "literal_error"
                                                   for rest, e in branches[label])]
    fits = untagged or fits  # a branch whose "type" tag the value does not carry is not the one meant
    if fits:
        label = max(fits, key=lambda b: len(branches[b][0][0]))  # the branch that got furthest
        chosen = branches[label]
        if not all(not rest and e.get("type") in (*_EXPECTED, "literal_error") for rest, e in chosen):
            return _explain(chosen, value, path)
    alternatives = list(dict.fromkeys(a for label in branches for a in _alternatives(label)))
    return path, f"expected {_join(alternatives)}, got {described(value)}"


def _below(path: list, message: str) -> tuple[list, str]:
    """(path, message) of a validator's text that names a place below its value, '.schema: ...' or
    '.grammar.syntax: ...' (a place the value may lack: a field it needs), as that place's path and the rest."""
    place = _PLACE.match(message)
    if place is None:
        return path, message
    segments = re.findall(r"\.(\w+)|\[(\d+)\]", place.group(1))
    return path + [int(index) if index else key for key, index in segments], message[place.end():]


def _tag(value: Any, loc: tuple) -> bool:
    """Whether loc[0] is the label a tagged union gives the branch of the value's "type" (which may also be one of
    its keys: `{"type": "text", "text": ...}`)."""
    return (isinstance(value, dict) and value.get("type") == loc[0] and len(loc) > 1
            and (_holds(value, loc[1]) or not _holds(value, loc[0])))


def _holds(value: Any, seg: Any) -> bool:
    """Whether `seg` indexes into `value` (a key of a JSON object, an index of a list) rather than naming a union
    branch."""
    if isinstance(value, dict):
        return isinstance(seg, str) and seg in value
    return isinstance(value, list) and isinstance(seg, int) and 0 <= seg < len(value)


def _message(err: dict) -> str:
    """One error at its value: 'expected X, got Y' for a wrong type or literal, else pydantic's (or the validator's)
    text."""
    kind = err.get("type")
    if kind == "missing":
        return "a required field is missing"
    if kind in _EXPECTED:
        return f"expected {_EXPECTED[kind]}, got {described(err.get('input'))}"
    if kind == "literal_error" and "expected" in (err.get("ctx") or {}):
        return f"expected {err['ctx']['expected']}, got {described(err.get('input'))}"
    return str(err.get("msg", "invalid value")).removeprefix("Value error, ")


def _describe(label: str) -> tuple[str, str, set[str]]:
    """A union branch's label as (the value it takes, its plural, the JSON kinds it can take)."""
    if label in _SCALARS:
        return _SCALARS[label]
    wrapped = re.fullmatch(r"function-(?:after|before|wrap|plain)\[.*, ([^,\]]+)\]", label)
    if wrapped:  # a validator around a type: the type
        return _describe(wrapped.group(1))
    if label.startswith("constrained-str"):
        return _SCALARS["str"]
    nullable = re.fullmatch(r"nullable\[(.*)\]", label)
    if nullable:
        one, many, kinds = _describe(nullable.group(1))
        return f"{one} or null", many, kinds | {"null"}
    if label == "any" or label.startswith("union["):
        return "a value", "values", _ANY
    outer = re.fullmatch(r"(list|tuple|set|frozenset)\[(.*)\]", label)
    if outer:
        _, items, _ = _describe(outer.group(2))
        return f"a list of {items}", f"lists of {items}", {"list"}
    if label.startswith(("dict[", "tagged-union[", "typed-dict")) or re.fullmatch(r"[A-Z]\w*", label):
        return _OBJECT
    values = _literals(label)
    if values is not None:
        return _join([repr(v) for v in values]), "values", {_kind(v) for v in values}
    return label, label, _ANY


def _alternatives(label: str) -> list[str]:
    """The values a branch takes, a literal's one by one (so several branches' lists read as one)."""
    values = _literals(label)
    return [repr(v) for v in values] if values is not None else [_describe(label)[0]]


def _literals(label: str) -> list | None:
    if not (label.startswith("literal[") and label.endswith("]")):
        return None
    try:
        return list(ast.literal_eval(f"({label[len('literal['):-1]},)"))
    except (SyntaxError, ValueError):
        return None


def _kind(value: Any) -> str:
    """The JSON kind of a parsed value."""
    if value is None:
        return "null"
    for t, name in ((bool, "bool"), (int, "int"), (float, "float"), (str, "str"), (list, "list"), (dict, "object")):
        if isinstance(value, t):
            return name
    return type(value).__name__


def described(value: Any) -> str:
    """What came, for a message: 'an integer (5)', "a string ('x')", 'a list', 'an object'."""
    kind = _kind(value)
    if kind == "null":
        return "null"
    if kind in ("list", "object"):
        return {"list": "a list", "object": "an object"}[kind]
    text = json.dumps(value) if kind in ("bool", "int", "float") else repr(value)
    text = text if len(text) <= 40 else text[:37] + "..."
    article = {"bool": "a boolean", "int": "an integer", "float": "a number", "str": "a string"}.get(kind, kind)
    return f"{article} ({text})"


def _join(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} or {items[-1]}"
