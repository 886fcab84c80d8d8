"""The `tensorrt` backend: a serialized TensorRT engine built from the ONNX export.

Built with the TensorRT Python API: the ONNX parser fills a network, one optimization profile covers the
shapes the artifact declares (tokens per step, sequences, blocks per sequence, cache blocks), and the
builder serializes the engine to `model.plan`. At run time the engine reads and writes torch CUDA tensors
in place (the KV caches are bound as both input and output buffers).

TensorRT needs an NVIDIA GPU and the `tensorrt` package; without them `check_available` stops the
command before any work. The graph is the fp32 ONNX step (`onnx_backend.export_for_tensorrt`); fp16 and
bf16 are builder flags; INT8 is explicit quantization, int8 weights behind DequantizeLinear nodes (one
scale per output channel), with fp16 allowed elsewhere. The caches and logits stay fp32 at the engine's
boundary. This module has not run on a machine with TensorRT: it follows the TensorRT Python API docs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from compile.manifest import ArtifactError, Manifest
from compile.onnx_backend import MODEL_FILE, STEP_INPUTS, cache_input, cache_output
from model.attention import TorchPagedAttention
from model.config import ModelConfig

ENGINE_FILE = "model.plan"


def check_available(precision: str, device: torch.device) -> None:
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ValueError("the tensorrt backend needs an NVIDIA GPU (--device cuda); none is available here")
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        raise ValueError("the tensorrt backend needs the `tensorrt` Python package (pip install tensorrt)") from None


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
        profiles[cache_input(i)] = ((2, 1, bs, config.num_kv_heads, config.head_dim), cache, cache)
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
        # The graph's inputs and outputs are fp32 whatever kernels the builder chose, the caches included.
        return cls(engine, ModelConfig.from_dict(manifest.model["config"]), manifest.shapes["block_size"],
                   torch.float32)

    def allocate_kv_caches(self, num_blocks: int) -> list[torch.Tensor]:
        shape = (2, num_blocks, self.block_size, self.config.num_kv_heads, self.config.head_dim)
        return [torch.zeros(shape, dtype=self.kv_cache_dtype, device="cuda") for _ in range(self.config.num_layers)]

    def sample_logits(self, input_ids, positions, kv_caches, plan, sample_rows) -> torch.Tensor:
        inputs = dict(zip(STEP_INPUTS, (input_ids, positions, plan.query_index, plan.output_index,
                                        plan.block_tables, plan.mask, plan.slot_mapping, plan.seq_lens,
                                        sample_rows)))
        for i, cache in enumerate(kv_caches):
            inputs[cache_input(i)] = cache
        for name, tensor in inputs.items():
            tensor = tensor.contiguous()
            inputs[name] = tensor
            self.context.set_input_shape(name, tuple(tensor.shape))
            self.context.set_tensor_address(name, tensor.data_ptr())
        logits = torch.empty((sample_rows.shape[0], self.config.vocab_size), dtype=torch.float32, device="cuda")
        self.context.set_tensor_address("logits", logits.data_ptr())
        for i, cache in enumerate(kv_caches):  # written in place: the output buffer is the input's
            self.context.set_tensor_address(cache_output(i), cache.data_ptr())
        if not self.context.execute_async_v3(torch.cuda.current_stream().cuda_stream):
            raise RuntimeError("TensorRT execution failed")
        return logits
