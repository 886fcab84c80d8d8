"""A request's structured-output fields, in any of the dialects clients speak, as one engine `Guide`.

OpenAI's `response_format`, vLLM's `guided_json`/`guided_regex`/`guided_choice`/`guided_grammar` and its
`structured_outputs` object, and llama.cpp's `grammar` (GBNF) and `json_schema` all say the same thing;
a request may use one of them. A forced tool call (`tool_choice` "required" or a named function) is a
grammar too (server/tool_calls.py), and excludes the others.
"""

from __future__ import annotations

from engine.async_engine import EngineInfo
from engine.guide import Guide, GuideError
from server import protocol as p
from server.errors import APIError


def request_guide(body: p._Request) -> tuple[Guide | None, str | None]:
    """The request's guide and the field it came from, or (None, None). A field that cannot become a guide
    (two of them, a schema too deep, a grammar that does not parse) is a 400 naming the field; compiling it
    for the vocabulary comes later (`compile_guide`)."""
    found: list[tuple[str, object]] = []
    fmt = body.response_format
    if fmt is not None and fmt.type != "text":
        found.append(("response_format", fmt))
    for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "grammar", "json_schema"):
        if getattr(body, name) is not None:
            found.append((name, getattr(body, name)))
    if body.structured_outputs is not None:
        found.append(("structured_outputs", body.structured_outputs))
    if len(found) > 1:
        raise APIError(400, f"{' and '.join(n for n, _ in found)} each constrain the output; send one of them",
                       param=found[1][0])
    if not found:
        return None, None
    name, value = found[0]
    try:
        return _guide(name, value), name
    except GuideError as error:
        raise APIError(400, f"{name}: {error}", param=name) from None


def _guide(name: str, value) -> Guide:
    if name == "response_format":
        if value.type == "json_object":
            return Guide.json_object()
        # OpenAI's strict schemas must be followed exactly; without `strict` it is best effort, so a keyword
        # llguidance does not implement is ignored rather than refused.
        return Guide.json_schema(value.json_schema.schema_, lenient=value.json_schema.strict is not True)
    if name in ("guided_json", "json_schema"):
        return Guide.json_schema(value)
    if name == "guided_regex":
        return Guide.regex(value)
    if name == "guided_choice":
        return Guide.choice(value)
    if name in ("guided_grammar", "grammar"):
        return Guide.grammar(value)
    outputs: p.StructuredOutputs = value
    set_fields = [f for f in ("json_", "regex", "choice", "grammar", "json_object") if getattr(outputs, f) is not None]
    if len(set_fields) != 1:
        raise GuideError("set exactly one of json, regex, choice, grammar, json_object")
    field = set_fields[0]
    if field == "json_":
        return Guide.json_schema(outputs.json_)
    if field == "regex":
        return Guide.regex(outputs.regex)
    if field == "choice":
        return Guide.choice(outputs.choice)
    if field == "grammar":
        return Guide.grammar(outputs.grammar)
    if not outputs.json_object:
        raise GuideError("json_object: false constrains nothing; leave it out")
    return Guide.json_object()


def compile_guide(info: EngineInfo, guide: Guide, param: str) -> None:
    """Compiles the guide for the model's vocabulary (or finds it in the cache), so that a guide the engine
    cannot use is refused now with a 400. CPU work (milliseconds; a pathological grammar stops at the
    compiler's limits): run it off the event loop."""
    if info.guides is None:
        raise APIError(400, "this model has no tokenizer, so its output cannot follow a grammar", param=param)
    try:
        info.guides.compile(guide)
    except GuideError as error:
        raise APIError(400, f"{param}: {error}", param=param) from None
