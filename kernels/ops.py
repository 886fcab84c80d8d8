"""The decoder's fusable operations, as one namespace chosen once per model: Triton kernels or references.

`select_ops(device)` gives the Triton kernels for a CUDA device (when Triton is installed) and the
plain-torch references anywhere else. The environment variable LADDER_KERNELS forces a side:
`torch`, or `triton` (on a machine without CUDA that means Triton's interpreter: slow, for tests).
The model calls the same names either way, so its code does not change with the choice.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels import cpu_decode_attention as cpu_kernel
from kernels import cpu_fused_ops as cpu_fused
from kernels.rms_norm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref
from kernels.rotary import rotary_embedding_, rotate_ref
from kernels.runtime import HAS_TRITON, INTERPRETING, require_triton
from kernels.swiglu import gelu_tanh_and_mul, gelu_tanh_and_mul_ref, silu_and_mul, silu_and_mul_ref

KERNELS_ENV = "LADDER_KERNELS"

Tensor = torch.Tensor


@dataclass(frozen=True)
class Ops:
    """One implementation of each op; all take and return tensors of the model's dtype unless noted."""

    # Names the side too: the model picks its attention backend by it (model/attention/), since
    # attention backends hold state per model and live above the kernels.
    name: str  # "torch", "cpu" (torch, with the C++ decode attention) or "triton"
    rms_norm: Callable[[Tensor, Tensor, float], Tensor]  # (x, weight, eps) -> normed
    fused_add_rms_norm: Callable[[Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor]]  # -> (normed, x + residual)
    # (q [T, Hq, D], k [T, Hk, D], cos, sin [T, D/2] float32) -> rotated (q, k); may rotate in place
    apply_rotary: Callable[[Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]
    silu_and_mul: Callable[[Tensor], Tensor]  # gate_up [..., 2I] -> [..., I]
    gelu_tanh_and_mul: Callable[[Tensor], Tensor]  # gate_up [..., 2I] -> [..., I] (Gemma's GeGLU)


def _rotate_both_ref(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    return rotate_ref(q, cos, sin), rotate_ref(k, cos, sin)


def _rotate_both_(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    return rotary_embedding_(q, k, cos=cos, sin=sin)


TORCH_OPS = Ops(
    name="torch", rms_norm=rms_norm_ref, fused_add_rms_norm=fused_add_rms_norm_ref, apply_rotary=_rotate_both_ref,
    silu_and_mul=silu_and_mul_ref, gelu_tanh_and_mul=gelu_tanh_and_mul_ref,
)
# The CPU default: RMSNorm, the rotary embedding and the gated activations as one C++ call each for
# float32 (the references otherwise, and under torch.compile), and decode attention on the C++ kernel
# when it builds.
CPU_OPS = dataclasses.replace(TORCH_OPS, name="cpu", rms_norm=cpu_fused.rms_norm,
                              fused_add_rms_norm=cpu_fused.fused_add_rms_norm, apply_rotary=cpu_fused.rotary,
                              silu_and_mul=cpu_fused.silu_and_mul, gelu_tanh_and_mul=cpu_fused.gelu_tanh_and_mul)
TRITON_OPS = Ops(
    name="triton", rms_norm=rms_norm, fused_add_rms_norm=fused_add_rms_norm, apply_rotary=_rotate_both_,
    silu_and_mul=silu_and_mul, gelu_tanh_and_mul=gelu_tanh_and_mul,
)


def select_ops(device: torch.device | str | None = None) -> Ops:
    """The ops for a model on `device` (default: torch's default device), honouring LADDER_KERNELS."""
    choice = os.environ.get(KERNELS_ENV, "").strip().lower() or "auto"
    device = torch.device(device) if device is not None else torch.get_default_device()
    if choice == "torch":
        return TORCH_OPS
    if choice == "triton":
        require_triton()
        if device.type == "cpu" and not INTERPRETING:
            raise RuntimeError(
                f"{KERNELS_ENV}=triton for a CPU model needs Triton's interpreter: "
                "set TRITON_INTERPRET=1 before ladder is imported"
            )
        return TRITON_OPS
    if choice != "auto":
        raise ValueError(f"{KERNELS_ENV}={os.environ[KERNELS_ENV]!r}: expected torch, triton or auto")
    # Automatic choice: compiled kernels only (the interpreter is for tests, never picked by itself).
    if device.type == "cuda" and HAS_TRITON and not INTERPRETING:
        return TRITON_OPS
    if device.type == "cpu" and cpu_kernel.is_enabled():
        return CPU_OPS
    return TORCH_OPS
