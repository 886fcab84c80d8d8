"""Mixture-of-experts feed-forward: routing, the fused grouped form and its plain per-expert reference.

Every expert is a SwiGLU MLP. Its weights are stacked over experts:

    w13 [E, 2I, H]  gate rows first, then up rows, per expert (one matmul gives both)
    w2  [E, H, I]   the down projection

Routing (Qwen3-MoE, Mixtral, the same function): softmax over all E router logits in float32, keep the
top k, and, with `renormalize`, divide the k weights by their sum. With `renormalize` this equals
Mixtral's "softmax over the top-k logits" exactly (a softmax's ratios do not depend on the other entries);
Qwen3-MoE renormalises when its config's `norm_topk_prob` says so.

`fused_moe` (float weights), `int8_moe` (weight-only int8 experts) and `w4a8_moe` (a GGUF's own blocks
times int8 activations, one C++ call: kernels/cpu_w4a8_experts.py) run each expert on the tokens routed to it
only (`grouped_moe`): the T * k (token, expert) pairs are sorted by expert, each expert does one matmul over
its gathered rows, and every token sums its k expert outputs in slot order (the order top-k gave them).
`fused_moe_triton` is the same function for CUDA: two grouped GEMMs over the pairs padded per expert to the
kernel's row block, with no host sync. `fused_moe_ref` runs every expert on every token and
masks by the routing weight: simple enough to be obviously right, and E / k times the arithmetic.

Each of them takes an `expert_offset` (expert parallelism, parallel/shard.py): the stacked weights are then
experts expert_offset .. expert_offset + len(w13) - 1 of the E the router scores, routing still picks the
top k over all E, and a pair routed to an expert outside that range contributes 0; the ranks' partial
outputs are summed by the all-reduce after the block. With the whole stack (the default) nothing changes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels.cpu_int8_linear import int8_linear, pack
from kernels.cpu_w4a8_experts import w4a8_experts
from kernels.runtime import (
    FLOAT_DTYPES,
    HAS_TRITON,
    check_devices,
    check_tensor,
    dot_dtype,
    dot_precision,
    require_triton,
    tl,
    triton,
)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] float32, experts [T, k] int64), slots in descending weight."""
    probs = torch.softmax(router_logits.float(), dim=-1)  # float32 whatever the model's dtype, as HF does
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def _expert(rows: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert's SwiGLU MLP: rows [n, H], w13 [2I, H], w2 [H, I] -> [n, H]."""
    gate, up = F.linear(rows, w13).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w2)


def grouped_moe(
    x: torch.Tensor,  # [T, H]
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    renormalize: bool,
    expert: Callable[[int, torch.Tensor, torch.Tensor], None],  # (e, rows [n, H], out [n, H]): out = e(rows)
    experts_held: range | None = None,  # the experts `expert` computes (indices into the router's E); None: all
) -> torch.Tensor:  # [T, H], x's dtype
    """The MoE feed-forward over the routed (token, expert) pairs only: `route`, then `grouped_experts`."""
    weights, experts = route(router_logits, top_k, renormalize)
    held = range(router_logits.shape[1]) if experts_held is None else experts_held
    return grouped_experts(x, weights, experts, expert, held)


def grouped_experts(
    x: torch.Tensor,  # [T, H]
    weights: torch.Tensor,  # [T, k] float32, each token's routing weights in slot order (`route`)
    experts: torch.Tensor,  # [T, k] int64, the router's experts of those slots
    expert: Callable[[int, torch.Tensor, torch.Tensor], None],  # (e, rows [n, H], out [n, H]): out = e(rows)
    held: range,  # the experts `expert` computes (indices into the router's E)
) -> torch.Tensor:  # [T, H], x's dtype
    """The routed (token, expert) pairs of the experts in `held`, whatever form the experts' weights take
    (`expert` computes one expert on its rows, `e` counted from held.start).

    With `held` a part of the router's experts, only the pairs routed to those are computed; the
    others' rows are 0, so the result is this part's share of the whole sum (every token still adds its k
    rows in slot order, and adding an exact 0 changes no bit).

    Deterministic: no atomics and no scatter-add. Each pair's output is written to its own row, then every
    token gathers and adds its k rows in slot order with elementwise adds, so a token's sum is formed the
    same way whatever else is in the batch (its expert matmuls are as batch-invariant as any GEMM's row is).
    One host sync per call (the per-expert row counts), which the loop over experts needs.
    """
    num_tokens, top_k = experts.shape
    flat_experts = experts.reshape(-1)  # [T*k] pair p = (token p // k, slot p % k)
    order = torch.argsort(flat_experts, stable=True)  # pairs grouped by expert, token order inside a group
    counts = torch.bincount(flat_experts, minlength=held.stop).tolist()
    begin = sum(counts[:held.start])  # the held experts' pairs are order[begin:end] (grouped by expert)
    end = begin + sum(counts[held.start:held.stop])
    rows = x.index_select(0, order[begin:end] // top_k)  # [P, H] each held pair's token, grouped by expert
    out = x.new_empty(order.numel(), x.shape[1])  # [T*k, H] each pair's expert output, same order
    out[:begin].zero_()  # pairs of experts held elsewhere
    out[end:].zero_()
    start = begin
    for e in held:
        n = counts[e]
        if n:
            expert(e - held.start, rows[start - begin:start - begin + n], out[start:start + n])
            start += n
    out.mul_(weights.reshape(-1)[order].unsqueeze(1).to(out.dtype))  # scale by the routing weight
    # position [T, k]: where pair (t, j) sits in `out`
    position = torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel(), device=x.device))
    position = position.view(num_tokens, top_k)
    total = out.index_select(0, position[:, 0])
    for slot in range(1, top_k):  # fixed order, elementwise: no reduction kernel's shape-dependent blocking
        total.add_(out.index_select(0, position[:, slot]))
    return total


def fused_moe(
    x: torch.Tensor,  # [T, H]
    router_logits: torch.Tensor,  # [T, E]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    top_k: int,
    renormalize: bool = True,
    expert_offset: int = 0,  # w13[0] is the router's expert `expert_offset` (see the module's docstring)
) -> torch.Tensor:  # [T, H], x's dtype
    """`grouped_moe` over float experts: per expert one matmul for gate and up, one for down."""

    def expert(e: int, rows: torch.Tensor, out: torch.Tensor) -> None:
        gate, up = F.linear(rows, w13[e]).chunk(2, dim=-1)
        torch.mm(F.silu(gate) * up, w2[e].t(), out=out)  # straight into the pair rows

    return grouped_moe(x, router_logits, top_k, renormalize, expert,
                       held_experts(router_logits, w13.shape[0], expert_offset))


def held_experts(router_logits: torch.Tensor, num_held: int, expert_offset: int) -> range | None:
    """The router's experts a stack of `num_held` from `expert_offset` holds; None when it holds all E.
    ValueError when the range does not fit in E."""
    num_experts = router_logits.shape[-1]
    if expert_offset < 0 or expert_offset + num_held > num_experts:
        raise ValueError(f"experts {expert_offset}..{expert_offset + num_held - 1} are not among the router's "
                         f"{num_experts}")
    return None if num_held == num_experts else range(expert_offset, expert_offset + num_held)


def int8_moe(
    x: torch.Tensor,  # [T, H] float32
    router_logits: torch.Tensor,  # [T, E]
    w13_packed: torch.Tensor,  # [E, ...] each expert's int8 [2I, H] in cpu_int8_linear.pack's layout
    w13_scale: torch.Tensor,  # [E, 2I] float32, one per output channel
    w2_packed: torch.Tensor,  # [E, ...] each expert's int8 [H, I], packed
    w2_scale: torch.Tensor,  # [E, H] float32
    top_k: int,
    renormalize: bool = True,
    expert_offset: int = 0,  # w13_packed[0] is the router's expert `expert_offset`
) -> torch.Tensor:  # [T, H]
    """`grouped_moe` over weight-only int8 experts (kernels/cpu_int8_linear.py: int8 weights widened to
    float32 in registers, so an expert reads a quarter of its float32 bytes)."""
    inter2, hidden = w13_scale.shape[1], w2_scale.shape[1]

    def expert(e: int, rows: torch.Tensor, out: torch.Tensor) -> None:
        gate, up = int8_linear(rows, w13_packed[e], w13_scale[e], None, inter2).chunk(2, dim=-1)
        out.copy_(int8_linear(F.silu(gate) * up, w2_packed[e], w2_scale[e], None, hidden))

    return grouped_moe(x, router_logits, top_k, renormalize, expert,
                       held_experts(router_logits, w13_scale.shape[0], expert_offset))


def w4a8_moe(
    x: torch.Tensor,  # [T, H] float32
    router_logits: torch.Tensor,  # [T, E]
    w13_codes: torch.Tensor,  # [E, ...] each expert's gate and up rows [2I, H] in cpu_w4a8_linear.pack's layout
    w13_scales: torch.Tensor,  # [E, ...] their float16 scales, packed
    w13_zero: int,  # the kernel's zero for w13 (w = d (u - zero) where the scales hold d alone)
    w2_codes: torch.Tensor,  # [E, ...] each expert's down rows [H, I], packed
    w2_scales: torch.Tensor,
    w2_zero: int,
    top_k: int,
    renormalize: bool = True,
    expert_offset: int = 0,  # w13_codes[0] is the router's expert `expert_offset`
) -> torch.Tensor:  # [T, H]
    """Routing, then every routed pair through the W4A8 experts as the dense W4A8 layers compute, in one
    C++ call (kernels/cpu_w4a8_experts.py; its reference is `grouped_experts`' loop over experts)."""
    held_experts(router_logits, w13_codes.shape[0], expert_offset)  # ValueError for a range outside E
    weights, experts = route(router_logits, top_k, renormalize)
    return w4a8_experts(x.float().contiguous(), weights.contiguous(), experts.contiguous(), w13_codes, w13_scales,
                        w13_zero, w2_codes, w2_scales, w2_zero, expert_offset)


def pack_int8_experts(weight_int8: torch.Tensor) -> torch.Tensor:
    """int8 [E, N, K] -> each expert's cpu_int8_linear layout, stacked: [E, ceil(N / 16), K, 16]."""
    return torch.stack([pack(w) for w in weight_int8])


def fused_moe_ref(
    x: torch.Tensor,  # [T, H]
    router_logits: torch.Tensor,  # [T, E]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    top_k: int,
    renormalize: bool = True,
    expert_offset: int = 0,  # w13[0] is the router's expert `expert_offset`
) -> torch.Tensor:  # [T, H]
    """Every expert on every token, masked by the routing weight (0 for an expert a token does not use)."""
    weights, experts = route(router_logits, top_k, renormalize)
    # dense [T, E]: the routing weight of each expert for each token, 0 where not routed
    dense = torch.zeros(x.shape[0], router_logits.shape[1], dtype=torch.float32, device=x.device)
    dense.scatter_(1, experts, weights)
    out = torch.zeros_like(x, dtype=torch.float32)
    for e in range(w13.shape[0]):
        out += dense[:, expert_offset + e:expert_offset + e + 1] * _expert(x, w13[e], w2[e]).float()
    return out.to(x.dtype)


def moe_loop_hf(
    x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
    renormalize: bool = True,
) -> torch.Tensor:
    """Hugging Face transformers' loop (Qwen3MoeExperts.forward): per expert hit, find its tokens with a
    mask, run them, index_add_ into the output. For the benchmark's second baseline."""
    weights, experts = route(router_logits, top_k, renormalize)
    out = torch.zeros_like(x)
    mask = F.one_hot(experts, num_classes=w13.shape[0]).permute(2, 1, 0)  # [E, k, T]
    for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()[:, 0].tolist():
        slot, token = torch.where(mask[e])
        y = _expert(x[token], w13[e], w2[e]) * weights[token, slot, None].to(x.dtype)
        out.index_add_(0, token, y)
    return out


# -- Triton: a grouped GEMM over the pairs, for CUDA (TRITON_INTERPRET=1 runs it on a CPU for tests) -----

if HAS_TRITON:

    @triton.jit
    def _grouped_matmul_kernel(
        a_ptr, w_ptr, out_ptr, rows_ptr, block_expert_ptr,
        N, K, num_experts, stride_am, stride_we, stride_wn, stride_om,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):
        # Program (m, n): out[m*BM:(m+1)*BM, n*BN:(n+1)*BN] = a[rows of the block] @ w[expert of the block]^T.
        # Every block of BLOCK_M slots belongs to one expert; slots whose row is -1 (padding) are skipped.
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        # Blocks past the last expert's padded range (expert E) hold only padding: every row masked.
        expert = tl.minimum(tl.load(block_expert_ptr + pid_m), num_experts - 1).to(tl.int64)
        slots = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rows = tl.load(rows_ptr + slots)
        row_mask = rows >= 0
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < K
            a = tl.load(a_ptr + rows.to(tl.int64)[:, None] * stride_am + ks[None, :],
                        mask=row_mask[:, None] & k_mask[None, :], other=0.0).to(DOT_DTYPE)
            w = tl.load(w_ptr + expert * stride_we + cols[None, :] * stride_wn + ks[:, None],
                        mask=col_mask[None, :] & k_mask[:, None], other=0.0).to(DOT_DTYPE)  # [BK, BN]
            acc += tl.dot(a, w, input_precision=DOT_PRECISION)
        tl.store(out_ptr + slots.to(tl.int64)[:, None] * stride_om + cols[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def align_pairs(experts: torch.Tensor, num_experts: int,
                block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lay the (token, slot) pairs out by expert, each expert's run padded to a multiple of `block_m`, on
    the device and without a host sync (the slot count is the bound cdiv(P, block_m) + E blocks).

    experts [T, k] -> (slot_pair [S] int64: the pair (t * k + j) in each slot, -1 for padding;
    block_expert [S / block_m] int64: each block's expert, E for unused blocks; pair_slot [T * k]: each
    pair's slot)."""
    flat = experts.reshape(-1)
    num_pairs, device = flat.numel(), flat.device
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    start = torch.cumsum(counts, 0) - counts
    sorted_experts = flat[order]
    slot = (padded_end - padded)[sorted_experts] + torch.arange(num_pairs, device=device) - start[sorted_experts]
    num_blocks = triton.cdiv(num_pairs, block_m) + num_experts
    slot_pair = torch.full((num_blocks * block_m,), -1, dtype=torch.int64, device=device)
    slot_pair[slot] = order
    block_start = torch.arange(num_blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_end, block_start, right=True)  # E past the last expert's range
    pair_slot = torch.empty_like(slot).index_copy_(0, order, slot)
    return slot_pair, block_expert, pair_slot


def _grouped_matmul(a: torch.Tensor, w: torch.Tensor, rows: torch.Tensor, block_expert: torch.Tensor,
                    block_m: int) -> torch.Tensor:
    """out [S, N]: slot s holds a[rows[s]] @ w[expert of s's block]^T (rows -1: left unwritten)."""
    num_experts, n, k = w.shape
    out = torch.empty(rows.shape[0], n, dtype=a.dtype, device=a.device)
    block_n, block_k = 64, 32
    grid = (block_expert.shape[0], triton.cdiv(n, block_n))
    _grouped_matmul_kernel[grid](
        a, w, out, rows, block_expert, n, k, num_experts, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_DTYPE=dot_dtype(a.dtype), DOT_PRECISION=dot_precision(a.dtype),
    )
    return out


def fused_moe_triton(
    x: torch.Tensor,  # [T, H]
    router_logits: torch.Tensor,  # [T, E]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    top_k: int,
    renormalize: bool = True,
    block_m: int = 16,
    expert_offset: int = 0,  # w13[0] is the router's expert `expert_offset`
) -> torch.Tensor:  # [T, H], x's dtype
    """`fused_moe` as two grouped GEMMs (gate/up, then down) over the pairs aligned per expert; routing,
    SiLU * up, the weighting and the slot-order sum stay in torch. No host sync, so it can be captured.
    Pairs routed to experts outside the stack (`expert_offset`) go to one extra group whose slots are
    padding: computed by no program, and 0 in the sum."""
    require_triton()
    for name, t in (("x", x), ("w13", w13), ("w2", w2)):
        check_tensor(name, t, ndim=2 if name == "x" else 3, dtypes=FLOAT_DTYPES)
    check_devices(x=x, router_logits=router_logits, w13=w13, w2=w2)
    num_tokens, hidden = x.shape
    weights, experts = route(router_logits, top_k, renormalize)
    num_held = w13.shape[0]
    foreign = None
    if held_experts(router_logits, num_held, expert_offset) is not None:
        experts = experts - expert_offset
        foreign = (experts < 0) | (experts >= num_held)  # [T, k]
        experts = torch.where(foreign, num_held, experts)  # one more group, after the held experts
    slot_pair, block_expert, pair_slot = align_pairs(experts, num_held + (foreign is not None), block_m)
    if foreign is not None:  # the extra group's slots become padding (its blocks: expert E_held, clamped)
        slot_pair = torch.where((slot_pair >= 0) & foreign.reshape(-1)[slot_pair.clamp(min=0)], -1, slot_pair)
    # The first GEMM reads each slot's token row; -1 // k stays -1, so padding stays padding.
    gate_up = _grouped_matmul(x, w13, slot_pair // top_k, block_expert, block_m)  # [S, 2I]
    gate, up = gate_up.chunk(2, dim=-1)
    act = (F.silu(gate) * up).contiguous()  # [S, I]; padding rows hold garbage that nothing reads
    own_rows = torch.where(slot_pair >= 0, torch.arange(slot_pair.shape[0], device=x.device), -1)
    down = _grouped_matmul(act, w2, own_rows, block_expert, block_m)  # [S, H]
    down = down[pair_slot]  # [T*k, H]
    if foreign is not None:  # unwritten rows: replaced, not multiplied (they may hold NaN)
        down = torch.where(foreign.reshape(-1, 1), 0.0, down)
    per_pair = (down * weights.reshape(-1, 1).to(down.dtype)).view(num_tokens, top_k, hidden)
    total = per_pair[:, 0]
    for slot in range(1, top_k):
        total = total + per_pair[:, slot]
    return total
