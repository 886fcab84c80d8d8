"""Reading a GGUF file: its metadata mapped onto ModelConfig, and its tensors dequantized.

Dequantization (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K and the other types the `gguf` package
knows) is done by the `gguf` package in numpy. Names are mapped from llama.cpp's (`blk.0.attn_q.weight`)
to Hugging Face's (`layers.0.self_attn.q_proj.weight`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from model.config import ModelConfig
from model.errors import ModelLoadError, one_line

# GGUF architecture -> ModelConfig architecture. Mistral checkpoints are written as "llama".
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

GLOBAL_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
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
}
LAYER_PATTERN = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


class GGUFCheckpoint:
    """An opened GGUF file: `metadata` (plain Python values), `config`, and `read_tensors()`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        if not path.is_file():
            raise ModelLoadError(f"{path}: no such file")
        try:
            self.reader = gguf.GGUFReader(str(path))
        except Exception as e:  # bad magic, truncated header or tensor data beyond the end of the file
            raise ModelLoadError(f"{path}: not a readable GGUF file ({one_line(e)})") from None
        self.metadata: dict[str, Any] = {}
        for key, field in self.reader.fields.items():
            try:
                self.metadata[key] = field.contents()
            except Exception as e:
                raise ModelLoadError(f"{path}: unreadable metadata {key!r} ({one_line(e)})") from None
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
        if scaling not in (None, "none"):
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
        try:
            return ModelConfig(
                architecture=ARCHITECTURES[self.gguf_arch],
                vocab_size=int(vocab_size),
                hidden_size=hidden,
                intermediate_size=int(self._require("feed_forward_length")),
                num_layers=int(self._require("block_count")),
                num_heads=num_heads,
                num_kv_heads=int(self._get("attention.head_count_kv", num_heads)),
                head_dim=int(self._get("attention.key_length", hidden // num_heads)),
                rms_norm_eps=float(self._get("attention.layer_norm_rms_epsilon", 1e-6)),
                rope_theta=float(self._get("rope.freq_base", 10000.0)),
                max_position_embeddings=int(self._get("context_length", 2048)),
                tie_word_embeddings="output.weight" not in self.tensor_names,
                attention_bias=self.gguf_arch == "qwen2",
                qk_norm=self.gguf_arch == "qwen3",
                rope_freq_factors=freq_factors,
                bos_token_id=self.metadata.get("tokenizer.ggml.bos_token_id"),
                eos_token_ids=(int(eos),) if eos is not None else (),
            )
        except (ValueError, TypeError) as e:
            raise ModelLoadError(f"{self.path}: {one_line(e)}") from None

    def _dequantize(self, name: str) -> np.ndarray:
        tensor = next(t for t in self.reader.tensors if t.name == name)
        try:
            return gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError:
            raise ModelLoadError(
                f"{self.path}: tensor {name!r} has unsupported type {tensor.tensor_type.name}"
            ) from None

    def read_tensors(self) -> dict[str, torch.Tensor]:
        """Every model tensor, dequantized to float32, under Hugging Face names, [out, in] layout."""
        tensors: dict[str, torch.Tensor] = {}
        for t in self.reader.tensors:
            if t.name == "rope_freqs.weight":
                continue
            name = self._hf_name(t.name)
            if name is None:
                continue  # tensors the decoder does not use
            array = np.ascontiguousarray(self._dequantize(t.name), dtype=np.float32)
            if not array.flags.writeable:  # F32 tensors come back as views of the read-only file map
                array = array.copy()
            weight = torch.from_numpy(array)
            if self.gguf_arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
                weight = unpermute_rotary(weight, self.config.num_heads)
            elif self.gguf_arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
                weight = unpermute_rotary(weight, self.config.num_kv_heads)
            tensors[name] = weight
        return tensors

    @staticmethod
    def _hf_name(name: str) -> str | None:
        if name in GLOBAL_NAMES:
            return GLOBAL_NAMES[name]
        match = LAYER_PATTERN.fullmatch(name)
        if match is None or match.group(2) not in LAYER_NAMES:
            return None
        layer, part, kind = match.groups()
        return f"layers.{layer}.{LAYER_NAMES[part]}.{kind}"


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
