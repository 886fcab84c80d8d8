"""A short load through the engine in this process: a flood of requests that all arrive at once, run to
the end, with every step's forward timed and costed, and every request's time split into queue,
prefill and decode (the engine's own RequestTiming)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from doctor.cost import ModelCost
from doctor.roofline import RooflinePoint, combine
from engine.throughput import BenchConfig, make_workload
from engine.llm_engine import LLMEngine
from engine.model_runner import ModelInputs, ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerOutput
from engine.stats import RequestTiming

STEP_PHASES = ("schedule", "prepare", "forward", "sample")


@dataclass(frozen=True)
class LoadEvidence:
    """What a load showed about the runtime layer; the same fields whether measured in this process or
    read from a server's /metrics (then None where the server does not say)."""

    source: str  # "engine" or the server's URL
    num_requests: int
    wall_seconds: float
    mean_queue: float | None  # seconds from arrival to first scheduled
    mean_prefill: float | None
    mean_decode: float | None
    mean_e2e: float | None
    step_seconds: dict[str, float]  # engine time by step phase
    num_steps: int
    prompt_tokens: float
    generation_tokens: float
    num_preemptions: float | None
    prefix_queries: float | None
    prefix_hits: float | None
    max_num_seqs: int | None
    steps: list[RooflinePoint] = field(default_factory=list)  # each step's forward, when measured here

    @property
    def queue_share(self) -> float | None:
        """Of a request's life, the part spent waiting to be scheduled."""
        if self.mean_queue is None or not self.mean_e2e:
            return None
        return self.mean_queue / self.mean_e2e

    @property
    def overhead_share(self) -> float | None:
        """Of the engine's step time, the part outside the model's forward (scheduling, building inputs,
        sampling): Python and host work that a faster model would not remove."""
        total = sum(self.step_seconds.values())
        return None if total <= 0 else 1.0 - self.step_seconds.get("forward", 0.0) / total

    @property
    def mean_batch(self) -> float | None:
        """Tokens sampled per step: the decode batch the engine ran at."""
        return self.generation_tokens / self.num_steps if self.num_steps else None

    @property
    def occupancy(self) -> float | None:
        if self.mean_batch is None or not self.max_num_seqs:
            return None
        return self.mean_batch / self.max_num_seqs

    @property
    def prefix_hit_rate(self) -> float | None:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else None

    @property
    def output_tokens_per_s(self) -> float:
        return self.generation_tokens / self.wall_seconds if self.wall_seconds > 0 else 0.0

    def combined(self, phase: str) -> RooflinePoint | None:
        """The load's decode-only steps (phase "decode"), its steps with prompt tokens ("prefill"), or the
        whole load costed at once ("load", over HTTP) as one point."""
        chosen = [s for s in self.steps if s.phase == phase]
        return combine("load" if phase == "load" else f"load {phase}", phase, chosen)

    def to_dict(self) -> dict:
        data = {k: v for k, v in asdict(self).items() if k != "steps"}
        for name in ("queue_share", "overhead_share", "mean_batch", "occupancy", "prefix_hit_rate",
                     "output_tokens_per_s"):
            data[name] = getattr(self, name)
        data["num_steps_measured"] = len(self.steps)
        return data


class TimedRunner:
    """The engine's runner with each step's forward timed and costed (the load's roofline points)."""

    def __init__(self, runner: ModelRunner, cost: ModelCost) -> None:
        self.runner, self.cost = runner, cost
        self.module, self.kv_caches = runner.module, runner.kv_caches
        self.points: list[RooflinePoint] = []
        self._shape: tuple[list[int], list[int]] = ([], [])

    def copy_states(self, pairs: list[tuple[int, int]]) -> None:  # (snapshots of linear-attention states)
        self.runner.copy_states(pairs)

    def prepare(self, batch: SchedulerOutput) -> ModelInputs:
        query_lens = [item.num_new_tokens for item in batch.scheduled]
        seq_lens = [item.request.num_computed_tokens + item.num_new_tokens for item in batch.scheduled]
        self._shape = (query_lens, seq_lens)
        return self.runner.prepare(batch)

    def forward(self, inputs: ModelInputs):
        device = self.module.device
        if device.type == "cuda":  # kernels run asynchronously: time them from an idle device to a finished one
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        outputs = self.runner.forward(inputs)  # (logits, hidden states or None)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        query_lens, seq_lens = self._shape
        cost = self.cost.step(query_lens, seq_lens, len(inputs.sample_requests))
        phase = "decode" if all(q == 1 for q in query_lens) else "prefill"
        self.points.append(RooflinePoint(f"step {len(self.points)}", phase, sum(query_lens), seconds, cost))
        return outputs


def run_engine_load(engine: LLMEngine, cost: ModelCost, num_requests: int, input_len: int, output_len: int,
                    seed: int = 0, on_progress: Callable[[str], None] = lambda _: None) -> LoadEvidence:
    """All `num_requests` arrive at once; each has a random prompt of `input_len` tokens and produces
    exactly `output_len` tokens."""
    special = engine.tokenizer.special_ids if engine.tokenizer else frozenset()
    work = make_workload(BenchConfig(num_prompts=num_requests, input_len=input_len, output_len=output_len, seed=seed),
                         engine.model.config.vocab_size, special)
    timings: list[RequestTiming] = []
    engine.stats.observers.append(timings.append)
    timed = TimedRunner(engine.runner, cost)
    engine.runner = timed
    before = engine.stats.snapshot()
    try:
        start = time.perf_counter()
        for i, prompt in enumerate(work.prompts):
            engine.add_request(f"doctor-{i}", prompt,
                               SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True))
        last_report = start
        while engine.has_unfinished():
            engine.step()
            if time.perf_counter() - last_report > 1.0:
                last_report = time.perf_counter()
                on_progress(f"load: {len(timed.points)} steps, {sum(p.num_tokens for p in timed.points)} tokens "
                            f"computed, {len(timings)}/{num_requests} requests done")
        wall = time.perf_counter() - start
    finally:
        engine.runner = timed.runner
        engine.stats.observers.remove(timings.append)
    after = engine.stats.snapshot()

    def mean(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return sum(present) / len(present) if present else None

    moved = {key: after[key] - before[key] for key in ("num_steps", "num_prompt_tokens", "num_generation_tokens",
                                                       "num_preemptions", "prefix_queries", "prefix_hits")}
    return LoadEvidence(
        source="engine", num_requests=num_requests, wall_seconds=wall,
        mean_queue=mean([t.queue for t in timings]), mean_prefill=mean([t.prefill for t in timings]),
        mean_decode=mean([t.decode for t in timings]), mean_e2e=mean([t.end_to_end for t in timings]),
        step_seconds={p: after["seconds"].get(p, 0.0) - before["seconds"].get(p, 0.0) for p in STEP_PHASES},
        num_steps=moved["num_steps"], prompt_tokens=moved["num_prompt_tokens"],
        generation_tokens=moved["num_generation_tokens"], num_preemptions=moved["num_preemptions"],
        prefix_queries=moved["prefix_queries"], prefix_hits=moved["prefix_hits"],
        max_num_seqs=engine.config.max_num_seqs, steps=timed.points,
    )
