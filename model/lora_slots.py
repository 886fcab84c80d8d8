"""Resident LoRA adapters on a decoder: S slots of rank R on each adapted projection, read per row.

`LoRASlots.attach(module, max_loras, max_rank)` wraps the four projections of every layer (q/k/v fused,
o, gate/up fused, down) in a `LoRALinear`, from outside the decoder as the quantized layers are, whatever
the base layer is (float, W8A8, W4A8). Each wrapper holds, for the S slots,

    a [S, P * R, in]   the A of each of its P parts (q, k, v for qkv_proj) stacked, rank padded to R
    b [S, P * R, out]  their B transposed and scaled, part p's rows writing only part p's output columns

so one `kernels.lora.lora_add` per projection adds every row's own adapter (zeros where an adapter does
not target a part: a zero row of A gives a zero in the shrink, a zero column of B adds nothing). A fused
wrapper passes its parts' output columns as `splits` ([0, q, q + kv, q + 2 kv] for qkv_proj), so the
kernel reads part p's rank rows of b only in part p's columns (the zeros elsewhere are never read).

A step sets `rows` ([T] int64, a slot per row of the flat batch, -1 for the base model) for its duration
(engine/model_runner.py); with `rows` None the wrappers are the base layers exactly. A row of slot -1 is
the base layer's output bit for bit, so requests without an adapter keep their tokens in a mixed batch.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.lora import lora_add
from model.lora import LoRAAdapter, target_shape

# Fused projection -> (the sub-module holding it, the adapter targets it is made of, in output order)
FUSED_TARGETS = {"qkv_proj": ("self_attn", ("q_proj", "k_proj", "v_proj")), "o_proj": ("self_attn", ("o_proj",)),
                 "gate_up_proj": ("mlp", ("gate_proj", "up_proj")), "down_proj": ("mlp", ("down_proj",))}


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, slots: LoRASlots, a: torch.Tensor, b: torch.Tensor,
                 splits: list[int] | None = None) -> None:
        super().__init__()
        self.base = base
        self.in_features, self.out_features = a.shape[-1], b.shape[-1]
        self.slots = [slots]  # a list, so the owner is not registered as a submodule
        # Plain attributes, not buffers: the slots are run-time state, not part of the model's weights.
        self.a, self.b = a, b
        self.splits = splits  # the parts' cumulative output columns (P > 1), else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, in] -> [T, out]
        y = self.base(x)
        rows = self.slots[0].rows_for(x.shape[0])
        if rows is None:
            return y
        return lora_add(y, x, self.a, self.b, rows, self.splits)


class LoRASlots:
    def __init__(self, max_loras: int, max_rank: int) -> None:
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be at least 1, got {max_loras} and {max_rank}")
        self.max_loras, self.max_rank = max_loras, max_rank  # which adapter is in which slot: LoRAManager
        self.rows: torch.Tensor | None = None  # [T] int64 during a step with adapters, else None
        # The slot every row uses when `rows` is None (one adapter over a whole model, as `ladder generate
        # --lora` runs it); None: the base model.
        self.everywhere: int | None = None
        self.wrappers: dict[tuple[int, str], LoRALinear] = {}  # (layer, fused projection) -> its wrapper

    @classmethod
    def attach(cls, module: nn.Module, max_loras: int, max_rank: int) -> LoRASlots:
        """Wrap the projections of every layer of `module` (a LlamaForCausalLM, any precision) in place."""
        config = module.config
        config.require_alike_layers("LoRA")
        slots = cls(max_loras, max_rank)
        dtype, device = module.activation_dtype, module.device
        for index, layer in enumerate(module.layers):
            for fused, (block, parts) in FUSED_TARGETS.items():
                parent = getattr(layer, block)
                base = getattr(parent, fused)
                in_features = target_shape(config, parts[0])[1]
                widths = [target_shape(config, part)[0] for part in parts]
                out_features = sum(widths)
                splits = [sum(widths[:i]) for i in range(len(widths) + 1)] if len(parts) > 1 else None
                a = torch.zeros(max_loras, len(parts) * max_rank, in_features, dtype=dtype, device=device)
                b = torch.zeros(max_loras, len(parts) * max_rank, out_features, dtype=dtype, device=device)
                wrapper = LoRALinear(base, slots, a, b, splits)
                setattr(parent, fused, wrapper)
                slots.wrappers[(index, fused)] = wrapper
        return slots

    def rows_for(self, num_rows: int) -> torch.Tensor | None:
        if self.rows is not None or self.everywhere is None:
            return self.rows
        device = next(iter(self.wrappers.values())).a.device
        return torch.full((num_rows,), self.everywhere, dtype=torch.long, device=device)

    @classmethod
    def with_one(cls, module: nn.Module, adapter: LoRAAdapter) -> LoRASlots:
        """`module` running `adapter` on every row of every step (a slot of the adapter's own rank)."""
        slots = cls.attach(module, 1, adapter.rank)
        slots.load(0, adapter)
        slots.everywhere = 0
        return slots

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Put `adapter` into `slot` (replacing what was there)."""
        if adapter.rank > self.max_rank:
            raise ValueError(f"LoRA adapter {adapter.name!r} has rank {adapter.rank}, over --max-lora-rank "
                             f"{self.max_rank}")
        self.clear(slot)
        r_max = self.max_rank
        for (index, fused), wrapper in self.wrappers.items():
            columns = wrapper.splits or [0, wrapper.out_features]  # part p writes columns[p]:columns[p + 1]
            for part, target in enumerate(FUSED_TARGETS[fused][1]):
                weight = adapter.weights.get((index, target))
                if weight is not None:
                    rows = slice(part * r_max, part * r_max + weight.a.shape[0])
                    wrapper.a[slot, rows] = weight.a.to(wrapper.a.dtype)
                    wrapper.b[slot, rows, columns[part]:columns[part + 1]] = weight.b.t().to(wrapper.b.dtype)

    def clear(self, slot: int) -> None:
        for wrapper in self.wrappers.values():
            wrapper.a[slot].zero_()
            wrapper.b[slot].zero_()
