"""Step-level statistics of the engine: what ran, how long each phase took, how full the cache is.

Written by the engine thread, read by whoever reports them (the server's /metrics) through
`snapshot()`, under a lock so a reader never sees a half-updated step.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from engine.block_manager import KVBlockManager
from engine.image_cache import ImageCache
from engine.request import Request
from engine.scheduler import Scheduler, SchedulerOutput


@dataclass(frozen=True)
class RequestTiming:
    """Where one finished sample's time went, in seconds (None when it never got that far)."""

    finish_reason: str
    queue: float | None  # arrival -> first scheduled
    prefill: float | None  # first scheduled -> first token
    decode: float | None  # first token -> finish
    time_to_first_token: float | None  # arrival -> first token
    end_to_end: float  # arrival -> finish
    num_prompt_tokens: int
    num_output_tokens: int


@dataclass
class EngineStats:
    num_steps: int = 0
    num_prompt_tokens: int = 0  # prompt tokens computed (recomputation after preemption included)
    num_generation_tokens: int = 0
    seconds: Counter = field(default_factory=Counter)  # phase -> total seconds: schedule, prepare, forward, sample
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_blocks: int = 0
    num_free_blocks: int = 0
    # The sliding-window layers' own pool (engine/window_blocks.py); 0 and 0 where the layers share one.
    num_window_blocks: int = 0
    num_free_window_blocks: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    num_preemptions: int = 0
    num_lora_loads: int = 0  # LoRA adapters copied into a slot since start (engine/lora_manager.py)
    num_loras_resident: int = 0
    finished: Counter = field(default_factory=Counter)  # finish reason -> count
    # Speculative decoding (engine/speculative.py): draft tokens verified, and of those accepted (each an
    # output token beyond the one a step gives anyway).
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # A vision model's images (engine/image_cache.py): those run through the tower and those found in the
    # image cache, the tiles run and the tower's seconds, since start.
    num_images_encoded: int = 0
    num_images_cached: int = 0
    num_vision_tiles: int = 0
    vision_seconds: float = 0.0
    # Tensor parallelism: seconds rank 0 spent in each collective since start (broadcast, all_reduce,
    # gather), all inside the forward phase; empty for one process.
    communication: dict[str, float] = field(default_factory=dict)
    # Called from the engine thread with each finished sample's timing (the server feeds histograms).
    observers: list[Callable[[RequestTiming], None]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record_step(self, batch: SchedulerOutput, num_sampled: int, schedule: float, prepare: float, forward: float,
                    sample: float) -> None:
        """Call before the batch's tokens are counted as computed."""
        with self.lock:
            self.num_steps += 1
            for item in batch.scheduled:
                prompt_left = max(item.request.num_prompt_tokens - item.request.num_computed_tokens, 0)
                self.num_prompt_tokens += min(item.num_new_tokens, prompt_left)
            self.num_generation_tokens += num_sampled
            self.seconds.update({"schedule": schedule, "prepare": prepare, "forward": forward, "sample": sample})

    def record_speculation(self, num_drafts: int, num_accepted: int) -> None:
        with self.lock:
            self.num_draft_tokens += num_drafts
            self.num_accepted_tokens += num_accepted
            self.num_generation_tokens += num_accepted

    def record_communication(self, seconds: dict[str, float]) -> None:
        with self.lock:
            self.communication = dict(seconds)

    def observe_queue(self, scheduler: Scheduler, blocks: KVBlockManager) -> None:
        with self.lock:
            self.num_running = len(scheduler.running)
            self.num_waiting = len(scheduler.waiting)
            self.kv_usage = blocks.usage
            self.num_blocks = blocks.num_blocks
            self.num_free_blocks = blocks.num_free_blocks
            self.num_window_blocks = getattr(blocks, "num_window_blocks", 0)
            self.num_free_window_blocks = getattr(blocks, "num_free_window_blocks", 0)
            self.prefix_queries = blocks.prefix_queries
            self.prefix_hits = blocks.prefix_hits
            self.num_preemptions = scheduler.num_preemptions
            if scheduler.adapters is not None:
                self.num_lora_loads = scheduler.adapters.num_loads
                self.num_loras_resident = sum(name is not None for name in scheduler.adapters.resident)

    def record_vision(self, cache: ImageCache, tiles: int, seconds: float) -> None:
        with self.lock:
            self.num_images_encoded, self.num_images_cached = cache.misses, cache.hits
            self.num_vision_tiles += tiles
            self.vision_seconds += seconds

    def record_finished(self, request: Request) -> None:
        now = time.monotonic()
        scheduled, first = request.first_scheduled_time, request.first_token_time
        timing = RequestTiming(
            finish_reason=request.finish_reason.value,
            queue=None if scheduled is None else scheduled - request.arrival_time,
            prefill=None if scheduled is None or first is None else first - scheduled,
            decode=None if first is None else now - first,
            time_to_first_token=None if first is None else first - request.arrival_time,
            end_to_end=now - request.arrival_time,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=len(request.output_token_ids),
        )
        with self.lock:
            self.finished[timing.finish_reason] += 1
        for observe in self.observers:
            observe(timing)

    def snapshot(self) -> dict:
        with self.lock:
            values = {k: v for k, v in vars(self).items() if k not in ("observers", "lock")}
            values["seconds"] = dict(self.seconds)
            values["finished"] = dict(self.finished)
            values["communication"] = dict(self.communication)
        return values
