"""The `tensorrt` backend: a serialized TensorRT engine built from the ONNX export.

Built with the TensorRT Python API: the ONNX parser fills a network, one optimization profile covers the
shapes the artifact declares (tokens per step, sequences, blocks per sequence, cache blocks), and the
builder serializes the engine to `model.plan`. At run time the engine reads and writes torch CUDA tensors
in place (the KV caches are bound as both input and output buffers).

TensorRT needs an NVIDIA GPU and the `tensorrt` package; without them `check_available` stops the
command before any work. Precisions: fp32, fp16 and bf16 (builder flags). INT8 through Q/DQ nodes is not
built yet and is refused with that reason. This module has not run on a machine with TensorRT.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from compile.manifest import ArtifactError, Manifest
from model.attention import TorchPagedAttention
from model.config import ModelConfig

ENGINE_FILE = "model.plan"
ONNX_FILE = "model.onnx"
PLAN_INPUTS = ("input_ids", "positions", "query_index", "output_index", "block_tables", "mask", "slot_mapping",
               "seq_lens", "sample_rows")


def check_available(precision: str, device: torch.device) -> None:
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ValueError("the tensorrt backend needs an NVIDIA GPU (--device cuda); none is available here")
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        raise ValueError("the tensorrt backend needs the `tensorrt` Python package (pip install tensorrt)") from None
    if precision == "int8":
        raise ValueError("tensorrt int8 (Q/DQ) is not built yet; use --precision fp16 or bf16, or the "
                         "torch-compile backend for int8")


def _profile_shapes(config: ModelConfig, shapes: dict[str, int], tokens: int) -> dict[str, tuple[tuple, tuple, tuple]]:
    """(min, opt, max) of every input for the declared shapes."""
    seqs, bs = shapes["max_num_seqs"], shapes["block_size"]
    blocks_per_seq = -(-shapes["max_model_len"] // bs)
    cache_blocks = seqs * blocks_per_seq
    one = {
        "input_ids": (tokens,), "positions": (tokens,), "output_index": (tokens,), "slot_mapping": (tokens,),
        "query_index": (seqs, tokens), "block_tables": (seqs, blocks_per_seq),
        "mask": (seqs, 1, tokens, blocks_per_seq * bs), "seq_lens": (seqs,), "sample_rows": (seqs,),
    }
    profiles = {name: (tuple(1 for _ in dims), tuple(max(1, d // 2) for d in dims), dims)
                for name, dims in one.items()}
    cache = (2, cache_blocks, bs, config.num_kv_heads, config.head_dim)
    for i in range(config.num_layers):
        profiles[f"kv_cache.{i}"] = ((2, 1, bs, config.num_kv_heads, config.head_dim), cache, cache)
    return profiles


def build_engine(directory: Path, options: Any, model_config: ModelConfig) -> list[str]:
    """Parse `model.onnx` in `directory` and write the serialized engine beside it."""
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # TensorRT 10: explicit batch is the only mode
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(directory / ONNX_FILE)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise ValueError(f"TensorRT cannot parse the ONNX export: {errors}")
    config = builder.create_builder_config()
    if options.precision == "fp16":
        config.set_flag(trt.BuilderFlag.FP16)
    elif options.precision == "bf16":
        config.set_flag(trt.BuilderFlag.BF16)
    shapes = {"max_num_seqs": options.max_num_seqs, "max_model_len": options.max_model_len,
              "block_size": options.block_size}
    profile = builder.create_optimization_profile()
    for name, (low, opt, high) in _profile_shapes(model_config, shapes, tokens=2048).items():
        profile.set_shape(name, low, opt, high)
    config.add_optimization_profile(profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise ValueError("TensorRT failed to build the engine (see its log above)")
    (directory / ENGINE_FILE).write_bytes(bytes(serialized))
    return [ENGINE_FILE]


class TensorRTModel:
    """A TensorRT engine behind the runner's interface; caches are CUDA tensors updated in place."""

    def __init__(self, engine: Any, config: ModelConfig, block_size: int, kv_cache_dtype: torch.dtype) -> None:
        self.engine = engine
        self.context = engine.create_execution_context()
        self.config = config
        self.block_size = block_size
        self.kv_cache_dtype = kv_cache_dtype
        self.attention = TorchPagedAttention(block_size, config.sliding_window)

    @classmethod
    def load(cls, directory: Path, manifest: Manifest, device: torch.device) -> TensorRTModel:
        try:
            import tensorrt as trt
        except ImportError:
            raise ArtifactError("this artifact needs the `tensorrt` package, which is not installed") from None
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        engine = runtime.deserialize_cuda_engine((directory / ENGINE_FILE).read_bytes())
        if engine is None:
            raise ArtifactError(f"{directory / ENGINE_FILE}: TensorRT cannot deserialize this engine "
                                "(built by another TensorRT version or for another GPU)")
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(manifest.precision, torch.float32)
        return cls(engine, ModelConfig.from_dict(manifest.model["config"]), manifest.shapes["block_size"], dtype)

    def allocate_kv_caches(self, num_blocks: int) -> list[torch.Tensor]:
        shape = (2, num_blocks, self.block_size, self.config.num_kv_heads, self.config.head_dim)
        return [torch.zeros(shape, dtype=self.kv_cache_dtype, device="cuda") for _ in range(self.config.num_layers)]

    def sample_logits(self, input_ids, positions, kv_caches, plan, sample_rows) -> torch.Tensor:
        inputs = dict(zip(PLAN_INPUTS, (input_ids, positions, plan.query_index, plan.output_index,
                                        plan.block_tables, plan.mask, plan.slot_mapping, plan.seq_lens,
                                        sample_rows)))
        for i, cache in enumerate(kv_caches):
            inputs[f"kv_cache.{i}"] = cache
        for name, tensor in inputs.items():
            tensor = tensor.contiguous()
            inputs[name] = tensor
            self.context.set_input_shape(name, tuple(tensor.shape))
            self.context.set_tensor_address(name, tensor.data_ptr())
        logits = torch.empty((sample_rows.shape[0], self.config.vocab_size), dtype=torch.float32, device="cuda")
        self.context.set_tensor_address("logits", logits.data_ptr())
        for i, cache in enumerate(kv_caches):  # written in place: the output buffer is the input's
            self.context.set_tensor_address(f"kv_cache_out.{i}", cache.data_ptr())
        if not self.context.execute_async_v3(torch.cuda.current_stream().cuda_stream):
            raise RuntimeError("TensorRT execution failed")
        return logits
