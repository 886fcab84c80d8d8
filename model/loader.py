"""`model.load`: one entry point for every model source."""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from model.config import QWEN3_5_ARCHITECTURES, ModelConfig
from model.default import DEFAULT_MODEL_NAME, is_packaged, packaged_model_path
from model.errors import ModelLoadError
from model.hf_checkpoint import (
    read_config,
    read_sampling_defaults,
    read_tensors,
    read_w4a8_blocks,
    safetensors_files,
)
from model.hub import fetch, is_repo_id
from model.moe import check_quantization as check_moe_quantization
from model.pooling import Pooling, gguf_pooling, hf_dir_pooling
from model.precision import QUANTIZATIONS, parse_dtype, resolve_dtype, resolve_vision_dtype
from model.step import StepModel
from model.vision import VISION_MODEL_TYPES, read_vision
from model.weights import build_model, shift_norm_weights, split_fused_phi3, split_qwen3_5

if TYPE_CHECKING:
    from model.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    config: ModelConfig
    module: StepModel  # the eager LlamaForCausalLM, or an artifact's runtime (engine/backends/)
    tokenizer: Tokenizer | None  # None for a directory without tokenizer.json (weights-only tests)
    name: str  # the name to serve it under
    path: Path  # the file or directory it came from
    load_seconds: float
    quantization: str = "none"  # applied at load (model/precision.py QUANTIZATIONS)
    # A request's sampling fields default to these when it leaves them out (a Hugging Face directory's
    # generation_config.json: temperature, top_p, top_k, min_p, repetition_penalty); {} for none.
    sampling_defaults: dict = field(default_factory=dict)
    pooling: Pooling | None = None  # the embedding rule the checkpoint declares (model/pooling.py); None: none


def read_score_rows(module, checkpoint, tokenizer: Tokenizer, source: str) -> None:
    """A reranker GGUF's classification rows (llama.cpp's `cls.output.weight`: the LM head's rows of the
    tokens its labels spell, "yes" and "no") become the module's `score_rows`, by token id: the logits
    /v1/rerank reads come from them. Such a file has no LM head of its own: the embeddings stand in (the
    model's own head when it was tied, as Qwen3-Reranker-0.6B's is)."""
    rows = checkpoint.classifier_rows()
    if not rows:
        return
    ids = {label: tokenizer.token_to_id(label) for label in rows}
    missing = sorted(label for label, token in ids.items() if token is None)
    if missing:
        raise ModelLoadError(f"{source}: its classifier labels {missing} are not tokens of its vocabulary; only "
                             "rerankers whose head is LM-head rows (Qwen3-Reranker's yes and no) are read")
    dtype = module.activation_dtype
    module.score_rows = {ids[label]: row.to(module.device, dtype) for label, row in rows.items()}
    if "output.weight" not in checkpoint.tensor_names:
        log.warning("%s: a reranker file (classifier rows %s): /v1/rerank scores with them; its LM head, not in "
                    "the file, is taken to be the embeddings (so for a model whose head was not tied, its "
                    "generated text is not the model's)", source, ", ".join(rows))


def check_source(source: str | Path | None) -> None:
    """ModelLoadError (one line) unless `source` is the embedded default, a directory or a .gguf file:
    what `load` refuses before reading anything, for a caller whose loading happens elsewhere (the Ray
    replicas)."""
    if is_packaged(source) or is_repo_id(str(source)):
        return
    path = Path(source).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix.lower() == ".gguf"):
        return
    if path.exists():
        raise ModelLoadError(f"{path}: not a model (expected a Hugging Face directory or a .gguf file)")
    raise ModelLoadError(f"{path}: no such file or directory")


def load(
    source: str | Path | None = None,
    dtype: str | torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    block_size: int = 16,
    quantization: str = "none",
    revision: str | None = None,
    download_dir: str | Path | None = None,
    vision_dtype: str = "auto",
    mmproj: str | Path | None = None,
    pan_and_scan: bool | None = None,
) -> LoadedModel:
    """Load a Hugging Face directory, a GGUF file, or (source None) the embedded default model, in `dtype`
    (auto: model/precision.py `resolve_dtype`); `quantization` int8 or w8a8 swaps its linears for int8 ones
    once the float32 weights are in, w4a8 (GGUF files) for layers over the file's own blocks, which are
    then never dequantized. A source `org/name` (or `org/name:file.gguf`) that is not a local path comes
    from the Hugging Face hub cache (model/hub.py) at `revision`, kept in `download_dir`. A vision model's
    tower loads in `vision_dtype` (model/precision.py `resolve_vision_dtype`); a GGUF text model's comes from
    llama.cpp's projector file `mmproj` (model/mmproj.py). `pan_and_scan` turns Gemma 3's crops of wide images
    on or off (None: as the checkpoint's processor config says; model/image_processor.py)."""
    start = time.perf_counter()
    torch_dtype = parse_dtype(resolve_dtype(dtype, device))
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r} (choose from {', '.join(QUANTIZATIONS)})")
    if quantization != "none" and torch_dtype != torch.float32:
        raise ValueError(f"quantization {quantization} starts from float32 weights: drop dtype {dtype} "
                         "(or use quantization none)")
    if is_packaged(source):
        name = DEFAULT_MODEL_NAME if source is None else str(source)
        path = packaged_model_path(name)
    elif is_repo_id(str(source)):
        path, name = fetch(str(source), revision, download_dir), str(source)
    else:
        path = Path(source).expanduser()
        check_source(path)
        name = path.stem if path.is_file() else path.name
    if mmproj is not None and path.is_dir():
        raise ValueError(f"{path}: --mmproj goes with a GGUF text model; a Hugging Face directory holds its own "
                         "vision tower")
    # The readers' packages (tokenizers, gguf) are imported here, not with the module: the decoder and
    # the kernels are usable where they are not installed.
    from model.tokenizer import Tokenizer

    if path.is_dir():
        config, raw_config = read_config(path)
        check_moe_quantization(config, quantization, str(path))
        tensors = read_tensors(safetensors_files(path))  # each read when build_model asks for it
        if "score.weight" in tensors:
            # A sequence classifier's head (a reranker or reward model converted for vLLM): the decoder and
            # its LM head (tied to the embeddings, or refused as missing) are what ladder runs.
            log.warning("%s: its classification head (score.weight) is not read; the model runs with its LM "
                        "head, which scores /v1/rerank the same only for a reranker converted from it", path)
        if config.architecture == "gemma3":
            tensors = shift_norm_weights(tensors)
        if config.architecture == "phi3":
            tensors = split_fused_phi3(config, tensors)
        if config.architecture in QWEN3_5_ARCHITECTURES:
            tensors = split_qwen3_5(config, tensors)
        skip: set[str] = set()
        if quantization == "w4a8":  # MXFP4 experts (GPT-OSS's published files), read as a GGUF's blocks are
            from model.block_quantization import replaced_weights

            blocks = read_w4a8_blocks(config, tensors, str(path))
            skip = replaced_weights(config)
        module = build_model(config, tensors, str(path), str(path / "config.json"), torch_dtype, device, block_size,
                             skip)
        if quantization == "w4a8":
            from model.block_quantization import quantize_w4a8

            quantize_w4a8(module, blocks)
        tokenizer = Tokenizer.from_hf_dir(path) if (path / "tokenizer.json").is_file() else None
        weight_files = [path / "config.json", *safetensors_files(path)]
        pooling = hf_dir_pooling(path)
        if raw_config.get("model_type") in VISION_MODEL_TYPES and "vision_config" in raw_config:
            tower_dtype = resolve_vision_dtype(vision_dtype, torch_dtype, device)
            module.vision = read_vision(path, raw_config, safetensors_files(path), tower_dtype, device,
                                        pan_and_scan)
    else:  # a .gguf file (check_source)
        from model.block_embedding import BlockEmbedding
        from model.gguf_checkpoint import GGUFCheckpoint

        checkpoint = GGUFCheckpoint(path)
        config = checkpoint.config
        check_moe_quantization(config, quantization, str(path))
        skip: set[str] = set()
        if quantization == "w4a8":
            from model.block_quantization import replaced_weights

            blocks = checkpoint.read_blocks()  # a file without them fails here, before any dequantizing
            # The float weights of the layers W4A8 replaces are left unread.
            skip = replaced_weights(config)
        # Looked up from the file's blocks, never made float: Gemma 4's per-layer table, and under W4A8 the token
        # embedding (its float32 table was 0.7 GB for Gemma 3 270M, 5.6 GB for a 31B: a quarter of that as Q8_0).
        tables = checkpoint.block_embedding_tables(tokens=quantization == "w4a8")
        module = build_model(config, checkpoint.read_tensors(), str(path), f"{path.name} metadata",
                             torch_dtype, device, block_size, skip | set(tables))
        for state_name, table in tables.items():  # (`name` is the model's: its served name)
            setattr(module, state_name.removesuffix(".weight"), BlockEmbedding.of(table, torch_dtype, device))
        tokenizer = Tokenizer.from_gguf_metadata(checkpoint.metadata, str(path))
        read_score_rows(module, checkpoint, tokenizer, str(path))
        if mmproj is not None:
            from model.mmproj import read_mmproj

            module.vision = read_mmproj(mmproj, tokenizer, config.hidden_size,
                                        resolve_vision_dtype(vision_dtype, torch_dtype, device), device,
                                        pan_and_scan)
        weight_files = [path]
        pooling = gguf_pooling(checkpoint.metadata)
        if quantization == "w4a8":
            from model.block_quantization import quantize_w4a8

            quantize_w4a8(module, blocks)
    if pan_and_scan is not None and module.vision is None:
        raise ModelLoadError(f"{path}: --pan-and-scan is for a model that reads images; this one reads none")
    if quantization not in ("none", "w4a8"):
        quantize(module, quantization, tokenizer, weight_files)
        if not path.is_dir():  # a GGUF: the LM head is int8 now, so the float table served lookups alone
            table = checkpoint.block_embedding_tables(tokens=True).get("embed_tokens.weight")
            if table is not None:
                module.embed_tokens = BlockEmbedding.of(table, torch_dtype, device)
    defaults = read_sampling_defaults(path) if path.is_dir() else {}
    if not path.is_dir():
        checkpoint.reader.release_pages()  # the file's pages read to build the weights, no longer needed
    if quantization != "none":
        return_freed_memory()  # the float weights quantization started from
    return LoadedModel(config, module, tokenizer, name, path, time.perf_counter() - start, quantization, defaults,
                       pooling)


def return_freed_memory() -> None:
    """Give the pages of freed memory back to the system. glibc's allocator keeps what was freed in pieces
    below its mmap threshold (32 MB at most) in its arenas: loading a quantized model frees the float layers it
    started from, about 0.35 GB of Gemma 3 270M's under W8A8 that the process otherwise kept resident. No-op
    where there is no glibc."""
    name = ctypes.util.find_library("c")
    try:
        trim = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    except OSError:
        trim = None
    if trim is not None:
        trim(0)


def quantize(module, scheme: str, tokenizer, weight_files: list[Path]) -> None:
    """Swap the float32 module's linears for the scheme's int8 ones in place; W8A8 is smoothed first,
    with the calibration read from its cache (computed and cached on the first start)."""
    from model import smoothquant
    from model.quantization import quantize_int8

    if scheme == "w8a8":
        started = time.perf_counter()
        smoothing, cache, cached = smoothquant.cached_smoothing(module, tokenizer, files_sha256(weight_files))
        smoothquant.apply(module, smoothing)
        log.info("SmoothQuant scales %s %s (%.1f s)", "read from" if cached else "calibrated and cached in",
                 cache, time.perf_counter() - started)
    quantize_int8(module, scheme)


def files_sha256(files: list[Path]) -> str:
    """One digest of the files' contents, in order."""
    digest = hashlib.sha256()
    for file in files:
        with open(file, "rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()
