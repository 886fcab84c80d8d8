"""A GGUF linear weight's blocks as W4A8 reads them (model/gguf_blocks.py), against the `gguf` package's own
dequantization: exact for the legacy types, Q6_K, Q3_K and IQ4_NL, within float16's rounding of the sub-block
scales for Q4_K, Q5_K and IQ4_XS, within half an 8-bit step for the requantized types."""

from __future__ import annotations

import pytest
import torch

from model.errors import ModelLoadError
from model.gguf_blocks import BLOCK_SIZE, BlockWeight, block_weight, is_block_type, requantize_8bit, w4a8_bytes

gguf = pytest.importorskip("gguf")
np = pytest.importorskip("numpy")

N, K = 32, 512  # rows a multiple of the kernel's 16, so the packed layers hold no padding


def _raw_blocks(name: str, rng) -> np.ndarray:
    """Random blocks of a type the gguf package cannot quantize: random bytes (every code, scale and min
    pattern), with finite float16 super-block scales of either sign for the sub-block types."""
    kind = gguf.GGMLQuantizationType[name]
    per_block, size = gguf.GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, size=(N, K // per_block, size), dtype=np.uint8)
    half = {"Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "Q2_K": [80, 82], "Q3_K": [108], "IQ4_NL": [0],
            "IQ4_XS": [0]}[name]
    for offset in half:
        scale = rng.uniform(-0.02, 0.02, size=raw.shape[:2]).astype(np.float16)
        raw[..., offset:offset + 2] = scale.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(N, -1)


def _reference(raw, name: str) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name]).reshape(N, K))


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1"])
def test_legacy_blocks_are_the_float_weights(name):
    """Each legacy type read as codes, d, m gives back exactly what the gguf package dequantizes."""
    values = np.random.default_rng(0).standard_normal((N, K)).astype(np.float32)
    raw = gguf.quants.quantize(values, gguf.GGMLQuantizationType[name])
    weight = block_weight(raw, name, (N, K))
    assert weight.bits == {"Q4": 4, "Q5": 5, "Q8": 8}[name[:2]]
    assert int(weight.codes.max()) < 1 << weight.bits
    assert torch.equal(weight.dequantize(), _reference(raw, name))


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K"])
def test_sub_block_scales_round_once_to_float16(name):
    """The codes are the file's; each weight moves at most by float16's half ulp of its sub-block's scale
    times its code plus that of its min (2^-11 of each, relative)."""
    raw = _raw_blocks(name, np.random.default_rng(1))
    weight = block_weight(raw, name, (N, K))
    assert weight.bits == (4 if name == "Q4_K" else 5) and weight.m is not None
    assert int(weight.codes.max()) == (15 if name == "Q4_K" else 31)
    error = (weight.dequantize() - _reference(raw, name)).abs()
    d, m = (t.float().repeat_interleave(BLOCK_SIZE, dim=1) for t in (weight.d, weight.m))
    bound = 2.0**-11 * (d.abs() * weight.codes.float() + m.abs()) + 1e-7
    assert (error <= bound).all(), float((error / bound).max())
    assert error.max() > 0  # rounded, not exact: the bound is what is tested


def test_q6_k_blocks_are_the_float_weights():
    """Q6_K read as 6-bit codes, its int8 sub-scales per 16 inputs and its super-block d per 32-block gives
    back exactly what the gguf package dequantizes, for every code, scale and sign (random bytes)."""
    raw = _raw_blocks("Q6_K", np.random.default_rng(7))
    weight = block_weight(raw, "Q6_K", (N, K))
    assert (weight.bits, weight.zero, weight.m) == (6, 32, None)
    assert weight.sub.dtype == torch.int8 and tuple(weight.sub.shape) == (N, K // 16)
    assert int(weight.codes.max()) == 63 and int(weight.codes.min()) == 0
    assert int(weight.sub.min()) == -128 and int(weight.sub.max()) == 127
    assert torch.equal(weight.dequantize(), _reference(raw, "Q6_K"))
    with pytest.raises(ModelLoadError, match="not a multiple of 256"):
        block_weight(raw.reshape(-1)[:N * 105].reshape(N, 105), "Q6_K", (N, 128))


def test_iq4_blocks_are_table_codes():
    """IQ4_NL as table codes into its 16 values (plus 128): exactly what the gguf package dequantizes, for every
    index and sign (random bytes); IQ4_XS the same codes, each 32-block's scale d (ls - 32) rounded once to float16
    (2^-11 of it, relative)."""
    from model.gguf_blocks import IQ4_TABLE, IQ4_ZERO, TABLE_CODES, how_read

    raw = _raw_blocks("IQ4_NL", np.random.default_rng(11))
    weight = block_weight(raw, "IQ4_NL", (N, K))
    assert (weight.bits, weight.zero, weight.m, how_read("IQ4_NL")) == (TABLE_CODES, IQ4_ZERO, None, "exact")
    assert torch.equal(weight.table, IQ4_TABLE) and int(weight.codes.max()) == 15
    assert torch.equal(weight.dequantize(), _reference(raw, "IQ4_NL"))
    raw = _raw_blocks("IQ4_XS", np.random.default_rng(12))
    weight = block_weight(raw, "IQ4_XS", (N, K))
    assert (weight.bits, how_read("IQ4_XS")) == (TABLE_CODES, "scales rounded to float16")
    reference = _reference(raw, "IQ4_XS")
    error = (weight.dequantize() - reference).abs()
    assert (error <= 2.0**-11 * reference.abs() + 1e-9).all() and error.max() > 0


def test_q3_k_blocks_are_six_bit_codes():
    """Q3_K read in Q6_K's form (6-bit codes q + 32 for its q in -4..3, its 6-bit sub-block scales less 32 as int8
    sub-scales, the super-block's d) gives back exactly what the gguf package dequantizes, for every code, scale and
    sign (random bytes); and through the W4A8 kernel's 6-bit path it is the reference's product bit for bit."""
    from kernels import cpu_w4a8_linear as kernel
    from model.gguf_blocks import how_read

    raw = _raw_blocks("Q3_K", np.random.default_rng(8))
    weight = block_weight(raw, "Q3_K", (N, K))
    assert (weight.bits, weight.zero, weight.m, how_read("Q3_K")) == (6, 32, None, "exact")
    assert (int(weight.codes.min()), int(weight.codes.max())) == (28, 35)
    assert (int(weight.sub.min()), int(weight.sub.max())) == (-32, 31)
    assert torch.equal(weight.dequantize(), _reference(raw, "Q3_K"))
    x = torch.randn(5, K)
    codes, scales = kernel.pack(weight.codes, weight.d, None, 6, weight.sub)
    ref = kernel.w4a8_matmul_ref(x, weight.codes, weight.d.float(), None, weight.zero, weight.sub)
    assert torch.equal(kernel.w4a8_linear(x, codes, scales, None, N, weight.zero), ref)
    with pytest.raises(ModelLoadError, match="not a multiple of 256"):
        block_weight(raw.reshape(-1)[:N * 55].reshape(N, 55), "Q3_K", (N, 128))


@pytest.mark.parametrize("name", ["Q2_K"])
def test_other_types_are_requantized_to_8_bits(name):
    raw = _raw_blocks(name, np.random.default_rng(2))
    weight = block_weight(raw, name, (N, K))
    reference = _reference(raw, name)
    assert (weight.bits, weight.zero, weight.m) == (8, 128, None)
    d = weight.d.float().repeat_interleave(BLOCK_SIZE, dim=1)
    amax = reference.view(N, -1, BLOCK_SIZE).abs().amax(-1).repeat_interleave(BLOCK_SIZE, dim=1)
    assert torch.allclose(d, amax / 127, rtol=2.0**-10)  # Q8_0's rule, d rounded to float16
    assert ((weight.dequantize() - reference).abs() <= d * 0.5 * (1 + 2.0**-9) + 1e-7).all()


def test_requantizing_in_chunks_of_rows_changes_nothing(monkeypatch):
    from model import gguf_blocks

    raw = _raw_blocks("Q2_K", np.random.default_rng(5))
    whole = block_weight(raw, "Q2_K", (N, K))
    monkeypatch.setattr(gguf_blocks, "REQUANTIZE_CHUNK", 5 * K)  # rows 0-4, 5-9, ...: the last chunk short
    chunked = block_weight(raw, "Q2_K", (N, K))
    assert torch.equal(chunked.codes, whole.codes) and torch.equal(chunked.d, whole.d)


def test_requantizing_zeros_and_the_float_types():
    """All-zero blocks keep d = 0 (no division by zero); float types are no blocks, but are read by
    requantizing; an unreadable type and a row length that is no multiple of 32 are refused in one line."""
    weight = requantize_8bit(torch.zeros(2, 64))
    assert torch.equal(weight.dequantize(), torch.zeros(2, 64)) and (weight.d == 0).all()
    assert not any(is_block_type(t) for t in ("F32", "F16", "BF16", "I8", "F64", "no such type"))
    assert all(is_block_type(t) for t in ("Q4_0", "Q8_0", "Q4_K", "Q6_K", "IQ4_NL"))
    with pytest.raises(ModelLoadError, match="not a GGUF type the w4a8 layers can read"):
        block_weight(np.zeros((2, 64), np.int8), "I8", (2, 64))
    # A float linear in a quantized file (an output kept in 16 bits) is requantized as Q2_K is.
    half = np.random.default_rng(6).standard_normal((2, 64)).astype(np.float16)
    weight = block_weight(half, "F16", (2, 64))
    assert torch.equal(weight.codes, requantize_8bit(torch.from_numpy(half).float()).codes)
    with pytest.raises(ModelLoadError, match="not a multiple of 32"):
        block_weight(np.zeros((2, 40), np.uint8), "Q8_0", (2, 40))


@pytest.mark.parametrize("name", ["Q4_1", "Q4_0", "Q5_0"])
def test_widened_codes_are_the_same_weights(name):
    """4- and 5-bit codes widen exactly (as 6-bit codes: zero 32, sub-scales of 1, m kept); 6-bit codes
    widen to 8 bits by requantizing, within half a step of Q8_0's rule."""
    values = np.random.default_rng(3).standard_normal((N, K)).astype(np.float32)
    narrow = block_weight(gguf.quants.quantize(values, gguf.GGMLQuantizationType[name]), name, (N, K))
    for bits in (5, 6, 8):
        wide = narrow.widened(bits)
        assert wide.bits == bits and torch.equal(wide.dequantize(), narrow.dequantize())
        assert wide.widened(bits) is wide
    assert narrow.widened(6).zero == 32 and (narrow.widened(6).sub == 1).all()
    with pytest.raises(ValueError, match="cannot narrow"):
        narrow.widened(8).widened(5)
    six = block_weight(_raw_blocks("Q6_K", np.random.default_rng(8)), "Q6_K", (N, K))
    eight = six.widened(8)
    assert (eight.bits, eight.zero, eight.sub) == (8, 128, None)
    step = eight.d.float().repeat_interleave(BLOCK_SIZE, dim=1)
    assert ((eight.dequantize() - six.dequantize()).abs() <= step * 0.5 * (1 + 2.0**-9) + 1e-7).all()


def test_w4a8_bytes_are_the_packed_layers():
    """The auto choice's byte count (`w4a8_bytes`) is what the fused W4A8 layer holds: a Q4_K q and k beside
    a Q6_K v widen to 6-bit codes with d, m and sub-scales, the same weights; a Q4_0 layer keeps 4-bit codes
    and d alone; a Q6_K layer beside a Q8_0 one widens to 8 bits."""
    from model.block_quantization import concat
    from model.w4a8_linear import W4A8Linear

    rng = np.random.default_rng(4)
    parts = [block_weight(_raw_blocks(name, rng), name, (N, K)) for name in ("Q4_K", "Q4_K", "Q6_K")]
    fused = W4A8Linear(concat(parts), None)
    assert fused.bits == 6 and fused.codes.shape[-1] == 416 and fused.scales.shape[2] == 2
    held = fused.codes.numel() + fused.scales.numel() * 2
    assert held == w4a8_bytes(["Q4_K", "Q4_K", "Q6_K"], [N, N, N], K)
    assert torch.equal(concat(parts).dequantize(), torch.cat([p.dequantize() for p in parts]))
    six = W4A8Linear(parts[2], None)
    assert six.codes.numel() + six.scales.numel() * 2 == w4a8_bytes(["Q6_K"], [N], K) == N * K * 7 // 8
    eight = concat([parts[2], block_weight(gguf.quants.quantize(rng.standard_normal((N, K)).astype(np.float32),
                                                                 gguf.GGMLQuantizationType.Q8_0), "Q8_0", (N, K))])
    assert eight.bits == 8 and eight.sub is None
    values = rng.standard_normal((N, K)).astype(np.float32)
    alone = W4A8Linear(block_weight(gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q4_0), "Q4_0", (N, K)),
                       None)
    assert alone.codes.numel() + alone.scales.numel() * 2 == w4a8_bytes(["Q4_0"], [N], K)
    assert isinstance(concat([parts[0]]), BlockWeight)
    # Q4_K gate beside a Q5_0 up: 5-bit codes (an explicit m for the Q5_0 part's zero), 3/4 of a W8A8 byte.
    gate = block_weight(_raw_blocks("Q4_K", rng), "Q4_K", (N, K))
    up = block_weight(gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q5_0), "Q5_0", (N, K))
    fused = W4A8Linear(concat([gate, up]), None)
    assert fused.bits == 5 and fused.codes.shape[-1] == 320 and fused.scales.shape[2] == 2
    assert fused.codes.numel() + fused.scales.numel() * 2 == w4a8_bytes(["Q4_K", "Q5_0"], [N, N], K)
    assert torch.equal(concat([gate, up]).dequantize(), torch.cat([gate.dequantize(), up.dequantize()]))
    # IQ4 table codes: 4-bit indices and a 16-byte table per 16 rows and 32 inputs; beside Q4_K codes, bytes.
    nl, xs = (block_weight(_raw_blocks(name, rng), name, (N, K)) for name in ("IQ4_NL", "IQ4_XS"))
    for names, layer in ((["IQ4_XS"], xs), (["IQ4_NL", "IQ4_XS"], concat([nl, xs])), (["IQ4_XS", "Q4_K"],
                                                                                          concat([xs, gate]))):
        fused = W4A8Linear(layer, None)
        assert fused.codes.numel() + fused.scales.numel() * 2 == w4a8_bytes(names, [N] * len(names), K), names
