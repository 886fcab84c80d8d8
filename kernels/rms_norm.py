"""RMSNorm, alone and fused with the residual add that precedes it in every decoder layer.

The references define the numerics: the sum is rounded to the input dtype (it becomes the residual
stream), normalised in float32, cast back, then scaled by the weight.
"""

from __future__ import annotations

import torch

from kernels.runtime import (
    FLOAT_DTYPES,
    HAS_TRITON,
    check_devices,
    check_tensor,
    next_power_of_2,
    require_triton,
    tl,
    triton,
)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D], weight [D] -> [..., D]."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual)."""
    x = x + residual
    return rms_norm_ref(x, weight, eps), x


if HAS_TRITON:

    @triton.jit
    def _rms_norm_kernel(
        x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
        stride_x, stride_residual, stride_out, stride_residual_out,
        size, eps,
        HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
    ):
        # One program normalises one row of `size` elements.
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < size
        # Arithmetic stays in float32 (the interpreter cannot do bfloat16 arithmetic); casts mark the
        # roundings the reference makes.
        dtype = x_ptr.dtype.element_ty
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0).to(tl.float32)
            x = (x + r).to(dtype)
            tl.store(residual_out_ptr + row * stride_residual_out + cols, x, mask=mask)
            x = x.to(tl.float32)
        inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / size + eps)
        normed = (x * inv_rms).to(dtype).to(tl.float32)
        weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols, (normed * weight).to(dtype), mask=mask)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    require_triton()
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension")
    size = x.shape[-1]
    check_tensor("weight", weight, shape=[size], dtypes=[x.dtype])
    tensors = {"x": x, "weight": weight}
    if residual is not None:
        check_tensor("residual", residual, shape=list(x.shape), dtypes=[x.dtype])
        tensors["residual"] = residual
    check_devices(**tensors)
    # [..., size] -> [rows, size]: a view when the leading dimensions allow it, else a copy.
    x2 = x.reshape(-1, size)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    residual2 = residual.reshape(-1, size) if residual is not None else x2
    residual_out = torch.empty_like(out) if residual is not None else out
    num_rows = x2.shape[0]
    if num_rows:
        block = next_power_of_2(size)
        _rms_norm_kernel[(num_rows,)](
            x2, residual2, weight, out, residual_out,
            x2.stride(0), residual2.stride(0), out.stride(0), residual_out.stride(0),
            size, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)),
        )
    return out.view(x.shape), residual_out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton rms_norm_ref: x [..., D] (last dimension contiguous), weight [D] of x's dtype."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton fused_add_rms_norm_ref: returns (normed, x + residual) as new tensors."""
    return _launch(x, residual, weight, eps)
