"""A Llama GGUF of a chosen size whose quantized blocks are random, laid out as llama.cpp's quantization
presets lay out real files: for measuring speed on shapes no packaged model has (its text is noise).

    .venv/bin/python benchmarks/synthetic_gguf.py --out /tmp/llama-1b-q4_k_m.gguf [--preset q4_k_m]
        [--hidden 2048] [--layers 16] [--intermediate 8192] [--heads 32] [--kv-heads 8]

Presets: q4_k_m (Q4_K everywhere but the LM head and, in every other layer, attn_v and ffn_down: Q6_K, as
llama.cpp's Q4_K_M gives more bits to those), q5_k_m (the same with Q5_K), q4_0, q6_k, q8_0, iq4_nl, iq4_xs and
q3_k (the LM head Q6_K, as llama.cpp's presets keep it). The defaults are
Llama 3.2 1B's shapes; the tokenizer (and so the vocabulary, 49,152 tokens) is the embedded SmolLM2's:
1.17B parameters in all.
`--reranker` writes a dense Qwen3 (per-head q/k norms) converted as llama.cpp converts Qwen3-Reranker: pooling
type rank, the tied head's "yes" and "no" rows as `cls.output.weight`, and a `rerank` template giving the
prompt `ladder serve`'s /v1/rerank writes through the chat template (for Qwen3-Reranker-0.6B's shapes:
`--hidden 1024 --layers 28 --intermediate 3072 --heads 16 --kv-heads 8 --head-dim 128`).
`--experts E --experts-used K` writes a Qwen3-MoE instead (every layer sparse, `--intermediate` rows per
expert; ffn_down_exps takes the place of ffn_down in the preset), e.g. Qwen3-30B-A3B's layer shapes with
fewer layers and experts: `--experts 32 --experts-used 8 --intermediate 768 --heads 32 --kv-heads 4
--head-dim 128`.
`--gpt-oss` writes a GPT-OSS as llama.cpp's converter lays out the published files: MXFP4 experts (random codes,
scales of 2^-8), every other layer sliding-window (128 tokens), YaRN, sinks and biases; its projections, embedding
and LM head in `--preset` (q8_0 for the published files' kind). gpt-oss-20b's layer shapes with fewer layers:
`--gpt-oss --preset q8_0 --hidden 2880 --heads 64 --kv-heads 8 --head-dim 64 --intermediate 2880 --experts 32
--experts-used 4` (rows of 2880 are not a multiple of 256: the q8_0 preset only).
`--qwen35` writes a Qwen3.5 as llama.cpp's converter lays it out (arch qwen35): three linear-attention layers
(gated delta rule) to one of gated attention, `--linear-heads` key and value heads of 128 dims each, a 4-tap
convolution, norms near 1, decays spread; `--vocab` pads the embedded tokenizer's vocabulary with control tokens
to the real model's size (the LM head is a large part of a small model's bytes). Qwen3.5-0.8B's shapes:
`--qwen35 --hidden 1024 --layers 24 --intermediate 3584 --heads 8 --kv-heads 2 --head-dim 256 --linear-heads 16
--vocab 248320`. With `--experts E --experts-used K` a Qwen3.5-MoE (arch qwen35moe): every layer `E` experts of
`--intermediate` rows beside a shared expert as wide; Qwen3.5-35B-A3B's layer shapes with fewer layers:
`--qwen35 --experts 256 --experts-used 8 --intermediate 512 --hidden 2048 --heads 16 --kv-heads 2 --head-dim 256
--linear-heads 16 --linear-value-heads 32 --vocab 248320 --layers 4`. `--qwen3-next` with `--experts` writes a
Qwen3-Next instead (arch qwen3next; 80B-A3B's shapes: `--experts 512 --experts-used 10 --intermediate 512 --hidden
2048 --heads 16 --kv-heads 2 --head-dim 256 --linear-heads 16 --linear-value-heads 32 --vocab 151936`).
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import gguf
import numpy as np

# The float16 super-block scales written into each random block (byte offset -> value): weights of a few
# hundredths, as a trained model's are.
SCALES = {
    "Q4_0": {0: 2e-3},
    "Q8_0": {0: 2e-4},
    "Q4_K": {0: 2e-4, 2: 1.5e-3},
    "Q5_K": {0: 1e-4, 2: 1.5e-3},
    "Q6_K": {208: 5e-4},
    "IQ4_NL": {0: 2e-4},
    "IQ4_XS": {0: 1e-5},  # times a sub-block's ls - 32 (up to 32 either way)
    "Q3_K": {108: 3e-4},  # times a sub-block's scale - 32 and q in -4..3
}


def random_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, bytes per row] uint8 of valid `kind` blocks: random codes, fixed small scales."""
    qtype = gguf.GGMLQuantizationType[kind]
    per_block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // per_block, size), dtype=np.uint8)
    for offset, value in SCALES[kind].items():
        raw[..., offset:offset + 2] = np.array([value], dtype=np.float16).view(np.uint8)
    if kind == "Q6_K":  # 16 int8 sub-block scales: small ones keep the weights small
        raw[..., 192:208] = rng.integers(1, 9, size=raw[..., 192:208].shape).astype(np.uint8)
    return raw.reshape(rows, -1)


def tensor_kind(preset: str, name: str, layer: int | None) -> str:
    if preset.startswith("iq4") or preset == "q3_k":
        return "Q6_K" if name == "output" else preset.upper()
    if preset not in ("q4_k_m", "q5_k_m"):
        return preset.upper()
    if name == "output" or (name in ("attn_v", "ffn_down") and layer is not None and layer % 2 == 0):
        return "Q6_K"
    return "Q4_K" if preset == "q4_k_m" else "Q5_K"


@functools.cache
def tokenizer_source():
    from model.default import packaged_model_path
    from model.gguf_file import GGUFFile

    return GGUFFile(packaged_model_path())


def copy_tokenizer(writer: gguf.GGUFWriter, vocab: int | None = None) -> None:
    """The embedded model's tokenizer (SmolLM2's 49,152 BPE tokens, merges and chat template): real text
    tokenizes as it does for a real model, and llama.cpp's server loads it. `vocab`: padded with control tokens
    to that many."""
    meta = tokenizer_source().metadata
    tokens, types = list(meta["tokenizer.ggml.tokens"]), list(meta["tokenizer.ggml.token_type"])
    padding = max(0, (vocab or 0) - len(tokens))
    writer.add_tokenizer_model(meta["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    writer.add_token_list(tokens + [f"<|pad_{i}|>" for i in range(padding)])
    writer.add_token_types(types + [3] * padding)
    writer.add_token_merges(meta["tokenizer.ggml.merges"])
    writer.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    writer.add_unk_token_id(meta["tokenizer.ggml.unknown_token_id"])
    writer.add_pad_token_id(meta["tokenizer.ggml.padding_token_id"])
    writer.add_add_bos_token(meta["tokenizer.ggml.add_bos_token"])
    writer.add_chat_template(meta["tokenizer.chat_template"])


def rerank_template() -> str:
    """The prompt of /v1/rerank (server/rerank.py) as the embedded model's ChatML template renders it, with
    llama.cpp's {query} and {document} placeholders."""
    from server.rerank import DEFAULT_INSTRUCTION, JUDGE

    return (f"<|im_start|>system\n{JUDGE}<|im_end|>\n<|im_start|>user\n<Instruct>: {DEFAULT_INSTRUCTION}\n"
            "<Query>: {query}\n<Document>: {document}<|im_end|>\n<|im_start|>assistant\n")


def write(path: Path, preset: str, hidden: int, layers: int, intermediate: int, heads: int, kv_heads: int,
          head_dim: int | None = None, experts: int = 0, experts_used: int = 0, seed: int = 0,
          reranker: bool = False) -> None:
    """A dense Llama, or with `experts` a Qwen3-MoE (per-head q/k norms, every layer sparse: a float32 router,
    experts of `intermediate` rows each), or with `reranker` a dense Qwen3 reranker file (module docstring)."""
    rng = np.random.default_rng(seed)
    head_dim = head_dim or hidden // heads
    writer = gguf.GGUFWriter(str(path), "qwen3moe" if experts else "qwen3" if reranker else "llama")
    writer.add_block_count(layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    if head_dim != hidden // heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(experts_used)
        writer.add_expert_feed_forward_length(intermediate)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    copy_tokenizer(writer)
    vocab = len(tokenizer_source().metadata["tokenizer.ggml.tokens"])
    writer.add_vocab_size(vocab)
    if reranker:
        writer.add_pooling_type(gguf.PoolingType.RANK)
        writer.add_array("qwen3.classifier.output_labels", ["yes", "no"])
        writer.add_chat_template([{"name": "rerank", "template": rerank_template()}])

    def linear(name: str, rows: int, cols: int, layer: int | None, stack: int = 0) -> np.ndarray:
        """A [rows, cols] weight, or `stack` of them ([stack, rows, cols]: llama.cpp's expert tensors); its blocks."""
        kind = tensor_kind(preset, name.split(".")[-2].removesuffix("_exps") if layer is not None
                           else name.split(".")[0], layer)
        raw = random_blocks(kind, max(stack, 1) * rows, cols, rng)
        writer.add_tensor(name, raw.reshape(stack, rows, -1) if stack else raw,
                          raw_dtype=gguf.GGMLQuantizationType[kind])
        return raw

    embeddings = linear("token_embd.weight", vocab, hidden, None)
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    if reranker:  # the tied head's rows of "yes" and "no", in place of an LM head
        tokens = list(tokenizer_source().metadata["tokenizer.ggml.tokens"])
        kind = gguf.GGMLQuantizationType[tensor_kind(preset, "token_embd", None)]
        rows = gguf.quants.dequantize(embeddings[[tokens.index("yes"), tokens.index("no")]], kind)
        writer.add_tensor("cls.output.weight", np.ascontiguousarray(rows, dtype=np.float32))
    else:
        linear("output.weight", vocab, hidden, None)
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, dtype=np.float32))
        linear(f"blk.{i}.attn_q.weight", heads * head_dim, hidden, i)
        linear(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden, i)
        linear(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden, i)
        linear(f"blk.{i}.attn_output.weight", hidden, heads * head_dim, i)
        if reranker:
            writer.add_tensor(f"blk.{i}.attn_q_norm.weight", np.ones(head_dim, dtype=np.float32))
            writer.add_tensor(f"blk.{i}.attn_k_norm.weight", np.ones(head_dim, dtype=np.float32))
        if not experts:
            linear(f"blk.{i}.ffn_gate.weight", intermediate, hidden, i)
            linear(f"blk.{i}.ffn_up.weight", intermediate, hidden, i)
            linear(f"blk.{i}.ffn_down.weight", hidden, intermediate, i)
            continue
        writer.add_tensor(f"blk.{i}.attn_q_norm.weight", np.ones(head_dim, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.attn_k_norm.weight", np.ones(head_dim, dtype=np.float32))
        router = rng.standard_normal((experts, hidden)).astype(np.float32) * 0.05  # tokens spread over experts
        writer.add_tensor(f"blk.{i}.ffn_gate_inp.weight", router)
        linear(f"blk.{i}.ffn_gate_exps.weight", intermediate, hidden, i, experts)
        linear(f"blk.{i}.ffn_up_exps.weight", intermediate, hidden, i, experts)
        linear(f"blk.{i}.ffn_down_exps.weight", hidden, intermediate, i, experts)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def random_mxfp4(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, bytes per row] uint8 of MXFP4 blocks: random 4-bit codes, each block's E8M0 byte 120 (llama.cpp
    reads the doubled E2M1 values, up to 12, times 2^-8): weights of a few hundredths."""
    raw = rng.integers(0, 256, size=(rows, cols // 32, 17), dtype=np.uint8)
    raw[..., 0] = 120
    return raw.reshape(rows, -1)


def write_gpt_oss(path: Path, preset: str, hidden: int, layers: int, intermediate: int, heads: int, kv_heads: int,
                  head_dim: int, experts: int, experts_used: int, seed: int = 0) -> None:
    """A GPT-OSS (module docstring) with the embedded model's tokenizer."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "gpt-oss")
    for add, value in (("block_count", layers), ("context_length", 131072), ("embedding_length", hidden),
                       ("feed_forward_length", intermediate), ("expert_count", experts),
                       ("expert_used_count", experts_used), ("expert_feed_forward_length", intermediate),
                       ("head_count", heads), ("head_count_kv", kv_heads), ("key_length", head_dim),
                       ("value_length", head_dim), ("rope_freq_base", 150000.0), ("sliding_window", 128),
                       ("layer_norm_rms_eps", 1e-5), ("rope_scaling_factor", 32.0),
                       ("rope_scaling_orig_ctx_len", 4096)):
        getattr(writer, f"add_{add}")(value)
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    copy_tokenizer(writer)
    vocab = len(tokenizer_source().metadata["tokenizer.ggml.tokens"])
    writer.add_vocab_size(vocab)
    kind = gguf.GGMLQuantizationType[tensor_kind(preset, "attn_q", None)]

    def linear(name: str, rows: int, cols: int) -> None:
        writer.add_tensor(name, random_blocks(kind.name, rows, cols, rng), raw_dtype=kind)

    def floats(name: str, *shape: int, scale: float = 0.0, fill: float = 0.0) -> None:
        writer.add_tensor(name, (fill + scale * rng.standard_normal(shape)).astype(np.float32))

    linear("token_embd.weight", vocab, hidden)
    linear("output.weight", vocab, hidden)
    floats("output_norm.weight", hidden, fill=1.0)
    q, kv = heads * head_dim, kv_heads * head_dim
    for i in range(layers):
        p = f"blk.{i}."
        floats(p + "attn_norm.weight", hidden, fill=1.0)
        floats(p + "post_attention_norm.weight", hidden, fill=1.0)
        for name, rows, cols in (("attn_q", q, hidden), ("attn_k", kv, hidden), ("attn_v", kv, hidden),
                                 ("attn_output", hidden, q)):
            linear(p + name + ".weight", rows, cols)
            floats(p + name + ".bias", rows, scale=0.02)
        floats(p + "attn_sinks.weight", heads, scale=0.5)
        floats(p + "ffn_gate_inp.weight", experts, hidden, scale=0.05)  # tokens spread over experts
        floats(p + "ffn_gate_inp.bias", experts, scale=0.05)
        for name, rows, cols in (("ffn_gate_exps", intermediate, hidden), ("ffn_up_exps", intermediate, hidden),
                                 ("ffn_down_exps", hidden, intermediate)):
            raw = random_mxfp4(experts * rows, cols, rng)
            writer.add_tensor(p + name + ".weight", raw.reshape(experts, rows, -1),
                              raw_dtype=gguf.GGMLQuantizationType.MXFP4)
            floats(p + name + ".bias", experts, rows, scale=0.02)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_gemma4(path: Path, preset: str, hidden: int, layers: int, intermediate: int, heads: int, kv_heads: int,
                 head_dim: int, global_head_dim: int, per_layer: int, shared: int, seed: int = 0, experts: int = 0,
                 experts_used: int = 0, expert_intermediate: int = 0) -> None:
    """A Gemma 4 text model of the small models' kind (module docstring), as llama.cpp's converter lays it out;
    with `experts`, 26B-A4B's kind instead: experts beside each dense MLP (gate and up as one stack, float32
    router and scales), no per-layer embeddings or shared caches (pass per_layer=0, shared=0)."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "gemma4")
    swa = [(i + 1) % 5 != 0 for i in range(layers)]
    swa[-1] = False
    writer.add_block_count(layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(hidden)
    first_shared = layers - shared
    writer.add_feed_forward_length([intermediate * (2 if i >= first_shared else 1) for i in range(layers)])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(global_head_dim)
    writer.add_value_length(global_head_dim)
    writer.add_key_length_swa(head_dim)
    writer.add_value_length_swa(head_dim)
    writer.add_sliding_window(512)
    writer.add_sliding_window_pattern(swa)
    writer.add_shared_kv_layers(shared)
    writer.add_embedding_length_per_layer_input(per_layer)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_rope_freq_base_swa(10_000.0)
    writer.add_rope_dimension_count(global_head_dim)
    writer.add_rope_dimension_count_swa(head_dim)
    writer.add_final_logit_softcapping(30.0)
    writer.add_layer_norm_rms_eps(1e-6)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(experts_used)
        writer.add_expert_feed_forward_length(expert_intermediate)
    copy_tokenizer(writer)
    vocab = len(tokenizer_source().metadata["tokenizer.ggml.tokens"])
    writer.add_vocab_size(vocab)
    rotated = global_head_dim // 8  # a quarter of the pairs rotate
    writer.add_tensor("rope_freqs.weight", np.array([1.0] * rotated + [1e30] * (global_head_dim // 2 - rotated),
                                                    dtype=np.float32))

    def linear(name: str, rows: int, cols: int, layer: int | None, stack: int = 0) -> None:
        kind = tensor_kind(preset, name.split(".")[-2].removesuffix("_exps") if layer is not None
                           else name.split(".")[0], layer)
        raw = random_blocks(kind, max(stack, 1) * rows, cols, rng)
        writer.add_tensor(name, raw.reshape(stack, rows, -1) if stack else raw,
                          raw_dtype=gguf.GGMLQuantizationType[kind])

    def norm(name: str, size: int) -> None:
        writer.add_tensor(name, np.ones(size, dtype=np.float32))

    linear("token_embd.weight", vocab, hidden, None)  # tied to the LM head, as Gemma's
    norm("output_norm.weight", hidden)
    if per_layer:
        linear("per_layer_token_embd.weight", vocab, layers * per_layer, None)
        linear("per_layer_model_proj.weight", layers * per_layer, hidden, None)
        norm("per_layer_proj_norm.weight", per_layer)
    for i in range(layers):
        d = head_dim if swa[i] else global_head_dim
        for name in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm", *(("post_norm",) if per_layer
                                                                                       else ())):
            norm(f"blk.{i}.{name}.weight", hidden)
        norm(f"blk.{i}.attn_q_norm.weight", d)
        writer.add_tensor(f"blk.{i}.layer_output_scale.weight", np.full(1, 0.5, dtype=np.float32))
        linear(f"blk.{i}.attn_q.weight", heads * d, hidden, i)
        if i < first_shared:
            norm(f"blk.{i}.attn_k_norm.weight", d)
            linear(f"blk.{i}.attn_k.weight", kv_heads * d, hidden, i)
            linear(f"blk.{i}.attn_v.weight", kv_heads * d, hidden, i)
        linear(f"blk.{i}.attn_output.weight", hidden, heads * d, i)
        width = intermediate * (2 if i >= first_shared else 1)
        linear(f"blk.{i}.ffn_gate.weight", width, hidden, i)
        linear(f"blk.{i}.ffn_up.weight", width, hidden, i)
        linear(f"blk.{i}.ffn_down.weight", hidden, width, i)
        if per_layer:
            linear(f"blk.{i}.inp_gate.weight", per_layer, hidden, i)
            linear(f"blk.{i}.proj.weight", hidden, per_layer, i)
        if experts:  # the router (float32: tokens spread over experts), its scales, the stacks, three norms
            writer.add_tensor(f"blk.{i}.ffn_gate_inp.weight",
                              rng.standard_normal((experts, hidden)).astype(np.float32) * 0.05)
            norm(f"blk.{i}.ffn_gate_inp.scale", hidden)
            norm(f"blk.{i}.ffn_down_exps.scale", experts)
            linear(f"blk.{i}.ffn_gate_up_exps.weight", 2 * expert_intermediate, hidden, i, experts)
            linear(f"blk.{i}.ffn_down_exps.weight", hidden, expert_intermediate, i, experts)
            for name in ("pre_ffw_norm_2", "post_ffw_norm_1", "post_ffw_norm_2"):
                norm(f"blk.{i}.{name}.weight", hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_qwen35(path: Path, preset: str, hidden: int, layers: int, intermediate: int, heads: int, kv_heads: int,
                 head_dim: int, linear_heads: int, linear_value_heads: int, vocab: int | None, experts: int = 0,
                 experts_used: int = 0, seed: int = 0, qwen3_next: bool = False) -> None:
    """A Qwen3.5 (module docstring) with the embedded model's tokenizer, padded to `vocab` tokens; every fourth
    layer attention, a quarter of each head rotating, the LM head tied to the embedding (as the small models); with
    `experts`, a Qwen3.5-MoE, or with `qwen3_next` a Qwen3-Next (arch qwen3next: b and a in one `ssm_ba`)."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "qwen3next" if qwen3_next else "qwen35moe" if experts else "qwen35")
    state = 128  # the linear attention's key and value head size (every Qwen3.5)
    mlp = ((("expert_count", experts), ("expert_used_count", experts_used), ("expert_feed_forward_length",
           intermediate), ("expert_shared_feed_forward_length", intermediate)) if experts
           else ()) + ((("feed_forward_length", intermediate),) if qwen3_next or not experts else ())
    for add, value in (("block_count", layers), ("context_length", 262144), ("embedding_length", hidden), *mlp,
                       ("head_count", heads), ("head_count_kv", kv_heads),
                       ("key_length", head_dim), ("value_length", head_dim), ("rope_freq_base", 1e7),
                       ("rope_dimension_count", head_dim // 4), ("layer_norm_rms_eps", 1e-6),
                       ("ssm_conv_kernel", 4), ("ssm_state_size", state), ("ssm_group_count", linear_heads),
                       ("ssm_time_step_rank", linear_value_heads), ("ssm_inner_size", state * linear_value_heads),
                       ("full_attention_interval", 4)):
        getattr(writer, f"add_{add}")(value)
    if not qwen3_next:
        writer.add_rope_dimension_sections([11, 11, 10, 0])
    copy_tokenizer(writer, vocab)
    vocab = max(vocab or 0, len(tokenizer_source().metadata["tokenizer.ggml.tokens"]))
    writer.add_vocab_size(vocab)

    def linear(name: str, rows: int, cols: int, layer: int | None) -> None:
        kind = tensor_kind(preset, name.split(".")[-2] if layer is not None else "output", layer)
        writer.add_tensor(name, random_blocks(kind, rows, cols, rng), raw_dtype=gguf.GGMLQuantizationType[kind])

    def floats(name: str, *shape: int, scale: float = 0.0, fill: float = 0.0) -> None:
        writer.add_tensor(name, (fill + scale * rng.standard_normal(shape)).astype(np.float32))

    linear("token_embd.weight", vocab, hidden, None)
    floats("output_norm.weight", hidden, fill=1.0)
    keys, values = linear_heads * state, linear_value_heads * state
    for i in range(layers):
        p = f"blk.{i}."
        floats(p + "attn_norm.weight", hidden, fill=1.0)
        floats(p + "post_attention_norm.weight", hidden, fill=1.0)
        if (i + 1) % 4:  # linear attention
            linear(p + "attn_qkv.weight", 2 * keys + values, hidden, i)
            linear(p + "attn_gate.weight", values, hidden, i)
            if qwen3_next:
                linear(p + "ssm_ba.weight", 2 * linear_value_heads, hidden, i)
            else:
                linear(p + "ssm_beta.weight", linear_value_heads, hidden, i)
                linear(p + "ssm_alpha.weight", linear_value_heads, hidden, i)
            linear(p + "ssm_out.weight", hidden, values, i)
            floats(p + "ssm_conv1d.weight", 2 * keys + values, 4, scale=0.3)
            floats(p + "ssm_dt.bias", linear_value_heads, scale=1.0)
            floats(p + "ssm_a", linear_value_heads, fill=-1.0, scale=0.0)
            floats(p + "ssm_norm.weight", state, fill=1.0)
        else:
            linear(p + "attn_q.weight", 2 * heads * head_dim, hidden, i)
            linear(p + "attn_k.weight", kv_heads * head_dim, hidden, i)
            linear(p + "attn_v.weight", kv_heads * head_dim, hidden, i)
            linear(p + "attn_output.weight", hidden, heads * head_dim, i)
            floats(p + "attn_q_norm.weight", head_dim, fill=1.0)
            floats(p + "attn_k_norm.weight", head_dim, fill=1.0)
        if not experts:
            linear(p + "ffn_gate.weight", intermediate, hidden, i)
            linear(p + "ffn_up.weight", intermediate, hidden, i)
            linear(p + "ffn_down.weight", hidden, intermediate, i)
            continue
        floats(p + "ffn_gate_inp.weight", experts, hidden, scale=0.05)  # tokens spread over experts
        for name, rows, cols in (("ffn_gate_exps", intermediate, hidden), ("ffn_up_exps", intermediate, hidden),
                                 ("ffn_down_exps", hidden, intermediate)):
            kind = tensor_kind(preset, name.replace("_exps", ""), i)
            raw = random_blocks(kind, experts * rows, cols, rng)
            writer.add_tensor(p + name + ".weight", raw.reshape(experts, rows, -1),
                              raw_dtype=gguf.GGMLQuantizationType[kind])
        for name, rows, cols in (("ffn_gate_shexp", intermediate, hidden), ("ffn_up_shexp", intermediate, hidden),
                                 ("ffn_down_shexp", hidden, intermediate)):
            linear(p + name + ".weight", rows, cols, i)
        floats(p + "ffn_gate_inp_shexp.weight", hidden, scale=0.05)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--preset", default="q4_k_m",
                        choices=["q4_k_m", "q5_k_m", "q4_0", "q6_k", "q8_0", "iq4_nl", "iq4_xs", "q3_k"])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--intermediate", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=None, help="default: hidden / heads")
    parser.add_argument("--experts", type=int, default=0,
                        help="a Qwen3-MoE of this many experts a layer (--intermediate: each expert's)")
    parser.add_argument("--experts-used", type=int, default=8)
    parser.add_argument("--reranker", action="store_true", help="a Qwen3 reranker file (see above)")
    parser.add_argument("--gemma4", action="store_true", help="a Gemma 4 of the small models' kind (see above)")
    parser.add_argument("--global-head-dim", type=int, default=512)
    parser.add_argument("--per-layer", type=int, default=256)
    parser.add_argument("--shared-layers", type=int, default=20)
    parser.add_argument("--gpt-oss", action="store_true", help="a GPT-OSS (see above)")
    parser.add_argument("--qwen35", action="store_true", help="a Qwen3.5 (see above)")
    parser.add_argument("--qwen3-next", action="store_true", help="with --qwen35 --experts: a Qwen3-Next")
    parser.add_argument("--linear-heads", type=int, default=16, help="with --qwen35: linear attention's key heads")
    parser.add_argument("--linear-value-heads", type=int, default=None,
                        help="with --qwen35: its value heads (default: as many as its key heads)")
    parser.add_argument("--vocab", type=int, default=None, help="with --qwen35: the vocabulary padded to this")
    parser.add_argument("--expert-intermediate", type=int, default=512,
                        help="with --gemma4 --experts: each expert's width (26B-A4B's experts beside the MLP)")
    args = parser.parse_args()
    if (args.hidden % 256 or args.intermediate % 256) and not (args.gpt_oss and args.preset == "q8_0"):
        parser.error("--hidden and --intermediate must be multiples of 256 (K-quant rows)")
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    if args.gpt_oss:
        write_gpt_oss(path, args.preset, args.hidden, args.layers, args.intermediate, args.heads, args.kv_heads,
                      args.head_dim or args.hidden // args.heads, args.experts or 32, args.experts_used)
    elif args.qwen35:
        write_qwen35(path, args.preset, args.hidden, args.layers, args.intermediate, args.heads, args.kv_heads,
                     args.head_dim or args.hidden // args.heads, args.linear_heads,
                     args.linear_value_heads or args.linear_heads, args.vocab, args.experts, args.experts_used,
                     qwen3_next=args.qwen3_next)
    elif args.gemma4:
        write_gemma4(path, args.preset, args.hidden, args.layers, args.intermediate, args.heads, args.kv_heads,
                     args.head_dim or args.hidden // args.heads, args.global_head_dim,
                     0 if args.experts else args.per_layer, 0 if args.experts else args.shared_layers,
                     experts=args.experts, experts_used=args.experts_used,
                     expert_intermediate=args.expert_intermediate)
    else:
        write(path, args.preset, args.hidden, args.layers, args.intermediate, args.heads, args.kv_heads,
              args.head_dim, args.experts, args.experts_used, reranker=args.reranker)
    print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB, preset {args.preset})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
