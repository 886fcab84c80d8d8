"""Reading a Hugging Face model directory: config.json, one or several safetensors files, and the sampling
defaults of generation_config.json."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from model.config import ModelConfig
from model.errors import ModelLoadError, one_line
from model.weights import LazyTensors

if TYPE_CHECKING:
    from model.gguf_blocks import BlockWeight

INDEX_FILE = "model.safetensors.index.json"

log = logging.getLogger(__name__)


def read_config(directory: Path) -> tuple[ModelConfig, dict]:
    path = directory / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{path}: missing (a Hugging Face model directory needs config.json)")
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: not valid JSON ({one_line(e)})") from None
    try:
        return ModelConfig.from_hf(raw), raw
    except (KeyError, ValueError, TypeError) as e:
        detail = f"missing field {e}" if isinstance(e, KeyError) else one_line(e)
        raise ModelLoadError(f"{path}: {detail}") from None


def safetensors_files(directory: Path) -> list[Path]:
    """The checkpoint's files: those named by the index when there is one, else every *.safetensors."""
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{index}: not a valid safetensors index ({one_line(e)})") from None
        files = [directory / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"{f}: missing (named by {INDEX_FILE})")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{directory}: no *.safetensors files (pickled .bin checkpoints are not loaded)")
    return files


# A multimodal checkpoint's language model sits under one of these (transformers 4 and 5 spellings); the
# rest of it (vision tower, projector) is not the decoder's.
LANGUAGE_MODEL_PREFIXES = ("language_model.model.", "model.language_model.", "language_model.", "model.text_model.")
OTHER_TOWERS = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.",
                "model.vision_model.", "model.connector.", "vision_model.", "connector.")


def decoder_name(key: str) -> str | None:
    """A checkpoint tensor's name as the decoder knows it (`layers.0.self_attn.q_proj.weight`, `lm_head.weight`),
    or None for a tensor of another tower."""
    if key.startswith(OTHER_TOWERS):
        return None
    for prefix in LANGUAGE_MODEL_PREFIXES:
        if key.startswith(prefix):
            return key.removeprefix(prefix)
    return key.removeprefix("model.")


def read_tensors(files: list[Path]) -> LazyTensors[torch.Tensor]:
    """Every tensor of the checkpoint under its name without the `model.` prefix, read from its file when it
    is asked for (shapes from the headers): loading holds the module being built and one tensor's sources,
    not the whole checkpoint beside it. ModelLoadError for a file whose header, or a tensor, is unreadable."""
    where: dict[str, tuple[Path, str]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        try:
            # safe_open validates the header against the file size, so a truncated file fails here
            # or when one of its tensors is read.
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    name = decoder_name(key)
                    if name is not None:
                        where[name] = (path, key)
                        shapes[name] = tuple(f.get_slice(key).get_shape())
        except Exception as e:  # the safetensors error types differ between versions
            raise ModelLoadError(f"{path}: not a readable safetensors file ({one_line(e)})") from None

    def read(name: str) -> torch.Tensor:
        path, key = where[name]
        try:
            with safe_open(str(path), framework="pt") as f:
                return f.get_tensor(key)
        except Exception as e:
            raise ModelLoadError(f"{path}: tensor {key!r} is unreadable ({one_line(e)})") from None

    return LazyTensors(shapes, read)


def has_mxfp4_experts(tensors: Mapping[str, torch.Tensor]) -> bool:
    """Whether a directory's tensors hold GPT-OSS's experts as the published MXFP4 blocks."""
    return any(name.endswith("mlp.experts.gate_up_proj_blocks") for name in tensors)


def read_w4a8_blocks(config: ModelConfig, tensors: LazyTensors[torch.Tensor], source: str) -> LazyTensors[BlockWeight]:
    """A directory with MXFP4 experts (GPT-OSS's published checkpoints) as `--quantization w4a8` reads a GGUF
    (model/gguf_checkpoint.py `read_blocks`: the same names and layouts): each sparse layer's experts as the
    table codes of their own blocks, gate and up as one stack ([E * 2I, H], each expert's gate rows then its up
    rows, from the interleaved ones: the file's stack read once); every
    other linear (q, k, v, o, the LM head, 16-bit in these files) requantized to 8 bits per 32-block, as a
    GGUF's float linears are. Made tensor by tensor when asked for."""
    from model.block_quantization import linear_sources
    from model.gguf_blocks import requantize_8bit
    from model.moe_checkpoint import deinterleave_gate_up, mxfp4_block_weight

    if not has_mxfp4_experts(tensors):
        raise ModelLoadError(f"{source}: quantization w4a8 runs a GGUF file's own blocks, or MXFP4 experts (GPT-OSS's "
                             "published checkpoints); this directory has neither (use w8a8, int8 or none)")
    shapes: dict[str, tuple[int, ...]] = {}
    makers = {}
    dense = {part for parts in linear_sources(config).values() for part in parts}
    for name in dense:
        source_name = "embed_tokens.weight" if name == "lm_head.weight" and config.tie_word_embeddings else name
        shapes[name] = tensors.shapes[source_name]
        makers[name] = lambda n=source_name: requantize_8bit(tensors[n].float())
    for i in range(config.num_layers):
        if not config.is_sparse_layer(i):
            continue
        p = f"layers.{i}.mlp.experts."

        def stack(kind: str, p: str = p) -> BlockWeight:  # [E, N, G, 16] and [E, N, G] -> [E * N, G * 32]
            blocks, scales = tensors[p + kind + "_blocks"], tensors[p + kind + "_scales"]
            if kind == "gate_up_proj":
                blocks, scales = deinterleave_gate_up(blocks), deinterleave_gate_up(scales)
            return mxfp4_block_weight(blocks.reshape(-1, *blocks.shape[2:]), scales.reshape(-1, scales.shape[2]))

        for kind in ("gate_up_proj", "down_proj"):
            e, rows, groups, _ = tensors.shapes[p + kind + "_blocks"]
            name = p + kind if kind == "gate_up_proj" else p + kind + ".weight"  # the names quantize_w4a8 reads
            shapes[name], makers[name] = (e * rows, groups * 32), lambda kind=kind, fn=stack: fn(kind)
    return LazyTensors(shapes, lambda name: makers[name]())


# The sampling fields of a generation_config.json that a request's own fields default to (vLLM's choice).
SAMPLING_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def read_sampling_defaults(directory: Path) -> dict[str, float | int]:
    """The sampling defaults of the directory's generation_config.json ({} without one). A field of the
    wrong type is left out with a warning: the model still serves, with ladder's own default for it."""
    path = directory / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: not valid JSON ({one_line(e)})") from None
    defaults: dict[str, float | int] = {}
    for name in SAMPLING_DEFAULT_FIELDS:
        value = raw.get(name) if isinstance(raw, dict) else None
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            log.warning("%s: %s is %r, not a number; ignored", path, name, value)
            continue
        defaults[name] = int(value) if name == "top_k" else float(value)
    return defaults
