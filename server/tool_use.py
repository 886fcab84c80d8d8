"""What a chat request asks of tools: the functions the model is shown, whether it must call one, and the
format its calls are written in (server/tool_calls.py)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.guide import Guide
from server import protocol as p
from server.tool_calls import ToolFormat, tool_call_grammar


@dataclass(frozen=True)
class ToolUse:
    definitions: list[dict]  # the request's tools, OpenAI-shaped, as the chat template receives them
    format: ToolFormat
    required: bool  # tool_choice "required": at least one call, to any of the tools
    name: str | None  # tool_choice naming a function: exactly that one
    parallel: bool

    @classmethod
    def of(cls, body: p.ChatPrompt, fmt: ToolFormat) -> ToolUse | None:
        """None when the reply cannot hold tool calls (no tools, or tool_choice "none"). `fmt`: the format of
        the model's chat template (`tool_format`)."""
        if not body.uses_tools:
            return None
        choice = body.tool_choice
        name = choice.function.name if isinstance(choice, p.NamedToolChoice) else None
        return cls([t.model_dump(exclude_none=True) for t in body.tools], fmt,
                   required=choice == "required", name=name, parallel=body.parallel_tool_calls)

    @property
    def forced(self) -> bool:
        """The reply must be tool calls, enforced by a grammar; with "auto" the model chooses."""
        return self.required or self.name is not None

    def guide(self) -> Guide:
        # A named function is called once (OpenAI's behaviour), whatever parallel_tool_calls says.
        return Guide("lark", tool_call_grammar(self.definitions, self.name, self.parallel and self.name is None,
                                               self.format))
