"""A GGUF linear weight's quantized blocks as the W4A8 kernel reads them: per 32 inputs of a row, unsigned
codes u and float16 scales, w = d * u + m (or d * (u - zero)); 6-bit codes with an int8 sub-scale c per 16
inputs besides: w = d * c * (u - zero) (+ m).

How each GGML type gets there (`block_weight`):

- exact, the file's own codes and scales: Q4_0, Q4_1 (4-bit codes), Q5_0, Q5_1 (5-bit), Q6_K (6-bit, its
  16-input sub-blocks' int8 scales kept as they are beside the super-block's d), Q3_K (as 6-bit codes: its
  3-bit q in -4..3 as u = q + 32, its 16-input sub-blocks' 6-bit scales less 32 as the int8 sub-scales, the
  super-block's d), Q8_0 (8-bit); MXFP4 (GPT-OSS's
  experts) exactly too, as table codes: its 4-bit indices into `MXFP4_TABLE` (its 16 values, integers times
  half a power of two, plus 12), d that half power of two, which float16 holds exactly (else requantized as
  below), and zero 12; IQ4_NL exactly too, as table codes into its 16 values plus 128 (`IQ4_TABLE`, zero 128)
  with its own float16 d;
- K-quants with 32-input sub-blocks (Q4_K, Q5_K): the codes as stored (4- and 5-bit); each sub-block's scale and min, a
  6-bit integer times the super-block's float16 d or dmin, rounded once to float16 (IQ4_XS likewise: IQ4_NL's
  table codes, each 32-block's scale d (ls - 32) rounded once to float16). That rounding moves a
  weight by at most 2^-11 of its sub-block's largest |scale * code| and |min| (`tests/model/test_gguf_blocks.py`
  bounds it), far below the 4-bit step;
- every other quantized type (Q2_K, the other IQ types): requantized from
  the weights the `gguf` package dequantizes, 8 bits per 32-block the way Q8_0 is made (d = max |w| / 127 in
  float16, u = round(w / d) + 128), at most half a step of 1/127 of the block's largest weight from the file's;
- a float linear (F32, F16, BF16) in a quantized file (an output or embedding kept in 16 bits): requantized
  the same way.

A file whose linears are all float holds no blocks (`is_block_type`): `--quantization w8a8` serves it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from model.errors import ModelLoadError

BLOCK_SIZE = 32  # inputs per block: the kernel's activation quantization block too
EXACT_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q6_K", "Q3_K", "MXFP4")
# MXFP4's 16 values (E2M1) doubled, indexed by a 4-bit code: integers, so a block is those times 2^(e - 128); as
# table codes (kernels/cpu_w4a8_linear.py TABLE_CODES) each value plus MXFP4_ZERO, so the table holds 0 .. 24.
MXFP4_CODES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
MXFP4_ZERO = 12
MXFP4_TABLE = torch.tensor([v + MXFP4_ZERO for v in MXFP4_CODES], dtype=torch.uint8)
TABLE_CODES = 7  # kernels/cpu_w4a8_linear.py's: 4-bit indices into a table of codes
# IQ4_NL's 16 values (IQ4_XS's too), as table codes: each plus 128, w = d (u - 128).
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
IQ4_ZERO = 128
IQ4_TABLE = torch.tensor([v + IQ4_ZERO for v in IQ4_VALUES], dtype=torch.uint8)
TABLE_TYPES = ("IQ4_NL", "IQ4_XS")  # read as table codes into IQ4_TABLE
SUB_BLOCK_TYPES = ("Q4_K", "Q5_K")
FLOAT_TYPES = ("F32", "F16", "BF16")  # read, in a quantized file, by requantizing
REQUANTIZE_CHUNK = 1 << 24  # weights dequantized to float32 at a time by `requantized` (64 MB)


SIX_BIT_ZERO = 32  # 6-bit codes' zero (Q6_K's): w = d * c * (u - 32)


@dataclass(frozen=True)
class BlockWeight:
    """A linear weight [N, K] in blocks of 32 inputs: w[n, k] = d[n, k / 32] * codes[n, k] + m[n, k / 32]
    (m given), or d * (codes - zero) (m None). 6-bit codes carry sub, an int8 scale per 16 inputs: w = d *
    sub[n, k / 16] * (codes - zero), + m where m is given (zero is 32 either way). Table codes (bits
    TABLE_CODES) are 4-bit indices into `table`: the codes above are table[codes]."""

    codes: torch.Tensor  # [N, K] uint8, 0 .. 2^bits - 1 (bits 4, 5, 6 or 8; table codes: 0 .. 15)
    d: torch.Tensor  # [N, K / 32] float16
    m: torch.Tensor | None  # [N, K / 32] float16
    bits: int
    zero: int
    sub: torch.Tensor | None = None  # [N, K / 16] int8: 6-bit codes only
    table: torch.Tensor | None = None  # [16] uint8: table codes only

    @property
    def values(self) -> torch.Tensor:
        """[N, K] uint8: the codes the weight is made of (a table code's entry)."""
        return self.codes if self.table is None else self.table[self.codes.long()]

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32: for the exact types, what the `gguf` package dequantizes (the float model's weight)."""
        if self.table is not None:
            return self.widened(8).dequantize()
        d = self.d.float().repeat_interleave(BLOCK_SIZE, dim=1)
        if self.sub is not None:  # (d * c) * q, the `gguf` package's order
            w = (d * self.sub.float().repeat_interleave(BLOCK_SIZE // 2, dim=1)) * (self.codes.float() - self.zero)
            return w if self.m is None else w + self.m.float().repeat_interleave(BLOCK_SIZE, dim=1)
        if self.m is None:
            return (self.codes.float() - self.zero) * d
        return d * self.codes.float() + self.m.float().repeat_interleave(BLOCK_SIZE, dim=1)

    def rows(self, index: torch.Tensor | slice) -> BlockWeight:
        """The weight of these output rows, in this order."""
        def take(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[index]

        return BlockWeight(self.codes[index], self.d[index], take(self.m), self.bits, self.zero, take(self.sub),
                           self.table)

    def widened(self, bits: int) -> BlockWeight:
        """The same weight with codes of `bits` >= its own, for fusing narrower parts beside wider ones: exact
        from 4 or 5 bits (a 4-bit code is a 5- or 8-bit one below 16; as a 6-bit one it moves to zero 32 under
        sub-scales of 1); from 6 bits to 8 requantized (`requantize_8bit`), as the other K-quants are."""
        if bits == self.bits:
            return self
        if self.table is not None:  # the table's codes, as bytes
            if bits != 8:
                raise ValueError(f"table codes widen to 8 bits, not {bits}")
            return BlockWeight(self.values, self.d, self.m, 8, self.zero)
        if bits < self.bits:
            raise ValueError(f"{self.bits}-bit codes cannot narrow to {bits} bits")
        if self.bits == 6:
            return requantize_8bit(self.dequantize())
        if bits == 6:  # u - zero = (u + 32 - zero) - 32, and 15 + 32 < 64
            codes = self.codes + (SIX_BIT_ZERO - self.zero)
            ones = torch.ones(self.codes.shape[0], self.codes.shape[1] // 16, dtype=torch.int8)
            return BlockWeight(codes, self.d, self.m, 6, SIX_BIT_ZERO, ones)
        return BlockWeight(self.codes, self.d, self.m, bits, self.zero)


def is_block_type(type_name: str) -> bool:
    """Whether a tensor of this GGML type can be read as blocks (every quantized type the `gguf` package
    knows; not the float types)."""
    import gguf  # only where GGUF files are read

    kind = gguf.GGMLQuantizationType.__members__.get(type_name)
    return kind in gguf.GGML_QUANT_SIZES and gguf.GGML_QUANT_SIZES[kind][0] > 1  # float types: 1 a block


def code_bits(type_name: str) -> int:
    """The codes' width once read: 4 for Q4_0, Q4_1, Q4_K and the table codes (MXFP4, IQ4_NL, IQ4_XS), 5 for
    Q5_0, Q5_1 and Q5_K, 6 for Q6_K and Q3_K, 8 for every other type."""
    if type_name in ("Q4_0", "Q4_1", "Q4_K", "MXFP4", *TABLE_TYPES):
        return 4
    if type_name in ("Q6_K", "Q3_K"):
        return 6
    return 5 if type_name in ("Q5_0", "Q5_1", "Q5_K") else 8


def w4a8_bytes(type_names: list[str], rows: list[int], k: int) -> int:
    """Bytes a decode step reads of one W4A8 layer fused from parts of these types (rows [N] of K inputs
    each): codes (6-bit: and an int8 sub-scale per 16; table codes: and a 16-byte table per 16 rows and 32
    inputs), then float16 scales per 32 inputs, d alone or d and m (a part with a min, or parts of different
    types, which `model/block_quantization.concat` gives an explicit m)."""
    bits = max(code_bits(t) for t in type_names)
    tables = {t if t == "MXFP4" else "IQ4" for t in type_names if t in ("MXFP4", *TABLE_TYPES)}
    table_parts = sum(t in ("MXFP4", *TABLE_TYPES) for t in type_names)
    if tables and (len(tables) > 1 or table_parts < len(type_names)):
        bits = 8  # table codes beside other codes: all as bytes (concat)
    same = set(type_names) <= set(TABLE_TYPES) or len(set(type_names)) == 1
    two = not same or any(t in ("Q4_1", "Q5_1", "Q4_K", "Q5_K") for t in type_names)
    n = sum(rows)
    sub = n * k // 16 if bits == 6 else 0
    table = n * k // BLOCK_SIZE if bits == 4 and tables else 0
    return n * k * bits // 8 + sub + table + n * (k // BLOCK_SIZE) * 2 * (2 if two else 1)


def how_read(type_name: str) -> str:
    """"exact", "scales rounded to float16" or "requantized to 8 bits": what `block_weight` does to this type."""
    if type_name in EXACT_TYPES or type_name == "IQ4_NL":
        return "exact"
    if type_name in SUB_BLOCK_TYPES or type_name == "IQ4_XS":
        return "scales rounded to float16"
    return "requantized to 8 bits"


def block_weight(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> BlockWeight:
    """One tensor's raw bytes ([N, bytes per row] uint8, as GGUFReader maps them) -> its BlockWeight."""
    n, k = shape
    if k % BLOCK_SIZE:
        raise ModelLoadError(f"a {type_name} weight of {k} input channels: not a multiple of {BLOCK_SIZE}")
    raw = np.ascontiguousarray(raw).reshape(n, -1)  # float types: [N, K] of their own dtype (BF16: bytes)
    if type_name == "Q6_K":
        return _six_bit(raw, n, k)
    if type_name == "Q3_K":
        return _three_bit(raw, n, k)
    if type_name == "MXFP4":
        return _mxfp4(raw, n, k)
    if type_name in TABLE_TYPES:
        return _iq4(raw, type_name, n, k)
    if type_name in EXACT_TYPES:
        return _legacy(raw, type_name, n, k)
    if type_name in SUB_BLOCK_TYPES:
        return _sub_blocks(raw, type_name, n, k)
    return requantized(raw, type_name, n, k)


def _f16(b: np.ndarray) -> torch.Tensor:
    """[..., 2] uint8 -> [...] float16."""
    return torch.from_numpy(np.ascontiguousarray(b).view(np.float16)[..., 0].copy())


def _legacy(raw: np.ndarray, type_name: str, n: int, k: int) -> BlockWeight:
    """Q4_0, Q4_1, Q8_0, Q5_0, Q5_1: one float16 d (and m) per 32-block, then the codes."""
    blocks = raw.reshape(n, k // BLOCK_SIZE, -1)
    d = _f16(blocks[..., 0:2])
    if type_name == "Q8_0":  # int8 q: u = q + 128, w = d (u - 128)
        codes = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return BlockWeight(torch.from_numpy(codes.reshape(n, k)), d, None, 8, 128)
    has_m = type_name in ("Q4_1", "Q5_1")
    m = _f16(blocks[..., 2:4]) if has_m else None
    rest = blocks[..., 4:] if has_m else blocks[..., 2:]
    fifth = None
    if type_name.startswith("Q5"):  # 32 high bits (little-endian), bit j for input j, then 16 bytes of nibbles
        fifth, rest = np.unpackbits(rest[..., :4], axis=-1, bitorder="little") << 4, rest[..., 4:]  # [n, kb, 32]
    codes = np.concatenate([rest & 0x0F, rest >> 4], axis=-1)  # inputs 0..15 low nibbles, 16..31 high
    if fifth is not None:
        codes = codes | fifth
    zero = {"Q4_0": 8, "Q5_0": 16}.get(type_name, 0)
    return BlockWeight(torch.from_numpy(codes.reshape(n, k).astype(np.uint8)), d, m, code_bits(type_name), zero)


def _mxfp4(raw: np.ndarray, n: int, k: int) -> BlockWeight:
    """MXFP4 (17 bytes per 32 inputs: an E8M0 exponent e, then 16 bytes whose low nibbles are inputs 0..15 and
    high ones 16..31): w = MXFP4_CODES[q] 2^(e - 128), as table codes q into MXFP4_TABLE (zero MXFP4_ZERO) and
    d = 2^(e - 128) in float16. A block whose scale float16 cannot hold (e outside 104..143) sends the tensor to
    `requantized`."""
    blocks = raw.reshape(n, k // BLOCK_SIZE, 17)
    exponent = blocks[..., 0].astype(np.int32) - 128
    if exponent.min() < -24 or exponent.max() > 15:
        return requantized(raw, "MXFP4", n, k)
    qs = blocks[..., 1:]
    nibbles = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [n, kb, 32]
    d = torch.from_numpy(np.ldexp(np.float32(1), exponent).astype(np.float16))
    return BlockWeight(torch.from_numpy(nibbles.reshape(n, k)), d, None, TABLE_CODES, MXFP4_ZERO, table=MXFP4_TABLE)


def _iq4(raw: np.ndarray, type_name: str, n: int, k: int) -> BlockWeight:
    """IQ4_NL (18 bytes per 32 inputs: float16 d, then 16 bytes whose low nibbles are inputs 0..15 and high ones
    16..31) and IQ4_XS (136 bytes per 256: float16 d, the 8 sub-blocks' 6-bit scales ls as 2 high bits each in a
    uint16 and 4 low bits each in 4 bytes, then 8 x 16 bytes of nibbles as IQ4_NL's): w = d IQ4_VALUES[q] (IQ4_XS:
    d (ls - 32) in sub-block j, rounded once to float16), as table codes q into IQ4_TABLE."""
    if type_name == "IQ4_NL":
        blocks = raw.reshape(n, k // BLOCK_SIZE, 18)
        d, qs = _f16(blocks[..., 0:2]), blocks[..., 2:]
    else:
        if k % 256:
            raise ModelLoadError(f"an IQ4_XS weight of {k} input channels: not a multiple of 256")
        blocks = raw.reshape(n, k // 256, 136)
        super_d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)  # [n, kb, 1]
        high = blocks[..., 2:4].copy().view(np.uint16).astype(np.int32) >> (2 * np.arange(8))  # [n, kb, 8]
        low = blocks[..., 4:8, None] >> np.array([0, 4], dtype=np.uint8)  # [n, kb, 4, 2]: sub-block 2i + h
        ls = (low.reshape(n, -1, 8) & 0x0F).astype(np.int32) | ((high & 3) << 4)
        with np.errstate(over="ignore"):
            scale = (super_d * (ls - 32)).astype(np.float16)  # [n, kb, 8]
        if not np.isfinite(scale).all():
            raise ModelLoadError("an IQ4_XS weight's sub-block scales exceed float16's range (use --quantization "
                                 "w8a8)")
        d, qs = torch.from_numpy(scale.reshape(n, -1)), blocks[..., 8:].reshape(n, -1, 16)
    nibbles = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [n, k / 32, 32]
    return BlockWeight(torch.from_numpy(nibbles.reshape(n, k)), d, None, TABLE_CODES, IQ4_ZERO, table=IQ4_TABLE)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes [..., 12] -> the 8 sub-blocks' 6-bit scales and mins, each [..., 8]: sub-blocks
    0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); 4-7 in the nibbles of bytes 8-11, their top
    two bits in the top bits of bytes 0-3 and 4-7."""
    low_sc, low_mn, tail = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([low_sc & 63, (tail & 0x0F) | ((low_sc >> 6) << 4)], axis=-1)
    mn = np.concatenate([low_mn & 63, (tail >> 4) | ((low_mn >> 6) << 4)], axis=-1)
    return sc, mn


def _sub_blocks(raw: np.ndarray, type_name: str, n: int, k: int) -> BlockWeight:
    """Q4_K (144 bytes) and Q5_K (176 bytes) per 256 inputs: d, dmin (float16), 12 bytes of 6-bit scales and
    mins, (Q5_K: 32 bytes of high bits), 128 bytes of nibbles; w = d sc_j u - dmin mn_j in sub-block j."""
    if k % 256:
        raise ModelLoadError(f"a {type_name} weight of {k} input channels: not a multiple of 256")
    blocks = raw.reshape(n, k // 256, -1)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)  # [n, kb, 1]
    dmin = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = _k_scales(blocks[..., 4:16])
    # Four chunks of 64 inputs, 32 bytes each: the low nibbles are sub-block 2c, the high ones 2c + 1.
    qs = blocks[..., -128:].reshape(n, k // 256, 4, 1, 32)
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=3)  # [n, kb, 4, 2, 32]
    if type_name == "Q5_K":  # byte l of qh: bit j is input l's fifth bit in sub-block j
        qh = blocks[..., 16:48]
        shifts = np.arange(8, dtype=np.uint8).reshape(4, 2, 1)
        codes = codes | (((qh[:, :, None, None, :] >> shifts) & 1) << 4)
    with np.errstate(over="ignore"):
        scale = (d * sc).astype(np.float16)  # [n, kb, 8]: d sc_j, rounded once
        minimum = (-(dmin * mn)).astype(np.float16)
    if not (np.isfinite(scale).all() and np.isfinite(minimum).all()):
        raise ModelLoadError(f"a {type_name} weight's sub-block scales exceed float16's range "
                             "(use --quantization w8a8)")
    return BlockWeight(torch.from_numpy(codes.reshape(n, k).astype(np.uint8)),
                       torch.from_numpy(scale.reshape(n, -1)), torch.from_numpy(minimum.reshape(n, -1)),
                       code_bits(type_name), 0)


def _six_bit(raw: np.ndarray, n: int, k: int) -> BlockWeight:
    """Q6_K (210 bytes per 256 inputs): 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales (one
    per 16 inputs), float16 d; w = d sc_j (q - 32) with q = low | high << 4 in 0..63."""
    if k % 256:
        raise ModelLoadError(f"a Q6_K weight of {k} input channels: not a multiple of 256")
    kb = k // 256
    blocks = raw.reshape(n, kb, 210)
    # Each half of 128 inputs is four runs of 32: the low nibbles of its ql bytes 0-31, then of 32-63, then
    # their high nibbles; the runs' top two bits are bit pairs 0, 1, 2, 3 of its 32 qh bytes.
    ql = blocks[..., :128].reshape(n, kb, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)
    qh = blocks[..., 128:192].reshape(n, kb, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
    codes = ((ql & 0x0F).reshape(n, kb, 2, 4, 32) | ((qh & 0x03) << 4)).reshape(n, k)
    sub = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).reshape(n, kb * 16)
    d = _f16(blocks[..., 208:210]).repeat_interleave(256 // BLOCK_SIZE, dim=1)  # [n, k / 32]: a super-block's
    return BlockWeight(torch.from_numpy(np.ascontiguousarray(codes)), d, None, 6, SIX_BIT_ZERO,
                       torch.from_numpy(sub.copy()))


def _three_bit(raw: np.ndarray, n: int, k: int) -> BlockWeight:
    """Q3_K (110 bytes per 256 inputs: 32 bytes of high bits, 64 of 2-bit pairs, 12 of 6-bit scales, float16 d):
    w = d (sc_j - 32) q in 16-input sub-block j, q = low - 4 (1 - high) in -4..3; read as Q6_K's form, 6-bit codes
    u = q + 32 under int8 sub-scales sc_j - 32 (the `gguf` package's order, (d c) q, exactly)."""
    if k % 256:
        raise ModelLoadError(f"a Q3_K weight of {k} input channels: not a multiple of 256")
    kb = k // 256
    blocks = raw.reshape(n, kb, 110)
    # Input e of a super-block: its 2-bit pair at bits 2 ((e % 128) / 32) of qs byte 32 (e / 128) + e % 32, its
    # high bit at bit e / 32 of hmask byte e % 32.
    low = (blocks[..., 32:96].reshape(n, kb, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)) & 3
    high = (blocks[..., 0:32].reshape(n, kb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1
    codes = low.reshape(n, kb, 256) + 28 + 4 * high.reshape(n, kb, 256)  # q + 32
    packed = blocks[..., 96:108]  # sub-blocks 0-7 in the nibbles of bytes 0-7, 8-15 in their high nibbles
    scales = np.concatenate([packed[..., 0:8] & 0x0F, packed[..., 0:8] >> 4], axis=-1)
    top = packed[..., 8:12, None] >> np.array([0, 2, 4, 6], dtype=np.uint8)  # [n, kb, 4, 4]: byte 8 + i, shift s
    scales = scales | ((top.transpose(0, 1, 3, 2).reshape(n, kb, 16) & 3) << 4)  # sub-block 4 s + i
    sub = (scales.astype(np.int16) - 32).astype(np.int8).reshape(n, kb * 16)
    d = _f16(blocks[..., 108:110]).repeat_interleave(256 // BLOCK_SIZE, dim=1)
    return BlockWeight(torch.from_numpy(codes.reshape(n, k).astype(np.uint8)), d, None, 6, SIX_BIT_ZERO,
                       torch.from_numpy(np.ascontiguousarray(sub)))


def requantized(raw: np.ndarray, type_name: str, n: int, k: int) -> BlockWeight:
    """A quantized (or float) type's weights as the `gguf` package dequantizes them, quantized per 32-block to
    8 bits (`requantize_8bit`): how `block_weight` reads every type it cannot read exactly."""
    import gguf

    if not (is_block_type(type_name) or type_name in FLOAT_TYPES):
        raise ModelLoadError(f"{type_name} is not a GGUF type the w4a8 layers can read (use --quantization w8a8)")
    # In chunks of rows: a float32 copy of a whole expert stack would be several times the file's bytes.
    step = max(1, REQUANTIZE_CHUNK // k)
    parts = []
    for start in range(0, n, step):
        try:
            w = gguf.quants.dequantize(raw[start:start + step], gguf.GGMLQuantizationType[type_name])
        except NotImplementedError:
            raise ModelLoadError(f"the gguf package cannot dequantize {type_name} (use another file)") from None
        parts.append(requantize_8bit(torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32).reshape(-1, k))))
    if len(parts) == 1:
        return parts[0]
    return BlockWeight(torch.cat([p.codes for p in parts]), torch.cat([p.d for p in parts]), None, 8, 128)


def requantize_8bit(w: torch.Tensor) -> BlockWeight:
    """float32 [N, K] -> 8-bit codes per 32-block: d = max |w| / 127 in float16, u = round(w / d) + 128."""
    n, k = w.shape
    blocks = w.reshape(n, k // BLOCK_SIZE, BLOCK_SIZE)
    d = (blocks.abs().amax(-1) / 127).to(torch.float16)
    divisor = torch.where(d == 0, torch.ones_like(d), d).float().unsqueeze(-1)
    q = torch.round(blocks / divisor).clamp_(-128, 127)
    codes = (q + 128).to(torch.uint8).reshape(n, k)
    return BlockWeight(codes, d, None, 8, 128)
