"""KV block bookkeeping without a model: balance, reference counts, prefix hits, LRU eviction."""

from __future__ import annotations

from engine.block_manager import KVBlockManager
from engine.request import Request
from engine.sampling_params import SamplingParams


def request(tokens: list[int], rid: str = "r") -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4))


def admit(blocks: KVBlockManager, req: Request) -> int:
    prefix = blocks.cached_prefix(req, req.kv_pool)
    blocks.count_lookup(req, prefix)
    assert blocks.allocate(req, req.num_tokens - prefix.num_tokens, prefix)
    req.num_computed_tokens = req.num_tokens
    blocks.register_computed_blocks(req)
    return prefix.num_tokens


def test_allocation_and_release_balance():
    blocks = KVBlockManager(num_blocks=10, block_size=4)
    reqs = [request(list(range(i, i + 7)), str(i)) for i in range(3)]
    for r in reqs:
        assert blocks.allocate(r, 7)
        assert len(r.block_ids) == 2
    assert blocks.num_free_blocks == 4
    assert not blocks.allocate(request(list(range(100, 120))), 20)  # 5 blocks > 4 free: nothing changes
    assert blocks.num_free_blocks == 4
    for r in reqs:
        blocks.release(r)
    assert blocks.num_free_blocks == 10 and all(c == 0 for c in blocks.ref_counts)


def test_prefix_hit_shares_blocks_and_counts_references():
    blocks = KVBlockManager(num_blocks=10, block_size=4)
    a = request([1, 2, 3, 4, 5, 6, 7, 8, 9], "a")
    assert admit(blocks, a) == 0
    b = request([1, 2, 3, 4, 5, 6, 7, 8, 42, 43], "b")
    assert admit(blocks, b) == 8
    assert b.block_ids[:2] == a.block_ids[:2]
    assert [blocks.ref_counts[x] for x in a.block_ids[:2]] == [2, 2]
    assert blocks.prefix_hits == 8 and blocks.prefix_queries == 9 + 10
    blocks.release(a)
    assert [blocks.ref_counts[x] for x in b.block_ids[:2]] == [1, 1]
    blocks.release(b)
    assert blocks.num_free_blocks == 10


def test_differing_first_block_means_no_hit():
    """The chained hash makes a block's key depend on everything before it."""
    blocks = KVBlockManager(num_blocks=10, block_size=4)
    admit(blocks, request([1, 2, 3, 4, 5, 6, 7, 8, 9], "a"))
    assert admit(blocks, request([0, 2, 3, 4, 5, 6, 7, 8, 9], "b")) == 0


def test_full_prompt_hit_leaves_one_token_to_compute():
    blocks = KVBlockManager(num_blocks=10, block_size=4)
    admit(blocks, request(list(range(8)), "a"))
    b = request(list(range(8)), "b")
    prefix = blocks.cached_prefix(b)
    assert prefix.num_tokens == 4  # not 8: the last token's logits are needed


def test_freed_cached_blocks_are_reused_then_evicted_lru():
    blocks = KVBlockManager(num_blocks=4, block_size=2)
    a = request([1, 2, 3, 4, 5], "a")  # blocks: [1,2] [3,4] [5]
    admit(blocks, a)
    blocks.release(a)  # all free, two of them still cached
    assert len(blocks.cached[0]) == 2
    again = request([1, 2, 3, 4, 9], "again")
    assert admit(blocks, again) == 4  # found while free
    blocks.release(again)
    # A new unrelated request needing every block evicts the cached ones.
    c = request([7, 7, 7, 7, 7, 7, 7], "c")
    assert admit(blocks, c) == 0
    assert len(c.block_ids) == 4
    assert all(blocks.cached[0].get(h) in c.block_ids for h in blocks.cached[0])  # only c's own blocks remain
    assert blocks.cached_prefix(request([1, 2, 3, 4, 5], "d")).num_tokens == 0


def test_lru_order_evicts_tail_blocks_first():
    """Released blocks go to the free list tail first, so a prefix outlives the blocks after it."""
    blocks = KVBlockManager(num_blocks=4, block_size=2)
    a = request([1, 2, 3, 4, 5, 6, 7], "a")  # 4 blocks, 3 full and cached
    admit(blocks, a)
    blocks.release(a)
    b = request([9, 9, 9], "b")  # needs 2 blocks: takes the least recently freed: a's last two
    admit(blocks, b)
    assert blocks.cached_prefix(request([1, 2, 3, 4, 0], "c")).num_tokens == 4


def test_disabled_prefix_cache_never_hits():
    blocks = KVBlockManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    admit(blocks, request(list(range(9)), "a"))
    assert admit(blocks, request(list(range(9)), "b")) == 0


def test_pools_keep_their_blocks_and_their_prefixes_apart():
    blocks = KVBlockManager(num_blocks=8, block_size=4, num_pools=2)
    first = request(list(range(9)), "first")
    first.kv_pool = 1
    assert admit(blocks, first) == 0
    assert all(4 <= b < 8 for b in first.block_ids)  # pool 1 is blocks 4..7
    again = request(list(range(9)), "again")  # pool 0 has never computed the prefix
    assert blocks.cached_prefix(again, 0).num_tokens == 0
    assert blocks.cached_prefix(again, 1).num_tokens == 8
    assert admit(blocks, again) == 0 and all(b < 4 for b in again.block_ids)
    late = request(list(range(20)), "late")  # 5 blocks: more than a pool holds, though 5 are free in all
    late.kv_pool = 1
    assert not blocks.allocate(late, 20) and late.block_ids == []
    blocks.release(first)
    blocks.release(again)
    assert blocks.num_free_blocks == 8 and blocks.usage == 0.0
