"""W4A8: linear layers that compute on a GGUF file's own quantized blocks.

The float model loaded from such a file holds the dequantized weights, d * u + m per 32-block; these
layers keep u, d and m as the file has them (model/gguf_blocks.py: exactly for Q4_0, Q4_1, Q5_0, Q5_1,
Q6_K and Q8_0, with float16-rounded sub-block scales for Q4_K and Q5_K, requantized to 8 bits for the other
types) and quantize each 32-block of the activations to int8 on the fly (kernels/cpu_w4a8_linear.py). No
calibration (SmoothQuant) is needed: only the activations are rounded, per block of 32, which bounds an
outlier's damage to its own block. A batch-1 decode step reads 5/8 of the bytes the W8A8 layers read for
the 4-bit projections (4-bit codes and 16-bit scales per 32), 3/4 for the 5-bit ones, 7/8 for the 6-bit
ones (their sub-scales too), and an 8-bit LM head as it is.

The module (model/w4a8_linear.py) is a swap applied from outside model/llama.py, like model/quantization.py's INT8 forms: q/k/v and
gate/up are fused here the way model/weights.py fuses the float weights (rows concatenated).
"""

from __future__ import annotations

import torch

from model.config import ModelConfig
from model.errors import ModelLoadError
from model.gguf_blocks import BlockWeight
from model.llama import LlamaForCausalLM
from model.moe import GptOssMoeBlock, W4A8Gemma4Experts, W4A8GptOssMoeBlock, W4A8SparseMoeBlock
from model.w4a8_linear import W4A8Linear


def linear_sources(config: ModelConfig) -> dict[str, list[str]]:
    """Each linear module of the model -> the checkpoint weights its rows come from, in order (a sparse
    layer's experts are in `expert_sources`)."""
    sources = {"lm_head": ["lm_head.weight"]}
    for i in range(config.num_layers):
        attn, mlp = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
        if config.is_linear_layer(i):  # Qwen3.5's linear attention: its fused input projection and its output
            linear = f"layers.{i}.linear_attn."
            sources[linear + "in_proj"] = [linear + f"in_proj_{x}.weight" for x in ("qkv", "z", "b", "a")]
            sources[linear + "out_proj"] = [linear + "out_proj.weight"]
        else:
            sources[attn + "qkv_proj"] = [attn + f"{x}_proj.weight" for x in config.layer_projections(i)]
            if config.attention_output_gate:
                sources[attn + "qkv_proj"].append(attn + "q_gate_proj.weight")
            sources[attn + "o_proj"] = [attn + "o_proj.weight"]
        if not config.is_sparse_layer(i):
            sources[mlp + "gate_up_proj"] = [mlp + "gate_proj.weight", mlp + "up_proj.weight"]
            sources[mlp + "down_proj"] = [mlp + "down_proj.weight"]
        elif config.shared_expert_intermediate_size:  # the shared expert (its gate, hidden -> 1, stays float)
            shared, module = mlp + "shared_expert.", f"layers.{i}.shared_expert."
            sources[module + "gate_up_proj"] = [shared + "gate_proj.weight", shared + "up_proj.weight"]
            sources[module + "down_proj"] = [shared + "down_proj.weight"]
        if config.per_layer_input_size:  # Gemma 4's per-layer embedding's gate and projection
            for name in (f"layers.{i}.per_layer_input_gate", f"layers.{i}.per_layer_projection"):
                sources[name] = [name + ".weight"]
    return sources


def expert_sources(config: ModelConfig) -> dict[str, tuple[str, str, str]]:
    """Each sparse layer's MoE block -> the GGUF reader's stacked [E, out, in] gate, up and down weights."""
    return {f"layers.{i}.mlp": tuple(f"layers.{i}.mlp.experts.{x}_proj.weight" for x in ("gate", "up", "down"))
            for i in range(config.num_layers) if config.is_sparse_layer(i)}


def gemma4_expert_layers(config: ModelConfig) -> list[int]:
    """The layers with Gemma 4's experts beside their MLP (every layer of 26B-A4B, else none)."""
    return list(range(config.num_layers)) if config.experts_beside_mlp else []


def replaced_weights(config: ModelConfig) -> set[str]:
    """The float module's state-dict names that `quantize_w4a8` replaces: the loader leaves them unread."""
    return ({f"{name}.weight" for name in linear_sources(config)}
            | {f"{block}.{w}" for block in expert_sources(config) for w in ("w13", "w2")}
            | {f"layers.{i}.experts.{w}" for i in gemma4_expert_layers(config) for w in ("gate_up_proj", "down_proj")})


def split_experts(weight: BlockWeight, num_experts: int) -> list[BlockWeight]:
    """A stacked expert weight read as [E * N, K] rows -> E weights of [N, K]."""
    n = weight.codes.shape[0] // num_experts
    return [weight.rows(slice(e * n, (e + 1) * n)) for e in range(num_experts)]


def concat(parts: list[BlockWeight]) -> BlockWeight:
    """Row-concatenated weights in one format, each part's weights exactly: narrower parts widen to the
    widest part's codes (a K-quant file's Q4_K q and k beside its Q6_K v: 6 bits, sub-scales of 1 and zero
    32 for the Q4_K rows; beside a Q8_0 part, 8 bits, the Q6_K rows requantized); parts of different zeros,
    or with and without m, get an explicit m: -zero d (exact in float16: zero is a power of two), or, for
    6-bit codes, which all share zero 32, m = 0."""
    if len(parts) == 1:
        return parts[0]
    bits = max(p.bits for p in parts)
    tables = {None if p.table is None else tuple(p.table.tolist()) for p in parts}
    if tables != {None} and (len(tables) > 1 or len({p.bits for p in parts}) > 1):
        bits = 8  # table codes beside other codes (or another table): all as bytes
    parts = [p.widened(bits) for p in parts]
    if len({(p.m is None, p.zero) for p in parts}) > 1:
        if bits == 6:
            parts = [p if p.m is not None else BlockWeight(p.codes, p.d, torch.zeros_like(p.d), 6, p.zero, p.sub)
                     for p in parts]
        else:
            parts = [p if p.m is not None else BlockWeight(p.codes, p.d, (p.d.float() * -p.zero).half(), p.bits, 0)
                     for p in parts]

    def cat(name: str) -> torch.Tensor | None:
        return None if getattr(parts[0], name) is None else torch.cat([getattr(p, name) for p in parts])

    return BlockWeight(cat("codes"), cat("d"), cat("m"), parts[0].bits, parts[0].zero, cat("sub"), parts[0].table)


def quantize_w4a8(module: LlamaForCausalLM, blocks: dict[str, BlockWeight]) -> LlamaForCausalLM:
    """Swap every linear layer for a W4A8Linear over the file's blocks (`GGUFCheckpoint.read_blocks`), and
    every MoE block for a W4A8SparseMoeBlock (GPT-OSS's for a W4A8GptOssMoeBlock), in place; biases (Qwen2's q/k/v,
    GPT-OSS's everywhere) and routers stay float. A
    tied LM head gets its own copy of the embedding's blocks."""
    config = module.config
    for name, (gate, up, down) in expert_sources(config).items():
        old = module.get_submodule(name)
        e, h, inter = config.num_experts, config.hidden_size, config.moe_intermediate_size
        downs = split_experts(blocks[down], e)
        fused = f"{name}.experts.gate_up_proj"  # a file that stacks gate and up as one tensor
        if fused in blocks:
            w13 = split_experts(blocks[fused], e)
        else:
            w13 = [concat([g, u]) for g, u in zip(split_experts(blocks[gate], e), split_experts(blocks[up], e),
                                                  strict=True)]
        if tuple(w13[0].codes.shape) != (2 * inter, h) or tuple(downs[0].codes.shape) != (h, inter):
            raise ModelLoadError(f"{name}: expert blocks of shapes {list(w13[0].codes.shape)} and "
                                 f"{list(downs[0].codes.shape)}, the layer's are [{2 * inter}, {h}] and [{h}, {inter}]")
        layer, _, child = name.rpartition(".")
        setattr(module.get_submodule(layer), child,
                W4A8GptOssMoeBlock(old, w13, downs) if isinstance(old, GptOssMoeBlock)
                else W4A8SparseMoeBlock(old.gate, w13, downs, old.top_k, old.renormalize))
    for i in gemma4_expert_layers(config):
        p, e = f"layers.{i}.experts.", config.num_experts
        if p + "gate_up_proj" in blocks:  # one stack of each expert's gate rows then up rows
            w13 = split_experts(blocks[p + "gate_up_proj"], e)
        else:  # gate and up stacked apart
            w13 = [concat([g, u]) for g, u in zip(split_experts(blocks[p + "gate_proj"], e),
                                                    split_experts(blocks[p + "up_proj"], e), strict=True)]
        w2 = split_experts(blocks[p + "down_proj"], e)
        h, inter = config.hidden_size, config.moe_intermediate_size
        if tuple(w13[0].codes.shape) != (2 * inter, h) or tuple(w2[0].codes.shape) != (h, inter):
            raise ModelLoadError(f"layer {i}: expert blocks of shapes {list(w13[0].codes.shape)} and "
                                 f"{list(w2[0].codes.shape)}, the layer's are [{2 * inter}, {h}] and [{h}, {inter}]")
        module.layers[i].experts = W4A8Gemma4Experts(w13, w2)
    for name, sources in linear_sources(config).items():
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        old = getattr(parent, child)
        weight = concat([blocks[source] for source in sources])
        if tuple(weight.codes.shape) != (old.out_features, old.in_features):
            raise ModelLoadError(f"{name}: blocks of shape {list(weight.codes.shape)}, the layer is "
                                 f"[{old.out_features}, {old.in_features}]")
        setattr(parent, child, W4A8Linear(weight, old.bias))
    return module
