"""The prefix router's choices, called as Serve calls it but without a cluster: a burst of requests is
chosen for before any of them is sent, and must still spread over the replicas."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'ladder[ray]')")
from deploy.forwarding import ForwardedRequest
from deploy.prefix_key import block_hashes
from deploy.prefix_router import PrefixAffinityRouter
from deploy.routing_stats import RoutingStats

REPLICAS = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=name)) for name in ("a", "b")]
BY_NAME = {r.replica_id.unique_id: r for r in REPLICAS}


def make_router(threshold: int) -> PrefixAffinityRouter:
    # Serve's constructor wants a live deployment; the routing state is all initialize_state's.
    router = object.__new__(PrefixAffinityRouter)
    router.initialize_state(imbalance_threshold=threshold)
    router.stats = RoutingStats()
    return router


def pending(request_id: str, prompt: str) -> SimpleNamespace:
    forwarded = ForwardedRequest("POST", "/v1/completions", b"", (), b"", block_hashes(prompt))
    return SimpleNamespace(args=[forwarded], metadata=SimpleNamespace(internal_request_id=request_id))


def prompt(i: int) -> str:
    return f"request {i:03d} " * 20  # 280 characters: 4 full blocks, its own from the first


def choose(router: PrefixAffinityRouter, request) -> str:
    ranks = asyncio.run(router.choose_replicas(REPLICAS, request))
    assert [len(rank) for rank in ranks] == [1, 1]  # the choice first, the other replica as the fallback
    return ranks[0][0].replica_id.unique_id


def test_a_burst_of_new_prefixes_spreads_evenly_before_any_is_sent():
    router = make_router(threshold=2)
    requests = [pending(f"r{i}", prompt(i)) for i in range(32)]
    chosen = [choose(router, r) for r in requests]  # Serve chooses for the whole burst first
    assert chosen.count("a") == chosen.count("b") == 16
    for request, name in zip(requests, chosen):
        router.on_request_routed(request, BY_NAME[name].replica_id, None)
    assert router.in_flight == {"a": 16, "b": 16} and not router.chosen and not router.choices
    assert router.stats.per_replica == {"a": 16, "b": 16}


@pytest.mark.parametrize("threshold", [0, 2, 8])
def test_a_burst_of_prefixes_one_replica_holds_spills_past_the_threshold(threshold):
    router = make_router(threshold)
    for i in range(32):  # replica a served all of them before
        router.table.record(block_hashes(prompt(i)), "a")
    chosen = [choose(router, pending(f"r{i}", prompt(i))) for i in range(32)]
    # The holder keeps its prefixes while it is at most `threshold` requests busier than the other.
    assert 0 <= chosen.count("a") - chosen.count("b") <= threshold + 1
    assert chosen[:threshold + 1] == ["a"] * (threshold + 1)


def test_a_request_asked_for_again_counts_once_and_routed_elsewhere_counts_there():
    router = make_router(threshold=2)
    request = pending("r0", prompt(0))
    assert choose(router, request) == "a"
    assert choose(router, request) == "a"  # Serve could not send it and asks again
    assert router.load("a") == 1 and router.load("b") == 0
    router.on_request_routed(request, BY_NAME["b"].replica_id, None)  # a had no room: Serve took rank 2
    assert (router.load("a"), router.load("b")) == (0, 1)
    assert router.table.lookup(block_hashes(prompt(0)), {"a", "b"}).replica_ids == ("a", "b")
    router.on_request_completed(BY_NAME["b"].replica_id, "r0")
    assert (router.load("a"), router.load("b")) == (0, 0)
    assert router.stats.in_flight == {"b": 0}
