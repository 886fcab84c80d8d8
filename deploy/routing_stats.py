"""Counts of routing decisions, rendered as Prometheus text by the ingress's /metrics.

The router runs inside the ingress process (Ray Serve builds it for the ingress's handle to the
replicas), so one module-level instance is shared by the router that writes it and the route that
reads it; each ingress replica counts its own decisions.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class RoutingStats:
    num_requests: int = 0  # routed requests that carried a prompt
    num_matches: int = 0  # of those, ones whose leading blocks a live replica had served
    num_hits: int = 0  # of those, ones routed to such a replica
    num_balanced: int = 0  # matches sent elsewhere because those replicas were too busy
    num_replica_deaths: int = 0
    per_replica: dict[str, int] = field(default_factory=dict)
    in_flight: dict[str, int] = field(default_factory=dict)  # the router's load view: sent, not completed
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def observe(self, replica_id: str, holders: tuple[str, ...], has_prefix: bool) -> None:
        """One routed request: `holders` are the live replicas that held its prefix when it was routed."""
        with self.lock:
            self.per_replica[replica_id] = self.per_replica.get(replica_id, 0) + 1
            if not has_prefix:
                return
            self.num_requests += 1
            if holders:
                self.num_matches += 1
                if replica_id in holders:
                    self.num_hits += 1
                else:
                    self.num_balanced += 1

    def set_in_flight(self, replica_id: str, count: int | None) -> None:
        """The router's count of `replica_id`'s requests sent and not completed; None: the replica is gone."""
        with self.lock:
            if count is None:
                self.in_flight.pop(replica_id, None)
            else:
                self.in_flight[replica_id] = count

    def replica_died(self) -> None:
        with self.lock:
            self.num_replica_deaths += 1

    @property
    def hit_ratio(self) -> float:
        """Requests routed to the replica holding their prefix, of all requests with a prompt: first
        sightings of a prefix count as misses."""
        return self.num_hits / self.num_requests if self.num_requests else 0.0

    def render(self) -> str:
        with self.lock:
            lines = []
            for name, doc, value in (
                ("ladder_router_requests", "Routed requests that carried a prompt", self.num_requests),
                ("ladder_router_prefix_matches", "Requests whose prompt prefix a live replica had served",
                 self.num_matches),
                ("ladder_router_prefix_hits", "Requests routed to a replica holding their prefix", self.num_hits),
                ("ladder_router_prefix_balanced", "Prefix matches sent elsewhere because their replicas were busy",
                 self.num_balanced),
                ("ladder_router_replica_deaths", "Replicas seen dying by the router", self.num_replica_deaths),
            ):
                lines += [f"# HELP {name}_total {doc}", f"# TYPE {name}_total counter", f"{name}_total {value}"]
            lines += ["# HELP ladder_router_prefix_hit_ratio Prefix hits over routed requests with a prompt",
                      "# TYPE ladder_router_prefix_hit_ratio gauge", f"ladder_router_prefix_hit_ratio {self.hit_ratio}",
                      "# HELP ladder_router_replica_requests_total Requests routed to each replica",
                      "# TYPE ladder_router_replica_requests_total counter"]
            lines += [f'ladder_router_replica_requests_total{{replica="{replica}"}} {count}'
                      for replica, count in sorted(self.per_replica.items())]
            lines += [("# HELP ladder_router_replica_in_flight Requests the router sent to each replica and saw "
                       "no completion of: the load it balances on"),
                      "# TYPE ladder_router_replica_in_flight gauge"]
            lines += [f'ladder_router_replica_in_flight{{replica="{replica}"}} {count}'
                      for replica, count in sorted(self.in_flight.items())]
            return "\n".join(lines) + "\n"


STATS = RoutingStats()
