"""The `torch-compile` artifact runtime: the model's own module, compiled by `torch.compile` (Inductor).

The artifact (`compile/pipeline.py` writes it) holds the weights after the precision change
(`model.safetensors`: float, or int8 with per-channel scales; a tied LM head gets its own copy once
quantized or smoothed), the model config and the tokenizer; the manifest's `backend_options` hold the
`torch.compile` arguments. Loading rebuilds exactly that module and compiles it again; Inductor's on-disk
cache, warmed by `ladder compile` on the same machine, makes that quick.

What Inductor sees: one step, `sample_logits(input_ids, positions, kv_caches, plan, sample_rows)`, with
every batch dimension dynamic. Paged attention stays one opaque custom op (`ladder::paged_attention`,
which writes the cache in place and runs the C++ decode kernel or the torch path): Inductor fuses the
norms, rotary, SwiGLU and W8A8's per-token quantization around it and calls the matmuls (float, the INT8
weight-only kernel, or `_int_mm`) directly, with no Python per layer. On CUDA the plain-torch attention
is traced instead and CUDA graphs are captured (`mode="reduce-overhead"`); that path has not been run on
a GPU yet.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch._dynamo.config as dynamo_config
import torch.fx.experimental._config as fx_config
from safetensors.torch import load_file

from kernels.ops import select_ops
from model.attention import AttentionPlan, OpaquePagedAttention, TorchPagedAttention
from model.attention_metadata import AttentionMetadata
from model.config import ModelConfig
from model.llama import LlamaForCausalLM
from model.quantization import INT8_LINEARS, activation_dtype, int8_skeleton, pack_all
from model.rope import inverse_frequencies
from model.sequences import Sequences
from model.step import allocate_kv_caches

WEIGHTS, CONFIG = "model.safetensors", "config.json"


def compile_options(device: torch.device) -> dict[str, Any]:
    # dynamic: one graph for every token count; CUDA graphs only where they exist.
    return {"dynamic": True, "fullgraph": True, "mode": "reduce-overhead" if device.type == "cuda" else "default"}


class TorchCompiledModel:
    """A compiled module as a StepModel (model/step.py)."""

    def __init__(self, module: LlamaForCausalLM, precision: str, options: dict[str, Any]) -> None:
        self.module = module
        self.config = module.config
        self.block_size = module.block_size
        self.precision = precision
        self.kv_cache_dtype = activation_dtype(precision)
        self.device = module.device
        attention_type = OpaquePagedAttention if self.device.type == "cpu" else TorchPagedAttention
        self.attention = attention_type(module.block_size, module.config.sliding_window)
        module.attention = self.attention
        for layer in module.layers:
            layer.self_attn.backend = self.attention
        # Dynamo caches graphs per code object, and every model's `sample_logits` shares one: leave room
        # for several models in a process (tests, the compile pipeline) beside their shape variants.
        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 64)
        self._compiled = torch.compile(module.sample_logits, **options)

    def plan(self, meta: AttentionMetadata) -> AttentionPlan:
        return self.attention.plan(meta)

    def allocate_kv_caches(self, num_blocks: int) -> list[torch.Tensor]:
        return allocate_kv_caches(self.config, self.block_size, num_blocks, self.kv_cache_dtype, self.device)

    def warm_up(self) -> None:
        """Compile now, not on the first requests: run the kinds of step the engine makes (one prompt,
        one decode, decodes beside a prefill chunk) on a scratch cache."""
        seqs = Sequences(self, 3, 4 * self.block_size)
        seqs.step([[1, 2, 3], [], []])  # a prompt alone
        seqs.step([[4], [], []])  # one decode
        seqs.step([[5], [1] * 19, [2, 3]])  # a decode beside two prompts of other lengths
        seqs.step([[6], [7], [8]])  # a decode batch

    def sample_logits(self, input_ids, positions, kv_caches, plan, sample_rows) -> torch.Tensor:
        # Size-oblivious shapes: a batch of one sequence or one token is not a special case, so the
        # same graph serves every step instead of one graph per pattern of 1s in the shapes.
        with fx_config.patch(backed_size_oblivious=True, use_duck_shape=False):
            return self._compiled(input_ids, positions, kv_caches, plan, sample_rows)


def load(directory: Path, precision: str, block_size: int, device: torch.device,
         options: dict[str, Any]) -> TorchCompiledModel:
    """Rebuild the saved module (no random init, no pickle) and compile it with the recorded options."""
    config = ModelConfig.from_dict(json.loads((directory / CONFIG).read_text(encoding="utf-8")))
    with torch.device("meta"):
        module = LlamaForCausalLM(config, block_size=block_size, ops=select_ops(device))
        if precision in INT8_LINEARS:
            int8_skeleton(module, precision)
    state = load_file(str(directory / WEIGHTS), device=str(device))
    tied = "lm_head.weight" not in state  # saved without its own head: the embedding is the head
    if tied:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    module.load_state_dict(state, strict=True, assign=True)
    if tied:
        module.lm_head.weight = module.embed_tokens.weight
    module.inv_freq = inverse_frequencies(config).to(device)
    pack_all(module)
    model = TorchCompiledModel(module.eval().requires_grad_(False), precision, options)
    model.warm_up()
    return model
