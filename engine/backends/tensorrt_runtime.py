"""A serialized TensorRT engine (`compile/tensorrt_build.py` builds it) as a StepModel.

The engine reads and writes torch CUDA tensors in place: the KV caches are bound as both input and
output buffers. Its graph's inputs and outputs are fp32 whatever kernels the builder chose, the caches
included. This module has not run on a machine with TensorRT: it follows the TensorRT Python API docs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.backends.manifest import ArtifactError, Manifest
from engine.backends.onnx_runtime import STEP_INPUTS, cache_input, cache_output
from model.attention import TorchAttentionPlan, TorchPagedAttention
from model.attention_metadata import AttentionMetadata
from model.config import ModelConfig
from model.step import allocate_kv_caches

ENGINE_FILE = "model.plan"


class TensorRTModel:
    """A TensorRT engine as a StepModel; caches are CUDA tensors updated in place."""

    def __init__(self, engine: Any, config: ModelConfig, block_size: int, kv_cache_dtype: torch.dtype) -> None:
        self.engine = engine
        self.context = engine.create_execution_context()
        self.config = config
        self.block_size = block_size
        self.kv_cache_dtype = kv_cache_dtype
        self.attention = TorchPagedAttention(block_size, config.sliding_window)
        self.device = torch.device("cuda")

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

    def plan(self, meta: AttentionMetadata) -> TorchAttentionPlan:
        return self.attention.plan(meta)

    def allocate_kv_caches(self, num_blocks: int) -> list[torch.Tensor]:
        return allocate_kv_caches(self.config, self.block_size, num_blocks, self.kv_cache_dtype, self.device)

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
