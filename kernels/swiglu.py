"""Gated activations on the fused gate-up projection: SwiGLU silu(gate) * up (Llama, Qwen), GeGLU
gelu_tanh(gate) * up (Gemma, GELU's tanh approximation) and GPT-OSS's clamped SwiGLU (its reference only)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

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


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2 * I] (gate first, up second) -> [..., I]."""
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2 * I] (gate first, up second) -> [..., I]."""
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def clamped_swiglu_ref(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's experts: gate_up [..., 2 * I] (gate first, up second) -> [..., I], with g = min(gate, limit):
    (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)."""
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    gate = gate.clamp(max=limit)
    return (up.clamp(-limit, limit) + 1) * (gate * torch.sigmoid(gate * alpha))


if HAS_TRITON:

    @triton.jit
    def _silu_and_mul_kernel(
        in_ptr, out_ptr, stride_in, stride_out, size, BLOCK: tl.constexpr, GELU: tl.constexpr = False,
    ):
        # Program (row, chunk) writes out[row, chunk * BLOCK : (chunk + 1) * BLOCK].
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < size
        gate = tl.load(in_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(in_ptr + row * stride_in + size + cols, mask=mask, other=0.0).to(tl.float32)
        if GELU:  # 0.5 g (1 + tanh(u)) = g sigmoid(2u), u = sqrt(2 / pi) (g + 0.044715 g^3)
            inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
            out = gate / (1.0 + tl.exp(-2.0 * inner)) * up
        else:
            out = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Triton silu_and_mul_ref: gate_up [..., 2 * I], last dimension contiguous -> new [..., I]."""
    return _gated(gate_up, gelu=False)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Triton gelu_tanh_and_mul_ref: gate_up [..., 2 * I], last dimension contiguous -> new [..., I]."""
    return _gated(gate_up, gelu=True)


def _gated(gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:
    require_triton()
    check_tensor("gate_up", gate_up, dtypes=FLOAT_DTYPES)
    if gate_up.dim() == 0 or gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up must end in an even dimension (gate then up), got shape {list(gate_up.shape)}")
    check_devices(gate_up=gate_up)
    size = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, gate_up.shape[-1])
    out = torch.empty(rows.shape[0], size, dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0] and size:
        block = min(1024, next_power_of_2(size))
        grid = (rows.shape[0], triton.cdiv(size, block))
        _silu_and_mul_kernel[grid](rows, out, rows.stride(0), out.stride(0), size, BLOCK=block, GELU=gelu,
                                   num_warps=4)
    return out.view(*gate_up.shape[:-1], size)
