"""Many LoRA adapters on one linear layer, each row of a flat batch with its own (Punica's SGMV/BGMV).

    out = lora_add(y, x, a, b, rows)

    y    [T, N]     the base linear's output for the T rows (tokens) of the batch
    x    [T, K]     the linear's input, y's dtype
    a    [S, R, K]  the "A" (shrink) matrices of S adapter slots, rank padded to R with zero rows
    b    [S, R, N]  the "B" matrices transposed, b[s, r, n] = B_s[n, r], the adapter's scaling folded in
    rows [T] int64  the slot of each row, -1 for none
    out  [T, N]     a new tensor: y, plus (x[t] @ a[s].T) @ b[s] on each row t with s = rows[t] >= 0

`splits` (optional, `lora_add(y, x, a, b, rows, splits)`) describes a fused projection of P parts (q, k, v
into one qkv): P + 1 columns 0 = c_0 < c_1 < ... < c_P = N, R divisible by P. Rank block p, rows
p * R / P .. (p + 1) * R / P of a and b, then adds only to the output columns c_p .. c_{p+1}: column n of
part p is y + h[ranks of p] @ b[s, ranks of p, n]. b's entries outside their part's columns are never read
(they may hold anything), so a block-diagonal b costs 1/P of its bytes and multiply-adds. None: one part,
every rank row writing every column (the op ladder::lora_add takes an empty list for it).

The rank-R intermediate h = x[t] @ a[s].T is float32 (so is every sum), the sum y + h @ b[s] is rounded
once to y's dtype, and a row without a slot is y's row bit for bit. A row's result depends on its own
x, y and slot only, not on the other rows or on T (the C++ and Triton kernels compute each row alone, in
one fixed order), so adding rows of other requests to a batch never changes a request's output.

Implementations, one per device, chosen by `lora_add`:
- CPU, float32: ladder::lora_add, the C++ kernel of kernels/csrc/lora.cpp (rows grouped by slot so each
  adapter's weights are read once per call; AVX2 tiles); the torch reference where the extension cannot
  be built or LADDER_CPU_KERNELS=0. Other CPU dtypes take the reference. A column's sum runs over its
  part's ranks only, in order.
- CUDA: two Triton kernels (`lora_add_triton`): a shrink of each row to h [T, R] float32, then an expand
  over blocks of N that adds h @ b[s] to y (each part's ranks masked to its columns; at most 4 parts), or
  copies y. There a slot outside -1 .. S - 1 counts as none (checking would cost a host sync); the C++
  kernel raises ValueError on it.
- `lora_add_ref`, the plain-torch definition: one pair of matmuls per adapter present in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.cpu_extension import cpu_op, load  # noqa: F401  (load: callers build through it)
from kernels.runtime import FLOAT_DTYPES, HAS_TRITON, check_devices, next_power_of_2, require_triton, tl, triton


def lora_add_ref(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                 rows: torch.Tensor, splits: Sequence[int] | None = None) -> torch.Tensor:
    """The definition: for each slot s present, the rows idx = rows == s get y + (x @ a[s].T) @ b[s]; with
    `splits`, part p's columns c_p .. c_{p+1} get only its rank block's product (b read there alone)."""
    out = y.clone()
    n, rank = y.shape[1], a.shape[1]
    bounds = list(splits) if splits else [0, n]
    per_part = rank // (len(bounds) - 1)
    for s in rows.unique().tolist():
        if s < 0:
            continue
        idx = rows == s
        h = x[idx].float() @ a[s].float().t()  # [n, R] float32
        for p, (c0, c1) in enumerate(zip(bounds[:-1], bounds[1:])):
            ranks = slice(p * per_part, (p + 1) * per_part)
            out[idx, c0:c1] = (y[idx, c0:c1].float() + h[:, ranks] @ b[s, ranks, c0:c1].float()).to(y.dtype)
    return out


def _lora_add_op_ref(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor,
                     splits: list[int], portable: bool) -> torch.Tensor:
    """ladder::lora_add's schema (`splits` int[], empty for one part) and fallback (`portable` is the C++
    kernel's alone)."""
    return lora_add_ref(y, x, a, b, rows, splits)


TRITON_MAX_PARTS = 4  # the Triton expand's split1 .. split3

_lora_add = cpu_op("lora_add", _lora_add_op_ref, lambda y, x, a, b, rows, splits, portable: torch.empty_like(y))


_checked_splits: dict[tuple[tuple[int, ...], int, int], list[int]] = {}  # (splits, N, R) -> the op's list


def _check_splits(splits: Sequence[int] | None, n: int, rank: int) -> list[int]:
    """`splits` as the op's list (empty for one part), or ValueError (module docstring). A projection
    passes the same splits on every step: checked once per (splits, N, R), then looked up."""
    if splits is None:
        return []
    key = (tuple(splits), n, rank)
    bounds = _checked_splits.get(key)
    if bounds is not None:
        return bounds
    bounds = [int(c) for c in splits]
    parts = len(bounds) - 1
    if parts < 1 or bounds[0] != 0 or bounds[-1] != n:
        raise ValueError(f"lora_add: splits must be P + 1 >= 2 columns from 0 to N = {n}, got {list(splits)}")
    if any(c0 >= c1 for c0, c1 in zip(bounds[:-1], bounds[1:])):
        raise ValueError(f"lora_add: splits must be strictly increasing, got {list(splits)}")
    if rank % parts:
        raise ValueError(f"lora_add: the rank R = {rank} must be divisible by the number of parts P = {parts} "
                         f"(splits {list(splits)})")
    if len(_checked_splits) < 1024:
        _checked_splits[key] = bounds
    return bounds


def _check(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor) -> None:
    """ValueError unless the shapes, dtypes and devices agree. The way through is one expression (a few
    microseconds: it runs per linear, per step); the messages are built only on the way out."""
    try:
        (t, n), (t_x, k), (s, r, k_a), (s_b, r_b, n_b), (t_rows,) = y.shape, x.shape, a.shape, b.shape, rows.shape
    except ValueError:
        pass  # a rank is wrong: said below
    else:
        dtype, device = y.dtype, y.device
        if (t == t_x == t_rows and k == k_a and n == n_b and s == s_b and r == r_b and dtype in FLOAT_DTYPES
                and x.dtype is dtype and a.dtype is dtype and b.dtype is dtype and rows.dtype is torch.int64
                and x.device == device and a.device == device and b.device == device and rows.device == device):
            return
    shapes = (f"y {list(y.shape)}, x {list(x.shape)}, a {list(a.shape)}, b {list(b.shape)}, "
              f"rows {list(rows.shape)}")
    if (y.dim(), x.dim(), a.dim(), b.dim(), rows.dim()) != (2, 2, 3, 3, 1):
        raise ValueError(f"lora_add expects y [T, N], x [T, K], a [S, R, K], b [S, R, N], rows [T]; got {shapes}")
    if not x.shape[0] == y.shape[0] == rows.shape[0]:
        raise ValueError(f"y, x and rows must have the same number of rows T; got {shapes}")
    if a.shape[0] != b.shape[0]:
        raise ValueError(f"a and b must hold the same number of slots S; got {shapes}")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"a and b must have the same rank R (a [S, R, K], b [S, R, N]); got {shapes}")
    if a.shape[2] != x.shape[1] or b.shape[2] != y.shape[1]:
        raise ValueError(f"a's last dimension must be x's K and b's y's N; got {shapes}")
    if y.dtype not in FLOAT_DTYPES or not x.dtype == a.dtype == b.dtype == y.dtype:
        raise ValueError(f"y, x, a and b must share one float dtype; got {y.dtype}, {x.dtype}, {a.dtype}, {b.dtype}")
    if rows.dtype != torch.int64:
        raise ValueError(f"rows must be int64, got {rows.dtype}")
    raise ValueError(f"tensors must share one device, got y on {y.device}, x on {x.device}, a on {a.device}, "
                     f"b on {b.device}, rows on {rows.device}")


if HAS_TRITON:

    @triton.jit
    def _lora_shrink_kernel(
        x_ptr, a_ptr, rows_ptr, h_ptr, K, R, num_slots,
        stride_x, stride_a_slot, stride_a_rank, stride_h,
        BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        # One program: h[t, ranks] = x[t] @ a[slot, ranks].T for one row t and BLOCK_R ranks, over K in
        # BLOCK_K steps (the order depends on K alone: a row's h is the same in any batch).
        t = tl.program_id(0).to(tl.int64)
        ranks = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        slot = tl.load(rows_ptr + t)
        valid = (slot >= 0) & (slot < num_slots)
        slot = tl.where(valid, slot, 0)
        # A row without a slot has no ranks and no columns: it loads and stores nothing (the expand
        # copies its y). The masks compare against such limits rather than combine `valid` with `&`,
        # which the interpreter mistypes for a scalar and a block.
        num_ranks = tl.where(valid, R, 0)
        rank_mask = ranks < num_ranks
        acc = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, tl.where(valid, K, 0), BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            xv = tl.load(x_ptr + t * stride_x + cols, mask=cols < K, other=0.0).to(tl.float32)
            av = tl.load(a_ptr + slot * stride_a_slot + ranks[:, None] * stride_a_rank + cols[None, :],
                         mask=rank_mask[:, None] & (cols[None, :] < K), other=0.0).to(tl.float32)
            acc += av * xv[None, :]
        tl.store(h_ptr + t * stride_h + ranks, tl.sum(acc, axis=1), mask=rank_mask)

    @triton.jit
    def _part_of(col, split1, split2, split3):
        return (col >= split1).to(tl.int32) + (col >= split2).to(tl.int32) + (col >= split3).to(tl.int32)

    @triton.jit
    def _lora_expand_kernel(
        y_ptr, h_ptr, b_ptr, rows_ptr, out_ptr, N, part_ranks, split1, split2, split3, num_slots,
        stride_y, stride_h, stride_b_slot, stride_b_rank, stride_out,
        BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        # One program: out[t, cols] = y + h[t] @ b[slot, :, cols] for one row t and BLOCK_N columns; y
        # itself, bit for bit, where the row has no slot. Parts (at most 4): a column n is in part
        # (n >= split1) + (n >= split2) + (n >= split3) (the unused bounds are N), and rank r, of part
        # r // part_ranks, adds to it only there: b is loaded where the two agree, nowhere else. The
        # ranks run BLOCK_R at a time in order, from the first rank of the block's first part to the last
        # of its last part (the order depends on the columns alone).
        t = tl.program_id(0).to(tl.int64)
        block0 = tl.program_id(1) * BLOCK_N
        cols = block0 + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        col_part = _part_of(cols, split1, split2, split3)
        first_part = _part_of(block0, split1, split2, split3)
        last_part = _part_of(tl.minimum(block0 + BLOCK_N, N) - 1, split1, split2, split3)
        slot = tl.load(rows_ptr + t)
        valid = (slot >= 0) & (slot < num_slots)
        slot = tl.where(valid, slot, 0)
        r_begin = first_part * part_ranks
        r_end = tl.where(valid, (last_part + 1) * part_ranks, r_begin)  # no ranks without a slot (see the shrink)
        y = tl.load(y_ptr + t * stride_y + cols, mask=col_mask, other=0.0)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for r0 in range(r_begin, r_end, BLOCK_R):
            ranks = r0 + tl.arange(0, BLOCK_R)
            rank_mask = ranks < r_end
            rank_part = ranks // tl.maximum(part_ranks, 1)
            hv = tl.load(h_ptr + t * stride_h + ranks, mask=rank_mask, other=0.0)
            bv = tl.load(b_ptr + slot * stride_b_slot + ranks[:, None] * stride_b_rank + cols[None, :],
                         mask=(rank_mask[:, None] & col_mask[None, :]) & (rank_part[:, None] == col_part[None, :]),
                         other=0.0).to(tl.float32)
            acc += tl.sum(hv[:, None] * bv, axis=0)
        out = tl.where(valid, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), y)
        tl.store(out_ptr + t * stride_out + cols, out, mask=col_mask)


def lora_add_triton(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    rows: torch.Tensor, splits: Sequence[int] | None = None) -> torch.Tensor:
    """`lora_add` by the Triton kernels (CUDA tensors; any device under TRITON_INTERPRET=1)."""
    require_triton()
    _check(y, x, a, b, rows)
    bounds = _check_splits(splits, y.shape[1], a.shape[1])
    check_devices(y=y, x=x, a=a, b=b, rows=rows)
    return _launch(y, x, a, b, rows, bounds)


def _launch(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor,
            bounds: list[int]) -> torch.Tensor:
    y, x, a, b, rows = y.contiguous(), x.contiguous(), a.contiguous(), b.contiguous(), rows.contiguous()
    num_rows, n = y.shape
    num_slots, rank, k = a.shape
    out = torch.empty_like(y)
    if num_rows == 0 or n == 0:
        return out
    bounds = bounds or [0, n]
    num_parts = len(bounds) - 1
    if num_parts > TRITON_MAX_PARTS:
        raise ValueError(f"lora_add: the Triton kernel takes at most {TRITON_MAX_PARTS} parts, got splits {bounds}")
    part_ranks = rank // num_parts
    inner = bounds[1:-1] + [n] * (TRITON_MAX_PARTS - num_parts)  # split1 .. split3
    h = torch.empty(num_rows, rank, dtype=torch.float32, device=y.device)  # [T, R]
    if rank:
        block_r = min(16, next_power_of_2(max(rank, 1)))
        block_k = min(128, next_power_of_2(max(k, 1)))
        _lora_shrink_kernel[(num_rows, triton.cdiv(rank, block_r))](
            x, a, rows, h, k, rank, num_slots, x.stride(0), a.stride(0), a.stride(1), h.stride(0),
            BLOCK_R=block_r, BLOCK_K=block_k,
        )
    block_n = min(128, next_power_of_2(n))
    _lora_expand_kernel[(num_rows, triton.cdiv(n, block_n))](
        y, h, b, rows, out, n, part_ranks, *inner, num_slots,
        y.stride(0), h.stride(0), b.stride(0), b.stride(1), out.stride(0),
        BLOCK_R=min(16, next_power_of_2(max(part_ranks, 1))), BLOCK_N=block_n,
    )
    return out


def lora_add(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor,
             splits: Sequence[int] | None = None, *, portable: bool = False) -> torch.Tensor:
    """y [T, N] + each row's adapter product (module docstring), as a new tensor. `splits`: the P + 1
    column bounds of a fused projection's parts (module docstring), None for one part. `portable`: the
    C++ kernel's portable loop even where its AVX2 tiles exist (tests; the results are the same)."""
    _check(y, x, a, b, rows)
    bounds = _check_splits(splits, y.shape[1], a.shape[1])
    if y.is_cpu:
        if y.dtype != torch.float32:
            return lora_add_ref(y, x, a, b, rows, bounds)
        return _lora_add(y.contiguous(), x.contiguous(), a.contiguous(), b.contiguous(), rows.contiguous(), bounds,
                         portable)
    if y.is_cuda and HAS_TRITON:
        return _launch(y, x, a, b, rows, bounds)
    return lora_add_ref(y, x, a, b, rows, bounds)
