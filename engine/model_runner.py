"""Turns the scheduler's batch into a step (model/step.py), runs it, and returns the logits to sample from."""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass

import torch

from engine.request import Request
from engine.scheduler import SchedulerOutput
from model.lora_slots import LoRASlots
from model.step import (
    InputEmbeds,
    SeqChunk,
    StepInputs,
    StepModel,
    allocate_caches,
    build_step,
    run_step,
    run_step_with_hidden,
)


@dataclass(frozen=True)
class ModelInputs:
    step: StepInputs
    sample_requests: list[Request]  # the requests whose rows are sampled, in the step's sample_rows order
    # Per sampled request, the speculative drafts its step verifies: it has len(drafts) + 1 rows of logits,
    # the last token's and each draft's, consecutive. All empty in a step without speculation.
    drafts: list[tuple[int, ...]]

    # Prompts scored (SamplingParams.prompt_logprobs): their rows of logits, which come before the sampled
    # rows; then the rows of the sampled requests, in order (None: every row of the logits, none scored).
    scored: tuple[ScoredRows, ...] = ()
    sample_logit_rows: list[int] | None = None
    # Embedding requests' rows of the step's final hidden states (step.hidden_rows), in order.
    pooled: tuple[PooledRows, ...] = ()

    @property
    def speculates(self) -> bool:
        return any(self.drafts)


@dataclass(frozen=True)
class ScoredRows:
    """`count` consecutive rows of a step's logits, from `first_row`, that give the log-probabilities of a
    request's prompt tokens at positions `first_position` .. + count - 1 (each row the token after it)."""

    request: Request
    first_row: int
    count: int
    first_position: int


@dataclass(frozen=True)
class PooledRows:
    """`count` consecutive rows, from `first_row`, of a step's hidden states that an embedding request pools
    (mean: every row of its chunk; cls: its first chunk's first; last: its last chunk's last); `completes`:
    the chunk ends its prompt, so its embedding is ready after this step."""

    request: Request
    first_row: int
    count: int
    completes: bool


class ModelRunner:
    def __init__(self, module: StepModel, num_blocks: int, lora: LoRASlots | None = None,
                 num_window_blocks: int | None = None, num_state_slots: int = 0) -> None:
        """`num_state_slots`: the sequences whose states the linear-attention layers keep at once (a model
        without such layers keeps none; engine/state_slots.py)."""
        self.module = module
        self.lora = lora  # the model's LoRA slots, told each step's rows
        # The sliding-window layers' own pool (engine/window_blocks.py): each step then gives them the
        # requests' window_block_ids as their block tables.
        self.windowed = num_window_blocks is not None
        window = {"num_window_blocks": num_window_blocks} if self.windowed else {}
        self.kv_caches = allocate_caches(module, num_blocks, num_state_slots, **window)
        # A cache split into pools (one per rank, tensor parallelism by sequences): the step's sequences go
        # pool by pool, so each rank's rows are one contiguous run of the batch (a view, not a gather).
        self.num_pools = module.kv_pools

    def warm_up(self) -> None:
        """The model's own warm-up on the engine's caches, before the engine takes requests and /ready
        answers (model/step.py `StepModel.warm_up`; compiled artifacts warmed as they loaded)."""
        self.module.warm_up(self.kv_caches)

    def copy_states(self, pairs: list[tuple[int, int]]) -> None:
        """Copy linear-attention states between rows of their pools, (source row, destination row) each, in every
        such layer: a snapshot kept (engine/state_cache.py), or one restored into a running sequence's slot."""
        if not pairs:
            return
        source, target = (torch.tensor(rows, dtype=torch.long) for rows in zip(*pairs))
        for i, pool in enumerate(self.kv_caches):
            if self.module.config.is_linear_layer(i):
                pool.index_copy_(0, target.to(pool.device), pool.index_select(0, source.to(pool.device)))

    def prepare(self, batch: SchedulerOutput) -> ModelInputs:
        self.copy_states(batch.state_copies)  # a cached prefix's states, before the step reads them
        chunks: list[SeqChunk] = []
        sample_requests: list[Request] = []
        drafts: list[tuple[int, ...]] = []
        scheduled = batch.scheduled
        if self.num_pools > 1:
            scheduled = sorted(scheduled, key=lambda item: item.request.kv_pool)  # stable: order within a pool kept
        scored: list[ScoredRows] = []
        sample_logit_rows: list[int] = []
        pooled: list[PooledRows] = []
        hidden_rows: list[int] = []
        row = 0  # the chunk's first row of the step's logits
        offset = 0  # the chunk's first row of the step's flat batch
        for item in scheduled:
            request, start, draft = item.request, item.request.num_computed_tokens, item.draft_token_ids
            end = start + item.num_new_tokens - len(draft)
            if request.pooling is not None:  # an embedding: rows of hidden states, never a token
                rows = pooled_rows(request.pooling, start, end, request.num_prompt_tokens)
                pooled.append(PooledRows(request, len(hidden_rows), len(rows), end == request.num_prompt_tokens))
                hidden_rows.extend(offset + r for r in rows)
            # Only a chunk that reaches the request's last known token gives the next token (and its
            # drafts' rows, each of which gives the token after it).
            is_sampled = end == request.num_tokens and request.pooling is None
            num_sampled = (1 + len(draft)) * is_sampled
            # A prompt scored: each row from `start` on gives the log-probability of the prompt token after it,
            # up to the row before the prompt's last token (the rows of a chunk that ends inside the prompt all
            # do; a final chunk's last row is the sampled one), so the chunk returns all its rows.
            last = request.num_prompt_tokens - 1
            num_scored = max(0, min(end, last) - start) if request.scores_prompt else 0
            num_rows = len(draft) + end - start if num_scored else num_sampled
            tokens = request.all_token_ids[start:end] + list(draft)
            chunks.append(SeqChunk(tokens, start, request.block_ids, num_rows, request.lora_slot,
                                   request.window_block_ids if self.windowed else None,
                                   image_rows(request, start, end), request.state_slot))
            if num_scored:
                scored.append(ScoredRows(request, row, num_scored, start + 1))
            if is_sampled:
                sample_requests.append(request)
                drafts.append(draft)
                sample_logit_rows.extend(range(row + num_rows - num_sampled, row + num_rows))
            row += num_rows
            offset += len(tokens)
        step = build_step(chunks, self.module.block_size, self.module.device)
        if pooled:
            step = dataclasses.replace(step, hidden_rows=torch.tensor(hidden_rows, dtype=torch.long,
                                                                      device=self.module.device))
        return ModelInputs(step, sample_requests, drafts, tuple(scored), sample_logit_rows if scored else None,
                           tuple(pooled))

    def forward(self, inputs: ModelInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [B, vocab] float32 for the rows to sample (B may be 0 when only prefill chunks ran), and the
        final hidden states [H, hidden] float32 of the embedding requests' rows (None without any)."""
        if self.lora is not None:
            self.lora.rows = inputs.step.adapters
        try:
            if inputs.step.hidden_rows is not None:
                return run_step_with_hidden(self.module, inputs.step, self.kv_caches)
            return run_step(self.module, inputs.step, self.kv_caches), None
        finally:
            if self.lora is not None:
                self.lora.rows = None


def image_rows(request: Request, start: int, end: int) -> InputEmbeds | None:
    """The image embeddings of a chunk of positions start .. end - 1, by the chunk's rows; None for none."""
    positions = request.image_positions
    first, last = bisect.bisect_left(positions, start), bisect.bisect_left(positions, end)
    if first == last:
        return None
    rows = torch.tensor(positions[first:last], dtype=torch.long) - start
    return InputEmbeds(rows, request.image_embeds[first:last], bidirectional=bool(request.image_spans))


def pooled_rows(kind: str, start: int, end: int, num_prompt_tokens: int) -> range:
    """The rows of a chunk of prompt positions start .. end - 1 that `kind` pools, counted from the chunk's
    first: mean every row, cls position 0's, last the prompt's last position's."""
    if kind == "mean":
        return range(end - start)
    if kind == "cls":
        return range(1) if start == 0 else range(0)
    return range(end - start - 1, end - start) if end == num_prompt_tokens else range(0)
