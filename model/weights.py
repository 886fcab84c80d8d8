"""From named checkpoint tensors to a ready `LlamaForCausalLM`.

Both checkpoint readers (`hf_checkpoint.py`, `gguf_checkpoint.py`) produce tensors under Hugging Face's
names without the `model.` prefix (`layers.0.self_attn.q_proj.weight`, ...). This module checks every
tensor against the shape the config implies, fuses q/k/v and gate/up, and builds the module without
ever initialising random weights.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kernels.ops import select_ops
from model.config import ModelConfig
from model.errors import ModelLoadError
from model.llama import LlamaForCausalLM
from model.rope import inverse_frequencies


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor the config calls for, with its shape."""
    h, q, kv, inter = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "embed_tokens.weight": (config.vocab_size, h),
        "norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        }
        if config.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,)}
        if config.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (config.head_dim,),
                       p + "self_attn.k_norm.weight": (config.head_dim,)}
    return shapes


def check_tensors(config: ModelConfig, tensors: Mapping[str, torch.Tensor], source: str, config_name: str) -> None:
    """Raise ModelLoadError (one line, naming `source`) for a missing tensor or a contradicting shape."""
    for name, shape in expected_shapes(config).items():
        if name not in tensors:
            raise ModelLoadError(f"{source}: missing tensor {name!r} required by {config_name}")
        actual = tuple(tensors[name].shape)
        if actual != shape:
            raise ModelLoadError(
                f"{source}: tensor {name!r} has shape {list(actual)} but {config_name} implies {list(shape)}"
            )


def fuse(config: ModelConfig, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint names -> the module's state dict (q/k/v and gate/up concatenated)."""
    state = {"embed_tokens.weight": tensors["embed_tokens.weight"], "norm.weight": tensors["norm.weight"]}
    state["lm_head.weight"] = tensors["embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"]
    for i in range(config.num_layers):
        p = f"layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        state[p + "input_layernorm.weight"] = tensors[p + "input_layernorm.weight"]
        state[p + "post_attention_layernorm.weight"] = tensors[p + "post_attention_layernorm.weight"]
        state[attn + "qkv_proj.weight"] = torch.cat([tensors[attn + f"{x}_proj.weight"] for x in "qkv"])
        if config.attention_bias:
            state[attn + "qkv_proj.bias"] = torch.cat([tensors[attn + f"{x}_proj.bias"] for x in "qkv"])
        if config.qk_norm:
            state[attn + "q_norm.weight"] = tensors[attn + "q_norm.weight"]
            state[attn + "k_norm.weight"] = tensors[attn + "k_norm.weight"]
        state[attn + "o_proj.weight"] = tensors[attn + "o_proj.weight"]
        state[mlp + "gate_up_proj.weight"] = torch.cat([tensors[mlp + f"{x}_proj.weight"] for x in ("gate", "up")])
        state[mlp + "down_proj.weight"] = tensors[mlp + "down_proj.weight"]
    return state


def build_model(
    config: ModelConfig,
    tensors: Mapping[str, torch.Tensor],
    source: str,
    config_name: str,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    block_size: int = 16,
) -> LlamaForCausalLM:
    """Check, fuse and load `tensors` into a new module of `dtype` on `device`, in eval mode."""
    check_tensors(config, tensors, source, config_name)
    state = {name: t.to(device=device, dtype=dtype) for name, t in fuse(config, tensors).items()}
    # Build on the meta device: no memory is touched until the real tensors are assigned.
    with torch.device("meta"):
        module = LlamaForCausalLM(config, block_size=block_size, ops=select_ops(device))
    module.load_state_dict(state, strict=True, assign=True)
    if config.tie_word_embeddings:
        module.lm_head.weight = module.embed_tokens.weight
    # Buffers are not in the state dict; rebuild them on the real device.
    module.inv_freq = inverse_frequencies(config).to(device)
    return module.eval().requires_grad_(False)
