"""Rotary position embedding of q and k, Hugging Face half-split ("neox") layout.

Element j of a head pairs with element j + head_dim/2, both rotated by angle position * inv_freq[j]. The
angle of each token comes either from cos/sin tables (one row per token, or rows picked by `positions`)
or from `positions` and `inv_freq` directly; Llama 3 frequency scaling is already folded into inv_freq.
"""

from __future__ import annotations

import numpy as np
import torch

from kernels.runtime import (
    FLOAT_DTYPES,
    HAS_TRITON,
    INDEX_DTYPES,
    check_devices,
    check_tensor,
    next_power_of_2,
    require_triton,
    tl,
    triton,
)


def rope_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    """[head_dim / 2] float32 angular frequency theta^(-2j / head_dim) of each rotated pair, unscaled."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def rotary_cos_sin_ref(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] -> (cos, sin), each [T, head_dim / 2] float32: of the float32 angles position * inv_freq,
    on a CPU outside a compiled graph computed in float64 by numpy and rounded to float32.

    torch's float32 cos and sin on a CPU run on MKL's vector math library, whose threads split a call, and a
    process's first call was seen to come back with one thread's share at reduced accuracy (errors up to
    1.5e-4 on 1,024 of a prefill's 2,112 angles; MKL_NUM_THREADS=1 made it go away): the rotary angles, and
    so a request's greedy text, then depended on the process's history. numpy's float64 cos and sin run
    on the calling thread alone and within an ulp of float64, so their float32 rounding is the same in
    every run but where a value lies within an ulp of float64 of a rounding boundary."""
    angles = positions.float()[:, None] * inv_freq[None, :]  # [T, head_dim / 2], exact float32 products
    if angles.device.type != "cpu" or torch.compiler.is_compiling():
        return angles.cos(), angles.sin()  # Inductor's and CUDA's own code, no MKL threads
    wide = angles.detach().numpy().astype(np.float64)
    return torch.from_numpy(np.cos(wide).astype(np.float32)), torch.from_numpy(np.sin(wide).astype(np.float32))


def rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] rotated by per-token cos/sin [T, head_dim / 2]; a new tensor of x's dtype."""
    half = x.shape[-1] // 2
    cos = cos[:, None, :].to(x.dtype)
    sin = sin[:, None, :].to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _token_cos_sin(cos, sin, positions, inv_freq):
    if inv_freq is not None:
        return rotary_cos_sin_ref(positions, inv_freq)
    if positions is not None:
        return cos[positions], sin[positions]
    return cos, sin


def rotary_embedding_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    inv_freq: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated copies of q [T, Hq, D] and k [T, Hk, D]; the angles as in `rotary_embedding_`."""
    cos, sin = _token_cos_sin(cos, sin, positions, inv_freq)
    return rotate_ref(q, cos, sin), rotate_ref(k, cos, sin)


if HAS_TRITON:

    @triton.jit
    def _rotate_heads(base_ptr, stride_head, num_heads, half, cos, sin, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
        heads = tl.arange(0, BLOCK_H)
        cols = tl.arange(0, BLOCK_HALF)
        mask = (heads[:, None] < num_heads) & (cols[None, :] < half)
        first = base_ptr + heads[:, None] * stride_head + cols[None, :]
        x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(first + half, mask=mask, other=0.0).to(tl.float32)
        dtype = base_ptr.dtype.element_ty
        tl.store(first, (x1 * cos[None, :] - x2 * sin[None, :]).to(dtype), mask=mask)
        tl.store(first + half, (x2 * cos[None, :] + x1 * sin[None, :]).to(dtype), mask=mask)

    @triton.jit
    def _rotary_kernel(
        q_ptr, k_ptr, cos_ptr, sin_ptr, positions_ptr, inv_freq_ptr,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_cos, stride_sin,
        num_q_heads, num_k_heads, half,
        HAS_POSITIONS: tl.constexpr, FROM_INV_FREQ: tl.constexpr,
        BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr,
    ):
        # One program rotates every q and k head of one token.
        token = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_HALF)
        col_mask = cols < half
        row = token
        if HAS_POSITIONS:
            row = tl.load(positions_ptr + token).to(tl.int64)
        if FROM_INV_FREQ:
            angle = row.to(tl.float32) * tl.load(inv_freq_ptr + cols, mask=col_mask, other=0.0)
            cos = tl.cos(angle)
            sin = tl.sin(angle)
        else:
            cos = tl.load(cos_ptr + row * stride_cos + cols, mask=col_mask, other=0.0).to(tl.float32)
            sin = tl.load(sin_ptr + row * stride_sin + cols, mask=col_mask, other=0.0).to(tl.float32)
        _rotate_heads(q_ptr + token * stride_qt, stride_qh, num_q_heads, half, cos, sin, BLOCK_QH, BLOCK_HALF)
        _rotate_heads(k_ptr + token * stride_kt, stride_kh, num_k_heads, half, cos, sin, BLOCK_KH, BLOCK_HALF)


def rotary_embedding_(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    inv_freq: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hk, D] in place and return them.

    The angles come from one of:
      cos, sin [T, D/2] float32, row t for token t;
      cos, sin [P, D/2] and positions [T], row positions[t] for token t;
      positions [T] and inv_freq [D/2] float32, angle positions[t] * inv_freq.
    q and k may be strided views (heads and tokens at any stride), e.g. slices of a fused qkv output.
    """
    require_triton()
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    num_tokens, num_q_heads, head_dim = q.shape
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    half = head_dim // 2
    check_tensor("k", k, shape=[num_tokens, None, head_dim], dtypes=[q.dtype])
    tensors = {"q": q, "k": k}
    if positions is not None:
        check_tensor("positions", positions, shape=[num_tokens], dtypes=INDEX_DTYPES)
        tensors["positions"] = positions
    if inv_freq is not None:
        if positions is None or cos is not None or sin is not None:
            raise ValueError("inv_freq needs positions and excludes cos/sin")
        check_tensor("inv_freq", inv_freq, shape=[half], dtypes=[torch.float32])
        tensors["inv_freq"] = inv_freq
    else:
        if cos is None or sin is None:
            raise ValueError("give cos and sin tables, or positions and inv_freq")
        rows = None if positions is not None else num_tokens
        check_tensor("cos", cos, shape=[rows, half], dtypes=[torch.float32])
        check_tensor("sin", sin, shape=[rows, half], dtypes=[torch.float32])
        tensors |= {"cos": cos, "sin": sin}
    check_devices(**tensors)
    if num_tokens:
        dummy = q  # stands in for the pointers a mode does not read
        _rotary_kernel[(num_tokens,)](
            q, k, cos if cos is not None else dummy, sin if sin is not None else dummy,
            positions if positions is not None else dummy, inv_freq if inv_freq is not None else dummy,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            cos.stride(0) if cos is not None else 0, sin.stride(0) if sin is not None else 0,
            num_q_heads, k.shape[1], half,
            HAS_POSITIONS=positions is not None, FROM_INV_FREQ=inv_freq is not None,
            BLOCK_QH=next_power_of_2(num_q_heads), BLOCK_KH=next_power_of_2(k.shape[1]),
            BLOCK_HALF=next_power_of_2(half), num_warps=4,
        )
    return q, k
