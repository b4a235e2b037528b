"""The fleet planner: variants and instance counts for every deployment, serving each
deployment's demand within its SLOs at least cost, by priority when the fleet is short.

Estimate, then build, then solve:

1. **Variants.** Nodes of one make-up form a node group
   (:func:`policies.scheduling.table.fleet_groups`). A deployment's candidate instances are
   ``k`` nodes of one group (``k`` in ``settings.instance_nodes``) and, on fleets of at most
   ``settings.mixed_max_groups`` groups, one node each of two groups. Each make-up's step
   curve is computed once (:mod:`policies.fleetplan.curves`, cached by key) and sized per
   role (:mod:`policies.fleetplan.sizing`): an **aggregated** variant, a **decode** variant,
   and **prefill** variants paired with decode variants over the KV path between their
   nodes (:func:`kv_path`; a pair without an RDMA or NVLink path is not a candidate).
2. **Integer program** (HiGHS through :class:`policies.solvers.milp.Model`: one thread,
   fixed seed, a node limit - the same inputs give the same plan on a busy machine). Variables:
   ``x_v`` in Z>=0 instances of aggregated variant ``v``; for a prefill/decode pair ``k =
   (p, q)``: ``y_k``, ``z_k`` in Z>=0 prefill and decode instances of its pool; served rates
   ``r_v, f_k >= 0`` and ``s_d`` per deployment. Constraints::

       (1) r_v <= cap_v x_v;   f_k <= capP_k y_k;   f_k <= capD_q z_k
       (2) s_d = sum_{v of d} r_v + sum_{k of d} f_k <= demand_d
       (3) sum over instances of nodes of group g <= |g|            (every group g)
       (4) the same over d's instances <= nodes of g eligible for d  (every d, g)
       (5) sum usd x <= budget_usd_d;  sum gpus x <= budget_gpus_d   (where given)

   Solved lexicographically by priority: for each priority level, highest first, maximise
   ``sum_{d at level} s_d / demand_d`` and keep what it reaches (less 1e-6) as a constraint
   for the levels below; then minimise ``sum usd x + move_weight * sum usd |x - x_prev|``
   (the price of the GPUs, plus a penalty for every instance changed against the previous
   plan) with every level's served share kept. So a higher priority's demand is served
   first, each deployment up to its demand, and at least cost (within
   ``settings.cost_gap``: the cost stage stops at a plan proven within that fraction of
   the cheapest).
3. **Read back.** Counts become pools with named nodes (previous nodes kept where the count
   allows), predicted latencies at each pool's load, and shortfalls with what would fix
   them.

Units: requests per second, milliseconds, GB/s, USD per hour. Pure: no I/O.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, replace

from policies.cost import fleet_usd_per_hour
from policies.costmodel import GIB, Efficiency
from policies.deployment import describe_nodes, sub_fleet
from policies.errors import InputError
from policies.fleet import Fleet, Node
from policies.fleetplan.curves import (
    CurveCache,
    CurveEntry,
    MemoryCurveCache,
    compute_curve,
    curve_key,
)
from policies.fleetplan.sizing import (
    Lengths,
    Sizing,
    aggregated_step_us,
    aggregated_ttft_us,
    decode_capacity,
    size_aggregated,
    size_pair,
)
from policies.fleetplan.types import (
    DeploymentPlan,
    FleetDeployment,
    FleetPlan,
    PlannedGroup,
    PlannedPool,
    PlanRequest,
    Shortfall,
    Variant,
)
from policies.scheduling.table import fleet_groups
from policies.scheduling.types import NodeGroup
from policies.solvers.milp import Limits, Model
from policies.spec import check_spec, price_table, selects

_EPS = 1e-9


@dataclass(frozen=True)
class Pair:
    """A prefill variant feeding a decode variant of one deployment.

    Attributes:
        prefill: the prefill variant (its sizing is this pair's).
        decode: the decode variant.
        kv_gbytes_per_s: one transfer's bandwidth, GB/s.
        kv_latency_us: one transfer's fixed cost, us.
        kv_path: the path in words.
    """

    prefill: Variant
    decode: Variant
    kv_gbytes_per_s: float
    kv_latency_us: float
    kv_path: str

    @property
    def key(self) -> str:
        return f"{self.prefill.key}+{self.decode.key}"


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


def plan_fleet(
    req: PlanRequest,
    *,
    cache: CurveCache | None = None,
    pool: Executor | None = None,
) -> FleetPlan:
    """Plan the fleet (see the module docstring).

    Args:
        req: fleet, deployments with traffic and SLOs, previous plan, settings.
        cache: curves kept between calls (a disk-backed one across runs); in memory when
            None.
        pool: the caller's executor for curves not in the cache (a process pool computes
            them in parallel; the plan is the same without it).

    Raises:
        InputError: an invalid deployment (the field is named).
    """
    check_request(req)
    cands = candidates(req, cache if cache is not None else MemoryCurveCache(), pool)
    t0 = time.perf_counter()
    counts, solver = _solve(req, cands)
    elapsed = time.perf_counter() - t0
    return _read_back(req, cands, counts, solver, elapsed)


def check_request(req: PlanRequest) -> None:
    """Validate the deployments: their specs (traffic, SLOs, disaggregation and budget
    included), that each states traffic and SLOs, and unique names.

    Raises:
        InputError: naming the deployment and the field.
    """
    seen: set[str] = set()
    for d in req.deployments:
        at = f"deployments.{d.name or '?'}"
        check_spec(d.spec, path=at)
        if d.name in seen:
            raise InputError(f"deployment {d.name!r} appears twice", field=f"{at}.name")
        seen.add(d.name)
        if d.spec.traffic is None or d.spec.slo is None:
            missing = "traffic" if d.spec.traffic is None else "slo"
            raise InputError(
                "the fleet planner needs the demand and the SLOs. To fix: give spec.traffic "
                "and spec.slo, or schedule it by its batch (tokensPerGpu)",
                field=f"{at}.{missing}",
            )


# ---------------------------------------------------------------------- candidates


def _eligible(fleet: Fleet, d: FleetDeployment) -> set[str]:
    return {
        n.name
        for n in fleet.nodes
        if selects(d.spec, n.labels) and (d.eligible is None or n.name in d.eligible)
    }


def _unit(n: int, t: int, k: int) -> tuple[int, ...]:
    """The count vector of ``k`` nodes of group ``t`` among ``n`` groups."""
    return tuple(k if i == t else 0 for i in range(n))


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
    fleet = req.fleet
    groups = fleet_groups(fleet)
    ng = len(groups)
    mixed = 0 < ng <= s.mixed_max_groups
    elig: dict[str, tuple[int, ...]] = {}
    entries: dict[str, CurveEntry] = {}
    wanted: dict[str, list[tuple[tuple[int, ...], str, Fleet]]] = {}
    stats = [0, 0]  # computed, cached

    def part_of(d: FleetDeployment, vec: tuple[int, ...]) -> tuple[str, Fleet]:
        picked = [n for g, k in zip(groups, vec, strict=True) for n in g.nodes[:k]]
        part = sub_fleet(fleet, picked, name=f"{fleet.name}-{d.name}")
        return curve_key(d.spec, part, s.grid), part

    def run(round_jobs: Sequence[tuple[FleetDeployment, tuple[int, ...]]]) -> None:
        todo: dict[str, tuple[FleetDeployment, Fleet]] = {}
        for d, vec in round_jobs:
            key, part = part_of(d, vec)
            wanted[d.name].append((vec, key, part))
            if key in entries or key in todo:
                continue
            got = cache.get(key)
            if got is not None:
                entries[key] = got
                stats[1] += 1
            else:
                todo[key] = (d, part)
        keys = list(todo)
        specs = [todo[k][0].spec for k in keys]
        parts = [todo[k][1] for k in keys]
        grids = [s.grid] * len(keys)
        mapper: Callable[..., Iterable[CurveEntry]] = (
            pool.map if pool is not None and len(keys) > 1 else map
        )
        for key, entry in zip(keys, mapper(compute_curve, specs, parts, grids), strict=True):
            cache.put(key, entry)
            entries[key] = entry
            stats[0] += 1

    ladder = sorted(set(s.instance_nodes))
    tried: dict[tuple[str, int], int] = {}  # (deployment, group) -> ladder sizes tried
    for d in req.deployments:
        names = _eligible(fleet, d)
        elig[d.name] = tuple(sum(1 for n in g.nodes if n in names) for g in groups)
        wanted[d.name] = []
    run(
        [
            (d, _unit(ng, t, ladder[0]))
            for d in req.deployments
            for t, cap in enumerate(elig[d.name])
            if ladder[0] <= cap
        ]
    )
    for d in req.deployments:
        for t in range(ng):
            tried[d.name, t] = 1

    def entry(d: FleetDeployment, vec: tuple[int, ...]) -> CurveEntry | None:
        key, _ = part_of(d, vec)
        return entries.get(key)

    def holds(d: FleetDeployment, vec: tuple[int, ...]) -> bool:
        e = entry(d, vec)
        return e is not None and e.curve is not None

    def tight(d: FleetDeployment, vec: tuple[int, ...]) -> bool:
        """Weights fill more than half the instance's memory (a larger one has room for
        a larger batch)."""
        e = entry(d, vec)
        if e is None or e.curve is None:
            return False
        _, part = part_of(d, vec)
        memory = sum(g.spec.memory_gib for g in part.gpus) * GIB
        return e.curve.kv_capacity_tokens * e.curve.kv_bytes_per_token < 0.5 * memory

    mixed_done = not mixed
    while True:
        more: list[tuple[FleetDeployment, tuple[int, ...]]] = []
        for d in req.deployments:
            for t, cap in enumerate(elig[d.name]):
                step = tried[d.name, t]
                if step >= len(ladder) or ladder[step] > cap:
                    continue
                ok = [k for k in ladder[:step] if k <= cap and holds(d, _unit(ng, t, k))]
                if ok and (len(ok) >= s.sizes_per_group or not tight(d, _unit(ng, t, ok[-1]))):
                    continue
                more.append((d, _unit(ng, t, ladder[step])))
                tried[d.name, t] = step + 1
        if not more and not mixed_done:
            mixed_done = True
            for d in req.deployments:
                alone = [
                    any(holds(d, _unit(ng, t, k)) for k in ladder[: tried[d.name, t]])
                    for t in range(ng)
                ]
                for a_ in range(ng):
                    for b_ in range(a_ + 1, ng):
                        if elig[d.name][a_] and elig[d.name][b_] and not (alone[a_] and alone[b_]):
                            more.append((d, tuple(1 if i in (a_, b_) else 0 for i in range(ng))))
        if not more:
            break
        run(more)
    # Only make-ups that exist once per deployment, in a stable order.
    for name, rows in wanted.items():
        seen: dict[tuple[int, ...], tuple[tuple[int, ...], str, Fleet]] = {}
        for row in rows:
            seen.setdefault(row[0], row)
        wanted[name] = sorted(seen.values(), key=lambda r: (sum(r[0]), r[0]))
    aggregated: dict[str, tuple[Variant, ...]] = {}
    pairs: dict[str, tuple[Pair, ...]] = {}
    decodes: dict[str, tuple[Variant, ...]] = {}
    reasons: dict[str, tuple[str, ...]] = {}
    for d in req.deployments:
        agg, dec, pre, why = _variants(d, groups, wanted[d.name], entries, fleet, req)
        aggregated[d.name] = agg
        decodes[d.name] = dec
        pairs[d.name] = _pairs(d, pre, dec, fleet, groups, req)
        reasons[d.name] = why
    return Candidates(
        groups,
        aggregated,
        pairs,
        decodes,
        elig,
        reasons,
        computed=stats[0],
        cached=stats[1],
    )


def _variants(
    d: FleetDeployment,
    groups: Sequence[NodeGroup],
    wanted: Sequence[tuple[tuple[int, ...], str, Fleet]],
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
            )
            if sz.ok:
                agg.append(replace(base, key=f"{label}/aggregated", role="aggregated", sizing=sz))
            else:
                why.append(f"{make_up} aggregated: {sz.reason}")
        if d.disaggregation != "off":
            sz = decode_capacity(entry.curve, d.traffic, d.slo, utilisation=s.utilisation)
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


def _per_request_usd(v: Variant) -> float:
    return v.usd_per_hour / v.sizing.requests_per_s if v.sizing.requests_per_s > 0 else math.inf


def _pairs(
    d: FleetDeployment,
    prefill: Sequence[Variant],
    decode: Sequence[Variant],
    fleet: Fleet,
    groups: Sequence[NodeGroup],
    req: PlanRequest,
) -> tuple[Pair, ...]:
    """Prefill/decode pairs with a KV path: the cheapest decode variants per request and
    for each its cheapest prefill partners and its own make-up's prefill variant."""
    s = req.settings
    if d.disaggregation == "off" or not decode or not prefill:
        return ()
    kept = sorted(decode, key=lambda v: (_per_request_usd(v), v.key))[: s.decode_variants]
    out: list[Pair] = []
    for q in kept:
        options: list[Pair] = []
        for p in prefill:
            path = kv_path(
                _first_node(fleet, groups, p.counts),
                _first_node(fleet, groups, q.counts, last=True),
                fleet,
            )
            if path is None:
                continue
            gbs, lat, words = path
            ps = size_pair(
                p.curve,
                q.curve,
                d.traffic,
                d.slo,
                kv_gbytes_per_s=gbs,
                kv_latency_us=lat,
                prefill_nic_gbytes_per_s=p.nic_gbytes_per_s or gbs,
                decode_nic_gbytes_per_s=q.nic_gbytes_per_s or gbs,
                utilisation=s.utilisation,
            )
            if not ps.prefill.ok or not ps.decode.ok:
                continue
            q2 = replace(q, sizing=ps.decode)
            options.append(Pair(replace(p, sizing=ps.prefill), q2, gbs, lat, words))
        options.sort(key=lambda k: (_per_request_usd(k.prefill), k.prefill.key))
        kept_pairs = options[: s.pairs_per_decode]
        # The same make-up as the decode side too (a P/D split inside one generation), which
        # the cheapest partners may miss when their generation is scarce.
        same = next((k for k in options if k.prefill.counts == q.counts), None)
        if same is not None and same not in kept_pairs:
            kept_pairs.append(same)
        out.extend(kept_pairs)
    return tuple(out)


def _first_node(
    fleet: Fleet, groups: Sequence[NodeGroup], vec: Sequence[int], *, last: bool = False
) -> Node:
    """A node of the make-up's first group (the KV path is judged from it): its first, or
    with ``last`` its last (a prefill and a decode instance of one group run on different
    nodes)."""
    t = next(i for i, k in enumerate(vec) if k)
    return fleet.node(groups[t].nodes[-1 if last else 0])


def kv_path(a: Node, b: Node, fleet: Fleet) -> tuple[float, float, str] | None:
    """The path a KV transfer takes from a prefill node ``a`` to a decode node ``b``:
    ``(GB/s one transfer gets, latency us, words)``, or None when there is no RDMA or
    NVLink path. NVLink when both are in one NVLink domain (multi-node NVLink); else RDMA
    over a fabric both nodes attach to, or over a fabric link between their fabrics
    (bandwidth the smallest of one NIC's port and the link; latency added). One transfer
    runs over one NIC (a rank's KV goes through its own NIC) at the RDMA efficiency."""
    eff = Efficiency()
    if a.nvlink is not None and b.nvlink is not None and a.nvlink.domain == b.nvlink.domain:
        gbs = min(a.nvlink.per_gpu_bidir_gbytes_per_s, b.nvlink.per_gpu_bidir_gbytes_per_s)
        return gbs / 2.0 * eff.nvlink, eff.alpha_nvlink_us, f"NVLink {a.nvlink.domain}"
    if not a.nics or not b.nics:
        return None
    nic_a = max(x.per_direction_gbits_per_s for x in a.nics)
    nic_b = max(x.per_direction_gbits_per_s for x in b.nics)
    one = min(nic_a, nic_b) / 8.0 * eff.rdma
    common = set(a.fabrics) & set(b.fabrics)
    if common:
        return one, eff.alpha_rdma_us, f"RDMA {sorted(common)[0]}"
    best: tuple[float, float, str] | None = None
    for link in fleet.fabric_links:
        ends = {link.a, link.b}
        if any(f in ends for f in a.fabrics) and any(f in ends for f in b.fabrics):
            gbs = min(one, link.per_direction_gbits_per_s / 8.0 * eff.rdma)
            cand = (gbs, eff.alpha_rdma_us + link.latency_us, f"RDMA {link.a}-{link.b}")
            if best is None or cand[0] > best[0]:
                best = cand
    return best


# ---------------------------------------------------------------------- solve


@dataclass
class _Program:
    """The integer program's columns (indices into ``model``)."""

    model: Model
    x: dict[tuple[str, str], int]  # (deployment, aggregated variant key) -> instances
    y: dict[tuple[str, str], int]  # (deployment, pair key) -> prefill instances
    z: dict[tuple[str, str], int]  # (deployment, pair key) -> decode instances
    served: dict[str, int]  # deployment -> requests/s served
    cost: list[tuple[int, float]]  # instance column -> USD per hour


Counts = dict[tuple[str, str, str], int]
"""``(deployment, kind, key) -> instances``; kind ``agg`` (variant key), ``pre`` or ``dec``
(pair key)."""


def _build(req: PlanRequest, c: Candidates) -> _Program:
    """Columns and constraints (1)-(5) of the module docstring."""
    m = Model("fleet_plan")
    x: dict[tuple[str, str], int] = {}
    y: dict[tuple[str, str], int] = {}
    z: dict[tuple[str, str], int] = {}
    served: dict[str, int] = {}
    sizes = [len(g.nodes) for g in c.groups]
    use: list[list[tuple[int, float]]] = [[] for _ in c.groups]
    cost: list[tuple[int, float]] = []

    def ub(vec: Sequence[int]) -> int:
        return min(sizes[t] // k for t, k in enumerate(vec) if k)

    for d in req.deployments:
        placed: list[tuple[int, Variant]] = []
        rates: list[tuple[int, float]] = []
        for v in c.aggregated[d.name]:
            xv = m.var(0, ub(v.counts), integer=True)
            rv = m.var(0)
            m.le([(rv, 1.0), (xv, -v.sizing.requests_per_s)], 0.0)  # (1)
            x[d.name, v.key] = xv
            placed.append((xv, v))
            rates.append((rv, 1.0))
        for k in c.pairs[d.name]:
            yk = m.var(0, ub(k.prefill.counts), integer=True)
            zk = m.var(0, ub(k.decode.counts), integer=True)
            fk = m.var(0)
            m.le([(fk, 1.0), (yk, -k.prefill.sizing.requests_per_s)], 0.0)  # (1)
            m.le([(fk, 1.0), (zk, -k.decode.sizing.requests_per_s)], 0.0)  # (1)
            y[d.name, k.key], z[d.name, k.key] = yk, zk
            placed += [(yk, k.prefill), (zk, k.decode)]
            rates.append((fk, 1.0))
        sd = m.var(0, d.traffic.requests_per_s)  # (2)
        m.eq([(sd, 1.0), *((r, -1.0) for r, _ in rates)], 0.0)  # (2)
        served[d.name] = sd
        mine: list[list[tuple[int, float]]] = [[] for _ in c.groups]
        for col, v in placed:
            for t, cnt in enumerate(v.counts):
                if cnt:
                    mine[t].append((col, float(cnt)))
                    use[t].append((col, float(cnt)))
            cost.append((col, v.usd_per_hour))
        for t, terms in enumerate(mine):  # (4)
            if terms and c.eligible[d.name][t] < sizes[t]:
                m.le(terms, c.eligible[d.name][t])
        if d.budget_usd_per_hour > 0 and placed:  # (5)
            m.le([(col, v.usd_per_hour) for col, v in placed], d.budget_usd_per_hour)
        if d.budget_gpus > 0 and placed:  # (5)
            m.le([(col, float(v.gpus)) for col, v in placed], d.budget_gpus)
    for t, terms in enumerate(use):  # (3)
        if terms:
            m.le(terms, sizes[t])
    return _Program(m, x, y, z, served, cost)


def _previous_counts(req: PlanRequest) -> Counts:
    out: Counts = {}
    prev = req.previous
    if prev is None:
        return out
    for name, dp in prev.deployments.items():
        for p in dp.pools:
            if p.instances is not None:
                out[name, "agg", p.instances.variant.key] = p.instances.count
            elif p.prefill is not None and p.decode is not None:
                key = f"{p.prefill.variant.key}+{p.decode.variant.key}"
                out[name, "pre", key] = p.prefill.count
                out[name, "dec", key] = p.decode.count
    return out


def _solve(req: PlanRequest, c: Candidates) -> tuple[Counts, str]:
    """Instance counts by the lexicographic integer programs (module docstring); each solve
    starts from the previous one's answer (which stays feasible), so a work-limited solve
    never ends without one."""
    p = _build(req, c)
    m = p.model
    status = "HiGHS optimal"
    values: tuple[float, ...] = ()
    ints = [col for col, _ in p.cost]

    def run(gap: float) -> None:
        nonlocal status, values
        if values:
            for col in ints:
                m.set_start(col, round(values[col]))
        limits = Limits(max_nodes=req.settings.max_solver_nodes, mip_gap=gap)
        out = m.solve(solver="highs", limits=limits)
        if out.values:
            values = out.values
        if out.status != "optimal":
            status = f"{out.solver} {out.status}"

    for level in sorted({d.priority for d in req.deployments}, reverse=True):
        at = [d for d in req.deployments if d.priority == level]
        share = [(p.served[d.name], 1.0 / d.traffic.requests_per_s) for d in at]
        m.minimise([(col, -w) for col, w in share])
        run(req.settings.mip_gap)
        reached = sum(values[col] * w for col, w in share) if values else 0.0
        m.ge(share, reached - 1e-6 * max(1.0, len(at)))
    prev = _previous_counts(req)
    w = req.settings.move_weight
    terms = list(p.cost)
    if prev and w > 0:
        cols: list[tuple[tuple[str, str, str], int, float]] = []
        for d in req.deployments:
            for v in c.aggregated[d.name]:
                cols.append(((d.name, "agg", v.key), p.x[d.name, v.key], v.usd_per_hour))
            for k in c.pairs[d.name]:
                cols.append(((d.name, "pre", k.key), p.y[d.name, k.key], k.prefill.usd_per_hour))
                cols.append(((d.name, "dec", k.key), p.z[d.name, k.key], k.decode.usd_per_hour))
        for ident, col, usd in cols:
            before = prev.get(ident, 0)
            dev = m.var(0)
            m.ge([(dev, 1.0), (col, -1.0)], -before)
            m.ge([(dev, 1.0), (col, 1.0)], before)
            terms.append((dev, w * usd))
            if values:
                values = (*values, abs(round(values[col]) - before))
    m.minimise(terms)
    run(req.settings.cost_gap)
    counts: Counts = {}

    def count(col: int) -> int:
        return round(values[col]) if values else 0

    for (name, key), col in p.x.items():
        counts[name, "agg", key] = count(col)
    for (name, key), col in p.y.items():
        counts[name, "pre", key] = count(col)
    for (name, key), col in p.z.items():
        counts[name, "dec", key] = count(col)
    return counts, status


# ---------------------------------------------------------------------- read back


def _deal(
    req: PlanRequest, c: Candidates, counts: Counts
) -> tuple[dict[tuple[str, str, str], tuple[tuple[str, ...], ...]], tuple[str, ...]]:
    """Node names per instance: an instance keeps the nodes it had in the previous plan
    where it still exists, the rest come from the free nodes in fleet order (deployments
    with the fewest eligible nodes first)."""
    free: list[list[str]] = [list(g.nodes) for g in c.groups]
    out: dict[tuple[str, str, str], list[tuple[str, ...]]] = {}
    elig = {d.name: _eligible(req.fleet, d) for d in req.deployments}
    vec_of: dict[tuple[str, str, str], tuple[int, ...]] = {}
    for d in req.deployments:
        for v in c.aggregated[d.name]:
            vec_of[d.name, "agg", v.key] = v.counts
        for k in c.pairs[d.name]:
            vec_of[d.name, "pre", k.key] = k.prefill.counts
            vec_of[d.name, "dec", k.key] = k.decode.counts
    prev_nodes: dict[tuple[str, str, str], list[tuple[str, ...]]] = {}
    if req.previous is not None:
        for name, dp in req.previous.deployments.items():
            for p in dp.pools:
                if p.instances is not None:
                    prev_nodes[name, "agg", p.instances.variant.key] = list(p.instances.nodes)
                elif p.prefill is not None and p.decode is not None:
                    key = f"{p.prefill.variant.key}+{p.decode.variant.key}"
                    prev_nodes[name, "pre", key] = list(p.prefill.nodes)
                    prev_nodes[name, "dec", key] = list(p.decode.nodes)
    taken: set[str] = set()
    # Kept instances first.
    for ident, n in sorted(counts.items()):
        if n <= 0:
            continue
        kept = [
            inst
            for inst in prev_nodes.get(ident, [])
            if all(x not in taken for x in inst) and all(x in elig[ident[0]] for x in inst)
        ][:n]
        for inst in kept:
            taken.update(inst)
        out[ident] = kept
    order = sorted((i for i, n in counts.items() if n > 0), key=lambda i: (len(elig[i[0]]), i))
    for ident in order:
        vec = vec_of[ident]
        while len(out[ident]) < counts[ident]:
            picked: list[str] = []
            for t, cnt in enumerate(vec):
                pool = [x for x in free[t] if x not in taken and x in elig[ident[0]]]
                picked.extend(pool[:cnt])
            if len(picked) < sum(vec):  # pragma: no cover - the program's (3), (4) prevent it
                break
            taken.update(picked)
            out[ident].append(tuple(picked))
    left = tuple(n.name for n in req.fleet.nodes if n.name not in taken)
    return {k: tuple(v) for k, v in out.items()}, left


def _agg_load(
    v: Variant, d: FleetDeployment, per_instance: float, chunk: int
) -> tuple[float, float]:
    """Predicted ``(TTFT ms, TPOT ms)`` of an aggregated instance at ``per_instance``
    requests/s: the steady batch ``B`` with ``B / (OSL t(B)) = rate``."""
    n = Lengths.of(d.traffic, d.slo)
    lo, hi = 0.0, float(v.sizing.batch_limit)
    for _ in range(40):
        mid = (lo + hi) / 2
        t = aggregated_step_us(v.curve, n, max(mid, 1e-9), chunk)
        if mid / (n.osl * t * 1e-6) < per_instance:
            lo = mid
        else:
            hi = mid
    b = max(hi, 1.0)
    return aggregated_ttft_us(v.curve, n, b, chunk) / 1e3, aggregated_step_us(
        v.curve, n, b, chunk
    ) / 1e3


def _decode_load(v: Variant, d: FleetDeployment, per_instance: float) -> float:
    """Predicted TPOT of a decode instance at ``per_instance`` requests/s, ms."""
    n = Lengths.of(d.traffic, d.slo)
    lo, hi = 0.0, float(v.sizing.batch_limit)
    for _ in range(40):
        mid = (lo + hi) / 2
        t = v.curve.decode_us(max(mid, 1e-9), n.context)
        if mid / (n.osl * t * 1e-6) < per_instance:
            lo = mid
        else:
            hi = mid
    return v.curve.decode_us(max(hi, 1.0), n.context) / 1e3


def _prefill_ttft_ms(
    p: PlannedPool, d: FleetDeployment, per_instance: float, step_ms: float
) -> float:
    """Predicted TTFT of a P/D pool at ``per_instance`` requests/s per prefill instance, ms:
    the running forward and the request's own, each of the tokens that arrive during one
    forward (a fixed point; at least the percentile prompt, at most the budget), then the KV
    transfer and a decode step."""
    assert p.prefill is not None
    v = p.prefill.variant
    n = Lengths.of(d.traffic, d.slo)
    tokens = n.isl_q
    for _ in range(50):
        nxt = min(
            float(p.prefill.batch_limit),
            max(n.isl_q, per_instance * n.isl * v.curve.prefill_time_us(tokens) * 1e-6),
        )
        if abs(nxt - tokens) < 1.0:
            break
        tokens = nxt
    forward = v.curve.prefill_time_us(tokens)
    kv_us = p.kv_latency_us + v.curve.kv_bytes_per_token * n.isl_q / (p.kv_gbytes_per_s * 1e3)
    return (2.0 * forward + kv_us) / 1e3 + step_ms


def _read_back(
    req: PlanRequest, c: Candidates, counts: Counts, solver: str, solve_s: float
) -> FleetPlan:
    nodes, free = _deal(req, c, counts)
    chunk = req.settings.chunk_tokens
    plans: dict[str, DeploymentPlan] = {}
    shortfalls: dict[str, Shortfall] = {}
    for d in req.deployments:
        pools: list[PlannedPool] = []
        for v in c.aggregated[d.name]:
            k = counts.get((d.name, "agg", v.key), 0)
            if k <= 0:
                continue
            pools.append(
                PlannedPool(
                    name=v.key,
                    requests_per_s=0.0,
                    instances=PlannedGroup(v, k, nodes[d.name, "agg", v.key], v.sizing.batch_limit),
                    capacity_requests_per_s=k * v.sizing.requests_per_s,
                )
            )
        for pr in c.pairs[d.name]:
            yk = counts.get((d.name, "pre", pr.key), 0)
            zk = counts.get((d.name, "dec", pr.key), 0)
            if yk <= 0 or zk <= 0:
                continue
            pools.append(
                PlannedPool(
                    name=pr.key,
                    requests_per_s=0.0,
                    prefill=PlannedGroup(
                        pr.prefill, yk, nodes[d.name, "pre", pr.key], pr.prefill.sizing.batch_limit
                    ),
                    decode=PlannedGroup(
                        pr.decode, zk, nodes[d.name, "dec", pr.key], pr.decode.sizing.batch_limit
                    ),
                    kv_gbytes_per_s=pr.kv_gbytes_per_s,
                    kv_latency_us=pr.kv_latency_us,
                    kv_path=pr.kv_path,
                    capacity_requests_per_s=min(
                        yk * pr.prefill.sizing.requests_per_s, zk * pr.decode.sizing.requests_per_s
                    ),
                )
            )
        capacity = sum(p.capacity_requests_per_s for p in pools)
        demand = d.traffic.requests_per_s
        served = min(demand, capacity)
        loaded: list[PlannedPool] = []
        for p in pools:
            rate = served * p.capacity_requests_per_s / capacity if capacity > 0 else 0.0
            if p.instances is not None:
                ttft, tpot = _agg_load(p.instances.variant, d, rate / p.instances.count, chunk)
            else:
                assert p.prefill is not None and p.decode is not None
                tpot = _decode_load(p.decode.variant, d, rate / p.decode.count)
                ttft = _prefill_ttft_ms(p, d, rate / p.prefill.count, tpot)
            loaded.append(replace(p, requests_per_s=rate, ttft_ms=ttft, tpot_ms=tpot))
        plans[d.name] = DeploymentPlan(d.name, d.priority, d.traffic, d.slo, tuple(loaded), served)
        short = demand - served
        if short > demand * 1e-6:
            shortfalls[d.name] = _shortfall(req, c, d, plans, short)
    variants: dict[str, tuple[Variant, ...]] = {}
    for d in req.deployments:
        best_prefill: dict[str, Variant] = {}
        for pr in c.pairs[d.name]:
            seen = best_prefill.get(pr.prefill.key)
            if seen is None or pr.prefill.sizing.requests_per_s > seen.sizing.requests_per_s:
                best_prefill[pr.prefill.key] = pr.prefill
        variants[d.name] = (*c.aggregated[d.name], *c.decode[d.name], *best_prefill.values())
    return FleetPlan(
        deployments=plans,
        shortfalls=shortfalls,
        free_nodes=free,
        solver=solver,
        variants=variants,
        curves_computed=c.computed,
        curves_cached=c.cached,
        solve_s=solve_s,
    )


def _shortfall(
    req: PlanRequest,
    c: Candidates,
    d: FleetDeployment,
    plans: Mapping[str, DeploymentPlan],
    short: float,
) -> Shortfall:
    """Why ``d`` is short by ``short`` requests/s and what would serve the rest."""
    tokens = short * d.traffic.output_len.mean
    amount = (
        f"{short:.3g} requests/s ({tokens:,.0f} output tokens/s) of {d.traffic.requests_per_s:.3g}"
    )
    if not any(c.eligible[d.name]):
        return Shortfall(
            d.name,
            "nodes",
            short,
            tokens,
            "nodes matching its node selector",
            f"no node is eligible for {d.name} (node selector {dict(d.spec.node_selector)}). "
            "To fix: label nodes or change the node selector",
        )
    # (USD per request/s, key, requests/s of one instance (pair), its USD/h, GPUs, counts)
    options: list[tuple[float, str, float, float, int, tuple[int, ...]]] = []
    for v in c.aggregated[d.name]:
        rate = v.sizing.requests_per_s
        options.append((v.usd_per_hour / rate, v.key, rate, v.usd_per_hour, v.gpus, v.counts))
    for p in c.pairs[d.name]:
        rate = min(p.prefill.sizing.requests_per_s, p.decode.sizing.requests_per_s)
        usd = p.prefill.usd_per_hour + p.decode.usd_per_hour
        vec = tuple(a + b for a, b in zip(p.prefill.counts, p.decode.counts, strict=True))
        options.append((usd / rate, p.key, rate, usd, p.prefill.gpus + p.decode.gpus, vec))
    if not options:
        seen = "; ".join(c.reasons[d.name][:3])
        return Shortfall(
            d.name,
            "slo",
            short,
            tokens,
            "a looser SLO or faster GPUs",
            f"{d.name} misses {amount}: no instance on this fleet meets TTFT "
            f"{d.slo.ttft_ms:g} ms and TPOT {d.slo.tpot_ms:g} ms at p{d.slo.percentile:g} "
            f"({seen}). To fix: relax the SLO, shorten the prompts or add faster GPUs",
        )
    options.sort()
    _, key, rate, usd, gpus, vec = options[0]
    need = math.ceil(short / rate - 1e-9)
    parts = [
        f"{need * k} more node{'s' if need * k != 1 else ''} of {g.label}"
        for g, k in zip(c.groups, vec, strict=True)
        if k
    ]
    fix = " and ".join(parts) + f" (as {need} more {key})"
    mine = plans[d.name]
    budget = d.budget_usd_per_hour
    if budget > 0 and mine.usd_per_hour + usd > budget + 1e-9:
        return Shortfall(
            d.name,
            "budget",
            short,
            tokens,
            f"a budget of {mine.usd_per_hour + need * usd:.1f} USD/h",
            f"{d.name} misses {amount}: its budget of {budget:g} USD/h is spent "
            f"({mine.usd_per_hour:.1f} USD/h). To fix: raise the budget to "
            f"{mine.usd_per_hour + need * usd:.1f} USD/h or relax the SLO",
        )
    if d.budget_gpus > 0 and mine.gpus + gpus > d.budget_gpus:
        return Shortfall(
            d.name,
            "budget",
            short,
            tokens,
            f"a budget of {mine.gpus + need * gpus} GPUs",
            f"{d.name} misses {amount}: its budget of {d.budget_gpus} GPUs is used "
            f"({mine.gpus}). To fix: raise the budget to {mine.gpus + need * gpus} GPUs",
        )
    holders = sorted(
        {
            o.deployment
            for o in plans.values()
            if o.deployment != d.name
            and req_priority(req, o.deployment) >= d.priority
            and any(
                x in _eligible(req.fleet, d)
                for p in o.pools
                for g in p.groups()
                for inst in g.nodes
                for x in inst
            )
        }
    )
    held = f"; the nodes it may use are held by {', '.join(holders)}" if holders else ""
    return Shortfall(
        d.name,
        "gpus",
        short,
        tokens,
        fix,
        f"{d.name} misses {amount}{held}. To fix: add {fix}, lower its demand or raise its "
        "priority",
    )


def req_priority(req: PlanRequest, name: str) -> int:
    """The priority of deployment ``name``."""
    return next(d.priority for d in req.deployments if d.name == name)
