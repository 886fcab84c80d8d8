"""The C++ CPU W8A8 linear: bit for bit the torch reference (`torch._int_mm` over per-row int8 activations),
for any shape, thread count and batch; and the W8A8 layer uses it."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_w8a8_linear as kernel
from kernels.int8_matmul import quantize_int8_ref
from model.quantization import W8A8Linear

pytestmark = pytest.mark.skipif(kernel.load() is None, reason="the CPU W8A8 kernel could not be built here "
                                "(a C++ compiler and ninja are needed); the torch reference is used instead")


def _case(m, n, k, seed=0):
    gen = torch.Generator().manual_seed(seed * 7919 + m * 1000 + n * 10 + k)
    weight = torch.randn(n, k, generator=gen)
    x = torch.randn(m, k, generator=gen)
    if k > 1:
        x[:, 1] *= 50  # an outlier channel, as RMSNorm outputs have
    q, scale = quantize_int8_ref(weight)
    return x, q, scale, torch.randn(n, generator=gen)


@pytest.mark.parametrize("m", [1, 3, 8, 9, 33])
@pytest.mark.parametrize("n,k", [(37, 101), (960, 576), (16, 1), (130, 36), (17, 3)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_equals_the_reference_bit_for_bit(m, n, k, with_bias):
    x, q, scale, bias = _case(m, n, k)
    packed, wsum = kernel.pack(q)
    assert torch.equal(kernel.unpack(packed, n, k), q)
    ref = kernel.w8a8_matmul_ref(x, q, scale)
    if with_bias:
        ref = ref + bias
    out = kernel.w8a8_linear(x, packed, wsum, scale, bias if with_bias else None, n)
    assert out.dtype == torch.float32 and torch.equal(out, ref)


@pytest.mark.parametrize("m", [1, 2, 5, 7])
@pytest.mark.parametrize("n,k", [(45, 33), (29, 576), (8, 4)])
def test_tile_edges_the_whole_int8_range_and_rounding_ties(m, n, k):
    """The vector tiles' edges (rows past a multiple of the tile's 4 or 8, a last block of 16 channels cut
    inside or past its first 8, K inside a group of 4), weights over all of int8 (-128 too: the AVX2 tiles
    multiply |w|, up to 128, by q with w's sign) and a row whose quantization rounds halves (scale 1, q =
    round(x) half to even): bit for bit the reference, the int32 sums too."""
    gen = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    q[0] = -128
    scale = torch.rand(n, generator=gen) + 0.5
    bias = torch.randn(n, generator=gen)
    x = torch.randn(m, k, generator=gen)
    x[0] = torch.arange(k) % 9 - 3.5  # halves: -3.5 .. 4.5
    x[0, 0] = -127.0  # max |x| 127: the row's scale is 1
    packed, wsum = kernel.pack(q)
    assert torch.equal(kernel.w8a8_linear(x, packed, wsum, scale, bias, n), kernel.w8a8_matmul_ref(x, q, scale) + bias)
    assert torch.equal(kernel.w8a8_int32(x, packed, wsum, n), kernel.w8a8_int32_ref(x, q))


@pytest.mark.parametrize("m", [1, 9, 33])
@pytest.mark.parametrize("n,k", [(37, 101), (960, 577), (16, 1)])
def test_integer_sums_are_exact_and_their_epilogue_is_the_linear(m, n, k):
    """`w8a8_int32`, what a tensor-parallel rank adds across ranks, is the exact integer product, and
    (sums * x_scale) * scale + bias gives `w8a8_linear`'s bits."""
    x, q, scale, bias = _case(m, n, k)
    packed, wsum = kernel.pack(q)
    sums = kernel.w8a8_int32(x, packed, wsum, n)
    qx, x_scale = kernel.quantize_rows_ref(x)
    assert sums.dtype == torch.int32 and torch.equal(sums, qx.long().matmul(q.long().t()).int())
    assert torch.equal(sums, kernel.w8a8_int32_ref(x, q))
    linear = kernel.w8a8_linear(x, packed, wsum, scale, bias, n)
    assert torch.equal((sums.float() * x_scale) * scale + bias, linear)
    assert torch.equal(kernel.w8a8_epilogue(sums, kernel.row_maximum(x), scale, bias), linear)


@pytest.mark.parametrize("m", [1, 33])
def test_column_parts_quantized_with_the_whole_rows_maximum_add_up_to_the_linear(m):
    """A row-parallel rank's part: its columns quantized with the whole row's maximum. The parts' int32
    sums add up to the whole product, and the epilogue of the total is `w8a8_linear`, bit for bit."""
    n, k, split = 96, 200, 72
    x, q, scale, bias = _case(m, n, k)
    maximum = kernel.row_maximum(x)
    parts = []
    for cols in (slice(0, split), slice(split, k)):
        packed, wsum = kernel.pack(q[:, cols].contiguous())
        part = kernel.w8a8_int32(x[:, cols].contiguous(), packed, wsum, n, maximum)
        assert torch.equal(part, kernel.w8a8_int32_ref(x[:, cols].contiguous(), q[:, cols], maximum))
        parts.append(part)
    packed, wsum = kernel.pack(q)
    assert torch.equal(parts[0] + parts[1], kernel.w8a8_int32(x, packed, wsum, n))
    assert torch.equal(kernel.w8a8_epilogue(parts[0] + parts[1], maximum, scale, bias),
                       kernel.w8a8_linear(x, packed, wsum, scale, bias, n))


def test_rows_do_not_depend_on_the_batch_or_threads():
    """Batch invariance: a row's output is the same alone, in any batch, on one thread or two."""
    x, q, scale, bias = _case(40, 300, 576)
    packed, wsum = kernel.pack(q)
    together = kernel.w8a8_linear(x, packed, wsum, scale, bias, 300)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([kernel.w8a8_linear(x[i:i + 1], packed, wsum, scale, bias, 300) for i in range(40)])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together, alone)


@pytest.mark.parametrize("m", [8, 15, 32, 47, 100])
@pytest.mark.parametrize("n,k", [(40, 64), (576, 576), (1536, 1536)])
def test_many_rows_on_the_tile_units_equal_each_row_alone(m, n, k):
    """From 8 rows with K a multiple of 64 an AMX CPU runs the tile units (tdpbusd, 32 or 16 rows by 2
    blocks of 16 channels a unit, the last row group padded, an odd last block alone): the same integer sums as
    vpdpbusd, the same epilogue, so every row equals itself computed alone, the raw sums too. The weights
    span all of int8 and a row rounds halves. Elsewhere it is the vector tiles, and the same holds."""
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    q[0] = -128
    x = torch.randn(m, k, generator=gen)
    x[0] = torch.arange(k) % 9 - 3.5
    x[0, 0] = -127.0
    scale, bias = torch.rand(n, generator=gen) + 0.5, torch.randn(n, generator=gen)
    packed, wsum = kernel.pack(q)
    together = kernel.w8a8_linear(x, packed, wsum, scale, bias, n)
    alone = torch.cat([kernel.w8a8_linear(x[i:i + 1], packed, wsum, scale, bias, n) for i in range(m)])
    assert torch.equal(together, alone) and torch.equal(together, kernel.w8a8_matmul_ref(x, q, scale) + bias)
    sums = kernel.w8a8_int32(x, packed, wsum, n)
    assert torch.equal(sums, kernel.w8a8_int32_ref(x, q))
    assert torch.equal(sums, torch.cat([kernel.w8a8_int32(x[i:i + 1], packed, wsum, n) for i in range(m)]))


def test_leading_dimensions_zero_rows_and_bad_shapes():
    x, q, scale, _ = _case(6, 48, 64)
    packed, wsum = kernel.pack(q)
    out = kernel.w8a8_linear(x.view(2, 3, 64), packed, wsum, scale, None, 48)
    assert out.shape == (2, 3, 48) and torch.equal(out.view(6, 48), kernel.w8a8_matmul_ref(x, q, scale))
    assert kernel.w8a8_linear(x[:0], packed, wsum, scale, None, 48).shape == (0, 48)
    with pytest.raises(RuntimeError, match="input channels"):
        kernel.w8a8_linear(torch.randn(2, 60), packed, wsum, scale, None, 48)
    with pytest.raises(ValueError, match="int8"):
        kernel.pack(q.float())


def test_the_layer_runs_the_kernel_and_matches_its_torch_path():
    torch.manual_seed(0)
    layer = W8A8Linear.from_linear(torch.nn.Linear(96, 40))
    assert layer.packed is not None
    x = torch.randn(5, 96)
    fast = layer(x)
    layer.packed = None  # the layer's torch path
    assert torch.equal(fast, layer(x))
