"""A fleet plan as documents: the ``FleetPlan`` document of ``mixfleetctl schedule show -o
json`` and, per deployment, the serving simulator's
:class:`~policies.serving.plan.ServingPlan` (whose document, ``servingPlan`` in the fleet
plan document, ``mixfleetctl serve simulate`` reads).

Fleet plan document::

    kind: FleetPlan
    solver: HiGHS optimal
    usdPerHour: 84.6
    goodputOutputTokensPerS: 9416
    freeNodes: [a100-0]
    curves: {computed: 12, cached: 0}
    deployments:
      - name: dsv3
        priority: 10
        demand: {requestsPerS: 20, outputTokensPerS: 10240}
        served: {requestsPerS: 10.8, outputTokensPerS: 5530}
        slo: {ttftMs: 2000, tpotMs: 50, percentile: 90}
        predicted: {ttftMs: 154, tpotMs: 43.8}
        usdPerHour: 30.4
        usdPerMillionTokens: 1.53
        gpus: 8
        pools:
          - name: 1x8xH200-SXM-141GB/aggregated
            requestsPerS: 10.8
            predicted: {ttftMs: 154, tpotMs: 43.8}
            instances: [{variant: ..., role: aggregated, makeUp: "1x (8x H200-SXM-141GB)",
                         count: 1, nodes: [[h200-0]], batchLimit: 325,
                         workload: {phase: decode, tokensPerGpu: 40, contextLen: 4608},
                         gpus: 8, attentionTp: 1, expertParallel: 8, requestsPerSEach: 10.8,
                         usdPerHourEach: 30.4}]
            kvPath: {gbytesPerS: 42.5, latencyUs: 25, path: RDMA ib0}   # P/D pools only
        servingPlan: {pools: [...]}        # policies.serving.plan document
        traffic: {...}                     # spec.traffic document (served rate)
    shortfalls:
      - {deployment: dsv3, resource: gpus, missingRequestsPerS: 9.2,
         missingOutputTokensPerS: 4713, fix: "1 more node of 8x H200-SXM-141GB ...",
         message: "..."}

Pure: no I/O.
"""

from __future__ import annotations

import math
from typing import Any

from policies.fleetplan.types import DeploymentPlan, FleetPlan, PlannedGroup, PlannedPool
from policies.serving.plan import (
    InstanceGroup,
    KvPath,
    Pool,
    ServingPlan,
    plan_to_doc,
)
from policies.serving.traffic import Traffic, slo_to_doc, traffic_to_doc


def _round(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def instance_group(g: PlannedGroup, chunk_tokens: int) -> InstanceGroup:
    """The simulator's instance group of a planned group."""
    curve = g.variant.curve
    role = g.variant.role
    return InstanceGroup(
        count=g.count,
        curve=curve,
        batch_limit=0 if role == "prefill" else g.batch_limit,
        chunk_tokens=g.batch_limit if role == "prefill" else chunk_tokens,
        usd_per_hour=g.variant.usd_per_hour,
        label=f"{g.variant.make_up}, {role}, EP{g.variant.expert_parallel}",
    )


def serving_plan(dp: DeploymentPlan, chunk_tokens: int) -> ServingPlan | None:
    """The serving simulator's plan of one deployment (None when nothing serves it); each
    pool's share is the traffic the planner sends it."""
    pools: list[Pool] = []
    for p in dp.pools:
        share = p.requests_per_s if p.requests_per_s > 0 else 1e-9
        if p.instances is not None:
            pools.append(Pool(p.name, share, instances=instance_group(p.instances, chunk_tokens)))
        elif p.prefill is not None and p.decode is not None:
            pools.append(
                Pool(
                    p.name,
                    share,
                    prefill=instance_group(p.prefill, chunk_tokens),
                    decode=instance_group(p.decode, chunk_tokens),
                    kv_path=KvPath(p.kv_gbytes_per_s, p.kv_latency_us),
                )
            )
    return ServingPlan(tuple(pools)) if pools else None


def planned_workload(g: PlannedGroup, traffic: Traffic) -> dict[str, Any]:
    """What one instance of ``g`` is planned to run, per GPU, as a deployment's ``workload``
    block: the batch the planner sized and the KV each sequence reserves (prefill: its
    prompt-token budget and the mean prompt; aggregated and decode: its sequences and the
    mean prompt plus output, as :func:`policies.fleetplan.sizing` reserves them). The engine
    placement of the instance is solved at this workload (``plan launch --fleet-plan``)."""
    gpus = max(1, g.variant.gpus)
    isl = traffic.input_len.mean
    if g.variant.role == "prefill":
        return {
            "phase": "prefill",
            "tokensPerGpu": max(1, g.batch_limit // gpus),
            "contextLen": max(1, math.ceil(isl)),
        }
    return {
        "phase": "decode",
        "tokensPerGpu": max(1, g.batch_limit // gpus),
        "contextLen": max(1, math.ceil(isl + max(1.0, traffic.output_len.mean))),
    }


def _group_doc(g: PlannedGroup, traffic: Traffic) -> dict[str, Any]:
    v = g.variant
    return {
        "variant": v.key,
        "role": v.role,
        "makeUp": v.make_up,
        "count": g.count,
        "nodes": [list(n) for n in g.nodes],
        "batchLimit": g.batch_limit,
        "workload": planned_workload(g, traffic),
        "gpus": v.gpus,
        "attentionTp": v.attention_tp,
        "expertParallel": v.expert_parallel,
        "requestsPerSEach": _round(v.sizing.requests_per_s),
        "usdPerHourEach": _round(v.usd_per_hour),
    }


def _pool_doc(p: PlannedPool, traffic: Traffic) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "name": p.name,
        "requestsPerS": _round(p.requests_per_s),
        "capacityRequestsPerS": _round(p.capacity_requests_per_s),
        "predicted": {"ttftMs": _round(p.ttft_ms), "tpotMs": _round(p.tpot_ms)},
    }
    if p.instances is not None:
        doc["instances"] = [_group_doc(p.instances, traffic)]
    else:
        doc["instances"] = [_group_doc(g, traffic) for g in p.groups()]
        doc["kvPath"] = {
            "gbytesPerS": _round(p.kv_gbytes_per_s),
            "latencyUs": _round(p.kv_latency_us),
            "path": p.kv_path,
        }
    return doc


def deployment_doc(dp: DeploymentPlan, chunk_tokens: int) -> dict[str, Any]:
    """One deployment's part of the fleet plan document."""
    osl = dp.traffic.output_len.mean
    doc: dict[str, Any] = {
        "name": dp.deployment,
        "priority": dp.priority,
        "demand": {
            "requestsPerS": _round(dp.demand_requests_per_s),
            "outputTokensPerS": _round(dp.demand_requests_per_s * osl),
        },
        "served": {
            "requestsPerS": _round(dp.served_requests_per_s),
            "outputTokensPerS": _round(dp.goodput_output_tokens_per_s),
        },
        "slo": slo_to_doc(dp.slo),
        "predicted": {"ttftMs": _round(dp.ttft_ms), "tpotMs": _round(dp.tpot_ms)},
        "usdPerHour": _round(dp.usd_per_hour),
        "usdPerMillionTokens": _round(dp.usd_per_million_tokens)
        if dp.served_requests_per_s > 0
        else None,
        "gpus": dp.gpus,
        "pools": [_pool_doc(p, dp.traffic) for p in dp.pools],
    }
    sp = serving_plan(dp, chunk_tokens)
    if sp is not None:
        doc["servingPlan"] = plan_to_doc(sp)
        doc["traffic"] = traffic_to_doc(
            dp.traffic.scaled(dp.served_requests_per_s / dp.demand_requests_per_s)
        )
    return doc


def plan_doc(plan: FleetPlan, chunk_tokens: int) -> dict[str, Any]:
    """The ``FleetPlan`` document (the module docstring shows its form)."""
    return {
        "kind": "FleetPlan",
        "solver": plan.solver,
        "usdPerHour": _round(plan.usd_per_hour),
        "goodputOutputTokensPerS": _round(plan.goodput_output_tokens_per_s),
        "freeNodes": list(plan.free_nodes),
        "curves": {"computed": plan.curves_computed, "cached": plan.curves_cached},
        "deployments": [deployment_doc(d, chunk_tokens) for d in plan.deployments.values()],
        "shortfalls": [
            {
                "deployment": s.deployment,
                "resource": s.resource,
                "missingRequestsPerS": _round(s.missing_requests_per_s),
                "missingOutputTokensPerS": _round(s.missing_output_tokens_per_s),
                "fix": s.fix,
                "message": s.message,
            }
            for s in plan.shortfalls.values()
        ],
    }
