"""The C++ CPU W4A8 linear over GGUF blocks: bit for bit its torch reference (activations quantized per
32-block, integer block sums, the float epilogue in a fixed order), for Q4_1, Q4_0, Q5_1, Q5_0, Q6_K (6-bit
codes with int8 sub-scales per 16 inputs, with and without m), Q8_0, MXFP4 and IQ4_NL (table codes: 4-bit
indices into a block's table; IQ4's codes up to 241) forms, any batch and thread count, on the vector tiles and the portable loop; and the GGUF
reader's blocks are exactly the weights the float model is built from."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_w4a8_linear as kernel
from model.gguf_blocks import IQ4_TABLE, IQ4_ZERO, MXFP4_TABLE, MXFP4_ZERO, TABLE_CODES, BlockWeight

pytestmark = pytest.mark.skipif(kernel.load() is None, reason="the CPU W4A8 kernel could not be built here "
                                "(a C++ compiler and ninja are needed); the torch reference is used instead")

FORMATS = {"q4_1": (4, 0, True), "q4_0": (4, 8, False), "q5_1": (5, 0, True), "q5_0": (5, 16, False),
           "q6_k": (6, 32, False), "q6_k_m": (6, 32, True), "q8_0": (8, 128, False),
           "mxfp4": (TABLE_CODES, MXFP4_ZERO, False), "iq4_nl": (TABLE_CODES, IQ4_ZERO, False)}  # bits, zero, has m
TABLES = {"mxfp4": MXFP4_TABLE, "iq4_nl": IQ4_TABLE}
# q6_k_m: a fused layer's 6-bit form beside parts with a min (model/block_quantization.concat).


def _case(m, n, k, form, seed=0):
    bits, zero, has_m = FORMATS[form]
    table = TABLES.get(form)
    gen = torch.Generator().manual_seed(seed * 7919 + m * 1000 + n * 10 + k + bits)
    codes = torch.randint(0, 16 if table is not None else 1 << bits, (n, k), dtype=torch.uint8, generator=gen)
    d = (torch.rand(n, k // 32, generator=gen) * 0.02).half()
    mins = (torch.randn(n, k // 32, generator=gen) * 0.05).half() if has_m else None
    sub = torch.randint(-128, 128, (n, k // 16), dtype=torch.int8, generator=gen) if bits == 6 else None
    if sub is not None:  # the int8 range's ends, where the integer sums are largest
        sub[0, ::2], sub[-1, 1::2] = -128, 127
        d = d / 64
    x = torch.randn(m, k, generator=gen)
    x[:, 3] *= 50  # an outlier channel, as RMSNorm outputs have
    x[:, 32:64] = 0  # an all-zero block
    return x, BlockWeight(codes, d, mins, bits, zero, sub, table), torch.randn(n, generator=gen)


def _pack(w: BlockWeight):
    return kernel.pack(w.codes, w.d, w.m, w.bits, w.sub, w.table)


def _reference(x, w: BlockWeight, bias=None):
    y = kernel.w4a8_matmul_ref(x, w.values, w.d.float(), None if w.m is None else w.m.float(), w.zero, w.sub)
    return y if bias is None else y + bias


@pytest.mark.parametrize("form", FORMATS)
@pytest.mark.parametrize("m", [1, 9, 33])
@pytest.mark.parametrize("n,k", [(37, 96), (208, 576), (16, 32)])
def test_equals_the_reference_bit_for_bit(form, m, n, k):
    x, w, bias = _case(m, n, k, form)
    codes, scales = _pack(w)
    assert torch.equal(kernel.unpack(codes, n), w.values)
    assert (kernel.sub_scales_of(codes, n) is None) == (w.sub is None)
    assert w.sub is None or torch.equal(kernel.sub_scales_of(codes, n), w.sub)
    for with_bias in (False, True):
        ref = _reference(x, w, bias if with_bias else None)
        for portable in (False, True):
            out = kernel.w4a8_linear(x, codes, scales, bias if with_bias else None, n, w.zero, portable=portable)
            assert out.dtype == torch.float32 and torch.equal(out, ref), (with_bias, portable)
    # The reference computes the dequantized weights' product, up to the activations' rounding (an
    # outlier coarsens only its own block: measured without one).
    plain = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    exact = plain @ w.dequantize().t()
    assert ((_reference(plain, w) - exact).norm() / exact.norm()).item() < 0.02


@pytest.mark.parametrize("form", FORMATS)
@pytest.mark.parametrize("m", [2, 3, 6, 7])
@pytest.mark.parametrize("n", [8, 45])
def test_vector_tiles_equal_the_portable_loop_at_their_edges(form, m, n):
    """Rows past a multiple of the tiles' (4 on AVX2), a last block of 16 channels cut inside or past its
    first 8, codes at both ends of their range (the 8-bit AVX2 tiles multiply |u - 128|, up to 128) and a
    block whose quantization rounds halves (scale 1, a = round(x) half to even): the vector tiles (AVX-512
    VNNI or AVX2) equal the portable loop and the reference, bit for bit."""
    x, w, bias = _case(m, n, 96, form)
    w.codes[0] = 0
    w.codes[1] = 15 if w.table is not None else (1 << w.bits) - 1
    x[0, 64:] = torch.arange(32) % 9 - 3.5  # halves: -3.5 .. 4.5
    x[0, 64] = 127.0  # max |x| of the block 127: its scale is 1
    codes, scales = _pack(w)
    ref = _reference(x, w, bias)
    for portable in (False, True):
        assert torch.equal(kernel.w4a8_linear(x, codes, scales, bias, n, w.zero, portable=portable), ref), portable


@pytest.mark.parametrize("form", FORMATS)
@pytest.mark.parametrize("m", [12, 40, 130])
def test_many_rows_on_widened_codes_equal_the_reference(form, m):
    """With many rows the tiles read codes widened to bytes (VNNI: 5- and 6-bit codes from 32 rows, 4-bit
    from 128; AVX2: 5- and 6-bit codes from 8 and 16), below 128 rows a chunk of blocks at a time (35
    blocks here: VNNI's chunks of 16 and 22 blocks end inside them): the sums run on across chunks, the
    bias is added once, a last block of 16 channels is cut, and a row's output is the one it has in a
    batch of 5."""
    n, k = 45, 35 * 32
    x, w, bias = _case(m, n, k, form)
    codes, scales = _pack(w)
    out = kernel.w4a8_linear(x, codes, scales, bias, n, w.zero)
    assert torch.equal(out, _reference(x, w, bias))
    assert torch.equal(kernel.w4a8_linear(x[:5], codes, scales, bias, n, w.zero), out[:5])


def test_rows_do_not_depend_on_the_batch_or_threads():
    """Batch invariance: a row's output is the same alone, in any batch, on one thread or two."""
    x, w, bias = _case(40, 300, 576, "q4_1")
    codes, scales = kernel.pack(w.codes, w.d, w.m, w.bits, w.sub)
    together = kernel.w4a8_linear(x, codes, scales, bias, 300)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([kernel.w4a8_linear(x[i:i + 1], codes, scales, bias, 300) for i in range(40)])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together, alone)


def test_leading_dimensions_zero_rows_bad_shapes_and_the_fallback():
    x, w, _ = _case(6, 48, 64, "q8_0")
    codes, scales = kernel.pack(w.codes, w.d, w.m, w.bits, w.sub)
    out = kernel.w4a8_linear(x.view(2, 3, 64), codes, scales, None, 48, 128)
    assert out.shape == (2, 3, 48) and torch.equal(out.view(6, 48), _reference(x, w))
    assert kernel.w4a8_linear(x[:0], codes, scales, None, 48, 128).shape == (0, 48)
    with pytest.raises(RuntimeError, match="input channels"):
        kernel.w4a8_linear(torch.randn(2, 96), codes, scales, None, 48, 128)
    with pytest.raises(ValueError, match="multiple of 32"):
        kernel.pack(w.codes[:, :40], w.d, None, 8)
    with pytest.raises(ValueError, match="0..15"):
        kernel.pack(w.codes, w.d, None, 4)
    with pytest.raises(ValueError, match="0..31"):
        kernel.pack(w.codes, w.d, None, 5)
    with pytest.raises(ValueError, match="4, 5, 6 or 8"):
        kernel.pack(w.codes, w.d, None, 3)
    with pytest.raises(ValueError, match="uint8 table"):  # table codes without their table
        kernel.pack(w.codes % 16, w.d, None, TABLE_CODES)
    with pytest.raises(ValueError, match="uint8 table"):  # a table of another type
        kernel.pack(w.codes % 16, w.d, None, TABLE_CODES, table=torch.full((16,), 1, dtype=torch.int16))
    with pytest.raises(ValueError, match="0..63"):
        kernel.pack(w.codes, w.d, None, 6, torch.zeros(48, 4, dtype=torch.int8))
    six = w.codes % 64
    with pytest.raises(ValueError, match="sub-scales"):
        kernel.pack(six, w.d, None, 6)  # 6-bit codes without their sub-scales
    with pytest.raises(ValueError, match="sub-scales"):
        kernel.pack(six, w.d, None, 6, torch.zeros(48, 3, dtype=torch.int8))
    with pytest.raises(ValueError, match="sub-scales"):
        kernel.pack(w.codes % 16, w.d, None, 4, torch.zeros(48, 4, dtype=torch.int8))
    # The op's torch reference, from the packed form.
    assert torch.equal(kernel.w4a8_linear_ref(x, codes, scales, None, 48, 128, False), out.view(6, 48))
