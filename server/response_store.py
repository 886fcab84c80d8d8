"""The Responses API's stored responses, in this process's memory: what `previous_response_id` continues from
and `GET /v1/responses/{id}` returns.

Each entry is a response object and the conversation that led to it, as chat messages with the response's
own output last, so that a request naming it as `previous_response_id` continues from there (its
instructions are its own: a stored response's are not carried over, as OpenAI's API does). The store keeps
the most recently used entries within a bound on their text, so a long-running server's memory stays
bounded; an entry evicted, or stored by another process (another Ray replica), is a 404 that says so.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_CHARS = 32 << 20  # characters of stored conversations and responses, about 64 MB of text


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object, as it was answered
    messages: list[dict[str, Any]]  # the conversation up to and including the response's output
    size: int  # characters of both, as JSON


class ResponseStore:
    def __init__(self, max_chars: int = DEFAULT_MAX_CHARS) -> None:
        self.max_chars = max_chars
        self.num_chars = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()  # the routes run on the event loop; a body may be built on a worker

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        """Keep `response` (by its id) and the conversation it ends; the least recently used entries go
        first when the text is over the bound (an entry larger than the whole bound is not kept)."""
        size = len(json.dumps(response, ensure_ascii=False)) + len(json.dumps(messages, ensure_ascii=False))
        if size > self.max_chars:
            return
        with self._lock:
            self._drop(response["id"])
            self._entries[response["id"]] = StoredResponse(response, messages, size)
            self.num_chars += size
            while self.num_chars > self.max_chars:
                self._drop(next(iter(self._entries)))

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is not None:
                self._entries.move_to_end(response_id)
            return entry

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._drop(response_id)

    def _drop(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.num_chars -= entry.size
        return True


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat turn they were: one assistant message with the text of its
    message items, the calls of its function_call items and the text of its reasoning items."""
    text = "".join(part.get("text", "") for item in output if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                      "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    reasoning = "".join(part.get("text", "") for item in output if item["type"] == "reasoning"
                        for part in item.get("content") or ())
    message: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning_content"] = reasoning
    return [message] if text or calls or reasoning else []
