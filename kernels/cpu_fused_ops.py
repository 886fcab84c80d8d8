"""RMSNorm (with the residual add), the rotary embedding and SiLU x up as single C++ calls, for float32
models on a CPU.

At batch 1 a decode step of a small model is bound by the number of operations, not by their arithmetic:
the torch reference of RMSNorm is six ATen calls (float, pow, mean, add, rsqrt, two multiplies) and the
rotary embedding a dozen (slices, casts, four multiplies, two adds, a concatenation), each a few
microseconds of dispatch on a shared CPU, sixty norms and thirty rotations a step. Here each is one call
that reads its inputs once. Every row (token) is computed alone, in the same order whatever the batch, so
results do not depend on what else is in the step.

SiLU x up and GELU (tanh form) x up are one C++ call each too, with their own arithmetic (an AVX-512 exp,
within a few roundings of torch's): they are the functions the decoder step (model/cpu_step.py) runs, and
the eager model must compute what the step computes, bit for bit.

Each is a custom op (ladder::rms_norm, ladder::fused_add_rms_norm, ladder::rotary, ladder::silu_and_mul,
ladder::gelu_tanh_and_mul, ladder::clamped_swiglu, ladder::sigmoid_gate; kernels/csrc/fused_ops.cpp,
kernels/cpu_extension.py), called in eager mode only: under torch.compile the references are traced and
Inductor fuses their element-wise work into its own loops. Other dtypes and non-CPU tensors use the
references too, and so does every call where the extension cannot be built or LADDER_CPU_KERNELS=0.
"""

from __future__ import annotations

import torch

from kernels.cpu_extension import cpu_kernels_enabled, cpu_op, load  # noqa: F401  (load: callers build through it)
from kernels.rms_norm import fused_add_rms_norm_ref, rms_norm_ref
from kernels.rotary import rotate_ref
from kernels.swiglu import clamped_swiglu_ref, gelu_tanh_and_mul_ref, silu_and_mul_ref


def rotary_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """q, k rotated in place by the reference."""
    q.copy_(rotate_ref(q, cos, sin))
    k.copy_(rotate_ref(k, cos, sin))


_rms_norm = cpu_op("rms_norm", rms_norm_ref, lambda x, weight, eps: torch.empty_like(x))
_fused_add_rms_norm = cpu_op("fused_add_rms_norm", fused_add_rms_norm_ref,
                             lambda x, residual, weight, eps: (torch.empty_like(x), torch.empty_like(x)))
_rotary = cpu_op("rotary", rotary_ref, lambda q, k, cos, sin: None, mutates_args=("q", "k"))
_silu_and_mul = cpu_op("silu_and_mul", silu_and_mul_ref,
                       lambda gate_up: gate_up.new_empty(gate_up.shape[:-1] + (gate_up.shape[-1] // 2,)))
_gelu_tanh_and_mul = cpu_op("gelu_tanh_and_mul", gelu_tanh_and_mul_ref,
                            lambda gate_up: gate_up.new_empty(gate_up.shape[:-1] + (gate_up.shape[-1] // 2,)))
_clamped_swiglu = cpu_op("clamped_swiglu", clamped_swiglu_ref, lambda gate_up, alpha, limit:
                         gate_up.new_empty(gate_up.shape[:-1] + (gate_up.shape[-1] // 2,)))


def sigmoid_gate_ref(out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return out * torch.sigmoid(gate)


_sigmoid_gate = cpu_op("sigmoid_gate", sigmoid_gate_ref, lambda out, gate: torch.empty_like(out))


def sigmoid_gate(out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """out [T, n] * sigmoid(gate [T, n]): Qwen3.5's attention output gate, as the decoder step computes it."""
    if not _native(out, gate) or out.dim() != 2:
        return sigmoid_gate_ref(out, gate)
    return _sigmoid_gate(out.contiguous(), gate.contiguous())


def _native(*tensors: torch.Tensor) -> bool:
    """Whether to call the op: every tensor float32 on the CPU, the kernels on, in eager mode. Under
    torch.compile the references are traced: Inductor fuses their element-wise ops itself."""
    return (cpu_kernels_enabled() and not torch.compiler.is_compiling()
            and all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D], weight [D] -> [..., D]; `kernels.rms_norm.rms_norm_ref` up to float rounding."""
    if not _native(x, weight):
        return rms_norm_ref(x, weight, eps)
    return _rms_norm(x.contiguous(), weight.contiguous(), eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual)."""
    if not _native(x, residual, weight):
        return fused_add_rms_norm_ref(x, residual, weight, eps)
    return _fused_add_rms_norm(x.contiguous(), residual.contiguous(), weight.contiguous(), eps)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hk, D] rotated in place by cos, sin [T, D/2] float32; returns (q, k)."""
    if not _native(q, k, cos, sin) or q.stride(-1) != 1 or k.stride(-1) != 1:
        return rotate_ref(q, cos, sin), rotate_ref(k, cos, sin)
    _rotary(q, k, cos.contiguous(), sin.contiguous())
    return q, k


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I] (gate first) -> silu(gate) * up [..., I]; `silu_and_mul_ref` up to float rounding."""
    if not _native(gate_up) or gate_up.shape[-1] % 2:
        return silu_and_mul_ref(gate_up)
    return _silu_and_mul(gate_up.contiguous())


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's experts' act: gate_up [..., 2I] (gate first) -> [..., I]; `clamped_swiglu_ref` up to float
    rounding (the C++ experts call, kernels/cpu_w4a8_experts.py, runs the same function)."""
    if not _native(gate_up) or gate_up.shape[-1] % 2:
        return clamped_swiglu_ref(gate_up, alpha, limit)
    return _clamped_swiglu(gate_up.contiguous(), alpha, limit)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I] (gate first) -> gelu_tanh(gate) * up [..., I]; `gelu_tanh_and_mul_ref` up to float
    rounding."""
    if not _native(gate_up) or gate_up.shape[-1] % 2:
        return gelu_tanh_and_mul_ref(gate_up)
    return _gelu_tanh_and_mul(gate_up.contiguous())
