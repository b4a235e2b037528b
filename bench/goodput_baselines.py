"""The goodput benchmark's hand-made plans, each as a serving plan for the simulator:
(a) one instance over every GPU (:func:`baseline_one`), (b) one aggregated instance per
node group and (c) the aiconfigurator-style prefill/decode split inside each group
(:func:`baseline_split`); the docstring of :mod:`bench.goodput` defines them.

Units: requests per second, USD per hour, GB/s.
"""

from __future__ import annotations

from typing import Any

from bench.goodput_setup import SLO
from policies.advice.cost import fleet_usd_per_hour
from policies.deployment import sub_fleet
from policies.fleetplan import compute_curve, kv_path
from policies.fleetplan.sizing import size_aggregated, size_pair
from policies.hardware.fleet import Fleet
from policies.scheduling.table import fleet_groups
from policies.scheduling.types import NodeGroup
from policies.serving.curves import StepCurve
from policies.serving.plan import DEFAULT_CHUNK_TOKENS, InstanceGroup, KvPath, Pool, ServingPlan
from policies.serving.traffic import Traffic
from policies.spec.build import DeploymentSpec, price_table

AIC_PREFILL, AIC_DECODE = 0.9, 0.92  # aiconfigurator's rate-matching degradation factors

GroupPlan = tuple[Pool, float, float]
"""A node group's pool, its capacity (requests/s) and the price of its GPUs (USD/h)."""


def _group(curve: Any, count: int, batch: int, usd: float, chunk: int, label: str) -> InstanceGroup:
    return InstanceGroup(count, curve, batch, chunk, usd, label)


def baseline_one(fleet: Fleet, sp: DeploymentSpec) -> tuple[ServingPlan | None, float, float, str]:
    """(a) one aggregated instance over every GPU: ``(plan, capacity rps, USD/h, why not)``."""
    assert sp.traffic is not None
    entry = compute_curve(sp, fleet)
    usd = fleet_usd_per_hour(fleet, price_table(sp))
    if entry.curve is None:
        return None, 0.0, usd, entry.reason
    sz = size_aggregated(entry.curve, sp.traffic, SLO)
    if not sz.ok:
        return None, 0.0, usd, sz.reason
    g = _group(entry.curve, 1, sz.batch_limit, usd, DEFAULT_CHUNK_TOKENS, "whole fleet")
    return ServingPlan((Pool("all", 1.0, instances=g),)), sz.requests_per_s, usd, ""


def baseline_split(
    fleet: Fleet, sp: DeploymentSpec, *, pd: bool
) -> tuple[ServingPlan | None, float, float, list[str]]:
    """(b) (``pd`` False) or (c) (``pd`` True): ``(plan, capacity rps, USD/h, notes)``."""
    assert sp.traffic is not None
    pools: list[Pool] = []
    total = usd_total = 0.0
    notes: list[str] = []
    for g in fleet_groups(fleet):
        got = _pd_group(fleet, sp, g) if pd else _aggregated_group(fleet, sp, g)
        if isinstance(got, str):
            notes.append(got)
            continue
        pool, rate, usd = got
        pools.append(pool)
        total += rate
        usd_total += usd
        if pd:
            notes.append(pool.name)
    plan = ServingPlan(tuple(pools)) if pools else None
    return plan, total, usd_total, notes


def _aggregated_group(fleet: Fleet, sp: DeploymentSpec, g: NodeGroup) -> GroupPlan | str:
    """(b) on node group ``g``: one aggregated instance of all its nodes, or why not."""
    assert sp.traffic is not None
    part = sub_fleet(fleet, g.nodes)
    entry = compute_curve(sp, part)
    if entry.curve is None:
        return f"{g.label}: {entry.reason[:80]}"
    sz = size_aggregated(entry.curve, sp.traffic, SLO)
    if not sz.ok:
        return f"{g.label}: {sz.reason}"
    usd = fleet_usd_per_hour(part, price_table(sp))
    grp = _group(entry.curve, 1, sz.batch_limit, usd, DEFAULT_CHUNK_TOKENS, g.label)
    return Pool(g.label, sz.requests_per_s, instances=grp), sz.requests_per_s, usd


def _pd_group(fleet: Fleet, sp: DeploymentSpec, g: NodeGroup) -> GroupPlan | str:
    """(c) on node group ``g``: its workers aggregated or split into prefill and decode,
    whichever serves more, or why neither."""
    assert sp.traffic is not None
    worker = _smallest_worker(fleet, sp, g)
    if worker is None:
        return f"{g.label}: no worker holds the model"
    k, part, curve = worker
    m = len(g.nodes) // k
    usd = fleet_usd_per_hour(part, price_table(sp))
    agg = size_aggregated(curve, sp.traffic, SLO, utilisation=1.0)
    best_rate = m * agg.requests_per_s if agg.ok else 0.0
    best_pool: Pool | None = None
    if agg.ok:
        grp = _group(curve, m, agg.batch_limit, usd, DEFAULT_CHUNK_TOKENS, g.label)
        best_pool = Pool(f"{g.label} agg", best_rate, instances=grp)
    split = _best_pd_split(fleet, g, (k, m, curve, usd), sp.traffic, best_rate)
    if split is not None:
        best_pool, best_rate = split
    if best_pool is None:
        return f"{g.label}: no worker meets the SLO"
    return best_pool, best_rate, m * usd


def _smallest_worker(
    fleet: Fleet, sp: DeploymentSpec, g: NodeGroup
) -> tuple[int, Fleet, StepCurve] | None:
    """(c)'s worker on ``g``: the smallest node count (1, 2, 4, 8) that holds the model,
    ``(nodes, the sub-fleet of them, its curve)``, or None."""
    for k in (1, 2, 4, 8):
        if k > len(g.nodes):
            break
        part = sub_fleet(fleet, g.nodes[:k])
        entry = compute_curve(sp, part)
        if entry.curve is not None:
            return k, part, entry.curve
    return None


def _best_pd_split(
    fleet: Fleet,
    g: NodeGroup,
    worker: tuple[int, int, StepCurve, float],
    tr: Traffic,
    beat: float,
) -> tuple[Pool, float] | None:
    """The prefill:decode split of ``g``'s workers (``worker``: nodes each, workers, curve,
    USD/h each) of the highest aiconfigurator rate (requests/s) above ``beat``:
    ``(pool, rate)``, or None (no KV path between two workers, a role that misses the SLO,
    or no split above ``beat``)."""
    k, m, curve, usd = worker
    node = fleet.node(g.nodes[0])
    path = kv_path(node, fleet.node(g.nodes[-1]), fleet) if m >= 2 else None
    if path is None:
        return None
    nic = node.rdma_per_direction_gbits_per_s / 8.0 * k * 0.85
    pair = size_pair(
        curve,
        curve,
        tr,
        SLO,
        kv_gbytes_per_s=path[0],
        kv_latency_us=path[1],
        prefill_nic_gbytes_per_s=nic,
        decode_nic_gbytes_per_s=nic,
        utilisation=1.0,
    )
    if not (pair.prefill.ok and pair.decode.ok):
        return None
    best: tuple[Pool, float] | None = None
    for n_p in range(1, m):
        n_d = m - n_p
        rate = min(
            AIC_PREFILL * n_p * pair.prefill.requests_per_s,
            AIC_DECODE * n_d * pair.decode.requests_per_s,
        )
        if rate > beat:
            beat = rate
            pool = Pool(
                f"{g.label} P{n_p}D{n_d}",
                rate,
                prefill=_group(curve, n_p, 0, usd, pair.prefill.batch_limit, g.label),
                decode=_group(curve, n_d, pair.decode.batch_limit, usd, 1, g.label),
                kv_path=KvPath(path[0], path[1]),
            )
            best = (pool, rate)
    return best
