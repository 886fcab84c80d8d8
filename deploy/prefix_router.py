"""Ray Serve request router for the engine replicas: a replica that served a prompt's prefix, unless it is
much busier than the least loaded one; otherwise the least loaded.

Serve builds one router per handle, inside the process that holds the handle (the ingress), and calls
`choose_replicas` for each request: it returns ranks of candidates, and Serve sends the request to the
candidate with the shortest queue in the first rank that has room.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from deploy import routing_stats
from deploy.affinity import AffinityTable

# A replica this many requests busier than the least loaded one loses its prefix's requests: the
# recomputed prefix costs less than the queue. About a quarter of a replica's batch.
DEFAULT_IMBALANCE_THRESHOLD = 8
MAX_PENDING = 4096


def prefix_of(pending_request: PendingRequest | None) -> tuple[int, ...]:
    if pending_request is None or not pending_request.args:
        return ()
    return getattr(pending_request.args[0], "prefix_hashes", ())


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(self, imbalance_threshold: int = DEFAULT_IMBALANCE_THRESHOLD,
                         table_capacity: int = 1 << 16, **kwargs: Any) -> None:
        if imbalance_threshold < 0:
            raise ValueError(f"imbalance_threshold must be at least 0, got {imbalance_threshold}")
        self.imbalance_threshold = imbalance_threshold
        self.table = AffinityTable(table_capacity)
        # Serve ships this class to the ingress by value (pickled with its module's globals), so the shared
        # counters are looked up there, in the ingress's own copy of deploy.routing_stats.
        self.stats: routing_stats.RoutingStats = routing_stats.STATS
        self.in_flight: dict[str, int] = {}  # replica id -> requests sent and not completed
        # internal request id -> the replicas holding its prefix, from choice to routing; bounded, since a
        # request cancelled while it waits for a replica is never routed
        self.holders: OrderedDict[str, tuple[str, ...]] = OrderedDict()
        self.dead: set[str] = set()

    def load(self, replica: RunningReplica) -> int:
        # Our own count of requests sent and not completed. The app has one ingress, so this router sends
        # every request and the count is exact; Serve's queue-length cache is not: a replica's report of its
        # queue can arrive after the request it counted has completed, and then holds for seconds.
        return self.in_flight.get(replica.replica_id.unique_id, 0)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        hashes = prefix_of(pending_request)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        holders = self.table.lookup(hashes, set(by_id)).replica_ids if hashes else ()
        if pending_request is not None:
            self.holders[pending_request.metadata.internal_request_id] = holders
            while len(self.holders) > MAX_PENDING:
                self.holders.popitem(last=False)
        loads = {rid: self.load(r) for rid, r in by_id.items()}
        least = min(loads.values())
        if holders:
            # The least loaded of the replicas holding the prefix, unless even it is far busier than the
            # least loaded replica: then the prefix spills over to that one, which holds it from then on.
            owner = by_id[min(holders, key=lambda rid: loads[rid])]
            if loads[owner.replica_id.unique_id] <= least + self.imbalance_threshold:
                return [[owner], [r for r in candidate_replicas if r is not owner]]
        # No owner, or a busy one: the least loaded, and of equally loaded ones the one holding the fewest
        # prefixes, so new prefixes spread over the replicas even when traffic is light.
        ranked = sorted(candidate_replicas, key=lambda r: (loads[r.replica_id.unique_id],
                                                           self.table.num_blocks(r.replica_id.unique_id)))
        if hashes:
            # Held from now on, before Serve sends the request: in a burst, the next new prefix then goes to
            # another replica, and the next request of this one finds it here.
            self.table.record(hashes, ranked[0].replica_id.unique_id)
        return [ranked[:1], ranked[1:]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        rid = replica_id.unique_id
        hashes = prefix_of(pending_request)
        holders = self.holders.pop(pending_request.metadata.internal_request_id, ())
        self.in_flight[rid] = self.in_flight.get(rid, 0) + 1
        self.stats.observe(rid, holders, bool(hashes))
        if hashes:
            self.table.record(hashes, rid)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        rid = replica_id.unique_id
        if self.in_flight.get(rid, 0) > 0:
            self.in_flight[rid] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.table.forget(replica_id.unique_id)
        self.in_flight.pop(replica_id.unique_id, None)
        if replica_id.unique_id not in self.dead:  # Serve may report one death more than once
            self.dead.add(replica_id.unique_id)
            self.stats.replica_died()
