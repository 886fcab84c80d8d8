"""Tiny random checkpoints of each supported family, written by `transformers` itself."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch

FAMILIES = ("llama3", "mistral", "qwen2", "qwen3", "gemma3", "gemma4", "gemma4_e", "smollm3", "phi3")
MOE_FAMILIES = ("qwen3_moe", "mixtral")  # mixture-of-experts decoders (tests/model/test_moe.py)
# Gemma 4's experts beside each dense MLP (26B-A4B's shape): tested with the families, apart from the MoE tests
# (its layers differ, so neither tensor nor expert parallelism takes it).
GEMMA4_MOE = "gemma4_moe"
# GPT-OSS: experts with biases and a clamped SwiGLU, attention sinks (tests/model/test_gpt_oss.py and the parity
# tests of every family).
GPT_OSS = "gpt_oss"
# Qwen3.5: linear-attention layers (a gated delta rule) between gated attention ones (tests/model/test_qwen3_5.py).
QWEN3_5 = "qwen3_5"
QWEN3_5_MOE = "qwen3_5_moe"  # its mixture of experts, a shared expert beside 4 routed ones (2 a token)
QWEN3_NEXT = "qwen3_next"  # Qwen3.5-MoE's layers, projections fused per key head, a dense MLP in layer 2


def hf_config(family: str, vocab_size: int = 320, **gemma4_sizes):
    """`gemma4_sizes`: fields of a Gemma 4 config in place of the tiny ones (wider rows for K-quant files)."""
    import transformers

    common = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
        # A wide init gives peaked logits, so greedy comparisons are not decided by near ties.
        initializer_range=0.2, tie_word_embeddings=False,
    )
    if family == "llama3":
        return transformers.LlamaConfig(
            **common, rope_theta=50000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
        )
    if family == "mistral":
        return transformers.MistralConfig(**common, sliding_window=None)
    if family == "qwen2":
        return transformers.Qwen2Config(**{**common, "tie_word_embeddings": True})
    if family == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=32)
    if family == "gemma3":
        # A window of 16 tokens, shorter than the tests' prompts, on the first layer; the second attends to
        # everything. Each kind of layer has its own RoPE base, and the attention its own scale.
        return transformers.Gemma3TextConfig(
            **{**common, "tie_word_embeddings": True}, head_dim=32, sliding_window=16,
            layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=24,
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
        )
    if family in ("gemma4", "gemma4_e", GEMMA4_MOE):
        # Gemma 4's two shapes on four layers (sliding, full, sliding, full; a 16-token window): the full-attention
        # layers with heads of their own size (32 against 16) and proportional RoPE. "gemma4" as the 31B: one
        # KV head in those layers, whose values are their keys; "gemma4_e" as E2B/E4B: per-layer embeddings, the
        # last two layers reading the first two's caches with MLPs twice as wide. Both cap their logits at 30
        # (llama.cpp caps a Gemma 4 GGUF at 30 when the file names no cap, so the files agree either way).
        # "gemma4_moe": the 31B shape with 26B-A4B's experts (4, two a token) beside each dense MLP.
        own = ({"num_global_key_value_heads": 1, "attention_k_eq_v": True, "hidden_size_per_layer_input": 0,
                **({"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32}
                   if family == GEMMA4_MOE else {})}
               if family != "gemma4_e" else
               {"hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": vocab_size, "num_kv_shared_layers": 2,
                "use_double_wide_mlp": True})
        return transformers.Gemma4TextConfig(**{
            **common, "num_hidden_layers": 4, "tie_word_embeddings": True, "head_dim": 16, "global_head_dim": 32,
            "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"] * 2, "pad_token_id": None,
            "final_logit_softcapping": 30.0, **own, **gemma4_sizes})
    if family == "smollm3":  # four layers, so llama.cpp's fixed NoPE step (every fourth layer) meets one
        return transformers.SmolLM3Config(**{**common, "num_hidden_layers": 4, "tie_word_embeddings": True},
                                          rope_theta=2_000_000.0, pad_token_id=None, bos_token_id=None,
                                          eos_token_id=None)
    if family == "phi3":
        # Phi-4-mini's shape of rotation: 3/4 of each 16-dim head rotates (rotary_dim 12), LongRoPE's short
        # factors within the original 128-token context (the family tests' contexts), its long ones past it, a
        # cos/sin scale from the 4x longer max_position_embeddings.
        rng = torch.Generator().manual_seed(3)
        short, long = (1 + torch.rand(6, generator=rng)).tolist(), (1 + 4 * torch.rand(6, generator=rng)).tolist()
        return transformers.Phi3Config(
            **{**common, "num_attention_heads": 4, "num_key_value_heads": 2}, sliding_window=None,
            pad_token_id=None, bos_token_id=None, eos_token_id=None, original_max_position_embeddings=128,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                             "short_factor": short, "long_factor": long, "original_max_position_embeddings": 128})
    if family == "qwen3_moe":
        # Three layers, the middle one dense (mlp_only_layers), so both MLP kinds run; weights not renormalised.
        return transformers.Qwen3MoeConfig(
            **{**common, "num_hidden_layers": 3}, head_dim=32, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=32, mlp_only_layers=[1], norm_topk_prob=False,
        )
    if family == GPT_OSS:
        # GPT-OSS's shape: a sliding-window layer (16 tokens) then a full one, 4 experts (2 a token) of width 32,
        # YaRN 32x over 4,096 tokens (transformers' default, unrounded ramp), biases everywhere, sinks.
        return transformers.GptOssConfig(**{**common, "intermediate_size": 32}, head_dim=16, num_local_experts=4,
                                         num_experts_per_tok=2, sliding_window=16, pad_token_id=None,
                                         bos_token_id=None, eos_token_id=None)
    if family == QWEN3_5:
        # Qwen3.5's shape on four layers (linear, attention, linear, attention): 2 key heads serving 4 value heads,
        # a 4-tap convolution, attention with an output gate rotating a quarter of each 32-dim head.
        return transformers.Qwen3_5TextConfig(
            **{**common, "num_hidden_layers": 4}, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
            layer_types=["linear_attention", "full_attention"] * 2, pad_token_id=None, bos_token_id=None,
            eos_token_id=None, rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0,
                                                "partial_rotary_factor": 0.25, "mrope_interleaved": True,
                                                "mrope_section": [2, 1, 1]})
    if family == QWEN3_5_MOE:
        return transformers.Qwen3_5MoeTextConfig(
            **{k: v for k, v in common.items() if k not in ("intermediate_size", "num_hidden_layers")},
            num_hidden_layers=4, head_dim=32,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"] * 2, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64, pad_token_id=None,
            bos_token_id=None, eos_token_id=None, rope_parameters={
                "rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                "mrope_interleaved": True, "mrope_section": [2, 1, 1]})
    if family == QWEN3_NEXT:
        return transformers.Qwen3NextConfig(
            **{**common, "num_hidden_layers": 4}, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
            layer_types=["linear_attention", "full_attention"] * 2, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=64, mlp_only_layers=[2], pad_token_id=None,
            bos_token_id=None, eos_token_id=None, rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0,
                                                                 "partial_rotary_factor": 0.25})
    if family == "mixtral":  # the experts are intermediate_size wide; weights always renormalised
        return transformers.MixtralConfig(**{**common, "intermediate_size": 32}, num_local_experts=8,
                                          num_experts_per_tok=2, sliding_window=None)
    raise ValueError(family)


def ministral3_config(vocab_size: int = 320, original_context: int = 32):
    """A tiny Ministral 3 text config (transformers' Ministral3Config): Mistral's layers, YaRN with mscale and
    mscale_all_dim 1 (no scale of cos and sin), Llama 4's attention temperature past `original_context`."""
    import transformers

    rope = {"rope_type": "yarn", "rope_theta": 1_000_000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "original_max_position_embeddings": original_context, "mscale": 1.0, "mscale_all_dim": 1.0,
            "llama_4_scaling_beta": 0.1}
    return transformers.Ministral3Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=4 * original_context, rope_parameters=rope,
        tie_word_embeddings=False)


def spread_qwen3_5_parameters(model):
    """A Qwen3.5's norms, which scale by (1 + w), with w away from 0 (the linear attention's output norm, which scales
    by w, away from 1), and its decays' parameters spread: each then matters to a comparison. Returns the model."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0 if "linear_attn" not in name else 1, 0.2)
            if name.endswith(("A_log", "dt_bias")):
                param.normal_(0, 1)
    return model


def make_hf_model(family: str, directory: Path, seed: int = 0, vocab_size: int = 320):
    """Write a random model of `family` to `directory` (config.json + model.safetensors); return it."""
    import transformers

    torch.manual_seed(seed)
    config = hf_config(family, vocab_size)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).eval()
    if family == "qwen2":  # make the biases matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.2)
    if family == "gemma3":  # Gemma's norms start at w = 0 (a scale of 1 + w); make the offset matter
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.normal_(0, 0.2)
    if family.startswith("gemma4"):  # norms (scaled by w) and each layer's output scale away from 1
        with torch.no_grad():
            for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
                if name.endswith(("norm.weight", "router.scale", "per_expert_scale")):
                    tensor.normal_(1, 0.2)
                if name.endswith("layer_scalar"):
                    tensor.uniform_(0.5, 1.5)
    if family in (QWEN3_5, QWEN3_5_MOE, QWEN3_NEXT):
        spread_qwen3_5_parameters(model)
    if family == GPT_OSS:  # biases, sinks and the router's bias away from 0
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("bias", "sinks")):
                    param.normal_(0, 0.5)
    model.save_pretrained(directory, safe_serialization=True)
    return model


# --- GGUF ----------------------------------------------------------------------------------------

GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate": "ffn_gate_inp",  # a mixture of experts' router
}


GEMMA_GGUF_LAYER_NAMES = {
    **GGUF_LAYER_NAMES, "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


GEMMA4_GGUF_LAYER_NAMES = {
    **GEMMA_GGUF_LAYER_NAMES, "per_layer_input_gate": "inp_gate", "per_layer_projection": "proj",
    "post_per_layer_input_norm": "post_norm", "router.proj": "ffn_gate_inp",
    "pre_feedforward_layernorm_2": "pre_ffw_norm_2", "post_feedforward_layernorm_1": "post_ffw_norm_1",
    "post_feedforward_layernorm_2": "post_ffw_norm_2",
}
# Gemma 4's router scales: parameters of the router, tensors of llama.cpp's layer.
GEMMA4_GGUF_ROUTER_SCALES = {"router.scale": "ffn_gate_inp.scale", "router.per_expert_scale": "ffn_down_exps.scale"}


PHI3_GGUF_LAYER_NAMES = {**GGUF_LAYER_NAMES, "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}


def write_and_close(writer) -> None:
    """Write a GGUF writer's header, metadata and tensors to its file, and close it."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def k_quant_model():
    """A random Llama whose rows are 256 inputs long, as K-quants need."""
    import transformers

    cfg = hf_config("llama3")
    cfg.hidden_size, cfg.intermediate_size, cfg.head_dim = 256, 512, 64
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def write_gguf_experts(writer, name: str, tensor, qtype, fused_gate_up: bool = False):
    """transformers' stacked experts of one layer as llama.cpp's: gate_up_proj [E, 2I, H] -> ffn_gate_exps and
    ffn_up_exps [E, I, H] (with `fused_gate_up`, one ffn_gate_up_exps [E, 2I, H], as its converter writes Gemma
    4's); down_proj [E, H, I] -> ffn_down_exps (numpy order; GGUF lists dimensions reversed). Quantized to
    `qtype` unless it is F32 or a K-quant (rows of 256); returns what the file holds, as `tensor`."""
    from gguf.quants import dequantize, quantize

    layer = name.removeprefix("model.").split(".")[1]
    split = name.endswith("gate_up_proj") and not fused_gate_up
    parts = tensor.float().chunk(2, dim=1) if split else (tensor.float(),)
    kinds = ("gate", "up") if split else ("gate_up",) if name.endswith("gate_up_proj") else ("down",)
    held = []
    for kind, part in zip(kinds, parts):
        array = part.contiguous().numpy()
        if qtype.name in ("F32", "Q4_K", "Q6_K"):
            writer.add_tensor(f"blk.{layer}.ffn_{kind}_exps.weight", array)
        else:
            raw = quantize(array, qtype)
            writer.add_tensor(f"blk.{layer}.ffn_{kind}_exps.weight", raw, raw_dtype=qtype)
            array = dequantize(raw, qtype)
        held.append(torch.from_numpy(array.copy()))
    return torch.cat(held, dim=1)


def llama_cpp_permute(rows, num_heads: int):
    """llama.cpp's q/k row order (written independently of ladder's inverse): per head,
    rows [2, half] -> [half, 2]. Works on any array whose first axis is rows."""
    shape = rows.shape
    return rows.reshape(num_heads, 2, shape[0] // num_heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def random_raw_blocks(qtype, rows: int, cols: int, rng):
    """Random but well-scaled raw blocks for types the gguf package cannot quantize (K-quants, IQ4)."""
    import gguf
    import numpy as np

    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block_elems, block_bytes), dtype=np.uint8)
    if qtype in (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q5_K):
        # d, dmin (f16); 12 bytes packing eight 6-bit scales and mins (all set to 1 here, so each value
        # is d * q - dmin with q a random nibble, or 5-bit code for Q5_K: centred near zero); Q5_K's 32
        # bytes of fifth bits; 128 bytes of nibbles.
        five = qtype == gguf.GGMLQuantizationType.Q5_K
        raw[..., 0:2] = np.array([0.01 if five else 0.02], dtype=np.float16).view(np.uint8)
        raw[..., 2:4] = np.array([0.15], dtype=np.float16).view(np.uint8)
        raw[..., 4:12] = 1
        raw[..., 12:16] = 0x11
    elif qtype == gguf.GGMLQuantizationType.Q6_K:  # ql[128], qh[64], scales[16] int8, d (f16)
        raw[..., 192:208] = rng.integers(-4, 5, size=raw[..., 192:208].shape).astype(np.int8).view(np.uint8)
        raw[..., 208:210] = np.array([0.005], dtype=np.float16).view(np.uint8)
    elif qtype == gguf.GGMLQuantizationType.Q3_K:  # hmask[32], qs[64], 12 bytes of 6-bit scales, d (f16)
        raw[..., 96:108] = rng.integers(0, 256, size=raw[..., 96:108].shape, dtype=np.uint8)
        raw[..., 108:110] = np.array([0.002], dtype=np.float16).view(np.uint8)
    elif qtype == gguf.GGMLQuantizationType.IQ4_NL:  # d (f16), 16 bytes of 4-bit indices
        raw[..., 0:2] = np.array([0.0005], dtype=np.float16).view(np.uint8)
    elif qtype == gguf.GGMLQuantizationType.IQ4_XS:  # d (f16), scales_h, scales_l, 128 bytes of indices
        raw[..., 0:2] = np.array([0.00005], dtype=np.float16).view(np.uint8)
    else:
        raise ValueError(qtype)
    return raw.reshape(rows, -1)


def copy_smollm2_tokenizer(writer, special_tokens: Sequence[str] = (), eos_token: str | None = None,
                           chat_template: str | None = None, pre: str | None = None) -> None:
    """The embedded model's tokenizer (tokens, merges, chat template) into a GGUF being written, with
    `special_tokens` added after its vocabulary as control tokens (as llama.cpp's converter writes a
    tokenizer's special added tokens), and another EOS token, chat template or pre-tokenizer name
    (`tokenizer.ggml.pre`: another family's splitting rules over the same vocabulary) if given."""
    from model.default import default_model_path
    from model.gguf_checkpoint import GGUFCheckpoint

    meta = GGUFCheckpoint(default_model_path()).metadata
    tokens = [*meta["tokenizer.ggml.tokens"], *special_tokens]
    writer.add_tokenizer_model(meta["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(pre or meta["tokenizer.ggml.pre"])
    writer.add_token_list(tokens)
    writer.add_token_types([*meta["tokenizer.ggml.token_type"], *[3] * len(special_tokens)])
    writer.add_token_merges(meta["tokenizer.ggml.merges"])
    writer.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(tokens.index(eos_token) if eos_token else meta["tokenizer.ggml.eos_token_id"])
    writer.add_chat_template(chat_template or meta["tokenizer.chat_template"])


def gemma4_vocab_metadata() -> dict:
    """A Gemma 4-style GGUF vocabulary (`tokenizer.ggml.model` gemma4: SentencePiece pieces with BPE merges)
    made of the packaged Gemma 3 270M file's 262,144 pieces, its merges derived from their scores (as
    ladder reads a SentencePiece vocabulary), its token types, BOS and EOS: metadata keys -> values."""
    from model.default import packaged_model_path
    from model.gguf_checkpoint import GGUFCheckpoint
    from model.gguf_vocab import _merges_from_scores

    meta = GGUFCheckpoint(packaged_model_path("gemma-3-270m")).metadata
    tokens = [str(t) for t in meta["tokenizer.ggml.tokens"]]
    types = [int(t) for t in meta["tokenizer.ggml.token_type"]]
    merges = _merges_from_scores(tokens, [float(x) for x in meta["tokenizer.ggml.scores"]], types)
    return {"tokenizer.ggml.model": "gemma4", "tokenizer.ggml.pre": "gemma4", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": [f"{a} {b}" for a, b in merges],
            "tokenizer.ggml.bos_token_id": meta["tokenizer.ggml.bos_token_id"],
            "tokenizer.ggml.eos_token_id": meta["tokenizer.ggml.eos_token_id"],
            "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_space_prefix": False}


def write_vocab_metadata(writer, vocab: dict) -> None:
    """`gemma4_vocab_metadata`'s keys into a GGUF being written, as llama.cpp's converter writes them."""
    writer.add_tokenizer_model(vocab["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(vocab["tokenizer.ggml.pre"])
    writer.add_token_list(vocab["tokenizer.ggml.tokens"])
    writer.add_token_types(vocab["tokenizer.ggml.token_type"])
    writer.add_token_merges(vocab["tokenizer.ggml.merges"])
    writer.add_bos_token_id(vocab["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(vocab["tokenizer.ggml.eos_token_id"])
    writer.add_add_bos_token(vocab["tokenizer.ggml.add_bos_token"])
    writer.add_add_space_prefix(vocab["tokenizer.ggml.add_space_prefix"])


def write_gemma4_metadata(writer, cfg) -> None:
    """A Gemma 4 text config's metadata as llama.cpp's converter writes it (conversion/gemma.py Gemma4Model):
    head sizes and KV heads per kind of layer, widths per layer, the window pattern, the shared-cache layers,
    the per-layer embeddings' width, both RoPE bases, and proportional RoPE as a `rope_freqs` tensor of 1
    (rotated pairs) and 1e30 (the others)."""
    import numpy as np

    n = cfg.num_hidden_layers
    swa = [t == "sliding_attention" for t in cfg.layer_types]
    (head_swa, kv_swa), (head_full, kv_full) = (
        (cfg.per_layer_config[swa.index(kind)].head_dim, cfg.per_layer_config[swa.index(kind)].num_key_value_heads)
        for kind in (True, False))
    writer.add_key_length(head_full)
    writer.add_value_length(head_full)
    writer.add_key_length_swa(head_swa)
    writer.add_value_length_swa(head_swa)
    writer.add_head_count_kv([kv_swa if s else kv_full for s in swa])
    shared = cfg.num_kv_shared_layers
    double = cfg.use_double_wide_mlp
    writer.add_feed_forward_length([cfg.intermediate_size * (2 if double and i >= n - shared else 1) for i in range(n)])
    writer.add_sliding_window(cfg.sliding_window)
    writer.add_sliding_window_pattern(swa)
    writer.add_shared_kv_layers(shared)
    writer.add_embedding_length_per_layer_input(cfg.hidden_size_per_layer_input or 0)
    writer.add_rope_freq_base_swa(cfg.rope_parameters["sliding_attention"]["rope_theta"])
    writer.add_rope_dimension_count(head_full)
    writer.add_rope_dimension_count_swa(head_swa)
    if cfg.enable_moe_block:
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.top_k_experts)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if cfg.final_logit_softcapping:
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    rotated = int(head_full * cfg.rope_parameters["full_attention"]["partial_rotary_factor"] / 2)
    factors = [1.0] * rotated + [1e30] * (head_full // 2 - rotated)
    writer.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32))


def write_byte_vocab(writer, vocab_size: int) -> None:
    """A vocabulary of the 256 byte tokens and control tokens up to `vocab_size` (eos 256, bos 257)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    byte_tokens = list(bytes_to_unicode().values())
    extra = [f"<|extra_{i}|>" for i in range(vocab_size - 256)]
    writer.add_token_list(byte_tokens + extra)
    writer.add_token_types([1] * 256 + [3] * len(extra))
    writer.add_token_merges([])
    writer.add_eos_token_id(256)
    writer.add_bos_token_id(257)


def write_gguf(hf_model, path: Path, qtype_name: str = "F32", arch: str = "llama", rng_seed: int = 0,
               qtypes: dict[str, str] | None = None, smollm2_tokenizer: bool | dict = False,
               reranker: tuple[int, int] | None = None, vocab: dict | None = None,
               fused_experts: bool | None = None) -> dict:
    """Write `hf_model` as a GGUF with every 2-D weight in `qtype_name`, or in qtypes[part] for the tensors
    whose GGUF name has that part ("attn_v", "output", ...: a K-quant file's mix of types); norms stay F32.
    The vocabulary is 256 byte tokens and control tokens, or with `smollm2_tokenizer` the embedded model's
    (its 49,152 tokens, merges and chat template: `hf_model` needs that vocabulary size; a dict: the keyword
    arguments of `copy_smollm2_tokenizer`, for a vocabulary with tokens added). `reranker` (the
    ids of "yes" and "no") writes the file as llama.cpp converts Qwen3-Reranker: pooling type rank, labels
    "yes" and "no", their LM-head rows as `cls.output.weight` in place of the LM head. `vocab`: a vocabulary's
    metadata (`gemma4_vocab_metadata`) in place of either. `fused_experts`: stacked experts' gate and up as one
    `ffn_gate_up_exps` (True) or two tensors (False); None: as llama.cpp's converter writes the family (Gemma 4's
    fused, the others' apart).

    Returns the state dict the file actually holds after quantization, in Hugging Face names and
    layout, to load into the reference model (row permutations commute with row-wise quantization,
    so the reference never needs ladder's inverse permutation).
    """
    import gguf
    import numpy as np
    from gguf.quants import dequantize, quantize

    cfg = hf_model.config
    qtype = gguf.GGMLQuantizationType[qtype_name]
    rng = np.random.default_rng(rng_seed)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    if arch != "gemma4":
        writer.add_feed_forward_length(cfg.intermediate_size)
    if getattr(cfg, "num_local_experts", 0):  # Qwen3-MoE (arch qwen3moe), Mixtral (arch llama)
        writer.add_expert_count(cfg.num_local_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_feed_forward_length(getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    if arch != "gemma4":
        writer.add_head_count_kv(cfg.num_key_value_heads)
    # Gemma 3 keeps RoPE parameters per layer type; the file's base is the full-attention layers'.
    writer.add_rope_freq_base(cfg.rope_parameters.get("full_attention", cfg.rope_parameters)["rope_theta"])
    if arch == "gemma4":  # heads of two sizes (whose config refuses a single head_dim)
        write_gemma4_metadata(writer, cfg)
    else:
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        if arch == "gemma3" or head_dim != cfg.hidden_size // cfg.num_attention_heads:  # as llama.cpp writes them
            writer.add_key_length(head_dim)
            writer.add_value_length(head_dim)
    if arch == "gemma3":
        writer.add_sliding_window(cfg.sliding_window)
        writer.add_array(f"{arch}.attention.sliding_window_pattern",
                         [t == "sliding_attention" for t in cfg.layer_types])
    if arch == "phi3":  # as llama.cpp's converter writes Phi-3: the rotated dims, LongRoPE's factors as tensors
        rope = cfg.rope_parameters
        rotary = int(head_dim * rope.get("partial_rotary_factor", 1.0))
        writer.add_rope_dimension_count(rotary)
        writer.add_sliding_window(cfg.sliding_window or 0)
        if rope.get("long_factor"):
            original = rope["original_max_position_embeddings"]
            scale = cfg.max_position_embeddings / original
            writer.add_rope_scaling_orig_ctx_len(original)
            writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
            writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
            writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    if rope.get("rope_type") == "yarn":  # as llama.cpp's converter writes YaRN
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        for key in ("beta_fast", "beta_slow"):
            if rope.get(key) is not None:
                getattr(writer, f"add_rope_scaling_yarn_{key}")(rope[key])
    if arch == "mistral3":  # as llama.cpp's converter writes Ministral 3
        writer.add_rope_scaling_yarn_log_mul(rope["mscale_all_dim"])
        writer.add_attn_temperature_scale(rope["llama_4_scaling_beta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    if vocab is not None:
        write_vocab_metadata(writer, vocab)
    elif smollm2_tokenizer:
        copy_smollm2_tokenizer(writer, **(smollm2_tokenizer if isinstance(smollm2_tokenizer, dict) else {}))
    else:
        write_byte_vocab(writer, cfg.vocab_size)
    if reranker is not None:
        writer.add_pooling_type(gguf.PoolingType.RANK)
        writer.add_array(f"{arch}.classifier.output_labels", ["yes", "no"])
        head = hf_model.get_output_embeddings().weight.detach().float()
        writer.add_tensor("cls.output.weight", head[list(reranker)].numpy().astype(np.float32))

    if cfg.rope_parameters.get("rope_type") == "llama3":
        # llama.cpp stores Llama 3 scaling as per-frequency divisors in a `rope_freqs` tensor.
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg)
        dim = cfg.head_dim
        plain = 1.0 / (cfg.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2).float() / dim))
        writer.add_tensor("rope_freqs.weight", (plain / scaled).numpy().astype(np.float32))

    held = {}
    for name, tensor in hf_model.state_dict().items():
        array = tensor.float().numpy()
        if name == "lm_head.weight" and (cfg.tie_word_embeddings or reranker is not None):
            continue
        if ".mlp.experts." in name or (arch == "gemma4" and ".experts." in name):  # llama.cpp's 3-D tensors
            fused = arch == "gemma4" if fused_experts is None else fused_experts
            held[name] = write_gguf_experts(writer, name, tensor, qtype, fused_gate_up=fused)
            continue
        scale = next((part for key, part in GEMMA4_GGUF_ROUTER_SCALES.items() if name.endswith(key)), None)
        if arch == "gemma4" and scale is not None:  # a router's scale vector, F32 as llama.cpp keeps norms
            writer.add_tensor(f"blk.{name.removeprefix('model.').split('.')[1]}.{scale}", array)
            held[name] = tensor.float()
            continue
        short = name.removeprefix("model.")
        if short.startswith("layers."):
            _, layer, *rest = short.split(".")
            module, kind = ".".join(rest[:-1]), rest[-1]
            names = {"gemma3": GEMMA_GGUF_LAYER_NAMES, "gemma4": GEMMA4_GGUF_LAYER_NAMES,
                     "phi3": PHI3_GGUF_LAYER_NAMES}.get(arch, GGUF_LAYER_NAMES)
            gguf_name = (f"blk.{layer}.layer_output_scale.weight" if kind == "layer_scalar"
                         else f"blk.{layer}.{names[module]}.{kind}")
        else:
            gguf_name = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
                         "lm_head.weight": "output.weight", "embed_tokens_per_layer.weight": "per_layer_token_embd.weight",
                         "per_layer_model_projection.weight": "per_layer_model_proj.weight",
                         "per_layer_projection_norm.weight": "per_layer_proj_norm.weight"}[short]
        tensor_type = qtype
        for part, name_of_type in (qtypes or {}).items():
            if f".{part}." in f".{gguf_name}":
                tensor_type = gguf.GGMLQuantizationType[name_of_type]
        if array.ndim == 2 and tensor_type != gguf.GGMLQuantizationType.F32:
            if tensor_type.name in ("Q4_K", "Q5_K", "Q6_K", "Q3_K", "IQ4_NL", "IQ4_XS"):
                raw = random_raw_blocks(tensor_type, *array.shape, rng)
            else:
                raw = quantize(array, tensor_type)
            array = dequantize(raw, tensor_type)
        else:
            raw = array
        held[name] = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))
        if arch == "gemma3" and name.endswith("norm.weight"):
            raw = raw + 1.0  # llama.cpp's files store Gemma's norm scale (1 + w)
        if arch in ("llama", "smollm3", "mistral3") and (".q_proj." in name or ".k_proj." in name):
            heads = cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads
            raw = llama_cpp_permute(raw, heads)
        raw = np.ascontiguousarray(raw)
        if raw.dtype in (np.float32, np.float16):
            writer.add_tensor(gguf_name, raw)
        else:
            writer.add_tensor(gguf_name, raw, raw_dtype=tensor_type)
    if cfg.tie_word_embeddings:
        held["lm_head.weight"] = held["model.embed_tokens.weight"]
    write_and_close(writer)
    return held


QWEN35_GGUF_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "linear_attn.in_proj_qkv": "attn_qkv", "linear_attn.in_proj_z": "attn_gate", "linear_attn.in_proj_b": "ssm_beta",
    "linear_attn.in_proj_a": "ssm_alpha", "linear_attn.in_proj_ba": "ssm_ba", "linear_attn.out_proj": "ssm_out",
    "linear_attn.norm": "ssm_norm",
    "linear_attn.conv1d": "ssm_conv1d", "mlp.gate": "ffn_gate_inp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
}


def tile_value_heads(tensor: torch.Tensor, dim: int, key_heads: int, value_heads: int, size: int) -> torch.Tensor:
    """Value heads (each `size` wide along `dim`) from grouped by key head to tiled, as llama.cpp's converter
    orders them: [k0v0, k0v1, k1v0, k1v1] -> [k0v0, k1v0, k0v1, k1v1]."""
    shape = list(tensor.shape)
    grouped = tensor.reshape(*shape[:dim], key_heads, value_heads // key_heads, size, *shape[dim + 1:])
    return grouped.transpose(dim, dim + 1).reshape(shape)


def untile_value_heads(tensor: torch.Tensor, dim: int, key_heads: int, value_heads: int, size: int) -> torch.Tensor:
    shape = list(tensor.shape)
    tiled = tensor.reshape(*shape[:dim], value_heads // key_heads, key_heads, size, *shape[dim + 1:])
    return tiled.transpose(dim, dim + 1).reshape(shape)


def write_qwen35_gguf(hf_model, path: Path, qtype_name: str = "F32", smollm2_tokenizer: bool = False,
                      mtp: bool = False) -> dict:
    """A Qwen3.5 text model as llama.cpp's converter writes it (arch qwen35): norms as 1 + w (the linear
    attention's output norm as it is), ssm_a = -exp(A_log), dt_bias as `ssm_dt.bias`, the convolution [C, K], the
    linear attention's value heads tiled; 2-D weights in `qtype_name`, norms and vectors F32. A Qwen3-Next (arch
    qwen3next): value heads as they are, in_proj_qkvz split into attn_qkv and attn_gate, in_proj_ba as it is
    (`ssm_ba`). Returns the state dict
    the file holds, in Hugging Face names and layout. `smollm2_tokenizer`: the embedded model's vocabulary (as
    `write_gguf`'s). `mtp`: a multi-token-prediction layer after the others, as the converter writes a checkpoint's
    `mtp.*` (block_count one more, `nextn_predict_layers` 1, the layer's attention and `nextn.*` tensors, random)."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize, quantize

    cfg = hf_model.config
    qtype = gguf.GGMLQuantizationType[qtype_name]
    hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    moe = getattr(cfg, "num_experts", 0)
    qwen3_next = cfg.model_type == "qwen3_next"
    writer = gguf.GGUFWriter(str(path), "qwen3next" if qwen3_next else "qwen35moe" if moe else "qwen35")
    writer.add_block_count(cfg.num_hidden_layers + mtp)
    if mtp:
        writer.add_nextn_predict_layers(1)
        extra = f"blk.{cfg.num_hidden_layers}."
        h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        for name, shape in (("attn_q.weight", (2 * q, h)), ("attn_k.weight", (kv, h)), ("attn_v.weight", (kv, h)),
                            ("attn_output.weight", (h, q)), ("attn_norm.weight", (h,)), ("nextn.eh_proj.weight",
                            (h, 2 * h)), ("nextn.enorm.weight", (h,)), ("nextn.hnorm.weight", (h,))):
            writer.add_tensor(extra + name, np.random.default_rng(0).standard_normal(shape).astype(np.float32))
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    if moe:  # (no dense MLP: no feed_forward_length, as llama.cpp's converter writes Qwen3.5-MoE)
        if qwen3_next:  # (its dense layers' width)
            writer.add_feed_forward_length(cfg.intermediate_size)
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    else:
        writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(int(cfg.head_dim * cfg.rope_parameters["partial_rotary_factor"]))
    if not qwen3_next:
        writer.add_rope_dimension_sections(list(cfg.rope_parameters["mrope_section"]) + [0])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    writer.add_ssm_state_size(dk)
    writer.add_ssm_group_count(hk)
    writer.add_ssm_time_step_rank(hv)
    writer.add_ssm_inner_size(dv * hv)
    writer.add_full_attention_interval(cfg.layer_types.index("full_attention") + 1)
    writer.add_vocab_size(cfg.vocab_size)
    if smollm2_tokenizer:
        copy_smollm2_tokenizer(writer)
    else:
        write_byte_vocab(writer, cfg.vocab_size)

    def tiled(name: str, tensor: torch.Tensor) -> tuple[torch.Tensor, callable]:
        """The tensor as the file orders it, and the inverse for what it holds."""
        identity = (tensor, lambda t: t)
        if hk == hv or qwen3_next or "linear_attn." not in name:
            return identity
        channels = 2 * hk * dk
        if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
            qk, v = tensor[:channels], tensor[channels:]
            return (torch.cat([qk, tile_value_heads(v, 0, hk, hv, dv)]),
                    lambda t: torch.cat([t[:channels], untile_value_heads(t[channels:], 0, hk, hv, dv)]))
        if name.endswith("in_proj_z.weight"):
            return tile_value_heads(tensor, 0, hk, hv, dv), lambda t: untile_value_heads(t, 0, hk, hv, dv)
        if name.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
            return tile_value_heads(tensor, 0, hk, hv, 1), lambda t: untile_value_heads(t, 0, hk, hv, 1)
        if name.endswith("out_proj.weight"):
            return tile_value_heads(tensor, 1, hk, hv, dv), lambda t: untile_value_heads(t, 1, hk, hv, dv)
        return identity

    def add_matrix(gguf_name: str, raw: torch.Tensor) -> torch.Tensor:
        """A 2-D weight in `qtype`; what the file holds."""
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, np.ascontiguousarray(raw.numpy(), dtype=np.float32))
            return raw
        blocks = quantize(raw.numpy(), qtype)
        writer.add_tensor(gguf_name, blocks, raw_dtype=qtype)
        return torch.from_numpy(np.ascontiguousarray(dequantize(blocks, qtype), dtype=np.float32))

    held = {}
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        short = name.removeprefix("model.")
        if name.endswith("in_proj_qkvz.weight"):  # per key head [q, k, v, z] -> every q, k, v; every z
            layer, h, per_key = short.split(".")[1], tensor.shape[1], [dk, dk, hv // hk * dv, hv // hk * dv]
            q, k, v, z = tensor.float().view(hk, -1, h).split(per_key, dim=1)
            qkv = add_matrix(f"blk.{layer}.attn_qkv.weight", torch.cat([x.reshape(-1, h) for x in (q, k, v)]))
            z = add_matrix(f"blk.{layer}.attn_gate.weight", z.reshape(-1, h))
            q, k, v = qkv.split([hk * dk, hk * dk, hv * dv])
            held[name] = torch.cat([x.reshape(hk, -1, h) for x in (q, k, v, z)], dim=1).reshape(-1, h)
            continue
        if ".mlp.experts." in name:  # llama.cpp's stacks [E, out, in]
            held[name] = write_gguf_experts(writer, name, tensor, qtype)
            continue
        if name.endswith("shared_expert_gate.weight"):  # a vector [H] in the file
            writer.add_tensor(f"blk.{short.split('.')[1]}.ffn_gate_inp_shexp.weight", tensor.float()[0].numpy())
            held[name] = tensor.float()
            continue
        tensor, back = tiled(name, tensor.float())
        if short.startswith("layers."):
            _, layer, *rest = short.split(".")
            module, kind = ".".join(rest[:-1]), rest[-1]
            if kind == "A_log":
                gguf_name, raw = f"blk.{layer}.ssm_a", -torch.exp(tensor)
            elif kind == "dt_bias":
                gguf_name, raw = f"blk.{layer}.ssm_dt.bias", tensor
            elif module == "linear_attn.conv1d":
                gguf_name, raw = f"blk.{layer}.ssm_conv1d.weight", tensor[:, 0]
            else:
                gguf_name, raw = f"blk.{layer}.{QWEN35_GGUF_NAMES[module]}.{kind}", tensor
        else:
            gguf_name = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
                         "lm_head.weight": "output.weight"}[short]
            raw = tensor
        raw = raw.numpy()
        if raw.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32 and "conv1d" not in gguf_name:
            blocks = quantize(raw, qtype)
            writer.add_tensor(gguf_name, blocks, raw_dtype=qtype)
            held[name] = back(torch.from_numpy(np.ascontiguousarray(dequantize(blocks, qtype), dtype=np.float32)))
            continue
        if name.endswith("norm.weight") and "linear_attn" not in name:
            raw = raw + 1.0  # llama.cpp's files store the (1 + w) scale
        writer.add_tensor(gguf_name, np.ascontiguousarray(raw, dtype=np.float32))
        held[name] = back(tensor)
    if cfg.tie_word_embeddings:
        held["lm_head.weight"] = held["model.embed_tokens.weight"]
    write_and_close(writer)
    return held


def write_gpt_oss_gguf(hf_model, path: Path, qtype_name: str = "F32", expert_type: str = "MXFP4",
                       smollm2_tokenizer: bool = False) -> dict:
    """A GPT-OSS as llama.cpp's converter writes it (arch gpt-oss): experts split into gate, up and down stacks
    [E, out, in] of `expert_type` with F32 biases, the router and every projection's bias, the sinks as
    `attn_sinks.weight`, the norm before the experts as `post_attention_norm`; other 2-D weights in
    `qtype_name`. The vocabulary: 256 byte tokens and control tokens, or SmolLM2's (`smollm2_tokenizer`, for
    llama.cpp). Returns the state dict the file holds, in transformers' names and layout."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize, quantize

    cfg = hf_model.config
    writer = gguf.GGUFWriter(str(path), "gpt-oss")
    rope = cfg.rope_parameters
    for add, value in (("block_count", cfg.num_hidden_layers), ("context_length", cfg.max_position_embeddings),
                       ("embedding_length", cfg.hidden_size), ("feed_forward_length", cfg.intermediate_size),
                       ("expert_count", cfg.num_local_experts), ("expert_used_count", cfg.num_experts_per_tok),
                       ("expert_feed_forward_length", cfg.intermediate_size), ("head_count", cfg.num_attention_heads),
                       ("head_count_kv", cfg.num_key_value_heads), ("key_length", cfg.head_dim),
                       ("value_length", cfg.head_dim), ("rope_freq_base", rope["rope_theta"]),
                       ("sliding_window", cfg.sliding_window), ("layer_norm_rms_eps", cfg.rms_norm_eps),
                       ("vocab_size", cfg.vocab_size), ("rope_scaling_factor", rope["factor"]),
                       ("rope_scaling_orig_ctx_len", rope["original_max_position_embeddings"])):
        getattr(writer, f"add_{add}")(value)
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    if smollm2_tokenizer:
        copy_smollm2_tokenizer(writer)
    else:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("gpt-4o")
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        extra = [f"<|extra_{i}|>" for i in range(cfg.vocab_size - 256)]
        writer.add_token_list(list(bytes_to_unicode().values()) + extra)
        writer.add_token_types([1] * 256 + [3] * len(extra))
        writer.add_token_merges([])
        writer.add_eos_token_id(256)

    def add(name: str, array, kind: str) -> np.ndarray:
        """Write `array` as `kind` (F32 left as it is); returns what the file holds, as float32."""
        qtype = gguf.GGMLQuantizationType[kind]
        if qtype == gguf.GGMLQuantizationType.F32 or array.ndim == 1:
            writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
            return array
        raw = quantize(np.ascontiguousarray(array, dtype=np.float32), qtype)
        writer.add_tensor(name, raw, raw_dtype=qtype)
        return dequantize(raw, qtype).reshape(array.shape)

    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.router": "ffn_gate_inp"}
    held = {}
    for name, tensor in hf_model.state_dict().items():
        array, short = tensor.float().numpy(), name.removeprefix("model.")
        if not short.startswith("layers."):
            gguf_name = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
                         "lm_head.weight": "output.weight"}[short]
            held[name] = torch.from_numpy(np.array(add(gguf_name, array, "F32" if "norm" in short else qtype_name)))
            continue
        _, layer, *rest = short.split(".")
        module, kind = ".".join(rest[:-1]), rest[-1]
        p = f"blk.{layer}."
        if module == "self_attn" and kind == "sinks":
            held[name] = torch.from_numpy(add(p + "attn_sinks.weight", array, "F32"))
        elif kind in ("gate_up_proj", "gate_up_proj_bias"):  # [E, H, 2I] / [E, 2I]: gate and up interleaved
            suffix = "bias" if kind.endswith("bias") else "weight"
            parts = [array[..., 0::2], array[..., 1::2]]
            if suffix == "weight":  # [E, H, I] -> [E, I, H]
                parts = [part.transpose(0, 2, 1) for part in parts]
            out = [add(p + f"ffn_{which}_exps.{suffix}", part, expert_type if suffix == "weight" else "F32")
                   for which, part in zip(("gate", "up"), parts)]
            if suffix == "weight":
                out = [part.transpose(0, 2, 1) for part in out]
            merged = np.empty_like(array)
            merged[..., 0::2], merged[..., 1::2] = out
            held[name] = torch.from_numpy(merged)
        elif kind in ("down_proj", "down_proj_bias"):  # [E, I, H] -> [E, H, I]
            if kind == "down_proj":
                held[name] = torch.from_numpy(np.ascontiguousarray(
                    add(p + "ffn_down_exps.weight", array.transpose(0, 2, 1), expert_type).transpose(0, 2, 1)))
            else:
                held[name] = torch.from_numpy(add(p + "ffn_down_exps.bias", array, "F32"))
        else:
            kind_of = "F32" if "norm" in module or kind == "bias" or module == "mlp.router" else qtype_name
            held[name] = torch.from_numpy(np.array(add(p + f"{names[module]}.{kind}", array, kind_of)))
    write_and_close(writer)
    return held


def make_tiny_chat_model(directory: Path, seed: int = 0) -> Path:
    """A tiny random Llama with SmolLM2's real tokenizer and chat template: a fast stand-in for serving tests
    (its text is noise, but every token, template and length path is real)."""
    import json

    import transformers

    from model.default import default_model_path
    from model.gguf_checkpoint import GGUFCheckpoint
    from model.tokenizer import Tokenizer

    metadata = GGUFCheckpoint(default_model_path()).metadata
    tokenizer = Tokenizer.from_gguf_metadata(metadata, "default")
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token, "add_bos_token": False,
        "chat_template": tokenizer.chat_template,
    }))
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory, safe_serialization=True)
    return directory


# A Qwen3-style ChatML template: past reasoning is shown from `reasoning_content`; `enable_thinking` false
# writes an empty closed block into the prompt (as Qwen3's does), `open_thinking` opens the block for the
# reply (as QwQ's and newer DeepSeek-R1 templates do).
THINKING_TEMPLATE = """\
{%- for message in messages %}
{%- if message.role == 'assistant' %}<|im_start|>assistant
{% if message.reasoning_content %}<think>
{{ message.reasoning_content }}
</think>

{% endif %}{{ message.content or '' }}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% elif open_thinking %}<think>
{% endif %}{% endif %}"""


def write_thinking_tokenizer(directory: Path, chat_template: str):
    """SmolLM2's vocabulary plus <think>, </think>, <tool_call> and </tool_call> (ids 49152-49155, added tokens decoded
    as text, as Qwen's are) and `chat_template`, written to `directory`; returns the tokenizer before the additions."""
    import json

    import tokenizers

    from model.default import default_model_path
    from model.gguf_checkpoint import GGUFCheckpoint
    from model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf_metadata(GGUFCheckpoint(default_model_path()).metadata, "default")
    tokenizer.backend.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False)
                                  for t in ("<think>", "</think>", "<tool_call>", "</tool_call>")])
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token, "add_bos_token": False,
        "chat_template": chat_template,
    }))
    return tokenizer


def make_tiny_thinking_model(directory: Path, seed: int = 0) -> Path:
    """A tiny random Llama over `write_thinking_tokenizer`'s vocabulary whose chat template is THINKING_TEMPLATE: a
    stand-in for a reasoning model."""
    import transformers

    tokenizer = write_thinking_tokenizer(directory, THINKING_TEMPLATE)
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=tokenizer.backend.get_vocab_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory, safe_serialization=True)
    return directory


# Gemma 4's control tokens as its Hugging Face tokenizer holds them: special added tokens (ids 49,152 on, after
# SmolLM2's vocabulary in the tiny model); ladder keeps the thinking, tool-call and quote markers in decoded text.
GEMMA4_CHAT_TOKENS = ("<|turn>", "<turn|>", "<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>",
                      "<|tool_response>", "<tool_response|>", '<|"|>', "<|tool>", "<tool|>", "<|think|>")
# A Gemma 4-style chat template, written for these tests: turns between <|turn>ROLE and <turn|>, tools declared
# in the system turn, past calls in Gemma's notation, results as tool responses, and <|think|> when thinking
# is on. The published templates say much more (their tool declarations especially); this is the markup only.
GEMMA4_CHAT_TEMPLATE = """{{- bos_token -}}
{%- if tools or enable_thinking or messages[0].role == 'system' %}<|turn>system
{% if enable_thinking %}<|think|>{% endif %}{% if messages[0].role == 'system' %}{{ messages[0].content }}{% endif %}
{%- for tool in tools or [] %}<|tool>declaration:{{ tool.function.name }}{}<tool|>{% endfor %}<turn|>
{% endif %}
{%- for m in messages if m.role != 'system' %}
{%- if m.role == 'assistant' %}<|turn>model
{% for call in m.tool_calls or [] %}<|tool_call>call:{{ call.function.name }}{}<tool_call|>{% endfor %}{{ m.content or '' }}<turn|>
{% elif m.role == 'tool' %}<|tool_response>response:{{ m.content }}<tool_response|>
{% else %}<|turn>{{ m.role }}
{{ m.content }}<turn|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|turn>model
{% endif %}"""


def make_tiny_gemma4_chat_model(directory: Path, seed: int = 0) -> Path:
    """A tiny random Gemma 4 (the `gemma4` family's shape) over SmolLM2's vocabulary plus GEMMA4_CHAT_TOKENS as
    special tokens, EOS <turn|>, and GEMMA4_CHAT_TEMPLATE: a stand-in for a Gemma 4 checkpoint's chat."""
    import transformers

    tokenizer = write_smollm2_tokenizer(directory, GEMMA4_CHAT_TOKENS, "<turn|>", GEMMA4_CHAT_TEMPLATE)
    torch.manual_seed(seed)
    config = hf_config("gemma4", vocab_size=tokenizer.backend.get_vocab_size())
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory, safe_serialization=True)
    return directory


# GPT-OSS's harmony tokens as its Hugging Face tokenizer holds them (special added tokens, ids 49,152 on in the tiny
# model); ladder keeps the header markers in decoded text and stops at <|return|> and <|call|>, not <|end|>.
HARMONY_TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
# A harmony chat template, written for these tests after the published one's markup: the system message with the
# reasoning effort and the tools' names, messages between <|start|>ROLE and <|end|>, a past call as a message to the
# function (with its analysis from `thinking`), a result as the function's message, the generation prompt
# <|start|>assistant. The published template says much more (its tool declarations especially).
HARMONY_CHAT_TEMPLATE = """<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}
{%- for tool in tools or [] %} tool:{{ tool.function.name }}{% endfor %}<|end|>
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}
{%- if m.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>{% endif %}
{%- set call = m.tool_calls[0].function %}<|start|>assistant to=functions.{{ call.name }}<|channel|>commentary json\
<|message|>{{ call.arguments | tojson }}<|call|>
{%- elif m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>
{%- elif m.role == 'tool' %}<|start|>functions.tool to=assistant<|channel|>commentary<|message|>{{ m.content }}<|end|>
{%- else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start|>assistant{% endif %}"""


def make_tiny_harmony_chat_model(directory: Path, seed: int = 0) -> Path:
    """A tiny random GPT-OSS (the `gpt_oss` family's shape) over SmolLM2's vocabulary plus HARMONY_TOKENS as special
    tokens, EOS <|return|>, and HARMONY_CHAT_TEMPLATE: a stand-in for a GPT-OSS checkpoint's chat."""
    import json

    import transformers

    tokenizer = write_smollm2_tokenizer(directory, HARMONY_TOKENS, "<|return|>", HARMONY_CHAT_TEMPLATE)
    vocab = tokenizer.backend.get_vocab()
    (directory / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [vocab["<|return|>"], vocab["<|call|>"]]}))
    torch.manual_seed(seed)
    config = hf_config(GPT_OSS, vocab_size=tokenizer.backend.get_vocab_size())
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory, safe_serialization=True)
    return directory


# A Qwen3.5-style chat template, written for these tests: ChatML turns, tools listed as JSON in the system turn,
# past calls in the XML notation (each argument bare), results as tool responses, and the reply's <think> block
# opened by the generation prompt unless enable_thinking is false (an empty block then).
QWEN3_5_CHAT_TEMPLATE = """\
{%- if tools %}<|im_start|>system
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools><|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' %}<|im_start|>assistant
{{ m.content or '' }}
{%- for call in m.tool_calls or [] %}
<tool_call>
<function={{ call.function.name }}>
{% for key, value in call.function.arguments | items %}<parameter={{ key }}>
{{ value | tojson if value is mapping or (value is sequence and value is not string) else value | string }}
</parameter>
{% endfor %}</function>
</tool_call>
{%- endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
<think>
{% if enable_thinking is defined and enable_thinking is false %}
</think>

{% endif %}{% endif %}"""


def make_tiny_qwen3_5_chat_model(directory: Path, seed: int = 0) -> Path:
    """A tiny random Qwen3.5 (the `qwen3_5` family's shape) over `write_thinking_tokenizer`'s vocabulary (Qwen's
    <think> and <tool_call> markers) and QWEN3_5_CHAT_TEMPLATE."""
    import transformers

    tokenizer = write_thinking_tokenizer(directory, QWEN3_5_CHAT_TEMPLATE)
    torch.manual_seed(seed)
    config = hf_config(QWEN3_5, vocab_size=tokenizer.backend.get_vocab_size())
    config.eos_token_id = tokenizer.eos_token_id
    spread_qwen3_5_parameters(transformers.AutoModelForCausalLM.from_config(config)).save_pretrained(
        directory, safe_serialization=True)
    return directory


def write_smollm2_tokenizer(directory: Path, special_tokens: Sequence[str], eos_token: str, chat_template: str):
    """SmolLM2's tokenizer with `special_tokens` added (special, ids from 49,152 on) saved in `directory` as
    tokenizer.json and tokenizer_config.json with `eos_token` and `chat_template`; returns it."""
    import json

    import tokenizers

    from model.default import default_model_path
    from model.gguf_checkpoint import GGUFCheckpoint
    from model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf_metadata(GGUFCheckpoint(default_model_path()).metadata, "default")
    tokenizer.backend.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                                          for t in special_tokens])
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": tokenizer.bos_token, "eos_token": eos_token, "add_bos_token": False,
        "chat_template": chat_template,
    }))
    return tokenizer


# SmolVLM's chat template: a message's content is a list of parts, an image part written as <image>.
VISION_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
VISION_TOKENS = ("<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>",
                 *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)))


def make_tiny_vision_model(directory: Path, seed: int = 0, longest_edge: int = 128, tile: int = 64,
                           text: dict | None = None, vision: dict | None = None, scale_factor: int = 2) -> Path:
    """A tiny random SmolVLM (Idefics3): SmolLM2's vocabulary plus SmolVLM's image tokens (special), a
    2-layer Llama, a 2-layer SigLIP over `tile`-pixel tiles of 8-pixel patches folded 2 x 2 (16 tokens a
    tile), images resized to `longest_edge` first, and SmolVLM's chat template. `text` and `vision` override
    the two configs' fields (benchmarks/vision_bench.py builds SmolVLM-256M's shapes so)."""
    import json

    import transformers

    tokenizer = write_smollm2_tokenizer(directory, VISION_TOKENS, "<end_of_utterance>", VISION_TEMPLATE)
    backend = tokenizer.backend
    (directory / "preprocessor_config.json").write_text(json.dumps({
        "do_convert_rgb": True, "do_image_splitting": True, "do_normalize": True, "do_pad": True,
        "do_rescale": True, "do_resize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "image_processor_type": "Idefics3ImageProcessor", "max_image_size": {"longest_edge": tile},
        "resample": 1, "rescale_factor": 1 / 255, "size": {"longest_edge": longest_edge},
    }))
    vision_config = {"hidden_size": 24, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 2,
                     "image_size": tile, "patch_size": 8, **(vision or {})}
    patches = vision_config["image_size"] // vision_config["patch_size"]
    (directory / "processor_config.json").write_text(json.dumps({"image_seq_len": patches ** 2 // scale_factor ** 2}))
    torch.manual_seed(seed)
    eos = backend.token_to_id("<end_of_utterance>")
    config = transformers.Idefics3Config(
        text_config={"model_type": "llama", "vocab_size": backend.get_vocab_size(), "hidden_size": 32,
                     "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                     "num_key_value_heads": 1, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
                     "tie_word_embeddings": False, "bos_token_id": tokenizer.bos_token_id, "eos_token_id": eos,
                     **(text or {})},
        vision_config=vision_config, scale_factor=scale_factor, image_token_id=backend.token_to_id("<image>"),
        tie_word_embeddings=False,
    )
    model = transformers.Idefics3ForConditionalGeneration(config)
    with torch.no_grad():  # random weights large enough that images change the logits
        for name, p in model.named_parameters():
            if "vision_model" in name or "connector" in name:
                p.normal_(0, 0.2 if p.dim() > 1 else 0.05)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def clip_writer(path: Path, config: dict, projector: str, scale_factor: int, preprocessor: dict):
    """A GGUF writer of llama.cpp's `clip` projector file with the metadata its converter writes for a vision
    model's config.json (`config`) and preprocessor_config.json; the caller adds its tensors and closes it."""
    import gguf

    vision = config["vision_config"]
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_uint32("clip.vision.projection_dim", config["text_config"]["hidden_size"])
    writer.add_uint32("clip.vision.image_size", vision["image_size"])
    writer.add_uint32("clip.vision.patch_size", vision["patch_size"])
    writer.add_uint32("clip.vision.embedding_length", vision["hidden_size"])
    writer.add_uint32("clip.vision.feed_forward_length", vision["intermediate_size"])
    writer.add_uint32("clip.vision.block_count", vision["num_hidden_layers"])
    writer.add_uint32("clip.vision.attention.head_count", vision["num_attention_heads"])
    writer.add_array("clip.vision.image_mean", preprocessor["image_mean"])
    writer.add_array("clip.vision.image_std", preprocessor["image_std"])
    writer.add_string("clip.projector_type", projector)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", vision.get("layer_norm_eps", 1e-6))
    writer.add_uint32("clip.vision.projector.scale_factor", scale_factor)
    writer.add_bool("clip.use_gelu", True)
    return writer


def write_vision_gguf(vision_dir: Path, text_path: Path, mmproj_path: Path, text_type: str = "F32",
                      mmproj_f16: bool = False) -> None:
    """The tiny SmolVLM of `make_tiny_vision_model` as llama.cpp's converter writes SmolVLM: the text model as
    a llama GGUF (`text_type`; SmolLM2's tokenizer and the image tokens as control tokens, SmolVLM's template)
    and the tower as a `clip` projector file of type idefics3, its tensors named by the gguf package's own map
    (the names llama.cpp reads), its metadata as llama.cpp's converter writes it, and with `mmproj_f16` its
    matrices in float16 (the converter's default; the embeddings stay float32)."""
    import json

    import gguf
    import transformers

    model = transformers.Idefics3ForConditionalGeneration.from_pretrained(vision_dir)
    config = json.loads((vision_dir / "config.json").read_text())
    text = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config["text_config"]))
    text.model.load_state_dict(model.model.text_model.state_dict())
    text.lm_head.load_state_dict(model.lm_head.state_dict())
    write_gguf(text, text_path, text_type, smollm2_tokenizer={
        "special_tokens": VISION_TOKENS, "eos_token": "<end_of_utterance>", "chat_template": VISION_TEMPLATE})

    vision = config["vision_config"]
    preprocessor = json.loads((vision_dir / "preprocessor_config.json").read_text())
    writer = clip_writer(mmproj_path, config, "idefics3", config["scale_factor"], preprocessor)
    writer.add_uint32("clip.vision.preproc_image_size", preprocessor["size"]["longest_edge"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vision["num_hidden_layers"])
    for name, tensor in model.state_dict().items():
        if not name.startswith(("model.vision_model.", "model.connector.")):
            continue
        stem, kind = name.rsplit(".", 1)
        array = tensor.float().numpy()
        if mmproj_f16 and array.ndim >= 2 and ".embeddings." not in name:
            array = array.astype("float16")
        writer.add_tensor(f"{names.get_name(stem)}.{kind}", array)
    write_and_close(writer)


# Gemma 3's chat template in the shape of the released one: a system message folded into the first user
# turn, "model" for the assistant's role, an image part written as <start_of_image>.
GEMMA3_VISION_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- else -%}{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
GEMMA3_VISION_TOKENS = ("<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>",
                        "<image_soft_token>")


def make_tiny_gemma3_vision_model(directory: Path, seed: int = 0, image_size: int = 64, tokens_per_image: int = 16,
                                  sliding_window: int = 12) -> Path:
    """A tiny random Gemma 3 that reads images: SmolLM2's vocabulary plus Gemma's turn and image tokens
    (special), a 2-layer Gemma 3 decoder (a sliding-window layer, `sliding_window` tokens, shorter than an
    image's run, then a full one), a 2-layer SigLIP over `image_size`-pixel images of 8-pixel patches pooled
    to `tokens_per_image` tokens, and a Gemma 3-style chat template."""
    import json

    import transformers

    tokenizer = write_smollm2_tokenizer(directory, GEMMA3_VISION_TOKENS, "<end_of_turn>", GEMMA3_VISION_TEMPLATE)
    backend = tokenizer.backend
    (directory / "preprocessor_config.json").write_text(json.dumps({
        "do_convert_rgb": None, "do_normalize": True, "do_pan_and_scan": None, "do_rescale": True,
        "do_resize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "image_processor_type": "Gemma3ImageProcessor", "image_seq_length": tokens_per_image, "resample": 2,
        "rescale_factor": 1 / 255, "size": {"height": image_size, "width": image_size},
    }))
    torch.manual_seed(seed)
    ids = {t: backend.token_to_id(t) for t in GEMMA3_VISION_TOKENS}
    config = transformers.Gemma3Config(
        text_config={"vocab_size": backend.get_vocab_size(), "hidden_size": 32, "intermediate_size": 64,
                     "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
                     "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "sliding_window": sliding_window,
                     "layer_types": ["sliding_attention", "full_attention"], "query_pre_attn_scalar": 16,
                     "bos_token_id": tokenizer.bos_token_id, "eos_token_id": ids["<end_of_turn>"],
                     "initializer_range": 0.2},
        vision_config={"hidden_size": 24, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 2,
                       "image_size": image_size, "patch_size": 8, "vision_use_head": False},
        mm_tokens_per_image=tokens_per_image, image_token_index=ids["<image_soft_token>"],
        boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"], initializer_range=0.2,
    )
    model = transformers.Gemma3ForConditionalGeneration(config)
    with torch.no_grad():  # random weights large enough that images change the logits; Gemma's norms offset
        for name, p in model.named_parameters():
            if "vision_tower" in name or "multi_modal_projector" in name:
                p.normal_(0, 0.2 if p.dim() > 1 else 0.05)
            elif name.endswith("norm.weight"):
                p.normal_(0, 0.2)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def write_gemma3_vision_gguf(model_dir: Path, text_path: Path, mmproj_path: Path, text_type: str = "F32") -> None:
    """The tiny Gemma 3 of `make_tiny_gemma3_vision_model` as llama.cpp's converter writes Gemma 3: the text model
    as a gemma3 GGUF (`text_type`; SmolLM2's tokenizer with Gemma's turn and image tokens as control tokens, the
    Gemma 3-style template) and the tower as a `clip` projector file of type gemma3, its tensors named by the gguf
    package's own map, the soft-embedding norm stored as 1 + w, the projection in float16 and the pool's scale
    written (not 4): the tensors and metadata llama.cpp's converter writes for this checkpoint (checked with
    its convert_hf_to_gguf.py --mmproj --outtype f32)."""
    import json

    import gguf
    import transformers

    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    text = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**config["text_config"]))
    text.model.load_state_dict(model.model.language_model.state_dict())
    text.lm_head.weight = text.model.embed_tokens.weight
    write_gguf(text, text_path, text_type, arch="gemma3",
               smollm2_tokenizer={"special_tokens": GEMMA3_VISION_TOKENS, "eos_token": "<end_of_turn>",
                                  "chat_template": GEMMA3_VISION_TEMPLATE})

    vision = config["vision_config"]
    preprocessor = json.loads((model_dir / "preprocessor_config.json").read_text())
    patches = vision["image_size"] // vision["patch_size"]
    writer = clip_writer(mmproj_path, config, "gemma3", patches // int(config["mm_tokens_per_image"] ** 0.5),
                         preprocessor)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vision["num_hidden_layers"])
    tower = {f"vision_tower.vision_model.{k}": v for k, v in model.model.vision_tower.state_dict().items()}
    projector = {f"multi_modal_projector.{k.replace('_weight', '.weight')}": v
                 for k, v in model.model.multi_modal_projector.state_dict().items()}
    for name, tensor in {**tower, **projector}.items():
        stem, kind = name.rsplit(".", 1)
        array = tensor.float().numpy()
        if stem.endswith("soft_emb_norm"):
            array = array + 1.0
        if stem.endswith("input_projection"):  # the converter's one forced float16 tensor
            array = array.astype("float16")
        writer.add_tensor(f"{names.get_name(stem)}.{kind}", array)
    write_and_close(writer)
