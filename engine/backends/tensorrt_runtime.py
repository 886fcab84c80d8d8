"""A serialized TensorRT engine (`compile/tensorrt_build.py` builds it) as a StepModel.

The engine reads torch CUDA tensors where they are. Its graph's inputs and outputs are fp32 whatever
kernels the builder chose, the caches included.

The caches: the graph returns each layer's updated cache as an output. TensorRT does not document that
an output may share an input's memory, so outputs are never bound to the caches themselves: each goes
to a scratch buffer of the cache's shape (kept between steps), and only the slots this step wrote
(`slot_mapping`) are copied back into the caller's cache. TensorRT still writes the whole output cache
each step; that is the price of a graph whose cache is an output (the ONNX Runtime backend, whose
ScatterND is documented to update in place, binds it in place instead).

The engine serves at most the tokens per step and sequences it was built for (the manifest's shapes);
`set_input_shape` refusing a shape raises with the input's name and shape. This module has not run on a
machine with TensorRT: it follows the TensorRT Python API docs.
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
from model.step import BaseStepModel, allocate_kv_caches

ENGINE_FILE = "model.plan"


class TensorRTModel(BaseStepModel):
    """A TensorRT engine as a StepModel; caches are CUDA tensors updated in place."""

    def __init__(self, engine: Any, config: ModelConfig, block_size: int, kv_cache_dtype: torch.dtype,
                 device: torch.device | str = "cuda") -> None:
        self.engine = engine
        self.context = engine.create_execution_context()
        self.config = config
        self.block_size = block_size
        self.kv_cache_dtype = kv_cache_dtype
        self.attention = TorchPagedAttention(block_size, config.sliding_window)
        self.device = torch.device(device)
        self._scratch: list[torch.Tensor] = []  # one output cache per layer, the shape of the caches

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
                   torch.float32, device)

    def warm_up(self, kv_caches: list[torch.Tensor]) -> None:
        """None: the engine was built ahead of time and deserialized at load."""

    def plan(self, meta: AttentionMetadata) -> TorchAttentionPlan:
        return self.attention.plan(meta)

    def allocate_kv_caches(self, num_blocks: int) -> list[torch.Tensor]:
        return allocate_kv_caches(self.config, self.block_size, num_blocks, self.kv_cache_dtype, self.device)

    def _set_input(self, name: str, tensor: torch.Tensor) -> None:
        if not self.context.set_input_shape(name, tuple(tensor.shape)):
            raise ValueError(f"the TensorRT engine refuses {name} of shape {list(tensor.shape)}: outside the "
                             "shapes it was built for (the manifest's max_num_seqs, max_model_len, "
                             "max_num_batched_tokens)")
        self.context.set_tensor_address(name, tensor.data_ptr())

    def sample_logits(self, input_ids, positions, kv_caches, plan, sample_rows) -> torch.Tensor:
        device = self.device
        inputs = dict(zip(STEP_INPUTS, (input_ids, positions, plan.query_index, plan.output_index,
                                        plan.block_tables, plan.mask, plan.slot_mapping, plan.seq_lens,
                                        sample_rows)))
        for i, cache in enumerate(kv_caches):
            inputs[cache_input(i)] = cache
        bound = {}  # referenced until the engine has run
        for name, tensor in inputs.items():
            bound[name] = tensor.to(device).contiguous()
            self._set_input(name, bound[name])
        if len(self._scratch) != len(kv_caches) or self._scratch[0].shape != kv_caches[0].shape:
            self._scratch = [torch.empty_like(cache) for cache in kv_caches]
        num_rows = sample_rows.shape[0]
        # A prefill-only step has no rows to sample; the engine still needs an address to write to.
        logits = torch.empty((max(num_rows, 1), self.config.vocab_size), dtype=torch.float32, device=device)
        self.context.set_tensor_address("logits", logits.data_ptr())
        for i, scratch in enumerate(self._scratch):
            self.context.set_tensor_address(cache_output(i), scratch.data_ptr())
        if not self.context.execute_async_v3(torch.cuda.current_stream(device).cuda_stream):
            raise RuntimeError("TensorRT execution failed")
        slots = bound["slot_mapping"]
        for cache, scratch in zip(kv_caches, self._scratch):
            # [2, N, block, kvh, d] seen as [2, slots, kvh, d]: copy back the slots this step wrote.
            flat, new = cache.view(2, -1, *cache.shape[3:]), scratch.view(2, -1, *cache.shape[3:])
            flat[:, slots] = new[:, slots]
        return logits[:num_rows]
