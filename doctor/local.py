"""`ladder doctor` on a model loaded in this process: machine limits, sweeps, a load, the verdict."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from doctor.breakdown import matmul_weight_bytes, measure_breakdown
from doctor.config import DoctorConfig
from doctor.cost import ModelCost
from doctor.load import run_engine_load
from doctor.machine import contention_note, measure_machine
from doctor.memory import measure_memory
from doctor.report import DoctorReport
from doctor.roofline import operating_point
from doctor.sweep import run_sweeps
from doctor.verdict import Evidence, classify
from engine.backends.artifact import LoadedArtifact, load_artifact
from engine.config import GIB, EngineConfig, bytes_per_block, state_bytes
from engine.llm_engine import LLMEngine, set_kv_cache_dtype
from kernels.kv_layout import blocks_for_tokens
from model.loader import LoadedModel, load, return_freed_memory
from model.precision import PRECISIONS, precision_of_dtype
from model.quantization import linear_bytes_of, release_unpacked, resolve_quantization


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def precision_of(loaded: LoadedModel) -> str:
    if isinstance(loaded, LoadedArtifact):
        return loaded.manifest.precision
    quantization = getattr(loaded, "quantization", "none")  # int8 or w8a8 linears swapped in at load
    return quantization if quantization != "none" else precision_of_dtype(loaded.module.activation_dtype)


def kernels_of(loaded: LoadedModel) -> str:
    if isinstance(loaded, LoadedArtifact):
        m = loaded.manifest
        return f"artifact: {m.backend} backend, {m.precision} (parity {m.parity.get('passed', '?')})" \
            if isinstance(m.parity, dict) else f"artifact: {m.backend} backend, {m.precision}"
    module = loaded.module
    ops = getattr(getattr(module, "ops", None), "name", "?")
    attention = type(getattr(module, "attention", None)).__name__
    quantization = getattr(loaded, "quantization", "none")
    linears = "" if quantization == "none" else f", {quantization} linears swapped in at load"
    compiled = ("not compiled: see `ladder compile`" if quantization == "none" or PRECISIONS[quantization].compiled
                else f"not compiled: `ladder compile` builds no {quantization} artifact")
    return f"eager PyTorch, ops {ops!r}, attention {attention}{linears} ({compiled})"


def quantization_for(config: DoctorConfig, device: str) -> str:
    """What `ladder serve` with the same options runs: `--quantization` resolved for this model and device
    (an artifact keeps the precision it was compiled in)."""
    if config.artifact is not None:
        return "none"
    return resolve_quantization(config.quantization, config.dtype, device, config.model)


def engine_config(config: DoctorConfig, loaded: LoadedModel, device: str, quantization: str = "none") -> EngineConfig:
    """An engine sized for the doctor's work: a cache that holds the whole load, and the sweeps."""
    num_requests = config.load_requests
    max_model_len = max(config.input_len + config.output_len, config.max_prefill)
    tokens = max(num_requests * blocks_for_tokens(config.input_len + config.output_len, config.block_size),
                 config.max_num_seqs * blocks_for_tokens(config.input_len + 1, config.block_size),
                 2 * blocks_for_tokens(max_model_len, config.block_size)) * config.block_size
    set_kv_cache_dtype(loaded, config.kv_cache_dtype)  # as the engine will: the cache it sizes is the one it gets
    per_block = bytes_per_block(loaded.config, config.block_size, loaded.module.kv_cache_dtype)
    # The linear-attention layers' states (Qwen3.5): half the budget runs max_num_seqs of them, a quarter holds as
    # many prefix-cache snapshots (engine/config.py `plan_state_rows`).
    states = 4 * state_bytes(loaded.config, config.max_num_seqs)
    gib = ((blocks_for_tokens(tokens, config.block_size) + 1) * per_block + states) / GIB
    return EngineConfig(model=config.model, dtype=config.dtype, device=device, quantization=quantization,
                        max_num_seqs=config.max_num_seqs,
                        max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=max_model_len,
                        block_size=config.block_size, kv_cache_dtype=config.kv_cache_dtype, kv_cache_memory_gib=gib,
                        enable_prefix_caching=config.enable_prefix_caching, seed=config.seed)


def model_shapes(loaded: LoadedModel, config: DoctorConfig) -> list[tuple[int, int, int]]:
    """The MLP's matmuls at the decode sweep's largest batch and the prefill sweep's largest chunk."""
    c = loaded.config
    return [(m, k, n) for m in sorted({config.max_num_seqs, config.max_prefill})
            for k, n in ((c.hidden_size, c.intermediate_size), (c.intermediate_size, c.hidden_size))]


def run_local(config: DoctorConfig, loaded: LoadedModel | None = None,
              on_progress: Callable[[str], None] = lambda _: None,
              serialize_token: Callable[[str], object] | None = None) -> DoctorReport:
    """Measure everything in this process; `loaded` skips loading (a model already in memory, whose own
    quantization then counts). `serialize_token(text)`: the server's SSE chunk of one token, timed in the
    step breakdown (None: not timed)."""
    device = config.device or default_device()
    owned = loaded is None  # loaded here: kept as `ladder serve` keeps it (release_unpacked)
    if loaded is None:
        quantization = quantization_for(config, device)
        on_progress("loading the model" + ("" if quantization == "none" else f" ({quantization} linears)"))
        loaded = (load_artifact(config.artifact, device) if config.artifact is not None
                  else load(config.model, dtype=config.dtype, device=device, block_size=config.block_size,
                            quantization=quantization))
    quantization = getattr(loaded, "quantization", "none")
    engine = LLMEngine(engine_config(config, loaded, device, quantization), loaded=loaded)
    module = engine.model.module
    if owned and isinstance(module, torch.nn.Module) and config.artifact is None:
        release_unpacked(module)  # the int8 weights' plain copies, which serve drops too: memory as it would be
        return_freed_memory()
    cost = ModelCost(loaded.config, precision_of(loaded), module.kv_cache_dtype.itemsize)
    dense, experts = matmul_weight_bytes(module) if isinstance(module, torch.nn.Module) else (0, 0)
    if dense:  # the bytes the loaded kernels read (W4A8: the file's block widths), not the nominal size
        cost = dataclasses.replace(cost, bytes_per_weight=dense / cost.dense_params,
                                   expert_bytes_per_weight=experts / cost.expert_params() if experts else None)
    shapes = model_shapes(loaded, config)
    machines = [measure_machine(module.device, shapes, on_progress=on_progress)]
    if module.device.type == "cuda":  # the host's limits too, for comparison
        machines.append(measure_machine(torch.device("cpu"), shapes, on_progress=on_progress))
    sweep = run_sweeps(module, engine.runner.kv_caches, cost, engine.config.max_num_seqs, config.input_len,
                       min(config.max_prefill, config.max_num_batched_tokens, engine.max_model_len),
                       on_progress=on_progress)
    on_progress(f"load: {config.load_requests} requests of {config.input_len} + {config.output_len} tokens at once")
    evidence_load = run_engine_load(engine, cost, config.load_requests, config.input_len, config.output_len,
                                    config.seed, on_progress)
    machine, kind = machines[0], cost.matmul_kind
    operating = operating_point("the load's steps", evidence_load.steps, machine, kind)
    breakdown = measure_breakdown(engine, machine.memory_bandwidth, cost.precision, config.input_len,
                                  seed=config.seed, serialize_token=serialize_token, on_progress=on_progress)
    evidence = evidence_for(evidence_load, operating, cost, machine, is_artifact=config.artifact is not None)
    # A model whose layers have different attention windows runs eager only (model/attention/install.py).
    compilable = getattr(loaded.module, "local_attention", None) is None
    # What this file's own blocks would read in w4a8, for advice on a model served otherwise.
    sizes = linear_bytes_of(config.model) if config.artifact is None else None
    verdict = classify(dataclasses.replace(evidence, compilable=compilable,
                                           w4a8_bytes_ratio=sizes and sizes[0] / sizes[1]))
    notes = [note] if (note := contention_note()) else []
    memory = measure_memory(module, engine.runner.kv_caches) if isinstance(module, torch.nn.Module) else None
    return DoctorReport(loaded.name, str(machine.device), cost, kernels_of(loaded), machines, sweep, evidence_load,
                        operating, verdict, notes=notes, quantization=quantization_of(config, loaded, cost),
                        breakdown=breakdown, memory=memory)


def quantization_of(config: DoctorConfig, loaded: LoadedModel, cost: ModelCost) -> tuple[str | None, str]:
    """(--quantization as asked, what the linears run); an artifact's is its own, not asked (None)."""
    if isinstance(loaded, LoadedArtifact):
        return None, cost.precision if PRECISIONS[cost.precision].quantized else "none"
    return config.quantization, getattr(loaded, "quantization", "none")


def evidence_for(load_evidence, operating, cost: ModelCost, machine, is_artifact: bool = False) -> Evidence:
    kind = cost.matmul_kind
    return Evidence(
        queue_share=load_evidence.queue_share, occupancy=load_evidence.occupancy,
        max_num_seqs=load_evidence.max_num_seqs, num_preemptions=load_evidence.num_preemptions,
        overhead_share=load_evidence.overhead_share,
        roof_fraction=None if operating is None else operating.fraction,
        roof=None if operating is None else operating.roof,
        operating_label=f"the load's {operating.num_steps} steps" if operating else "the load's steps",
        weight_bytes=cost.weight_bytes, precision=cost.precision, is_artifact=is_artifact,
        faster_kinds={k: v / machine.peak[kind] for k, v in machine.peak.items() if k != kind and kind in machine.peak},
    )
