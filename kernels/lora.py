"""Many LoRA adapters on one linear layer, each row of a flat batch with its own (Punica's SGMV/BGMV).

    out = lora_add(y, x, a, b, rows)

    y    [T, N]     the base linear's output for the T rows (tokens) of the batch
    x    [T, K]     the linear's input, y's dtype
    a    [S, R, K]  the "A" (shrink) matrices of S adapter slots, rank padded to R with zero rows
    b    [S, R, N]  the "B" matrices transposed, b[s, r, n] = B_s[n, r], the adapter's scaling folded in
    rows [T] int64  the slot of each row, -1 for none
    out  [T, N]     a new tensor: y, plus (x[t] @ a[s].T) @ b[s] on each row t with s = rows[t] >= 0

The rank-R intermediate h = x[t] @ a[s].T is float32 (so is every sum), the sum y + h @ b[s] is rounded
once to y's dtype, and a row without a slot is y's row bit for bit. A row's result depends on its own
x, y and slot only, not on the other rows or on T (the C++ and Triton kernels compute each row alone, in
one fixed order), so adding rows of other requests to a batch never changes a request's output.

Implementations, one per device, chosen by `lora_add`:
- CPU, float32: ladder::lora_add, the C++ kernel of kernels/csrc/lora.cpp (rows grouped by slot so each
  adapter's weights are read once per call; AVX2 tiles); the torch reference where the extension cannot
  be built or LADDER_CPU_KERNELS=0. Other CPU dtypes take the reference.
- CUDA: two Triton kernels (`lora_add_triton`): a shrink of each row to h [T, R] float32, then an expand
  over blocks of N that adds h @ b[s] to y, or copies y. There a slot outside -1 .. S - 1 counts as none
  (checking would cost a host sync); the C++ kernel raises ValueError on it.
- `lora_add_ref`, the plain-torch definition: one pair of matmuls per adapter present in the batch.
"""

from __future__ import annotations

import torch

from kernels.cpu_extension import cpu_op, load  # noqa: F401  (load: callers build through it)
from kernels.runtime import FLOAT_DTYPES, HAS_TRITON, check_devices, next_power_of_2, require_triton, tl, triton


def lora_add_ref(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                 rows: torch.Tensor) -> torch.Tensor:
    """The definition: for each slot s present, the rows idx = rows == s get y + (x @ a[s].T) @ b[s]."""
    out = y.clone()
    for s in rows.unique().tolist():
        if s < 0:
            continue
        idx = rows == s
        h = x[idx].float() @ a[s].float().t()  # [n, R] float32
        out[idx] = (y[idx].float() + h @ b[s].float()).to(y.dtype)
    return out


def _lora_add_op_ref(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor,
                     portable: bool) -> torch.Tensor:
    """ladder::lora_add's schema and fallback (`portable` is the C++ kernel's alone)."""
    return lora_add_ref(y, x, a, b, rows)


_lora_add = cpu_op("lora_add", _lora_add_op_ref, lambda y, x, a, b, rows, portable: torch.empty_like(y))


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
    def _lora_expand_kernel(
        y_ptr, h_ptr, b_ptr, rows_ptr, out_ptr, N, R, num_slots,
        stride_y, stride_h, stride_b_slot, stride_b_rank, stride_out,
        BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        # One program: out[t, cols] = y + h[t] @ b[slot, :, cols] for one row t and BLOCK_N columns, the
        # ranks BLOCK_R at a time in order; y itself, bit for bit, where the row has no slot.
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        slot = tl.load(rows_ptr + t)
        valid = (slot >= 0) & (slot < num_slots)
        slot = tl.where(valid, slot, 0)
        num_ranks = tl.where(valid, R, 0)  # no ranks to load without a slot (see the shrink)
        y = tl.load(y_ptr + t * stride_y + cols, mask=col_mask, other=0.0)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for r0 in range(0, num_ranks, BLOCK_R):
            ranks = r0 + tl.arange(0, BLOCK_R)
            rank_mask = ranks < num_ranks
            hv = tl.load(h_ptr + t * stride_h + ranks, mask=rank_mask, other=0.0)
            bv = tl.load(b_ptr + slot * stride_b_slot + ranks[:, None] * stride_b_rank + cols[None, :],
                         mask=rank_mask[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(hv[:, None] * bv, axis=0)
        out = tl.where(valid, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), y)
        tl.store(out_ptr + t * stride_out + cols, out, mask=col_mask)


def lora_add_triton(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    rows: torch.Tensor) -> torch.Tensor:
    """`lora_add` by the Triton kernels (CUDA tensors; any device under TRITON_INTERPRET=1)."""
    require_triton()
    _check(y, x, a, b, rows)
    check_devices(y=y, x=x, a=a, b=b, rows=rows)
    return _launch(y, x, a, b, rows)


def _launch(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    y, x, a, b, rows = y.contiguous(), x.contiguous(), a.contiguous(), b.contiguous(), rows.contiguous()
    num_rows, n = y.shape
    num_slots, rank, k = a.shape
    out = torch.empty_like(y)
    if num_rows == 0 or n == 0:
        return out
    h = torch.empty(num_rows, rank, dtype=torch.float32, device=y.device)  # [T, R]
    block_r = min(16, next_power_of_2(max(rank, 1)))
    if rank:
        block_k = min(128, next_power_of_2(max(k, 1)))
        _lora_shrink_kernel[(num_rows, triton.cdiv(rank, block_r))](
            x, a, rows, h, k, rank, num_slots, x.stride(0), a.stride(0), a.stride(1), h.stride(0),
            BLOCK_R=block_r, BLOCK_K=block_k,
        )
    block_n = min(128, next_power_of_2(n))
    _lora_expand_kernel[(num_rows, triton.cdiv(n, block_n))](
        y, h, b, rows, out, n, rank, num_slots, y.stride(0), h.stride(0), b.stride(0), b.stride(1), out.stride(0),
        BLOCK_R=block_r, BLOCK_N=block_n,
    )
    return out


def lora_add(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor, *,
             portable: bool = False) -> torch.Tensor:
    """y [T, N] + each row's adapter product (module docstring), as a new tensor. `portable`: the C++
    kernel's portable loop even where its AVX2 tiles exist (tests; the results are the same)."""
    _check(y, x, a, b, rows)
    if y.is_cpu:
        if y.dtype != torch.float32:
            return lora_add_ref(y, x, a, b, rows)
        return _lora_add(y.contiguous(), x.contiguous(), a.contiguous(), b.contiguous(), rows.contiguous(), portable)
    if y.is_cuda and HAS_TRITON:
        return _launch(y, x, a, b, rows)
    return lora_add_ref(y, x, a, b, rows)
