"""The W4A8 linear module: a GGUF's own 4-, 5-, 6- or 8-bit blocks, packed once for the CPU kernel
(kernels/cpu_w4a8_linear.py), times int8 activations quantized per 32-block."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from kernels import cpu_w4a8_linear

if TYPE_CHECKING:  # the decoder imports its C++ step, which takes this module: no import of the loaders here
    from model.gguf_blocks import BlockWeight


class W4A8Linear(nn.Module):
    """y [..., N] float32 = x [..., K] times w = d * u + m (or d * (u - zero)) per 32-block of each row,
    activations quantized per 32-block to int8; bit for bit `cpu_w4a8_linear.w4a8_matmul_ref`."""

    def __init__(self, weight: BlockWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.codes.shape
        self.bits, self.zero = weight.bits, weight.zero
        codes, scales = cpu_w4a8_linear.pack(weight.codes, weight.d, weight.m, weight.bits, weight.sub, weight.table)
        # [ceil(N / 16), K / 32, 256, 320, 416 or 512] uint8: 4-, 5-, 6- (with sub-scales) or 8-bit
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)  # [ceil(N / 16), K / 32, 1 or 2, 16] float16
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_w4a8_linear.w4a8_linear(x, self.codes, self.scales, self.bias, self.out_features, self.zero)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}"
