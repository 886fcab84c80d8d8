"""ONNX Runtime running an exported engine step (`compile/onnx_export.py` writes it), as a StepModel.

The graph's interface, which the exporter and this runtime share:

    inputs   input_ids [T], positions [T], query_index [S, Q], output_index [T], block_tables [S, NB],
             mask [S, 1, Q, L] bool, slot_mapping [T], seq_lens [S], sample_rows [B]  (all int64 but mask),
             kv_cache.{i} [2, N, block_size, kv_heads, head_dim]  (one per layer)
    outputs  logits [B, vocab] float32, kv_cache_out.{i} (same shape as kv_cache.{i})

Inside the graph each layer's cache update is one ScatterND straight into the 5-d cache, and the
attention reads the ScatterND's output, never the input cache. So when `OnnxModel` binds
`kv_cache_out.{i}` to the very buffer of `kv_cache.{i}`, ONNX Runtime's ScatterND sees input == output
and only writes the new slots: the cache is updated in place with no copy.
"""

from __future__ import annotations

from pathlib import Path

import torch

from model.attention import TorchAttentionPlan, TorchPagedAttention
from model.attention_metadata import AttentionMetadata
from model.config import ModelConfig
from model.step import BaseStepModel, allocate_kv_caches

MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"

PLAN_INPUTS = ("query_index", "output_index", "block_tables", "mask", "slot_mapping", "seq_lens")
STEP_INPUTS = ("input_ids", "positions", *PLAN_INPUTS, "sample_rows")


def cache_input(i: int) -> str:
    return f"kv_cache.{i}"


def cache_output(i: int) -> str:
    return f"kv_cache_out.{i}"


_ORT_TYPES = {torch.float32: "float32", torch.float16: "float16", torch.int64: "int64", torch.bool: "bool"}


def default_providers() -> list[str]:
    """CUDA when this onnxruntime build has it, then the CPU. (TensorRT needs shape profiles for the
    dynamic dims: pass it explicitly with its options when wanted.)"""
    import onnxruntime as ort

    available = ort.get_available_providers()
    return [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available]


def ort_value(array, device: torch.device):
    import onnxruntime as ort

    return ort.OrtValue.ortvalue_from_numpy(array, device.type, device.index or 0)


class OnnxModel(BaseStepModel):
    """An exported step in an `onnxruntime.InferenceSession`, as a `model.step.StepModel` (its
    `sample_logits` updates the caches in place)."""

    def __init__(self, session, config: ModelConfig, block_size: int, kv_cache_dtype: torch.dtype,
                 alias_caches: bool = True) -> None:
        self.session = session
        self.config = config
        self.block_size = block_size
        self.kv_cache_dtype = kv_cache_dtype
        self.attention = TorchPagedAttention(block_size, config.sliding_window)
        # True: bind kv_cache_out.{i} to kv_cache.{i}'s own buffer (ScatterND then writes only the new
        # slots). False: ORT writes a fresh cache that is copied back (for measuring that cost).
        self.alias_caches = alias_caches
        self.device = torch.device("cuda", 0) if session.get_providers()[0] in (
            "CUDAExecutionProvider", "TensorrtExecutionProvider") else torch.device("cpu")
        self._check_graph()
        self._scratch: list[torch.Tensor] | None = None

    @classmethod
    def load(cls, directory: Path, config: ModelConfig, block_size: int, kv_cache_dtype: torch.dtype,
             num_threads: int | None = None, providers: list | None = None, alias_caches: bool = True) -> OnnxModel:
        import onnxruntime as ort

        options = ort.SessionOptions()
        # The artifact is already optimised offline; the online pass may add machine-specific layouts.
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if num_threads is not None:
            options.intra_op_num_threads = num_threads
        session = ort.InferenceSession(str(Path(directory) / MODEL_FILE), options,
                                       providers=providers or default_providers())
        return cls(session, config, block_size, kv_cache_dtype, alias_caches)

    def _check_graph(self) -> None:
        cfg = self.config
        inputs = {i.name: i for i in self.session.get_inputs()}
        expected = [*STEP_INPUTS, *(cache_input(i) for i in range(cfg.num_layers))]
        if sorted(inputs) != sorted(expected):
            raise ValueError(f"ONNX graph inputs {sorted(inputs)} do not match the config's {cfg.num_layers} layers")
        cache = inputs[cache_input(0)]
        want_type = f"tensor({_ORT_TYPES[self.kv_cache_dtype]})".replace("float32", "float")
        if cache.type != want_type:
            raise ValueError(f"ONNX graph takes a {cache.type} KV cache, not {self.kv_cache_dtype}")
        shape = [2, None, self.block_size, cfg.num_kv_heads, cfg.head_dim]
        got = [d if isinstance(d, int) else None for d in cache.shape]
        if got != shape:
            raise ValueError(f"ONNX graph KV cache shape {cache.shape} does not match {shape}")

    def warm_up(self, kv_caches: list[torch.Tensor]) -> None:
        """None: the session is built and optimised at load."""

    def plan(self, meta: AttentionMetadata) -> TorchAttentionPlan:
        return self.attention.plan(meta)

    def allocate_kv_caches(self, num_blocks: int) -> list[torch.Tensor]:
        self._scratch = None
        return allocate_kv_caches(self.config, self.block_size, num_blocks, self.kv_cache_dtype, self.device)

    def _bind(self, binding, name: str, tensor: torch.Tensor, output: bool = False) -> None:
        import numpy as np

        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        device = tensor.device
        if tensor.numel() == 0:  # no buffer to point at (data_ptr 0): let ORT hold the empty tensor
            if output:
                binding.bind_output(name, device.type, device.index or 0)
            else:
                empty = np.empty(list(tensor.shape), dtype=_ORT_TYPES[tensor.dtype])
                binding.bind_ortvalue_input(name, ort_value(empty, device))
            return
        args = (name, device.type, device.index or 0, np.dtype(_ORT_TYPES[tensor.dtype]), list(tensor.shape),
                tensor.data_ptr())
        (binding.bind_output if output else binding.bind_input)(*args)

    @torch.inference_mode()
    def sample_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                      plan: TorchAttentionPlan, sample_rows: torch.Tensor) -> torch.Tensor:
        """Logits [B, vocab] float32 of `sample_rows`; writes this step's keys and values into `kv_caches`."""
        if len(kv_caches) != self.config.num_layers:
            raise ValueError(f"expected {self.config.num_layers} KV caches, got {len(kv_caches)}")
        device = self.device
        step = {
            "input_ids": input_ids, "positions": positions, "query_index": plan.query_index,
            "output_index": plan.output_index, "block_tables": plan.block_tables, "mask": plan.mask,
            "slot_mapping": plan.slot_mapping, "seq_lens": plan.seq_lens, "sample_rows": sample_rows,
        }
        # Keep every bound tensor referenced until the run is over.
        bound = {name: t.to(device=device, dtype=torch.bool if name == "mask" else torch.long).contiguous()
                 for name, t in step.items()}
        logits = torch.empty((sample_rows.shape[0], self.config.vocab_size), dtype=torch.float32, device=device)
        binding = self.session.io_binding()
        for name, tensor in bound.items():
            self._bind(binding, name, tensor)
        if not self.alias_caches and (self._scratch is None or self._scratch[0].shape != kv_caches[0].shape):
            self._scratch = [torch.empty_like(c) for c in kv_caches]
        for i, cache in enumerate(kv_caches):
            if cache.dtype != self.kv_cache_dtype:
                raise ValueError(f"KV cache {i} is {cache.dtype}, the graph takes {self.kv_cache_dtype}")
            self._bind(binding, cache_input(i), cache)
            self._bind(binding, cache_output(i), cache if self.alias_caches else self._scratch[i], output=True)
        self._bind(binding, "logits", logits, output=True)
        self.session.run_with_iobinding(binding)
        if not self.alias_caches:
            for cache, new in zip(kv_caches, self._scratch):
                cache.copy_(new)
        return logits
