"""From named checkpoint tensors to a ready `LlamaForCausalLM`.

Both checkpoint readers (`hf_checkpoint.py`, `gguf_checkpoint.py`) produce tensors under Hugging Face's
names without the `model.` prefix (`layers.0.self_attn.q_proj.weight`, ...). This module checks every
tensor against the shape the config implies, fuses q/k/v and gate/up, and builds the module without
ever initialising random weights. The module's tensors are made one at a time: with a reader that makes
each checkpoint tensor when it is asked for (`LazyTensors`, the GGUF reader), host memory holds the built
part of the module plus one tensor's sources, not a second copy of the whole model.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping
from typing import TypeVar

import torch
from torch import nn

from kernels.ops import select_ops
from model.config import ModelConfig
from model.errors import ModelLoadError
from model.llama import LlamaForCausalLM
from model.moe_checkpoint import expert_shapes, expert_sources, stack_experts

# Gemma 4's norms around its experts: of their input, of the dense MLP's output and of theirs.
GEMMA4_EXPERT_NORMS = ("pre_feedforward_layernorm_2", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2")


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor the config calls for, with its shape."""
    h = config.hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        "embed_tokens.weight": (config.vocab_size, h),
        "norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    if config.per_layer_input_size:
        width = config.num_layers * config.per_layer_input_size
        shapes |= {"embed_tokens_per_layer.weight": (config.per_layer_vocab_size, width),
                   "per_layer_model_projection.weight": (width, h),
                   "per_layer_projection_norm.weight": (config.per_layer_input_size,)}
    for i in range(config.num_layers):
        p = f"layers.{i}."
        head_dim = config.layer_head_dim(i)
        q, kv = config.num_heads * head_dim, config.layer_kv_heads(i) * head_dim
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
        shapes |= mlp_shapes(config, i)
        if config.is_linear_layer(i):
            shapes |= linear_attention_shapes(config, p + "linear_attn.")
            continue
        shapes |= {p + "self_attn.q_proj.weight": (q, h), p + "self_attn.o_proj.weight": (h, q)}
        if config.attention_output_gate:
            shapes |= {p + "self_attn.q_gate_proj.weight": (q, h)}
        own_kv = config.kv_source(i) == i  # a layer that reads an earlier layer's cache has no k/v of its own
        kinds = config.layer_projections(i)[1:]
        shapes |= {p + f"self_attn.{x}_proj.weight": (kv, h) for x in kinds}
        if config.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,)} | {p + f"self_attn.{x}_proj.bias": (kv,) for x in kinds}
        if config.output_bias:
            shapes |= {p + "self_attn.o_proj.bias": (h,)}
        if config.attention_sinks:
            shapes |= {p + "self_attn.sinks": (config.num_heads,)}
        if config.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (head_dim,)}
            if own_kv:
                shapes |= {p + "self_attn.k_norm.weight": (head_dim,)}
        if config.sandwich_norms:
            shapes |= {p + "pre_feedforward_layernorm.weight": (h,), p + "post_feedforward_layernorm.weight": (h,)}
        if config.layer_scalars:
            shapes |= {p + "layer_scalar": (1,)}
        if config.experts_beside_mlp:
            e, moe = config.num_experts, config.moe_intermediate_size
            shapes |= {p + "router.proj.weight": (e, h), p + "router.scale": (h,), p + "router.per_expert_scale": (e,),
                       p + "experts.gate_up_proj": (e, 2 * moe, h), p + "experts.down_proj": (e, h, moe)}
            shapes |= {p + f"{norm}.weight": (h,) for norm in GEMMA4_EXPERT_NORMS}
        if config.per_layer_input_size:
            shapes |= {p + "per_layer_input_gate.weight": (config.per_layer_input_size, h),
                       p + "per_layer_projection.weight": (h, config.per_layer_input_size),
                       p + "post_per_layer_input_norm.weight": (h,)}
    return shapes


def mlp_shapes(config: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    """Layer i's MLP tensors: gate, up and down, or the stacked experts of a sparse layer (model/moe_checkpoint.py)
    and its shared expert and gate (Qwen3.5-MoE)."""
    p, h, inter = f"layers.{i}.", config.hidden_size, config.layer_intermediate_size(i)
    if not config.is_sparse_layer(i):
        return {p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter)}
    shapes = expert_shapes(config, i)
    if config.shared_expert_intermediate_size:
        shared = config.shared_expert_intermediate_size
        shapes |= {p + "mlp.shared_expert.gate_proj.weight": (shared, h), p + "mlp.shared_expert.up_proj.weight":
                   (shared, h), p + "mlp.shared_expert.down_proj.weight": (h, shared),
                   p + "mlp.shared_expert_gate.weight": (1, h)}
    return shapes


def linear_attention_shapes(config: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    """A linear-attention layer's checkpoint tensors (Qwen3.5's `linear_attn.*`) and their shapes."""
    h, heads = config.hidden_size, config.linear_value_heads
    keys, values = config.linear_key_heads * config.linear_key_dim, heads * config.linear_value_dim
    channels = 2 * keys + values
    return {prefix + "in_proj_qkv.weight": (channels, h), prefix + "in_proj_z.weight": (values, h),
            prefix + "in_proj_b.weight": (heads, h), prefix + "in_proj_a.weight": (heads, h),
            prefix + "conv1d.weight": (channels, 1, config.linear_conv_kernel), prefix + "dt_bias": (heads,),
            prefix + "A_log": (heads,), prefix + "norm.weight": (config.linear_value_dim,),
            prefix + "out_proj.weight": (h, values)}


T = TypeVar("T")


class LazyTensors(Mapping[str, T]):
    """Checkpoint tensors by name whose shapes are known up front and whose data is made when a tensor is
    asked for, afresh each time (nothing is kept): a reader's dequantization runs tensor by tensor."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], read: Callable[[str], T]) -> None:
        self.shapes = shapes
        self._read = read

    def __getitem__(self, name: str) -> T:
        if name not in self.shapes:
            raise KeyError(name)
        return self._read(name)

    def __contains__(self, name: object) -> bool:  # without reading the tensor
        return name in self.shapes

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def shift_norm_weights(tensors: LazyTensors[torch.Tensor]) -> LazyTensors[torch.Tensor]:
    """Gemma's and Qwen3.5's RMSNorm scale by (1 + w) and their checkpoints store w; the decoder's RMSNorm scales
    by its weight, so each norm weight is read as 1 + w, in float32. (GGUF files store 1 + w already.) Qwen3.5's
    linear-attention output norm scales by its weight itself."""
    def read(name: str) -> torch.Tensor:
        shifted = name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight")
        return tensors[name].float() + 1.0 if shifted else tensors[name]

    return LazyTensors(tensors.shapes, read)


def rotary_order(config: ModelConfig) -> torch.Tensor:
    """With a rotary part of each head (`rotary_dim`), the order [head_dim] in which a head's dims are read so
    the rotated pairs (j, j + rotary_dim / 2) sit at (j, j + head_dim / 2), where the decoder's rotation pairs
    them, and the passing dims fill the rest of both halves, paired at frequency 0 (model/rope.py): q . k is a
    sum over the dims, the same in any order both share (a per-dim norm weight is read in it too)."""
    head, rot = config.head_dim, config.rotary_dims
    passing = (head - rot) // 2
    # [rotated first half, passing first half, rotated second half, passing second half]
    return torch.cat([torch.arange(rot // 2), rot + torch.arange(passing),
                      rot // 2 + torch.arange(rot // 2), rot + passing + torch.arange(passing)])


def split_qwen3_5(config: ModelConfig, tensors: LazyTensors[T], shift_norms: bool = True,
                  take: Callable[[T, torch.Tensor], T] = lambda t, index: t.index_select(0, index)) -> LazyTensors[T]:
    """A Qwen3.5 checkpoint's tensors as the decoder reads them: each attention layer's q_proj, which holds each
    head's queries then its output gate, read as `q_proj` and `q_gate_proj`; queries, keys and their norms'
    weights in `rotary_order`; Qwen3-Next's linear-attention projections fused per key head (`qwen3_next_rows`)
    read as Qwen3.5's four; with `shift_norms`, norms as (1 + w) (a directory's: `shift_norm_weights`; a GGUF
    file holds 1 + w). `take(tensor, rows)` selects rows (a GGUF file's raw blocks take them their own way)."""
    if shift_norms:
        tensors = shift_norm_weights(tensors)
    heads, head = config.num_heads, config.head_dim
    order = rotary_order(config)
    # Rows of the checkpoint's q_proj: head h's queries at 2 h D + order, its gate at 2 h D + D ..
    starts = 2 * head * torch.arange(heads)[:, None]
    query_rows, gate_rows = (starts + order).flatten(), (starts + head + torch.arange(head)).flatten()
    shapes, sources = dict(tensors.shapes), {}
    for name in [n for n in tensors.shapes if n.endswith("self_attn.q_proj.weight")]:
        for part, rows in (("q_proj", query_rows), ("q_gate_proj", gate_rows)):
            shapes[name.replace("q_proj", part)] = (heads * head, tensors.shapes[name][1])
            sources[name.replace("q_proj", part)] = (name, rows)
    for fused, parts in qwen3_next_rows(config).items():
        for name in [n for n in tensors.shapes if n.endswith(f"linear_attn.{fused}.weight")]:
            for part, rows in parts.items():
                shapes[name.replace(fused, part)] = (len(rows), tensors.shapes[name][1])
                sources[name.replace(fused, part)] = (name, rows)
            del shapes[name]  # read through its parts only

    def read(name: str) -> T:
        if name in sources:
            whole, rows = sources[name]
            return take(tensors[whole], rows)
        tensor = tensors[name]
        if name.endswith("self_attn.k_proj.weight"):
            kv_heads = tensors.shapes[name][0] // head
            return take(tensor, (head * torch.arange(kv_heads)[:, None] + order).flatten())
        if name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
            return tensor[order]
        return tensor

    return LazyTensors(shapes, read)


def qwen3_next_rows(config: ModelConfig) -> dict[str, dict[str, torch.Tensor]]:
    """Qwen3-Next's fused linear-attention projections -> Qwen3.5's separate ones -> the fused rows that make each.
    `in_proj_qkvz` holds, for key head g, [q_g (Dk), k_g (Dk), v (r Dv), z (r Dv)] with r = Hv / Hk value heads a
    key head, those of heads g r .. g r + r - 1; `in_proj_ba`, for g, [b (r), a (r)]. Qwen3.5's in_proj_qkv is
    every q, then every k, then every v; in_proj_z every z; in_proj_b and in_proj_a one row a value head."""
    hk, hv, dk, dv = (config.linear_key_heads, config.linear_value_heads, config.linear_key_dim,
                      config.linear_value_dim)
    r = hv // max(hk, 1)
    group = 2 * dk + 2 * r * dv  # one key head's rows of in_proj_qkvz

    def rows(offset: int, width: int, stride: int = group) -> torch.Tensor:
        return (stride * torch.arange(hk)[:, None] + offset + torch.arange(width)).flatten()

    qkv = torch.cat([rows(0, dk), rows(dk, dk), rows(2 * dk, r * dv)])
    return {"in_proj_qkvz": {"in_proj_qkv": qkv, "in_proj_z": rows(2 * dk + r * dv, r * dv)},
            "in_proj_ba": {"in_proj_b": rows(0, r, 2 * r), "in_proj_a": rows(r, r, 2 * r)}}


def phi3_rows(config: ModelConfig) -> dict[str, tuple[str, torch.Tensor]]:
    """Phi-3's checkpoints fuse q/k/v (`qkv_proj`) and gate/up (`gate_up_proj`): each separate projection's
    name -> (its fused tensor's name, the rows of it that make it, in order). With a rotary part of each head
    (`rotary_dim`), q's and k's rows are reordered within each head so the rotated pairs (j, j + rotary_dim / 2)
    sit at (j, j + head_dim / 2), where the decoder's rotation pairs them, and the passing dims fill the rest of
    both halves, paired at frequency 0 (model/rope.py): q . k is a sum over the dims, the same in any order
    both share."""
    head, order = config.head_dim, rotary_order(config)  # row j of a head takes row order[j]

    def heads(start: int, count: int) -> torch.Tensor:
        return (start + head * torch.arange(count)[:, None] + order[None, :]).flatten()

    q, kv, ff = config.q_size, config.kv_size, config.intermediate_size
    return {"self_attn.q_proj": ("self_attn.qkv_proj", heads(0, config.num_heads)),
            "self_attn.k_proj": ("self_attn.qkv_proj", heads(q, config.num_kv_heads)),
            "self_attn.v_proj": ("self_attn.qkv_proj", q + kv + torch.arange(kv)),
            "mlp.gate_proj": ("mlp.gate_up_proj", torch.arange(ff)),
            "mlp.up_proj": ("mlp.gate_up_proj", ff + torch.arange(ff))}


def split_fused_phi3(config: ModelConfig, tensors: LazyTensors[T],
                     take: Callable[[T, torch.Tensor], T] = lambda t, index: t.index_select(0, index),
                     ) -> LazyTensors[T]:
    """A Phi-3 checkpoint's tensors with its fused projections read as the separate ones the other families'
    checkpoints hold (`phi3_rows`), each cut from its fused tensor when it is asked for: `take(fused, rows)`
    (a GGUF file's raw blocks take their rows their own way)."""
    shapes, sources = dict(tensors.shapes), {}
    for part, (whole, index) in phi3_rows(config).items():
        for name in [n for n in tensors.shapes if n.endswith(f"{whole}.weight")]:
            split = name.replace(whole, part)
            shapes[split] = (len(index), tensors.shapes[name][1])
            sources[split] = (name, index)
    for name, _ in sources.values():
        shapes.pop(name, None)  # the fused tensor itself is read through its parts only

    def read(name: str) -> T:
        if name in sources:
            whole, index = sources[name]
            return take(tensors[whole], index)
        return tensors[name]

    return LazyTensors(shapes, read)


def check_tensors(config: ModelConfig, tensors: Mapping[str, torch.Tensor], source: str, config_name: str) -> None:
    """Raise ModelLoadError (one line, naming `source`) for a missing tensor or a contradicting shape."""
    for name, shape in expected_shapes(config).items():
        if name not in tensors:
            raise ModelLoadError(f"{source}: missing tensor {name!r} required by {config_name}")
        actual = tensors.shapes[name] if isinstance(tensors, LazyTensors) else tuple(tensors[name].shape)
        if actual != shape:
            raise ModelLoadError(
                f"{source}: tensor {name!r} has shape {list(actual)} but {config_name} implies {list(shape)}"
            )


def fused_sources(config: ModelConfig) -> dict[str, list[str]]:
    """Each tensor of the module's state dict -> the checkpoint tensors it is made of, rows concatenated
    in order (q/k/v and gate/up fused). A tied LM head is left out: it is the embedding."""
    sources = {"embed_tokens.weight": ["embed_tokens.weight"], "norm.weight": ["norm.weight"]}
    if not config.tie_word_embeddings:
        sources["lm_head.weight"] = ["lm_head.weight"]
    if config.per_layer_input_size:
        for name in ("embed_tokens_per_layer.weight", "per_layer_model_projection.weight",
                     "per_layer_projection_norm.weight"):
            sources[name] = [name]
    for i in range(config.num_layers):
        p = f"layers.{i}."
        attn = p + "self_attn."
        sources |= mlp_sources(config, i)
        if config.is_linear_layer(i):  # Qwen3.5: its norms, MLP and linear attention (model/linear_attention.py)
            linear = p + "linear_attn."
            sources |= {name: [name] for name in (p + "input_layernorm.weight", p + "post_attention_layernorm.weight")}
            sources |= {linear + name: [linear + name] for name in ("conv1d.weight", "dt_bias", "A_log",
                                                                     "out_proj.weight")}
            sources[linear + "in_proj.weight"] = [linear + f"in_proj_{x}.weight" for x in ("qkv", "z", "b", "a")]
            sources[linear + "norm_weight"] = [linear + "norm.weight"]
            continue
        own = [p + "input_layernorm.weight", p + "post_attention_layernorm.weight", attn + "o_proj.weight"]
        if config.sandwich_norms:
            own += [p + "pre_feedforward_layernorm.weight", p + "post_feedforward_layernorm.weight"]
        if config.layer_scalars:
            own.append(p + "layer_scalar")
        if config.output_bias:
            own.append(attn + "o_proj.bias")
        if config.attention_sinks:
            own.append(attn + "sinks")
        if config.experts_beside_mlp:
            own += [p + name for name in ("router.proj.weight", "router.scale", "router.per_expert_scale",
                                          "experts.gate_up_proj", "experts.down_proj")]
            own += [p + f"{norm}.weight" for norm in GEMMA4_EXPERT_NORMS]
        if config.per_layer_input_size:
            own += [p + "per_layer_input_gate.weight", p + "per_layer_projection.weight",
                    p + "post_per_layer_input_norm.weight"]
        own_kv = config.kv_source(i) == i
        if config.qk_norm:
            own += [attn + "q_norm.weight"] + ([attn + "k_norm.weight"] if own_kv else [])
        sources |= {name: [name] for name in own}
        kinds = config.layer_projections(i)
        sources[attn + "qkv_proj.weight"] = [attn + f"{x}_proj.weight" for x in kinds]
        if config.attention_output_gate:  # the gates after the keys and values (model/llama.py `Attention`)
            sources[attn + "qkv_proj.weight"].append(attn + "q_gate_proj.weight")
        if config.attention_bias:
            sources[attn + "qkv_proj.bias"] = [attn + f"{x}_proj.bias" for x in kinds]
    return sources


def mlp_sources(config: ModelConfig, i: int) -> dict[str, list[str]]:
    """`fused_sources` of layer i's MLP: gate/up fused, or the router and stacked experts of a sparse layer
    (model/moe_checkpoint.py) and its shared expert (Qwen3.5-MoE's, on the layer beside the block)."""
    p = f"layers.{i}."
    mlp = p + "mlp."
    if not config.is_sparse_layer(i):
        return {mlp + "gate_up_proj.weight": [mlp + "gate_proj.weight", mlp + "up_proj.weight"],
                mlp + "down_proj.weight": [mlp + "down_proj.weight"]}
    sources = expert_sources(config, i)
    if config.shared_expert_intermediate_size:
        shared = mlp + "shared_expert."
        sources[p + "shared_expert.gate_up_proj.weight"] = [shared + "gate_proj.weight", shared + "up_proj.weight"]
        sources[p + "shared_expert.down_proj.weight"] = [shared + "down_proj.weight"]
        sources[p + "shared_expert_gate.weight"] = [mlp + "shared_expert_gate.weight"]
    return sources


def build_model(
    config: ModelConfig,
    tensors: Mapping[str, torch.Tensor],
    source: str,
    config_name: str,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    block_size: int = 16,
    skip: Collection[str] = frozenset(),
) -> LlamaForCausalLM:
    """Check, fuse and load `tensors` into a new module of `dtype` on `device`, in eval mode, one tensor
    at a time. The state-dict names in `skip` stay on the meta device, unread (a tied LM head untied), for
    a caller that replaces their modules next (`quantize_w4a8`, over a GGUF file's own blocks)."""
    if config.num_experts:
        tensors = stack_experts(config, tensors, source)
    check_tensors(config, tensors, source, config_name)
    # Build on the meta device: no memory is touched until the real tensors are assigned.
    with torch.device("meta"):
        module = LlamaForCausalLM(config, block_size=block_size, ops=select_ops(device))
    for name, parts in fused_sources(config).items():
        if name in skip:
            continue
        # A lazy reader makes the parts here; they are gone once concatenated (or cast).
        tensor = tensors[parts[0]] if len(parts) == 1 else torch.cat([tensors[part] for part in parts])
        owner_name, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        assert getattr(owner, leaf).shape == tensor.shape, name  # check_tensors checked the parts
        setattr(owner, leaf, nn.Parameter(tensor.to(device=device, dtype=dtype), requires_grad=False))
        del tensor
    if config.tie_word_embeddings and "lm_head.weight" not in skip:
        module.lm_head.weight = module.embed_tokens.weight
    unloaded = [name for name, p in module.named_parameters(remove_duplicate=False)
                if p.is_meta and name not in skip]
    assert not unloaded, f"fused_sources misses {unloaded}"
    # Buffers are not in the state dict; rebuild them on the real device.
    module.make_rotary(device)
    return module.eval().requires_grad_(False)
