"""A request and its lifecycle, in one place.

    WAITING --schedule--> RUNNING --stop/length/abort/error--> FINISHED
       ^                     |
       +----- PREEMPTED <----+   (blocks freed; recomputed from scratch when rescheduled)

Each request carries its token ids and how many of them are in the KV cache (`num_computed_tokens`),
so the scheduler needs no separate prefill and decode phases: a request with uncomputed tokens gets a
chunk of them; one whose tokens are all computed gets the next sampled token.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # a stop token or stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # the client went away or asked to cancel
    ERROR = "error"  # the request can never run, or the engine failed


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probability of the chosen token, and the best `k` candidates (token id, logprob); `rank`: 1 + how
    many tokens are more likely than the chosen one (a prompt token's; None where not computed)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    rank: int | None = None


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    # A sample of an n > 1 request waits until its leader has computed the shared prompt, so it finds
    # the prompt's blocks in the prefix cache instead of computing them again.
    leader: Request | None = None
    parent_id: str = ""  # the id the client knows; request_id is unique per sample
    index: int = 0  # which of the parent's n samples

    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at the last admission
    num_preemptions: int = 0
    block_ids: list[int] = field(default_factory=list)
    kv_pool: int = 0  # the block manager's pool its blocks come from (chosen at each admission)
    # The sliding-window layers' blocks, one entry per block of the sequence, -1 once out of every later
    # query's window (engine/window_blocks.py); empty for a model whose layers share `block_ids`.
    window_block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks, in order
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # A guided sample's llguidance matcher (engine/guide.py): which tokens may come next, advanced by each
    # token appended. Kept through preemption: the output tokens it has seen are kept too.
    matcher: Any = None
    # The matcher of a guide that waits for the end of the reply's reasoning block (params.reasoning).
    held_matcher: Any = None
    # In the reply's reasoning block (params.reasoning): None until the first token says, where the prompt
    # did not open one; how many tokens the block holds so far (its markers not counted: the budget's
    # measure), and how many of the output's tokens are the block's, its markers counted (usage's).
    in_reasoning: bool | None = field(default=False, init=False)
    num_reasoning_tokens: int = 0
    num_reasoning_output_tokens: int = 0
    # The LoRA adapter the request runs with (None: the base model), the slot it holds while admitted
    # (-1: none; engine/lora_manager.py), and what its prefix-cache hash chain starts from (the adapter's).
    lora: str | None = None
    lora_slot: int = -1
    # Its row of the linear-attention layers' state pools while it runs (engine/state_slots.py); -1: none. And
    # where a prefix it shares with earlier prompts ends, when their KV blocks reach further than a snapshot of
    # those states (engine/state_cache.py): its states are kept there too (0: nowhere).
    state_slot: int = -1
    shared_prefix: int = 0
    cache_salt: bytes = b""
    # The prompt's log-probabilities (params.prompt_logprobs), by position 1 .. P - 1: each token's after
    # the tokens before it. Kept through preemption; a recomputed prompt writes the same values again.
    prompt_scores: dict[int, TokenLogprobs] = field(default_factory=dict)
    # An embedding request: the pooling kind (model/pooling.py POOLING_KINDS); its prompt runs, nothing is
    # sampled, and `pooled` gathers its final hidden states as its chunks run (mean: their float64 sum; last,
    # cls: the row). Reset by preemption, which computes the prompt again.
    pooling: str | None = None
    pooled: Any = None
    # A prompt with images (model/vision.py): the prompt positions of its `<image>` tokens, ascending, and
    # the embeddings [len(image_positions), hidden] each step puts in their rows instead of the token's.
    image_positions: list[int] = field(default_factory=list)
    image_embeds: Any = None
    image_digest: bytes = b""  # the images' pixels' sha256: keys the prefix cache's blocks from the first image on
    # A model whose image tokens see each other both ways (Gemma 3): each image's run of positions [start,
    # end), which one chunk computes to its end (`chunk_end`). Empty for any other model.
    image_spans: list[tuple[int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        block = self.params.reasoning
        if block is not None:
            self.in_reasoning = True if block.opened else None
            if block.opened and self.matcher is not None:  # the guide waits for the block's end
                self.held_matcher, self.matcher = self.matcher, None

    @property
    def guide_opening(self) -> int | None:
        """A token the guide's mask lets through beside its grammar: a reasoning block's start, as the reply's
        first token (params.reasoning)."""
        block = self.params.reasoning
        if block is None or self.output_token_ids or block.opened or self.matcher is None:
            return None
        return block.start_id

    @property
    def forced_token(self) -> int | None:
        """The block's end, once the reasoning budget is spent (params.reasoning_budget); a grammar that
        covers the block (an active matcher inside it) keeps its own rule."""
        budget = self.params.reasoning_budget
        if budget is None or not self.in_reasoning or self.matcher is not None or self.num_reasoning_tokens < budget:
            return None
        return self.params.reasoning.end_id

    def note_reasoning(self, token_id: int) -> None:
        """Follow the reasoning block through an appended token."""
        block = self.params.reasoning
        if block is None:
            return
        if self.in_reasoning is None:
            self.in_reasoning = token_id == block.start_id
            self.num_reasoning_output_tokens += self.in_reasoning
        elif self.in_reasoning:
            self.num_reasoning_output_tokens += 1
            if token_id == block.end_id:
                self.in_reasoning = False
            else:
                self.num_reasoning_tokens += 1

    @property
    def needs_every_prompt_row(self) -> bool:
        """Whether rows of its prompt from the first on must be computed (none read from the prefix cache):
        to score them, or to pool them (mean, cls)."""
        return self.scores_prompt or self.pooling in ("mean", "cls")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def scores_prompt(self) -> bool:
        """Whether its prompt's log-probabilities are still to compute: asked for and not all computed yet
        (each of a request's n samples computes its own: none reads the prompt from the prefix cache)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_scores) < self.num_prompt_tokens - 1

    @property
    def prompt_logprobs(self) -> list[TokenLogprobs]:
        """The computed prompt log-probabilities, positions 1 .. P - 1 in order."""
        return [self.prompt_scores[p] for p in sorted(self.prompt_scores)]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def is_prefill_done(self) -> bool:
        return self.num_computed_tokens >= self.num_prompt_tokens

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.error = error

    def chunk_end(self, start: int, end: int) -> int:
        """Where a chunk of positions start .. end - 1 must end instead so it cuts no image span: before a span
        it would enter, or after one it starts inside (over the step's budget, by less than a span: a span's
        tokens attend to all of it, so its last token must be computed with the rest)."""
        for first, last in self.image_spans:
            if first < end < last:
                return first if first > start else last
        return end

    def preempt(self) -> None:
        """Drop everything in the cache; the request recomputes its prompt and outputs later."""
        self.status = RequestStatus.PREEMPTED
        self.num_computed_tokens = 0
        self.num_preemptions += 1
        self.pooled = None
        self.block_ids = []
        self.window_block_ids = []
