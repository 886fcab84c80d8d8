"""Tensor parallelism applied from outside the model: slice a loaded decoder's weights for one rank and
add the collectives around its unchanged layers.

Per decoder layer (Megatron style):
- qkv_proj is column-parallel: a rank keeps the q, k and v rows of its heads, so attention runs on local
  heads and writes a KV cache of local KV heads only;
- o_proj is row-parallel: a rank keeps the input columns of its heads; its partial output is summed over
  the ranks by an all-reduce (a forward hook);
- gate_up_proj is column-parallel (the rank's columns of gate and of up), down_proj row-parallel with an
  all-reduce, so the MLP needs one collective;
- the embedding and the LM head are split by vocabulary rows: the lookup ends in an all-reduce, the LM
  head's logits are gathered on rank 0.
A mixture-of-experts layer (model/moe.py) is split by experts instead (expert parallelism): a rank keeps
the stacked w13 and w2 (and int8 scales) of its contiguous E / size experts, the router whole. The
hidden states are the same on every rank, so each routes every token over all E experts, computes its own
experts' (token, expert) pairs and leaves the others' at 0; the all-reduce after the block, the one a
dense layer has after down_proj, sums the ranks' parts and is the whole token exchange. A model's dense
layers (Qwen3-MoE's `dense_layers`) are split as above.
Norms, rotary tables and the residual stream are replicated. The same slicing serves float and int8
linears (model/quantization.py): their weights are [out, in] with one scale per output row, so a
column-parallel layer slices the scales with the rows and a row-parallel one keeps them all.

W8A8 keeps every rank's result one process's, bit for bit: down_proj's ranks add their int32 sums
before the float epilogue (parallel/row_parallel_w8a8.py: a MAX all-reduce of each token's maximum for
the whole row's scale, then an int32 all-reduce), and o_proj's input, the attention output, is narrow
(one row of heads), so the ranks all-gather it and each runs the whole o_proj: one collective where a
row-parallel layer would need two.

Split by sequences instead (`TensorParallelLayout.by_sequences`, parallel/sequence_split.py), q/k/v and
o_proj stay whole on every rank and each layer's attention is wrapped to run the rank's own sequences;
the MLP, the embedding and the LM head are split as above.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from kernels.ops import Ops
from model.config import ModelConfig
from model.llama import LlamaForCausalLM
from model.moe import Int8SparseMoeBlock, SparseMoeBlock
from model.quantization import INT8_LINEARS, Int8Weights, W8A8Linear, int8_skeleton, pack_all
from parallel.collectives import Collectives
from parallel.layout import TensorParallelLayout
from parallel.row_parallel_w8a8 import RowParallelW8A8
from parallel.sequence_split import SequenceSplitAttention
from parallel.vocab_parallel_embedding import VocabParallelEmbedding

ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")
EXPERT_STACKS = ("w13", "w2", "w13_scale", "w2_scale")  # a sparse block's tensors with one row per expert


def replicates_o_proj(quantization: str) -> bool:
    """Whether o_proj is whole on every rank, its input all-gathered (W8A8: see above)."""
    return quantization == "w8a8"


def _rows(t: torch.Tensor, ranges: list[range]) -> torch.Tensor:
    return torch.cat([t[r.start:r.stop] for r in ranges])  # a copy: the full tensor is not kept alive


def _columns(t: torch.Tensor, r: range) -> torch.Tensor:
    return t[:, r.start:r.stop].contiguous().clone()


def shard_state(state: Mapping[str, torch.Tensor], config: ModelConfig, layout: TensorParallelLayout,
                rank: int, quantization: str) -> dict[str, torch.Tensor]:
    """The full model's state dict -> rank `rank`'s part, under the same names."""
    q, kv, inter = config.q_size, config.kv_size, config.intermediate_size
    q_rows, kv_rows, cols = layout.q_rows(rank), layout.kv_rows(rank), layout.intermediate[rank]
    k_rows, v_rows = (range(offset + kv_rows.start, offset + kv_rows.stop) for offset in (q, q + kv))
    qkv_rows = [q_rows, k_rows, v_rows]
    shards = {}
    for name, t in state.items():
        module, _, kind = name.rpartition(".")
        if module in ("embed_tokens", "lm_head"):  # weight [V, H], scale [V]
            shards[name] = _rows(t, [layout.vocab[rank]])
        elif module.endswith("mlp") and kind in EXPERT_STACKS:  # [E, ...]: the rank's experts
            shards[name] = _rows(t, [layout.experts[rank]])
        elif module.endswith("self_attn.qkv_proj"):  # weight [q + 2 kv, H], bias and scale [q + 2 kv]
            shards[name] = _rows(t, qkv_rows)
        elif module.endswith("self_attn.o_proj") and (replicates_o_proj(quantization) or layout.by_sequences):
            shards[name] = t  # whole, bias included, on every rank
        elif module.endswith("mlp.gate_up_proj"):  # weight [2 I, H], scale [2 I]
            shards[name] = _rows(t, [cols, range(inter + cols.start, inter + cols.stop)])
        elif module.endswith(ROW_PARALLEL) and kind == "weight":  # [H, in]: the rank's input columns
            shards[name] = _columns(t, q_rows if module.endswith("o_proj") else cols)
        elif module.endswith(ROW_PARALLEL) and kind == "bias" and quantization == "w8a8":
            shards[name] = t  # added by every rank after the exact integer sum (parallel/row_parallel_w8a8.py)
        elif module.endswith(ROW_PARALLEL) and kind == "bias":  # added once, by the sum
            shards[name] = t.clone() if rank == 0 else torch.zeros_like(t)
        else:  # norms and per-output-row scales of row-parallel layers: replicated
            shards[name] = t
    return shards


def _assign(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = module.get_submodule(owner_name)
    if isinstance(getattr(owner, attr), nn.Parameter):
        setattr(owner, attr, nn.Parameter(tensor, requires_grad=False))
    else:
        setattr(owner, attr, tensor)


def build_rank_module(config: ModelConfig, block_size: int, ops: Ops, quantization: str,
                      state: Mapping[str, torch.Tensor], layout: TensorParallelLayout,
                      collectives: Collectives) -> LlamaForCausalLM:
    """Rank `collectives.rank`'s decoder from its `shard_state` (tensors already on its device): the
    model's own classes, with local head counts and the collectives hooked on."""
    rank = collectives.rank
    with torch.device("meta"):  # nothing is allocated until the shard's tensors are assigned
        module = LlamaForCausalLM(config, block_size=block_size, ops=ops)
        if quantization in INT8_LINEARS:
            int8_skeleton(module, quantization)
            for layer in module.layers:  # the int8 experts' buffers, to assign the rank's stacks to
                if isinstance(layer.mlp, SparseMoeBlock):
                    block = layer.mlp
                    layer.mlp = Int8SparseMoeBlock(len(layout.experts[rank]), config.hidden_size,
                                                   config.moe_intermediate_size, block.top_k, block.renormalize)
        module.embed_tokens = VocabParallelEmbedding(torch.empty(len(layout.vocab[rank]), config.hidden_size),
                                                     layout.vocab[rank], collectives)
    for name, tensor in state.items():
        _assign(module, name, tensor)
    device = module.embed_tokens.weight.device
    if config.tie_word_embeddings and type(module.lm_head) is nn.Linear:
        module.lm_head.weight = module.embed_tokens.weight  # one copy of the shared rows
    module.make_rotary(device)  # a buffer outside the state dict
    missing = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t is not None and t.is_meta]
    if missing:
        raise ValueError(f"rank {rank}'s shard lacks {len(missing)} tensors, e.g. {missing[0]!r}")
    num_kv = len(layout.kv_heads[rank])
    for layer in module.layers:
        attn = layer.self_attn
        attn.num_kv_heads, attn.num_heads = num_kv, num_kv * layout.heads_per_kv
        attn.q_size, attn.kv_size = attn.num_heads * config.head_dim, num_kv * config.head_dim
    for m in module.modules():
        if isinstance(m, (nn.Linear, Int8Weights)):
            m.out_features, m.in_features = m.weight.shape
    pack_all(module)
    for layer in module.layers:
        if isinstance(layer.mlp, (SparseMoeBlock, Int8SparseMoeBlock)):
            layer.mlp.expert_offset = layout.experts[rank].start
            if isinstance(layer.mlp, Int8SparseMoeBlock):
                layer.mlp.pack()
        if isinstance(getattr(layer.mlp, "down_proj", None), W8A8Linear):  # a sparse layer has none
            layer.mlp.down_proj = RowParallelW8A8(layer.mlp.down_proj, collectives)
        if layout.by_sequences:
            layer.self_attn = SequenceSplitAttention(layer.self_attn, collectives)
    hook_collectives(module, layout, collectives, quantization)
    return module.eval().requires_grad_(False)


def row_parallel_layers(layer: nn.Module, layout: TensorParallelLayout, quantization: str) -> list[nn.Module]:
    """The layer's modules whose output is a partial sum over the ranks: o_proj (unless whole), and the MLP's
    down_proj or, for a sparse layer, the whole mixture of experts (each rank's experts' share)."""
    mlp = layer.mlp if isinstance(layer.mlp, (SparseMoeBlock, Int8SparseMoeBlock)) else layer.mlp.down_proj
    if layout.by_sequences or replicates_o_proj(quantization):
        return [mlp]
    return [layer.self_attn.o_proj, mlp]


def hook_collectives(module: LlamaForCausalLM, layout: TensorParallelLayout, collectives: Collectives,
                     quantization: str) -> None:
    """An all-reduce after each float or int8 row-parallel layer and mixture of experts (W8A8's reduce inside
    RowParallelW8A8),
    an all-gather before W8A8's whole o_proj (heads split; split by sequences, the attention module
    gathers its output rows itself), a gather of the vocabulary shards after the LM head."""

    def all_reduce(_module, _inputs, output: torch.Tensor) -> torch.Tensor:
        return collectives.all_reduce(output)

    head_widths = [len(layout.q_rows(rank)) for rank in range(layout.size)]

    def gather_heads(_module, inputs: tuple[torch.Tensor]) -> tuple[torch.Tensor]:  # [T, local q] -> [T, q]
        (x,) = inputs
        return (collectives.all_gather_columns(x.contiguous(), head_widths),)

    for layer in module.layers:
        if replicates_o_proj(quantization) and not layout.by_sequences:
            layer.self_attn.o_proj.register_forward_pre_hook(gather_heads)
        for row_parallel in row_parallel_layers(layer, layout, quantization):
            if not isinstance(row_parallel, RowParallelW8A8):
                row_parallel.register_forward_hook(all_reduce)

    widths = [len(r) for r in layout.vocab]

    def gather_logits(_module, _inputs, output: torch.Tensor) -> torch.Tensor:  # [B, V / size] -> [B, V]
        if output.shape[0] == 0:  # no row is sampled this step, on any rank: nothing to gather
            return output.new_empty(0, sum(widths))
        return collectives.gather_columns(output.contiguous(), widths)

    module.lm_head.register_forward_hook(gather_logits)
