"""W4A8 linear for the CPU over a GGUF's own quantized blocks: 4-bit (Q4_0, Q4_1), 5-bit (Q5_0, Q5_1), 6-bit
(Q6_K) or 8-bit (Q8_0) weight codes times int8 activations quantized per 32-block on the fly.

The weight of output n over input block b (32 input channels) is w = d[n, b] * u + m[n, b], with u an
unsigned code (0..15, 0..31 or 0..255) and d, m float16, which is exactly how the file stores it: Q4_1
and Q5_1 keep d and m; Q4_0 is m = -8 d, Q5_0 m = -16 d; Q8_0 (signed q) is u = q + 128, m = -128 d.
The weights carry no error beyond the file's own. Each 32-block of an input row is quantized
symmetrically, as llama.cpp's Q8_1 does: s = max(max|x_block|, 1e-12) / 127, a = round(x / s) (half to
even). Then

    y[n] = sum over b, in order, of   (float(dot[n, b]) * s[b]) * d[n, b]  +  m[n, b] * (s[b] * sum(a_b))

with dot = sum_k u * a exact in int32, each product and sum rounded to float32 as written, left to right:
`(y + t) + r`. Where m is implied (m = -zero * d), the offset is taken out of the integer sum instead,
exactly: y[n] = sum over b of (float(sum_k (u - zero) * a) * s[b]) * d[n, b], one product fewer. 6-bit
codes (Q6_K) carry an int8 sub-scale c per 16 inputs besides d: w = d * c * (u - zero) (+ m), and the
integer sum weighs its two halves, dot = c_lo * sum_{k<16} (u - zero) a + c_hi * sum_{k>=16} (u - zero) a,
exact in int32 and below 2^24 (so exact as a float too: 2 * 16 * 32 * 127 * 128), which is how llama.cpp
sums a Q6_K row. The
torch reference (`w4a8_matmul_ref`) does the same operations in the same order, so the C++ kernel equals
it bit for bit for every shape, batch and thread count, and a row's result never
depends on the rows beside it.

The product runs on AVX-512 VNNI: `vpdpbusd` multiplies 64 unsigned bytes (the codes) by 64 signed
bytes (four activations broadcast to 16 lanes) into 16 int32 sums, so unsigned codes need no offset.
Codes are packed once (`pack`) per 16 output channels and 32-block: 8-bit as [8 groups, 16, 4] bytes,
4-bit as [4, 16, 4] bytes whose low nibbles hold groups 0-3 and high nibbles groups 4-7 (a 64-byte
load and two masks feed two instructions), 5-bit as the 4-bit bytes of the low four bits followed by one
64-bit mask a group, bit t the fifth bit of the group's byte t (one masked byte add of 16 per 64 codes on
AVX-512; a shuffle and compare on AVX2), 6-bit as the 4-bit bytes (four lines of 64), then two 64-byte
vectors of bit pairs, byte t of vector p holding bits 4-5 of the codes of byte t in lines 2p and 2p + 1
(line 2p's low and high nibble's at bits 0-1 and 2-3, line 2p + 1's at 4-5 and 6-7: a shift and a mask a
line on either ISA), then the 32 sub-scales, [16 channels, 2 halves] int8. Table codes (`TABLE_CODES`: MXFP4's,
GPT-OSS's experts) are 4-bit indices packed as 4-bit codes, then the block's 16-byte table of the codes they
stand for (each at most 31, so AVX2's int16 sums hold as for 5-bit codes): one byte shuffle a line looks them
up. A 4-bit weight moves 5/8 of the
bytes of an int8 one (Q4_1: 20 bytes per 32 weights), a 5-bit one 3/4 (24), a 6-bit one 7/8 (28), which is
what bounds a batch-1 decode step. d and m stay float16,
[16] each per block, converted in registers. Threads split the blocks of output channels. Where AVX-512
VNNI is missing, AVX2 tiles over the same layout compute the same exact integer sums (`vpmaddubsw`,
`vpmaddwd`), and a portable loop is compiled where AVX2 is missing too (and can be asked for, for tests).
`w4a8_linear` is the custom op ladder::w4a8_linear (kernels/csrc/w4a8_linear.cpp, kernels/cpu_extension.py):
the C++ kernel on CPU tensors where the extension builds, the torch reference anywhere else or with
LADDER_CPU_KERNELS=0.
"""

from __future__ import annotations

import torch

from kernels.cpu_extension import cpu_op, load

BLOCK_N = 16  # output channels per packed block
BLOCK_K = 32  # input channels per quantization block (the GGUF's and the activations')
GROUP_K = 4  # input channels summed by one vpdpbusd lane
# Bytes of packed codes per 16 outputs and 32-block, by code width: 4-bit nibbles; the same nibbles and a
# 64-byte plane of fifth bits; the nibbles, 128 bytes of bit pairs and 32 int8 sub-scales; or one byte a code.
# Table codes: 4-bit indices into a 16-byte table of codes (0 .. 255) kept after each block's nibbles.
TABLE_CODES = 7
CODE_BYTES = {4: 256, 5: 320, 6: 416, 8: 512, TABLE_CODES: 272}
SUB_SCALE_BYTES = 32  # 6-bit: [16 channels, 2 halves of 16 inputs] int8, at the end of each block's codes


def has_vnni() -> bool:
    """Whether the build has the AVX-512 VNNI tiles (else the AVX2 tiles where the CPU has AVX2, the
    portable loop elsewhere)."""
    module = load()
    return module is not None and module.has_vnni()


def has_int8_tiles() -> bool:
    """Whether the build has vector int8 tiles, AVX-512 VNNI or AVX2 (else the portable loop runs)."""
    module = load()
    return module is not None and module.has_int8_tiles()


def quantize_blocks_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] float32 (K a multiple of 32) -> (a int8 [M, K], s [M, K / 32], s * sum(a) per block)."""
    m, k = x.shape
    xb = x.view(m, k // BLOCK_K, BLOCK_K)
    s = xb.abs().amax(dim=-1).clamp(min=1e-12) / 127  # [M, KB]
    a = torch.round(xb / s[..., None]).to(torch.int8)  # |x / s| <= 127 by construction
    return a.view(m, k), s, s * a.sum(dim=-1, dtype=torch.int32).float()


def w4a8_matmul_ref(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None = None,
                    zero: int = 0, sub: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: x [M, K] float32 quantized per 32-block, times weights w = d * codes + m (m given) or
    w = d * (codes - zero) (m None), codes uint8 [N, K] (0..15, 0..31 or 0..255), d and m float32 [N, K / 32]
    -> [M, N] float32. With sub (int8 [N, K / 16], 6-bit codes): w = d * sub * (codes - zero) (+ m)."""
    rows, k = x.shape
    a, s, c = quantize_blocks_ref(x)
    # The integer products run on int8 codes: codes - zero fits, and so does codes - 128 (added back as
    # 128 * sum(a)) for codes that carry their own m.
    shift = 128 if m is not None and sub is None else zero
    signed = (codes.to(torch.int16) - shift).to(torch.int8)
    y = x.new_zeros(rows, codes.shape[0])
    for b in range(k // BLOCK_K):
        cols = slice(b * BLOCK_K, (b + 1) * BLOCK_K)
        if sub is None:
            dot = torch._int_mm(a[:, cols], signed[:, cols].t())  # [M, N] int32, exact
        else:  # each half of 16 inputs weighed by its sub-scale, in int32
            lo, hi = slice(b * BLOCK_K, b * BLOCK_K + 16), slice(b * BLOCK_K + 16, (b + 1) * BLOCK_K)
            dot = (torch._int_mm(a[:, lo], signed[:, lo].t()) * sub[:, 2 * b].int()
                   + torch._int_mm(a[:, hi], signed[:, hi].t()) * sub[:, 2 * b + 1].int())
        if m is None:
            y = y + (dot.float() * s[:, b:b + 1]) * d[:, b]
        else:
            if sub is None:
                dot = dot + 128 * a[:, cols].sum(dim=-1, keepdim=True, dtype=torch.int32)
            y = (y + (dot.float() * s[:, b:b + 1]) * d[:, b]) + m[:, b] * c[:, b:b + 1]
    return y


def pack(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, bits: int, sub: torch.Tensor | None = None,
         table: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """codes uint8 [N, K] (0 .. 2^bits - 1; bits 4, 5, 6 or 8), d and m float16 [N, K / 32] (m None: w = d *
    (u - zero), the kernel's `zero`), sub int8 [N, K / 16] (6-bit codes only: their sub-scales) -> (codes
    [ceil(N / 16), K / 32, CODE_BYTES[bits]] uint8, scales [ceil(N / 16), K / 32, 1 or 2, 16] float16),
    zero-padded to whole blocks of 16 outputs. bits TABLE_CODES: `codes` are 4-bit indices into `table` uint8
    [16], the weight's codes u = table[index]."""
    if (table is not None) != (bits == TABLE_CODES) or (table is not None and (
            table.dtype != torch.uint8 or tuple(table.shape) != (16,))):
        raise ValueError("table codes take a uint8 table [16], other widths none")
    if codes.dim() != 2 or codes.dtype != torch.uint8 or codes.shape[1] % BLOCK_K:
        raise ValueError(f"expected uint8 codes [N, K] with K a multiple of {BLOCK_K}, got {codes.dtype} "
                         f"{tuple(codes.shape)}")
    if bits not in CODE_BYTES:
        raise ValueError(f"bits must be 4, 5, 6 or 8 (or TABLE_CODES, {TABLE_CODES}), got {bits}")
    width = 4 if bits == TABLE_CODES else bits
    if width < 8 and codes.numel() and int(codes.max()) >= 1 << width:
        raise ValueError(f"{width}-bit codes must be in 0..{(1 << width) - 1}")
    n, k = codes.shape
    if (sub is not None) != (bits == 6) or (sub is not None and (sub.dtype != torch.int8 or
                                                                 tuple(sub.shape) != (n, k // 16))):
        raise ValueError(f"6-bit codes take int8 sub-scales [N, K / 16] = [{n}, {k // 16}], other widths none")
    blocks, kb = -(-n // BLOCK_N), k // BLOCK_K
    padded = codes.new_zeros(blocks * BLOCK_N, k)
    padded[:n] = codes
    # [blocks, 16, kb, 8 groups, 4] -> [blocks, kb, 8, 16, 4]
    grouped = padded.view(blocks, BLOCK_N, kb, 8, GROUP_K).permute(0, 2, 3, 1, 4)
    if bits == 8:
        packed = grouped.contiguous().view(blocks, kb, -1)
    else:
        low = grouped & 0x0F
        planes = [(low[:, :, :4] | (low[:, :, 4:] << 4)).contiguous().view(blocks, kb, -1)]  # inputs 16.. high
        if bits == 5:  # group g's fifth bits, bit t for byte t of its 64 (channel t / 4, input t % 4)
            weights = (1 << torch.arange(8, dtype=torch.int32)).to(torch.uint8)
            plane = (grouped >> 4).contiguous().view(blocks, kb, 8, 8, 8)  # [.., group, byte, bit]
            planes.append((plane * weights).sum(-1, dtype=torch.int32).to(torch.uint8).view(blocks, kb, 64))
        if bits == 6:  # line 2p + r's half h (group 4h + 2p + r) at bits 2 (2r + h) of vector p
            pairs = (grouped >> 4).reshape(blocks, kb, 2, 2, 2, 64).to(torch.int32)  # [.., h, p, r, byte]
            vectors = sum(pairs[:, :, h, :, r] << (2 * (2 * r + h)) for h in range(2) for r in range(2))
            planes.append(vectors.to(torch.uint8).view(blocks, kb, 128))
        if sub is not None:  # [N, kb, 2] -> [blocks, kb, 16 channels, 2 halves]
            padded_sub = sub.new_zeros(blocks * BLOCK_N, kb, 2)
            padded_sub[:n] = sub.view(n, kb, 2)
            planes.append(padded_sub.view(blocks, BLOCK_N, kb, 2).permute(0, 2, 1, 3).contiguous()
                          .view(torch.uint8).view(blocks, kb, SUB_SCALE_BYTES))
        if table is not None:  # the same 16 codes after every block's indices
            planes.append(table.view(1, 1, 16).expand(blocks, kb, 16))
        packed = torch.cat(planes, dim=-1)
    parts = [d] if m is None else [d, m]
    scales = torch.zeros(blocks * BLOCK_N, kb, len(parts), dtype=torch.float16)
    for i, part in enumerate(parts):
        scales[:n, :, i] = part.to(torch.float16)
    scales = scales.view(blocks, BLOCK_N, kb, len(parts)).permute(0, 2, 3, 1).contiguous()
    return packed, scales


def code_width(packed: torch.Tensor) -> int:
    """The bits of a packed weight's codes, from its bytes per block (`CODE_BYTES`)."""
    width = {v: k for k, v in CODE_BYTES.items()}.get(packed.shape[-1])
    if width is None:
        raise ValueError(f"packed codes of {packed.shape[-1]} bytes a block: expected one of "
                         f"{sorted(CODE_BYTES.values())}")
    return width


def unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of `pack`'s codes: uint8 [N, K] (table codes: the codes their indices stand for)."""
    blocks, kb = packed.shape[:2]
    bits = code_width(packed)
    if bits == 8:
        grouped = packed.view(blocks, kb, 8, BLOCK_N, GROUP_K)
    else:
        nibbles = packed[..., :256].reshape(blocks, kb, 4, BLOCK_N, GROUP_K)
        grouped = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=2)
        if bits == TABLE_CODES:  # each index through its block's table
            tables = packed[..., 256:272].long()  # [blocks, kb, 16]
            index = grouped.long().reshape(blocks, kb, -1)
            grouped = torch.gather(tables, 2, index).to(torch.uint8).reshape(grouped.shape)
        if bits == 5:
            masks = packed[..., 256:320].reshape(blocks, kb, 8, 8, 1)
            plane = (masks >> torch.arange(8, dtype=torch.uint8)) & 1  # [.., group, byte, bit]
            grouped = grouped | (plane.reshape(grouped.shape) << 4)
        if bits == 6:
            vectors = packed[..., 256:384].reshape(blocks, kb, 1, 2, 1, 64)  # [.., h, p, r, byte]
            shifts = torch.tensor([[0, 4], [2, 6]], dtype=torch.uint8).view(2, 1, 2, 1)  # 2 (2r + h) by [h, r]
            pairs = (vectors >> shifts) & 3  # [.., h, p, r, byte]: group 4h + 2p + r
            grouped = grouped | (pairs.reshape(grouped.shape) << 4)
    return grouped.permute(0, 3, 1, 2, 4).reshape(blocks * BLOCK_N, kb * BLOCK_K)[:n]


def sub_scales_of(packed: torch.Tensor, n: int) -> torch.Tensor | None:
    """`pack`'s sub-scales of 6-bit codes, int8 [N, K / 16]; None for other widths."""
    if code_width(packed) != 6:
        return None
    blocks, kb = packed.shape[:2]
    sub = packed[..., -SUB_SCALE_BYTES:].contiguous().view(torch.int8).view(blocks, kb, BLOCK_N, 2)
    return sub.permute(0, 2, 1, 3).reshape(blocks * BLOCK_N, kb * 2)[:n]


def scales_of(scales: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`pack`'s scales as float32: d [N, KB] and m [N, KB] (None where the format implies it)."""
    per_row = scales.permute(0, 3, 1, 2).reshape(-1, scales.shape[1], scales.shape[2])[:n].float()
    return per_row[:, :, 0], (per_row[:, :, 1] if scales.shape[2] == 2 else None)


def w4a8_linear_ref(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, n: int,
                    zero: int, portable: bool) -> torch.Tensor:
    """`w4a8_linear` by the torch reference, from the packed weight (`portable` is the kernel's alone)."""
    k = x.shape[-1]
    d, m = scales_of(scales, n)
    y = w4a8_matmul_ref(x.reshape(-1, k).float(), unpack(codes, n), d, m, zero, sub_scales_of(codes, n))
    return (y if bias is None else y + bias.float()).view(*x.shape[:-1], n)


_w4a8_linear = cpu_op("w4a8_linear", w4a8_linear_ref, lambda x, codes, scales, bias, n, zero, portable:
                      x.new_empty(x.shape[:-1] + (n,), dtype=torch.float32))


def w4a8_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, n: int,
                zero: int = 0, portable: bool = False) -> torch.Tensor:
    """y [..., N] float32 = x [..., K] times the packed weight (`pack`), + bias; equal bit for bit to
    `w4a8_matmul_ref` on the unpacked codes and scales. `zero`: w = d * (u - zero) when the scales hold d
    only (Q4_0: 8, Q8_0 stored as q + 128: 128), and for 6-bit codes whether or not they hold m (Q6_K: 32).
    `portable`: the C++ kernel's portable loop even where its VNNI tiles exist (tests)."""
    return _w4a8_linear(x, codes, scales, bias, n, zero, portable)
