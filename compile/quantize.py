"""Precision changes applied to a built model: 16-bit casts and INT8 weight-only linear layers.

INT8 weight-only swaps every `nn.Linear` of the decoder (and the LM head) for `Int8Linear`, as gpt-fast
does: weights stored int8 with one float32 scale per output channel, activations stay float. Decode
reads a quarter of the fp32 weight bytes, which is what bounds it. The embedding stays float: a lookup
reads a few rows, not the whole table.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import cpu_int8_linear
from kernels.int8_matmul import int8_matmul, quantize_int8_ref
from model.llama import LlamaForCausalLM

FLOAT_PRECISIONS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class Int8Linear(nn.Module):
    """y = x @ (weight_int8 * scale[:, None]).T + bias, weights int8 [N, K], scale float32 [N]."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scale", torch.ones(out_features, dtype=torch.float32))
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)
        # The CPU kernel's interleaved layout, rebuilt from `weight` by `pack()` (not saved).
        self.register_buffer("packed", None, persistent=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        module = cls(linear.in_features, linear.out_features, linear.bias is not None)
        module.weight, module.scale = quantize_int8_ref(linear.weight.detach())
        if linear.bias is not None:
            module.bias = linear.bias.detach().float()
        return module.pack()

    def pack(self) -> Int8Linear:
        if self.weight.device.type == "cpu":
            self.packed = cpu_int8_linear.pack(self.weight)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:  # the Triton kernel; bias added after
            y = int8_matmul(x.reshape(-1, self.in_features), self.weight, self.scale)
            y = y.reshape(*x.shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias.to(y.dtype)
        return cpu_int8_linear.int8_linear(x, self.packed, self.scale, self.bias, self.out_features)


def linear_names(module: LlamaForCausalLM) -> list[str]:
    """Every linear layer INT8 replaces: q/k/v, o, gate/up, down of each layer, and the LM head."""
    return [name for name, m in module.named_modules() if isinstance(m, nn.Linear)]


def quantize_int8(module: LlamaForCausalLM) -> LlamaForCausalLM:
    """Swap the linear layers for Int8Linear in place (a tied LM head gets its own int8 copy)."""
    for name in linear_names(module):
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, child, Int8Linear.from_linear(getattr(parent, child)))
    return module


def int8_skeleton(module: LlamaForCausalLM) -> LlamaForCausalLM:
    """Empty Int8Linear layers in place of the linears (on the module's device, e.g. meta), ready for
    `load_state_dict(..., assign=True)` of a saved INT8 model; call `pack_all` after loading."""
    for name in linear_names(module):
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        old = getattr(parent, child)
        with torch.device(old.weight.device):
            setattr(parent, child, Int8Linear(old.in_features, old.out_features, old.bias is not None))
    return module


def pack_all(module: nn.Module) -> None:
    for m in module.modules():
        if isinstance(m, Int8Linear):
            m.pack()


def apply_precision(module: LlamaForCausalLM, precision: str) -> LlamaForCausalLM:
    """The module in `precision` (fp32, fp16, bf16: a cast; int8: fp32 activations, int8 linears)."""
    if precision in FLOAT_PRECISIONS:
        inv_freq = module.inv_freq  # rotary frequencies stay float32 whatever the weights' dtype
        module = module.to(FLOAT_PRECISIONS[precision])
        module.inv_freq = inv_freq
        return module
    if precision == "int8":
        return quantize_int8(module.float())
    raise ValueError(f"unknown precision {precision!r} (choose from fp32, fp16, bf16, int8)")


def activation_dtype(precision: str) -> torch.dtype:
    """The dtype of activations and of the KV cache for a precision (INT8 weight-only keeps fp32)."""
    return FLOAT_PRECISIONS.get(precision, torch.float32)
