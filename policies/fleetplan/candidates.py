"""A deployment's candidate instances: node make-ups, their step curves and the variants
sized from them.

A candidate instance is ``k`` nodes of one node group (``k`` in ``settings.instance_nodes``)
or, on fleets of at most ``settings.mixed_max_groups`` groups, one node each of two groups.
Each make-up's step curve is computed once (:mod:`policies.fleetplan.curves`, cached by key)
and sized per role (:mod:`policies.fleetplan.sizing`): an **aggregated** variant, a
**decode** variant, and **prefill** variants paired with decode variants
(:mod:`policies.fleetplan.pairs`).

Units: requests per second, GB/s, USD per hour. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, replace

from policies.advice.cost import fleet_usd_per_hour
from policies.deployment import describe_nodes, sub_fleet
from policies.errors import InputError
from policies.estimate.costmodel import GIB, Efficiency
from policies.fleetplan.curves import CurveCache, CurveEntry, compute_curve, curve_key
from policies.fleetplan.pairs import Pair, pairs_for
from policies.fleetplan.sizing import Sizing, decode_capacity, size_aggregated
from policies.fleetplan.types import FleetDeployment, PlanRequest, Variant
from policies.hardware.fleet import Fleet
from policies.scheduling.table import fleet_groups
from policies.scheduling.types import NodeGroup
from policies.spec.build import price_table, selects

Job = tuple[FleetDeployment, tuple[int, ...]]
"""A make-up asked for: ``(deployment, nodes per group)``."""
MakeUp = tuple[tuple[int, ...], str, Fleet]
"""``(nodes per group, curve key, the sub-fleet of those nodes)``."""


@dataclass(frozen=True)
class Candidates:
    """What the integer program chooses from.

    Attributes:
        groups: the fleet's node groups.
        aggregated: aggregated variants per deployment.
        pairs: prefill/decode pairs per deployment.
        decode: every decode variant per deployment (for reports).
        eligible: per deployment, eligible nodes per group.
        reasons: per deployment, why make-ups gave no variant (for shortfalls).
        computed: curves computed (not cached).
        cached: curves read from the cache.
    """

    groups: tuple[NodeGroup, ...]
    aggregated: Mapping[str, tuple[Variant, ...]]
    pairs: Mapping[str, tuple[Pair, ...]]
    decode: Mapping[str, tuple[Variant, ...]]
    eligible: Mapping[str, tuple[int, ...]]
    reasons: Mapping[str, tuple[str, ...]]
    computed: int
    cached: int


def eligible_nodes(fleet: Fleet, d: FleetDeployment) -> set[str]:
    """Names of the nodes ``d`` may use: its node selector matches them and, where it names
    its eligible nodes, they are among them."""
    return {
        n.name
        for n in fleet.nodes
        if selects(d.spec, n.labels) and (d.eligible is None or n.name in d.eligible)
    }


def _unit(n: int, t: int, k: int) -> tuple[int, ...]:
    """The count vector of ``k`` nodes of group ``t`` among ``n`` groups."""
    return tuple(k if i == t else 0 for i in range(n))


class _Rounds:
    """Make-ups asked for round by round and their curves: a round's curves not in the cache
    are computed together (on ``pool`` when given, for more than one) and stored in it.

    Attributes:
        groups: the fleet's node groups.
        entries: curve key -> its curve.
        wanted: per deployment, every make-up asked for (repeats included), in order.
        computed: curves computed (not cached).
        cached: curves read from the cache.
    """

    def __init__(
        self,
        req: PlanRequest,
        groups: Sequence[NodeGroup],
        cache: CurveCache,
        pool: Executor | None,
    ) -> None:
        self._req = req
        self._cache = cache
        self._pool = pool
        self.groups = tuple(groups)
        self.entries: dict[str, CurveEntry] = {}
        self.wanted: dict[str, list[MakeUp]] = {d.name: [] for d in req.deployments}
        self.computed = 0
        self.cached = 0

    def part_of(self, d: FleetDeployment, vec: tuple[int, ...]) -> tuple[str, Fleet]:
        """The curve key and the sub-fleet of make-up ``vec`` for ``d``."""
        fleet = self._req.fleet
        picked = [n for g, k in zip(self.groups, vec, strict=True) for n in g.nodes[:k]]
        part = sub_fleet(fleet, picked, name=f"{fleet.name}-{d.name}")
        return curve_key(d.spec, part, self._req.settings.grid), part

    def run(self, round_jobs: Sequence[Job]) -> None:
        """Ask for the make-ups of one round: read their curves from the cache or compute
        them."""
        grid = self._req.settings.grid
        todo: dict[str, tuple[FleetDeployment, Fleet]] = {}
        for d, vec in round_jobs:
            key, part = self.part_of(d, vec)
            self.wanted[d.name].append((vec, key, part))
            if key in self.entries or key in todo:
                continue
            got = self._cache.get(key)
            if got is not None:
                self.entries[key] = got
                self.cached += 1
            else:
                todo[key] = (d, part)
        keys = list(todo)
        specs = [todo[k][0].spec for k in keys]
        parts = [todo[k][1] for k in keys]
        grids = [grid] * len(keys)
        mapper: Callable[..., Iterable[CurveEntry]] = (
            self._pool.map if self._pool is not None and len(keys) > 1 else map
        )
        for key, entry in zip(keys, mapper(compute_curve, specs, parts, grids), strict=True):
            self._cache.put(key, entry)
            self.entries[key] = entry
            self.computed += 1

    def entry(self, d: FleetDeployment, vec: tuple[int, ...]) -> CurveEntry | None:
        """The curve of make-up ``vec`` for ``d``, or None when not asked for yet."""
        key, _ = self.part_of(d, vec)
        return self.entries.get(key)

    def holds(self, d: FleetDeployment, vec: tuple[int, ...]) -> bool:
        """Make-up ``vec`` has been asked for and holds ``d``'s model."""
        e = self.entry(d, vec)
        return e is not None and e.curve is not None

    def tight(self, d: FleetDeployment, vec: tuple[int, ...]) -> bool:
        """Weights fill more than half the instance's memory (a larger one has room for
        a larger batch)."""
        e = self.entry(d, vec)
        if e is None or e.curve is None:
            return False
        _, part = self.part_of(d, vec)
        memory = sum(g.spec.memory_gib for g in part.gpus) * GIB
        return e.curve.kv_capacity_tokens * e.curve.kv_bytes_per_token < 0.5 * memory

    def distinct(self, name: str) -> list[MakeUp]:
        """Deployment ``name``'s make-ups, each once, in a stable order (fewest nodes
        first)."""
        seen: dict[tuple[int, ...], MakeUp] = {}
        for row in self.wanted[name]:
            seen.setdefault(row[0], row)
        return sorted(seen.values(), key=lambda r: (sum(r[0]), r[0]))


def candidates(req: PlanRequest, cache: CurveCache, pool: Executor | None) -> Candidates:
    """Every deployment's variants and pairs, their curves from ``cache`` or computed (on
    ``pool`` when given) and stored in it.

    Make-ups are chosen in rounds (each round's curves computed together): per deployment
    and node group the sizes of ``settings.instance_nodes`` from the smallest up, until one
    holds the model, and further (up to ``settings.sizes_per_group`` that hold it) while the
    weights fill more than half of the instance's memory (a larger instance has room for a
    larger batch); then, on fleets of at most ``settings.mixed_max_groups`` groups, one node
    each of two groups where one of them cannot hold the model at any size it has (a mix
    uses a generation no single-group instance can)."""
    s = req.settings
    groups = fleet_groups(req.fleet)
    ng = len(groups)
    elig: dict[str, tuple[int, ...]] = {}
    for d in req.deployments:
        names = eligible_nodes(req.fleet, d)
        elig[d.name] = tuple(sum(1 for n in g.nodes if n in names) for g in groups)
    ladder = sorted(set(s.instance_nodes))
    rounds = _Rounds(req, groups, cache, pool)
    rounds.run(
        [
            (d, _unit(ng, t, ladder[0]))
            for d in req.deployments
            for t, cap in enumerate(elig[d.name])
            if ladder[0] <= cap
        ]
    )
    # (deployment, group) -> ladder sizes tried
    tried = {(d.name, t): 1 for d in req.deployments for t in range(ng)}
    mixed_done = not (0 < ng <= s.mixed_max_groups)
    while True:
        more = _larger(req, rounds, elig, ladder, tried)
        if not more and not mixed_done:
            mixed_done = True
            more = _mixed(req, rounds, elig, ladder, tried)
        if not more:
            break
        rounds.run(more)
    return _assemble(req, rounds, elig)


def _larger(
    req: PlanRequest,
    rounds: _Rounds,
    elig: Mapping[str, tuple[int, ...]],
    ladder: Sequence[int],
    tried: dict[tuple[str, int], int],
) -> list[Job]:
    """The next ladder size per deployment and group where no size tried holds the model,
    or fewer than ``settings.sizes_per_group`` do and the largest that does is tight;
    counts it in ``tried``."""
    s = req.settings
    ng = len(rounds.groups)
    more: list[Job] = []
    for d in req.deployments:
        for t, cap in enumerate(elig[d.name]):
            step = tried[d.name, t]
            if step >= len(ladder) or ladder[step] > cap:
                continue
            ok = [k for k in ladder[:step] if k <= cap and rounds.holds(d, _unit(ng, t, k))]
            if ok and (len(ok) >= s.sizes_per_group or not rounds.tight(d, _unit(ng, t, ok[-1]))):
                continue
            more.append((d, _unit(ng, t, ladder[step])))
            tried[d.name, t] = step + 1
    return more


def _mixed(
    req: PlanRequest,
    rounds: _Rounds,
    elig: Mapping[str, tuple[int, ...]],
    ladder: Sequence[int],
    tried: Mapping[tuple[str, int], int],
) -> list[Job]:
    """One node each of two groups, both eligible, where one of them holds the model at no
    size tried."""
    ng = len(rounds.groups)
    more: list[Job] = []
    for d in req.deployments:
        alone = [
            any(rounds.holds(d, _unit(ng, t, k)) for k in ladder[: tried[d.name, t]])
            for t in range(ng)
        ]
        for a_ in range(ng):
            for b_ in range(a_ + 1, ng):
                if elig[d.name][a_] and elig[d.name][b_] and not (alone[a_] and alone[b_]):
                    more.append((d, tuple(1 if i in (a_, b_) else 0 for i in range(ng))))
    return more


def _assemble(req: PlanRequest, rounds: _Rounds, elig: Mapping[str, tuple[int, ...]]) -> Candidates:
    """The candidates from the make-ups asked for: each deployment's variants and pairs."""
    aggregated: dict[str, tuple[Variant, ...]] = {}
    pairs: dict[str, tuple[Pair, ...]] = {}
    decodes: dict[str, tuple[Variant, ...]] = {}
    reasons: dict[str, tuple[str, ...]] = {}
    groups = rounds.groups
    for d in req.deployments:
        wanted = rounds.distinct(d.name)
        agg, dec, pre, why = _variants(d, groups, wanted, rounds.entries, req.fleet, req)
        aggregated[d.name] = agg
        decodes[d.name] = dec
        pairs[d.name] = pairs_for(d, pre, dec, req.fleet, groups, req, elig[d.name])
        reasons[d.name] = why
    return Candidates(
        groups,
        aggregated,
        pairs,
        decodes,
        elig,
        reasons,
        computed=rounds.computed,
        cached=rounds.cached,
    )


def _variants(
    d: FleetDeployment,
    groups: Sequence[NodeGroup],
    wanted: Sequence[MakeUp],
    entries: Mapping[str, CurveEntry],
    fleet: Fleet,
    req: PlanRequest,
) -> tuple[tuple[Variant, ...], tuple[Variant, ...], tuple[Variant, ...], tuple[str, ...]]:
    """A deployment's aggregated, decode and (unsized) prefill variants, and the reasons
    make-ups gave none."""
    s = req.settings
    prices = price_table(d.spec)
    agg: list[Variant] = []
    dec: list[Variant] = []
    pre: list[Variant] = []
    why: list[str] = []
    for vec, key, part in wanted:
        entry = entries[key]
        make_up = describe_nodes(fleet, [n.name for n in part.nodes])
        if entry.curve is None:
            why.append(f"{make_up}: {entry.reason}")
            continue
        try:
            usd = fleet_usd_per_hour(part, prices)
        except InputError:
            usd = 0.0
        nic = sum(n.rdma_per_direction_gbits_per_s for n in part.nodes) / 8.0 * Efficiency().rdma
        base = Variant(
            key="",
            deployment=d.name,
            role="",
            counts=vec,
            make_up=make_up,
            gpus=entry.gpus,
            attention_tp=max(entry.attention_tp, default=1),
            expert_parallel=entry.gpus,
            curve_key=key,
            curve=entry.curve,
            sizing=Sizing(0, 0.0, 0.0, 0.0, "unsized"),
            usd_per_hour=usd,
            nic_gbytes_per_s=nic,
        )
        label = _vec_label(groups, vec)
        if d.disaggregation != "on":
            sz = size_aggregated(
                entry.curve,
                d.traffic,
                d.slo,
                chunk_tokens=s.chunk_tokens,
                utilisation=s.utilisation,
                queueing=s.queueing,
                batch_cap=d.batch_cap(entry.gpus),
            )
            if sz.ok:
                agg.append(replace(base, key=f"{label}/aggregated", role="aggregated", sizing=sz))
            else:
                why.append(f"{make_up} aggregated: {sz.reason}")
        if d.disaggregation != "off":
            sz = decode_capacity(
                entry.curve,
                d.traffic,
                d.slo,
                utilisation=s.utilisation,
                batch_cap=d.batch_cap(entry.gpus),
            )
            if sz.ok:
                dec.append(replace(base, key=f"{label}/decode", role="decode", sizing=sz))
            else:
                why.append(f"{make_up} decode: {sz.reason}")
            pre.append(replace(base, key=f"{label}/prefill", role="prefill"))
    return tuple(agg), tuple(dec), tuple(pre), tuple(why)


def _vec_label(groups: Sequence[NodeGroup], vec: Sequence[int]) -> str:
    """``2x8xH200-SXM-141GB`` (+ ...) for a count vector."""
    return "+".join(
        f"{k}x{g.label.replace(' ', '')}" for g, k in zip(groups, vec, strict=True) if k
    )
