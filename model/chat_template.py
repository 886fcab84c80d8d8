"""Rendering of Hugging Face style Jinja chat templates.

Chat templates ship with model files and are untrusted code, so they run in Jinja's immutable
sandbox. The environment mirrors what transformers' ``apply_chat_template`` offers templates
(``raise_exception``, ``strftime_now``, a ``tojson`` that keeps non-ASCII text and does not
HTML-escape, loop controls, ``{% generation %}`` blocks), so a prompt rendered here is the same
text the model was trained on.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from model.errors import one_line

__all__ = ["BUILTIN_TEMPLATES", "compile_chat_template", "read_chat_template", "reads_content_parts",
           "render_chat_template"]

# Templates for GGUF files that ship none, by `general.architecture`, as llama.cpp's server falls back to
# a template it knows. Gemma's turns: `<start_of_turn>user` / `<start_of_turn>model`, each closed by
# `<end_of_turn>`; a system message has no role of its own and opens the first user turn.
_GEMMA_TURNS = """\
{%- macro text(content) -%}
{%- if content is string -%}{{ content }}{%- else -%}
{%- for part in content if part.type == 'text' -%}{{ part.text }}{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{{- bos_token -}}
{%- set system = messages[0] if messages and messages[0].role == 'system' else none -%}
{%- set turns = messages[1:] if system is not none else messages -%}
{%- for message in turns -%}
{{- '<start_of_turn>' ~ ('model' if message.role == 'assistant' else message.role) ~ '\n' -}}
{%- if loop.first and system is not none -%}{{ text(system.content) | trim ~ '\n\n' }}{%- endif -%}
{{- text(message.content) | trim ~ '<end_of_turn>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}
"""
BUILTIN_TEMPLATES = {"gemma3": _GEMMA_TURNS}


class _GenerationBlock(jinja2.ext.Extension):
    """Accepts ``{% generation %}...{% endgeneration %}`` and renders its body unchanged.

    Some templates mark assistant turns this way for training masks; serving only needs the text.
    """

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes <, > and & for HTML and forces ASCII; prompts must keep the raw text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=64)
def compile_chat_template(template: str) -> jinja2.Template:
    """Compile ``template`` once; later calls with the same text reuse the compiled template.

    Raises ``ValueError`` (one line) when the template does not parse.
    """
    try:
        return _environment().from_string(template)
    except jinja2.exceptions.TemplateError as exc:
        raise ValueError(f"chat template does not compile: {one_line(exc)}") from exc


@functools.lru_cache(maxsize=64)
def reads_content_parts(template: str) -> bool:
    """Whether the template loops over a message's content: it reads content as a list of typed parts
    (`{"type": "text", ...}`, `{"type": "image"}`), as vision models' templates do, some of them only so."""
    try:
        tree = _environment().parse(template)
    except jinja2.exceptions.TemplateError:
        return False
    for loop in tree.find_all(jinja2.nodes.For):
        source = loop.iter
        while isinstance(source, jinja2.nodes.Filter | jinja2.nodes.Test) and source.node is not None:
            source = source.node
        if isinstance(source, jinja2.nodes.Getitem) and isinstance(source.arg, jinja2.nodes.Const) \
                and source.arg.value == "content":
            return True
        if isinstance(source, jinja2.nodes.Getattr) and source.attr == "content":
            return True
    return False


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
    **extra: Any,
) -> str:
    """Render ``messages`` with ``template``, the way transformers' ``apply_chat_template`` does.

    ``extra`` becomes template variables (``tools``, ``documents``, ``enable_thinking``...);
    ``tools`` and ``documents`` default to ``None``. Keys whose value is ``None`` are dropped from
    each message first, as transformers does, so templates see them as absent rather than "None".
    Any error raised while rendering (``raise_exception`` calls, sandbox violations, undefined
    operations) becomes a one-line ``ValueError``.
    """
    compiled = compile_chat_template(template)
    variables: dict[str, Any] = {"tools": None, "documents": None}
    if bos_token is not None:
        variables["bos_token"] = bos_token
    if eos_token is not None:
        variables["eos_token"] = eos_token
    variables.update(extra)
    variables["messages"] = [_clean_message(message) for message in messages]
    variables["add_generation_prompt"] = add_generation_prompt
    try:
        return compiled.render(**variables)
    except jinja2.exceptions.TemplateError as exc:
        raise ValueError(f"chat template failed: {one_line(exc)}") from exc
    except Exception as exc:  # a template is code: whatever it raises is the template's error
        raise ValueError(f"chat template failed: {type(exc).__name__}: {one_line(exc)}") from exc


def _clean_message(message: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise ValueError(f"chat messages must be mappings, got {type(message).__name__}")
    return {key: value for key, value in message.items() if value is not None}


def read_chat_template(value: str) -> str:
    """A chat template given as a file (Jinja text, or a tokenizer_config.json holding one) or as the
    template itself; ValueError (one line) for neither."""
    path = Path(value).expanduser()
    if path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--chat-template {value}: cannot read it ({one_line(exc)})") from None
        if path.suffix == ".json":
            try:
                text = json.loads(text)["chat_template"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"--chat-template {value}: a JSON file must hold a \"chat_template\" string") from None
            if not isinstance(text, str):
                raise ValueError(f"--chat-template {value}: its \"chat_template\" is not one template string")
        return text
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r}: no such file, and not a Jinja template")
