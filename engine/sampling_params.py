"""Per-request sampling parameters, validated where they are created."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from engine.guide import Guide

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0
GREEDY_BELOW = 1e-5
MAX_SPECULATIVE_TOKENS = 16  # draft tokens per step a request may ask for (engine/speculative.py)


@dataclass(frozen=True)
class ThinkBlock:
    """A reasoning model's block: its start and end marker tokens, and whether the prompt opened it."""

    start_id: int
    end_id: int
    opened: bool = False


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled and when it stops.

    temperature 0 is greedy. top_k 0 (or -1) and top_p 1 and min_p 0 disable those filters.
    Penalties follow the OpenAI API (presence, frequency: over generated tokens) and the CTRL paper
    (repetition: over prompt and generated tokens; 1 disables it). `logit_bias` adds to a token's logit
    before everything else (OpenAI's -100 bans a token, +100 all but forces it); `guide` constrains the
    output to a JSON schema, regex, choice or grammar (engine/guide.py), and the request stops when it is
    complete. `reasoning`: a reasoning model's block markers (`ThinkBlock`); a guide then holds after the
    reply's reasoning: from the first token unless that token starts a block the grammar does not cover
    itself, else after the block's end. `reasoning_budget`: the most tokens the block may hold; then its
    end is the next token (not where a grammar covers the block).
    `speculative_tokens` is how many draft tokens per step prompt lookup may propose for it
    (engine/speculative.py): 0 never, None the engine's default.
    """

    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; k: the chosen token's and the k best tokens'
    # None: none; k: each prompt token's log-probability after the tokens before it, and the k best there
    # (the prompt is then computed whole, not read from the prefix cache).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) sorted by id; a mapping is accepted
    guide: Guide | None = None
    # An embedding request pooled by its last token: its last delta carries the next-token logits of these
    # tokens ([T] float32) instead of the hidden state (a reranker's "no" and "yes"; server/rerank.py).
    score_token_ids: tuple[int, ...] = ()
    reasoning: ThinkBlock | None = None
    reasoning_budget: int | None = None
    speculative_tokens: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "score_token_ids", tuple(int(t) for t in self.score_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias)))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        checks = [
            (self.n >= 1, f"n must be at least 1, got {self.n}"),
            (self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}"),
            (0 <= self.min_tokens <= self.max_tokens,
             f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"),
            (0.0 <= self.temperature <= 2.0, f"temperature must be in [0, 2], got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be -1, 0 or positive, got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (-2.0 <= self.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2.0 <= self.frequency_penalty <= 2.0,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (0.0 < self.repetition_penalty <= 2.0,
             f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
             f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
             f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}"),
            (all(s for s in self.stop), "stop strings must not be empty"),
            (all(-MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for _, b in self.logit_bias),
             f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"),
            (all(t >= 0 for t, _ in self.logit_bias), "logit_bias token ids must not be negative"),
            (self.reasoning_budget is None or self.reasoning_budget >= 0,
             f"reasoning_budget must be at least 0, got {self.reasoning_budget}"),
            (self.reasoning_budget is None or self.reasoning is not None, "reasoning_budget needs reasoning markers"),
            (self.speculative_tokens is None or 0 <= self.speculative_tokens <= MAX_SPECULATIVE_TOKENS,
             f"speculative_tokens must be in [0, {MAX_SPECULATIVE_TOKENS}], got {self.speculative_tokens}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def is_greedy(self) -> bool:
        # Below this, dividing by the temperature overflows float32 logits: it is argmax in all but name.
        return self.temperature < GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def replace(self, **changes) -> SamplingParams:
        return dataclasses.replace(self, **changes)
