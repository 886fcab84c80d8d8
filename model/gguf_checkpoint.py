"""Reading a GGUF file: its metadata mapped onto ModelConfig, and its tensors dequantized.

Dequantization (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K and the other types the `gguf` package
knows) is done by the `gguf` package in numpy. Names are mapped from llama.cpp's (`blk.0.attn_q.weight`)
to Hugging Face's (`layers.0.self_attn.q_proj.weight`).

The file itself is read by model/gguf_file.py. Linear weights of a quantized type can also be read as
blocks (`read_blocks`, model/gguf_blocks.py), for the W4A8 layers that compute on the file's own codes
(model/block_quantization.py).

`read_tensors` and `read_blocks` hand out one tensor at a time, made when it is asked for (`LazyTensors`),
so loading never holds a dequantized copy of the whole model beside the module being built.
"""

from __future__ import annotations

import collections
import logging
import re
import struct
from pathlib import Path
from typing import Any, TypeVar

import gguf
import numpy as np
import torch

from model.config import ModelConfig, YarnScaling, yarn_attention_factor
from model.errors import ModelLoadError, one_line
from model.gguf_blocks import FLOAT_TYPES, BlockWeight, block_weight, how_read, is_block_type, w4a8_bytes
from model.gguf_file import GGUFFile, GGUFTensor
from model.weights import LazyTensors, split_fused_phi3, split_qwen3_5

log = logging.getLogger(__name__)
T = TypeVar("T")

# GGUF architecture -> ModelConfig architecture. Mistral checkpoints are written as "llama".
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3", "gemma4": "gemma4",
                 "qwen3moe": "qwen3_moe", "smollm3": "smollm3", "phi3": "phi3", "mistral3": "mistral",
                 "gpt-oss": "gpt_oss", "qwen35": "qwen3_5", "qwen35moe": "qwen3_5_moe",
                 "qwen3next": "qwen3_next"}
# Phi-3's fused projections, whose rows model/weights.py `split_fused_phi3` cuts apart.
PHI3_FUSED_NAMES = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# Architectures whose q/k rows llama.cpp's converter permutes (its LlamaModel and the models built on it).
PERMUTED_ARCHITECTURES = ("llama", "smollm3", "mistral3")
# llama.cpp's SmolLM3: every fourth layer without rotary embeddings (a fixed step, not in the file).
SMOLLM3_NOPE_STEP = 4
# Mixtral checkpoints are written as "llama" too, with {arch}.expert_count > 0.

GLOBAL_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
    # Gemma 4's per-layer embeddings (E2B, E4B)
    "per_layer_token_embd.weight": "embed_tokens_per_layer.weight",
    "per_layer_model_proj.weight": "per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "per_layer_projection_norm.weight",
}
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # Mixture of experts: the router, and each projection of every expert as one [E, out, in] tensor
    # (model/moe_checkpoint.py stacks gate and up into the module's w13).
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_up_exps": "mlp.experts.gate_up_proj",  # gate and up as one stack (newer converters)
}
# Tensors read as parameters of their own, not a module's `.weight`.
PARAMETER_NAMES = frozenset({"layer_scalar", "mlp.experts.gate_up_proj", "experts.gate_up_proj", "experts.gate_proj",
                             "experts.up_proj", "experts.down_proj", "self_attn.sinks"})
# GPT-OSS: the norm before the experts is its post_attention_norm; a sink logit per head.
GPT_OSS_LAYER_NAMES = {**LAYER_NAMES, "post_attention_norm": "post_attention_layernorm",
                       "attn_sinks": "self_attn.sinks"}
# Qwen3.5: the norm before the MLP is its post_attention_norm; the linear-attention layers' projections, each its
# own tensor (attn_qkv the convolution's queries, keys and values; attn_gate the output gate z), the convolution,
# the decay's bias and log-rate (`ssm_a`, stored as -exp(A_log)) and the output norm.
QWEN35_LAYER_NAMES = {**LAYER_NAMES, "post_attention_norm": "post_attention_layernorm",
                      "attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z",
                      "ssm_beta": "linear_attn.in_proj_b", "ssm_alpha": "linear_attn.in_proj_a",
                      "ssm_ba": "linear_attn.in_proj_ba",  # Qwen3-Next's b and a, fused per key head
                      "ssm_out": "linear_attn.out_proj", "ssm_norm": "linear_attn.norm",
                      "ssm_conv1d": "linear_attn.conv1d",
                      "ssm_dt": "linear_attn.dt_bias", "ssm_a": "linear_attn.A_log",
                      # Qwen3.5-MoE's shared expert and its gate (a vector [H] in the file)
                      "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
                      "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}
# The files of Qwen3.5's layers: Qwen3.5, Qwen3.5-MoE and Qwen3-Next (whose value heads keep transformers' order).
QWEN35_ARCHES = ("qwen35", "qwen35moe", "qwen3next")
QWEN35_LINEAR_PARTS = frozenset({"attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha", "ssm_ba", "ssm_out",
                                 "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"})
# llama.cpp's GPT-OSS constants (not in the file): the experts' SwiGLU clamp and gain, and every other layer
# (the first among them) windowed.
GPT_OSS_SWIGLU = {"swiglu_limit": 7.0, "swiglu_alpha": 1.702}
# Gemma's four norms per layer: its ffn_norm is the norm before the MLP, whose Llama name is taken.
GEMMA_LAYER_NAMES = {
    **LAYER_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Gemma 4's: Gemma 3's, each layer's output scale and per-layer embedding's gate, projection and norm, and
# 26B-A4B's experts beside the dense MLP (their router's scales are `ffn_gate_inp.scale` and, per expert,
# `ffn_down_exps.scale`; gate and up stacked as one tensor, or as two).
GEMMA4_LAYER_NAMES = {
    **GEMMA_LAYER_NAMES,
    "layer_output_scale": "layer_scalar",
    "inp_gate": "per_layer_input_gate",
    "proj": "per_layer_projection",
    "post_norm": "post_per_layer_input_norm",
    "ffn_gate_inp": "router.proj",
    "ffn_gate_up_exps": "experts.gate_up_proj",
    "ffn_gate_exps": "experts.gate_proj",
    "ffn_up_exps": "experts.up_proj",
    "ffn_down_exps": "experts.down_proj",
    "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
    "post_ffw_norm_1": "post_feedforward_layernorm_1",
    "post_ffw_norm_2": "post_feedforward_layernorm_2",
}
# Gemma 4's per-layer embedding's gate and projection: linears of each layer beside the projections.
GEMMA4_LINEAR_PARTS = frozenset({"inp_gate", "proj"})
# Gemma 4's router scales, by (llama.cpp part, kind): the parameters' own names.
GEMMA4_ROUTER_SCALES = {("ffn_gate_inp", "scale"): "router.scale", ("ffn_down_exps", "scale"): "router.per_expert_scale"}
LAYER_PATTERN = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias|scale)")
# A layer's tensor without a kind (Qwen3.5's `blk.N.ssm_a`).
BARE_LAYER_PATTERN = re.compile(r"blk\.(\d+)\.(ssm_a)")
# llama.cpp's Gemma 3 constants where older files have no metadata: every sixth layer attends to the
# whole context, the sliding-window layers rotate with base 10,000.
GEMMA3_WINDOW_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10_000.0

def linear_gguf_names(types: dict[str, str]) -> list[str]:
    """The file's tensors that become linear layers: the projections, and the LM head (the token
    embedding when the file ties them)."""
    projections = {**LAYER_NAMES, **PHI3_FUSED_NAMES}
    linear = ({part for part, name in projections.items() if name.endswith("_proj")} | GEMMA4_LINEAR_PARTS
              | QWEN35_LINEAR_PARTS)
    names = [name for name in types if (match := LAYER_PATTERN.fullmatch(name)) and match.group(3) == "weight"
             and match.group(2) in linear]
    return names + ["output.weight" if "output.weight" in types else "token_embd.weight"]


def tensor_types(path: Path) -> dict[str, str]:
    """Every tensor's name -> its GGML type name ("Q4_1", "F32", ...). ValueError (or struct.error) for a
    file that is not GGUF version 2 or 3."""
    return {t.name: t.tensor_type.name for t in GGUFFile(path).tensors}


# The file's tensors that W4A8 fuses into one layer (model/block_quantization.linear_sources).
FUSED = {"attn_q": "qkv", "attn_k": "qkv", "attn_v": "qkv", "ffn_gate": "gate_up", "ffn_up": "gate_up",
         "ffn_gate_exps": "gate_up_exps", "ffn_up_exps": "gate_up_exps", "ffn_gate_up_exps": "gate_up_exps"}


def linear_bytes(path: Path) -> tuple[int, int] | None:
    """The weight bytes of the GGUF file's linear layers (experts included) in W4A8, on the file's own
    blocks as model/gguf_blocks.py reads them, and in W8A8's int8 rows; None for a file with no quantized
    linear, one of a type that cannot be read, or one that cannot be read at all (loading it says why). W4A8 reads fewer where 4-bit codes
    (Q4_0, Q4_1, Q4_K) outweigh the 8-bit ones' per-block scales."""
    try:
        tensors = {t.name: t for t in GGUFFile(path).tensors}
    except (OSError, ValueError, struct.error):  # not GGUF, truncated: the loader's error is the one to show
        return None
    groups: dict[str, list[GGUFTensor]] = {}
    names = linear_gguf_names({name: t.tensor_type.name for name, t in tensors.items()})
    if not any(name in tensors and is_block_type(tensors[name].tensor_type.name) for name in names):
        return None  # a float file
    for name in names:
        tensor = tensors.get(name)
        kind = tensor.tensor_type.name if tensor is not None else ""
        if tensor is None or len(tensor.shape) not in (2, 3) or not (is_block_type(kind) or kind in FLOAT_TYPES):
            return None
        match = LAYER_PATTERN.fullmatch(name)
        key = f"{match.group(1)}.{FUSED.get(match.group(2), match.group(2))}" if match else name
        groups.setdefault(key, []).append(tensor)
    w4a8 = w8a8 = 0
    for parts in groups.values():
        k, rows = int(parts[0].shape[0]), [int(np.prod(t.shape[1:])) for t in parts]  # GGUF: [K, N] or [K, N, E]
        w4a8 += w4a8_bytes([t.tensor_type.name for t in parts], rows, k)
        w8a8 += sum(rows) * (k + 4)  # int8 rows and a float32 scale each
    return w4a8, w8a8


class GGUFCheckpoint:
    """An opened GGUF file: `metadata` (plain Python values), `config`, and `read_tensors()`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        if not path.is_file():
            raise ModelLoadError(f"{path}: no such file")
        try:
            self.reader = GGUFFile(path)
        except (OSError, ValueError, struct.error) as e:  # bad magic, truncated header, data past the end
            raise ModelLoadError(f"{path}: not a readable GGUF file ({one_line(e)})") from None
        self.metadata: dict[str, Any] = self.reader.metadata
        self.tensor_names = {t.name for t in self.reader.tensors}
        self.config = self._config()

    def _get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.gguf_arch}.{key}", default)

    def _require(self, key: str) -> Any:
        value = self._get(key)
        if value is None:
            raise ModelLoadError(f"{self.path}: missing metadata {self.gguf_arch}.{key}")
        return value

    def _config(self) -> ModelConfig:
        self.gguf_arch = self.metadata.get("general.architecture")
        if self.gguf_arch not in ARCHITECTURES:
            raise ModelLoadError(
                f"{self.path}: unknown architecture {self.gguf_arch!r} (supported: {', '.join(ARCHITECTURES)})"
            )
        scaling = self._get("rope.scaling.type")
        if scaling not in (None, "none") and not (scaling == "linear" and self.gguf_arch == "gemma3") and \
                not (scaling == "yarn" and self.gguf_arch not in ("gemma3", "gemma4", "phi3")):
            raise ModelLoadError(f"{self.path}: unsupported rope scaling {scaling!r}")
        hidden = int(self._require("embedding_length"))
        num_heads = int(self._require("attention.head_count"))
        tokens = self.metadata.get("tokenizer.ggml.tokens")
        vocab_size = self._get("vocab_size") or (len(tokens) if tokens else None)
        if vocab_size is None:
            raise ModelLoadError(f"{self.path}: neither {self.gguf_arch}.vocab_size nor a token list")
        freq_factors = None
        if "rope_freqs.weight" in self.tensor_names:  # llama3 scaling, precomputed by llama.cpp
            freq_factors = tuple(float(x) for x in self._dequantize("rope_freqs.weight").reshape(-1))
        eos = self.metadata.get("tokenizer.ggml.eos_token_id")
        extra = self._gemma3_fields(hidden, num_heads) if self.gguf_arch in ("gemma3", "gemma4") else {}
        if self.gguf_arch == "gemma4":
            extra |= self._gemma4_fields(freq_factors)
            freq_factors = None  # the full-attention layers' proportional RoPE, read as such
        extra |= self._moe_fields()
        if self.gguf_arch == "phi3":
            extra |= self._phi3_fields(hidden, num_heads)
        if scaling == "yarn":
            extra |= self._yarn_fields()
        temperature = self._get("attention.temperature_scale")
        if temperature:  # Ministral 3's (llama.cpp's mistral3): past the original context, as YaRN's is
            extra["attention_temperature_beta"] = float(temperature)
            extra["attention_temperature_length"] = int(self._get("rope.scaling.original_context_length")
                                                        or self._require("context_length"))
        if self.gguf_arch == "gpt-oss":
            extra |= self._gpt_oss_fields()
        if self.gguf_arch in QWEN35_ARCHES:
            extra |= self._qwen35_fields(hidden, num_heads)
        if self.gguf_arch == "smollm3":
            num_layers = int(self._require("block_count"))
            extra["nope_layers"] = tuple(i for i in range(num_layers) if (i + 1) % SMOLLM3_NOPE_STEP == 0)
        try:
            return ModelConfig(
                architecture="mixtral" if self.gguf_arch == "llama" and extra.get("num_experts")
                else ARCHITECTURES[self.gguf_arch],
                vocab_size=int(vocab_size),
                hidden_size=hidden,
                intermediate_size=int(extra.pop("intermediate_size", None) or self._require("feed_forward_length")),
                num_layers=int(extra.pop("num_layers", None) or self._require("block_count")),
                num_heads=num_heads,
                num_kv_heads=int(extra.pop("num_kv_heads", None) or self._get("attention.head_count_kv", num_heads)),
                head_dim=int(extra.pop("head_dim", None) or self._get("attention.key_length", hidden // num_heads)),
                rms_norm_eps=float(self._get("attention.layer_norm_rms_epsilon", 1e-6)),
                rope_theta=float(self._get("rope.freq_base", 10000.0)),
                max_position_embeddings=int(self._get("context_length", 2048)),
                tie_word_embeddings="output.weight" not in self.tensor_names,
                attention_bias=self.gguf_arch in ("qwen2", "gpt-oss"),
                qk_norm=self.gguf_arch in ("qwen3", "gemma3", "gemma4", "qwen3moe", *QWEN35_ARCHES),
                rope_freq_factors=extra.pop("rope_freq_factors", freq_factors),
                bos_token_id=self.metadata.get("tokenizer.ggml.bos_token_id"),
                eos_token_ids=(int(eos),) if eos is not None else (),
                **extra,
            )
        except (ValueError, TypeError) as e:
            raise ModelLoadError(f"{self.path}: {one_line(e)}") from None

    def _moe_fields(self) -> dict[str, Any]:
        """The mixture-of-experts fields ({} for a dense model): Qwen3-MoE (`qwen3moe`) and Mixtral (`llama`
        with experts). A layer without a router tensor is dense. llama.cpp renormalises both families' top-k
        weights unless the file says otherwise (`expert_weights_norm`)."""
        num_experts = int(self._get("expert_count") or 0)
        if not num_experts:
            return {}
        # (the multi-token-prediction layers after the others are not read: Qwen3.5-MoE's)
        num_layers = int(self._require("block_count")) - int(self._get("nextn_predict_layers", 0) or 0)
        return {
            "num_experts": num_experts,
            "num_experts_per_tok": int(self._require("expert_used_count")),
            "moe_intermediate_size": int(self._get("expert_feed_forward_length")
                                         or self._require("feed_forward_length")),
            "norm_topk_prob": bool(self._get("expert_weights_norm", True)),
            "dense_layers": tuple(i for i in range(num_layers)
                                  if f"blk.{i}.ffn_gate_inp.weight" not in self.tensor_names),
        }

    def _gpt_oss_fields(self) -> dict[str, Any]:
        """GPT-OSS as llama.cpp reads it: sinks, biased attention output, the clamped SwiGLU's constants, and
        sliding-window layers by `attention.sliding_window_pattern` when the file has one, else every other
        layer from the first."""
        num_layers = int(self._require("block_count"))
        pattern = self._get("attention.sliding_window_pattern")
        windowed = ([bool(x) for x in pattern] if isinstance(pattern, list)
                    else [i % int(pattern or 2) < int(pattern or 2) - 1 for i in range(num_layers)])
        return {"layer_types": tuple("sliding_attention" if w else "full_attention" for w in windowed),
                "sliding_window": int(self._require("attention.sliding_window")), "attention_sinks": True,
                "output_bias": True, **GPT_OSS_SWIGLU}

    def _qwen35_fields(self, hidden: int, num_heads: int) -> dict[str, Any]:
        """Qwen3.5 as llama.cpp's converter writes it: the layers past block_count - nextn_predict_layers are
        multi-token-prediction layers (not read); the recurrent ones listed, else all but every
        full_attention_interval-th; the linear attention's heads as the `ssm` keys name them (value heads tiled,
        `ModelConfig.linear_heads_tiled`; Qwen3-Next's grouped, as transformers orders them); a quarter of each head
        rotating."""
        num_layers = int(self._require("block_count")) - int(self._get("nextn_predict_layers", 0) or 0)
        listed = self._get("attention.recurrent_layers")
        if listed is not None:
            recurrent = [bool(x) for x in listed][:num_layers]
        else:
            interval = int(self._get("full_attention_interval", 4))
            recurrent = [(i + 1) % interval != 0 for i in range(num_layers)]
        head_dim = int(self._get("attention.key_length", hidden // num_heads))
        value_heads = int(self._require("ssm.time_step_rank"))
        shared = {}
        if self.gguf_arch in ("qwen35moe", "qwen3next"):
            shared = {"shared_expert_intermediate_size": int(self._require("expert_shared_feed_forward_length"))}
        if self.gguf_arch == "qwen35moe":  # no dense MLP: the experts' width stands in for feed_forward_length
            shared["intermediate_size"] = int(self._require("expert_feed_forward_length"))
        return {**shared, "num_layers": num_layers, "linear_layers": tuple(i for i, r in enumerate(recurrent) if r),
                "linear_key_heads": int(self._require("ssm.group_count")), "linear_value_heads": value_heads,
                "linear_key_dim": int(self._require("ssm.state_size")),
                "linear_value_dim": int(self._require("ssm.inner_size")) // value_heads,
                "linear_conv_kernel": int(self._require("ssm.conv_kernel")),
                "linear_heads_tiled": self.gguf_arch != "qwen3next",
                "attention_output_gate": True, "rotary_dim": int(self._get("rope.dimension_count", head_dim // 4))}

    def _phi3_fields(self, hidden: int, num_heads: int) -> dict[str, Any]:
        """Phi-3's rotation as llama.cpp's converter writes it: the rotated dims of each head, LongRoPE's short
        and long factors as tensors with its cos/sin scale, and a sliding window (0: none, Phi-4)."""
        extra: dict[str, Any] = {}
        head_dim = int(self._get("attention.key_length", hidden // num_heads))
        rotary = int(self._get("rope.dimension_count", head_dim))
        if rotary != head_dim:
            extra["rotary_dim"] = rotary
        if "rope_factors_long.weight" in self.tensor_names:
            extra |= {
                "rope_freq_factors": tuple(float(x) for x in self._dequantize("rope_factors_short.weight")),
                "rope_long_freq_factors": tuple(float(x) for x in self._dequantize("rope_factors_long.weight")),
                "rope_original_max_position_embeddings": int(self._require("rope.scaling.original_context_length")),
                "rope_attention_factor": float(self._get("rope.scaling.attn_factor", 1.0)),
            }
        window = int(self._get("attention.sliding_window", 0) or 0)
        if window:
            extra["sliding_window"] = window
        return extra

    def _gemma3_fields(self, hidden: int, num_heads: int) -> dict[str, Any]:
        """What Gemma 3 adds to the config, as llama.cpp reads it. The norm weights need no shift: the
        file stores Gemma's (1 + w) already."""
        num_layers = int(self._require("block_count"))
        pattern = self._get("attention.sliding_window_pattern", GEMMA3_WINDOW_PATTERN)
        if isinstance(pattern, list):  # per layer: True where the layer is windowed
            windowed = [bool(x) for x in pattern]
        else:
            windowed = [(i + 1) % int(pattern) != 0 for i in range(num_layers)]
        head_dim = int(self._get("attention.key_length", hidden // num_heads))
        # Gemma 3 27B scales queries by hidden / heads, the others by head_dim (llama.cpp tells them apart
        # by their 62 layers; no key says it).
        scalar = hidden // num_heads if num_layers == 62 else head_dim
        extra: dict[str, Any] = {
            "sliding_window": int(self._require("attention.sliding_window")),
            "layer_types": tuple("sliding_attention" if w else "full_attention" for w in windowed),
            "rope_local_theta": float(self._get("rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE)),
            "hidden_act": "gelu_tanh",
            "sandwich_norms": True,
            "embedding_scale": hidden**0.5,
            "query_pre_attn_scalar": float(scalar),
        }
        if self._get("rope.scaling.type") == "linear":
            extra["rope_linear_factor"] = float(self._require("rope.scaling.factor"))
        softcap = self._get("final_logit_softcapping")
        if softcap:
            extra["final_logit_softcapping"] = float(softcap)
        return extra

    def _gemma4_fields(self, freq_factors: tuple[float, ...] | None) -> dict[str, Any]:
        """Gemma 4 as llama.cpp's converter writes it: key_length the full-attention layers' head size and
        key_length_swa the others'; head_count_kv and feed_forward_length per layer where layers differ;
        proportional RoPE as `rope_freqs` of 1 (rotated pairs) and 1e30 (the rest); values are keys where the
        full-attention layers have no attn_v. Norm weights are Gemma 4's own (no 1 + w)."""
        num_layers = int(self._require("block_count"))
        windowed = [bool(x) for x in self._require("attention.sliding_window_pattern")]
        if len(windowed) != num_layers:
            raise ModelLoadError(f"{self.path}: attention.sliding_window_pattern has {len(windowed)} entries for "
                                 f"{num_layers} layers")
        full = [i for i in range(num_layers) if not windowed[i]]
        swa = [i for i in range(num_layers) if windowed[i]]
        if not full or not swa:
            raise ModelLoadError(f"{self.path}: Gemma 4 with {len(full)} full-attention and {len(swa)} sliding layers")

        def per_layer(key: str) -> tuple[int, int | None]:  # (the sliding layers' value, the full ones')
            value = self._require(key)
            values = [int(x) for x in value] if isinstance(value, list) else [int(value)] * num_layers
            if len({values[i] for i in swa}) > 1 or len({values[i] for i in full}) > 1:
                raise ModelLoadError(f"{self.path}: {self.gguf_arch}.{key} differs among layers of one kind")
            return values[swa[0]], values[full[0]]

        head_full = int(self._require("attention.key_length"))
        head_swa = int(self._get("attention.key_length_swa", head_full))
        kv_swa, kv_full = per_layer("attention.head_count_kv")
        shared = int(self._get("attention.shared_kv_layers", 0) or 0)
        ff = self._require("feed_forward_length")
        ff = [int(x) for x in ff] if isinstance(ff, list) else [int(ff)] * num_layers
        first_shared = num_layers - shared
        double = shared > 0 and ff[-1] == 2 * ff[0]
        expected = [ff[0] * (2 if double and i >= first_shared else 1) for i in range(num_layers)]
        if ff != expected:
            raise ModelLoadError(f"{self.path}: feed_forward_length {ff} is neither one width nor twice it in the "
                                 "shared-cache layers")
        proportion = None
        if freq_factors is not None:
            rotated = sum(1 for f in freq_factors if f < 1e20)
            if any(f != 1.0 for f in freq_factors[:rotated]) or len(freq_factors) != head_full // 2:
                raise ModelLoadError(f"{self.path}: rope_freqs is not Gemma 4's proportional RoPE")
            proportion = 2 * rotated / head_full
        # llama.cpp caps Gemma 4's logits at 30 unless the file says otherwise (its converter writes the key
        # only when the config sets a cap)
        softcap = float(self._get("final_logit_softcapping", 30.0) or 0.0)
        per_layer_size = int(self._get("embedding_length_per_layer_input", 0) or 0)
        per_layer_vocab = 0
        if per_layer_size:
            table = next((t for t in self.reader.tensors if t.name == "per_layer_token_embd.weight"), None)
            if table is None:
                raise ModelLoadError(f"{self.path}: embedding_length_per_layer_input is set and "
                                     "per_layer_token_embd.weight is missing")
            per_layer_vocab = int(table.shape[1])
        return {
            "head_dim": head_swa, "num_kv_heads": kv_swa, "intermediate_size": ff[0],
            "global_head_dim": head_full, "global_num_kv_heads": kv_full,
            "attention_k_eq_v": f"blk.{full[0]}.attn_v.weight" not in self.tensor_names,
            "value_norm": True, "layer_scalars": True, "query_pre_attn_scalar": 1.0,
            "rope_proportion": proportion,
            "per_layer_input_size": per_layer_size, "per_layer_vocab_size": per_layer_vocab,
            "kv_shared_layers": shared, "double_wide_shared_mlp": double,
            "final_logit_softcapping": softcap or None,
            # 26B-A4B: experts beside every layer's MLP (`_moe_fields` read their count and width)
            "experts_beside_mlp": bool(self._get("expert_count")), "dense_layers": (),
        }

    def _dequantize(self, name: str) -> np.ndarray:
        tensor = next(t for t in self.reader.tensors if t.name == name)
        try:
            # As a plain array: numpy's memmap subclass costs more per row slice than the dequantizing does.
            return gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
        except NotImplementedError:
            raise ModelLoadError(
                f"{self.path}: tensor {name!r} has unsupported type {tensor.tensor_type.name}"
            ) from None

    def classifier_rows(self) -> dict[str, torch.Tensor]:
        """A reranker file's classification head by label: llama.cpp writes Qwen3-Reranker's as
        `cls.output.weight`, the LM head's rows [hidden] float32 of the tokens "yes" and "no" (the labels of
        `{arch}.classifier.output_labels`), in place of the LM head. {} for a file without one."""
        if "cls.output.weight" not in self.tensor_names:
            return {}
        rows = np.ascontiguousarray(self._dequantize("cls.output.weight"), dtype=np.float32)
        rows = rows.reshape(-1, self.config.hidden_size)
        labels = [str(label) for label in self.metadata.get(f"{self.gguf_arch}.classifier.output_labels") or ()]
        if len(labels) != rows.shape[0]:
            raise ModelLoadError(f"{self.path}: cls.output.weight has {rows.shape[0]} rows and the file names "
                                 f"{len(labels)} classifier labels")
        return {label: torch.from_numpy(row.copy()) for label, row in zip(labels, rows)}

    def read_tensors(self) -> LazyTensors[torch.Tensor]:
        """Every model tensor under Hugging Face names, [out, in] layout, dequantized to float32 when it is
        read (shapes from the header)."""
        by_name = {}
        for t in self.reader.tensors:
            name = None if t.name == "rope_freqs.weight" else self._hf_name(t.name)
            if name is not None:  # else a tensor the decoder does not use
                by_name[name] = t
        shapes = {name: tuple(int(x) for x in reversed(t.shape)) for name, t in by_name.items()}
        tensors = LazyTensors(shapes, lambda name: self._read_tensor(name, by_name[name]))
        if self.gguf_arch == "gemma4":
            return stack_gate_up(tensors)
        if self.gguf_arch in QWEN35_ARCHES:
            for name in [n for n in shapes if n.endswith("linear_attn.conv1d.weight")]:
                shapes[name] = (shapes[name][0], 1, shapes[name][1])  # [C, K] in the file, conv1d's [C, 1, K]
            for name in [n for n in shapes if n.endswith("mlp.shared_expert_gate.weight")]:
                shapes[name] = (1, shapes[name][0])  # a vector [H] in the file, the gate's [1, H]
            return split_qwen3_5(self.config, tensors, shift_norms=False)
        return split_fused_phi3(self.config, tensors) if self.gguf_arch == "phi3" else tensors

    def _read_tensor(self, name: str, tensor: GGUFTensor) -> torch.Tensor:
        array = np.ascontiguousarray(self._dequantize(tensor.name), dtype=np.float32)
        if not array.flags.writeable:  # F32 tensors come back as views of the read-only file map
            array = array.copy()
        weight = torch.from_numpy(array)
        if self.gguf_arch in PERMUTED_ARCHITECTURES and name.endswith(("q_proj.weight", "q_proj.bias")):
            weight = unpermute_rotary(weight, self.config.num_heads)
        elif self.gguf_arch in PERMUTED_ARCHITECTURES and name.endswith(("k_proj.weight", "k_proj.bias")):
            weight = unpermute_rotary(weight, self.config.num_kv_heads)
        elif name.endswith("linear_attn.A_log"):  # the file's ssm_a is -exp(A_log)
            weight = torch.log(-weight)
        elif name.endswith("linear_attn.conv1d.weight"):
            weight = weight[:, None]
        elif name.endswith("mlp.shared_expert_gate.weight"):
            weight = weight.reshape(1, -1)
        return weight

    def _yarn_fields(self) -> dict[str, Any]:
        """YaRN: the factor, the original context, the betas (the file's, else 32 and 1), and cos and sin
        scaled as llama.cpp scales them: 0.1 ln(factor) + 1, times `rope.scaling.attn_factor` (llama.cpp sets
        the scale from the factor and applies no yarn_attn_factor key; its 0.3.36 reads no betas either)."""
        factor = float(self._require("rope.scaling.factor"))
        yarn = YarnScaling(factor, int(self._require("rope.scaling.original_context_length")),
                           float(self._get("rope.scaling.yarn_beta_fast", 32.0)),
                           float(self._get("rope.scaling.yarn_beta_slow", 1.0)))
        log_mul = float(self._get("rope.scaling.yarn_log_multiplier", 0.0))  # transformers' mscale_all_dim
        # With a log multiplier (mscale_all_dim), as llama.cpp takes it: mscale 1 over it (Ministral 3: 1 over 1).
        attention_factor = yarn_attention_factor(factor) / (yarn_attention_factor(factor, log_mul) if log_mul else 1.0)
        attention_factor *= float(self._get("rope.scaling.attn_factor", 1.0))
        return {"rope_yarn": yarn, "rope_attention_factor": attention_factor}

    def block_embedding_tables(self, tokens: bool = False) -> dict[str, GGUFTensor]:
        """The embedding tables kept as the file's blocks (model/block_embedding.py), under their modules'
        state-dict names: Gemma 4's per-layer table, and with `tokens` the token embedding (when the LM head
        does not need it as floats: W4A8 reads its own copy of the blocks), each when of a quantized type."""
        names = {"per_layer_token_embd.weight": "embed_tokens_per_layer.weight"}
        if tokens:
            names["token_embd.weight"] = "embed_tokens.weight"
        return {names[t.name]: t for t in self.reader.tensors
                if t.name in names and t.tensor_type.name not in FLOAT_TYPES}

    def read_blocks(self) -> LazyTensors[BlockWeight]:
        """Every linear weight as its raw blocks, read when it is asked for, under Hugging Face names (the
        LM head as `lm_head.weight` also when tied), rows in the same order as `read_tensors`.
        ModelLoadError, at once, when no linear weight is of a quantized type, or one is of a type that cannot
        be read (model/gguf_blocks.py says how each type is read: a float one in a quantized file too)."""
        by_name = {t.name: t for t in self.reader.tensors}
        tensors = {}
        names = linear_gguf_names({name: t.tensor_type.name for name, t in by_name.items()})
        if not any(is_block_type(by_name[name].tensor_type.name) for name in names):
            kinds = sorted({by_name[name].tensor_type.name for name in names})
            raise ModelLoadError(f"{self.path}: its linear weights are {', '.join(kinds)}; the w4a8 layers take a "
                                 "quantized file's blocks (use --quantization w8a8)")
        for gguf_name in names:
            tensor = by_name[gguf_name]
            if not (is_block_type(tensor.tensor_type.name) or tensor.tensor_type.name in FLOAT_TYPES):
                raise ModelLoadError(f"{self.path}: tensor {gguf_name!r} is {tensor.tensor_type.name}, which the "
                                     "w4a8 layers cannot read (use --quantization w8a8)")
            name = "lm_head.weight" if gguf_name in ("output.weight", "token_embd.weight") else self._hf_name(gguf_name)
            tensors[name] = tensor
        counts = collections.Counter(t.tensor_type.name for t in tensors.values())
        log.info("w4a8 blocks of %s: %s", self.path.name, ", ".join(
            f"{count} {kind} ({how_read(kind)})" for kind, count in sorted(counts.items())))
        shapes = {name: tuple(int(x) for x in reversed(t.shape)) for name, t in tensors.items()}
        blocks = LazyTensors(shapes, lambda name: self._read_blocks(name, tensors[name]))
        if self.gguf_arch == "phi3":
            return split_fused_phi3(self.config, blocks, lambda weight, rows: weight.rows(rows))
        if self.gguf_arch in QWEN35_ARCHES:
            return split_qwen3_5(self.config, blocks, shift_norms=False, take=lambda weight, rows: weight.rows(rows))
        return blocks

    def _read_blocks(self, name: str, tensor: GGUFTensor) -> BlockWeight:
        # GGUF lists the fastest dimension first: [K, N], or [K, N, E] for stacked experts, read as E * N rows.
        k, n = int(tensor.shape[0]), int(np.prod(tensor.shape[1:]))
        weight = block_weight(tensor.data, tensor.tensor_type.name, (n, k))
        if self.gguf_arch in PERMUTED_ARCHITECTURES and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = self.config.num_heads if "q_proj" in name else self.config.num_kv_heads
            weight = weight.rows(unpermute_rotary(torch.arange(n), heads))  # the rows' new order
        return weight

    def _hf_name(self, name: str) -> str | None:
        if name in GLOBAL_NAMES:
            return GLOBAL_NAMES[name]
        names = {"gemma3": GEMMA_LAYER_NAMES, "gemma4": GEMMA4_LAYER_NAMES, "gpt-oss": GPT_OSS_LAYER_NAMES,
                 "phi3": {**LAYER_NAMES, **PHI3_FUSED_NAMES},
                 **dict.fromkeys(QWEN35_ARCHES, QWEN35_LAYER_NAMES)}.get(self.gguf_arch, LAYER_NAMES)
        bare = BARE_LAYER_PATTERN.fullmatch(name)
        if bare is not None and self.gguf_arch in QWEN35_ARCHES:
            return f"layers.{bare.group(1)}.{names[bare.group(2)]}"
        match = LAYER_PATTERN.fullmatch(name)
        if match is None or match.group(2) not in names:
            return None
        layer, part, kind = match.groups()
        if self.gguf_arch == "gemma4" and (part, kind) in GEMMA4_ROUTER_SCALES:
            return f"layers.{layer}.{GEMMA4_ROUTER_SCALES[part, kind]}"
        if kind == "scale":
            return None
        if names[part] in PARAMETER_NAMES or (part, kind) == ("ssm_dt", "bias"):  # (Qwen3.5's dt_bias)
            return f"layers.{layer}.{names[part]}"
        return f"layers.{layer}.{names[part]}.{kind}"


def stack_gate_up(tensors: LazyTensors[T]) -> LazyTensors[T]:
    """Gemma 4's experts from a file that stacks gate and up apart ([E, I, H] each): one gate_up_proj
    [E, 2I, H] per layer, each expert's gate rows then its up rows, as its checkpoints hold them."""
    shapes, sources = dict(tensors.shapes), {}
    for gate in [name for name in shapes if name.endswith(".experts.gate_proj")]:
        up = gate.replace(".gate_proj", ".up_proj")
        if up in shapes:
            e, inter, h = shapes.pop(gate)
            shapes.pop(up)
            fused = gate.replace(".gate_proj", ".gate_up_proj")
            shapes[fused], sources[fused] = (e, 2 * inter, h), (gate, up)

    def read(name: str) -> T:
        if name in sources:
            gate, up = sources[name]
            return torch.cat([tensors[gate], tensors[up]], dim=1)
        return tensors[name]

    return LazyTensors(shapes, read)


def unpermute_rotary(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's reordering of q/k rows for its interleaved rotary layout.

    llama.cpp stores each head's rows as pairs (i, i + half) interleaved; Hugging Face keeps the two
    halves apart. Rows of one head: [half, 2] in the file -> [2, half] here.
    """
    rows = weight.shape[0]
    head_dim = rows // num_heads
    if rows % num_heads or head_dim % 2:
        raise ModelLoadError(f"q/k tensor of {rows} rows does not split into {num_heads} heads")
    rest = weight.shape[1:]
    return weight.reshape(num_heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(weight.shape).contiguous()
