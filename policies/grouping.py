"""Topology-aware grouping: one expert-parallel group across fabric segments, or one per
segment?

When a fleet spans fabric segments joined by a link slower than the segments themselves,
every expert-parallel all-to-all that spans them pays for the link. The alternative is to
serve the model with independent groups, one per segment, each a full copy of the model
with its own share of the traffic. :func:`compare_groupings` solves both with the same
policy and cost model and reports the throughput of each; a group that cannot hold the
model is reported infeasible with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from policies.errors import InputError
from policies.hardware.fleet import Fleet
from policies.request import PlacementRequest, PlacementResult
from policies.solve import solve


@dataclass(frozen=True)
class GroupResult:
    """One group of a grouping: its GPUs' nodes and its plan (or why it has none)."""

    nodes: tuple[str, ...]
    result: PlacementResult | None
    error: str = ""

    @property
    def tokens_per_s(self) -> float:
        if self.result is None or not self.result.plan.summary.feasible:
            return 0.0
        return self.result.plan.summary.tokens_per_s


@dataclass(frozen=True)
class Grouping:
    """A way to split the fleet into expert-parallel groups.

    Attributes:
        name: ``one-group`` or ``per-segment``.
        groups: the groups.
    """

    name: str
    groups: tuple[GroupResult, ...]

    @property
    def feasible(self) -> bool:
        return all(g.tokens_per_s > 0 for g in self.groups)

    @property
    def tokens_per_s(self) -> float:
        """Aggregate throughput, tokens/s (0 when a group is infeasible)."""
        return sum(g.tokens_per_s for g in self.groups) if self.feasible else 0.0


def segments(fleet: Fleet) -> list[Fleet]:
    """The fleet split by fabric segment (a node's first fabric), in fabric-name order."""
    by: dict[str, list[str]] = {}
    for node in fleet.nodes:
        by.setdefault(node.fabrics[0] if node.fabrics else "", []).append(node.name)
    out = []
    for name in sorted(by):
        keep = set(by[name])
        out.append(
            Fleet(
                f"{fleet.name}-{name or 'none'}",
                tuple(n for n in fleet.nodes if n.name in keep),
                (),
            )
        )
    return out


def _solve(req: PlacementRequest, fleet: Fleet) -> GroupResult:
    nodes = tuple(n.name for n in fleet.nodes)
    r = req.redundant_experts
    g = len(fleet.gpus)
    e = req.model.num_experts
    if req.form == "engine" and req.model.is_moe and (e + r) % g:
        r = -(-(e + r) // g) * g - e  # keep the slot budget per GPU, rounded up
    try:
        result = solve(replace(req, fleet=fleet, redundant_experts=r))
    except InputError as exc:
        return GroupResult(nodes, None, str(exc).splitlines()[0])
    if not result.placed:
        return GroupResult(nodes, None, result.message)
    return GroupResult(nodes, result)


def compare_groupings(req: PlacementRequest) -> list[Grouping]:
    """Solve the request as one group and as one group per fabric segment.

    Raises:
        InputError: the fleet has a single segment (nothing to compare).
    """
    parts = segments(req.fleet)
    if len(parts) < 2:
        raise InputError(
            "the fleet has one fabric segment; grouping by segment changes nothing. To fix: "
            "give nodes on different fabrics (nics[].fabric) joined by spec.fabric_links",
            field="fleet",
        )
    one = Grouping("one-group", (_solve(req, req.fleet),))
    per = Grouping("per-segment", tuple(_solve(req, part) for part in parts))
    return [one, per]
