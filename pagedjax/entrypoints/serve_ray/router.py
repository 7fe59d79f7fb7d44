"""Ray Serve request router for engine replicas: prefix-aware with a load fallback, or random.

A request's kwargs carry ``prefix`` (prefix_key.block_hashes of its prompt) and ``routing``
("prefix" or "random"). The router remembers which replica last served each block hash; a
request goes to the candidate holding its longest remembered prefix unless that replica's load
exceeds the least loaded one's by more than ``imbalance`` requests, in which case (and when no
prefix matches) it goes to the least loaded: among equals, the one its prefix ranks first by
rendezvous hashing, so that new prefixes spread over the replicas. Load = requests this router
has in flight on the replica + the engine's waiting and running requests (its routing stats),
KV usage breaking ties.
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

MAX_REMEMBERED_BLOCKS = 100_000


def _rank(hashes: list[str], replica: RunningReplica) -> bytes:
    seed = (hashes[0] if hashes else "") + replica.replica_id.unique_id
    return hashlib.blake2b(seed.encode(), digest_size=8).digest()


class PrefixAwareRouter(RequestRouter):
    def initialize_state(self, imbalance: int = 8, **kwargs):
        self.imbalance = imbalance
        self._owner: OrderedDict[str, ReplicaID] = OrderedDict()  # block hash -> replica
        self._in_flight: dict[ReplicaID, int] = {}

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        kwargs = pending_request.kwargs if pending_request is not None else {}
        if kwargs.get("routing", "prefix") == "random":
            return [[random.choice(candidate_replicas)]]
        hashes = kwargs.get("prefix") or []
        # equal loads: rendezvous hashing on the prefix spreads new prefixes over the replicas
        by_load = sorted(candidate_replicas, key=lambda r: (self._load(r), _rank(hashes, r)))
        holder = self._prefix_holder(hashes, candidate_replicas)
        if holder is not None and self._load(holder)[0] <= self._load(by_load[0])[0] + (
            self.imbalance
        ):
            return [[holder], [r for r in by_load if r is not holder]]
        return [[by_load[0]], by_load[1:]] if len(by_load) > 1 else [by_load]

    def _prefix_holder(self, hashes, candidates) -> RunningReplica | None:
        """The candidate that served the longest prefix of ``hashes``, if any."""
        ids = {r.replica_id: r for r in candidates}
        for h in reversed(hashes):
            owner = self._owner.get(h)
            if owner in ids:
                return ids[owner]
        return None

    def _load(self, replica: RunningReplica) -> tuple[int, float]:
        stats = replica.routing_stats or {}
        queued = int(stats.get("waiting", 0)) + int(stats.get("running", 0))
        mine = self._in_flight.get(replica.replica_id, 0)
        return max(queued, mine), float(stats.get("kv_usage", 0.0))

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        self._in_flight[replica_id] = self._in_flight.get(replica_id, 0) + 1
        for h in pending_request.kwargs.get("prefix") or []:
            self._owner[h] = replica_id
            self._owner.move_to_end(h)
        while len(self._owner) > MAX_REMEMBERED_BLOCKS:
            self._owner.popitem(last=False)

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        if self._in_flight.get(replica_id, 0) > 0:
            self._in_flight[replica_id] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID):
        super().on_replica_actor_died(replica_id)
        # its prefix cache died with it
        for h in [h for h, owner in self._owner.items() if owner == replica_id]:
            del self._owner[h]
        self._in_flight.pop(replica_id, None)
