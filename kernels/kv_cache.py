"""Writing the new tokens' keys and values into the paged KV cache (layout: kernels/kv_layout.py)."""

from __future__ import annotations

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


def write_kv_cache_ref(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store k, v [T, kv_heads, head_dim] at slots slot_mapping [T] of kv_cache, in place."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


if HAS_TRITON:

    @triton.jit
    def _write_kv_kernel(
        k_ptr, v_ptr, cache_ptr, slots_ptr,
        stride_kt, stride_kh, stride_vt, stride_vh,
        stride_c_kv, stride_c_block, stride_c_slot, stride_c_head,
        block_size, num_kv_heads, head_dim,
        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        # One program copies every head of one token's key and value.
        token = tl.program_id(0).to(tl.int64)
        slot = tl.load(slots_ptr + token).to(tl.int64)
        heads = tl.arange(0, BLOCK_H)
        cols = tl.arange(0, BLOCK_D)
        mask = (heads[:, None] < num_kv_heads) & (cols[None, :] < head_dim)
        dst = (cache_ptr + (slot // block_size) * stride_c_block + (slot % block_size) * stride_c_slot
               + heads[:, None] * stride_c_head + cols[None, :])
        dtype = cache_ptr.dtype.element_ty
        key = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + cols[None, :], mask=mask)
        tl.store(dst, key.to(dtype), mask=mask)
        value = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + cols[None, :], mask=mask)
        tl.store(dst + stride_c_kv, value.to(dtype), mask=mask)


def check_kv_cache(kv_cache: torch.Tensor) -> None:
    check_tensor("kv_cache", kv_cache, ndim=5, dtypes=FLOAT_DTYPES)
    if kv_cache.shape[0] != 2:
        raise ValueError(f"kv_cache must be [2, num_blocks, block_size, kv_heads, head_dim], got {list(kv_cache.shape)}")


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Triton write_kv_cache_ref. k, v may be strided views; every slot must lie inside the cache."""
    require_triton()
    check_kv_cache(kv_cache)
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    check_tensor("k", k, shape=[None, num_kv_heads, head_dim], dtypes=FLOAT_DTYPES)
    num_tokens = k.shape[0]
    check_tensor("v", v, shape=[num_tokens, num_kv_heads, head_dim], dtypes=FLOAT_DTYPES)
    check_tensor("slot_mapping", slot_mapping, shape=[num_tokens], dtypes=INDEX_DTYPES)
    check_devices(k=k, v=v, kv_cache=kv_cache, slot_mapping=slot_mapping)
    if num_tokens:
        _write_kv_kernel[(num_tokens,)](
            k, v, kv_cache, slot_mapping,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            *kv_cache.stride()[:4],
            block_size, num_kv_heads, head_dim,
            BLOCK_H=next_power_of_2(num_kv_heads), BLOCK_D=next_power_of_2(head_dim), num_warps=4,
        )
