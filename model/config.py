"""The one configuration every supported checkpoint is mapped onto.

Hugging Face `config.json` files and GGUF metadata both end up as a `ModelConfig`, so the decoder in
`model/llama.py` never needs to know where its weights came from.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Families that share the Llama decoder. Differences are flags on the config, not subclasses:
#   llama, mistral: plain;  qwen2: q/k/v biases;  qwen3: per-head RMSNorm on q and k;
#   gemma3: q/k norms, GeGLU, norms before and after attention and the MLP, a scaled embedding, and
#   sliding-window layers (their own RoPE base) between full-attention ones;
#   smollm3: layers without rotary embeddings (NoPE) among the rotary ones;
#   phi3 (Phi-3, Phi-3.5, Phi-4, Phi-4-mini): q/k/v and gate/up fused in the checkpoint, rotary over part of
#   each head (Phi-4-mini's 3/4), LongRoPE's per-frequency factors and cos/sin scale;
#   gemma4: Gemma 3's layers with a head size and KV heads of their own in the full-attention layers (whose
#   values may be their keys), values normalised, proportional RoPE, a scale on each layer's output, and in the
#   small models (E2B, E4B) per-layer token embeddings and layers that read an earlier layer's cache;
#   qwen3_moe (q/k norms), mixtral: sparse mixture-of-experts MLPs (model/moe.py);
#   gpt_oss (GPT-OSS): every MLP a mixture of experts with biases and a clamped SwiGLU, a router with a bias,
#   attention with biases (its output's too) and a sink logit per head, sliding-window layers between full ones;
#   qwen3_5 (Qwen3.5; qwen3_5_moe, its mixtures of experts with a shared expert): three linear-attention layers
#   (a gated delta rule over a state per sequence, model/linear_attention.py) to one of attention, whose output
#   is gated and whose heads rotate a quarter of their dims; every norm scales by (1 + w), as Gemma's;
#   qwen3_next (Qwen3-Next): Qwen3.5-MoE's layers before it, its checkpoints' linear-attention projections fused
#   per key head (`in_proj_qkvz`, `in_proj_ba`: model/weights.py split_qwen3_5 reads them apart).
MOE_ARCHITECTURES = ("qwen3_moe", "mixtral", "gpt_oss", "qwen3_5_moe", "qwen3_next")
# Qwen3.5's layers (linear attention beside gated attention), with dense MLPs or with experts beside a shared one.
QWEN3_5_ARCHITECTURES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "gemma4", "smollm3", "phi3", "qwen3_5",
                           *MOE_ARCHITECTURES)
# Hugging Face `model_type` -> architecture, where the two differ (a Gemma 3 text checkpoint says gemma3_text).
HF_MODEL_TYPES = {"gemma3_text": "gemma3", "gemma4_text": "gemma4", "ministral3": "mistral", "qwen3_5_text": "qwen3_5",
                  "qwen3_5_moe_text": "qwen3_5_moe"}
# A Gemma 3 text config's fields where its config.json leaves them out (transformers' Gemma3TextConfig
# defaults, which the multimodal checkpoints' text_config relies on).
GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 131_072, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1,
}
# Gemma4TextConfig's defaults, for a config.json that leaves fields out (transformers fills them so).
GEMMA4_TEXT_DEFAULTS = {
    "vocab_size": 262_144, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 30,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 131_072, "sliding_window": 512, "tie_word_embeddings": True, "bos_token_id": 2,
    "eos_token_id": 1, "hidden_size_per_layer_input": 256, "vocab_size_per_layer_input": 262_144,
}
# What a layer's `layer_types` entry may be (Hugging Face's names).
LAYER_TYPES = ("full_attention", "sliding_attention")
ACTIVATIONS = ("silu", "gelu_tanh")


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1/3.2 frequency scaling (`rope_type: llama3`). Other types are rejected at load."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class YarnScaling:
    """YaRN (`rope_type: yarn`; Qwen 2.5/3 and SmolLM3 past their trained context): each pair's frequency
    between its interpolated (divided by `factor`) and its original value, by where its wavelength falls
    between `beta_fast` and `beta_slow` rotations over the original context; cos and sin are scaled by
    ModelConfig.rope_attention_factor (0.1 ln(factor) + 1 unless given)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True  # the ramp's ends rounded out to whole pairs (transformers' default; llama.cpp's)


def yarn_attention_factor(factor: float, mscale: float = 1.0) -> float:
    """YaRN's default scale of cos and sin: 0.1 mscale ln(factor) + 1 (1 for no growth)."""
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    rope_scaling: RopeScaling | None = None
    # GGUF files store Llama 3 scaling as per-frequency divisors (llama.cpp's `rope_freqs` tensor)
    # instead of the four numbers above; either describes the same rotation.
    rope_freq_factors: tuple[float, ...] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Per layer, "full_attention" or "sliding_attention" (Gemma 3: five windowed layers to one full); None:
    # every layer alike, windowed when sliding_window is set (Mistral).
    layer_types: tuple[str, ...] | None = None
    # RoPE base of the sliding-window layers when it differs from the full ones' (Gemma 3: 10,000 and 1e6).
    rope_local_theta: float | None = None
    # Linear position scaling (`rope_type: linear`) of the full-attention layers: angles divided by it.
    rope_linear_factor: float | None = None
    hidden_act: str = "silu"  # the MLP's gate: silu(gate) * up (SwiGLU) or gelu_tanh(gate) * up (GeGLU)
    # Gemma: RMSNorm after attention and after the MLP too, before each adds into the residual stream.
    sandwich_norms: bool = False
    embedding_scale: float | None = None  # the token embeddings are multiplied by it (Gemma: sqrt(hidden))
    # q @ k^T is scaled by query_pre_attn_scalar ** -0.5 (Gemma); None: head_dim ** -0.5.
    query_pre_attn_scalar: float | None = None
    # logits = cap * tanh(logits / cap) (Gemma 2's final softcap); None: none.
    final_logit_softcapping: float | None = None
    # Mixture of experts (MOE_ARCHITECTURES; 0 experts: every MLP dense). A sparse layer routes each token to
    # num_experts_per_tok of num_experts SwiGLU experts of width moe_intermediate_size; the layers listed in
    # dense_layers keep a dense MLP of intermediate_size (Qwen3-MoE's mlp_only_layers, decoder_sparse_step).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1
    dense_layers: tuple[int, ...] = ()
    # A shared expert beside each sparse layer's routed ones (Qwen3.5-MoE): a SwiGLU MLP of this width every token
    # goes through, its output scaled by the sigmoid of a gate of its own (hidden -> 1); 0: none.
    shared_expert_intermediate_size: int = 0
    # Layers whose attention rotates neither queries nor keys (NoPE: SmolLM3's every fourth).
    nope_layers: tuple[int, ...] = ()
    # The first rotary_dim of each head's dims rotate, the rest pass (Phi-4-mini: 3/4); None: all of them.
    rotary_dim: int | None = None
    # LongRoPE (Phi-3.5, Phi-4-mini): rope_freq_factors are its short factors, these its long ones, taken
    # when the context served exceeds rope_original_max_position_embeddings; cos and sin are scaled by
    # rope_attention_factor either way.
    rope_long_freq_factors: tuple[float, ...] | None = None
    rope_original_max_position_embeddings: int | None = None
    rope_attention_factor: float | None = None  # LongRoPE's and YaRN's scale of cos and sin
    rope_yarn: YarnScaling | None = None
    # Llama 4's attention temperature (Ministral 3): queries scaled by 1 + beta ln(1 + floor(position / length)),
    # which is 1 below `length` tokens. ladder serves such a model up to `length` (engine/config.py).
    attention_temperature_beta: float | None = None
    attention_temperature_length: int | None = None
    # Gemma 4. The full-attention layers' head size and KV heads when they differ from the sliding ones' (31B:
    # 512 and 4 against 256 and 16); with attention_k_eq_v those layers' values are their keys' projection.
    global_head_dim: int | None = None
    global_num_kv_heads: int | None = None
    attention_k_eq_v: bool = False
    value_norm: bool = False  # values RMS-normalised (no weight) before they are cached
    # Proportional RoPE of the full-attention layers: the first proportion of each head's pairs rotate, at the
    # frequencies of the whole head; the rest have frequency 0. None: every pair rotates.
    rope_proportion: float | None = None
    layer_scalars: bool = False  # each layer's output (residual stream included) times its own scalar
    # Per-layer embeddings (E2B, E4B): a [per_layer_vocab_size, num_layers * per_layer_input_size] table
    # gives each token a per_layer_input_size vector per layer that gates into that layer's output.
    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0
    # The last kv_shared_layers layers compute no keys or values: each reads the cache of the last earlier
    # layer of its kind (`kv_source`); with double_wide_shared_mlp their MLPs are twice intermediate_size.
    kv_shared_layers: int = 0
    double_wide_shared_mlp: bool = False
    # Gemma 4's mixture of experts (26B-A4B): every layer keeps its dense MLP and adds num_experts GeGLU experts
    # beside it (`Gemma4Router`, `Gemma4Experts` in model/moe.py), their outputs normed and summed.
    experts_beside_mlp: bool = False
    # GPT-OSS. Each query head's softmax has a learned sink logit (`self_attn.sinks`); the attention's output
    # projection has a bias; the experts (and their router) have biases and a clamped SwiGLU:
    # (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit) (`GptOssMoeBlock`).
    attention_sinks: bool = False
    output_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.0
    # Qwen3.5. The layers whose token mixer is a gated delta rule (model/linear_attention.py) instead of attention:
    # a fixed-size state per sequence in place of a KV cache. Their heads: linear_key_heads of linear_key_dim
    # (queries and keys), linear_value_heads of linear_value_dim; a causal convolution of linear_conv_kernel taps
    # over the projected queries, keys and values before them.
    linear_layers: tuple[int, ...] = ()
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    linear_conv_kernel: int = 0
    # The value heads' order when there are more of them than key heads: grouped by the key head they read
    # (Hugging Face's: value head j reads key head j // (Hv / Hk)) or tiled (llama.cpp's GGUF files: j % Hk).
    linear_heads_tiled: bool = False
    # Attention's output (before o_proj) times the sigmoid of a gate the query projection makes per head.
    attention_output_gate: bool = False

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unknown architecture {self.architecture!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not 0 < self.rotary_dims <= self.head_dim or self.rotary_dims % 2:
            raise ValueError(f"rotary_dim must be even and in (0, head_dim={self.head_dim}], got {self.rotary_dim}")
        for factors in (self.rope_freq_factors, self.rope_long_freq_factors):
            if factors is not None and len(factors) != self.rotary_dims // 2:
                raise ValueError(f"rope frequency factors have {len(factors)} entries, expected "
                                 f"rotary_dim/2 = {self.rotary_dims // 2}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
            unknown = set(self.layer_types) - set(LAYER_TYPES)
            if unknown:
                raise ValueError(f"unknown layer type {min(unknown)!r} (supported: {', '.join(LAYER_TYPES)})")
            if "sliding_attention" in self.layer_types and not self.sliding_window:
                raise ValueError("layer_types names sliding_attention layers but sliding_window is not set")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r} (supported: {', '.join(ACTIVATIONS)})")
        if (self.num_experts > 0) != (self.architecture in MOE_ARCHITECTURES or self.experts_beside_mlp):
            raise ValueError(f"{self.architecture} with num_experts={self.num_experts}: the mixture-of-experts "
                             f"architectures ({', '.join(MOE_ARCHITECTURES)}) and Gemma 4's experts beside its MLPs "
                             "need experts, the others none")
        if self.experts_beside_mlp and self.architecture != "gemma4":
            raise ValueError("experts beside the MLP are Gemma 4's")
        if (self.swiglu_limit is not None) != (self.architecture == "gpt_oss"):
            raise ValueError("the clamped SwiGLU experts (swiglu_limit) are GPT-OSS's, and GPT-OSS's experts have one")
        if self.num_experts and not (0 < self.num_experts_per_tok <= self.num_experts
                                     and self.moe_intermediate_size > 0):
            raise ValueError(f"num_experts_per_tok must be in 1..{self.num_experts} and moe_intermediate_size "
                             f"positive, got {self.num_experts_per_tok} and {self.moe_intermediate_size}")
        if any(not 0 <= i < self.num_layers for i in self.dense_layers):
            raise ValueError(f"dense_layers {list(self.dense_layers)} outside 0..{self.num_layers - 1}")
        if any(not 0 <= i < self.num_layers for i in self.nope_layers):
            raise ValueError(f"nope_layers {list(self.nope_layers)} outside 0..{self.num_layers - 1}")
        if self.nope_layers and (self.layer_types is not None or self.sliding_window):
            raise ValueError("layers without rotary embeddings beside sliding-window ones are not supported")
        if not 0 <= self.kv_shared_layers < self.num_layers:
            raise ValueError(f"kv_shared_layers must be in 0..{self.num_layers - 1}, got {self.kv_shared_layers}")
        for i in range(self.num_layers):
            if self.num_heads % self.layer_kv_heads(i) or self.layer_head_dim(i) % 2:
                raise ValueError(f"layer {i}: {self.num_heads} heads over {self.layer_kv_heads(i)} KV heads of "
                                 f"{self.layer_head_dim(i)} dims (a multiple, and even dims, are needed)")
            self.kv_source(i)  # an earlier layer of its kind must hold the cache a shared layer reads
        if self.per_layer_input_size and self.per_layer_vocab_size <= 0:
            raise ValueError("per-layer embeddings need per_layer_vocab_size")
        if any(not 0 <= i < self.num_layers for i in self.linear_layers):
            raise ValueError(f"linear_layers {list(self.linear_layers)} outside 0..{self.num_layers - 1}")
        if self.linear_layers and not (min(self.linear_key_heads, self.linear_key_dim, self.linear_value_dim) > 0
                                       and self.linear_value_heads % self.linear_key_heads == 0
                                       and self.linear_conv_kernel >= 2):
            raise ValueError("linear-attention layers need key and value heads (values a multiple of keys), their "
                             "dims and a convolution of at least 2 taps")

    def is_linear_layer(self, layer: int) -> bool:
        """Whether `layer` mixes tokens with a gated delta rule over a recurrent state (Qwen3.5), not attention."""
        return layer in self.linear_layers

    @property
    def linear_state_size(self) -> int:
        """float32 numbers of one sequence's state in one linear-attention layer: the convolution's last
        linear_conv_kernel - 1 inputs, then each value head's [linear_key_dim, linear_value_dim] matrix."""
        channels = 2 * self.linear_key_heads * self.linear_key_dim + self.linear_value_heads * self.linear_value_dim
        matrices = self.linear_value_heads * self.linear_key_dim * self.linear_value_dim
        return (self.linear_conv_kernel - 1) * channels + matrices

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of `layer` (the keys a query sees, counted back from its own position); None:
        the whole context."""
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def windowed_layers(self) -> int:
        """How many layers see a sliding window (all of them in a Mistral with one, 15 of 18 in Gemma 3 270M)."""
        return sum(self.layer_window(i) is not None for i in range(self.num_layers))

    def is_full_layer(self, layer: int) -> bool:
        """Whether `layer` is a full-attention layer among sliding-window ones (Gemma's every sixth)."""
        return self.layer_types is not None and self.layer_types[layer] == "full_attention"

    def layer_head_dim(self, layer: int) -> int:
        return self.global_head_dim if self.global_head_dim and self.is_full_layer(layer) else self.head_dim

    def layer_kv_heads(self, layer: int) -> int:
        return self.global_num_kv_heads if self.global_num_kv_heads and self.is_full_layer(layer) else self.num_kv_heads

    def layer_shares_values(self, layer: int) -> bool:
        """Whether `layer`'s values are its keys' projection (no v_proj; Gemma 4's full-attention layers)."""
        return self.attention_k_eq_v and self.is_full_layer(layer)

    def layer_projections(self, layer: int) -> str:
        """The projections `layer`'s qkv_proj fuses, in order: "qkv"; "qk" when its values are its keys
        (`layer_shares_values`); "q" when it reads an earlier layer's cache (`kv_source`)."""
        if self.kv_source(layer) != layer:
            return "q"
        return "qk" if self.layer_shares_values(layer) else "qkv"

    def layer_intermediate_size(self, layer: int) -> int:
        shared = self.kv_source(layer) != layer
        return self.intermediate_size * (2 if self.double_wide_shared_mlp and shared else 1)

    def kv_source(self, layer: int) -> int:
        """The layer whose KV cache `layer` reads: itself, or for one of the last kv_shared_layers the last
        layer of its kind before them (its keys and values, computed once, serve both)."""
        first_shared = self.num_layers - self.kv_shared_layers
        if layer < first_shared:
            return layer
        kind = self.is_full_layer(layer)
        for source in range(first_shared - 1, -1, -1):
            if self.is_full_layer(source) == kind:
                return source
        raise ValueError(f"layer {layer} shares the cache of an earlier layer of its kind, and there is none")

    @property
    def layers_alike(self) -> bool:
        """Whether every layer has the same attention shape and cache of its own, and no per-layer inputs:
        what the C++ step, tensor parallelism and the exporters assume."""
        return (self.global_head_dim in (None, self.head_dim) and self.global_num_kv_heads in (None, self.num_kv_heads)
                and not self.linear_layers and not self.attention_k_eq_v and not self.kv_shared_layers
                and not self.per_layer_input_size
                and not self.layer_scalars and not self.value_norm and not self.experts_beside_mlp)

    def require_alike_layers(self, what: str) -> None:
        """ValueError (one line) when `what` needs layers alike (`layers_alike`) and this model's differ, or
        attention without sink logits (GPT-OSS's run in the eager layers of one process only)."""
        if not self.layers_alike:
            raise ValueError(f"{what} is not supported for {self.architecture}, whose layers differ in shape or kind, "
                             "share caches or take per-layer inputs")
        if self.attention_sinks:
            raise ValueError(f"{what} is not supported for {self.architecture}, whose attention has sink logits "
                             "(served by one process's eager layers)")

    def is_sparse_layer(self, layer: int) -> bool:
        """Whether `layer`'s MLP is a mixture of experts (model/moe.py) rather than a dense one (Gemma 4's
        experts come beside its dense MLP: `experts_beside_mlp`)."""
        return self.num_experts > 0 and layer not in self.dense_layers and not self.experts_beside_mlp

    @property
    def rotary_dims(self) -> int:
        """How many of each head's dims rotate."""
        return self.rotary_dim or self.head_dim

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able fields; `from_dict` reads them back (artifacts store their config this way)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelConfig:
        fields = dict(data)
        if fields.get("rope_scaling") is not None:
            fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
        if fields.get("rope_yarn") is not None:
            fields["rope_yarn"] = YarnScaling(**fields["rope_yarn"])
        for name in ("rope_freq_factors", "rope_long_freq_factors", "layer_types", "dense_layers", "nope_layers",
                     "linear_layers"):
            if fields.get(name) is not None:
                fields[name] = tuple(fields[name])
        fields["eos_token_ids"] = tuple(fields.get("eos_token_ids") or ())
        return cls(**fields)

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> ModelConfig:
        """Map a Hugging Face `config.json` (transformers 4.x or 5.x spelling) onto a ModelConfig.

        Raises ValueError (or KeyError for a missing field) with a message the loader prefixes with
        the file name.
        """
        model_type = cfg.get("model_type")
        if model_type == "gemma3" and "text_config" in cfg:
            # A multimodal Gemma 3 (4B and up): its language model is a Gemma 3 text model (the decoder never
            # reads the vision tower's tensors, hf_checkpoint.py; the tower is model/vision.py's).
            text = {**{k: cfg[k] for k in ("bos_token_id", "eos_token_id", "tie_word_embeddings") if k in cfg},
                    **cfg["text_config"], "model_type": "gemma3_text"}
            return cls.from_hf(text)
        if model_type == "gemma4" and "text_config" in cfg:  # every Gemma 4: its text model beside its towers
            text = {**{k: cfg[k] for k in ("tie_word_embeddings",) if k in cfg}, **cfg["text_config"],
                    "model_type": "gemma4_text"}
            return cls.from_hf(text)
        if model_type == "mistral3" and "text_config" in cfg:
            # Mistral Small 3.1/3.2 and Ministral 3: a Mistral or Ministral 3 text model beside a Pixtral tower
            # (not read: images to these are refused as for any text model).
            text = {**{k: cfg[k] for k in ("tie_word_embeddings",) if k in cfg}, **cfg["text_config"]}
            return cls.from_hf({"model_type": "mistral", **text})
        if model_type in QWEN3_5_ARCHITECTURES and "text_config" in cfg:
            # Every Qwen3.5 checkpoint: its text model beside a vision tower (not read: images are refused).
            text = {**{k: cfg[k] for k in ("tie_word_embeddings",) if k in cfg}, **cfg["text_config"],
                    "model_type": f"{model_type}_text"}
            return cls.from_hf(text)
        if model_type in ("idefics3", "smolvlm") and "text_config" in cfg:
            # SmolVLM (Idefics3): a Llama-family text model with a vision tower beside it (model/vision.py).
            text = {**{k: cfg[k] for k in ("tie_word_embeddings",) if k in cfg}, **cfg["text_config"]}
            return cls.from_hf({"model_type": "llama", **text})
        if model_type == "gemma3_text":  # hub configs leave out the fields that keep their defaults
            cfg = {**GEMMA3_TEXT_DEFAULTS, **cfg}
        if model_type == "gemma4_text":
            cfg = {**GEMMA4_TEXT_DEFAULTS, **cfg}
        if model_type == "gpt_oss":
            cfg = _gpt_oss_defaults(cfg)
        arch = HF_MODEL_TYPES.get(model_type, model_type)
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unknown architecture model_type={model_type!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        hidden = int(cfg["hidden_size"])
        num_heads = int(cfg["num_attention_heads"])
        head_dim = cfg.get("head_dim") or hidden // num_heads
        extra: dict[str, Any] = {}
        if arch == "gemma3":
            rope, extra = _gemma3_fields(cfg, hidden)
        elif arch == "gemma4":
            rope, extra = _gemma4_fields(cfg, hidden)
        else:
            # transformers 5 moved rope_theta and rope_scaling into one `rope_parameters` dict.
            rope = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
        rope_theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = None
        if rope_type == "llama3":
            scaling = RopeScaling(
                factor=float(rope["factor"]),
                low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
            )
        elif rope_type == "linear":
            extra["rope_linear_factor"] = float(rope["factor"])
        elif rope_type == "proportional" and arch == "gemma4":
            extra["rope_proportion"] = float(rope.get("partial_rotary_factor", 1.0))
        elif rope_type in ("longrope", "su") and arch == "phi3":
            extra |= _longrope_fields(cfg, rope)
        elif rope_type == "yarn" and arch not in ("gemma3", "gemma4", "phi3"):
            extra |= _yarn_fields(cfg, rope)
        elif rope_type not in ("default", None):
            raise ValueError(f"unsupported rope_type {rope_type!r} (supported: default, linear, llama3, yarn; "
                             "longrope for phi3)")
        if rope.get("llama_4_scaling_beta"):  # Ministral 3's attention temperature, past its original context
            extra["attention_temperature_beta"] = float(rope["llama_4_scaling_beta"])
            extra["attention_temperature_length"] = int(rope["original_max_position_embeddings"])
        if arch in QWEN3_5_ARCHITECTURES:
            extra |= _qwen3_5_fields(cfg)
        if arch in ("phi3", *QWEN3_5_ARCHITECTURES):
            default = 0.25 if arch in QWEN3_5_ARCHITECTURES else 1.0  # (transformers' default for Qwen3.5)
            partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", default)))
            if partial != 1.0:
                extra["rotary_dim"] = int(int(head_dim) * partial)
        sliding_window = cfg.get("sliding_window")
        if arch in ("qwen2", "qwen3", "qwen3_moe") and not cfg.get("use_sliding_window", False):
            sliding_window = None
        if arch in MOE_ARCHITECTURES:
            extra |= _moe_fields(cfg, arch)
        if arch == "gpt_oss":
            extra |= {"layer_types": tuple(cfg["layer_types"]), "attention_sinks": True,
                      "output_bias": bool(cfg["attention_bias"]), "swiglu_limit": float(cfg["swiglu_limit"]),
                      "swiglu_alpha": float(cfg["swiglu_alpha"])}
        if arch == "smollm3":
            extra["nope_layers"] = _smollm3_nope_layers(cfg)
            if cfg.get("use_sliding_window"):
                raise ValueError("SmolLM3 with use_sliding_window is not supported")
            sliding_window = None
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            # (Qwen3.5-MoE has no dense MLP: its experts' width stands in)
            intermediate_size=int(cfg["intermediate_size"] if arch != "qwen3_5_moe" else
                                  cfg.get("intermediate_size") or extra["moe_intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2's q/k/v projections always carry biases; its config has no flag for it.
            attention_bias=True if arch == "qwen2" else bool(cfg.get("attention_bias", False)),
            qk_norm=arch in ("qwen3", "gemma3", "gemma4", "qwen3_moe", *QWEN3_5_ARCHITECTURES),
            sliding_window=int(sliding_window) if sliding_window else None,
            rope_scaling=scaling,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            **extra,
        )


def _gemma3_fields(cfg: Mapping[str, Any], hidden: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """A Gemma 3 text config's full-attention RoPE parameters, and the ModelConfig fields only Gemma sets.

    transformers 5 writes `rope_parameters` per layer type; 4.x wrote rope_theta, rope_local_base_freq and
    a rope_scaling that applies to the full-attention layers only."""
    if cfg.get("attn_logit_softcapping") is not None:
        raise ValueError("attn_logit_softcapping is not supported")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention (an encoder) is not supported")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"unsupported hidden_activation {act!r} (Gemma 3: gelu_pytorch_tanh)")
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params:
        full = dict(params["full_attention"])
        local = dict(params.get("sliding_attention") or {})
    else:
        full = {**(cfg.get("rope_scaling") or {}), "rope_theta": cfg.get("rope_theta", 1_000_000.0)}
        local = {"rope_theta": cfg.get("rope_local_base_freq", 10_000.0)}
    num_layers = int(cfg["num_hidden_layers"])
    layer_types = cfg.get("layer_types")
    if layer_types is None:  # transformers 4.x: every sliding_window_pattern-th layer is a full one
        pattern = int(cfg.get("sliding_window_pattern", 6))
        layer_types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]
    return full, _gemma_fields(cfg, hidden, layer_types, local) | {
        "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar", 256))}


def _gemma_fields(cfg: Mapping[str, Any], hidden: int, layer_types: Sequence[str],
                  local: Mapping[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields Gemma 3 and Gemma 4 share: layer kinds, the sliding-window layers' RoPE (`local`,
    unscaled), GeGLU, sandwich norms, the scaled embedding, the final logit cap."""
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"unsupported rope_type {local['rope_type']!r} for the sliding-window layers")
    softcap = cfg.get("final_logit_softcapping")
    return {
        "layer_types": tuple(layer_types),
        "rope_local_theta": float(local.get("rope_theta", 10_000.0)),
        "hidden_act": "gelu_tanh",
        "sandwich_norms": True,
        "embedding_scale": hidden**0.5,
        "final_logit_softcapping": float(softcap) if softcap else None,
    }


def _gemma4_fields(cfg: Mapping[str, Any], hidden: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """A Gemma 4 text config's full-attention RoPE parameters and its ModelConfig fields: Gemma 3's (the
    attention unscaled: its q/k norms set the scale) and Gemma 4's own."""
    if cfg.get("use_bidirectional_attention") == "all":
        raise ValueError("use_bidirectional_attention 'all' (an encoder) is not supported")
    experts: dict[str, Any] = {}
    if cfg.get("enable_moe_block"):  # 26B-A4B: experts beside every layer's dense MLP
        experts = {"experts_beside_mlp": True, "num_experts": int(cfg["num_experts"]),
                   "num_experts_per_tok": int(cfg["top_k_experts"]),
                   "moe_intermediate_size": int(cfg["moe_intermediate_size"]), "norm_topk_prob": True}
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"unsupported hidden_activation {act!r} (Gemma 4: gelu_pytorch_tanh)")
    num_layers = int(cfg["num_hidden_layers"])
    layer_types = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(num_layers)]
    layer_types = [*layer_types[:-1], "full_attention"]  # transformers forces the last layer to full attention
    k_eq_v = bool(cfg.get("attention_k_eq_v", False))
    if "per_layer_config" in cfg:  # transformers 5 writes the full-attention layers' overrides there
        head_dim = kv_heads = None
        for index, override in cfg["per_layer_config"].items():
            if set(override) - {"head_dim", "num_key_value_heads"} or layer_types[int(index)] != "full_attention":
                raise ValueError(f"per_layer_config of layer {index}: only the full-attention layers' head_dim "
                                 f"and num_key_value_heads may differ, got {sorted(override)}")
            for name, value in (("head_dim", head_dim), ("num_key_value_heads", kv_heads)):
                if name in override and value is not None and override[name] != value:
                    raise ValueError(f"per_layer_config: full-attention layers with different {name}s")
            head_dim = override.get("head_dim", head_dim)
            kv_heads = override.get("num_key_value_heads", kv_heads)
    else:  # as transformers reads them: the global KV heads count only where attention_k_eq_v holds
        head_dim = cfg.get("global_head_dim", 512)
        kv_heads = cfg.get("num_global_key_value_heads") if k_eq_v else None
    params = cfg.get("rope_parameters") or {}
    full = dict(params.get("full_attention") or {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                 "rope_theta": 1_000_000.0})
    local = dict(params.get("sliding_attention") or {"rope_theta": 10_000.0})
    per_layer = int(cfg.get("hidden_size_per_layer_input") or 0)
    return full, _gemma_fields(cfg, hidden, layer_types, local) | {
        "query_pre_attn_scalar": 1.0,  # scores are q . k unscaled
        "global_head_dim": int(head_dim) if head_dim else None,
        "global_num_kv_heads": int(kv_heads) if kv_heads else None,
        "attention_k_eq_v": k_eq_v,
        "value_norm": True,
        "layer_scalars": True,
        "per_layer_input_size": per_layer,
        "per_layer_vocab_size": int(cfg["vocab_size_per_layer_input"]) if per_layer else 0,
        "kv_shared_layers": int(cfg.get("num_kv_shared_layers") or 0),
        "double_wide_shared_mlp": bool(cfg.get("use_double_wide_mlp", False)),
        **experts,
    }


def _longrope_fields(cfg: Mapping[str, Any], rope: Mapping[str, Any]) -> dict[str, Any]:
    """LongRoPE's short and long per-frequency factors and its cos/sin scale, as transformers computes it:
    sqrt(1 + ln(factor) / ln(original context)), factor the context's growth (max_position_embeddings over
    original_max_position_embeddings) unless given."""
    original = int(rope.get("original_max_position_embeddings") or cfg["original_max_position_embeddings"])
    factor = rope.get("factor") or int(cfg.get("max_position_embeddings", original)) / original
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {"rope_freq_factors": tuple(float(x) for x in rope["short_factor"]),
            "rope_long_freq_factors": tuple(float(x) for x in rope["long_factor"]),
            "rope_original_max_position_embeddings": original, "rope_attention_factor": float(attention_factor)}


def _yarn_fields(cfg: Mapping[str, Any], rope: Mapping[str, Any]) -> dict[str, Any]:
    """YaRN as transformers reads it: factor (else the context's growth over the original one), the two
    betas (32 and 1 when absent or 0), truncate, and the attention factor: given, or from mscale and
    mscale_all_dim when both are, else 0.1 ln(factor) + 1."""
    original = int(rope["original_max_position_embeddings"])
    factor = float(rope.get("factor") or int(cfg.get("max_position_embeddings", original)) / original)
    attention_factor = rope.get("attention_factor")
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if attention_factor is None and mscale and mscale_all_dim:
        attention_factor = yarn_attention_factor(factor, float(mscale)) / yarn_attention_factor(factor, mscale_all_dim)
    if attention_factor is None:
        attention_factor = yarn_attention_factor(factor)
    yarn = YarnScaling(factor, original, float(rope.get("beta_fast") or 32.0), float(rope.get("beta_slow") or 1.0),
                       bool(rope.get("truncate", True)))
    return {"rope_yarn": yarn, "rope_attention_factor": float(attention_factor)}


def _gpt_oss_defaults(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """A GPT-OSS config.json with the fields it may leave out filled as transformers' GptOssConfig fills them:
    layers alternate sliding-window (first) and full attention, YaRN 32x over 4,096 tokens unrounded, biased
    attention, SwiGLU clamped at 7 with gain 1.702."""
    num_layers = int(cfg["num_hidden_layers"])
    rope = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    if not rope.get("rope_type", rope.get("type")):
        rope = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096, **rope}
    rope.setdefault("rope_theta", cfg.get("rope_theta", 150_000.0))
    return {"sliding_window": 128, "attention_bias": True, "swiglu_limit": 7.0, "swiglu_alpha": 1.702,
            "rms_norm_eps": 1e-5, "head_dim": 64, "max_position_embeddings": 131_072,
            "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)],
            **{k: v for k, v in cfg.items() if v is not None}, "rope_parameters": rope, "rope_scaling": None}


def _qwen3_5_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """A Qwen3.5 text config's linear-attention layers (layer_types, else every full_attention_interval-th layer
    attends) and their shapes. Its M-RoPE rotates a text token's three position ids alike: plain RoPE."""
    num_layers = int(cfg["num_hidden_layers"])
    kinds = cfg.get("layer_types")
    if kinds is None:
        interval = int(cfg.get("full_attention_interval", 4))
        kinds = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
    if len(kinds) != num_layers or set(kinds) - {"full_attention", "linear_attention"}:
        raise ValueError(f"layer_types must name full_attention or linear_attention for each of {num_layers} layers")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {cfg.get('hidden_act')!r} (Qwen3.5: silu)")
    return {"linear_layers": tuple(i for i, kind in enumerate(kinds) if kind == "linear_attention"),
            "linear_key_heads": int(cfg.get("linear_num_key_heads", 16)),
            "linear_value_heads": int(cfg.get("linear_num_value_heads", 32)),
            "linear_key_dim": int(cfg.get("linear_key_head_dim", 128)),
            "linear_value_dim": int(cfg.get("linear_value_head_dim", 128)),
            "linear_conv_kernel": int(cfg.get("linear_conv_kernel_dim", 4)),
            "attention_output_gate": True}


def _smollm3_nope_layers(cfg: Mapping[str, Any]) -> tuple[int, ...]:
    """The layers of a SmolLM3 config.json without rotary embeddings: `no_rope_layers` holds 1 for a layer
    that rotates, 0 for one that does not; without it, every `no_rope_layer_interval`-th layer (4) does not."""
    num_layers = int(cfg["num_hidden_layers"])
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = int(cfg.get("no_rope_layer_interval", 4))
        return tuple(i for i in range(num_layers) if (i + 1) % interval == 0)
    if len(flags) != num_layers:
        raise ValueError(f"no_rope_layers has {len(flags)} entries for {num_layers} layers")
    return tuple(i for i, rotates in enumerate(flags) if not rotates)


def _moe_fields(cfg: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """The mixture-of-experts fields of a Qwen3-MoE or Mixtral config.json.

    Mixtral's experts are intermediate_size wide, every layer sparse, weights always renormalised. Qwen3-MoE's
    are moe_intermediate_size wide; layer i is sparse unless listed in mlp_only_layers or (i + 1) is not a
    multiple of decoder_sparse_step, and those dense layers have an MLP of intermediate_size."""
    # transformers 5 writes num_local_experts for both (num_experts is its alias); the hub's Qwen3-MoE, num_experts.
    num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if arch == "gpt_oss":  # every layer sparse, experts intermediate_size wide, softmax over the top k's logits
        return {"num_experts": num_experts, "moe_intermediate_size": int(cfg["intermediate_size"]),
                "num_experts_per_tok": int(cfg.get("num_experts_per_tok") or cfg.get("experts_per_token") or 4),
                "norm_topk_prob": True}
    if arch == "mixtral":
        return {"num_experts": num_experts, "num_experts_per_tok": int(cfg.get("num_experts_per_tok", 2)),
                "moe_intermediate_size": int(cfg["intermediate_size"]), "norm_topk_prob": True}
    if arch == "qwen3_5_moe":  # every layer sparse, weights renormalised, a shared expert beside the routed ones
        return {"num_experts": num_experts, "num_experts_per_tok": int(cfg.get("num_experts_per_tok", 8)),
                "moe_intermediate_size": int(cfg.get("moe_intermediate_size", 512)), "norm_topk_prob": True,
                "shared_expert_intermediate_size": int(cfg.get("shared_expert_intermediate_size", 512))}
    if arch == "qwen3_next":  # a shared expert beside the routed ones; dense layers as Qwen3-MoE names them
        return {**_moe_fields({"norm_topk_prob": True, **cfg, "shared_expert_intermediate_size": 0}, "qwen3_moe"),
                "shared_expert_intermediate_size": int(cfg["shared_expert_intermediate_size"])}
    if cfg.get("shared_expert_intermediate_size"):
        raise ValueError("shared experts (Qwen2-MoE) are not supported")
    num_layers, step = int(cfg["num_hidden_layers"]), int(cfg.get("decoder_sparse_step") or 1)
    mlp_only = set(cfg.get("mlp_only_layers") or ())
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": int(cfg["num_experts_per_tok"]),
        "moe_intermediate_size": int(cfg["moe_intermediate_size"]),
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),  # transformers' default
        "dense_layers": tuple(i for i in range(num_layers) if i in mlp_only or (i + 1) % step),
    }
