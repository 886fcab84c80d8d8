"""LoRA adapters: a PEFT adapter directory or a llama.cpp GGUF adapter, read into plain tensors.

An adapter adds a low-rank product to some of the decoder's projections: for a target linear W [out, in],
    y = W x + scaling * B (A x),    A [r, in], B [out, r],
with scaling = alpha / r (alpha / sqrt(r) for rsLoRA), per module when the adapter's `rank_pattern` or
`alpha_pattern` say so. Here each target is read as (A, scaling * B) under Hugging Face's module names
(`q_proj` ... `down_proj`) per layer, checked against the base model's shapes. model/lora_slots.py puts
adapters into the slots the batched kernel reads; nothing here touches the decoder.

What is refused, each with a one-line `ModelLoadError` naming the file: a file that is not safetensors
or GGUF, a target outside the seven projections (embeddings, the LM head, `modules_to_save`), DoRA, LoRA
biases, a rank that contradicts the config, a shape that does not fit the base model, an A without its B.
Weights never come from pickle: an adapter with only `adapter_model.bin` is refused.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from model.config import ModelConfig
from model.errors import ModelLoadError, one_line

# The projections an adapter may target, by Hugging Face name, with their GGUF names.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GGUF_TARGETS = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
                "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
PEFT_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight")
GGUF_KEY = re.compile(r"blk\.(\d+)\.(\w+)\.weight\.lora_([ab])")
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclass(frozen=True)
class LoRAWeight:
    a: torch.Tensor  # [r, in] float32
    b: torch.Tensor  # [out, r] float32, the adapter's scaling folded in


@dataclass(frozen=True)
class LoRAAdapter:
    name: str
    path: Path
    rank: int  # the largest rank of its targets
    weights: dict[tuple[int, str], LoRAWeight]  # (layer, target) -> its low-rank pair


def target_shape(config: ModelConfig, target: str) -> tuple[int, int]:
    """(out, in) of a target projection of the base model."""
    h = config.hidden_size
    return {"q_proj": (config.q_size, h), "k_proj": (config.kv_size, h), "v_proj": (config.kv_size, h),
            "o_proj": (h, config.q_size), "gate_proj": (config.intermediate_size, h),
            "up_proj": (config.intermediate_size, h), "down_proj": (h, config.intermediate_size)}[target]


def adapter_name(path: str | Path) -> str:
    """The name an adapter is served under when none is given: its directory's name, or its file's stem."""
    path = Path(path).expanduser()
    return path.stem if path.suffix.lower() == ".gguf" else path.name


def load_adapter(path: str | Path, config: ModelConfig, name: str | None = None) -> LoRAAdapter:
    """Read a PEFT adapter directory (adapter_config.json + adapter_model.safetensors) or a GGUF LoRA
    adapter for a base model of `config`; ModelLoadError (one line, naming the file) for anything else."""
    path = Path(path).expanduser()
    name = name or adapter_name(path)
    try:
        config.require_alike_layers("LoRA")
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    if path.is_dir():
        weights = _read_peft(path, config)
    elif path.is_file() and path.suffix.lower() == ".gguf":
        weights = _read_gguf(path, config)
    elif path.exists():
        raise ModelLoadError(f"{path}: not a LoRA adapter (expected a PEFT directory or a .gguf file)")
    else:
        raise ModelLoadError(f"{path}: no such file or directory")
    if not weights:
        raise ModelLoadError(f"{path}: the adapter has no LoRA weights")
    rank = max(w.a.shape[0] for w in weights.values())
    return LoRAAdapter(name, path, rank, weights)


def _read_peft(directory: Path, config: ModelConfig) -> dict[tuple[int, str], LoRAWeight]:
    config_file, weights_file = directory / ADAPTER_CONFIG, directory / ADAPTER_WEIGHTS
    if not config_file.is_file():
        raise ModelLoadError(f"{directory}: no {ADAPTER_CONFIG} (not a PEFT adapter directory)")
    if not weights_file.is_file():
        pickled = " (adapter_model.bin is pickle, which ladder does not load)" if (
            directory / "adapter_model.bin").is_file() else ""
        raise ModelLoadError(f"{directory}: no {ADAPTER_WEIGHTS}{pickled}")
    try:
        settings = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{config_file}: not valid JSON ({one_line(e)})") from None
    if not isinstance(settings, dict):
        raise ModelLoadError(f"{config_file}: not a JSON object")
    _check_peft_settings(config_file, settings)
    tensors = _read_safetensors(weights_file)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = PEFT_KEY.fullmatch(key)
        if match is None or match.group(2) not in TARGETS:
            raise ModelLoadError(f"{weights_file}: tensor {key!r} is not a LoRA A or B of a projection "
                                 f"ladder adapts ({', '.join(TARGETS)})")
        layer, target, side = int(match.group(1)), match.group(2), match.group(3).lower()
        pairs.setdefault((layer, target), {})[side] = tensor
    declared = settings.get("target_modules")
    if isinstance(declared, list):
        unknown = sorted(set(declared) - set(TARGETS))
        if unknown:
            raise ModelLoadError(f"{config_file}: target_modules {unknown} are not projections ladder adapts "
                                 f"({', '.join(TARGETS)})")
        found = {target for _, target in pairs}
        missing = sorted(set(declared) - found, key=TARGETS.index)
        if missing:
            raise ModelLoadError(f"{weights_file}: target_modules names {missing} but the file has no weights "
                                 "for them")
    weights = {}
    for (layer, target), pair in sorted(pairs.items()):
        block = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        module = f"model.layers.{layer}.{block}.{target}"  # the name PEFT's patterns are matched against
        rank = _pattern_value(settings.get("rank_pattern"), module, settings.get("r"))
        alpha = _pattern_value(settings.get("alpha_pattern"), module, settings.get("lora_alpha", rank))
        weights[(layer, target)] = _pair(weights_file, config, layer, target, pair, rank, alpha,
                                         bool(settings.get("use_rslora")))
    return weights


def _check_peft_settings(config_file: Path, settings: dict) -> None:
    peft_type = settings.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise ModelLoadError(f"{config_file}: peft_type {peft_type!r} is not LORA")
    refused = {"use_dora": "DoRA", "modules_to_save": "modules_to_save (full copies of modules)",
               "fan_in_fan_out": "fan_in_fan_out (Conv1D layers)", "layer_replication": "layer_replication"}
    for key, what in refused.items():
        if settings.get(key):
            raise ModelLoadError(f"{config_file}: {what} is not supported by ladder's LoRA")
    if settings.get("bias", "none") != "none":
        raise ModelLoadError(f"{config_file}: bias {settings['bias']!r} is not supported (only 'none')")
    rank = settings.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ModelLoadError(f"{config_file}: r must be a positive integer, got {rank!r}")
    alpha = settings.get("lora_alpha", rank)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise ModelLoadError(f"{config_file}: lora_alpha must be a finite number, got {alpha!r}")


def _pattern_value(patterns: object, module: str, default):
    """PEFT's per-module override: the value of the first key that matches the end of the module's name."""
    if isinstance(patterns, dict):
        for key, value in patterns.items():
            if re.fullmatch(rf"(.*\.)?({key})", module):
                return value
    return default


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {key: f.get_tensor(key) for key in f.keys()}
    except Exception as e:  # the safetensors error types differ between versions
        raise ModelLoadError(f"{path}: not a readable safetensors file ({one_line(e)})") from None


def _read_gguf(path: Path, config: ModelConfig) -> dict[tuple[int, str], LoRAWeight]:
    import gguf

    from model.gguf_checkpoint import unpermute_rotary
    from model.gguf_file import GGUFFile

    try:
        reader = GGUFFile(path)
    except (OSError, ValueError, struct.error) as e:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({one_line(e)})") from None
    field = reader.metadata.get

    if field("general.type") != "adapter" or field("adapter.type") != "lora":
        raise ModelLoadError(f"{path}: not a GGUF LoRA adapter (general.type {field('general.type')!r}, "
                             f"adapter.type {field('adapter.type')!r})")
    alpha = field("adapter.lora.alpha")
    arch = field("general.architecture")
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for tensor in reader.tensors:
        match = GGUF_KEY.fullmatch(tensor.name)
        if match is None or match.group(2) not in GGUF_TARGETS:
            raise ModelLoadError(f"{path}: tensor {tensor.name!r} is not a LoRA A or B of a projection ladder "
                                 f"adapts ({', '.join(GGUF_TARGETS)})")
        try:
            array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError:
            raise ModelLoadError(f"{path}: tensor {tensor.name!r} has unsupported type "
                                 f"{tensor.tensor_type.name}") from None
        layer, target = int(match.group(1)), GGUF_TARGETS[match.group(2)]
        pairs.setdefault((layer, target), {})[match.group(3)] = torch.tensor(array, dtype=torch.float32)
    weights = {}
    for (layer, target), pair in sorted(pairs.items()):
        if arch == "llama" and target in ("q_proj", "k_proj") and "b" in pair:
            # llama.cpp permutes the rows of q and k (and so of their B) for its rotary layout.
            heads = config.num_heads if target == "q_proj" else config.num_kv_heads
            pair["b"] = unpermute_rotary(pair["b"], heads)
        rank = pair["a"].shape[0] if "a" in pair and pair["a"].dim() == 2 else None
        weights[(layer, target)] = _pair(path, config, layer, target, pair, rank,
                                         alpha if alpha is not None else rank, rslora=False)
    return weights


def _pair(source: Path, config: ModelConfig, layer: int, target: str, pair: dict[str, torch.Tensor],
          rank: object, alpha: object, rslora: bool) -> LoRAWeight:
    """Check one target's A and B against the base model and the declared rank; fold in the scaling."""
    module = f"layers.{layer}.{target}"
    if "a" not in pair or "b" not in pair:
        raise ModelLoadError(f"{source}: {module} has a LoRA {'B' if 'a' not in pair else 'A'} without its "
                             f"{'A' if 'a' not in pair else 'B'}")
    if not 0 <= layer < config.num_layers:
        raise ModelLoadError(f"{source}: {module}: the base model has {config.num_layers} layers")
    a, b = pair["a"], pair["b"]
    out_features, in_features = target_shape(config, target)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ModelLoadError(f"{source}: {module}: rank {rank!r} is not a positive integer")
    if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
        raise ModelLoadError(f"{source}: {module}: A {list(a.shape)} and B {list(b.shape)} do not fit rank "
                             f"{rank} over the base model's [{out_features}, {in_features}] weight")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise ModelLoadError(f"{source}: {module}: lora_alpha {alpha!r} is not a finite number")
    a, b = a.float(), b.float()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        raise ModelLoadError(f"{source}: {module}: the weights hold NaN or infinity")
    scaling = alpha / math.sqrt(rank) if rslora else alpha / rank
    return LoRAWeight(a.contiguous(), (b * scaling).contiguous())
