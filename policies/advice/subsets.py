"""Solving node subsets of a fleet for :func:`policies.advice.cost.min_cost`.

Owns :class:`SubsetEvaluator`: a subset (whole nodes, given as counts per node group) runs
either as one expert-parallel deployment (``group`` layout) or as one model copy per node
(``replicas`` layout, no all-to-all over the network); the evaluator solves either,
caching the per-node replica solves by node group, and :meth:`SubsetEvaluator.best` keeps
the faster. :class:`SubsetThroughput` is what one evaluation predicts.

Units: tokens per second. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from policies.deployment import Deployment, Outcome, sub_fleet, try_solve
from policies.request import PlacementResult


@dataclass(frozen=True)
class SubsetThroughput:
    """Throughput of a subset in one layout.

    Attributes:
        tokens_per_s: predicted throughput of all its plans together (0 when none).
        results: its plans (empty when screening without plans, or on failure).
        layout: ``group`` or ``replicas``.
        reason: why it has no plan; empty when it has.
    """

    tokens_per_s: float
    results: tuple[PlacementResult, ...]
    layout: str
    reason: str


def subset_nodes(groups: Sequence[tuple[str, ...]], counts: Sequence[int]) -> tuple[str, ...]:
    """The first ``counts[t]`` nodes of each node group ``groups[t]``, in group order."""
    return tuple(n for g, k in zip(groups, counts, strict=True) for n in g[:k])


class SubsetEvaluator:
    """Solves subsets in either layout, caching per-node replica solves by node group."""

    def __init__(
        self, dep: Deployment, tokens_per_gpu: int, groups: Sequence[tuple[str, ...]], layout: str
    ) -> None:
        self.dep = dep
        self.tokens = tokens_per_gpu
        self.groups = groups
        self.layout = layout
        self.replica_tps: dict[tuple[int, str], Outcome] = {}

    def group(self, names: Sequence[str], policy: str) -> SubsetThroughput:
        """The subset ``names`` as one expert-parallel deployment solved by ``policy``."""
        fleet = self.dep.fleet
        part = sub_fleet(fleet, names, name=f"{fleet.name}-subset")
        out = try_solve(self.dep.request(self.tokens, fleet=part, policy=policy))
        if out.ok and out.result is not None:
            return SubsetThroughput(
                out.result.plan.summary.tokens_per_s, (out.result,), "group", ""
            )
        return SubsetThroughput(0.0, (), "group", out.reason)

    def _replica(self, node: str, policy: str) -> Outcome:
        part = sub_fleet(self.dep.fleet, [node], name=f"{self.dep.fleet.name}-{node}")
        return try_solve(self.dep.request(self.tokens, fleet=part, policy=policy))

    def replicas(self, counts: Sequence[int], policy: str, *, plans: bool) -> SubsetThroughput:
        """One replica per node; with ``plans`` every node is solved (its own GPU ids),
        else one node per group stands for the others."""
        fleet = self.dep.fleet
        if any(
            fleet.node(n).nvlink is not None and self._shared_domain(n)
            for g in self.groups
            for n in g
        ):
            return SubsetThroughput(0.0, (), "replicas", "a multi-node NVLink domain")
        tps = 0.0
        results: list[PlacementResult] = []
        for gi, (grp, k) in enumerate(zip(self.groups, counts, strict=True)):
            if k == 0:
                continue
            key = (gi, policy)
            if key not in self.replica_tps:
                self.replica_tps[key] = self._replica(grp[0], policy)
            out = self.replica_tps[key]
            if not out.ok or out.result is None:
                return SubsetThroughput(0.0, (), "replicas", f"{grp[0]} alone: {out.reason}")
            tps += k * out.result.plan.summary.tokens_per_s
            if plans:
                results.append(out.result)
                for node in grp[1:k]:
                    more = self._replica(node, policy)
                    if more.result is None or not more.ok:
                        return SubsetThroughput(0.0, (), "replicas", f"{node} alone: {more.reason}")
                    results.append(more.result)
        return SubsetThroughput(tps, tuple(results), "replicas", "")

    def _shared_domain(self, node: str) -> bool:
        fleet = self.dep.fleet
        nv = fleet.node(node).nvlink
        return (
            nv is not None
            and sum(1 for n in fleet.nodes if n.nvlink and n.nvlink.domain == nv.domain) > 1
        )

    def best(
        self, names: Sequence[str], counts: Sequence[int], policy: str, *, plans: bool
    ) -> SubsetThroughput:
        """The faster of the layouts ``layout`` allows (``best``: both); when neither
        produces a plan, the first one with every reason."""
        options: list[SubsetThroughput] = []
        if self.layout in ("best", "group"):
            options.append(self.group(names, policy))
        if self.layout in ("best", "replicas"):
            options.append(self.replicas(counts, policy, plans=plans))
        ok = [o for o in options if o.tokens_per_s > 0]
        if not ok:
            return SubsetThroughput(
                0.0, (), options[0].layout, "; ".join(o.reason for o in options)
            )
        return max(ok, key=lambda o: o.tokens_per_s)
