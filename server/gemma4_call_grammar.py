"""The grammar of a forced tool call in Gemma 4's notation: ``<|tool_call>call:NAME{key:value,...}<tool_call|>``.

Gemma 4's chat template shows the model its earlier calls in a notation of its own, not JSON: bare keys in
sorted order, strings between ``<|"|>`` marks (any text but that mark; no escapes), numbers, true, false and
null as JSON writes them, ``{...}`` objects and ``[...]`` lists, no whitespace. A forced call (tool_choice
"required" or naming a function) is generated in that spelling, so the model writes what its template
taught it, and server/tool_calls.py reads it back into JSON arguments.

llguidance's %json rule speaks only JSON, so the tool's parameters schema is translated here into Lark
rules (llguidance's dialect), one per subschema: type (one or a list), properties and required (the keys
sorted, an optional key present or not), items, enum and const, anyOf and oneOf (as alternatives),
nullable, local $ref into $defs or definitions (recursion allowed). A schema without a type, or
``true``, takes any value. Keywords that narrow further (minLength, pattern, minimum, minItems,
additionalProperties of a schema...) are not enforced: ignored for an ordinary tool, refused by name for a
strict one, whose arguments must follow the schema exactly (as llguidance does for JSON).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

QUOTE = '<|"|>'
OPEN, CLOSE = "<|tool_call>", "<tool_call|>"
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}  # a tool without parameters
MAX_DEPTH = 64  # nesting of the schema's objects, lists and alternatives

# Keywords the translation follows, and those it ignores because they only describe.
FOLLOWED = frozenset({"type", "properties", "required", "items", "enum", "const", "anyOf", "oneOf", "$ref",
                      "nullable"})
DESCRIBING = frozenset({"description", "title", "default", "examples", "$schema", "$id", "$comment", "$defs",
                        "definitions", "x-guidance", "deprecated", "readOnly", "writeOnly"})

_QUOTE_RX = r'<\|"\|>'
TERMINALS = f"""\
GSTRING: /{_QUOTE_RX}/ (/(?s:.*)/ & ~/(?s:.*){_QUOTE_RX}(?s:.*)/) /{_QUOTE_RX}/
GINTEGER: /-?(0|[1-9][0-9]*)/
GNUMBER: /-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?/
GKEY: /[A-Za-z_][A-Za-z0-9_.-]*/
any_value: GSTRING | GNUMBER | "true" | "false" | "null" | any_object | any_array
any_object: "{{" (any_pair ("," any_pair)*)? "}}"
any_pair: GKEY ":" any_value
any_array: "[" (any_value ("," any_value)*)? "]"
"""


def gemma4_call_grammar(functions: Sequence[Mapping[str, Any]], parallel: bool) -> str:
    """A Lark grammar (llguidance's dialect) for a reply that is one call (back-to-back calls when
    ``parallel``, as the template writes several) to one of ``functions`` (OpenAI function objects: name,
    parameters, strict) in Gemma 4's notation. ValueError (one line) for a schema it cannot follow."""
    lines = ["start: call call*" if parallel else "start: call",
             "call: " + " | ".join(f"call_{i}" for i in range(len(functions)))]
    for i, function in enumerate(functions):
        schema = function.get("parameters") or NO_ARGUMENTS
        rules = _Translation(schema, strict=bool(function.get("strict")), prefix=f"f{i}_")
        arguments = rules.value(schema if _types(schema) else {**schema, "type": "object"}, 0)
        lines.append(f"call_{i}: {_literal(OPEN + 'call:' + function['name'])} {arguments} {_literal(CLOSE)}")
        lines.extend(rules.lines)
    return "\n".join(lines) + "\n" + TERMINALS


class _Translation:
    """The rules of one tool's parameters schema; `value(schema)` names the rule of a subschema."""

    def __init__(self, root: Any, strict: bool, prefix: str) -> None:
        self.root, self.strict, self.prefix = root, strict, prefix
        self.lines: list[str] = []
        self.refs: dict[str, str] = {}

    def rule(self, body: str) -> str:
        name = f"{self.prefix}r{len(self.lines)}"
        self.lines.append(f"{name}: {body}")
        return name

    def value(self, schema: Any, depth: int) -> str:
        if depth > MAX_DEPTH:
            raise ValueError(f"the parameters schema nests deeper than {MAX_DEPTH} levels")
        if schema is True or schema == {}:
            return "any_value"
        if not isinstance(schema, Mapping):
            raise ValueError("a parameters schema must be an object or true")  # noqa: TRY004 (a 400, as the rest)
        self._check_keywords(schema)
        if "$ref" in schema:
            return self._ref(schema["$ref"], depth)
        if "const" in schema:
            return _literal(_spelling(schema["const"]))
        if "enum" in schema:
            return "(" + " | ".join(_literal(_spelling(v)) for v in schema["enum"]) + ")"
        for key in ("anyOf", "oneOf"):
            if key in schema:
                rest = {k: v for k, v in schema.items() if k != key}
                options = [self.value({**rest, **option} if isinstance(option, Mapping) else option, depth + 1)
                           for option in schema[key]]
                return self.rule(" | ".join(options))
        types = _types(schema)
        if not types:
            return "any_value"
        options = [self._typed(t, schema, depth) for t in types]
        if schema.get("nullable") and "null" not in types:
            options.append('"null"')
        return options[0] if len(options) == 1 else self.rule(" | ".join(options))

    def _typed(self, kind: str, schema: Mapping[str, Any], depth: int) -> str:
        if kind == "string":
            return "GSTRING"
        if kind == "integer":
            return "GINTEGER"
        if kind == "number":
            return "GNUMBER"
        if kind == "boolean":
            return '("true" | "false")'
        if kind == "null":
            return '"null"'
        if kind == "array":
            item = self.value(schema.get("items", True), depth + 1)
            return self.rule(f'"[" ({item} ("," {item})*)? "]"')
        if kind == "object":
            return self._object(schema, depth)
        raise ValueError(f"the parameters schema has a type {kind!r} that JSON schema does not define")

    def _object(self, schema: Mapping[str, Any], depth: int) -> str:
        properties = schema.get("properties") or {}
        if not properties:
            return '"{}"' if schema.get("additionalProperties") is False or self.strict else "any_object"
        required = set(schema.get("required") or ())
        names = sorted(properties)  # the template writes a call's keys with dictsort
        pairs = [f"{_literal(name + ':')} {self.value(properties[name], depth + 1)}" for name in names]
        # first: the rule of the keys from names[i] on with none written yet; tail: the same after one was
        # (each then begins with a comma). None: no keys left. An optional key is there or not.
        first: str | None = None
        tail: str | None = None
        for i in range(len(names) - 1, -1, -1):
            rest = f" {tail}" if tail else ""
            if names[i] in required:
                first, tail = self.rule(pairs[i] + rest), self.rule(f'"," {pairs[i]}{rest}')
            else:
                first = self.rule(f"{pairs[i]}{rest} | {first}" if first else f"({pairs[i]}{rest})?")
                tail = self.rule(f'"," {pairs[i]}{rest} | {tail}' if tail else f'("," {pairs[i]}{rest})?')
        return self.rule(f'"{{" {first} "}}"')

    def _ref(self, ref: Any, depth: int) -> str:
        if ref in self.refs:
            return self.refs[ref]
        parts = ref.split("/") if isinstance(ref, str) else []
        if len(parts) != 3 or parts[0] != "#" or parts[1] not in ("$defs", "definitions"):
            raise ValueError(f"the parameters schema's $ref {ref!r} is not a local #/$defs/NAME")
        target = (self.root.get(parts[1]) or {}).get(parts[2]) if isinstance(self.root, Mapping) else None
        if target is None:
            raise ValueError(f"the parameters schema's $ref {ref!r} names no definition")
        name = f"{self.prefix}ref{len(self.refs)}"
        self.refs[ref] = name
        self.lines.append(f"{name}: {self.value(target, depth + 1)}")
        return name

    def _check_keywords(self, schema: Mapping[str, Any]) -> None:
        if not self.strict:
            return
        for key in schema:
            if key not in FOLLOWED and key not in DESCRIBING and not (key == "additionalProperties"
                                                                       and schema[key] is False):
                raise ValueError(f"a strict tool's parameters use {key!r}, which a forced call in Gemma 4's "
                                 "notation does not enforce")


def _types(schema: Mapping[str, Any]) -> list[str]:
    kind = schema.get("type")
    if kind is None:
        return ["object"] if "properties" in schema else (["array"] if "items" in schema else [])
    return [kind] if isinstance(kind, str) else list(kind)


def _spelling(value: Any) -> str:
    """A JSON value in Gemma 4's notation, as the template's format_argument writes it (keys bare)."""
    if isinstance(value, str):
        if QUOTE in value:
            raise ValueError(f"a value of the parameters schema holds {QUOTE}, which the notation cannot write")
        return QUOTE + value + QUOTE
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k}:{_spelling(v)}" for k, v in sorted(value.items())) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_spelling(v) for v in value) + "]"
    return json.dumps(value)


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)
