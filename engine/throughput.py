"""Offline throughput: the engine against Hugging Face `generate` on the same weights, in one run.

Both sides get the same prompts (random token ids of the asked lengths) and produce exactly the asked
number of output tokens each (greedy; the engine ignores EOS, `generate` is held to its length).
`generate` runs in padded batches, so prompts and outputs of mixed lengths cost it padding: that is
what it does in practice, and the table counts only the tokens that were asked for.
"""

from __future__ import annotations

import json
import platform
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engine.backends.artifact import LoadedArtifact
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from model.loader import parse_dtype


@dataclass(frozen=True)
class BenchConfig:
    model: str | None = None
    artifact: str | None = None  # a compiled artifact; transformers then runs its source model in fp32
    num_prompts: int = 64
    input_len: int = 128
    output_len: int = 128
    range_ratio: float = 0.0  # lengths drawn uniformly from [len * (1 - r), len * (1 + r)]
    seed: int = 0
    dtype: str = "float32"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_prefill_tokens: int | None = None
    kv_cache_memory_gib: float | None = None
    kv_cache_dtype: str = "auto"  # the engine's (EngineConfig.kv_cache_dtype)
    hf_batch_size: int = 64
    skip_hf: bool = False
    hf_dtype: str | None = None  # transformers' dtype; default: the engine's, float32 for an artifact
    device: str = "cpu"  # the engine's (EngineConfig.device); transformers runs on the same device
    quantization: str = "none"  # the engine's (EngineConfig.quantization); transformers runs unquantized
    tensor_parallel_size: int = 1  # the engine's (EngineConfig.tensor_parallel_size)
    tensor_parallel_attention: str = "heads"  # the engine's (EngineConfig.tensor_parallel_attention)
    # LoRA adapters (name, path): the prompts run a second time, prompt i with adapter i mod len, and the
    # table compares that run with the base model's in the same engine (the "ladder+lora" row).
    lora_modules: tuple[tuple[str, str], ...] = ()
    max_loras: int = 4
    max_lora_rank: int = 16
    lora_rounds: int = 3  # base and LoRA runs alternated this many times; the medians are compared

    def __post_init__(self) -> None:
        if self.num_prompts < 1 or self.input_len < 1 or self.output_len < 1:
            raise ValueError("num_prompts, input_len and output_len must be at least 1")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"range_ratio must be in [0, 1), got {self.range_ratio}")


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(config: BenchConfig, vocab_size: int, special_ids: frozenset[int]) -> Workload:
    rng = random.Random(config.seed)

    def length(base: int) -> int:
        spread = int(base * config.range_ratio)
        return max(1, rng.randint(base - spread, base + spread))

    ordinary = [t for t in range(vocab_size) if t not in special_ids]
    prompts = [[rng.choice(ordinary) for _ in range(length(config.input_len))] for _ in range(config.num_prompts)]
    return Workload(prompts, [length(config.output_len) for _ in range(config.num_prompts)])


def run_engine(engine: LLMEngine, work: Workload, loras: list[str] | None = None, tag: str = "bench") -> float:
    """Seconds to finish every request (request i with adapter loras[i % len(loras)] when given)."""
    start = time.perf_counter()
    for i, (prompt, out_len) in enumerate(zip(work.prompts, work.output_lens)):
        params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
        engine.add_request(f"{tag}-{i}", prompt, params, lora=loras[i % len(loras)] if loras else None)
    produced = 0
    while engine.has_unfinished():
        produced += sum(len(d.token_ids) for d in engine.step())
    elapsed = time.perf_counter() - start
    if produced != work.num_output_tokens:
        raise RuntimeError(f"engine produced {produced} tokens, expected {work.num_output_tokens}")
    return elapsed


def run_hf(path: Path, dtype: torch.dtype, work: Workload, batch_size: int, pad_id: int,
           device: torch.device | str = "cpu") -> tuple[float, float]:
    """(load seconds, generate seconds) for transformers on the same checkpoint."""
    import transformers

    start = time.perf_counter()
    kwargs = {"gguf_file": path.name} if path.is_file() else {}
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent if path.is_file() else path,
                                                           dtype=dtype, **kwargs).eval().to(device)
    loaded = time.perf_counter()
    for first in range(0, len(work.prompts), batch_size):
        prompts = work.prompts[first:first + batch_size]
        new_tokens = max(work.output_lens[first:first + batch_size])
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            out = hf.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens,
                              do_sample=False, pad_token_id=pad_id)
        if out.shape[1] != width + new_tokens:
            raise RuntimeError("transformers stopped early")
    return loaded - start, time.perf_counter() - loaded


def run_bench(config: BenchConfig) -> dict:
    engine_config = EngineConfig(model=config.model, artifact=config.artifact, dtype=config.dtype, device=config.device,
                                 quantization=config.quantization,
                                 max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                                 max_prefill_tokens=config.max_prefill_tokens,
                                 kv_cache_memory_gib=config.kv_cache_memory_gib, kv_cache_dtype=config.kv_cache_dtype,
                                 tensor_parallel_size=config.tensor_parallel_size,
                                 tensor_parallel_attention=config.tensor_parallel_attention,
                                 lora_modules=config.lora_modules, max_loras=config.max_loras,
                                 max_lora_rank=config.max_lora_rank,
                                 max_model_len=int((config.input_len + config.output_len)
                                                   * (1 + config.range_ratio)) + 1)
    start = time.perf_counter()
    engine = LLMEngine(engine_config)
    load_seconds = time.perf_counter() - start
    tokenizer = engine.tokenizer
    special = tokenizer.special_ids if tokenizer else frozenset()
    work = make_workload(config, engine.model.config.vocab_size, special)
    # Warm up allocator and kernels on a small batch so neither side pays first-call costs in the figures.
    warm_up = Workload(work.prompts[:2], [4] * len(work.prompts[:2]))
    try:
        run_engine(engine, warm_up)
        warm = engine.stats.snapshot()
        engine_seconds = run_engine(engine, work)
        lora_names = [name for name, _ in config.lora_modules]
        if lora_names:  # warmed too: the first steps with adapters load them into their slots
            run_engine(engine, warm_up, lora_names, tag="warm-lora")
            # Alternated, so a noisy neighbour costs both sides alike; medians of each side compared.
            base_rounds, lora_rounds = [engine_seconds], []
            for r in range(config.lora_rounds):
                lora_rounds.append(run_engine(engine, work, lora_names, tag=f"lora{r}"))
                if r + 1 < config.lora_rounds:
                    base_rounds.append(run_engine(engine, work, tag=f"base{r}"))
            engine_seconds, lora_seconds = statistics.median(base_rounds), statistics.median(lora_rounds)
    finally:
        engine.close()
    stats = engine.stats
    # The measured run only: the warm-up's steps (first calls, the workers' too) are left out.
    communication = {op: s - warm["communication"].get(op, 0.0) for op, s in stats.communication.items()}
    step_seconds = {phase: s - warm["seconds"].get(phase, 0.0) for phase, s in stats.seconds.items()}
    rows = {"ladder": summarize(work, engine_seconds, load_seconds)}  # with adapters: the base rounds' median
    if config.lora_modules:
        rows["ladder+lora"] = summarize(work, lora_seconds, load_seconds)
        rows["ladder+lora"]["vs_base"] = engine_seconds / lora_seconds
        rows["ladder+lora"]["rounds_seconds"] = {"base": base_rounds, "lora": lora_rounds}
    manifest = engine.model.manifest if isinstance(engine.model, LoadedArtifact) else None
    if not config.skip_hf:
        pad = tokenizer.eos_token_id if tokenizer and tokenizer.eos_token_id is not None else 0
        if manifest is not None:  # the artifact's source weights, at the fp32 the artifact is checked against
            hf_path, hf_dtype = Path(manifest.model["source"]), torch.float32
        else:
            hf_path, hf_dtype = engine.model.path, engine.model.module.activation_dtype
        if config.hf_dtype is not None:  # (transformers runs the base model; no adapters)
            hf_dtype = parse_dtype(config.hf_dtype)
        hf_load, hf_seconds = run_hf(hf_path, hf_dtype, work, config.hf_batch_size, pad, engine.model.module.device)
        rows["transformers"] = summarize(work, hf_seconds, hf_load)
        rows["transformers"]["dtype"] = str(hf_dtype).removeprefix("torch.")
        rows["ladder"]["speedup"] = rows["transformers"]["seconds"] / engine_seconds
    return {
        "config": asdict(config),
        "model": engine.model.name,
        "artifact": None if manifest is None else {
            "path": str(engine.model.path), "backend": manifest.backend, "precision": manifest.precision,
            "parity": manifest.parity},
        "num_prompt_tokens": work.num_prompt_tokens,
        "num_output_tokens": work.num_output_tokens,
        "results": rows,
        "engine_step_seconds": step_seconds,
        "engine_steps": stats.num_steps - warm["num_steps"],
        "tensor_parallel_size": config.tensor_parallel_size,
        "tensor_parallel_attention": engine_config.tensor_parallel_attention,  # resolved (auto)
        # Rank 0's seconds in each collective (inside the forward phase); empty for one process.
        "communication_seconds": communication,
        "environment": {"torch": torch.__version__, "python": platform.python_version(),
                        "machine": platform.machine(), "threads": torch.get_num_threads()},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def summarize(work: Workload, seconds: float, load_seconds: float) -> dict:
    return {
        "seconds": seconds,
        "load_seconds": load_seconds,
        "requests_per_s": len(work.prompts) / seconds,
        "output_tokens_per_s": work.num_output_tokens / seconds,
        "total_tokens_per_s": (work.num_output_tokens + work.num_prompt_tokens) / seconds,
    }


def format_table(report: dict) -> str:
    header = f"{'backend':<14}{'seconds':>10}{'req/s':>10}{'out tok/s':>12}{'total tok/s':>13}{'vs transformers':>17}"
    lines = [header, "-" * len(header)]
    for name, row in report["results"].items():
        ratio = row.get("speedup", 1.0 if name == "transformers" else None)
        shown = "-" if ratio is None else f"{ratio:.2f}x"  # --skip-hf: nothing to compare with
        lines.append(f"{name:<14}{row['seconds']:>10.2f}{row['requests_per_s']:>10.2f}"
                     f"{row['output_tokens_per_s']:>12.1f}{row['total_tokens_per_s']:>13.1f}{shown:>17}")
    if "transformers" in report["results"]:
        lines.append(f"transformers ran in {report['results']['transformers']['dtype']}")
    if "ladder+lora" in report["results"]:
        lora = report["config"]["lora_modules"]
        row = report["results"]["ladder+lora"]
        rounds = ", ".join(f"{b / l:.2f}" for b, l in zip(row["rounds_seconds"]["base"], row["rounds_seconds"]["lora"]))
        lines.append(f"ladder+lora: the same prompts spread over {len(lora)} LoRA adapters, {row['vs_base']:.2f}x "
                     f"the base model's output tok/s (medians of {len(row['rounds_seconds']['lora'])} alternated "
                     f"rounds, same engine; per round {rounds})")
    steps = report["engine_step_seconds"]
    total = sum(steps.values()) or 1.0
    split = ", ".join(f"{k} {v / total:.1%}" for k, v in sorted(steps.items(), key=lambda kv: -kv[1]))
    lines.append(f"engine time by phase over {report['engine_steps']} steps: {split}")
    if report.get("communication_seconds"):
        comm = report["communication_seconds"]
        parts = ", ".join(f"{op} {s / total:.1%}" for op, s in sorted(comm.items(), key=lambda kv: -kv[1]))
        split_by = report.get("tensor_parallel_attention", "heads")
        lines.append(f"tensor parallel ({report['tensor_parallel_size']} ranks, attention split by {split_by}): "
                     f"communication "
                     f"{sum(comm.values()) / total:.1%} of step time ({parts}), "
                     f"{sum(comm.values()) / max(report['engine_steps'], 1) * 1e3:.2f} ms per step")
    return "\n".join(lines)


def write_report(report: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
