"""Prometheus metrics: engine gauges and counters read at scrape time, latency histograms observed live."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.stats import EngineStats, RequestTiming

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0, 120.0)
TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0)


class EngineCollector(Collector):
    def __init__(self, get_stats: Callable[[], EngineStats | None], is_alive: Callable[[], bool]) -> None:
        self.get_stats = get_stats
        self.is_alive = is_alive

    def collect(self) -> Iterator:
        yield GaugeMetricFamily("ladder_engine_alive", "1 while the engine step loop runs", value=int(self.is_alive()))
        stats = self.get_stats()
        if stats is None:
            return
        s = stats.snapshot()
        gauges = {
            "ladder_num_requests_running": ("Requests being computed", s["num_running"]),
            "ladder_num_requests_waiting": ("Requests queued or preempted", s["num_waiting"]),
            "ladder_kv_cache_usage_ratio": ("Fraction of KV blocks held by requests", s["kv_usage"]),
            "ladder_kv_cache_blocks": ("KV blocks in the cache", s["num_blocks"]),
            "ladder_kv_cache_free_blocks": ("KV blocks held by no request", s["num_free_blocks"]),
            "ladder_kv_window_blocks": ("KV blocks of the sliding-window layers' own pool (0: they share the cache)",
                                        s["num_window_blocks"]),
            "ladder_kv_window_free_blocks": ("Sliding-window KV blocks held by no request",
                                             s["num_free_window_blocks"]),
            "ladder_lora_adapters_resident": ("LoRA adapters in a slot", s["num_loras_resident"]),
            "ladder_spec_decode_acceptance_ratio": (
                "Fraction of speculative draft tokens accepted since start (0 before any)",
                s["num_accepted_tokens"] / s["num_draft_tokens"] if s["num_draft_tokens"] else 0.0),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        counters = {
            "ladder_prefix_cache_queries": ("Prompt tokens looked up in the prefix cache", s["prefix_queries"]),
            "ladder_prefix_cache_hits": ("Prompt tokens found in the prefix cache", s["prefix_hits"]),
            "ladder_num_preemptions": ("Requests preempted to free KV blocks", s["num_preemptions"]),
            "ladder_prompt_tokens": ("Prompt tokens computed", s["num_prompt_tokens"]),
            "ladder_generation_tokens": ("Tokens generated", s["num_generation_tokens"]),
            "ladder_engine_steps": ("Engine steps run", s["num_steps"]),
            "ladder_lora_adapter_loads": ("LoRA adapters copied into a slot", s["num_lora_loads"]),
            "ladder_spec_decode_draft_tokens": ("Speculative draft tokens verified", s["num_draft_tokens"]),
            "ladder_spec_decode_accepted_tokens": ("Speculative draft tokens accepted", s["num_accepted_tokens"]),
            "ladder_vision_images_encoded": ("Images run through the vision tower", s["num_images_encoded"]),
            "ladder_vision_images_cached": ("Images whose embeddings the image cache held", s["num_images_cached"]),
            "ladder_vision_tiles": ("Image tiles run through the vision tower", s["num_vision_tiles"]),
            "ladder_vision_seconds": ("Seconds the vision tower ran", s["vision_seconds"]),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)
        finished = CounterMetricFamily("ladder_requests_finished", "Finished samples by reason", labels=["reason"])
        for reason in ("stop", "length", "abort", "error"):
            finished.add_metric([reason], s["finished"].get(reason, 0))
        yield finished
        phases = CounterMetricFamily("ladder_engine_step_seconds", "Engine time by step phase", labels=["phase"])
        for phase in ("schedule", "prepare", "forward", "sample"):
            phases.add_metric([phase], s["seconds"].get(phase, 0.0))
        yield phases
        if s["communication"]:  # tensor parallel: the communication part of the forward phase
            yield from communication_metrics(s["communication"], sum(s["seconds"].values()))


# all_reduce_max: W8A8 scales; all_gather: the attention output before W8A8's whole o_proj
COLLECTIVES = ("broadcast", "all_reduce", "all_reduce_max", "all_gather", "gather")


def communication_metrics(seconds: dict[str, float], step_seconds: float) -> Iterator:
    spent = CounterMetricFamily("ladder_tensor_parallel_communication_seconds",
                                "Rank 0's time in tensor-parallel collectives by op (part of the forward phase)",
                                labels=["op"])
    share = GaugeMetricFamily("ladder_tensor_parallel_communication_share",
                              "Fraction of engine step time spent in each tensor-parallel collective since start",
                              labels=["op"])
    for op in COLLECTIVES:
        spent.add_metric([op], seconds.get(op, 0.0))
        share.add_metric([op], seconds.get(op, 0.0) / step_seconds if step_seconds else 0.0)
    yield spent
    yield share


class ServerMetrics:
    def __init__(self, get_stats: Callable[[], EngineStats | None], is_alive: Callable[[], bool]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(get_stats, is_alive))

        def histogram(name: str, doc: str, buckets=LATENCY_BUCKETS) -> Histogram:
            return Histogram(name, doc, buckets=buckets, registry=self.registry)

        self.ttft = histogram("ladder_time_to_first_token_seconds", "Arrival to first generated token")
        self.itl = histogram("ladder_inter_token_latency_seconds", "Between streamed outputs of a sample",
                             TOKEN_BUCKETS)
        self.e2e = histogram("ladder_e2e_request_latency_seconds", "Arrival to finish")
        self.queue = histogram("ladder_request_queue_seconds", "Arrival to first scheduled")
        self.prefill = histogram("ladder_request_prefill_seconds", "First scheduled to first token")
        self.decode = histogram("ladder_request_decode_seconds", "First token to finish")

    def observe_finished(self, timing: RequestTiming) -> None:
        """Engine-thread callback; prometheus_client metrics are thread-safe."""
        for histogram, value in ((self.ttft, timing.time_to_first_token), (self.e2e, timing.end_to_end),
                                 (self.queue, timing.queue), (self.prefill, timing.prefill),
                                 (self.decode, timing.decode)):
            if value is not None:
                histogram.observe(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)
