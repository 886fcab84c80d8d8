"""A float model rounded as `--quantization int8` rounds it, the reference the int8 path is checked against."""

from __future__ import annotations

import torch
from torch import nn


def int8_rounded(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [..., K] through int8 and back, per output channel (kernels/int8_matmul.py's rounding)."""
    from kernels.int8_matmul import quantize_int8_ref

    q, scale = quantize_int8_ref(weight.reshape(-1, weight.shape[-1]))
    return (q.float() * scale[:, None]).view(weight.shape)


def round_as_int8(module: nn.Module, expert_blocks: tuple[type, ...]) -> None:
    """In place: every linear's weight but a router's (`mlp.gate`) and a shared expert's gate, and the stacked
    experts (w13, w2) of each block of `expert_blocks`."""
    with torch.no_grad():
        for name, sub in module.named_modules():
            if isinstance(sub, nn.Linear) and not name.endswith(("mlp.gate", "shared_expert_gate")):
                sub.weight.copy_(int8_rounded(sub.weight))
            elif isinstance(sub, expert_blocks):
                sub.w13.copy_(int8_rounded(sub.w13))
                sub.w2.copy_(int8_rounded(sub.w2))
