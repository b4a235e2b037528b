"""What the standalone controller writes in the statuses of engine instances and of the
planned deployments they serve, and the phase of a planned deployment
(:class:`~controlplane.server.controller.instances.Instances` writes them).

Pure functions of the last fleet plan and the instance records: no store, no clock.

* An instance's status carries its :class:`InstanceRecord` under ``INSTANCE_KEY``, its nodes
  and a ``scheduling`` block saying what it does (serves, retires or drains) for which
  deployment, role and pool.
* A planned deployment's status lists its instances under ``INSTANCES_KEY`` and the plan's
  summary under :data:`FLEET_PLAN_KEY` (``demand_requests_per_s``,
  ``served_requests_per_s``, predicted ``ttft_ms`` / ``tpot_ms``, ``usd_per_hour``,
  ``gpus``, ``solver`` and ``shortfalls``: ``resource``, ``missing_requests_per_s``,
  ``fix``, ``message``).
* Its phase (:func:`parent_phase`) is ``ready`` when every live (neither retiring nor
  draining) instance is committed and the plan serves its demand, ``rolling_out`` while
  instances are not committed yet, ``degraded`` when all are but the plan is short (or some
  instance cannot be planned while others serve), ``failed`` when an instance cannot be
  planned and none serves, ``pending`` when nothing serves it.

Units: requests per second, milliseconds (``_ms``), USD per hour, output tokens per second.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from controlplane.server.controller.instance_records import (
    INSTANCE_KEY,
    INSTANCES_KEY,
    InstanceRecord,
)
from policies.fleetplan.types import FleetPlan

#: Status key of a planned deployment's fleet plan summary.
FLEET_PLAN_KEY = "fleet_plan"
#: Phase message of a planned deployment before the first fleet plan.
WAITING_PLAN = "waiting for the fleet planner"


def instance_status(r: InstanceRecord, plan: FleetPlan | None, gpus: int | None) -> dict[str, Any]:
    """The status updates of an instance with record ``r`` under ``plan`` (the last fleet
    plan, None before the first); ``gpus``: its GPUs, when known (None leaves them)."""
    verb = (
        "drains"
        if r.draining
        else "retires (serves until its replacements are committed)"
        if r.retiring
        else "serves"
    )
    dp = plan.deployments.get(r.of) if plan is not None else None
    output_tokens = dp.traffic.output_len.mean if dp is not None else 0.0
    updates: dict[str, Any] = {
        INSTANCE_KEY: r.to_status(),
        "assigned_nodes": list(r.nodes),
        "scheduling": {
            "placed": True,
            "reason": f"instance of {r.of}: {verb} as {r.role} in pool {r.pool}, "
            f"planned by the fleet planner at {r.requests_per_s:.3g} requests/s",
            "resource": "",
            "missing": 0,
            "missing_unit": "",
            "predicted_tokens_per_s": 0.0 if r.dropped else r.requests_per_s * output_tokens,
            "decision": "draining" if r.draining else "retiring" if r.retiring else "",
            "solver": plan.solver if plan is not None else "",
        },
    }
    if gpus is not None:
        updates["assigned_gpus"] = gpus
    return updates


def parent_status(
    parent: str, plan: FleetPlan | None, records: Mapping[str, InstanceRecord]
) -> dict[str, Any]:
    """The status updates of the planned deployment ``parent``: its instances (live,
    retiring and draining, from ``records``: instance -> record) and the summary of
    ``plan`` (the last fleet plan, None before the first)."""
    dp = plan.deployments.get(parent) if plan is not None else None
    short = plan.shortfalls.get(parent) if plan is not None else None
    names = sorted(n for n, r in records.items() if r.of == parent)
    nodes = sorted({n for r in records.values() if r.of == parent for n in r.nodes})
    summary: dict[str, Any] = {}
    if dp is not None and plan is not None:
        summary = {
            "demand_requests_per_s": dp.demand_requests_per_s,
            "served_requests_per_s": dp.served_requests_per_s,
            "ttft_ms": dp.ttft_ms,
            "tpot_ms": dp.tpot_ms,
            "usd_per_hour": dp.usd_per_hour,
            "gpus": dp.gpus,
            "solver": plan.solver,
            "shortfalls": []
            if short is None
            else [
                {
                    "resource": short.resource,
                    "missing_requests_per_s": short.missing_requests_per_s,
                    "fix": short.fix,
                    "message": short.message,
                }
            ],
        }
    return {
        INSTANCES_KEY: names,
        FLEET_PLAN_KEY: summary,
        "assigned_nodes": nodes,
        "assigned_gpus": dp.gpus if dp is not None else 0,
        "scheduling": {
            "placed": bool(dp is not None and dp.pools),
            "reason": short.message
            if short is not None
            else f"served by {len(names)} engine instances",
            "resource": short.resource if short is not None else "",
            "missing": 0,
            "missing_unit": "",
            "predicted_tokens_per_s": dp.goodput_output_tokens_per_s if dp else 0.0,
            "decision": "",
            "solver": plan.solver if plan is not None else "",
        },
    }


def parent_phase(
    parent: str,
    plan: FleetPlan | None,
    records: Mapping[str, InstanceRecord],
    states: Mapping[str, tuple[bool, str]],
    *,
    error: str = "",
    failure: str = "",
) -> tuple[str, str]:
    """``(phase, message)`` of the planned deployment ``parent`` (see the module docstring).

    Args:
        parent: the planned deployment.
        plan: the last fleet plan adopted (None before the first).
        records: every instance (live, retiring and draining) by name.
        states: instance -> ``(committed, failure)`` (the instances not draining).
        error: why ``parent``'s instances cannot be written ("" for none).
        failure: why the last fleet plan failed ("" when it did not).
    """
    if error:
        return "failed", error
    if failure:
        return "failed", f"fleet plan failed: {failure}"
    if plan is None or parent not in plan.deployments:
        return "pending", WAITING_PLAN
    short = plan.shortfalls.get(parent)
    live = [n for n, r in records.items() if r.of == parent and not r.dropped]
    if not live:
        return "pending", short.message if short else "the fleet plan gives it no instance"
    done = sum(1 for n in live if states.get(n, (False, ""))[0])
    retiring = sum(1 for r in records.values() if r.of == parent and r.retiring)
    drains = sum(1 for r in records.values() if r.of == parent and r.draining)
    words = [f"{done} of {len(live)} instances committed"]
    if retiring:
        words.append(f"{retiring} retiring")
    if drains:
        words.append(f"{drains} draining")
    if short is not None:
        words.append(short.message)
    failed = [f"{n}: {states[n][1]}" for n in live if n in states and states[n][1]]
    if failed:
        phase = "degraded" if done else "failed"
        return phase, "; ".join([*words, *failed])[:1024]
    if done < len(live):
        return "rolling_out", "; ".join(words)[:1024]
    if short is not None:
        return "degraded", "; ".join(words)[:1024]
    return "ready", ""


__all__ = ["FLEET_PLAN_KEY", "WAITING_PLAN", "instance_status", "parent_phase", "parent_status"]
