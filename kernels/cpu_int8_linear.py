"""Weight-only INT8 linear for the CPU: y = x @ (weight * scale[:, None]).T (+ bias), float32 accumulation.

torch's own `_weight_int8pack_mm` is several times slower than a float32 `F.linear` on AVX-512 CPUs, so
this is a small C++ kernel (kernels/csrc/int8_linear.cpp). The weights are repacked once (`pack`) into
blocks of 16 output channels interleaved per k, [ceil(N / 16), K, 16] int8, zero-padded: for one k the
micro-kernel loads 16 int8, widens them to 16 floats and multiplies them into up to 8 rows of x at once,
keeping 16-wide float32 accumulators in registers; the per-channel scale (and the bias) is applied once at
the end. Threads split the blocks of output channels. A scalar loop over the same layout is compiled where
AVX-512 is missing.

`int8_linear` is the custom op `ladder::int8_linear` (kernels/cpu_extension.py): the C++ kernel on CPU
tensors where the extension builds, its torch reference (dequantize + F.linear) anywhere else or with
LADDER_CPU_KERNELS=0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.cpu_extension import cpu_kernels_enabled, cpu_op, load

BLOCK_N = 16  # output channels interleaved per k in the packed layout


def is_enabled() -> bool:
    return cpu_kernels_enabled()


def available() -> bool:
    """Whether `int8_linear` runs the C++ kernel (built here and not switched off by LADDER_CPU_KERNELS=0)."""
    return load() is not None


def pack(weight_int8: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> the kernel's layout, int8 [ceil(N / 16), K, 16], output channels past N zero."""
    if weight_int8.dim() != 2 or weight_int8.dtype != torch.int8:
        raise ValueError(f"expected an int8 [N, K] weight, got {weight_int8.dtype} {tuple(weight_int8.shape)}")
    n, k = weight_int8.shape
    blocks = -(-n // BLOCK_N)
    padded = weight_int8.new_zeros(blocks * BLOCK_N, k)
    padded[:n] = weight_int8
    return padded.view(blocks, BLOCK_N, k).transpose(1, 2).contiguous()


def unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of `pack`: int8 [ceil(N / 16), K, 16] -> int8 [N, K]."""
    blocks, k, _ = packed.shape
    return packed.transpose(1, 2).reshape(blocks * BLOCK_N, k)[:n]


def int8_linear_ref(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                    n: int) -> torch.Tensor:
    """The torch path: dequantize the packed weight and run F.linear in float32; returns x's dtype."""
    weight = unpack(packed, n).float() * scale.float()[:, None]
    out = F.linear(x.float(), weight, None if bias is None else bias.float())
    return out.to(x.dtype)


def _fake(x, packed, scale, bias, n):
    return x.new_empty(x.shape[:-1] + (n,))


_int8_linear = cpu_op("int8_linear", int8_linear_ref, _fake)


def check_devices(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
    """All on one device: the C++ kernel reads host pointers, so a CUDA tensor among CPU ones would be
    read as host memory."""
    tensors = {"x": x, "packed": packed, "scale": scale} | ({} if bias is None else {"bias": bias})
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1:
        where = ", ".join(f"{name} on {t.device}" for name, t in tensors.items())
        raise ValueError(f"int8_linear: tensors must share one device, got {where}")


def int8_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                n: int) -> torch.Tensor:
    """y [..., N] = x [..., K] @ (weight * scale[:, None]).T (+ bias), with `packed = pack(weight)`.

    x is float32 or bfloat16 (computed in float32, returned in x's dtype); scale and bias are [N]."""
    check_devices(x, packed, scale, bias)  # shapes and dtypes: the C++ kernel's own checks
    return _int8_linear(x, packed, scale, bias, n)
