"""Ray Serve request router for the engine replicas: a replica that served a prompt's prefix, unless it is
much busier than the least loaded one; otherwise the least loaded.

Serve builds one router per handle, inside the process that holds the handle (the ingress), and calls
`choose_replicas` for each request: it returns ranks of candidates, and Serve sends the request to the
candidate with the shortest queue in the first rank that has room.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Any, NamedTuple

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from deploy import routing_stats
from deploy.affinity import AffinityTable

# A replica this many requests busier than the least loaded one loses its prefix's requests: the
# recomputed prefix costs less than the queue. About a quarter of a replica's batch.
DEFAULT_IMBALANCE_THRESHOLD = 8
MAX_PENDING = 4096


class Choice(NamedTuple):
    holders: tuple[str, ...]  # the live replicas holding the request's prefix when it was chosen for
    replica_id: str  # the replica chosen first


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
        # internal request id -> the choice made for it, from choice to routing. Bounded: a request
        # cancelled while it waits for a replica is never routed.
        self.choices: OrderedDict[str, Choice] = OrderedDict()
        self.chosen: Counter[str] = Counter()  # replica id -> requests chosen for it and not yet routed
        self.dead: set[str] = set()

    def load(self, replica_id: str) -> int:
        """Requests sent to the replica and not completed, plus those chosen for it and not sent yet.

        Our own count: the app has one ingress, so this router sends every request and the count is exact.
        Serve's queue-length cache is not (a replica's report of its queue can arrive after the request it
        counted has completed, and then holds for seconds). The chosen-not-sent part matters in a burst:
        Serve asks for a choice for every request of the burst before the first one is sent, and without it
        they would all see the same loads and all go where the first one went.
        """
        return self.in_flight.get(replica_id, 0) + self.chosen[replica_id]

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        hashes = prefix_of(pending_request)
        request_id = pending_request.metadata.internal_request_id if pending_request is not None else None
        self.forget_choice(request_id)  # Serve asks again for a request it could not send
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        holders = self.table.lookup(hashes, set(by_id)).replica_ids if hashes else ()
        loads = {rid: self.load(rid) for rid in by_id}
        least = min(loads.values())
        owner = min(holders, key=lambda rid: loads[rid]) if holders else None
        if owner is None or loads[owner] > least + self.imbalance_threshold:
            # No owner, or even the least loaded one is far busier than the least loaded replica: the least
            # loaded, and of equally loaded ones the one holding the fewest prefixes, so new prefixes spread
            # over the replicas even when traffic is light. A spilled prefix is held there from then on.
            owner = min(by_id, key=lambda rid: (loads[rid], self.table.num_blocks(rid)))
            if hashes:
                # Held from now on, before Serve sends the request: in a burst, the next new prefix then
                # goes to another replica, and the next request of this one finds it here.
                self.table.record(hashes, owner)
        if request_id is not None:
            self.choices[request_id] = Choice(holders, owner)
            self.chosen[owner] += 1
            while len(self.choices) > MAX_PENDING:
                self.forget_choice(next(iter(self.choices)))
        first = by_id[owner]
        return [[first], [r for r in candidate_replicas if r is not first]]

    def forget_choice(self, request_id: str | None) -> Choice | None:
        choice = self.choices.pop(request_id, None) if request_id is not None else None
        if choice is not None:
            self.chosen[choice.replica_id] -= 1
            if self.chosen[choice.replica_id] <= 0:
                del self.chosen[choice.replica_id]
        return choice

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        rid = replica_id.unique_id
        hashes = prefix_of(pending_request)
        choice = self.forget_choice(pending_request.metadata.internal_request_id)
        holders = choice.holders if choice is not None else ()
        self.in_flight[rid] = self.in_flight.get(rid, 0) + 1
        self.stats.set_in_flight(rid, self.in_flight[rid])
        self.stats.observe(rid, holders, bool(hashes))
        if hashes:
            self.table.record(hashes, rid)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        rid = replica_id.unique_id
        if self.in_flight.get(rid, 0) > 0:
            self.in_flight[rid] -= 1
            self.stats.set_in_flight(rid, self.in_flight[rid])

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.table.forget(replica_id.unique_id)
        self.in_flight.pop(replica_id.unique_id, None)
        self.chosen.pop(replica_id.unique_id, None)
        self.stats.set_in_flight(replica_id.unique_id, None)
        if replica_id.unique_id not in self.dead:  # Serve may report one death more than once
            self.dead.add(replica_id.unique_id)
            self.stats.replica_died()
