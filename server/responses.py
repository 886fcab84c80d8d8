"""OpenAI's Responses API (POST /v1/responses) as a translation of the chat completions path.

A Responses request is a conversation (`instructions`, `input` items: messages, function calls and their
outputs) plus the fields of a chat completion under other names. `chat_body` turns it into the chat
completion request the server already validates, renders, guides and runs; `response_object` and
`ResponseEvents` turn the chat completion's answer, whole or streamed, into the Responses shapes: output
items (a message with `output_text`, `function_call`s), `usage` with input and output tokens, and the typed
stream events (`response.created` ... `response.output_text.delta` ... `response.completed`).

A response is kept in this process's memory (server/response_store.py) unless the request says `store:
false`: `previous_response_id` continues its conversation, `GET /v1/responses/{id}` returns it.
`conversation` objects are refused.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from server import protocol as p
from server.errors import APIError

# Fields of ladder's chat completions a Responses request may also give (OpenAI's API has none of these;
# vLLM's Responses endpoint takes several).
PASSED_THROUGH = ("top_k", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "stop",
                  "ignore_eos", "min_tokens", "logit_bias", "stop_token_ids", "speculative_tokens",
                  "chat_template_kwargs", "skip_special_tokens", "user", "include_reasoning", "reasoning_budget",
                  # vLLM's and llama.cpp's structured outputs, beside text.format (at most one of them all)
                  "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs", "grammar",
                  "json_schema")
UNSUPPORTED = {
    "conversation": "conversation objects are not implemented: use previous_response_id, or send the whole "
                    "conversation in input",
    "prompt": "stored prompt templates are not implemented",
    "reasoning": "reasoning effort is not a setting here: a reasoning model's thinking comes back as a reasoning "
                 "item, and is bounded by reasoning_budget (tokens; 0 for none)",
    "top_logprobs": "log-probabilities are given by /v1/chat/completions",
}


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def chat_body(body: p.ResponsesRequest, history: list[dict[str, Any]] = ()) -> tuple[dict[str, Any], list[dict]]:
    """The chat completion request (as JSON) that asks what the Responses request asks, after `history` (the
    stored conversation of its previous_response_id); and the conversation it continues, without its
    instructions (a later response's are its own), for the store."""
    for name, why in UNSUPPORTED.items():
        if body.model_extra and body.model_extra.get(name) is not None:
            raise APIError(400, f"{name} is not supported by this server ({why})", param=name)
    if body.background:
        raise APIError(400, "background is not supported by this server (responses are answered while the "
                            "request waits, or streamed)", param="background")
    if body.truncation not in (None, "disabled"):
        raise APIError(400, "truncation 'auto' is not supported: an input longer than the context is refused",
                       param="truncation")
    conversation = [*history, *input_messages(body.input)]
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    messages += conversation
    chat: dict[str, Any] = {"messages": messages, "stream": body.stream,
                            "parallel_tool_calls": body.parallel_tool_calls}
    if body.stream:
        chat["stream_options"] = {"include_usage": True}
    for name, value in (("model", body.model), ("max_tokens", body.max_output_tokens),
                        ("temperature", body.temperature), ("top_p", body.top_p)):
        if value is not None:
            chat[name] = value
    if body.tools:
        chat["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                         for tool in body.tools]
    if isinstance(body.tool_choice, p.ResponsesNamedTool):
        chat["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.name}}
    elif body.tool_choice is not None:
        chat["tool_choice"] = body.tool_choice
    if body.text is not None and body.text.format is not None and body.text.format.type != "text":
        fmt = body.text.format
        if fmt.type == "json_object":
            chat["response_format"] = {"type": "json_object"}
        else:
            schema = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict, "description": fmt.description}
            chat["response_format"] = {"type": "json_schema",
                                       "json_schema": {k: v for k, v in schema.items() if v is not None}}
    for name in PASSED_THROUGH:
        if body.model_extra and body.model_extra.get(name) is not None:
            chat[name] = body.model_extra[name]
    return chat, conversation


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages for `input`: a text is one user message; items are messages (`role` and `content`, a
    text or input_text/output_text parts), `function_call`s (an assistant turn's tool calls; consecutive
    calls are one turn), `function_call_output`s (tool messages) and `reasoning` items (the next assistant
    turn's `reasoning_content`)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    reasoning = ""  # a reasoning item's text, for the assistant turn that follows it

    def assistant(message: dict[str, Any]) -> dict[str, Any]:
        nonlocal reasoning
        if reasoning:
            message["reasoning_content"], reasoning = reasoning, ""
        return message

    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message" and "role" in item:
            message = {"role": item["role"], "content": item_text(item.get("content"), i)}
            messages.append(assistant(message) if item["role"] == "assistant" else message)
            reasoning = ""
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") and not last["content"]:
                last["tool_calls"].append(call)
            else:
                messages.append(assistant({"role": "assistant", "content": None, "tool_calls": [call]}))
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else item_text(output, i)})
        elif kind == "reasoning":  # its text goes with the next assistant turn (a summary alone is not read)
            reasoning += "".join(part.get("text", "") for part in item.get("content") or ()
                                 if isinstance(part, dict) and isinstance(part.get("text"), str))
        else:
            raise APIError(400, f"input[{i}]: items of type {kind!r} are not supported (messages, function_call "
                                "and function_call_output are)", param="input")
    return messages


def item_text(content: Any, index: int) -> Any:
    """A message's content as chat content: a string, or its text parts joined; with `input_image` parts,
    chat text and `image_url` parts in their order; other parts are refused."""
    if not isinstance(content, list):
        return content  # a string, or something the chat request's own validation refuses
    texts, parts = [], []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image":
            if not isinstance(part.get("image_url"), str):
                raise APIError(400, f"input[{index}]: an input_image needs its image_url (a data: or http(s) URL; "
                                    "file_id is not supported)", param="input")
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
            continue
        if kind not in ("input_text", "output_text", "text"):
            raise APIError(400, f"input[{index}]: content parts of type {kind!r} are not supported (text and "
                                "input_image)", param="input")
        texts.append(part.get("text"))
        parts.append({"type": "text", "text": part.get("text")})
    if len(parts) > len(texts):
        return parts
    return "".join(t for t in texts if isinstance(t, str)) if all(isinstance(t, str) for t in texts) else texts


def response_object(response_id: str, created: int, body: p.ResponsesRequest, model: str,
                    output: list[dict[str, Any]], status: str, usage: dict[str, int] | None,
                    incomplete: str | None = None, stored: bool = False) -> dict[str, Any]:
    """The Responses API's response object."""
    tool_choice = body.tool_choice.model_dump() if isinstance(body.tool_choice, p.ResponsesNamedTool) else \
        (body.tool_choice or "auto")
    return {
        "id": response_id, "object": "response", "created_at": created, "status": status, "error": None,
        "incomplete_details": {"reason": incomplete} if incomplete else None, "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens, "model": model, "output": output,
        "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": body.previous_response_id,
        "temperature": body.temperature, "top_p": body.top_p, "tool_choice": tool_choice,
        "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or ()],
        "text": {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)
                 if body.text is not None and body.text.format is not None else {"type": "text"}},
        "truncation": "disabled", "store": stored, "metadata": body.metadata or {},
        "usage": None if usage is None else {
            "input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": (usage.get("completion_tokens_details") or {}).get(
                "reasoning_tokens", 0)},
            "total_tokens": usage["total_tokens"]},
    }


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    return {"type": "message", "id": item_id or new_item_id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []}


def reasoning_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    """A reasoning model's thinking (server/reasoning.py), as OpenAI's reasoning item with its full text."""
    return {"type": "reasoning", "id": item_id or new_item_id("rs"), "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if status == "completed" else []}


def call_item(call: dict[str, Any]) -> dict[str, Any]:
    """A chat tool call (`{id, type, function: {name, arguments}}`) as a function_call output item."""
    return {"type": "function_call", "id": new_item_id("fc"), "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": "completed"}


def output_status(finish_reason: str | None) -> tuple[str, str | None]:
    """The response's status and incomplete reason for the chat choice's finish reason."""
    if finish_reason == "length":
        return "incomplete", "max_output_tokens"
    return "completed", None


class ResponseEvents:
    """One response: its object from a whole chat completion (`from_chat`), or its stream from a streamed
    one (`translate`: reads the chat path's server-sent `data:` lines, writes typed events, `event: <type>`
    and `data: {..., "sequence_number"}`). A finished response goes to `keep` (the store), if given."""

    def __init__(self, body: p.ResponsesRequest, response_id: str, model: str,
                 keep: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.body, self.response_id, self.model, self.keep = body, response_id, model, keep
        self.created = int(time.time())
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.message: dict[str, Any] | None = None  # the message item being streamed
        self.text = ""
        self.thought: dict[str, Any] | None = None  # the reasoning item being streamed
        self.thought_text = ""

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def snapshot(self, status: str, usage: dict[str, int] | None = None, incomplete: str | None = None) -> dict:
        return response_object(self.response_id, self.created, self.body, self.model, list(self.output), status,
                               usage, incomplete, stored=self.keep is not None)

    def finished(self, response: dict[str, Any]) -> dict[str, Any]:
        if self.keep is not None:
            self.keep(response)
        return response

    def from_chat(self, chat: p.ChatCompletionResponse) -> dict[str, Any]:
        choice = chat.choices[0]
        reasoning = choice.message.reasoning_content
        self.output = [reasoning_item(reasoning)] if reasoning else []
        self.output += [message_item(choice.message.content)] if choice.message.content else []
        self.output += [call_item(call.model_dump()) for call in choice.message.tool_calls or ()]
        status, incomplete = output_status(choice.finish_reason)
        return self.finished(self.snapshot(status, chat.usage.model_dump(), incomplete))

    async def translate(self, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
        yield self.event("response.created", response=self.snapshot("in_progress"))
        yield self.event("response.in_progress", response=self.snapshot("in_progress"))
        finish = None
        async for chunk in chunks:
            if not chunk.startswith("data: ") or chunk.startswith("data: [DONE]"):
                continue
            data = json.loads(chunk[len("data: "):])
            if "error" in data:
                for event in self.close_message():
                    yield event
                error = data["error"]
                yield self.event("error", code=error.get("code"), message=error["message"], param=error.get("param"))
                failed = self.snapshot("failed")
                failed["error"] = {"code": "server_error", "message": error["message"]}
                yield self.event("response.failed", response=failed)
                return
            for choice in data.get("choices", ()):
                delta = choice.get("delta", {})
                if delta.get("reasoning_content"):
                    for event in self.reasoning_delta(delta["reasoning_content"]):
                        yield event
                if delta.get("content"):
                    for event in self.text_delta(delta["content"]):
                        yield event
                for call in delta.get("tool_calls", ()):
                    for event in self.close_message():
                        yield event
                    for event in self.function_call(call):
                        yield event
                finish = choice.get("finish_reason") or finish
            if data.get("usage") is not None:
                for event in self.close_message():
                    yield event
                status, incomplete = output_status(finish)
                response = self.finished(self.snapshot(status, data["usage"], incomplete))
                yield self.event(f"response.{status}", response=response)

    def reasoning_delta(self, text: str) -> list[str]:
        events = []
        if self.thought is None:
            self.thought = reasoning_item("", status="in_progress")
            self.thought_text = ""
            events.append(self.event("response.output_item.added", output_index=len(self.output), item=self.thought))
            events.append(self.event("response.content_part.added", item_id=self.thought["id"],
                                     output_index=len(self.output), content_index=0,
                                     part={"type": "reasoning_text", "text": ""}))
        self.thought_text += text
        events.append(self.event("response.reasoning_text.delta", item_id=self.thought["id"],
                                 output_index=len(self.output), content_index=0, delta=text))
        return events

    def close_reasoning(self) -> list[str]:
        if self.thought is None:
            return []
        item_id, index = self.thought["id"], len(self.output)
        done = reasoning_item(self.thought_text, item_id=item_id)
        events = [self.event("response.reasoning_text.done", item_id=item_id, output_index=index, content_index=0,
                             text=self.thought_text),
                  self.event("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                             part=done["content"][0]),
                  self.event("response.output_item.done", output_index=index, item=done)]
        self.output.append(done)
        self.thought = None
        return events

    def text_delta(self, text: str) -> list[str]:
        events = self.close_reasoning()
        if self.message is None:
            self.message = message_item("", status="in_progress")
            self.text = ""
            events.append(self.event("response.output_item.added", output_index=len(self.output), item=self.message))
            events.append(self.event("response.content_part.added", item_id=self.message["id"],
                                     output_index=len(self.output), content_index=0,
                                     part={"type": "output_text", "text": "", "annotations": []}))
        self.text += text
        events.append(self.event("response.output_text.delta", item_id=self.message["id"],
                                 output_index=len(self.output), content_index=0, delta=text, logprobs=[]))
        return events

    def close_message(self) -> list[str]:
        """Closes the message item being streamed (and a reasoning item before it)."""
        if self.message is None:
            return self.close_reasoning()
        item_id, index = self.message["id"], len(self.output)
        done = message_item(self.text, item_id=item_id)
        part = done["content"][0]
        events = [self.event("response.output_text.done", item_id=item_id, output_index=index, content_index=0,
                             text=self.text, logprobs=[]),
                  self.event("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                             part=part),
                  self.event("response.output_item.done", output_index=index, item=done)]
        self.output.append(done)
        self.message = None
        return events

    def function_call(self, call: dict[str, Any]) -> list[str]:
        """A tool call comes whole from the chat stream (its text is parsed once complete): its item opens,
        its arguments come as one delta, and it closes."""
        item, index = call_item(call), len(self.output)
        opened = {**item, "arguments": "", "status": "in_progress"}
        events = [self.event("response.output_item.added", output_index=index, item=opened),
                  self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                             delta=item["arguments"]),
                  self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                             arguments=item["arguments"]),
                  self.event("response.output_item.done", output_index=index, item=item)]
        self.output.append(item)
        return events
