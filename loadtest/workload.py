"""Workloads: the i-th request of a run, the same for the same flags and seed."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from loadtest.config import DEFAULT_OUTPUT_LEN, LoadTestError, WorkloadConfig
from loadtest.tokens import TokenCounter, estimate_tokens, random_words

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
                  "assistant": "assistant", "bing": "assistant", "bard": "assistant", "system": "system"}


@dataclass(frozen=True)
class RequestSpec:
    index: int
    prompt: str  # the text sent to /v1/completions
    messages: tuple[dict, ...]  # the conversation sent to /v1/chat/completions
    max_tokens: int
    prompt_tokens: int  # of the prompt text (chat templates add their own tokens on the server)
    prompt_tokens_source: str  # "tokenizer" or "estimate"


class BaseWorkload(Protocol):
    description: str

    def request(self, index: int) -> RequestSpec: ...


def spread(rng: random.Random, length: int, range_ratio: float) -> int:
    """A length drawn uniformly from [length * (1 - r), length * (1 + r)], at least 1."""
    if range_ratio == 0:
        return length
    low = max(1, math.floor(length * (1 - range_ratio)))
    return rng.randint(low, max(low, math.ceil(length * (1 + range_ratio))))


class RandomWorkload:
    """Prompts of random common words: a shared prefix of `prefix_len` tokens, then a unique part of
    about `input_len` tokens (exactly, with a tokenizer). With `num_prefixes` > 1, request i shares
    prefix i mod num_prefixes (as tenants or system prompts would), which tells a router that keeps
    prefixes on their replica from one that spreads them."""

    def __init__(self, config: WorkloadConfig, counter: TokenCounter | None) -> None:
        self.config = config
        self.counter = counter
        self.output_len = config.output_len or DEFAULT_OUTPUT_LEN
        self.prefixes = [self._text(random.Random(f"{config.seed}:prefix" + (f"{g}" if g else "")), config.prefix_len)
                         for g in range(config.num_prefixes)]
        self.prefix = self.prefixes[0]
        spread_note = f" ±{config.range_ratio:.0%}" if config.range_ratio else ""
        prefix_note = f" (+{config.prefix_len} shared)" if config.prefix_len else ""
        if config.num_prefixes > 1:
            prefix_note = f" (+{config.prefix_len} shared by 1 in {config.num_prefixes})"
        self.description = f"random {config.input_len}{prefix_note} -> {self.output_len} tokens{spread_note}"

    def _text(self, rng: random.Random, num_tokens: int, lead: str = "") -> str:
        if num_tokens == 0:
            return ""
        if self.counter:
            return self.counter.exact_text(rng, num_tokens, lead)
        return lead + random_words(rng, num_tokens)

    def request(self, index: int) -> RequestSpec:
        rng = random.Random(f"{self.config.seed}:{index}")
        input_len = spread(rng, self.config.input_len, self.config.range_ratio)
        output_len = spread(rng, self.output_len, self.config.range_ratio)
        # The unique part starts with a space, so that tokens do not merge across the seam.
        prefix = self.prefixes[index % len(self.prefixes)]
        prompt = prefix + self._text(rng, input_len, lead=" " if prefix else "")
        if self.counter:
            num_prompt, source = self.counter.count(prompt), "tokenizer"
        else:
            num_prompt, source = self.config.prefix_len + input_len, "estimate"
        return RequestSpec(index, prompt, ({"role": "user", "content": prompt},), output_len, num_prompt, source)


@dataclass(frozen=True)
class Conversation:
    messages: tuple[dict, ...]  # system messages, then the first user turn
    output_len: int | None  # the record's own length: max_tokens, or its first reply's length


class FileWorkload:
    """Prompts from a JSONL file (or a JSON list), in an order shuffled by the seed, reused in cycles."""

    def __init__(self, config: WorkloadConfig, counter: TokenCounter | None) -> None:
        self.config = config
        self.counter = counter
        self.conversations = load_conversations(Path(config.dataset_path), counter)
        self.order = list(range(len(self.conversations)))
        random.Random(config.seed).shuffle(self.order)
        self.description = f"file {Path(config.dataset_path).name} ({len(self.conversations)} prompts)"

    def request(self, index: int) -> RequestSpec:
        conversation = self.conversations[self.order[index % len(self.order)]]
        prompt = conversation.messages[-1]["content"]
        output_len = self.config.output_len or conversation.output_len or DEFAULT_OUTPUT_LEN
        if self.counter:
            num_prompt, source = self.counter.count(prompt), "tokenizer"
        else:
            num_prompt, source = estimate_tokens(prompt), "estimate"
        return RequestSpec(index, prompt, conversation.messages, output_len, num_prompt, source)


def load_conversations(path: Path, counter: TokenCounter | None) -> list[Conversation]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise LoadTestError(f"--dataset-path: cannot read {path}: {error.strerror}") from None
    if text.lstrip().startswith("["):
        try:
            records = [(i + 1, record) for i, record in enumerate(json.loads(text))]
        except json.JSONDecodeError as error:
            raise LoadTestError(f"{path}: not valid JSON: {error}") from None
    else:
        records = []
        for number, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    records.append((number, json.loads(line)))
                except json.JSONDecodeError as error:
                    raise LoadTestError(f"{path}:{number}: not valid JSON: {error.msg}") from None
    conversations = []
    for number, record in records:
        conversation = parse_record(record, counter)
        if conversation is None:
            continue  # no user turn with text: nothing to send
        conversations.append(conversation)
    if not conversations:
        raise LoadTestError(f"{path}: no usable prompts (expected prompt, messages or conversations records)")
    return conversations


def parse_record(record: object, counter: TokenCounter | None) -> Conversation | None:
    """Accepts a bare string, {"prompt": ...}, {"messages": [{"role", "content"}]} or ShareGPT's
    {"conversations": [{"from", "value"}]}. Keeps system messages and the first user turn."""
    own_len = None
    if isinstance(record, str):
        turns = [("user", record)]
    elif isinstance(record, dict) and isinstance(record.get("prompt"), str):
        turns = [("user", record["prompt"])]
    elif isinstance(record, dict) and isinstance(record.get("messages"), list):
        turns = [(m.get("role"), m.get("content")) for m in record["messages"] if isinstance(m, dict)]
    elif isinstance(record, dict) and isinstance(record.get("conversations"), list):
        turns = [(SHAREGPT_ROLES.get(str(m.get("from", "")).lower()), m.get("value"))
                 for m in record["conversations"] if isinstance(m, dict)]
    else:
        return None
    if isinstance(record, dict):
        for key in ("max_tokens", "output_len"):
            if isinstance(record.get(key), int) and record[key] > 0:
                own_len = record[key]
    messages = []
    for position, (role, content) in enumerate(turns):
        if not isinstance(content, str):
            continue
        if role == "system":
            messages.append({"role": "system", "content": content})
        elif role == "user" and content.strip():
            messages.append({"role": "user", "content": content})
            if own_len is None:
                reply = next((c for r, c in turns[position + 1:] if r == "assistant" and isinstance(c, str)), None)
                if reply:
                    own_len = counter.count(reply) if counter else estimate_tokens(reply)
            return Conversation(tuple(messages), own_len)
    return None


def build_workload(config: WorkloadConfig, counter: TokenCounter | None = None) -> BaseWorkload:
    if config.dataset == "random":
        return RandomWorkload(config, counter)
    return FileWorkload(config, counter)
