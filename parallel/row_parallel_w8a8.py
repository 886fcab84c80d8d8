"""A row-parallel W8A8 linear whose ranks add integers, not floats: the same output as one process, bit for
bit.

One process computes y = (float(sum_k q_k w_k) * x_scale) * w_scale (+ bias), the sum exact in int32
(kernels/cpu_w8a8_linear.py). A rank holds the input columns k of its part, so it computes its part of
that integer sum; the ranks add the parts in int32 (exact, whatever the order) and then every rank applies
the float epilogue to the whole sum, in the kernel's order. Floats summed across ranks would round
differently from one process, and under W8A8 a last-bit difference in one layer can flip a rounding in
the next layer's activation quantization and, some tokens later, a greedy choice.

x_scale is the whole row's max |x| / 127, and a rank sees only its columns: the ranks all-reduce each
token's maximum first ([T, 1], MAX), and each quantizes its columns with that whole-row maximum.
Three calls per layer (maximum, int32 sums, epilogue: kernels/cpu_w8a8_linear.py) and two collectives.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.cpu_w8a8_linear import row_maximum, w8a8_epilogue, w8a8_int32, w8a8_int32_ref
from model.quantization import W8A8Linear
from parallel.collectives import Collectives


class RowParallelW8A8(nn.Module):
    def __init__(self, linear: W8A8Linear, collectives: Collectives) -> None:
        """`linear`: the rank's shard, weight [N, K_rank] int8, bias (whole, on every rank) or None."""
        super().__init__()
        self.linear = linear
        self.collectives = collectives

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, K_rank] -> [T, N] float32
        x = x.float().contiguous()
        maximum = self.collectives.all_reduce(row_maximum(x), op="max")  # [T, 1]
        linear = self.linear
        if linear.packed is not None:
            sums = w8a8_int32(x, linear.packed, linear.wsum, linear.out_features, maximum)
        else:
            sums = w8a8_int32_ref(x, linear.weight, maximum)
        sums = self.collectives.all_reduce(sums)  # int32: exact in any order
        return w8a8_epilogue(sums, maximum, linear.scale, linear.bias)
