"""The router's picture of its engines: the ranks of every tier and how a committed
routing sets them. No I/O: :mod:`.proxy` and :mod:`.routing` drive it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
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
    """

    spec: InstanceSpec
    engine: str
    planned: list[float]
    version: int = 0
    plan_id: str = ""


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
    """

    instances: dict[str, InstanceState] = field(default_factory=dict)
    tiers: dict[str, list[RankState]] = field(default_factory=dict)

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
        planned = rank_weights(routing)
        changed = []
        for inst in self.instances.values():
            if inst.spec.deployment != routing.deployment:
                continue
            if inst.version == routing.version and inst.planned == planned:
                continue
            inst.planned = planned
            inst.version = routing.version
            inst.plan_id = routing.plan_id
            if not inst.spec.engine and routing.engine:
                inst.engine = routing.engine
            changed.append(inst.spec.name)
        for tier in {self.instances[n].spec.tier for n in changed}:
            self._rebuild(tier)
        return changed

    def _rebuild(self, tier: str) -> None:
        """Recompute the tier's ranks, keeping the objects (and open counts) of ranks that
        remain; routed counters restart so achieved shares measure the new weights."""
        old = {(r.instance, r.rank): r for r in self.tiers.get(tier, [])}
        ranks: list[RankState] = []
        for inst in self.instances.values():
            if inst.spec.tier != tier:
                continue
            share = inst.spec.share if inst.spec.share is not None else len(inst.planned)
            for rank, (w, p) in enumerate(
                zip(effective_weights(inst.planned, share), inst.planned, strict=True)
            ):
                r = old.get((inst.spec.name, rank)) or RankState(inst.spec.name, rank, tier, w)
                r.weight, r.planned_weight = w, p
                r.routed_tokens, r.routed_requests = 0.0, 0
                ranks.append(r)
        self.tiers[tier] = ranks

    def tier_ranks(self) -> Iterator[tuple[str, Sequence[RankState]]]:
        """(tier, ranks) pairs, for the metrics."""
        yield from self.tiers.items()

    def status(self, healthy: set[str], connected: dict[str, bool]) -> dict[str, Any]:
        """The JSON document of ``GET /router/status``."""
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
        return {
            "instances": [
                {
                    "name": i.spec.name,
                    "url": i.spec.url,
                    "tier": i.spec.tier,
                    "deployment": i.spec.deployment,
                    "engine": i.engine,
                    "healthy": i.spec.name in healthy,
                    "ranks": len(i.planned),
                    "version": i.version,
                    "plan_id": i.plan_id,
                }
                for i in self.instances.values()
            ],
            "controller_connected": connected,
            "tiers": tiers,
        }
