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

from kernels.gated_delta import causal_conv_taps, chunked_delta_rule, gated_delta_decode, gated_rms_norm, heads
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
        self._taps: torch.Tensor | None = None  # `conv_taps`, and the weight it was made from
        self._taps_of: tuple[int, int] | None = None

    def forward(self, x: torch.Tensor, pool: torch.Tensor, plan: RecurrentPlan) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; each sequence's state in `pool` advanced past its new tokens."""
        projected = self.in_proj(x).float()  # [T, C + Hv Dv + 2 Hv]: convolution input, z, b, a
        if plan.fresh.numel():
            pool.index_fill_(0, plan.fresh, 0.0)
        if not plan.runs:  # decode: every row a sequence's one new token
            out = self.decode(projected, pool, plan.step_slots)
        else:
            out = torch.empty(x.shape[0], self.value_size, device=x.device)
            if plan.step_rows.numel():
                out[plan.step_rows] = self.decode(projected[plan.step_rows], pool, plan.step_slots)
            for first, end, slot in plan.runs:  # a prompt's chunk, its own
                out[first:end] = self.prompt(projected[first:end], pool[slot])
        return self.out_proj(out.to(x.dtype))

    def decode(self, projected: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """One token of each of B sequences [B, projected] -> [B, Hv Dv] (one C++ call, kernels/gated_delta.py)."""
        return gated_delta_decode(projected.contiguous(), pool, slots, self.conv_taps(), self.A_log.float(),
                                  self.dt_bias.float(), self.norm_weight.float(), self.key_heads, self.key_dim,
                                  self.value_dim, self.tiled, self.eps)

    def conv_taps(self) -> torch.Tensor:
        """[K, C] float32: the convolution's weight with each tap's channels contiguous, as its C++ ops read it
        (made again when the weight is replaced or changed in place)."""
        weight = self.conv1d.weight
        made_of = (weight.data_ptr(), weight._version)
        if self._taps is None or self._taps_of != made_of:
            self._taps = weight.detach().view(self.channels, self.taps).t().float().contiguous()
            self._taps_of = made_of
        return self._taps

    def prompt(self, projected: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """A sequence's run of L tokens [L, projected] -> [L, Hv Dv], its state row [linear_state_size] advanced:
        the convolution from the state's last inputs, the rule in chunks (kernels/gated_delta.py)."""
        mixed, z, b, a = projected.split([self.channels, self.value_size, self.value_heads, self.value_heads], dim=-1)
        width = (self.taps - 1) * self.channels
        conv_state = state[:width].view(self.taps - 1, self.channels)
        window = torch.cat([conv_state, mixed])  # [K - 1 + L, C]
        conv_state.copy_(window[mixed.shape[0]:])
        q, k, v = heads(causal_conv_taps(window, self.conv_taps()), self.key_heads, self.key_dim,  # (one C++ pass)
                        self.value_heads, self.value_dim, self.tiled)
        g = -self.A_log.float().exp() * F.softplus(a + self.dt_bias.float())  # [L, Hv], <= 0
        matrices = state[width:].view(self.value_heads, self.key_dim, self.value_dim)
        out = chunked_delta_rule(q, k, v, g, b.sigmoid(), matrices)
        return gated_rms_norm(out, z.view(-1, self.value_heads, self.value_dim), self.norm_weight.float(),
                              self.eps).flatten(1)
