"""The reference attention with chunks of up to `SHORT_QUERY` tokens on the C++ decode kernel
(`kernels/cpu_decode_attention.py`), which reads cached blocks in place instead of gathering them.

Each new token of such a chunk runs as its own decode row: token i is a query over the first
`position + 1` cached tokens, through its sequence's block table. The causal mask is then the row's
length and each row's sums run in the kernel's one fixed order, so a token's attention does not depend on
the step around it: alone (a decode), among the drafts of a speculative step, in a prompt computed whole
or in the few tokens left after a prefix-cache hit, beside other sequences' chunks. Under quantized
weights, whose activation rounding turns a last-bit difference into another token, that is what keeps a
request's greedy text the same with speculation, with a prefix-cache hit, and in any batch.

Longer chunks (prompts over 1,024 tokens) gather their blocks and run the reference in the same step: one
GEMM over the chunk beats re-reading the context per token there (SmolLM2 prefill on an Intel Xeon,
2 vCPUs: 128 tokens 0.066 s as rows, 0.061 s gathered; 512: 0.27 s both; 1,024: 0.68 s and 0.70 s;
2,048: 7.8 s and 2.7 s). A prompt over that length can then differ in its last bits after a cache hit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import cpu_decode_attention as cpu_kernel
from kernels.kv_cache import write_kv_cache_ref
from kernels.paged_attention import gathered_attention
from model.attention.torch_backend import TorchAttentionPlan, TorchPagedAttention
from model.attention_metadata import AttentionMetadata

# New tokens of a sequence up to which its chunk runs on the decode kernel, one row per token. A row
# re-reads its context, so the rows' cost grows with chunk length x context faster than the gather's.
SHORT_QUERY = 1024


@dataclass(frozen=True)
class CpuAttentionPlan:
    """Which new tokens run as decode rows on the kernel, and the reference's plan for the rest.

    Each row has its sequence's block table [R, num_blocks] and its length [R] (its position + 1: the keys
    it sees). In a step of short chunks only, every token is a row (`rows` and `gather` None); otherwise
    `rows` [R] and `gathered` [G] split the tokens, and `gather` is the reference's plan over the long
    chunks' sequences alone, whose queries are q[gathered]."""

    slot_mapping: torch.Tensor  # [T]
    row_block_tables: torch.Tensor
    row_seq_lens: torch.Tensor
    rows: torch.Tensor | None = None
    gathered: torch.Tensor | None = None
    gather: TorchAttentionPlan | None = None


class CpuPagedAttention(TorchPagedAttention):
    """Short chunks whose cache dtype the kernel takes (it computes in float32) run on it; anything else,
    and a machine where the kernel does not build, runs the reference."""

    def plan(self, meta: AttentionMetadata) -> CpuAttentionPlan | TorchAttentionPlan:
        if not cpu_kernel.load():
            return super().plan(meta)
        if meta.max_query_len == 1:  # decodes: one row per sequence already
            return CpuAttentionPlan(meta.slot_mapping, meta.block_tables, meta.seq_lens)
        starts = meta.query_start_loc
        query_lens = starts[1:] - starts[:-1]  # [S]
        num_tokens = int(starts[-1])
        sequence = torch.repeat_interleave(torch.arange(len(query_lens)), query_lens, output_size=num_tokens)  # [T]
        token = torch.arange(num_tokens)
        # Token t of sequence s sits at position seq_lens[s] - (starts[s + 1] - t) and sees one more key.
        token_lens = meta.seq_lens[sequence] - starts[1:][sequence] + token + 1  # [T]
        short = query_lens <= SHORT_QUERY  # [S]
        if meta.key_ends is not None:
            # A chunk whose image tokens see past themselves runs gathered, under the reference's mask (a row
            # of the kernel sees a prefix of its context, and a window counts back from the row's end).
            widened = meta.key_ends != token_lens  # [T]
            short[sequence[widened]] = False
        if not bool(short.any()):
            return super().plan(meta)
        is_row = short[sequence]  # [T]
        rows = token[is_row]
        row_seq = sequence[is_row]
        row_lens = token_lens[is_row]
        if bool(short.all()):
            return CpuAttentionPlan(meta.slot_mapping, meta.block_tables[row_seq], row_lens)
        long = ~short
        long_lens = query_lens[long]
        long_starts = torch.zeros(len(long_lens) + 1, dtype=torch.long)
        torch.cumsum(long_lens, 0, out=long_starts[1:])
        key_ends = meta.key_ends[~is_row] if meta.key_ends is not None else None
        sub = AttentionMetadata(long_starts, meta.seq_lens[long], meta.block_tables[long], meta.slot_mapping,
                                int(long_lens.max()), int(meta.seq_lens[long].max()), key_ends=key_ends)
        return CpuAttentionPlan(meta.slot_mapping, meta.block_tables[row_seq], row_lens, rows, token[~is_row],
                                super().plan(sub))

    def forward(self, q, k, v, kv_cache, plan, scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
        if not isinstance(plan, CpuAttentionPlan):
            return super().forward(q, k, v, kv_cache, plan, scale, sinks)
        write_kv_cache_ref(k, v, kv_cache, plan.slot_mapping)
        if plan.gather is None:
            return self._rows(q, kv_cache, plan.row_block_tables, plan.row_seq_lens, scale, sinks)
        out = torch.empty_like(q)
        out[plan.rows] = self._rows(q[plan.rows], kv_cache, plan.row_block_tables, plan.row_seq_lens, scale, sinks)
        out[plan.gathered] = gathered_attention(q[plan.gathered], kv_cache, plan.gather.gather, scale, sinks=sinks)
        return out

    def _rows(self, q, kv_cache, block_tables, seq_lens, scale: float, sinks: torch.Tensor | None) -> torch.Tensor:
        """One query row per token: the kernel where it takes the dtypes, its reference elsewhere."""
        if cpu_kernel.takes_dtypes(q.dtype, kv_cache.dtype):
            return cpu_kernel.paged_decode_attention(q, kv_cache, block_tables, seq_lens, scale, self.sliding_window,
                                                     sinks=sinks)
        return cpu_kernel.paged_decode_attention_ref(q, kv_cache, block_tables, seq_lens, scale,
                                                     self.sliding_window or 0, False, sinks)
