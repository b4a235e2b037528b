"""The router's picture of its engines: the ranks of every tier and how a committed
routing sets them. No I/O: :mod:`.proxy` and :mod:`.routing` drive it.
"""

from __future__ import annotations

from collections.abc import Container, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from mixfleet.v1 import engine_pb2

from controlplane.router.balance import RankState, effective_weights, shares
from controlplane.router.settings import InstanceSpec


@dataclass
class InstanceState:
    """One engine instance.

    Attributes:
        spec: how it was configured.
        engine: the rank field in use (``sglang`` | ``vllm`` | ``trtllm`` | ``native``).
        planned: the plan's weight of each DP rank (index = the engine's DP rank).
        version: plan version of ``planned`` (0 = static ranks, or none received yet).
        plan_id: the plan's id ("" = static).
        routable: it may take new requests (a controller-listed instance that is not
            ready, draining or no longer listed may not; its open requests finish).
        listed: the controller still lists it (always True for an ``--instance``).
        open_requests: requests open on it, all ranks together.
    """

    spec: InstanceSpec
    engine: str
    planned: list[float]
    version: int = 0
    plan_id: str = ""
    routable: bool = True
    listed: bool = True
    open_requests: int = 0


@dataclass(frozen=True)
class _Weights:
    """The last committed routing of one deployment, as ranks take it."""

    planned: list[float]
    version: int
    plan_id: str
    engine: str


def rank_weights(routing: engine_pb2.Routing) -> list[float]:
    """The plan's weight of each engine DP rank: the mean ``dp_weight`` of the GPUs that
    share the rank (``Routing.dp_ranks``; one rank per GPU when absent)."""
    ranks = list(routing.dp_ranks) or list(range(len(routing.dp_weights)))
    n = max(ranks, default=-1) + 1
    total = [0.0] * n
    count = [0] * n
    for r, w in zip(ranks, routing.dp_weights, strict=False):
        total[r] += w
        count[r] += 1
    return [t / c if c else 0.0 for t, c in zip(total, count, strict=True)]


@dataclass
class RouterState:
    """Instances and the ranks of every tier.

    Attributes:
        instances: by name.
        tiers: tier -> its ranks (all instances of the tier).
        full: names of the instances at their batch limit.
    """

    instances: dict[str, InstanceState] = field(default_factory=dict)
    tiers: dict[str, list[RankState]] = field(default_factory=dict)
    full: set[str] = field(default_factory=set)
    _weights: dict[str, _Weights] = field(default_factory=dict)

    @classmethod
    def from_specs(cls, specs: Sequence[InstanceSpec]) -> RouterState:
        """Static instances get ``ranks`` equal ranks; deployment instances none until their
        first routing arrives."""
        s = cls()
        for spec in specs:
            planned = [] if spec.deployment else list(spec.weights or [1.0] * spec.ranks)
            s.instances[spec.name] = InstanceState(spec, spec.engine or "sglang", planned)
            s.tiers.setdefault(spec.tier, [])
        for tier in s.tiers:
            s._rebuild(tier)
        return s

    def apply_routing(self, routing: engine_pb2.Routing) -> list[str]:
        """Take the weights of a committed routing for the deployment's instances; returns
        the names of the instances it changed."""
        weights = _Weights(rank_weights(routing), routing.version, routing.plan_id, routing.engine)
        self._weights[routing.deployment] = weights
        changed = [
            inst.spec.name
            for inst in self.instances.values()
            if inst.spec.deployment == routing.deployment and _take(inst, weights)
        ]
        for tier in {self.instances[n].spec.tier for n in changed}:
            self._rebuild(tier)
        return changed

    def sync(self, source: str, listed: Sequence[tuple[InstanceSpec, bool]]) -> list[str]:
        """Make the instances of the watched deployment ``source`` those of ``listed``
        ((spec, routable) pairs); returns the names added. One listed under a name that an
        instance of another origin has is left out. Instances of ``source`` no longer
        listed stop taking requests and are removed by :meth:`prune` once idle; the rank
        objects of those that remain are kept (their open counts with them)."""
        added: list[str] = []
        tiers: set[str] = set()
        seen: set[str] = set()
        for spec, routable in listed:
            inst = self.instances.get(spec.name)
            if inst is not None and inst.spec.source != source:
                continue
            seen.add(spec.name)
            if inst is None:
                inst = self.instances[spec.name] = InstanceState(spec, spec.engine or "sglang", [])
                added.append(spec.name)
            elif inst.spec.deployment != spec.deployment:
                inst.planned, inst.version, inst.plan_id = [], 0, ""
            tiers |= {inst.spec.tier, spec.tier}
            inst.spec, inst.routable, inst.listed = spec, routable, True
            inst.engine = spec.engine or inst.engine
            weights = self._weights.get(spec.deployment)
            if weights is not None:
                _take(inst, weights)
        for inst in self.instances.values():
            if inst.spec.source == source and inst.spec.name not in seen and inst.listed:
                inst.listed = inst.routable = False
                tiers.add(inst.spec.tier)
        for tier in tiers:
            self._rebuild(tier)
        self.full = {n for n, i in self.instances.items() if _at_cap(i)}
        return added

    def prune(self) -> list[str]:
        """Remove the instances the controller no longer lists that have no open request;
        returns their names."""
        gone = [n for n, i in self.instances.items() if not i.listed and i.open_requests <= 0]
        tiers = {self.instances[n].spec.tier for n in gone}
        for n in gone:
            del self.instances[n]
            self.full.discard(n)
        for tier in tiers:
            self._rebuild(tier)
        return gone

    def routing_keys(self) -> set[str]:
        """The deployments whose committed routing some instance takes its ranks from."""
        return {i.spec.deployment for i in self.instances.values() if i.spec.deployment}

    def acquire(self, inst: InstanceState) -> None:
        """Count a request as open on ``inst``."""
        inst.open_requests += 1
        if _at_cap(inst):
            self.full.add(inst.spec.name)

    def release(self, inst: InstanceState) -> None:
        """The request on ``inst`` has ended: one slot of it is free (every release frees
        one; :meth:`.fleet.Fleet.finished` wakes one waiting request per release)."""
        inst.open_requests = max(0, inst.open_requests - 1)
        if not _at_cap(inst):
            self.full.discard(inst.spec.name)

    def _rebuild(self, tier: str) -> None:
        """Recompute the tier's ranks, keeping the objects (and open counts) of ranks that
        remain; routed counters restart so achieved shares measure the new weights."""
        old = {(r.instance, r.rank): r for r in self.tiers.get(tier, [])}
        ranks: list[RankState] = []
        for inst in self.instances.values():
            if inst.spec.tier != tier:
                continue
            share = inst.spec.share if inst.spec.share is not None else len(inst.planned)
            scaled = effective_weights(inst.planned, share if inst.routable else 0.0)
            for rank, (w, p) in enumerate(zip(scaled, inst.planned, strict=True)):
                r = old.get((inst.spec.name, rank)) or RankState(inst.spec.name, rank, tier, w)
                r.weight, r.planned_weight = w, p
                r.routed_tokens, r.routed_requests = 0.0, 0
                ranks.append(r)
        self.tiers[tier] = ranks

    def serving(self, healthy: Container[str]) -> set[str]:
        """The instances that take new requests now: healthy, with a rank of weight > 0
        (routable, and its DP ranks known: a watched instance gets them from its own
        ``WatchRouting`` stream, which may come after ``WatchInstances`` lists it)."""
        return {
            r.instance
            for ranks in self.tiers.values()
            for r in ranks
            if r.weight > 0 and r.instance in healthy
        }

    def tier_ranks(self) -> Iterator[tuple[str, Sequence[RankState]]]:
        """(tier, ranks) pairs, for the metrics."""
        yield from self.tiers.items()

    def status(
        self, healthy: set[str], connected: dict[str, bool], waiting: dict[str, int]
    ) -> dict[str, Any]:
        """The JSON document of ``GET /router/status``; ``waiting``: requests waiting for a
        batch slot, per tier (:meth:`.fleet.SlotQueue.waiting_by_tier`)."""
        tiers = {}
        for tier, ranks in self.tiers.items():
            planned, achieved = shares(ranks)
            tiers[tier] = [
                {
                    "instance": r.instance,
                    "rank": r.rank,
                    "planned_weight": r.planned_weight,
                    "planned_share": round(p, 6),
                    "achieved_share": round(a, 6),
                    "open_requests": r.open_requests,
                    "outstanding_tokens": r.outstanding_tokens,
                    "routed_requests": r.routed_requests,
                }
                for r, p, a in zip(ranks, planned, achieved, strict=True)
            ]
        serving = self.serving(healthy)
        return {
            "instances": [
                {
                    "name": i.spec.name,
                    "url": i.spec.url,
                    "tier": i.spec.tier,
                    "deployment": i.spec.deployment,
                    "engine": i.engine,
                    "healthy": i.spec.name in healthy,
                    "serving": i.spec.name in serving,
                    "ranks": len(i.planned),
                    "version": i.version,
                    "plan_id": i.plan_id,
                    "source": i.spec.source,
                    "routable": i.routable,
                    "listed": i.listed,
                    "open_requests": i.open_requests,
                    "batch_limit": i.spec.batch_limit,
                }
                for i in self.instances.values()
            ],
            "controller_connected": connected,
            "tiers": tiers,
            "waiting": waiting,
        }


def _take(inst: InstanceState, weights: _Weights) -> bool:
    """Give ``inst`` the routing's weights; whether anything changed."""
    if inst.version == weights.version and inst.planned == weights.planned:
        return False
    inst.planned, inst.version, inst.plan_id = weights.planned, weights.version, weights.plan_id
    if not inst.spec.engine and weights.engine:
        inst.engine = weights.engine
    return True


def _at_cap(inst: InstanceState) -> bool:
    return 0 < inst.spec.batch_limit <= inst.open_requests
