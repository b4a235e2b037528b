"""Prefill/decode pairs: a deployment's prefill variants matched to its decode variants over
the KV path between their nodes (:func:`kv_path`; a pair without an RDMA or NVLink path is
not a candidate), each pair sized together (:func:`policies.fleetplan.sizing.size_pair`).

Units: GB/s, microseconds, USD per hour. Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from policies.estimate.costmodel import Efficiency
from policies.fleetplan.sizing import size_pair
from policies.fleetplan.types import FleetDeployment, PlanRequest, Variant
from policies.hardware.fleet import Fleet, Node
from policies.scheduling.types import NodeGroup


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


def _per_request_usd(v: Variant) -> float:
    return v.usd_per_hour / v.sizing.requests_per_s if v.sizing.requests_per_s > 0 else math.inf


def pairs_for(
    d: FleetDeployment,
    prefill: Sequence[Variant],
    decode: Sequence[Variant],
    fleet: Fleet,
    groups: Sequence[NodeGroup],
    req: PlanRequest,
    eligible: Sequence[int],
) -> tuple[Pair, ...]:
    """Prefill/decode pairs with a KV path: the cheapest decode variants per request and
    for each its cheapest prefill partners and its own make-up's prefill variant. A pair
    whose two instances together need more nodes of a group than the deployment may use
    (``eligible``: nodes per group) is not a candidate, so it takes no partner's place."""
    s = req.settings
    if d.disaggregation == "off" or not decode or not prefill:
        return ()
    kept = sorted(decode, key=lambda v: (_per_request_usd(v), v.key))[: s.decode_variants]
    out: list[Pair] = []
    for q in kept:
        options: list[Pair] = []
        for p in prefill:
            if any(a + b > cap for a, b, cap in zip(p.counts, q.counts, eligible, strict=True)):
                continue
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
                queueing=s.queueing,
                decode_batch_cap=d.batch_cap(q.gpus),
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
