"""The `torch-compile` backend: the model's own module, compiled by `torch.compile` (Inductor).

The artifact holds the weights after the precision change (`model.safetensors`: float, or int8 with
per-channel scales; a tied LM head gets its own copy once quantized or smoothed), the model config and the
tokenizer; the manifest's `backend_options` hold the `torch.compile` arguments. Loading rebuilds exactly
that module and compiles it again; Inductor's on-disk cache, warmed by `ladder compile` on the same
machine, makes that quick.

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
from safetensors.torch import load_file, save_file

from compile.quantize import INT8_LINEARS, activation_dtype, int8_skeleton, pack_all
from model.attention import CpuPagedAttention, TorchAttentionPlan, TorchPagedAttention
from model.config import ModelConfig
from model.llama import LlamaForCausalLM
from model.rope import inverse_frequencies

WEIGHTS, CONFIG = "model.safetensors", "config.json"


@torch.library.custom_op("ladder::paged_attention", mutates_args=("kv_cache",))
def paged_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
    query_index: torch.Tensor, output_index: torch.Tensor, block_tables: torch.Tensor, mask: torch.Tensor,
    slot_mapping: torch.Tensor, seq_lens: torch.Tensor, scale: float, block_size: int, sliding_window: int,
) -> torch.Tensor:
    """CpuPagedAttention.forward with the plan spelled out as tensors (custom ops take no dataclasses)."""
    plan = TorchAttentionPlan(query_index, output_index, block_tables, mask, slot_mapping, seq_lens)
    return CpuPagedAttention(block_size, sliding_window or None).forward(q, k, v, kv_cache, plan, scale)


@paged_attention_op.register_fake
def _(q, k, v, kv_cache, *rest) -> torch.Tensor:
    return torch.empty_like(q)


class OpaquePagedAttention(TorchPagedAttention):
    """The CPU attention behind one custom op, so `torch.compile` neither traces nor breaks on it."""

    def forward(self, q, k, v, kv_cache, plan: TorchAttentionPlan, scale: float) -> torch.Tensor:
        return paged_attention_op(q, k, v, kv_cache, plan.query_index, plan.output_index, plan.block_tables,
                                  plan.mask, plan.slot_mapping, plan.seq_lens, scale, self.block_size,
                                  self.sliding_window or 0)


def compile_options(device: torch.device) -> dict[str, Any]:
    # dynamic: one graph for every token count; CUDA graphs only where they exist.
    return {"dynamic": True, "fullgraph": True, "mode": "reduce-overhead" if device.type == "cuda" else "default"}


class TorchCompiledModel:
    """A compiled module behind the interface the engine's runner uses (`engine/model_runner.py`)."""

    def __init__(self, module: LlamaForCausalLM, precision: str, options: dict[str, Any]) -> None:
        self.module = module
        self.config = module.config
        self.block_size = module.block_size
        self.precision = precision
        self.kv_cache_dtype = activation_dtype(precision)
        device = module.embed_tokens.weight.device
        attention_type = OpaquePagedAttention if device.type == "cpu" else TorchPagedAttention
        self.attention = attention_type(module.block_size, module.config.sliding_window)
        module.attention = self.attention
        for layer in module.layers:
            layer.self_attn.backend = self.attention
        # Dynamo caches graphs per code object, and every model's `sample_logits` shares one: leave room
        # for several models in a process (tests, the compile pipeline) beside their shape variants.
        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 64)
        self._compiled = torch.compile(module.sample_logits, **options)

    def allocate_kv_caches(self, num_blocks: int) -> list[torch.Tensor]:
        return self.module.allocate_kv_caches(num_blocks, dtype=self.kv_cache_dtype)

    def warm_up(self) -> None:
        """Compile now, not on the first requests: run the kinds of step the engine makes (one prompt,
        one decode, decodes beside a prefill chunk) on a scratch cache."""
        from compile.parity import Sequences  # the same small driver the parity report uses

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


def save(module: LlamaForCausalLM, directory: Path) -> list[str]:
    state = {name: t.contiguous() for name, t in module.state_dict().items()}
    if module.lm_head.weight is module.embed_tokens.weight:
        del state["lm_head.weight"]  # the embedding itself; safetensors stores no aliases
    save_file(state, str(directory / WEIGHTS), metadata={"format": "pt"})
    (directory / CONFIG).write_text(json.dumps(module.config.to_dict(), indent=1), encoding="utf-8")
    return [WEIGHTS, CONFIG]


def load(directory: Path, precision: str, block_size: int, device: torch.device,
         options: dict[str, Any]) -> TorchCompiledModel:
    """Rebuild the saved module (no random init, no pickle) and compile it with the recorded options."""
    from kernels.ops import select_ops

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
