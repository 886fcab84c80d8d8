"""Building the `tensorrt` backend: a serialized TensorRT engine from the ONNX export.

Built with the TensorRT Python API: the ONNX parser fills a network, one optimization profile covers the
shapes the artifact declares (tokens per step from `--max-num-batched-tokens`, sequences, blocks per
sequence, cache blocks; zero sampled rows for prompt-only steps), and the
builder serializes the engine to `model.plan`, which `engine/backends/tensorrt_runtime.py` runs.

TensorRT needs an NVIDIA GPU and the `tensorrt` package; without them `check_available` stops the
command before any work. The graph is the fp32 ONNX step (`onnx_export.export_for_tensorrt`); fp16 and
bf16 are builder flags; INT8 is explicit quantization, int8 weights behind DequantizeLinear nodes (one
scale per output channel), with fp16 allowed elsewhere. The caches and logits stay fp32 at the engine's
boundary. This module has not run on a machine with TensorRT: it follows the TensorRT Python API docs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.backends.onnx_runtime import MODEL_FILE, cache_input
from engine.backends.tensorrt_runtime import ENGINE_FILE
from kernels.kv_layout import blocks_for_tokens, kv_cache_shape
from model.config import ModelConfig


def check_available(precision: str, device: torch.device) -> None:
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ValueError("the tensorrt backend needs an NVIDIA GPU (--device cuda); none is available here")
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        raise ValueError("the tensorrt backend needs the `tensorrt` Python package "
                         "(pip install 'ladder[tensorrt]')") from None


def _profile_shapes(config: ModelConfig, shapes: dict[str, int], tokens: int) -> dict[str, tuple[tuple, tuple, tuple]]:
    """(min, opt, max) of every input for the declared shapes."""
    seqs, bs = shapes["max_num_seqs"], shapes["block_size"]
    blocks_per_seq = blocks_for_tokens(shapes["max_model_len"], bs)
    cache_blocks = seqs * blocks_per_seq
    one = {
        "input_ids": (tokens,), "positions": (tokens,), "output_index": (tokens,), "slot_mapping": (tokens,),
        "query_index": (seqs, tokens), "block_tables": (seqs, blocks_per_seq),
        "mask": (seqs, 1, tokens, blocks_per_seq * bs), "seq_lens": (seqs,), "sample_rows": (seqs,),
    }
    profiles = {name: (tuple(1 for _ in dims), tuple(max(1, d // 2) for d in dims), dims)
                for name, dims in one.items()}
    # A step of prompt chunks only samples no row: sample_rows (and the logits) may be empty.
    profiles["sample_rows"] = ((0,), (max(1, seqs // 2),), (seqs,))
    cache = kv_cache_shape(cache_blocks, bs, config.num_kv_heads, config.head_dim)
    for i in range(config.num_layers):
        profiles[cache_input(i)] = (kv_cache_shape(1, bs, config.num_kv_heads, config.head_dim), cache, cache)
    return profiles


def build_engine(directory: Path, options: Any, model_config: ModelConfig) -> list[str]:
    """Parse `model.onnx` in `directory` and write the serialized engine beside it."""
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # TensorRT 10: explicit batch is the only mode
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(directory / MODEL_FILE)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise ValueError(f"TensorRT cannot parse the ONNX export: {errors}")
    config = builder.create_builder_config()
    if options.precision in ("fp16", "int8"):  # int8: Q/DQ weights; the rest may run in fp16
        config.set_flag(trt.BuilderFlag.FP16)
    if options.precision == "bf16":
        config.set_flag(trt.BuilderFlag.BF16)
    if options.precision == "int8":
        config.set_flag(trt.BuilderFlag.INT8)
    shapes = {"max_num_seqs": options.max_num_seqs, "max_model_len": options.max_model_len,
              "block_size": options.block_size}
    profile = builder.create_optimization_profile()
    tokens = options.max_num_batched_tokens  # the engine serving the artifact is capped to it (manifest)
    for name, (low, opt, high) in _profile_shapes(model_config, shapes, tokens).items():
        profile.set_shape(name, low, opt, high)
    config.add_optimization_profile(profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise ValueError("TensorRT failed to build the engine (see its log above)")
    (directory / ENGINE_FILE).write_bytes(bytes(serialized))
    return [ENGINE_FILE]
