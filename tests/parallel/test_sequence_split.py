"""Attention split by sequences without worker processes: the layout, and how each rank finds its own
sequences, rows and block ids in a step's broadcast metadata (parallel/sequence_split.py)."""

from __future__ import annotations

import pytest
import torch

from model.attention import TorchPagedAttention
from model.attention_metadata import AttentionMetadata
from model.config import ModelConfig
from parallel.layout import TensorParallelLayout
from parallel.sequence_split import local_metadata, plan_sequences

CONFIG = ModelConfig(architecture="llama", vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                     max_position_embeddings=256, tie_word_embeddings=True)
BLOCK = 4
POOL = 8  # blocks per rank: rank 0 holds blocks 0..7, rank 1 blocks 8..15


def test_split_by_sequences_keeps_every_head_and_takes_more_ranks_than_kv_heads():
    layout = TensorParallelLayout.for_model(CONFIG, 3, "sequences")
    assert layout.by_sequences and layout.kv_pools == 3
    assert all(len(heads) == 2 for heads in layout.kv_heads)  # every head on every rank
    assert [len(columns) for columns in layout.intermediate] == [42, 43, 43]  # the MLP is still split
    assert layout.blocks_per_rank(30) == 10
    with pytest.raises(ValueError, match="exceeds the model's 2 KV heads"):
        TensorParallelLayout.for_model(CONFIG, 3, "heads")
    with pytest.raises(ValueError, match="not 'rows'"):
        TensorParallelLayout.for_model(CONFIG, 2, "rows")
    heads = TensorParallelLayout.for_model(CONFIG, 2)
    assert heads.kv_pools == 1 and heads.blocks_per_rank(30) == 30


def interleaved_step() -> AttentionMetadata:
    """Four sequences alternating pools: a 3-token prefill chunk on rank 0, decodes after it."""
    tables = [[0, 1], [8], [2], [9, 10]]
    return AttentionMetadata.build(query_lens=[3, 1, 1, 1], seq_lens=[7, 2, 4, 5], block_tables=tables,
                                   block_size=BLOCK)


def test_each_rank_finds_its_sequences_rows_and_own_block_ids():
    meta = interleaved_step()
    local, token_owner, counts = local_metadata(meta, 1, 2, POOL, BLOCK)
    assert token_owner.tolist() == [0, 0, 0, 1, 0, 1] and counts == [4, 2]
    assert local.query_start_loc.tolist() == [0, 1, 2] and local.seq_lens.tolist() == [2, 5]
    assert local.block_tables.tolist() == [[0, 0], [1, 2]]  # ids within rank 1's pool; padding kept inside it
    # New tokens' slots: sequence 1's token 1 in block 8 -> local block 0; sequence 3's token 4 in block 10.
    assert local.slot_mapping.tolist() == [0 * BLOCK + 1, 2 * BLOCK + 0]
    assert (local.max_query_len, local.max_seq_len) == (1, 5)
    plan = plan_sequences(TorchPagedAttention(BLOCK), meta, 1, 2, POOL, BLOCK)
    assert plan.rows.tolist() == [3, 5] and plan.counts == [4, 2]
    # The ranks' rows, concatenated rank by rank, put back in the batch's order.
    concatenated = torch.tensor([0, 1, 2, 4, 3, 5])  # batch rows of rank 0, then of rank 1
    assert concatenated[plan.order].tolist() == list(range(6))


def test_a_rank_major_batch_is_sliced_and_a_rank_without_sequences_runs_none():
    meta = AttentionMetadata.build(query_lens=[1, 1, 2], seq_lens=[3, 4, 6], block_tables=[[0], [1], [8, 9]],
                                   block_size=BLOCK)
    first = plan_sequences(TorchPagedAttention(BLOCK), meta, 0, 2, POOL, BLOCK)
    second = plan_sequences(TorchPagedAttention(BLOCK), meta, 1, 2, POOL, BLOCK)
    assert first.rows == slice(0, 2) and second.rows == slice(2, 4) and first.order is None
    only_rank_0 = AttentionMetadata.build(query_lens=[2], seq_lens=[2], block_tables=[[3]], block_size=BLOCK)
    idle = plan_sequences(TorchPagedAttention(BLOCK), only_rank_0, 1, 2, POOL, BLOCK)
    assert idle.local is None and idle.counts == [2, 0] and idle.rows == slice(2, 2)


def test_auto_splits_by_sequences_on_a_cpu_and_the_engine_default_stays_heads():
    from engine.config import EngineConfig

    assert EngineConfig(device="cpu", tensor_parallel_attention="auto").tensor_parallel_attention == "sequences"
    assert EngineConfig(device="cpu").tensor_parallel_attention == "heads"
    with pytest.raises(ValueError, match="heads, sequences or auto, not 'rows'"):
        EngineConfig(tensor_parallel_attention="rows")
