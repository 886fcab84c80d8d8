"""What the router knows of a request before any replica sees it: chained hashes of its prompt's leading
text blocks.

The ingress has no tokenizer, so blocks are counted in characters: `BLOCK_CHARS` characters are about 16
tokens of English, one KV block of the engine's default size. Hash i covers blocks 0..i (each hash chains
the one before), so two prompts share hash i exactly when they share their first i + 1 blocks, which is
what decides how much of the second one the first one's replica finds in its prefix cache.

The ingress parses the body on its event loop, which relays every stream of every replica, and json.loads
holds the GIL however it is called (a worker thread stalls the loop about as long). So only bodies up to
`MAX_PARSE_BYTES` are parsed: a few milliseconds at most even for a body built of tiny values, where a
4 MiB one costs a quarter of a second. A larger body routes by load alone (no prefix), and the text taken
from a parsed body stops once it covers the `MAX_BLOCKS` blocks that are hashed.
"""

from __future__ import annotations

import hashlib
import json

BLOCK_CHARS = 64
MAX_BLOCKS = 64  # 4096 characters: past that a longer match changes nothing about where to route
MAX_TEXT_CHARS = BLOCK_CHARS * MAX_BLOCKS  # the most routing text that is ever hashed
# About 11 ms of json.loads for 256 KiB of tiny values on one core, a fraction of a millisecond for text;
# 256 KiB is about 64k tokens of prompt, past the context of the models served here.
MAX_PARSE_BYTES = 256 << 10


def routing_text(path: str, body: bytes) -> str | None:
    """The text whose prefix decides the replica: the prompt of /v1/completions, the messages of
    /v1/chat/completions, the instructions and input of /v1/responses, the input of /v1/embeddings (a
    repeated input's last-token embedding is read from the prefix cache), the instruction and query of
    /v1/rerank and the first text_1 of /v1/score (every document's prompt starts with them). None for other
    routes and for bodies the replica will refuse anyway."""
    if not path.endswith(("/completions", "/embeddings", "/responses", "/rerank", "/score")) \
            or len(body) > MAX_PARSE_BYTES:
        return None
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: nesting deeper than Python's limit
        return None
    if not isinstance(payload, dict):
        return None
    if path.endswith("/chat/completions"):
        return messages_text(payload.get("messages"))
    if path.endswith(("/rerank", "/score")):
        query = payload.get("query") if path.endswith("/rerank") else prompt_text(payload.get("text_1"))
        parts = (payload.get("instruction"), query)
        return "\x00".join(p for p in parts if isinstance(p, str)) or None
    if path.endswith("/responses"):  # the chat it becomes: the instructions' system turn, then the input
        instructions, given = payload.get("instructions"), payload.get("input")
        turns = [{"role": "system", "content": instructions}] if isinstance(instructions, str) and instructions else []
        if isinstance(given, str):
            turns.append({"role": "user", "content": given})
        elif isinstance(given, list):  # its messages; function calls and outputs route with them
            turns += [item for item in given if isinstance(item, dict) and "role" in item]
        return messages_text(turns)
    return prompt_text(payload.get("input" if path.endswith("/embeddings") else "prompt"))


def prompt_text(prompt: object) -> str | None:
    # A batch routes as its first prompt: one request goes to one replica.
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, int):  # token ids: their decimal text keeps the prefix property
            # Each id adds at least two characters ("7,"): the first MAX_TEXT_CHARS ids give all that is hashed.
            return ",".join(str(token) for token in prompt[:MAX_TEXT_CHARS])
        return prompt_text(first)
    return None


def messages_text(messages: object) -> str | None:
    if not isinstance(messages, list):
        return None
    parts, size = [], 0
    for message in messages:
        if not isinstance(message, dict):
            return None
        content = message.get("content")
        if isinstance(content, list):  # content parts: their text, in order
            content = "".join(part["text"] for part in content
                              if isinstance(part, dict) and isinstance(part.get("text"), str))
        parts.append(f"{message.get('role')}\x00{content if isinstance(content, str) else ''}\x00")
        size += len(parts[-1])
        if size >= MAX_TEXT_CHARS:  # the rest is never hashed (a later malformed message routes as it is)
            break
    return "".join(parts) or None


def block_hashes(text: str, block_chars: int = BLOCK_CHARS, max_blocks: int = MAX_BLOCKS) -> tuple[int, ...]:
    """Chained 64-bit hashes of the full `block_chars` blocks at the start of `text`, at most `max_blocks`.
    A partial last block has no hash: its replica's cache does not hold it as a block either."""
    hashes = []
    previous = b""
    for start in range(0, min(len(text) // block_chars, max_blocks) * block_chars, block_chars):
        digest = hashlib.blake2b(previous + text[start:start + block_chars].encode(), digest_size=8).digest()
        hashes.append(int.from_bytes(digest, "little"))
        previous = digest
    return tuple(hashes)


def request_prefix(path: str, body: bytes) -> tuple[int, ...]:
    text = routing_text(path, body)
    return block_hashes(text) if text else ()
