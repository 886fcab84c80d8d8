"""Weight-only INT8 matmul: y = x @ (weight * scale[:, None]).T with int8 weights, scaled per output channel.

The weights stay int8 in memory (half the bytes of fp16, which is what decode is bound by); each tile is
widened to the activations' dtype on the fly, accumulated in float32, and scaled once at the end.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.runtime import (
    FLOAT_DTYPES,
    HAS_TRITON,
    check_devices,
    check_tensor,
    dot_dtype,
    dot_precision,
    require_triton,
    tl,
    triton,
)


def int8_matmul_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] float, weight [N, K] int8, scale [N] float -> [M, N] of x's dtype."""
    return F.linear(x, weight.to(x.dtype)) * scale.to(x.dtype)


def quantize_int8_ref(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel quantization: weight [N, K] float -> (int8 [N, K], scale [N] float32)."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


if HAS_TRITON:

    @triton.jit
    def _int8_matmul_kernel(
        x_ptr, w_ptr, scale_ptr, out_ptr,
        M, N, K,
        stride_xm, stride_wn, stride_om,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):
        # Programs walk output tiles in groups of GROUP_M rows of tiles, so neighbouring programs share
        # weight tiles in L2.
        pid = tl.program_id(0)
        tiles_m = tl.cdiv(M, BLOCK_M)
        tiles_n = tl.cdiv(N, BLOCK_N)
        group = pid // (GROUP_M * tiles_n)
        first_m = group * GROUP_M
        group_size = tl.minimum(tiles_m - first_m, GROUP_M)
        tile_m = first_m + (pid % (GROUP_M * tiles_n)) % group_size
        tile_n = (pid % (GROUP_M * tiles_n)) // group_size

        rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        row_mask = rows < M
        col_mask = cols < N
        x_tile = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + ks[None, :]
        w_tile = w_ptr + cols.to(tl.int64)[None, :] * stride_wn + ks[:, None]  # [BLOCK_K, BLOCK_N]
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = (k0 + ks) < K
            x = tl.load(x_tile, mask=row_mask[:, None] & k_mask[None, :], other=0.0).to(DOT_DTYPE)
            w = tl.load(w_tile, mask=k_mask[:, None] & col_mask[None, :], other=0).to(DOT_DTYPE)
            acc += tl.dot(x, w, input_precision=DOT_PRECISION)
            x_tile += BLOCK_K
            w_tile += BLOCK_K
        acc = acc * tl.load(scale_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def _tiles(m: int, n: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages). Decode-sized M is bound by reading the weights:
    narrow, deep tiles give enough programs to keep every SM streaming. Large M is a regular GEMM."""
    if m <= 16:
        return 16, 16 if n < 8192 else 32, 256, 4, 4
    if m <= 64:
        return 64, 64, 64, 4, 4
    return 128, 128, 64, 8, 3


def int8_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Triton int8_matmul_ref. x [M, K] (rows at any stride), weight [N, K] int8, scale [N] -> new [M, N]."""
    require_triton()
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    m, k = x.shape
    check_tensor("weight", weight, shape=[None, k], dtypes=[torch.int8])
    n = weight.shape[0]
    check_tensor("scale", scale, shape=[n], dtypes=FLOAT_DTYPES)
    check_devices(x=x, weight=weight, scale=scale)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    block_m, block_n, block_k, num_warps, num_stages = _tiles(m, n)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _int8_matmul_kernel[grid](
        x, weight, scale, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8,
        DOT_DTYPE=dot_dtype(x.dtype), DOT_PRECISION=dot_precision(x.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


@torch.library.custom_op("ladder::int8_matmul", mutates_args=())
def int8_matmul_op(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`int8_matmul` as one opaque op: `torch.compile` calls the kernel instead of tracing its launcher
    (whose tile choice branches on M), and a CUDA graph records the launch as it is."""
    return int8_matmul(x, weight, scale)


@int8_matmul_op.register_fake
def _(x, weight, scale):
    return x.new_empty(x.shape[0], weight.shape[0])
