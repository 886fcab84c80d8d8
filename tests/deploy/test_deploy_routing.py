"""The Ray application's pure parts, without a Ray cluster: prompt prefix keys, the affinity table, the
routing counters, and the application's arguments."""

from __future__ import annotations

import json
import sys

import pytest

from deploy.affinity import AffinityTable, Match
from deploy.prefix_key import BLOCK_CHARS, block_hashes, request_prefix, routing_text
from deploy.routing_stats import RoutingStats

SHARED = "You are a careful assistant who answers in one short sentence. " * 5  # 4 full blocks and more


def test_block_hashes_chain_so_a_shared_hash_means_a_shared_prefix():
    a = block_hashes(SHARED + "What is the capital of France? Answer briefly, please, in English.")
    b = block_hashes(SHARED + "Name three colours of the rainbow and nothing else, thank you kindly.")
    num_shared = len(SHARED) // BLOCK_CHARS
    assert a[:num_shared] == b[:num_shared]
    assert a[num_shared:] and set(a[num_shared:]).isdisjoint(b)  # once they part, no later hash is shared
    # The same block text at another position hashes differently: position is part of the chain.
    block = "x" * BLOCK_CHARS
    assert block_hashes(block * 2)[1] != block_hashes(block)[0]
    assert block_hashes("short") == ()  # no full block: nothing a replica would hold as a block


def test_routing_text_reads_the_prompt_of_each_openai_route():
    completion = json.dumps({"prompt": "Hello world"}).encode()
    assert routing_text("/v1/completions", completion) == "Hello world"
    assert routing_text("/v1/completions", json.dumps({"prompt": ["first", "second"]}).encode()) == "first"
    assert routing_text("/v1/completions", json.dumps({"prompt": [1, 2, 3]}).encode()) == "1,2,3"
    chat = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}
    assert routing_text("/v1/chat/completions", json.dumps(chat).encode()) == "system\x00Be brief.\x00user\x00Hi\x00"
    # Bodies the replica will refuse route anywhere, without an error here.
    for body in (b"{not json", b"[1, 2]", b"\xff\xfe", json.dumps({"prompt": 5}).encode()):
        assert routing_text("/v1/completions", body) is None
    assert routing_text("/v1/embeddings", json.dumps({"input": ["first", "second"]}).encode()) == "first"
    # A Responses request routes as the chat it becomes.
    responses = {"instructions": "Be brief.", "input": [{"role": "user", "content": [{"type": "input_text",
                                                                                       "text": "Hi"}]}]}
    assert routing_text("/v1/responses", json.dumps(responses).encode()) == routing_text(
        "/v1/chat/completions", json.dumps(chat).encode())
    # Every document's prompt starts with the instruction and the query.
    rerank = {"query": "capital of France?", "documents": ["Paris.", "Rome."]}
    assert routing_text("/v1/rerank", json.dumps(rerank).encode()) == "capital of France?"
    instructed = json.dumps({**rerank, "instruction": "Find"}).encode()
    assert routing_text("/rerank", instructed) == "Find\x00capital of France?"
    scored = json.dumps({"text_1": ["capital of France?", "other"], "text_2": ["Paris.", "Rome."]}).encode()
    assert routing_text("/v1/score", scored) == "capital of France?"
    assert routing_text("/v1/models", completion) is None
    assert request_prefix("/v1/completions", json.dumps({"prompt": SHARED}).encode()) == block_hashes(SHARED)


def test_the_affinity_table_finds_the_live_replicas_with_the_longest_match():
    table = AffinityTable()
    num_shared = len(SHARED) // BLOCK_CHARS
    long_prompt, other = block_hashes(SHARED + "a" * 200), block_hashes(SHARED + "b" * 200)
    table.record(long_prompt[:2], "r1")
    table.record(long_prompt, "r2")
    assert table.lookup(long_prompt, {"r1", "r2"}) == Match(("r2",), len(long_prompt))
    assert table.lookup(other, {"r1", "r2"}) == Match(("r2",), num_shared)  # r1 holds only 2 of the shared blocks
    assert table.lookup(other[:2], {"r1", "r2"}) == Match(("r1", "r2"), 2)  # both hold those
    assert table.lookup(long_prompt, {"r1"}) == Match(("r1",), 2)  # r2's entries mean nothing once r2 is gone
    assert table.num_blocks("r2") == len(long_prompt) and table.num_blocks("r1") == 2
    table.record(long_prompt, "r2")  # served again: nothing new to hold
    assert len(table) == len(long_prompt) + 2
    table.forget("r2")
    assert len(table) == 2 and table.lookup(long_prompt, {"r1", "r2"}) == Match(("r1",), 2)
    assert table.lookup(block_hashes("z" * 300), {"r1"}) == Match((), 0)


def test_the_affinity_table_evicts_least_recently_used_blocks():
    table = AffinityTable(capacity=4)
    first, second = block_hashes("a" * 4 * BLOCK_CHARS), block_hashes("b" * 2 * BLOCK_CHARS)
    table.record(first, "r1")
    table.record(first[:1], "r1")  # touched again: the most recently used
    table.record(second, "r2")
    assert len(table) == 4 and table.num_blocks("r1") + table.num_blocks("r2") == 4
    assert table.lookup(first[:3], {"r1"}) == Match(("r1",), 1)  # its blocks 1 and 2 went first
    assert table.lookup(second, {"r2"}) == Match(("r2",), 2)
    with pytest.raises(ValueError, match="capacity"):
        AffinityTable(0)


def test_routing_stats_count_first_sightings_as_misses():
    stats = RoutingStats()
    stats.observe("r1", (), has_prefix=True)  # a new prefix
    stats.observe("r1", ("r1", "r2"), has_prefix=True)  # a replica holding it: a hit
    stats.observe("r2", ("r1",), has_prefix=True)  # its only holder was busy
    stats.observe("r2", (), has_prefix=False)  # /ready and the like: no prompt
    assert (stats.num_requests, stats.num_matches, stats.num_hits, stats.num_balanced) == (3, 2, 1, 1)
    assert stats.hit_ratio == pytest.approx(1 / 3)
    text = stats.render()
    assert "ladder_router_prefix_hits_total 1\n" in text and "ladder_router_requests_total 3\n" in text
    assert 'ladder_router_replica_requests_total{replica="r2"} 2' in text


def test_serve_ray_without_ray_says_so_in_one_line(monkeypatch, capsys):
    from ladder.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError, as when it is absent
    assert main(["serve", "--ray", "--replicas", "2"]) == 1
    assert capsys.readouterr().err.strip() == ("ladder serve: error: ladder serve --ray needs Ray Serve "
                                               "(ray is missing): pip install 'ladder[ray]'")


def test_serve_ray_refuses_a_missing_model_in_one_line_before_starting_ray(tmp_path, capsys):
    pytest.importorskip("ray", reason="the ray extra is not installed")
    from ladder.cli import main

    missing = tmp_path / "no-model"
    assert main(["serve", "--ray", "--replicas", "2", "--model", str(missing)]) == 1
    assert capsys.readouterr().err.strip() == f"ladder serve: error: {missing}: no such file or directory"
