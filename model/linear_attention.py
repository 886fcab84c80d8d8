"""Qwen3.5's linear-attention layer (Gated DeltaNet) and the per-sequence state it keeps instead of a KV cache.

The layer projects each token to queries, keys and values (through a short causal convolution), a gate z, a
write rate beta and a decay g, runs the gated delta rule (kernels/gated_delta.py) over its sequence's state,
normalises each value head's output and gates it with SiLU(z).

Its "cache" is a pool of states, one row per state slot: [num_slots, linear_state_size] float32, a row holding
the convolution's last K - 1 inputs [K - 1, C] and then the rule's matrices [Hv, Dk, Dv]. The engine gives
each running sequence a slot (engine/state_slots.py); a step's `AttentionMetadata.state_slots` says which row
is whose. A state has no positions: a sequence's tokens must come in order, each once, from its first (no
prefix from a cache, no drafts to take back), and a sequence's first step starts its state from zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels.gated_delta import causal_conv, chunked_delta_rule, delta_rule_step, l2_normalize
from model.attention_metadata import AttentionMetadata
from model.config import ModelConfig


@dataclass(frozen=True)
class RecurrentPlan:
    """What every linear-attention layer of a step needs from its metadata, read once per step.

    fresh: [F] slots whose sequence starts this step (their states are zeroed first).
    step_rows, step_slots: [B] the rows of the flat batch that are a sequence's only new token, and their slots.
    runs: (first row, end row, slot) of each sequence with more than one new token (a prompt's chunk)."""

    fresh: torch.Tensor
    step_rows: torch.Tensor
    step_slots: torch.Tensor
    runs: tuple[tuple[int, int, int], ...]

    @classmethod
    def build(cls, meta: AttentionMetadata) -> RecurrentPlan:
        if meta.state_slots is None:
            raise ValueError("a model with linear-attention layers needs each sequence's state slot in its step")
        starts = meta.query_start_loc.tolist()
        slots = meta.state_slots.tolist()
        cached = [n - (end - start) for n, start, end in zip(meta.seq_lens.tolist(), starts, starts[1:])]
        rows, step_slots, runs = [], [], []
        for s, slot in enumerate(slots):
            if starts[s + 1] - starts[s] == 1:
                rows.append(starts[s])
                step_slots.append(slot)
            else:
                runs.append((starts[s], starts[s + 1], slot))
        as_long = {"dtype": torch.long, "device": meta.state_slots.device}
        return cls(torch.tensor([slot for slot, n in zip(slots, cached) if n == 0], **as_long),
                   torch.tensor(rows, **as_long), torch.tensor(step_slots, **as_long), tuple(runs))


class GatedDeltaNet(nn.Module):
    """Names follow the checkpoints' `linear_attn.*`, with in_proj_qkv, in_proj_z, in_proj_b and in_proj_a fused
    into one `in_proj` (rows in that order: one matmul instead of four; the loader concatenates them)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.key_heads, self.value_heads = config.linear_key_heads, config.linear_value_heads
        self.key_dim, self.value_dim = config.linear_key_dim, config.linear_value_dim
        self.taps = config.linear_conv_kernel
        self.key_size = self.key_heads * self.key_dim
        self.value_size = self.value_heads * self.value_dim
        self.channels = 2 * self.key_size + self.value_size  # the convolution's: queries, keys, values
        self.in_proj = nn.Linear(config.hidden_size, self.channels + self.value_size + 2 * self.value_heads,
                                 bias=False)
        self.conv1d = nn.Conv1d(self.channels, self.channels, self.taps, groups=self.channels, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.value_heads))
        self.A_log = nn.Parameter(torch.zeros(self.value_heads))
        self.norm_weight = nn.Parameter(torch.ones(self.value_dim))  # the checkpoint's `norm.weight`
        self.out_proj = nn.Linear(self.value_size, config.hidden_size, bias=False)
        self.eps = config.rms_norm_eps
        self.tiled = config.linear_heads_tiled  # which key head each value head reads (model/config.py)

    def state_views(self, pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A pool [num_slots, linear_state_size] as its convolution inputs [num_slots, K - 1, C] and matrices
        [num_slots, Hv, Dk, Dv] (views: writes reach the pool)."""
        width = (self.taps - 1) * self.channels
        conv = pool[:, :width].view(-1, self.taps - 1, self.channels)
        return conv, pool[:, width:].view(-1, self.value_heads, self.key_dim, self.value_dim)

    def forward(self, x: torch.Tensor, pool: torch.Tensor, plan: RecurrentPlan) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; each sequence's state in `pool` advanced past its new tokens."""
        mixed, z, b, a = self.in_proj(x).float().split(
            [self.channels, self.value_size, self.value_heads, self.value_heads], dim=-1)
        beta = b.sigmoid()  # [T, Hv]
        g = -self.A_log.float().exp() * F.softplus(a + self.dt_bias.float())  # [T, Hv], <= 0
        weight = self.conv1d.weight[:, 0].float()  # [C, K]
        conv_state, matrices = self.state_views(pool)
        if plan.fresh.numel():
            pool.index_fill_(0, plan.fresh, 0.0)
        out = torch.empty(x.shape[0], self.value_heads, self.value_dim, device=x.device)
        if plan.step_rows.numel():  # one token of each of these sequences, batched
            rows, slots = plan.step_rows, plan.step_slots
            window = torch.cat([conv_state.index_select(0, slots), mixed[rows, None]], dim=1)  # [B, K, C]
            conv_state.index_copy_(0, slots, window[:, 1:])
            q, k, v = self.heads(causal_conv(window, weight)[:, 0])
            state = matrices.index_select(0, slots)
            out[rows] = delta_rule_step(q, k, v, g[rows], beta[rows], state)
            matrices.index_copy_(0, slots, state)
        for first, end, slot in plan.runs:  # a prompt's chunk, its own
            window = torch.cat([conv_state[slot], mixed[first:end]])  # [K - 1 + L, C]
            conv_state[slot] = window[end - first:]
            q, k, v = self.heads(causal_conv(window, weight))
            out[first:end] = chunked_delta_rule(q, k, v, g[first:end], beta[first:end], matrices[slot])
        normed = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm_weight.float()
        gated = normed * F.silu(z.view(-1, self.value_heads, self.value_dim))
        return self.out_proj(gated.view(-1, self.value_size).to(x.dtype))

    def heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The convolution's output [N, C] as queries and keys [N, Hv, Dk] (normed, queries scaled; each key head
        serves Hv / Hk value heads, consecutive ones or, tiled, every Hk-th) and values [N, Hv, Dv]."""
        q, k, v = mixed.split([self.key_size, self.key_size, self.value_size], dim=-1)
        q = l2_normalize(q.view(-1, self.key_heads, self.key_dim)) * self.key_dim**-0.5
        k = l2_normalize(k.view(-1, self.key_heads, self.key_dim))
        repeat = self.value_heads // self.key_heads
        if repeat > 1 and self.tiled:
            q, k = q.repeat(1, repeat, 1), k.repeat(1, repeat, 1)
        elif repeat > 1:
            q, k = q.repeat_interleave(repeat, dim=1), k.repeat_interleave(repeat, dim=1)
        return q, k, v.view(-1, self.value_heads, self.value_dim)
