"""What benchmarks/kernel_bench.py measures: each kernel at each size, with the bytes and FLOPs its work needs.

Bytes count what the operation must read and write at least once (inputs, outputs, the KV it attends
to); FLOPs count the multiply-adds as two. Both ignore how an implementation gets there, so the
fraction of the roof compares implementations on the same footing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kernels.decode_attention import paged_decode_attention, paged_decode_attention_ref
from kernels.int8_matmul import int8_matmul, int8_matmul_ref, quantize_int8_ref
from kernels.kv_cache import write_kv_cache, write_kv_cache_ref
from kernels.kv_layout import blocks_for_tokens, kv_cache_shape
from kernels.prefill_attention import paged_prefill_attention, paged_prefill_attention_ref
from kernels.rms_norm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref
from kernels.rotary import rope_frequencies, rotary_cos_sin_ref, rotary_embedding_, rotary_embedding_ref
from kernels.swiglu import silu_and_mul, silu_and_mul_ref


@dataclass(frozen=True)
class Case:
    kernel: str
    size: str
    dtype: torch.dtype
    bytes: int
    flops: int
    make_inputs: Callable[[torch.device], dict[str, Any]]  # same seed every call: equal inputs
    kernel_fn: Callable[..., Any]
    ref_fn: Callable[..., Any]


def _randn(g: torch.Generator, *shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.randn(*shape, generator=g, device=device).to(dtype)


def _generator(device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(0)


def norm_cases(tokens: int, hidden: int, dtype: torch.dtype) -> list[Case]:
    es = dtype.itemsize

    def inputs(device):
        g = _generator(device)
        return {"x": _randn(g, tokens, hidden, dtype=dtype, device=device),
                    "residual": _randn(g, tokens, hidden, dtype=dtype, device=device),
                    "weight": _randn(g, hidden, dtype=dtype, device=device), "eps": 1e-5}

    def plain(fn):
        return lambda x, residual, weight, eps: fn(x, weight, eps)

    size = f"T={tokens} D={hidden}"
    return [
        Case("rms_norm", size, dtype, (2 * tokens + 1) * hidden * es, 4 * tokens * hidden, inputs,
             plain(rms_norm), plain(rms_norm_ref)),
        Case("fused_add_rms_norm", size, dtype, (4 * tokens + 1) * hidden * es, 5 * tokens * hidden, inputs,
             fused_add_rms_norm, fused_add_rms_norm_ref),
    ]


def rotary_case(tokens: int, num_q: int, num_kv: int, head_dim: int, dtype: torch.dtype) -> Case:
    def inputs(device):
        g = _generator(device)
        inv_freq = rope_frequencies(head_dim, 500000.0).to(device)
        cos, sin = rotary_cos_sin_ref(torch.randint(0, 8192, (tokens,), generator=g, device=device), inv_freq)
        return {"q": _randn(g, tokens, num_q, head_dim, dtype=dtype, device=device),
                    "k": _randn(g, tokens, num_kv, head_dim, dtype=dtype, device=device), "cos": cos, "sin": sin}

    elements = tokens * (num_q + num_kv) * head_dim
    return Case("rotary", f"T={tokens} H={num_q}/{num_kv} d={head_dim}", dtype,
                2 * elements * dtype.itemsize + tokens * head_dim * 4, 3 * elements, inputs,
                lambda q, k, cos, sin: rotary_embedding_(q, k, cos=cos, sin=sin),
                lambda q, k, cos, sin: rotary_embedding_ref(q, k, cos=cos, sin=sin))


def swiglu_case(tokens: int, intermediate: int, dtype: torch.dtype) -> Case:
    def inputs(device):
        return {"gate_up": _randn(_generator(device), tokens, 2 * intermediate, dtype=dtype, device=device)}

    return Case("silu_and_mul", f"T={tokens} I={intermediate}", dtype, 3 * tokens * intermediate * dtype.itemsize,
                5 * tokens * intermediate, inputs, silu_and_mul, silu_and_mul_ref)


def _returning_cache(write):
    def run(k, v, kv_cache, slot_mapping):
        write(k, v, kv_cache, slot_mapping)
        return kv_cache
    return run


def kv_write_case(tokens: int, num_kv: int, head_dim: int, block_size: int, dtype: torch.dtype) -> Case:
    def inputs(device):
        g = _generator(device)
        num_blocks = 2 * tokens // block_size
        return {"k": _randn(g, tokens, num_kv, head_dim, dtype=dtype, device=device),
                    "v": _randn(g, tokens, num_kv, head_dim, dtype=dtype, device=device),
                    "kv_cache": torch.zeros(kv_cache_shape(num_blocks, block_size, num_kv, head_dim), dtype=dtype,
                                            device=device),
                    "slot_mapping": torch.randperm(num_blocks * block_size, generator=g, device=device)[:tokens]}

    elements = 2 * tokens * num_kv * head_dim
    return Case("write_kv_cache", f"T={tokens} kvh={num_kv} d={head_dim} bs={block_size}", dtype,
                2 * elements * dtype.itemsize + 8 * tokens, 0, inputs,
                _returning_cache(write_kv_cache), _returning_cache(write_kv_cache_ref))


def _paged_cache(g, num_seqs, seq_len, num_kv, head_dim, block_size, dtype, device):
    blocks_per_seq = blocks_for_tokens(seq_len, block_size)
    cache = _randn(g, 2, num_seqs * blocks_per_seq, block_size, num_kv, head_dim, dtype=dtype, device=device)
    tables = torch.randperm(num_seqs * blocks_per_seq, generator=g, device=device).view(num_seqs, blocks_per_seq)
    return cache, tables


def decode_case(num_seqs: int, context: int, heads: tuple[int, int, int], dtype: torch.dtype) -> Case:
    num_q, num_kv, head_dim = heads

    def inputs(device):
        g = _generator(device)
        cache, tables = _paged_cache(g, num_seqs, context, num_kv, head_dim, 16, dtype, device)
        return {"q": _randn(g, num_seqs, num_q, head_dim, dtype=dtype, device=device), "kv_cache": cache,
                    "seq_lens": torch.full((num_seqs,), context, device=device), "block_tables": tables,
                    "max_seq_len": context, "scale": head_dim**-0.5}

    kv_bytes = 2 * num_seqs * context * num_kv * head_dim * dtype.itemsize
    return Case("decode_attention", f"B={num_seqs} ctx={context} H={num_q}/{num_kv} d={head_dim}", dtype,
                kv_bytes + 2 * num_seqs * num_q * head_dim * dtype.itemsize, 4 * num_seqs * num_q * context * head_dim,
                inputs, paged_decode_attention, paged_decode_attention_ref)


def prefill_case(num_seqs: int, cached: int, new: int, heads: tuple[int, int, int], dtype: torch.dtype) -> Case:
    num_q, num_kv, head_dim = heads
    seq_len = cached + new

    def inputs(device):
        g = _generator(device)
        cache, tables = _paged_cache(g, num_seqs, seq_len, num_kv, head_dim, 16, dtype, device)
        return {"q": _randn(g, num_seqs * new, num_q, head_dim, dtype=dtype, device=device), "kv_cache": cache,
                    "query_start_loc": torch.arange(0, num_seqs + 1, device=device) * new,
                    "seq_lens": torch.full((num_seqs,), seq_len, device=device), "block_tables": tables,
                    "max_query_len": new, "max_seq_len": seq_len, "scale": head_dim**-0.5}

    def kernel(q, kv_cache, query_start_loc, seq_lens, block_tables, max_query_len, max_seq_len, scale):
        return paged_prefill_attention(q, kv_cache, query_start_loc, seq_lens, block_tables, max_query_len, scale)

    # Causal: new token i sees cached + i + 1 keys.
    keys_seen = num_seqs * (new * cached + new * (new + 1) // 2)
    io_bytes = (2 * num_seqs * new * num_q + 2 * num_seqs * seq_len * num_kv) * head_dim * dtype.itemsize
    return Case("prefill_attention", f"B={num_seqs} ctx={cached}+{new} H={num_q}/{num_kv} d={head_dim}", dtype,
                io_bytes, 4 * num_q * head_dim * keys_seen, inputs, kernel, paged_prefill_attention_ref)


def int8_case(m: int, n: int, k: int, dtype: torch.dtype) -> Case:
    def inputs(device):
        g = _generator(device)
        weight, scale = quantize_int8_ref(torch.randn(n, k, generator=g, device=device))
        return {"x": _randn(g, m, k, dtype=dtype, device=device), "weight": weight, "scale": scale.to(dtype)}

    return Case("int8_matmul", f"M={m} N={n} K={k}", dtype, n * k + (m * k + m * n + n) * dtype.itemsize,
                2 * m * n * k, inputs, int8_matmul, int8_matmul_ref)


def make_cases(quick: bool, dtype: torch.dtype) -> list[Case]:
    if quick:  # the default model's widths, few tokens
        return [
            *norm_cases(256, 576, dtype),
            rotary_case(128, 9, 3, 64, dtype),
            swiglu_case(128, 1536, dtype),
            kv_write_case(128, 3, 64, 16, dtype),
            decode_case(8, 256, (9, 3, 64), dtype),
            prefill_case(2, 64, 64, (9, 3, 64), dtype),
            int8_case(4, 576, 576, dtype),
            int8_case(128, 1536, 576, dtype),
        ]
    llama_8b = (32, 8, 128)
    return [
        *norm_cases(4096, 4096, dtype),
        rotary_case(4096, 32, 8, 128, dtype),
        swiglu_case(4096, 14336, dtype),
        kv_write_case(4096, 8, 128, 16, dtype),
        decode_case(64, 2048, llama_8b, dtype),
        decode_case(8, 16384, llama_8b, dtype),
        prefill_case(4, 1024, 1024, llama_8b, dtype),
        prefill_case(1, 0, 4096, llama_8b, dtype),
        int8_case(1, 4096, 4096, dtype),
        int8_case(16, 14336, 4096, dtype),
        int8_case(4096, 4096, 4096, dtype),
    ]
