"""The Llama-family decoder: Llama 2/3, Mistral, Qwen2/2.5 (q/k/v biases), Qwen3 (q/k norms), Gemma 3
(q/k norms, GeGLU, sandwich norms, a scaled embedding, sliding-window layers with their own RoPE base) and
Gemma 4 (Gemma 3's layers with heads of another size in the full-attention ones, normed values, a scale on
each layer's output, per-layer embeddings and layers that read an earlier layer's cache); Qwen3-MoE and
Mixtral swap a layer's MLP for a sparse mixture of experts (model/moe.py); GPT-OSS for experts with biases
and a clamped SwiGLU, beside attention with a sink logit per head and biases on every projection; Qwen3.5
swaps three layers' attention in four for a gated delta rule over a state per sequence
(model/linear_attention.py) and gates the others' attention output.

One module serves every caller: `forward` takes a flat batch of tokens from many sequences, the paged KV
cache tensors and the attention metadata as arguments, and keeps no state between calls, so the engine,
the compile pipeline and the exporters all drive exactly this code.

Names follow Hugging Face checkpoints, with q/k/v and gate/up fused into one projection each (one matmul
instead of three or two; the loader concatenates the weights).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import torch
from torch import nn

from kernels.cpu_fused_ops import sigmoid_gate
from kernels.ops import Ops, select_ops
from kernels.rotary import rotary_cos_sin_ref, rotate_ref
from model.attention import AttentionBackend, AttentionPlan, attention_for
from model.attention_metadata import AttentionMetadata
from model.config import ModelConfig
from model.cpu_step import CpuDecoderStep, step_support, structure_version
from model.linear_attention import GatedDeltaNet, RecurrentPlan
from model.moe import Gemma4Experts, Gemma4Router, GptOssMoeBlock, SparseMoeBlock
from model.precision import KV_CACHE_DTYPES
from model.rope import inverse_frequencies, local_inverse_frequencies, rotary_scale
from model.step import BaseStepModel, InputEmbeds, allocate_kv_caches
from model.vision import Vision

log = logging.getLogger(__name__)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ops: Ops) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Add `residual` (if any) to x, normalise the sum; returns (normed, new residual)."""
        if residual is not None:
            return self.ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
        return self.ops.rms_norm(x, self.weight, self.eps), x


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, ops: Ops, layer_index: int = 0) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.rotates = layer_index not in config.nope_layers  # False: a NoPE layer (SmolLM3's)
        self.num_heads = config.num_heads
        self.num_kv_heads = config.layer_kv_heads(layer_index)
        self.head_dim = head_dim = config.layer_head_dim(layer_index)
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.scale = config.attention_scale
        # Gemma 4: a layer that reads an earlier layer's cache projects queries only (`kv_source`); a
        # full-attention layer with attention_k_eq_v takes its values from its keys' projection.
        self.kv_source = config.kv_source(layer_index)
        self.kv_outputs = len(config.layer_projections(layer_index)) - 1
        # Qwen3.5: a gate per query head's output, projected after the keys and values (`gate_size` rows).
        self.gate_size = self.q_size if config.attention_output_gate else 0
        self.value_norm_eps = config.rms_norm_eps if config.value_norm else None
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + self.kv_outputs * self.kv_size + self.gate_size,
                                  bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.output_bias)
        # GPT-OSS: each query head's sink logit [num_heads] (see kernels/paged_attention.py)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads)) if config.attention_sinks else None
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps, ops) if config.qk_norm else None
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps, ops) if config.qk_norm and self.kv_outputs else None
        self.backend = backend
        self.ops = ops

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, head_dim / 2]
        sin: torch.Tensor,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, head_dim]
        plan: AttentionPlan,
        shared_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
        q_scale: torch.Tensor | None = None,  # [T, 1, 1]: Llama 4's attention temperature (Ministral 3)
    ) -> torch.Tensor:
        """`shared_kv`: this step's keys and values by layer, for the layers that read an earlier layer's
        cache (Gemma 4): a layer whose cache is read records its own, one that reads another's takes them.
        `q_scale`: each token's queries multiplied by it after their rotation."""
        # One view of the whole projection, then a split along the heads: viewing each non-contiguous slice
        # instead makes Inductor guard on T == 1 and compile the decode step a second time for batch 2.
        qkv = self.qkv_proj(x)
        gate = None
        if self.gate_size:
            qkv, gate = qkv.split([qkv.shape[-1] - self.gate_size, self.gate_size], dim=-1)
        qkv = qkv.view(-1, self.num_heads + self.kv_outputs * self.num_kv_heads, self.head_dim)
        if not self.kv_outputs:  # the source layer's keys and values, already normed and rotated
            q = self.q_norm(qkv)[0] if self.q_norm is not None else qkv
            k, v = shared_kv[self.kv_source]
            # the queries alone through the model's rotation (a view of no heads as its keys)
            q = self.ops.apply_rotary(q, q[:, :0], cos, sin)[0] if self.ops.name == "cpu" else rotate_ref(q, cos, sin)
            # Writing the source's keys and values again into the cache they share leaves it as it was.
            out = self.backend.forward(q, k, v, kv_cache, plan, self.scale)
            return self.o_proj(out.reshape(-1, self.q_size))
        if self.kv_outputs == 1:  # values are the keys' projection, before the keys' norm and rotation
            q, k = qkv.split([self.num_heads, self.num_kv_heads], dim=1)
            v = k
        else:
            q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        if self.q_norm is not None:  # Qwen3 and Gemma normalise each head before the rotation
            q, _ = self.q_norm(q)
            k, _ = self.k_norm(k)
        if self.value_norm_eps is not None:  # Gemma 4: each value head RMS-normalised, without a weight
            v = self.ops.rms_norm(v, torch.ones(self.head_dim, dtype=v.dtype, device=v.device), self.value_norm_eps)
        if self.rotates:
            q, k = self.ops.apply_rotary(q, k, cos, sin)
        if q_scale is not None:
            q = q * q_scale.to(q.dtype)
        if shared_kv is not None:
            shared_kv[self.layer_index] = k, v
        if self.sinks is not None:
            out = self.backend.forward(q, k, v, kv_cache, plan, self.scale, sinks=self.sinks)
        else:  # (wrappers of the backend, tensor parallelism's, take no sinks)
            out = self.backend.forward(q, k, v, kv_cache, plan, self.scale)  # [T, heads, head_dim]
        out = out.reshape(-1, self.q_size)
        return self.o_proj(out if gate is None else sigmoid_gate(out, gate))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, ops: Ops, intermediate_size: int | None = None) -> None:
        super().__init__()
        width = intermediate_size or config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * width, bias=False)
        self.down_proj = nn.Linear(width, config.hidden_size, bias=False)
        self.ops = ops
        self.geglu = config.hidden_act == "gelu_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        # silu(gate) * up, or Gemma's gelu_tanh(gate) * up
        return self.down_proj(self.ops.gelu_tanh_and_mul(gate_up) if self.geglu else self.ops.silu_and_mul(gate_up))


class DecoderLayer(nn.Module):
    """Norm names follow each family's checkpoints: Llama's post_attention_layernorm is the norm before the
    MLP; Gemma's (sandwich norms) is the norm of the attention's output, pre_feedforward_layernorm the one
    before the MLP and post_feedforward_layernorm that of the MLP's output."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, ops: Ops, layer_index: int = 0) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        # A layer mixes its tokens with attention or (Qwen3.5) with a gated delta rule, never both.
        self.linear_attn = GatedDeltaNet(config) if config.is_linear_layer(layer_index) else None
        self.self_attn = Attention(config, backend, ops, layer_index) if self.linear_attn is None else None
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        if not config.is_sparse_layer(layer_index):
            self.mlp = MLP(config, ops, config.layer_intermediate_size(layer_index))
        else:
            self.mlp = GptOssMoeBlock(config) if config.swiglu_limit is not None else SparseMoeBlock(config, ops)
        # Qwen3.5-MoE: a shared expert every token goes through beside the routed ones, scaled by a gate of its own.
        self.shared_expert = self.shared_expert_gate = None
        if config.shared_expert_intermediate_size and config.is_sparse_layer(layer_index):
            self.shared_expert = MLP(config, ops, config.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        self.pre_feedforward_layernorm = self.post_feedforward_layernorm = None
        if config.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        # Gemma 4: the layer's per-layer embedding gated into its output, and the output (residual stream
        # included) scaled by `layer_scalar`.
        self.per_layer_input_gate = self.per_layer_projection = self.post_per_layer_input_norm = None
        if config.per_layer_input_size:
            self.per_layer_input_gate = nn.Linear(config.hidden_size, config.per_layer_input_size, bias=False)
            self.per_layer_projection = nn.Linear(config.per_layer_input_size, config.hidden_size, bias=False)
            self.post_per_layer_input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.layer_scalar = nn.Parameter(torch.ones(1)) if config.layer_scalars else None
        # Gemma 4's experts beside the dense MLP (26B-A4B), routed on the residual stream, each output normed.
        self.router = self.experts = None
        if config.experts_beside_mlp:
            self.router, self.experts = Gemma4Router(config), Gemma4Experts(config)
            self.pre_feedforward_layernorm_2 = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
            self.post_feedforward_layernorm_1 = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
            self.post_feedforward_layernorm_2 = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.ops = ops

    @property
    def mlp_norm(self) -> RMSNorm:
        """The norm whose output is the MLP's input (SmoothQuant folds the MLP's scales into it)."""
        sandwich = self.pre_feedforward_layernorm is not None
        return self.pre_feedforward_layernorm if sandwich else self.post_attention_layernorm

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,  # a linear-attention layer's: its state pool
        plan: AttentionPlan,  # a linear-attention layer's: the step's RecurrentPlan
        per_layer_input: torch.Tensor | None = None,  # [T, per_layer_input_size] (Gemma 4's E2B, E4B)
        shared_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
        q_scale: torch.Tensor | None = None,  # [T, 1, 1] (Ministral 3 past its original context)
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # The residual stream is carried separately so each add fuses with the norm that follows it.
        h, residual = self.input_layernorm(x, residual)
        # (wrappers of the attention, tensor parallelism's, take neither `shared_kv` nor `q_scale`: only Gemma 4
        # passes the one, and only a model served in one process past Ministral 3's original context the other)
        if self.linear_attn is not None:
            h = self.linear_attn(h, kv_cache, plan)
        elif shared_kv is not None:
            h = self.self_attn(h, cos, sin, kv_cache, plan, shared_kv)
        elif q_scale is not None:
            h = self.self_attn(h, cos, sin, kv_cache, plan, q_scale=q_scale)
        else:
            h = self.self_attn(h, cos, sin, kv_cache, plan)
        if self.post_feedforward_layernorm is None:
            h, residual = self.post_attention_layernorm(h, residual)
            if self.shared_expert is not None:
                return self.mlp(h) + torch.sigmoid(self.shared_expert_gate(h)) * self.shared_expert(h), residual
            return self.mlp(h), residual
        h, _ = self.post_attention_layernorm(h)  # normed before it joins the residual stream
        h, residual = self.pre_feedforward_layernorm(h, residual)
        h = self.mlp(h)
        if self.experts is not None:
            weights, chosen = self.router(residual)
            routed = self.experts(self.pre_feedforward_layernorm_2(residual)[0], weights, chosen)
            h = self.post_feedforward_layernorm_1(h)[0] + self.post_feedforward_layernorm_2(routed)[0]
        h, _ = self.post_feedforward_layernorm(h)
        if self.layer_scalar is None:
            return h, residual
        # Gemma 4 scales the whole stream, so the sum is made here and the next layer's norm starts afresh.
        x = residual + h
        if self.per_layer_input_gate is not None:
            gate = self.ops.gelu_tanh_and_mul(torch.cat([self.per_layer_input_gate(x), per_layer_input], dim=-1))
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gate))[0]
        return x * self.layer_scalar, None


@functools.cache
def rounded_to(scale: float, dtype: torch.dtype) -> torch.Tensor:
    """`scale` as a 0-d CPU tensor of `dtype` (a scalar to ops on any device, traced as a constant): transformers
    rounds Gemma's embedding scale to the table's dtype before multiplying (sqrt(640) is 25.25 in bfloat16,
    not 25.298: the residual stream 0.2% off its bfloat16 reference otherwise). float32 products are as before."""
    return torch.tensor(scale, dtype=dtype)


class LlamaForCausalLM(nn.Module, BaseStepModel):
    def __init__(self, config: ModelConfig, block_size: int = 16, ops: Ops | None = None) -> None:
        """`ops`: the kernels every layer uses (kernels/ops.py); by default those for torch's default device."""
        super().__init__()
        self.config = config
        self.block_size = block_size
        self.ops = ops if ops is not None else select_ops()
        # One backend per window: `attention` plans the full-attention layers (all layers, in a model whose
        # layers are alike) and `local_attention`, when the layers differ, the sliding-window ones. Each
        # layer runs the backend of its window, with the plan that backend made (see `plan`).
        mixed = config.layer_types is not None
        self.attention = attention_for(self.ops, block_size, None if mixed else config.sliding_window)
        self.local_attention = attention_for(self.ops, block_size, config.sliding_window) if mixed else None
        # Per layer: a sliding-window layer among full ones (its own backend, plan and rotary frequencies).
        self.windowed = [mixed and kind == "sliding_attention" for kind in config.layer_types or ()]
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, self.local_attention if mixed and self.windowed[i] else self.attention, self.ops,
                         layer_index=i)
            for i in range(config.num_layers)
        )
        if config.per_layer_input_size:  # Gemma 4's per-layer embeddings (`per_layer_inputs`)
            width = config.num_layers * config.per_layer_input_size
            self.embed_tokens_per_layer = nn.Embedding(config.per_layer_vocab_size, width)
            self.per_layer_model_projection = nn.Linear(config.hidden_size, width, bias=False)
            self.per_layer_projection_norm = RMSNorm(config.per_layer_input_size, config.rms_norm_eps, self.ops)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, self.ops)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # token id -> [hidden]: a reranker file's own rows for some tokens' logits (`token_logits`; loader.py).
        self.score_rows: dict[int, torch.Tensor] = {}
        # The vision tower and image processor of a model that reads images (model/vision.py), else None:
        # kept beside the decoder, not among its modules, which quantization and the C++ step walk.
        self.vision: Vision | None = None
        self.register_buffer("inv_freq", None, persistent=False)
        self.register_buffer("local_inv_freq", None, persistent=False)
        self.register_buffer("rotary_scale", None, persistent=False)
        # LongRoPE's long factors in use (`fit_rotary_to`: a context past the model's original one).
        self.long_context = False
        # Llama 4's attention temperature in use (`fit_rotary_to`: a context past its length).
        self.query_temperature = False
        self.make_rotary(torch.get_default_device())
        self._kv_cache_dtype: torch.dtype | None = None  # kv_cache_dtype's setting (None: the activations')
        # The layers as one C++ call (model/cpu_step.py), built at the first step that can use it and again
        # after any module, parameter or buffer is registered; `cpu_step_reason` says why there is none.
        # use_cpu_step False: always the eager layers (benchmarks compare the two in one process).
        self.use_cpu_step = True
        self.cpu_step: CpuDecoderStep | None = None
        self.cpu_step_reason: str | None = "not built yet"
        self._cpu_step_version = -1

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64, the new tokens of every sequence, laid end to end
        positions: torch.Tensor,  # [T] int64, position of each token in its own sequence
        kv_caches: list[torch.Tensor],  # one [2, num_blocks, block_size, kv_heads, head_dim] per layer
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden] final hidden states (normed); logits come from compute_logits
        return self.run(input_ids, positions, kv_caches, self.plan(attn_metadata))

    def make_rotary(self, device: torch.device | str) -> None:
        """(Re)make the rotary frequencies, float32 buffers outside the state dict, on `device`:
        `local_inv_freq` those of the sliding-window layers (the same tensor when they rotate alike)."""
        self.inv_freq = inverse_frequencies(self.config, self.long_context).to(device)
        scale = rotary_scale(self.config)
        self.rotary_scale = None if scale is None else scale.to(device)
        local = local_inverse_frequencies(self.config)
        self.local_rotates_apart = local is not None  # else the windowed layers take the full ones' cos and sin
        self.local_inv_freq = self.inv_freq if local is None else local.to(device)

    def fit_rotary_to(self, max_model_len: int) -> None:
        """LongRoPE: its long factors when the context served exceeds the model's original one, else its short
        ones (as llama.cpp chooses by context; transformers switches by each call's length, which rotates a
        sequence's cached keys one way and its later ones the other). Llama 4's attention temperature is
        computed only for a context that reaches it (Ministral 3: past 16,384 tokens). Nothing for other
        rotations."""
        original = self.config.rope_original_max_position_embeddings
        long_context = original is not None and max_model_len > original
        if long_context != self.long_context:
            self.long_context = long_context
            self.make_rotary(self.device)
        length = self.config.attention_temperature_length
        self.query_temperature = bool(self.config.attention_temperature_beta) and max_model_len > (length or 0)

    def query_scale(self, positions: torch.Tensor) -> torch.Tensor:
        """[T, 1, 1] float32: Llama 4's attention temperature, 1 + beta ln(1 + floor(position / length)), in
        transformers' arithmetic (1 below `length`)."""
        cfg = self.config
        steps = torch.floor(positions.to(torch.float32) / cfg.attention_temperature_length)
        return (1 + cfg.attention_temperature_beta * torch.log(1 + steps))[:, None, None]

    # -- the step interface (model/step.py; BaseStepModel gives the rest: one pool, warm-up, close) -----

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def activation_dtype(self) -> torch.dtype:
        """What the layers compute in and pass between them: the final norm's dtype (float32 when quantized;
        the embedding may be a GGUF file's blocks, model/block_embedding.py)."""
        return self.norm.weight.dtype

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """The KV cache's element type: the activations' unless set (`--kv-cache-dtype`: a 16-bit cache under
        float32 activations halves the cache's memory and the bytes attention reads; keys and values are
        rounded as they are written, and attention computes in float32)."""
        return self._kv_cache_dtype or self.activation_dtype

    @kv_cache_dtype.setter
    def kv_cache_dtype(self, dtype: torch.dtype | None) -> None:  # None: the activations' again
        if dtype is not None and dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"a KV cache holds float32, bfloat16 or float16, not {dtype}")
        self._kv_cache_dtype = dtype

    def plan(self, attn_metadata: AttentionMetadata) -> AttentionPlan | tuple[AttentionPlan, AttentionPlan]:
        """The backend's plan; with sliding-window layers among full ones, (full layers' plan, windowed
        layers' plan): a plan may hold the window's mask. The windowed layers read the metadata's `window`
        tables when the engine gives them a pool of their own (engine/window_blocks.py)."""
        if self.config.linear_layers:  # (attention plan, RecurrentPlan) for the attention and linear layers
            return self.attention.plan(attn_metadata), RecurrentPlan.build(attn_metadata)
        if self.local_attention is None:  # every layer alike: windowed ones read the windowed tables, if any
            return self.attention.plan(attn_metadata.window or attn_metadata)
        return self.attention.plan(attn_metadata), self.local_attention.plan(attn_metadata.window or attn_metadata)

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        plan: AttentionPlan,  # the attention backend's plan: tensors only, shared by every layer
        input_embeds: InputEmbeds | None = None,  # rows that run on these embeddings instead of their tokens'
    ) -> torch.Tensor:
        """`forward` after the plan is built: no Python numbers from the metadata, so one compiled graph
        serves every batch shape."""
        cos, sin = rotary_cos_sin_ref(positions, self.inv_freq)  # [T, head_dim / 2] each
        if self.rotary_scale is not None:  # LongRoPE's attention factor, on the rotated pairs
            cos, sin = cos * self.rotary_scale, sin * self.rotary_scale
        x = self.embed_tokens(input_ids)
        if self.config.embedding_scale is not None:
            x = x * rounded_to(self.config.embedding_scale, x.dtype)
        if input_embeds is not None:  # an image's embeddings in its tokens' places (unscaled, as trained)
            x = x.index_copy(0, input_embeds.rows, input_embeds.values.to(x.dtype))
        q_scale = self.query_scale(positions) if self.query_temperature else None  # [T, 1, 1] or None
        if self.use_cpu_step and CpuDecoderStep.takes(plan, kv_caches) and self.decoder_step() is not None:
            if self.config.nope_layers:  # the step's second rotation is the NoPE layers': none (model/cpu_step.py)
                local = torch.ones_like(cos), torch.zeros_like(sin)
            elif self.local_attention is None:
                local = cos, sin
            else:
                local = self.local_cos_sin(positions, cos, sin)
            per_layer = self.per_layer_inputs(input_ids, x) if self.config.per_layer_input_size else None
            if self.config.linear_layers and plan[-1].fresh.numel():  # sequences starting: their states from zeros
                for i in self.config.linear_layers:
                    kv_caches[i].index_fill_(0, plan[-1].fresh, 0.0)
            return self.cpu_step(x, cos, sin, *local, kv_caches, plan, per_layer, q_scale)
        residual = None
        if self.config.layers_alike:
            if self.local_attention is None:
                for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                    x, residual = layer(x, residual, cos, sin, kv_cache, plan, q_scale=q_scale)
            else:
                full_plan, local_plan = plan
                local = self.local_cos_sin(positions, cos, sin)
                for layer, kv_cache, windowed in zip(self.layers, kv_caches, self.windowed, strict=True):
                    x, residual = layer(x, residual, *(local if windowed else (cos, sin)), kv_cache,
                                        local_plan if windowed else full_plan)
        elif self.config.linear_layers:  # Qwen3.5
            attention_plan, recurrent_plan = plan
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                x, residual = layer(x, residual, cos, sin, kv_cache,
                                    attention_plan if layer.linear_attn is None else recurrent_plan)
        else:  # Gemma 4
            x, residual = self.run_gemma4_layers(x, input_ids, cos, sin, positions, kv_caches, plan)
        x, _ = self.norm(x, residual)
        return x

    def run_gemma4_layers(self, x: torch.Tensor, input_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          positions: torch.Tensor, kv_caches: list[torch.Tensor],
                          plan: AttentionPlan) -> tuple[torch.Tensor, None]:
        """The layers of a model whose layers differ (Gemma 4): each with its per-layer embedding, the layers
        that read an earlier layer's cache given its keys and values."""
        per_layer = self.per_layer_inputs(input_ids, x) if self.config.per_layer_input_size else None
        shared_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        full_plan, local_plan = plan if self.local_attention is not None else (plan, plan)
        local = self.local_cos_sin(positions, cos, sin)
        residual = None
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            windowed = self.windowed[i] if self.windowed else False
            x, residual = layer(x, residual, *(local if windowed else (cos, sin)), kv_cache,
                                local_plan if windowed else full_plan,
                                None if per_layer is None else per_layer[:, i], shared_kv)
        return x, residual

    def local_cos_sin(self, positions: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The sliding-window layers' rotation: their own frequencies (Gemma's base, unscaled), or the full
        layers' cos and sin (scaled as theirs) where both rotate alike (GPT-OSS's YaRN)."""
        if not self.local_rotates_apart:
            return cos, sin
        return rotary_cos_sin_ref(positions, self.local_inv_freq)

    def per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Gemma 4's per-layer embeddings [T, num_layers, per_layer_input_size]: each token's own (scaled by
        sqrt of their size) averaged with a normed projection of its embedding x [T, hidden] (scaled)."""
        cfg = self.config
        size = cfg.per_layer_input_size
        own = self.embed_tokens_per_layer(input_ids).view(-1, cfg.num_layers, size) * size**0.5
        projected = (self.per_layer_model_projection(x) * cfg.hidden_size**-0.5).view(-1, cfg.num_layers, size)
        projected, _ = self.per_layer_projection_norm(projected)
        return (projected + own) * 2**-0.5

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.cpu_step, self._cpu_step_version = None, -1  # a copy's step is built over its own tensors

    def decoder_step(self) -> CpuDecoderStep | None:
        """The layers' C++ step for the modules as they are now, or None (`cpu_step_reason` says why)."""
        if self._cpu_step_version != structure_version():
            self._cpu_step_version = structure_version()
            reason = step_support(self)
            if reason != self.cpu_step_reason:
                log.info("decoder layers: %s", "one C++ call a step" if reason is None else f"eager ({reason})")
            self.cpu_step_reason = reason
            self.cpu_step = CpuDecoderStep(self) if reason is None else None
        return self.cpu_step

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] float32 (only for the rows that need sampling)."""
        logits = self.lm_head(hidden).float()
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def token_logits(self, hidden: torch.Tensor, token_ids: Sequence[int]) -> torch.Tensor:
        """hidden [hidden] float32 (a row `sample_logits_and_hidden` returned) -> the logits [T] float32 of
        `token_ids`, as sampling that row would see them: a reranker's "no" and "yes"."""
        row = hidden.to(self.device, self.activation_dtype)[None]
        logits = self.compute_logits(row)[0, list(token_ids)]
        for k, token in enumerate(token_ids):  # a reranker file's own rows for these tokens (model/loader.py)
            own = self.score_rows.get(token)
            if own is not None:
                value = (own @ row[0]).float()
                cap = self.config.final_logit_softcapping
                logits[k] = value if cap is None else torch.tanh(value / cap) * cap
        return logits.cpu()

    def sample_logits(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        plan: AttentionPlan,
        sample_rows: torch.Tensor,  # [B] rows of the flat batch whose next token is drawn
        input_embeds: InputEmbeds | None = None,
    ) -> torch.Tensor:  # [B, vocab] float32
        """One step as the engine runs it: write the cache, return the logits of the rows to sample."""
        return self.compute_logits(self.run(input_ids, positions, kv_caches, plan, input_embeds)[sample_rows])

    def sample_logits_and_hidden(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        plan: AttentionPlan,
        sample_rows: torch.Tensor,  # [B]
        hidden_rows: torch.Tensor,  # [H] rows whose final hidden states an embedding pools
        input_embeds: InputEmbeds | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [B, vocab], [H, hidden] float32
        hidden = self.run(input_ids, positions, kv_caches, plan, input_embeds)
        return self.compute_logits(hidden[sample_rows]), hidden[hidden_rows].float()

    def allocate_kv_caches(self, num_blocks: int, num_window_blocks: int | None = None,
                           num_state_slots: int = 0) -> list[torch.Tensor]:
        """`num_window_blocks`: the sliding-window layers' own pool (engine/window_blocks.py); None: every
        layer takes `num_blocks` under the same block ids. `num_state_slots`: the rows of the linear-attention
        layers' state pools (model/linear_attention.py)."""
        return allocate_kv_caches(self.config, self.block_size, num_blocks, self.kv_cache_dtype, self.device,
                                  num_window_blocks, num_state_slots)
