"""The C++ CPU weight-only INT8 linear against the torch reference, eager and under torch.compile."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_int8_linear as kernel
from kernels.int8_matmul import int8_matmul_ref, quantize_int8_ref

pytestmark = pytest.mark.skipif(kernel.load() is None, reason="the CPU int8 linear kernel could not be built here "
                                "(a C++ compiler and ninja are needed); the torch path is used instead")


def _case(m, n, k, seed=0):
    gen = torch.Generator().manual_seed(seed * 7919 + m * 1000 + n * 10 + k)
    weight = torch.randn(n, k, generator=gen)
    x = torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    q, scale = quantize_int8_ref(weight)
    return x, q, scale, bias


def _close(out, ref, tol=1e-4):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert not out.isnan().any()
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= tol * max(1.0, ref.float().abs().max().item()), err


@pytest.mark.parametrize("m", [1, 3, 8, 17, 33])
@pytest.mark.parametrize("n,k", [(37, 100), (960, 576), (16, 1), (130, 33)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_linear_matches_reference(m, n, k, with_bias):
    x, q, scale, bias = _case(m, n, k)
    ref = int8_matmul_ref(x, q, scale)
    if with_bias:
        ref = ref + bias
    out = kernel.int8_linear(x, kernel.pack(q), scale, bias if with_bias else None, n)
    _close(out, ref)


def test_quantize_and_pack_roundtrip():
    weight = torch.randn(37, 20)
    q, scale = quantize_int8_ref(weight)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (37,)
    assert ((q.float() * scale[:, None] - weight).abs() <= scale[:, None] / 2 + 1e-6).all()
    packed = kernel.pack(q)
    assert packed.shape == (3, 20, 16) and packed.dtype == torch.int8
    assert torch.equal(kernel.unpack(packed, 37), q)
    assert not packed[2, :, 5:].any()  # padding channels are zero


@pytest.mark.parametrize("m", [1, 9])
def test_bfloat16_input_gives_bfloat16_close_to_reference(m):
    x, q, scale, bias = _case(m, 960, 576, seed=1)
    xb = x.bfloat16()
    out = kernel.int8_linear(xb, kernel.pack(q), scale, bias, 960)
    assert out.dtype == torch.bfloat16
    ref = (int8_matmul_ref(xb.float(), q, scale) + bias).bfloat16()  # float32 math, rounded once
    _close(out, ref, tol=1e-2)


def test_leading_dims_are_kept():
    x, q, scale, bias = _case(6, 37, 100, seed=2)
    x3 = x.view(2, 3, 100)
    out = kernel.int8_linear(x3, kernel.pack(q), scale, bias, 37)
    assert out.shape == (2, 3, 37)
    _close(out.view(6, 37), int8_matmul_ref(x, q, scale) + bias)


def test_non_contiguous_input():
    x, q, scale, _ = _case(5, 40, 64, seed=3)
    xt = torch.randn(64, 5).t()  # [5, 64], not contiguous
    out = kernel.int8_linear(xt, kernel.pack(q), scale, None, 40)
    _close(out, int8_matmul_ref(xt.contiguous(), q, scale))


def test_large_values_and_zero_rows_are_finite():
    weight = torch.randn(48, 64) * 1e3
    weight[5] = 0  # an all-zero output channel: scale is clamped, output is exactly zero
    q, scale = quantize_int8_ref(weight)
    x = torch.randn(4, 64) * 1e3
    out = kernel.int8_linear(x, kernel.pack(q), scale, None, 48)
    assert out.isfinite().all()
    assert (out[:, 5] == 0).all()
    _close(out, int8_matmul_ref(x, q, scale))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fallback_matches_the_kernel(dtype):
    x, q, scale, bias = _case(17, 130, 96, seed=4)
    x = x.to(dtype).view(17, 1, 96)
    packed = kernel.pack(q)
    fast = kernel.int8_linear(x, packed, scale, bias, 130)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    _close(kernel.int8_linear_ref(x, packed, scale, bias, 130), fast, tol)  # the Python fallback
    assert kernel.available()
    with torch.inference_mode():  # straight from the dispatcher to the C++ kernel
        _close(kernel.int8_linear(x, packed, scale, bias, 130), fast, tol)


def test_runs_under_inference_mode():
    x, q, scale, bias = _case(5, 37, 100, seed=7)
    with torch.inference_mode():
        out = kernel.int8_linear(x, kernel.pack(q), scale, bias, 37)
    _close(out, int8_matmul_ref(x, q, scale) + bias)


def test_torch_compile_fullgraph():
    x, q, scale, bias = _case(3, 37, 100, seed=5)
    packed = kernel.pack(q)

    def f(x, packed, scale, bias):
        return torch.relu(kernel.int8_linear(x * 2.0, packed, scale, bias, 37)) + 1.0

    eager = f(x, packed, scale, bias)
    compiled = torch.compile(f, fullgraph=True, )(x, packed, scale, bias)
    torch.testing.assert_close(compiled, eager)


def test_custom_op_passes_opcheck():
    x, q, scale, bias = _case(4, 37, 100, seed=6)
    torch.library.opcheck(torch.ops.ladder.int8_linear.default, (x, kernel.pack(q), scale, bias, 37))


def test_rejects_mismatched_shapes():
    x, q, scale, _ = _case(2, 37, 100)
    with pytest.raises(RuntimeError, match="packed K"):
        kernel.int8_linear(torch.randn(2, 99), kernel.pack(q), scale, None, 37)
    with pytest.raises(RuntimeError, match="does not match"):
        kernel.int8_linear(x, kernel.pack(q), scale, None, 60)
    with pytest.raises(ValueError, match="int8"):
        kernel.pack(q.float())
