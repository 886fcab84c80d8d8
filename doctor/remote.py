"""`ladder doctor --base-url`: the same report for a running ladder server, measured over HTTP.

The runtime layer comes from the server's own counters (/metrics, read before and after a short flood
sent with loadtest's client); the model layer from GET /stats; the hardware layer is measured here,
so it describes the server's machine only when the server runs on this one (the report says so).
Without a per-step view, the load's steps are costed as a whole: every step reads the weights once,
every token does its matmuls, decode tokens attend to the mean context.
"""

from __future__ import annotations

import asyncio
import json
import math
import urllib.error
import urllib.request
from collections.abc import Callable
from urllib.parse import urlparse

import torch

from doctor.config import DoctorConfig
from doctor.cost import ModelCost, StepCost
from doctor.load import STEP_PHASES, LoadEvidence
from doctor.local import evidence_for
from doctor.machine import contention_note, measure_machine
from doctor.report import DoctorReport
from doctor.roofline import RooflinePoint, operating_point
from doctor.verdict import classify
from loadtest.client import api_root
from loadtest.config import LoadShape, LoadTestConfig, LoadTestError, WorkloadConfig
from loadtest.server_metrics import Samples, by_label, delta, parse_prometheus, total
from model.config import ModelConfig
from model.precision import PRECISIONS


def fetch(url: str, api_key: str | None = None) -> bytes:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.read()
    except urllib.error.HTTPError as error:
        raise ValueError(f"GET {url} answered {error.code}: is this a ladder server?") from None
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        raise ValueError(f"cannot reach {url}: {reason}") from None


def read_stats(root: str, api_key: str | None = None) -> dict:
    try:
        stats = json.loads(fetch(root + "/stats", api_key))
    except json.JSONDecodeError:
        raise ValueError(f"{root}/stats is not JSON: is this a ladder server?") from None
    if not stats.get("model") or not stats["model"].get("config"):
        raise ValueError(f"{root} has no model loaded yet (GET /stats shows none); retry when /ready answers 200")
    return stats


def histogram_mean(moved: Samples, name: str) -> float | None:
    count, seconds = total(moved, f"{name}_count"), total(moved, f"{name}_sum")
    return seconds / count if count else None


def load_cost(cost: ModelCost, num_steps: float, prompt_tokens: float, generation_tokens: float,
              num_requests: int) -> StepCost:
    """Every step of the load at once: weights once per step, each token's matmuls, attention at the
    mean context (prompt tokens attend to half their prompt on average)."""
    prompt_len = prompt_tokens / max(num_requests, 1)
    context = prompt_len + generation_tokens / max(num_requests, 1) / 2
    tokens = prompt_tokens + generation_tokens
    flops = 2.0 * (cost.layer_matmul_params * tokens + cost.head_params * generation_tokens)
    flops += cost.attention_flops(1) * (generation_tokens * context + prompt_tokens * prompt_len / 2)
    kv = (generation_tokens * context + tokens) * cost.kv_bytes_per_token
    return StepCost(num_steps * cost.weight_bytes + kv, flops)


def run_remote(config: DoctorConfig, on_progress: Callable[[str], None] = lambda _: None) -> DoctorReport:
    from loadtest.measure import measure  # needs aiohttp: imported only when a server is measured

    root = api_root(config.base_url)
    on_progress(f"reading {root}/stats")
    stats = read_stats(root, config.api_key)  # a server with a key may protect /stats and /metrics
    served = stats["model"]
    model_config = ModelConfig.from_dict(served["config"])
    precision = served["precision"] or "fp32"
    kv_dtype = PRECISIONS[precision].dtype if precision in PRECISIONS else torch.float32  # int8 forms: an fp32 cache
    cost = ModelCost(model_config, precision, kv_dtype.itemsize)
    num_requests = config.load_requests
    before = parse_prometheus(fetch(root + "/metrics", config.api_key).decode())
    on_progress(f"load: {num_requests} requests of ~{config.input_len} + {config.output_len} tokens at once")
    load_config = LoadTestConfig(
        base_url=root, model=None, api_key=config.api_key, endpoint="completions",
        workload=WorkloadConfig(input_len=config.input_len, output_len=config.output_len, seed=config.seed),
        shape=LoadShape(request_rate=math.inf, num_requests=num_requests), quiet=True)
    try:
        measurement = asyncio.run(measure(load_config))
    except LoadTestError as error:
        raise ValueError(str(error)) from None
    point = measurement.points[0]
    if point.summary.num_ok == 0:
        first = next(r for r in point.run.records if not r.ok)
        raise ValueError(f"no request of the load succeeded; the first: {first.error_kind}: {first.error}")
    moved = delta(before, parse_prometheus(fetch(root + "/metrics", config.api_key).decode()))
    steps = by_label(moved, "ladder_engine_step_seconds_total", "phase")
    num_steps = int(total(moved, "ladder_engine_steps_total") or 0)
    prompt_tokens = total(moved, "ladder_prompt_tokens_total") or 0.0
    generation_tokens = total(moved, "ladder_generation_tokens_total") or 0.0
    forward = steps.get("forward", 0.0)
    points = []
    if num_steps and forward > 0:
        points.append(RooflinePoint(f"load ({num_steps} steps)", "load", int(prompt_tokens + generation_tokens),
                                    forward, load_cost(cost, num_steps, prompt_tokens, generation_tokens,
                                                       num_requests)))
    evidence = LoadEvidence(
        source=root, num_requests=num_requests, wall_seconds=point.summary.duration_s,
        mean_queue=histogram_mean(moved, "ladder_request_queue_seconds"),
        mean_prefill=histogram_mean(moved, "ladder_request_prefill_seconds"),
        mean_decode=histogram_mean(moved, "ladder_request_decode_seconds"),
        mean_e2e=histogram_mean(moved, "ladder_e2e_request_latency_seconds"),
        step_seconds={phase: steps.get(phase, 0.0) for phase in STEP_PHASES}, num_steps=num_steps,
        prompt_tokens=prompt_tokens, generation_tokens=generation_tokens,
        num_preemptions=total(moved, "ladder_num_preemptions_total"),
        prefix_queries=total(moved, "ladder_prefix_cache_queries_total"),
        prefix_hits=total(moved, "ladder_prefix_cache_hits_total"),
        max_num_seqs=served.get("max_num_seqs"), steps=points)
    device = torch.device(served.get("device") or "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"the server runs on {device}, which this machine does not have: run the doctor there")
    c = model_config
    shapes = [(m, k, n) for m in sorted({served.get("max_num_seqs") or 16, config.max_prefill})
              for k, n in ((c.hidden_size, c.intermediate_size), (c.intermediate_size, c.hidden_size))]
    machine = measure_machine(device, shapes, on_progress=on_progress)
    operating = operating_point("the load's steps", points, machine, cost.matmul_kind)
    verdict = classify(evidence_for(evidence, operating, cost, machine, is_artifact=bool(served.get("artifact"))))
    kernels = f"served by {root}: {'artifact ' + served['artifact'] if served.get('artifact') else 'eager'}, {precision}"
    notes = []
    if urlparse(root).hostname not in ("127.0.0.1", "localhost", "::1"):
        notes.append(f"the hardware figures are this machine's; {root} may run on another")
    notes.append("the server counts all of its traffic during the load, not only the doctor's requests")
    if (note := contention_note()) is not None:
        notes.append(note)
    return DoctorReport(served["name"], str(device), cost, kernels, [machine], [], evidence, operating, verdict,
                        notes=notes,
                        quantization=(None, precision if precision in PRECISIONS and PRECISIONS[precision].quantized
                                      else "none"))
