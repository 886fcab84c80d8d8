"""Step-level statistics of the engine: what ran, how long each phase took, how full the cache is."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from engine.request import Request


@dataclass
class EngineStats:
    num_steps: int = 0
    num_prompt_tokens: int = 0  # prompt tokens computed (recomputation after preemption included)
    num_generation_tokens: int = 0
    seconds: Counter = field(default_factory=Counter)  # phase -> total seconds: schedule, prepare, forward, sample
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    prefix_queries: int = 0
    prefix_hits: int = 0
    num_preemptions: int = 0
    finished: Counter = field(default_factory=Counter)  # finish reason -> count
    # Per finished sample, for latency histograms: (queue, time to first token, end to end) in seconds.
    recent_latencies: list[tuple[float, float | None, float]] = field(default_factory=list)

    def record_step(self, plan, num_sampled: int, schedule: float, prepare: float, forward: float,
                    sample: float) -> None:
        """Call before the plan's tokens are counted as computed."""
        self.num_steps += 1
        for item in plan.scheduled:
            prompt_left = max(item.request.num_prompt_tokens - item.request.num_computed_tokens, 0)
            self.num_prompt_tokens += min(item.num_new_tokens, prompt_left)
        self.num_generation_tokens += num_sampled
        self.seconds.update({"schedule": schedule, "prepare": prepare, "forward": forward, "sample": sample})

    def observe_queue(self, scheduler, blocks) -> None:
        self.num_running = len(scheduler.running)
        self.num_waiting = len(scheduler.waiting)
        self.kv_usage = blocks.usage
        self.prefix_queries = blocks.prefix_queries
        self.prefix_hits = blocks.prefix_hits
        self.num_preemptions = scheduler.num_preemptions

    def record_finished(self, request: Request) -> None:
        self.finished[request.finish_reason.value] += 1
        now = time.monotonic()
        queued = (request.first_scheduled_time or now) - request.arrival_time
        ttft = None if request.first_token_time is None else request.first_token_time - request.arrival_time
        self.recent_latencies.append((queued, ttft, now - request.arrival_time))
        del self.recent_latencies[:-1000]
