"""The C++ RMSNorm, rotary and SiLU x up kernels against their torch references, and row by row the same in any
batch."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_fused_ops as fused
from kernels.rms_norm import fused_add_rms_norm_ref, rms_norm_ref
from kernels.rotary import rotate_ref
from kernels.swiglu import clamped_swiglu_ref, gelu_tanh_and_mul_ref, silu_and_mul_ref

pytestmark = pytest.mark.skipif(fused.load() is None, reason="the CPU fused kernels could not be built here "
                                "(a C++ compiler and ninja are needed); the torch references are used instead")


@pytest.mark.parametrize("rows,dim", [(1, 576), (7, 64), (33, 100), (0, 16)])
def test_norms_match_the_references(rows, dim):
    gen = torch.Generator().manual_seed(rows * 100 + dim)
    x, residual = torch.randn(rows, dim, generator=gen) * 3, torch.randn(rows, dim, generator=gen)
    weight = torch.randn(dim, generator=gen)
    torch.testing.assert_close(fused.rms_norm(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5), rtol=1e-5, atol=1e-5)
    normed, summed = fused.fused_add_rms_norm(x, residual, weight, 1e-6)
    ref_normed, ref_summed = fused_add_rms_norm_ref(x, residual, weight, 1e-6)
    assert torch.equal(summed, ref_summed)
    torch.testing.assert_close(normed, ref_normed, rtol=1e-5, atol=1e-5)
    if rows > 1:  # a row alone is the same row in a batch
        assert torch.equal(fused.rms_norm(x[1:2], weight, 1e-5), fused.rms_norm(x, weight, 1e-5)[1:2])


def test_rotary_rotates_strided_views_in_place():
    """q and k as the model has them: views into one [T, q + 2 kv] projection output."""
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(5, 9 * 64 + 2 * 3 * 64, generator=gen)
    q, k, v = qkv.split([576, 192, 192], dim=-1)
    q, k = q.view(5, 9, 64), k.view(5, 3, 64)
    angles = torch.randn(5, 32, generator=gen)
    cos, sin = angles.cos(), angles.sin()
    want_q, want_k, v_before = rotate_ref(q, cos, sin), rotate_ref(k, cos, sin), v.clone()
    got_q, got_k = fused.rotary(q, k, cos, sin)
    assert got_q.data_ptr() == q.data_ptr()  # in place
    torch.testing.assert_close(got_q, want_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_k, want_k, rtol=1e-6, atol=1e-6)
    assert torch.equal(v, v_before)


@pytest.mark.parametrize("rows,width", [(1, 1536), (4, 17), (3, 64)])
@pytest.mark.parametrize("ops", [(fused.silu_and_mul, silu_and_mul_ref), (fused.gelu_tanh_and_mul, gelu_tanh_and_mul_ref),
                                 (lambda g: fused.clamped_swiglu(g, 1.702, 7.0),
                                  lambda g: clamped_swiglu_ref(g, 1.702, 7.0))],
                         ids=["silu", "gelu_tanh", "clamped_swiglu"])
def test_gated_activations_match_the_references(rows, width, ops):
    """Their own exp: within a few float32 roundings of torch's silu and tanh-form gelu, over gates far
    into both tails (gelu's far negative tail is g / (1 + e^z) here, where torch's 0.5 g (1 + tanh) cancels
    to 0: within 1e-6 of the row's scale there); the tail of a row past a multiple of 16 lanes goes through
    the same arithmetic (a row alone equals itself in the batch)."""
    kernel, reference = ops
    gen = torch.Generator().manual_seed(width)
    gate_up = torch.randn(rows, 2 * width, generator=gen) * 12
    got, want = kernel(gate_up), reference(gate_up)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6 * float(want.abs().max()))
    assert torch.equal(kernel(gate_up[-1:]), got[-1:])
    edges = torch.tensor([[float("nan"), 100.0, -100.0, -1e30, 1e30, float("-inf"), 88.5, -88.5] + [1.0] * 8])
    torch.testing.assert_close(kernel(edges), reference(edges), equal_nan=True, rtol=2e-6, atol=1e-30)


def test_other_dtypes_use_the_references():
    x, weight = torch.randn(3, 32, dtype=torch.bfloat16), torch.randn(32, dtype=torch.bfloat16)
    assert torch.equal(fused.rms_norm(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5))
