"""The gated delta rule (Gated DeltaNet: Qwen3.5's linear-attention layers) and its causal convolution, in torch.

A linear-attention layer keeps, per sequence and value head, a state S [Dk, Dv] in place of a KV cache. Token t
(queries and keys L2-normed, queries also scaled by Dk^-1/2) decays the state by exp(g_t) (g_t <= 0), moves
what the state recalls for its key toward its value at the rate beta_t in (0, 1), and reads the state with its
query:

    S <- exp(g_t) S;    u_t = beta_t (v_t - S^T k_t);    S <- S + k_t u_t^T;    o_t = S^T q_t

`delta_rule_step` runs one token of each of B sequences (decode); `chunked_delta_rule` a sequence's run of
tokens in chunks of C with matrix products (prefill). In a chunk, with G_t the sum of g over the chunk up to t
and S0 the state before it, the corrections u solve a unit lower-triangular system

    u_s + beta_s sum_{r<s} exp(G_s - G_r) (k_s . k_r) u_r = beta_s (v_s - exp(G_s) S0^T k_s),

each output is o_t = exp(G_t) S0^T q_t + sum_{s<=t} exp(G_t - G_s) (q_t . k_s) u_s, and the state after it is
exp(G_C) S0 + sum_s exp(G_C - G_s) k_s u_s^T. `recurrent_delta_rule` (token by token) is the reference both
are tested against.

`gated_delta_decode` is a decode step of the whole layer between its projections, one C++ call
(kernels/csrc/gated_delta.cpp: each state read once and written once) with `gated_delta_decode_ref` as its
reference. Everything here is float32: the state accumulates over the whole sequence.
"""

from __future__ import annotations

import torch

from kernels.cpu_extension import cpu_op


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the eps inside the root, as the reference kernels)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def causal_conv(window: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A depthwise causal convolution, then SiLU. window [..., K - 1 + L, C]: the K - 1 inputs before the run
    (zeros at a sequence's start), then the run's L; weight [C, K] -> [..., L, C]. The taps are summed in one
    order for any batch, so a sequence's outputs do not depend on what runs beside it."""
    taps = weight.shape[1]
    length = window.shape[-2] - taps + 1
    out = window[..., 0:length, :] * weight[:, 0]
    for j in range(1, taps):
        out = out + window[..., j:j + length, :] * weight[:, j]
    return torch.nn.functional.silu(out)


def delta_rule_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor) -> torch.Tensor:
    """One token of each of B sequences. q, k [B, H, Dk]; v [B, H, Dv]; g, beta [B, H]; state [B, H, Dk, Dv],
    updated in place. Returns o [B, H, Dv].

    One read of the state gives both what it recalls for k and what q reads from it, since
    S_new^T q = exp(g) S^T q + (k . q) u; one read-and-write updates it."""
    decay = g.exp()  # [B, H]
    read = torch.stack([k, q], dim=2) @ state  # [B, H, 2, Dv]: S^T k, S^T q
    u = beta[..., None] * (v - decay[..., None] * read[:, :, 0])  # [B, H, Dv]
    state.mul_(decay[..., None, None]).add_(k[..., :, None] * u[..., None, :])
    return decay[..., None] * read[:, :, 1] + (k * q).sum(-1, keepdim=True) * u


def recurrent_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         state: torch.Tensor) -> torch.Tensor:
    """The rule token by token, as written: the reference. q, k [L, H, Dk]; v [L, H, Dv]; g, beta [L, H];
    state [H, Dk, Dv], updated in place. Returns o [L, H, Dv]."""
    out = torch.empty_like(v)
    for t in range(q.shape[0]):
        state.mul_(g[t].exp()[:, None, None])
        u = beta[t][:, None] * (v[t] - (state * k[t][:, :, None]).sum(1))
        state.add_(k[t][:, :, None] * u[:, None, :])
        out[t] = (state * q[t][:, :, None]).sum(1)
    return out


# Decays below e^-80 (about 1.8e-35) are taken as 0: they change nothing next to a term of order one, and their
# products would fall to subnormal floats, which x86 computes tens of times slower (a prompt's rule took 1.5x as long).
NEGLIGIBLE_LOG_DECAY = -80.0


def _decay(log_decay: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """exp(log_decay) where it is above NEGLIGIBLE_LOG_DECAY (and `keep`), else exactly 0."""
    wanted = log_decay > NEGLIGIBLE_LOG_DECAY
    return torch.where(wanted if keep is None else wanted & keep, log_decay, -torch.inf).exp()


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    """The rule over a sequence's L tokens, C = `chunk` at a time (see the module's docstring). Shapes as
    `recurrent_delta_rule`; state [H, Dk, Dv] updated in place. Returns o [L, H, Dv]."""
    # Head-major once ([H, L, D]: each chunk a slice the batched products read without a copy), back at the end.
    q, k, v = (x.transpose(0, 1).contiguous() for x in (q, k, v))
    g, beta = g.T.contiguous(), beta.T.contiguous()
    out = torch.empty_like(v)
    for start in range(0, q.shape[1], chunk):
        end = min(start + chunk, q.shape[1])
        qc, kc, vc = q[:, start:end], k[:, start:end], v[:, start:end]  # [H, C, D]
        cum = g[:, start:end].cumsum(-1)  # [H, C]: G
        bc = beta[:, start:end, None]  # [H, C, 1]
        n = end - start
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        # exp(G_t - G_s) for s <= t, 0 above the diagonal (masked before exp: those differences are positive)
        decay = _decay(cum[:, :, None] - cum[:, None, :], causal)  # [H, C, C]
        lower = (decay * (kc @ kc.transpose(1, 2))).tril(-1) * bc
        system = lower + torch.eye(n, dtype=q.dtype, device=q.device)
        from_start = _decay(cum)[..., None]  # [H, C, 1]: exp(G_t)
        rhs = bc * (vc - from_start * (kc @ state))  # [H, C, Dv]
        u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        out[:, start:end] = from_start * (qc @ state) + (decay * (qc @ kc.transpose(1, 2))) @ u
        last = cum[:, -1:]  # [H, 1]: G_C
        state.mul_(_decay(last)[..., None]).add_((kc * _decay(last - cum)[..., None]).transpose(1, 2) @ u)
    return out.transpose(0, 1).contiguous()


def gated_delta_decode_ref(projected: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor,
                           conv_taps: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                           norm_weight: torch.Tensor, key_heads: int, key_dim: int, value_dim: int, tiled: bool,
                           eps: float) -> torch.Tensor:
    """One new token of each of B sequences through a linear-attention layer, from its input projection to the
    input of its output projection; each sequence's state advanced in place in its row of `pool`.

    projected [B, C + Hv Dv + 2 Hv] float32: each token's convolution input (queries, keys, values: C), output
    gate z, write-rate logit b and decay input a. pool [S, (K - 1) C + Hv Dk Dv] float32, the layer's states
    (model/linear_attention.py); slots [B] int64, each token's row. conv_taps [K, C] (the convolution's weight
    transposed: tap j of every channel contiguous); A_log, dt_bias [Hv];
    norm_weight [Dv]. Returns [B, Hv Dv]: each value head's output RMS-normed, scaled by norm_weight and gated by
    SiLU(z). ladder::gated_delta_decode computes the same in one pass over each state."""
    taps, channels = conv_taps.shape
    conv_weight = conv_taps.t()
    value_heads = (projected.shape[1] - channels) // (value_dim + 2)
    mixed, z, b, a = projected.split([channels, value_heads * value_dim, value_heads, value_heads], dim=-1)
    width = (taps - 1) * channels
    conv_state = pool[:, :width].view(-1, taps - 1, channels)
    matrices = pool[:, width:].view(-1, value_heads, key_dim, value_dim)
    window = torch.cat([conv_state.index_select(0, slots), mixed[:, None]], dim=1)  # [B, K, C]
    conv_state.index_copy_(0, slots, window[:, 1:])
    q, k, v = heads(causal_conv(window, conv_weight)[:, 0], key_heads, key_dim, value_heads, value_dim, tiled)
    g = -A_log.exp() * torch.nn.functional.softplus(a + dt_bias)  # [B, Hv], <= 0
    state = matrices.index_select(0, slots)
    out = delta_rule_step(q, k, v, g, b.sigmoid(), state)
    matrices.index_copy_(0, slots, state)
    return gated_rms_norm(out, z.view(-1, value_heads, value_dim), norm_weight, eps).flatten(1)


def heads(mixed: torch.Tensor, key_heads: int, key_dim: int, value_heads: int, value_dim: int,
          tiled: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The convolution's output [N, C] as queries and keys [N, Hv, Dk] (L2-normed, queries scaled by Dk^-1/2; each
    key head serves Hv / Hk value heads: consecutive ones, or with `tiled` every Hk-th) and values [N, Hv, Dv]."""
    q, k, v = mixed.split([key_heads * key_dim, key_heads * key_dim, value_heads * value_dim], dim=-1)
    q = l2_normalize(q.view(-1, key_heads, key_dim)) * key_dim**-0.5
    k = l2_normalize(k.view(-1, key_heads, key_dim))
    repeat = value_heads // key_heads
    if repeat > 1:
        q, k = ((q.repeat(1, repeat, 1), k.repeat(1, repeat, 1)) if tiled
                else (q.repeat_interleave(repeat, dim=1), k.repeat_interleave(repeat, dim=1)))
    return q, k, v.view(-1, value_heads, value_dim)


def gated_rms_norm(out: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Each head's output [..., Dv] RMS-normed, scaled by weight [Dv], times SiLU(z)."""
    normed = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + eps) * weight
    return normed * torch.nn.functional.silu(z)


def _decode_shape(projected: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, conv_taps: torch.Tensor,
                  A_log: torch.Tensor, *rest: object) -> torch.Tensor:
    value_size = projected.shape[1] - conv_taps.shape[1] - 2 * A_log.shape[0]
    return projected.new_empty(projected.shape[0], value_size)


gated_delta_decode = cpu_op("gated_delta_decode", gated_delta_decode_ref, _decode_shape, mutates_args=("pool",))


def causal_conv_taps_ref(window: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
    """`causal_conv` with the taps laid out [K, C] (as `gated_delta_decode` takes them): window [K - 1 + L, C] ->
    [L, C]. ladder::causal_conv computes the same in one pass, rows in parallel."""
    return causal_conv(window, taps.t())


causal_conv_taps = cpu_op("causal_conv", causal_conv_taps_ref,
                          lambda window, taps: window.new_empty(window.shape[0] - taps.shape[0] + 1, window.shape[1]))
