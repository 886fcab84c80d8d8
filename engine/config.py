"""Engine configuration and KV-cache sizing."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.kv_layout import blocks_for_tokens, kv_cache_shape
from model.config import ModelConfig
from model.hub import fetch, is_repo_id
from model.pooling import POOLING_KINDS
from model.precision import parse_dtype, parse_kv_cache_dtype, resolve_dtype
from model.quantization import resolve_quantization
from parallel.layout import ATTENTION_SPLITS

GIB = 1 << 30
# On a CPU the cache shares memory with everything else; a bounded default keeps start-up quick.
CPU_DEFAULT_KV_GIB = 2


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # HF directory, GGUF file, hub name (org/name, org/name:file.gguf), or None: the default
    artifact: str | None = None  # a `ladder compile` artifact directory, served instead of `model`
    dtype: str = "auto"  # float32, bfloat16, float16 (fp32, ...), or auto (resolve_dtype); resolved in __post_init__
    device: str = "cpu"  # cpu, cuda, cuda:N, or auto (CUDA when present); resolved in __post_init__
    quantization: str = "none"  # none, int8, w8a8, w4a8, or auto (model/quantization.py); resolved in __post_init__
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # Prompt tokens per step while requests decode (engine/scheduler.py); None, or at least
    # max_num_batched_tokens: no bound. No bound by default: in the measured sweep (benchmarks/RESULTS.md,
    # "Closing runs on a quiet machine") a bound raised TTFT p99 and TPOT and cut throughput at 32 users.
    max_prefill_tokens: int | None = None
    max_model_len: int | None = None  # default: the model's context, capped by the KV cache
    block_size: int = 16
    # The KV cache's element type: auto (the activations': float32 on a CPU, quantized or not), float32,
    # bfloat16 or float16 (a 16-bit cache halves its memory and what decode attention reads; keys and values
    # are rounded once, as they are written).
    kv_cache_dtype: str = "auto"
    vision_dtype: str = "auto"  # a vision model's tower (model/precision.py resolve_vision_dtype)
    mmproj: str | None = None  # llama.cpp's projector file for a GGUF text model (model/mmproj.py)
    image_cache_mib: int = 256  # the vision tower's outputs kept by image (engine/image_cache.py); 0: none
    pan_and_scan: bool | None = None  # Gemma 3's crops of wide images on or off; None: the checkpoint's setting
    # Vision-tower tiles a server runs between two engine steps (0: a prompt's images whole). One SmolVLM tile
    # (SigLIP over 512 x 512 pixels) is about 0.26 s of 2 vCPUs in bfloat16: a request running meanwhile waits
    # that long per piece, not for the whole image (1.3 s for 5 tiles, 4.4 s for 17).
    vision_tiles_per_step: int = 1
    kv_cache_memory_gib: float | None = None  # default: the device's rule below (plan_kv_cache)
    kv_cache_memory_fraction: float = 0.25  # a CPU: this fraction of available memory, at most CPU_DEFAULT_KV_GIB
    # CUDA: the fraction of the device's memory this engine may fill, vLLM's --gpu-memory-utilization; the
    # cache gets what is left of it once the model is loaded.
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    seed: int = 0
    # Ranks the model is split over (parallel/): this process and N-1 workers it starts. The KV cache
    # budget is the whole group's: each rank holds its KV heads of every block (split by heads) or its
    # pool of the blocks with every head (split by sequences).
    tensor_parallel_size: int = 1
    # How the ranks split attention: by KV heads, or by sequences (each rank its own sequences' attention
    # with every head, and a pool of the KV blocks; parallel/sequence_split.py); auto: by sequences on a
    # CPU (ahead at batch 32 and on a prefill-heavy batch in benchmarks/RESULTS.md, "Stop 16"), by heads
    # on CUDA (where the sequence split has not run yet).
    tensor_parallel_attention: str = "heads"
    # LoRA adapters served beside the base model (model/lora.py), each request choosing one by name:
    # (name, PEFT directory or GGUF adapter) pairs read at start; enable_lora makes the slots without any,
    # for adapters loaded at run time. max_loras adapters are resident at once, of rank up to max_lora_rank.
    lora_modules: tuple[tuple[str, str], ...] = ()
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    # Speculative decoding (engine/speculative.py): draft tokens per step for requests that do not ask for
    # a number themselves (0: none unless asked; None: 4 with a draft model, else 0), the decoding sequences
    # above which no request speculates (a step of many sequences is bound by arithmetic, not by weights),
    # and a draft model of the same vocabulary (engine/draft_model.py; None: drafts by prompt lookup).
    speculative_tokens: int | None = None
    speculative_max_batch: int = 4
    speculative_model: str | None = None
    # The chat template to use instead of the model's (a file, or the Jinja text), and where a request's
    # sampling fields default from when it leaves them out: "auto", the model's generation_config.json
    # (temperature, top_p, top_k, min_p, repetition_penalty), or "none", ladder's own defaults.
    chat_template: str | None = None
    generation_config: str = "auto"
    # A model by name (model/hub.py): the hub revision (branch, tag or commit; None: main) and the cache
    # directory (None: huggingface_hub's, $HF_HUB_CACHE or $HF_HOME/hub). HF_HUB_OFFLINE: the cache only.
    revision: str | None = None
    download_dir: str | None = None
    # How /v1/embeddings pools a text's final hidden states (model/pooling.py): last, mean or cls; "auto" the
    # rule the checkpoint declares (sentence-transformers, GGUF pooling_type), else last. With
    # embedding_normalize None, a declared rule's normalization (else L2-normalized).
    pooling: str = "auto"
    embedding_normalize: bool | None = None

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_modules)

    def __post_init__(self) -> None:
        object.__setattr__(self, "device", resolve_device(self.device, self.artifact))
        object.__setattr__(self, "dtype", resolve_dtype(self.dtype, self.device))
        if self.artifact is not None and self.quantization not in ("none", "auto"):
            raise ValueError(f"quantization {self.quantization} applies to a model, not to an artifact "
                             "(an artifact has the precision it was compiled in)")
        quantization = "none" if self.artifact is not None else self.quantization
        # auto looks at a GGUF file's blocks: one named on the hub is fetched (into the cache load reads).
        local = self.model
        if quantization == "auto" and self.model is not None and self.model.endswith(".gguf") \
                and is_repo_id(self.model):
            local = str(fetch(self.model, self.revision, self.download_dir))
        object.__setattr__(self, "quantization", resolve_quantization(quantization, self.dtype, self.device,
                                                                     local, self.tensor_parallel_size))
        parse_kv_cache_dtype(self.kv_cache_dtype)  # ValueError for an unknown name
        if self.vision_tiles_per_step < 0:
            raise ValueError(f"vision_tiles_per_step must be at least 0, got {self.vision_tiles_per_step}")
        if self.image_cache_mib < 0:
            raise ValueError(f"image_cache_mib must be at least 0, got {self.image_cache_mib}")
        if self.vision_dtype != "auto":
            parse_dtype(self.vision_dtype)
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}")
        if self.kv_cache_memory_gib is not None and self.kv_cache_memory_gib <= 0:
            raise ValueError(f"kv_cache_memory_gib must be positive, got {self.kv_cache_memory_gib}")
        if not 0 < self.kv_cache_memory_fraction <= 1:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.artifact is not None and self.model is not None:
            raise ValueError("give a model or an artifact, not both")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {self.max_model_len}")
        if self.max_prefill_tokens is not None and self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be at least 1, got {self.max_prefill_tokens}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_attention not in (*ATTENTION_SPLITS, "auto"):
            raise ValueError(f"tensor_parallel_attention is heads, sequences or auto, "
                             f"not {self.tensor_parallel_attention!r}")
        if self.tensor_parallel_attention == "auto":
            split = "sequences" if torch.device(self.device).type == "cpu" else "heads"
            object.__setattr__(self, "tensor_parallel_attention", split)
        if self.tensor_parallel_size > 1 and self.artifact is not None:
            raise ValueError("tensor parallelism applies to a model, not to a compiled artifact")
        self._check_lora()
        if self.pooling != "auto" and self.pooling not in POOLING_KINDS:
            raise ValueError(f"pooling is auto, {', '.join(POOLING_KINDS)}, not {self.pooling!r}")
        if self.generation_config not in ("auto", "none"):
            raise ValueError(f"generation_config is auto or none, not {self.generation_config!r}")
        if self.speculative_tokens is None:
            object.__setattr__(self, "speculative_tokens", 4 if self.speculative_model is not None else 0)
        if self.speculative_model is not None and (self.artifact is not None or self.tensor_parallel_size > 1):
            raise ValueError("a draft model runs beside a model in one process, not with an artifact or "
                             "tensor parallelism (prompt lookup, without --speculative-model, runs with both)")

    def _check_lora(self) -> None:
        modules = self.lora_modules
        pairs = tuple(modules.items()) if isinstance(modules, dict) else tuple(tuple(pair) for pair in modules)
        object.__setattr__(self, "lora_modules", pairs)
        names = [name for name, _ in pairs]
        if any(not name or not isinstance(name, str) for name in names):
            raise ValueError("every LoRA module needs a name (name=path)")
        if len(set(names)) != len(names):
            raise ValueError(f"LoRA module names must be unique, got {names}")
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be at least 1, got {self.max_loras} and "
                             f"{self.max_lora_rank}")
        if self.lora_enabled and self.artifact is not None:
            raise ValueError("LoRA adapters apply to a model, not to a compiled artifact")
        if self.lora_enabled and self.tensor_parallel_size > 1:
            raise ValueError("LoRA adapters run in one process (--tensor-parallel-size 1)")


def fit_to_artifact(config: EngineConfig, shapes: dict[str, int]) -> EngineConfig:
    """The engine config within the shapes an artifact was compiled for: its block size, its
    max_model_len unless a shorter one is asked, and at most its max_num_seqs."""
    limit = shapes["max_model_len"]
    if config.max_model_len is not None and config.max_model_len > limit:
        raise ValueError(f"max_model_len {config.max_model_len} exceeds the {limit} tokens the artifact "
                         "was compiled for (recompile with a larger --max-model-len)")
    max_tokens = min(config.max_num_batched_tokens, shapes.get("max_num_batched_tokens", config.max_num_batched_tokens))
    return dataclasses.replace(config, block_size=shapes["block_size"], max_model_len=config.max_model_len or limit,
                               max_num_seqs=min(config.max_num_seqs, shapes["max_num_seqs"]),
                               max_num_batched_tokens=max_tokens)


def resolve_device(name: str, artifact: str | None = None) -> str:
    """cpu, cuda or cuda:N as asked; for "auto" the device an artifact was built for, else CUDA when a
    device is present. ValueError (one line) for a device this machine lacks."""
    name = name.strip().lower()
    if name == "auto" and artifact is not None:
        from engine.backends.manifest import read_manifest

        name = read_manifest(Path(artifact).expanduser(), verify_files=False).device.get("type", "cpu")
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"unknown device {name!r} (choose cpu, cuda or auto)") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {name!r} (choose cpu, cuda or auto)")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: no CUDA device is available here (torch {torch.__version__}, "
                             f"built for CUDA {torch.version.cuda or 'none'})")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return name


def gpu_kv_budget(device: torch.device, utilization: float) -> int:
    """Bytes for the KV cache on a CUDA device: `utilization` of its memory less what is in use now (the
    loaded model, and any other process on the device), as vLLM's --gpu-memory-utilization; the rest of
    the device is headroom for activations. ValueError (one line) when nothing is left."""
    torch.cuda.empty_cache()  # blocks the allocator caches from loading are free for the cache
    free, total = torch.cuda.mem_get_info(device)
    in_use = total - free
    budget = int(total * utilization) - in_use
    if budget <= 0:
        raise ValueError(f"--gpu-memory-utilization {utilization:g} leaves no room for the KV cache: "
                         f"{in_use / GIB:.2f} GiB of the device's {total / GIB:.2f} GiB is in use (the model and "
                         f"any other process), more than its {utilization:g} share of {total * utilization / GIB:.2f}"
                         " GiB; raise --gpu-memory-utilization or give --kv-cache-memory")
    return budget


def available_memory() -> int:
    """MemAvailable of the host: the bytes a KV cache on the CPU may take from."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 * GIB


def bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype, windowed: bool | None = None) -> int:
    """One block's bytes across every layer's cache (a layer that reads an earlier layer's cache has none of
    its own); `windowed` True or False: across the sliding-window layers' caches only, or the others' only."""
    total = 0
    for i in range(model.num_layers):
        if model.is_linear_layer(i):  # a state per sequence instead (`state_bytes`)
            continue
        if model.kv_source(i) == i and windowed in (None, model.layer_window(i) is not None):
            total += math.prod(kv_cache_shape(1, block_size, model.layer_kv_heads(i), model.layer_head_dim(i)))
    return total * dtype.itemsize


def state_bytes(model: ModelConfig, num_slots: int) -> int:
    """The linear-attention layers' state pools (float32; model/linear_attention.py) for `num_slots` sequences."""
    return len(model.linear_layers) * model.linear_state_size * 4 * num_slots


@dataclass(frozen=True)
class StateRows:
    """The rows of the linear-attention layers' state pools (model/linear_attention.py): one per sequence that may
    run at once, then the prefix cache's snapshots (engine/state_cache.py)."""

    running: int = 0
    snapshots: int = 0

    @property
    def total(self) -> int:
        return self.running + self.snapshots


def plan_state_rows(config: EngineConfig, model: ModelConfig, budget: int) -> StateRows:
    """How many sequences' states a model with linear-attention layers keeps, out of the cache `budget` (bytes):
    up to `max_num_seqs` running ones in half of it (a state is large beside a token's keys and values: 19 MB for
    Qwen3.5-0.8B), and with prefix caching as many snapshots as fit a quarter, up to the running ones. The rest is
    the attention layers' KV blocks. ValueError when not one sequence's state fits."""
    if not model.linear_layers:
        return StateRows()
    row = state_bytes(model, 1)
    running = min(config.max_num_seqs, budget // 2 // row)
    if running < 1:
        raise ValueError(f"one sequence's linear-attention states take {row / GIB:.3f} GiB, more than half the cache "
                         f"budget ({budget / GIB:.3f} GiB); give --kv-cache-memory {4 * row / GIB:.3f} or more")
    return StateRows(running, min(running, budget // 4 // row) if config.enable_prefix_caching else 0)


def plan_kv_cache(config: EngineConfig, model: ModelConfig, dtype: torch.dtype, device: torch.device,
                  num_pools: int = 1, states: StateRows = StateRows()) -> tuple[int, int]:
    """(num_blocks, max_model_len) for this model and memory, or a ValueError saying what would fit.

    `num_pools`: the blocks split into that many equal pools (one per rank, tensor parallelism by
    sequences), of which one sequence uses one: the longest sequence must fit a pool. `states`: the
    linear-attention states' rows (`plan_state_rows`), taken from the same budget first."""
    max_model_len = _max_model_len(config, model)
    per_block = bytes_per_block(model, config.block_size, dtype)
    budget, source = kv_budget(config, device)
    budget -= state_bytes(model, states.total)
    blocks_per_seq = blocks_for_tokens(max_model_len, config.block_size)
    # More than every sequence at full length could never be used.
    num_blocks = min(budget // per_block, blocks_per_seq * max(config.max_num_seqs, num_pools))
    num_blocks -= num_blocks % num_pools
    max_model_len = _fit(config, max_model_len, num_blocks // num_pools, num_pools, per_block, budget, source)
    return num_blocks, max_model_len


def plan_window_kv_cache(config: EngineConfig, model: ModelConfig, dtype: torch.dtype,
                         device: torch.device) -> tuple[int, int, int]:
    """(num_blocks, num_window_blocks, max_model_len) when the sliding-window layers keep only their window
    in a pool of their own (engine/window_blocks.py). That pool needs no more than every running sequence's
    window, a block boundary and a block for its drafts, plus one step's new tokens; the full-attention
    layers' blocks get the rest of the budget. ValueError as plan_kv_cache."""
    max_model_len = _max_model_len(config, model)
    full_bytes = bytes_per_block(model, config.block_size, dtype, windowed=False)
    window_bytes = bytes_per_block(model, config.block_size, dtype, windowed=True)
    budget, source = kv_budget(config, device)
    bs = config.block_size
    per_seq = blocks_for_tokens(model.sliding_window - 1, bs) + 3
    window_need = config.max_num_seqs * per_seq + blocks_for_tokens(config.max_num_batched_tokens, bs)
    blocks_per_seq = blocks_for_tokens(max_model_len, bs)
    if not full_bytes:  # every layer windowed: the full-attention blocks are bookkeeping (prefix hashes) only
        num_window_blocks = min(budget // window_bytes, window_need)
        # One sequence's window and a step's chunk must fit, or its allocation could never succeed.
        least = min(blocks_per_seq, per_seq + blocks_for_tokens(config.max_num_batched_tokens, bs))
        if num_window_blocks < least:
            raise ValueError(f"the KV cache ({source}: {budget / GIB:.3f} GiB) holds {num_window_blocks} blocks of "
                             f"{bs} tokens, fewer than one sequence's window and step need ({least}); give "
                             f"--kv-cache-memory {least * window_bytes / GIB:.3f} or more, or lower "
                             "--max-num-batched-tokens")
        return blocks_per_seq * config.max_num_seqs, num_window_blocks, max_model_len
    num_blocks = budget // (full_bytes + window_bytes)  # as many of each, when the budget is that small
    if num_blocks > window_need:
        num_blocks = (budget - window_need * window_bytes) // full_bytes
    num_blocks = min(num_blocks, blocks_per_seq * config.max_num_seqs)
    num_window_blocks = min(num_blocks, window_need)
    max_model_len = _fit(config, max_model_len, num_blocks, 1, full_bytes + window_bytes, budget, source)
    return num_blocks, num_window_blocks, max_model_len


def _max_model_len(config: EngineConfig, model: ModelConfig) -> int:
    max_model_len = config.max_model_len or model.max_position_embeddings
    if max_model_len > model.max_position_embeddings:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's context of "
                         f"{model.max_position_embeddings} tokens")
    return max_model_len


def kv_budget(config: EngineConfig, device: torch.device) -> tuple[int, str]:
    """The KV cache's bytes, and the rule that gave them."""
    if config.kv_cache_memory_gib is not None:
        return int(config.kv_cache_memory_gib * GIB), "--kv-cache-memory"
    if device.type == "cuda":
        return gpu_kv_budget(device, config.gpu_memory_utilization), \
            f"--gpu-memory-utilization {config.gpu_memory_utilization:g}"
    budget = int(available_memory() * config.kv_cache_memory_fraction)
    if budget > CPU_DEFAULT_KV_GIB * GIB:
        return CPU_DEFAULT_KV_GIB * GIB, f"the CPU default of {CPU_DEFAULT_KV_GIB} GiB"
    return budget, f"{config.kv_cache_memory_fraction:.0%} of available memory"


def _fit(config: EngineConfig, max_model_len: int, pool: int, num_pools: int, per_block: int, budget: int,
         source: str) -> int:
    """max_model_len as served: lowered to what a pool of `pool` blocks holds when none was asked for;
    ValueError when an asked-for length does not fit."""
    blocks_per_seq = blocks_for_tokens(max_model_len, config.block_size)
    if config.max_model_len is None and pool < blocks_per_seq:
        # No length was asked for: serve the longest sequence the cache (a pool of it) holds.
        max_model_len, blocks_per_seq = pool * config.block_size, pool
    if pool < 1 or pool < blocks_per_seq:
        need = blocks_per_seq * num_pools * per_block / GIB
        holds = f"{pool * config.block_size} tokens" + (" a rank" if num_pools > 1 else "")
        raise ValueError(
            f"the KV cache ({source}: {budget / GIB:.3f} GiB) holds {holds}, "
            f"fewer than max_model_len={max_model_len}; give --kv-cache-memory {need:.3f} or more, "
            f"or lower --max-model-len"
        )
    return max_model_len
