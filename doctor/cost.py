"""What one step of a model costs in bytes moved and floating-point work, from its config alone.

Counted as a roofline counts them: the weights of every linear layer are read once per step whatever
the batch (they are reused across the step's rows), the KV cache is read for every attended position
and written for every new token, and each weight does one multiply-add (2 FLOPs) per row it touches.
Norms, rotary embeddings and the embedding gather are left out: they are a few per cent at most. A mixture
of experts' layer reads its router and the experts its tokens reach, and each token multiplies k of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from model.config import ModelConfig
from model.precision import PRECISIONS


@dataclass(frozen=True)
class StepCost:
    bytes: float
    flops: float

    @property
    def intensity(self) -> float:
        """FLOPs per byte: where the step sits on the roofline's x axis."""
        return self.flops / self.bytes


@dataclass(frozen=True)
class ModelCost:
    config: ModelConfig
    precision: str  # a name of model/precision.py
    kv_itemsize: int  # bytes of one cached key or value element
    # Bytes a matmul weight takes as the loaded kernels read it, scales included (`breakdown.
    # matmul_weight_bytes` over `dense_params` and `expert_params`): the dense weights' (attention, dense
    # MLPs, routers, head) and the experts'; None: the precision's nominal size. W4A8's depends on the file
    # (0.5625-1.125 bytes by its blocks' widths), and a MoE model's router stays float beside W4A8 experts.
    bytes_per_weight: float | None = None
    expert_bytes_per_weight: float | None = None

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {self.precision!r} (choose from {', '.join(PRECISIONS)})")

    def _layers(self, experts_per_layer: float) -> float:
        """Matmul weights of every layer: attention (each layer's own head size and projections), the MLP,
        dense (3 H I) or sparse (the router's E H and `experts_per_layer` experts of 3 H I each; Gemma 4's
        experts beside a dense MLP), and Gemma 4's per-layer embedding gate and projection."""
        c = self.config
        h, expert = c.hidden_size, 3 * c.hidden_size * c.moe_intermediate_size
        total = float(h * c.num_layers * c.per_layer_input_size)  # the per-layer embeddings' model projection
        for i in range(c.num_layers):
            q, kv = c.num_heads * c.layer_head_dim(i), c.layer_kv_heads(i) * c.layer_head_dim(i)
            if c.is_linear_layer(i):  # Qwen3.5's linear attention: its input and output projections
                values = c.linear_value_heads * c.linear_value_dim
                inputs = 2 * c.linear_key_heads * c.linear_key_dim + 2 * values + 2 * c.linear_value_heads
                total += h * inputs + values * h
            else:
                gates = q if c.attention_output_gate else 0
                total += h * (q + (len(c.layer_projections(i)) - 1) * kv + gates) + q * h
            total += 2 * h * c.per_layer_input_size
            if not c.is_sparse_layer(i):
                total += 3 * h * c.layer_intermediate_size(i)
            if c.is_sparse_layer(i) or c.experts_beside_mlp:
                total += c.num_experts * h + experts_per_layer * expert
            if c.is_sparse_layer(i) and c.shared_expert_intermediate_size:  # Qwen3.5-MoE's, and its gate
                total += 3 * h * c.shared_expert_intermediate_size + h
        return total

    @property
    def layer_matmul_params(self) -> int:
        """Weights one token multiplies in the layers (a sparse layer's k experts, not its E)."""
        return round(self._layers(self.config.num_experts_per_tok))

    def _reached(self, num_tokens: int) -> float:
        """Experts of a sparse layer that at least one of `num_tokens` tokens reaches, E (1 - (1 - k / E)^T)
        on average (routing taken as uniform)."""
        c = self.config
        return c.num_experts * (1 - (1 - c.num_experts_per_tok / c.num_experts) ** num_tokens) \
            if c.num_experts else 0.0

    def expert_params(self, experts_per_layer: float | None = None) -> float:
        """Weights of `experts_per_layer` experts (None: all E) in every sparse layer."""
        c = self.config
        sparse = sum(c.is_sparse_layer(i) or c.experts_beside_mlp for i in range(c.num_layers))
        count = c.num_experts if experts_per_layer is None else experts_per_layer
        return sparse * count * 3 * c.hidden_size * c.moe_intermediate_size

    def layer_read_params(self, num_tokens: int) -> float:
        """Weights a step of `num_tokens` tokens reads in the layers, each once: a sparse layer's experts
        that at least one token reaches (`_reached`)."""
        return self._layers(self._reached(num_tokens))

    @property
    def head_params(self) -> int:
        return self.config.vocab_size * self.config.hidden_size

    @property
    def dense_params(self) -> int:
        """Weights of every matmul but the experts: attention, dense MLPs, routers and the head."""
        return round(self._layers(self.config.num_experts) - self.expert_params()) + self.head_params

    @property
    def num_params(self) -> int:
        """Every parameter: the matmuls (all experts), the embedding (once if tied to the head) and the norms."""
        c = self.config
        embedding = 0 if c.tie_word_embeddings else self.head_params
        embedding += c.per_layer_vocab_size * c.num_layers * c.per_layer_input_size  # Gemma 4's per-layer table
        return round(self._layers(c.num_experts)) + self.head_params + embedding + self._vectors()

    def _vectors(self) -> int:
        """Parameters outside the matmuls and embeddings: norm weights (q/k norms, Gemma's sandwich norms), and
        Gemma 4's layer scalars, per-layer embedding norms and router scales."""
        c = self.config
        h = c.hidden_size
        total = h + (c.per_layer_input_size if c.per_layer_input_size else 0)  # the final norm; Gemma 4's PLE norm
        for i in range(c.num_layers):
            total += h * (4 if c.sandwich_norms else 2) + (1 if c.layer_scalars else 0)
            if c.is_linear_layer(i):  # the convolution's taps, the decay's two vectors, the output norm
                channels = 2 * c.linear_key_heads * c.linear_key_dim + c.linear_value_heads * c.linear_value_dim
                total += channels * c.linear_conv_kernel + 2 * c.linear_value_heads + c.linear_value_dim
            elif c.qk_norm:
                total += c.layer_head_dim(i) * (2 if c.kv_source(i) == i else 1)
            if c.per_layer_input_size:
                total += h
            if c.experts_beside_mlp:
                total += 4 * h + c.num_experts  # three norms, the router's scale and per-expert scale
        return total

    @property
    def weight_bytes(self) -> float:
        """Bytes of weights a one-token step reads: the layers' matmuls (k experts a sparse layer) and the head."""
        return self.step_weight_bytes(1)

    def step_weight_bytes(self, num_tokens: int) -> float:
        """Bytes of weights a step of `num_tokens` tokens reads (a sparse layer's experts its tokens reach)."""
        dense = self.bytes_per_weight or PRECISIONS[self.precision].weight_bytes
        expert = self.expert_bytes_per_weight or dense
        experts = self.expert_params(self._reached(num_tokens))
        return (self.layer_read_params(num_tokens) - experts + self.head_params) * dense + experts * expert

    @property
    def kv_bytes_per_token(self) -> int:
        c = self.config  # a layer that reads an earlier layer's cache adds none
        return sum(2 * c.layer_kv_heads(i) * c.layer_head_dim(i) for i in range(c.num_layers)
                   if c.kv_source(i) == i and not c.is_linear_layer(i)) * self.kv_itemsize

    @property
    def matmul_kind(self) -> str:
        return PRECISIONS[self.precision].matmul

    def attention_flops(self, context: int) -> float:
        """One new token attending to `context` positions: QK^T and the weighted sum of V, every layer."""
        c = self.config
        return 4.0 * context * sum(c.num_heads * c.layer_head_dim(i) for i in range(c.num_layers))

    def step(self, query_lens: Sequence[int], seq_lens: Sequence[int], num_sampled: int) -> StepCost:
        """A step of several sequences: sequence i brings query_lens[i] new tokens and ends at seq_lens[i]
        tokens; `num_sampled` rows go through the head."""
        num_tokens = sum(query_lens)
        attended = 0.0  # sum over new tokens of the positions each attends to (causal within the chunk)
        for q, s in zip(query_lens, seq_lens, strict=True):
            attended += q * (s - q) + q * (q + 1) / 2
        flops = 2.0 * (self.layer_matmul_params * num_tokens + self.head_params * num_sampled)
        flops += self.attention_flops(1) * attended
        # The cache is read once per sequence (every query of a chunk shares the gathered blocks).
        kv_read = sum(s - q for q, s in zip(query_lens, seq_lens, strict=True)) * self.kv_bytes_per_token
        kv_write = num_tokens * self.kv_bytes_per_token
        return StepCost(self.step_weight_bytes(num_tokens) + kv_read + kv_write, flops)

    def decode_step(self, batch: int, context: int) -> StepCost:
        """`batch` sequences each adding one token after `context` cached ones."""
        return self.step([1] * batch, [context + 1] * batch, batch)

    def prefill_step(self, num_tokens: int) -> StepCost:
        """One prompt of `num_tokens` tokens from an empty cache; only its last row is sampled."""
        return self.step([num_tokens], [num_tokens], 1)

    def summary(self) -> dict:
        return {"num_params": self.num_params, "precision": self.precision, "weight_bytes": self.weight_bytes,
                "kv_bytes_per_token": self.kv_bytes_per_token,
                "decode_flops_per_token": self.decode_step(1, 0).flops,
                "decode_bytes_per_step": self.weight_bytes, "matmul_kind": self.matmul_kind}
