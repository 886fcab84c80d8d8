"""A mixture-of-experts layer's W4A8 experts as one C++ call (ladder::w4a8_experts): every routed (token,
expert) pair's gate/up matmul, SiLU x up and down matmul, scaled by its routing weight, and each token's
slots summed in slot order (Gemma 4's experts: gelu_tanh(gate) x up; GPT-OSS's: each expert's biases added by
its two matmuls and the clamped SwiGLU, ladder::clamped_swiglu, in place of SiLU x up).

It is `grouped_experts` (kernels/moe.py) over W4A8 experts, computed the same way: pairs grouped by expert
in pair order, each expert's rows through the W4A8 kernel (kernels/cpu_w4a8_linear.py) and the C++ SiLU x up
(kernels/cpu_fused_ops.py), the same float multiplies and adds in the same order, so the C++ op equals its
reference (`w4a8_experts_ref`, the Python loop over experts) bit for bit. At batch 1 the Python loop was ~90
torch calls a layer, a third of a small MoE model's step; here it is one. Routing (softmax, top-k) stays in
torch, ahead of it.
"""

from __future__ import annotations

import torch

from kernels.cpu_extension import cpu_op
from kernels.cpu_fused_ops import clamped_swiglu, gelu_tanh_and_mul, silu_and_mul
from kernels.cpu_w4a8_linear import w4a8_linear


def w4a8_experts_ref(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w13_codes: torch.Tensor,
                     w13_scales: torch.Tensor, w13_zero: int, w2_codes: torch.Tensor, w2_scales: torch.Tensor,
                     w2_zero: int, expert_offset: int, gelu: bool = False, w13_bias: torch.Tensor | None = None,
                     w2_bias: torch.Tensor | None = None, swiglu_limit: float = 0.0,
                     swiglu_alpha: float = 1.0) -> torch.Tensor:
    """x [T, H] float32; weights [T, k] float32 and experts [T, k] int64 (`kernels.moe.route`); the held
    experts' packed weights stacked [E_held, ...] (cpu_w4a8_linear.pack: w13 each expert's gate rows then
    up rows [2I, H], w2 its down rows [H, I]), experts expert_offset .. expert_offset + E_held - 1 of the
    router's -> [T, H] float32, pairs routed elsewhere contributing 0. `gelu`: gelu_tanh(gate) * up (Gemma 4's
    experts) in place of silu(gate) * up. GPT-OSS's: w13_bias [E_held, 2I] and w2_bias [E_held, H] float32, each
    added by its linear, and swiglu_limit > 0: the clamped SwiGLU (`clamped_swiglu`) with swiglu_alpha."""
    from kernels.moe import grouped_experts  # kernels.moe imports this module

    hidden, inter2 = x.shape[1], 2 * 32 * w2_codes.shape[2]  # w2 packed [E, H / 16, I / 32, ...]

    def expert(e: int, rows: torch.Tensor, out: torch.Tensor) -> None:
        gate_up = w4a8_linear(rows, w13_codes[e], w13_scales[e], None if w13_bias is None else w13_bias[e], inter2,
                              w13_zero)
        if swiglu_limit > 0:
            act = clamped_swiglu(gate_up, swiglu_alpha, swiglu_limit)
        else:
            act = gelu_tanh_and_mul(gate_up) if gelu else silu_and_mul(gate_up)
        out.copy_(w4a8_linear(act, w2_codes[e], w2_scales[e], None if w2_bias is None else w2_bias[e], hidden,
                              w2_zero))

    return grouped_experts(x, weights, experts, expert, range(expert_offset, expert_offset + w13_codes.shape[0]))


w4a8_experts = cpu_op("w4a8_experts", w4a8_experts_ref,
                      lambda x, weights, experts, *rest: torch.empty_like(x, dtype=torch.float32))
