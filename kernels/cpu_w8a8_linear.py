"""W8A8 linear for the CPU: int8 weights times int8 activations quantized per row on the fly, int32 sums.

y [M, N] = (int32(q [M, K] @ w [N, K].T) * x_scale [M, 1]) * w_scale [N] (+ bias), where each row of x is
quantized symmetrically: x_scale = max(max|x_row|, 1e-12) / 127, q = round(x / x_scale) (half to even).

The integer sums are exact, so the C++ kernel returns the very bits of the torch reference
(`w8a8_matmul_ref`: `torch._int_mm`) whatever the blocking, thread count or batch: batch invariance
comes for free. It uses AVX-512 VNNI (`vpdpbusd`: 64 unsigned-by-signed byte products summed into 16
int32 lanes per instruction, four times the multiply-adds of a float32 FMA), which wants unsigned
activations: the kernel stores q + 128 and subtracts 128 * sum_k w[n, k] afterwards (`wsum`, computed once
at packing). One instruction per 64 weight bytes keeps batch-1 decode at the memory bound, where the
weight-only kernel spends three instructions per 16 weights widening them to float32.

Weights are packed once (`pack`) into blocks of 16 output channels by groups of 4 input channels,
[ceil(N / 16), ceil(K / 4), 16, 4] int8, zero-padded: one 64-byte load feeds one `vpdpbusd` for 16
channels. Threads split the blocks of output channels. Where AVX-512 VNNI is missing, AVX2 tiles over the
same layout take the signed q instead (`vpmaddubsw` of |w| by q with w's sign, then `vpmaddwd`: exact,
no int16 saturation), and a scalar loop is compiled where AVX2 is missing too (kernels/csrc/w8a8_linear.cpp).
Each function here is a custom op (kernels/cpu_extension.py): the C++ kernel on CPU tensors where the
extension builds, the torch reference anywhere else or with LADDER_CPU_KERNELS=0.
"""

from __future__ import annotations

import torch

from kernels.cpu_extension import cpu_op, load  # noqa: F401  (load: callers build the extension through it)

BLOCK_N = 16  # output channels per packed block
GROUP_K = 4  # input channels summed by one vpdpbusd lane


def w8a8_matmul_ref(rows: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The reference: rows [M, K] float32 quantized per row to int8, times weight int8 [N, K] with scale [N],
    int32 accumulation -> [M, N] float32."""
    q, x_scale = quantize_rows_ref(rows)  # |rows / x_scale| <= 127 by construction
    # torch._int_mm returns garbage for a transposed [1, N] operand (K = 1, torch 2.13 on a CPU).
    acc = torch._int_mm(q, weight.t()) if weight.shape[1] > 1 else q.int() @ weight.int().t()
    return acc.float() * x_scale * scale


def row_scale(row_maximum: torch.Tensor) -> torch.Tensor:
    """A row's activation scale from its max |x|, op for op as the C++ kernel computes it."""
    return row_maximum.clamp(min=1e-12) / 127


def quantize_rows_ref(rows: torch.Tensor, row_max: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [M, K] float32 -> (q int8 [M, K], x_scale [M, 1] float32), as every W8A8 path quantizes: with
    each row's own max |x|, or with `row_max` [M, 1] (a row-parallel rank's columns, the whole row's)."""
    x_scale = row_scale(row_maximum(rows) if row_max is None else row_max)
    return torch.round(rows / x_scale).to(torch.int8), x_scale


def row_maximum(rows: torch.Tensor) -> torch.Tensor:
    """rows [M, K] -> max |x| of each row, [M, 1] (exact: a maximum does not round). abs + amax: the
    infinity norm computes the same value ten times slower on a CPU (104 vs 9 us for [32, 768])."""
    return rows.abs().amax(dim=-1, keepdim=True)


def w8a8_int32_ref(rows: torch.Tensor, weight: torch.Tensor, row_max: torch.Tensor | None = None) -> torch.Tensor:
    """rows [M, K] float32, weight int8 [N, K] -> int32 [M, N], the reference of `w8a8_int32`."""
    q, _ = quantize_rows_ref(rows, row_max)
    if rows.device.type != "cpu":  # no int32 matmul there; float64 holds these sums (|s| < 2^31) exactly
        return (q.double() @ weight.double().t()).to(torch.int32)
    return torch._int_mm(q, weight.t()) if weight.shape[1] > 1 else q.int() @ weight.int().t()


def pack(weight_int8: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 [N, K] -> (packed int8 [ceil(N / 16), ceil(K / 4), 16, 4], wsum int32 [ceil(N / 16) * 16])."""
    if weight_int8.dim() != 2 or weight_int8.dtype != torch.int8:
        raise ValueError(f"expected an int8 [N, K] weight, got {weight_int8.dtype} {tuple(weight_int8.shape)}")
    n, k = weight_int8.shape
    blocks, groups = -(-n // BLOCK_N), -(-k // GROUP_K)
    padded = weight_int8.new_zeros(blocks * BLOCK_N, groups * GROUP_K)
    padded[:n, :k] = weight_int8
    packed = padded.view(blocks, BLOCK_N, groups, GROUP_K).transpose(1, 2).contiguous()
    return packed, padded.sum(dim=1, dtype=torch.int32)


def unpack(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The inverse of `pack`'s first output: int8 [N, K]."""
    blocks, groups, _, _ = packed.shape
    return packed.transpose(1, 2).reshape(blocks * BLOCK_N, groups * GROUP_K)[:n, :k]


def w8a8_linear_ref(x: torch.Tensor, packed: torch.Tensor, wsum: torch.Tensor, scale: torch.Tensor,
                    bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """`w8a8_linear` by the torch reference, from the packed weight (`wsum` is the kernel's alone)."""
    k = x.shape[-1]
    y = w8a8_matmul_ref(x.reshape(-1, k).float(), unpack(packed, n, k), scale.float())
    return (y if bias is None else y + bias.float()).view(*x.shape[:-1], n)


def w8a8_int32_packed_ref(x: torch.Tensor, packed: torch.Tensor, wsum: torch.Tensor, n: int,
                          row_max: torch.Tensor | None) -> torch.Tensor:
    """`w8a8_int32` by the torch reference, from the packed weight."""
    return w8a8_int32_ref(x.float(), unpack(packed, n, x.shape[-1]), row_max)


def w8a8_epilogue_ref(sums: torch.Tensor, row_max: torch.Tensor, scale: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
    y = (sums.float() * row_scale(row_max)) * scale.float()
    return y if bias is None else y + bias.float()


_w8a8_linear = cpu_op("w8a8_linear", w8a8_linear_ref,
                      lambda x, packed, wsum, scale, bias, n: x.new_empty(x.shape[:-1] + (n,), dtype=torch.float32))
_w8a8_int32 = cpu_op("w8a8_int32", w8a8_int32_packed_ref,
                     lambda x, packed, wsum, n, row_max: x.new_empty(x.shape[0], n, dtype=torch.int32))
_w8a8_epilogue = cpu_op("w8a8_epilogue", w8a8_epilogue_ref,
                        lambda sums, row_max, scale, bias: sums.new_empty(sums.shape, dtype=torch.float32))


def w8a8_linear(x: torch.Tensor, packed: torch.Tensor, wsum: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """y [..., N] float32 = w8a8(x [..., K], weight) (+ bias) with `packed, wsum = pack(weight)`; equal bit
    for bit to `w8a8_matmul_ref(x, weight, scale) + bias`."""
    return _w8a8_linear(x, packed, wsum, scale, bias, n)


def w8a8_int32(x: torch.Tensor, packed: torch.Tensor, wsum: torch.Tensor, n: int,
               row_max: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] float32 -> int32 [M, N]: the exact integer sums sum_k q[m, k] w[n, k] before any scale, so
    that `w8a8_epilogue(sums, max |x| per row, scale, bias)` is `w8a8_linear` bit for bit. A row-parallel
    layer adds its ranks' sums exactly before that epilogue, each rank quantizing its columns with the
    whole row's maximum, `row_max` [M, 1] (by default each row's own)."""
    return _w8a8_int32(x, packed, wsum, n, row_max)


def w8a8_epilogue(sums: torch.Tensor, row_max: torch.Tensor, scale: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """int32 sums [M, N], each row's max |x| [M, 1] -> float32 [M, N]: `w8a8_linear`'s epilogue in its order,
    ((float(sum) * x_scale) * scale) (+ bias)."""
    return _w8a8_epilogue(sums, row_max, scale, bias)
