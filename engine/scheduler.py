"""Continuous batching: which requests advance this step, and by how many tokens. Pure Python.

Each step has a token budget (`max_num_batched_tokens`) and a cap on running sequences (`max_num_seqs`).
Running requests go first, oldest first: each gets its remaining tokens (one for a decode, the rest of
its prompt, in chunks, for a prefill). Waiting requests are then admitted first come, first served while
budget, sequence slots and blocks last. When blocks run out, the most recently admitted running request
is preempted (its blocks freed, recomputed later from the front of the queue), so older requests always
make progress and none starves.

Decodes first: while any request is decoding, prompt tokens (of running and newly admitted requests
alike) share a smaller budget, `max_prefill_tokens`, so a burst of prompts costs each decoding stream a
bounded delay per step instead of one long stall, and a burst is admitted a few prompts per step: their
first tokens come out in turn instead of all at the end, and the requests do not all finish (and come
back) together. With nothing decoding, prompts get the whole step budget.

A prompt whose images attend to themselves both ways (Gemma 3, `Request.image_spans`) is chunked so no
chunk ends inside an image: a chunk that would stops before it, or runs to its end when it starts inside.

A model with linear-attention layers (Qwen3.5) keeps a state per running sequence: a request takes a state slot
(engine/state_slots.py) when it is admitted and gives it back when it finishes or is preempted. Its cached prefix
reaches only as far as a snapshot of those states (engine/state_cache.py), which the step copies into the
request's slot first (`SchedulerOutput.state_copies`); a prompt's chunk ends at its snapshot's boundary.

A request with a LoRA adapter takes a slot of the adapter manager (engine/lora_manager.py) when it is
admitted and gives it back when it finishes or is preempted; one whose adapter finds no free slot stays
waiting, and the waiting requests behind it are considered in turn.

With the KV blocks split into pools (engine/block_manager.py), an admitted request goes to the pool
with the fewest running requests, one holding its prefix winning a near tie, and a preemption frees
blocks in the pool that ran out: the most recently admitted request of that pool is the victim.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import CachedPrefix, KVBlockManager
from engine.lora_manager import LoRAManager
from engine.request import FinishReason, Request, RequestStatus
from engine.state_cache import StateCache, boundaries
from engine.state_slots import StateSlots


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    max_prefill_tokens: int | None = None  # prompt tokens per step while any request decodes (None: no bound)
    # Prompt tokens per step of a request that scores its prompt (prompt_logprobs): each gives a row of
    # logits, [rows, vocab] float32, so the engine sizes this to the vocabulary.
    max_scored_tokens: int = 512

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "max_scored_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_prefill_tokens is not None and self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be at least 1, got {self.max_prefill_tokens}")


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens from request.num_computed_tokens on to run this step, drafts included
    # Speculative drafts run after the request's last token (engine/speculative.py): the step computes
    # them, but they count as computed only once the sampler accepts them.
    draft_token_ids: tuple[int, ...] = ()


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    rejected: list[Request] = field(default_factory=list)  # finished with an error: can never run
    # (snapshot row, state slot): linear-attention states to copy before the step runs (a cached prefix's)
    state_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: KVBlockManager,
                 adapters: LoRAManager | None = None, states: StateSlots | None = None,
                 state_cache: StateCache | None = None) -> None:
        self.config = config
        self.blocks = block_manager
        self.adapters = adapters  # LoRA slots, taken at admission and given back at preemption or the end
        self.states = states  # state slots (a model with linear-attention layers), held as the LoRA slots
        self.state_cache = state_cache  # their snapshots by prefix (None: such a model's prefixes are not reused)
        if states is not None and states.num_slots < config.max_num_seqs:
            raise ValueError(f"{states.num_slots} state slots cannot serve {config.max_num_seqs} running sequences")
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def why_never_fits(self, request: Request) -> str | None:
        """A reason the request can never be scheduled, or None."""
        if request.pooling is not None:  # an embedding: its prompt alone
            longest = request.num_prompt_tokens
            if longest > self.config.max_model_len:
                return f"the input ({longest} tokens) exceeds max_model_len ({self.config.max_model_len})"
        else:
            longest = request.num_prompt_tokens + request.params.max_tokens
            if longest > self.config.max_model_len:
                return (f"prompt ({request.num_prompt_tokens} tokens) plus max_tokens ({request.params.max_tokens}) "
                        f"exceeds max_model_len ({self.config.max_model_len})")
        if self.blocks.blocks_needed(longest) > self.blocks.pool_size:
            capacity = self.blocks.pool_size * self.blocks.block_size
            whole = "the whole cache" if self.blocks.num_pools == 1 else "a pool of the cache (one rank's)"
            return f"request needs up to {longest} tokens of KV cache but {whole} holds {capacity}"
        return None

    def schedule(self, drafts: dict[Request, list[int]] | None = None) -> SchedulerOutput:
        """`drafts`: speculative tokens to verify after decoding requests' last token; a request's drafts
        are cut to the step's budget, and dropped before anything is preempted for their blocks."""
        drafts = drafts or {}
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        # Prompt tokens also draw on prefill_budget; decodes (one token each) only on budget.
        prefill_budget = budget
        if self.config.max_prefill_tokens is not None and any(is_decode(r) for r in self.running):
            prefill_budget = self.config.max_prefill_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            remaining = request.num_tokens - request.num_computed_tokens
            is_prompt = remaining > 1  # a prompt (or a preempted request's recompute), in chunks
            if is_prompt:
                if prefill_budget <= 0:
                    index += 1  # its next chunk waits; the decodes after it still run
                    continue
                remaining = min(remaining, prefill_budget, self._prompt_chunk_limit(request))
            num_new = min(remaining, budget)
            if is_prompt:
                start = request.num_computed_tokens
                num_new = self._chunk_end(request, start, start + num_new) - start
            draft = tuple(drafts.get(request, ()))[:budget - 1] if not is_prompt else ()
            if draft and self.blocks.allocate(request, num_new + len(draft)):
                out.scheduled.append(ScheduledRequest(request, num_new + len(draft), draft))
                budget -= num_new + len(draft)
                index += 1
                continue
            while not self.blocks.allocate(request, num_new):
                victim = self._pop_victim(request.kv_pool)  # the pool's most recently admitted
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                out.scheduled.append(ScheduledRequest(request, num_new))
                budget -= num_new
                if is_prompt:
                    prefill_budget -= num_new
                index += 1
                continue
            break
        # Admissions wait while anything is being preempted: the freed blocks go to older requests.
        no_slot: list[Request] = []  # waiting for a LoRA slot: the requests behind them go first
        while (self.waiting and min(budget, prefill_budget) > 0 and len(self.running) < self.config.max_num_seqs
               and not out.preempted):
            request = self.waiting[0]
            reason = self.why_never_fits(request)
            if reason is not None:
                self.waiting.popleft()
                request.finish(FinishReason.ERROR, reason)
                out.rejected.append(request)
                continue
            if request.leader is not None and not (request.leader.is_prefill_done or request.leader.is_finished):
                break  # first come, first served: nothing overtakes a waiting sample
            if not self._take_adapter(request):
                no_slot.append(self.waiting.popleft())
                continue
            admitted = self._allocate_admission(request, min(budget, prefill_budget, self._prompt_chunk_limit(request)))
            if admitted is None:
                self._give_back_adapter(request)
                break
            prefix, num_new = admitted
            self.waiting.popleft()
            request.num_computed_tokens = prefix.num_tokens
            request.num_cached_tokens = prefix.num_tokens
            request.status = RequestStatus.RUNNING
            if self.states is not None:
                self.states.acquire(request)
                if prefix.num_tokens:  # the states after the prefix, copied from its snapshot before the step
                    snapshot = self.state_cache.find(request.block_hashes[len(prefix.block_ids) - 1])
                    out.state_copies.append((snapshot, request.state_slot))
                    self.state_cache.hits += 1
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
            prefill_budget -= num_new
        self.waiting.extendleft(reversed(no_slot))
        return out

    def finish_step(self, output: SchedulerOutput) -> None:
        """After the model ran: count computed tokens and cache the full blocks they completed."""
        for item in output.scheduled:
            item.request.num_computed_tokens += item.num_new_tokens - len(item.draft_token_ids)
            self.blocks.register_computed_blocks(item.request)

    def remove_finished(self) -> list[Request]:
        """Release the blocks of finished requests; returns them."""
        finished = [r for r in self.running if r.is_finished]
        finished += [r for r in self.waiting if r.is_finished]
        if finished:
            self.running = [r for r in self.running if not r.is_finished]
            self.waiting = deque(r for r in self.waiting if not r.is_finished)
            for request in finished:
                self.blocks.release(request)
                self._give_back_adapter(request)
                if self.states is not None:
                    self.states.release(request)
        return finished

    def _prompt_chunk_limit(self, request: Request) -> int:
        """The most prompt tokens the request may run in one step (its own limit, beside the budgets)."""
        return self.config.max_scored_tokens if request.scores_prompt else self.config.max_num_batched_tokens

    def _allocate_admission(self, request: Request, limit: int) -> tuple[CachedPrefix, int] | None:
        """Blocks for a waiting request's cached prefix and first chunk (up to `limit` tokens), from the
        first pool in `_pool_order` that has them: (prefix, chunk length), or None, nothing changed."""
        for pool, prefix in self._pool_order(request):
            request.kv_pool = pool
            if self.state_cache is not None:  # KV blocks shared past every snapshot: keep the states there too
                shared = self.blocks.cached_prefix(request, pool).num_tokens
                request.shared_prefix = shared if shared > prefix.num_tokens else 0
            num_new = min(request.num_tokens - prefix.num_tokens, limit)
            num_new = self._chunk_end(request, prefix.num_tokens, prefix.num_tokens + num_new) - prefix.num_tokens
            if self.blocks.allocate(request, num_new, prefix):
                self.blocks.count_lookup(request, prefix)
                return prefix, num_new
        return None

    def _pool_order(self, request: Request) -> list[tuple[int, CachedPrefix]]:
        """(pool, the request's cached prefix there), by load (running requests); a pool holding the
        request's prefix counts one request lighter, since computing the prefix again costs more than a
        sequence of imbalance."""
        num_pools = self.blocks.num_pools
        found = [(pool, self._cached_prefix(request, pool)) for pool in range(num_pools)]
        if num_pools == 1:
            return found
        load = [0] * num_pools
        for running in self.running:
            load[running.kv_pool] += 1
        return sorted(found, key=lambda item: (load[item[0]] - (item[1].num_tokens > 0), -item[1].num_tokens,
                                               item[0]))

    def _cached_prefix(self, request: Request, pool: int) -> CachedPrefix:
        """The block manager's cached prefix; with linear-attention states, cut back to the longest part of it that
        ends where a snapshot of them was kept (none without their cache)."""
        prefix = self.blocks.cached_prefix(request, pool)
        if self.states is None or not prefix.num_tokens:
            return prefix
        cached = self.state_cache.cached if self.state_cache is not None else {}
        count = next((k for k in range(len(prefix.block_ids), 0, -1) if request.block_hashes[k - 1] in cached), 0)
        return CachedPrefix(prefix.block_ids[:count], count * self.blocks.block_size)

    def _chunk_end(self, request: Request, start: int, end: int) -> int:
        """Where a prompt's chunk start .. end - 1 ends: `Request.chunk_end`, and at a boundary its states are kept
        at when it would pass one (engine/state_cache.py)."""
        end = request.chunk_end(start, end)
        if self.state_cache is not None and self.state_cache.num_snapshots:
            return next((b for b in boundaries(request, self.blocks.block_size) if start < b < end), end)
        return end

    def _pop_victim(self, pool: int) -> Request:
        """The most recently admitted running request of the pool (the caller's own request at worst)."""
        for index in range(len(self.running) - 1, -1, -1):
            if self.running[index].kv_pool == pool:
                return self.running.pop(index)
        raise RuntimeError(f"no running request holds blocks of pool {pool}")

    def _take_adapter(self, request: Request) -> bool:
        """Pin a LoRA slot holding the request's adapter (True for a request without one)."""
        if request.lora is None or request.lora_slot >= 0:
            return True
        slot = self.adapters.acquire(request.lora) if self.adapters is not None else None
        if slot is None:
            return False
        request.lora_slot = slot
        return True

    def _give_back_adapter(self, request: Request) -> None:
        if request.lora_slot >= 0:
            self.adapters.release(request.lora_slot)
            request.lora_slot = -1

    def _preempt(self, request: Request) -> None:
        self._give_back_adapter(request)
        if self.states is not None:
            self.states.release(request)
        self.blocks.release(request)
        request.preempt()
        self.num_preemptions += 1
        self.waiting.appendleft(request)


def is_decode(request: Request) -> bool:
    """One token left to compute: the last sampled one."""
    return request.num_tokens - request.num_computed_tokens == 1
