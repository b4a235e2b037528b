"""The ModelDeployment status, rebuilt from the observation on every tick: the ``Solved``,
``RolledOut``, ``Degraded`` and ``InteractiveSLO`` conditions, ``status.tiers`` of a tier
split, and the cost of the current plan (USD per hour and per million tokens). Pure.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from datetime import datetime

from apis.kube.errors import PermanentError
from apis.kube.names import (
    config_map_name,
    rfc3339,
)
from apis.kube.v1alpha1 import (
    Condition,
    ModelDeploymentStatus,
    PartitionPlanSpec,
    PlanRef,
    SolveRecord,
    TierAddition,
    TierReplica,
    TiersStatus,
)
from operators.inputs import (
    SolveInputs,
    effective_prices,
)
from operators.observe import (
    Observed,
    PlanView,
    SolveOutcome,
    TierOutcome,
)
from policies.advice.cost import PriceTable, usd_per_million_tokens
from policies.advice.tiers import TierPlan
from policies.errors import InputError

SOLVED, ROLLED_OUT, DEGRADED = "Solved", "RolledOut", "Degraded"


INTERACTIVE_SLO = "InteractiveSLO"


def _targets(observed: Observed) -> str:
    tier = observed.policy.interactive
    if tier is None:
        return "the SLO"
    parts = []
    if tier.tpot_ms is not None:
        parts.append(f"TPOT {tier.tpot_ms:g} ms")
    if tier.ttft_ms is not None:
        parts.append(f"TTFT {tier.ttft_ms:g} ms")
    return " / ".join(parts)


def tiers_status(outcome: TierOutcome, observed: Observed, now: datetime) -> TiersStatus:
    """``status.tiers`` of a split (or of a failed attempt)."""
    when = rfc3339(now)
    duration = round(outcome.duration_s, 3)
    tp = outcome.plan
    if tp is None:
        return TiersStatus(
            inputs_digest=outcome.inputs_digest,
            outcome="Failed",
            reason=outcome.reason,
            message=outcome.message[:8192],
            time=when,
            duration_s=duration,
        )
    inter = tp.interactive
    replicas = tuple(
        TierReplica(
            nodes=r.nodes,
            gpu_model=r.gpu_model,
            gpus=len(r.result.plan.gpus),
            decode_tokens_per_gpu=r.decode_tokens_per_gpu,
            prefill_tokens_per_gpu=r.prefill_tokens_per_gpu,
            tpot_ms=round(r.tpot_ms, 3),
            ttft_ms=round(r.ttft_ms, 3),
            requests_per_s=round(r.requests_per_s, 3),
        )
        for r in inter.replicas
    )
    additions = tuple(
        TierAddition(
            gpu_model=a.gpu_model,
            nodes=a.nodes,
            gpus_per_node=a.gpus_per_node,
            usd_per_hour=round(a.usd_per_hour, 2) if a.usd_per_hour is not None else None,
        )
        for a in inter.additions[:32]
    )
    return TiersStatus(
        inputs_digest=outcome.inputs_digest,
        outcome="Succeeded",
        reason="SLOMet" if inter.slo_met else "SLONotMet",
        message=_tiers_message(observed, tp, replicas, additions)[:8192],
        time=when,
        slo_met=inter.slo_met,
        demand_requests_per_s=round(inter.demand_requests_per_s, 3),
        capacity_requests_per_s=round(inter.capacity_requests_per_s, 3),
        interactive_nodes=inter.nodes,
        batch_nodes=tp.batch.nodes,
        replicas=replicas,
        additions=additions,
        duration_s=duration,
    )


def _tiers_message(
    observed: Observed,
    tp: TierPlan,
    replicas: Sequence[TierReplica],
    additions: Sequence[TierAddition],
) -> str:
    """The message of ``status.tiers``: the replicas serving the SLO, or what to add to
    meet it."""
    inter = tp.interactive
    targets = _targets(observed)
    demand = inter.demand_requests_per_s
    capacity = inter.capacity_requests_per_s
    batch = ", ".join(tp.batch.nodes) or "none"
    if inter.slo_met and not replicas:
        return (
            f"interactive.requestsPerS is {demand:g}: no interactive replica; every "
            f"eligible node is in the batch tier ({batch})"
        )
    if inter.slo_met:
        return (
            f"{len(replicas)} interactive replica(s) ("
            + "; ".join(", ".join(r.nodes) for r in replicas)
            + f") serve {capacity:.2f} requests/s within {targets} ({demand:.2f} asked; "
            f"predicted TPOT {inter.tpot_ms or 0.0:.2f} ms, TTFT {inter.ttft_ms or 0.0:.2f} "
            f"ms); batch tier, this deployment's plan: {batch}"
        )
    fixes = "; ".join(
        f"{a.nodes} node(s) of {a.gpus_per_node}x {a.gpu_model}"
        + (f" ({a.usd_per_hour:.2f} USD/h)" if a.usd_per_hour is not None else "")
        for a in additions[:5]
    )
    adds = (
        f"To meet it, add any one of: {fixes}; or lower interactive.requestsPerS or "
        "relax its targets"
        if fixes
        else "No catalog GPU meets these targets. To fix: relax tpotMs / ttftMs or shorten "
        "promptTokens / outputTokens"
    )
    why = [x for x in inter.reasons if not x.startswith("the eligible units serve")]
    return (
        f"the interactive tier cannot meet its SLO: the eligible NVLink domains serve "
        f"{capacity:.2f} requests/s within {targets}, {demand:.2f} asked. {adds}."
        + (f" Not eligible: {'; '.join(why)}." if why else "")
        + f" Meanwhile the interactive tier keeps {', '.join(inter.nodes) or 'no node'}; "
        f"batch tier: {batch}"
    )


def condition(
    previous: Sequence[Condition],
    type_: str,
    status: str,
    reason: str,
    message: str,
    generation: int,
    now: datetime,
) -> Condition:
    """A condition; keeps the old lastTransitionTime when its status did not change."""
    old = next((c for c in previous if c.type == type_), None)
    since = old.last_transition_time if old is not None and old.status == status else rfc3339(now)
    return Condition(
        type=type_,
        status=status,
        reason=reason,
        message=message[:32768],
        last_transition_time=since,
        observed_generation=generation,
    )


def _rollout(plan: PlanView, namespace: str) -> tuple[str, str, str]:
    """``(status, reason, message)`` of the RolledOut condition for a plan of a deployment
    in ``namespace``: what it waits for - the controller of that namespace while no agent
    acknowledged the plan, else the agents that have not committed it."""
    states = {n.node: n for n in plan.status.nodes}
    nodes = plan.spec.nodes
    failed = [states[n] for n in nodes if n in states and states[n].state in ("Failed", "Aborted")]
    if failed:
        detail = "; ".join(
            f"{f.node}: {f.reason or f.state} {f.message}".strip() for f in failed[:5]
        )
        return "False", "RolloutFailed", f"plan v{plan.spec.version} failed on {detail}"
    done = [n for n in nodes if n in states and states[n].state == "Committed"]
    if len(done) == len(nodes):
        return "True", "RolledOut", f"all {len(nodes)} nodes committed plan v{plan.spec.version}"
    waiting = [n for n in nodes if n not in done]
    heard = [n for n in nodes if n in states]
    who = (
        f"the agents on {', '.join(waiting[:10])} to commit it"
        if heard
        else f"the controller to roll it out to {', '.join(waiting[:10])} (no agent has "
        f"acknowledged it yet: a controller with --store kubernetes:{namespace} rolls out "
        "the PartitionPlans of this namespace)"
    )
    return (
        "False",
        "RolloutPending",
        f"{len(done)}/{len(nodes)} nodes committed plan v{plan.spec.version}; waiting for {who}",
    )


def deployment_status(
    observed: Observed,
    inputs: SolveInputs | None,
    input_error: PermanentError | None,
    current: PlanView | None,
    ours: PlanView | None,
    record: SolveRecord | None,
    solve: SolveOutcome | None,
    cm_wanted: bool,
    tiers: TiersStatus | None = None,
) -> ModelDeploymentStatus:
    """The deployment's status for this tick.

    Args:
        observed: what this tick observed.
        inputs: the solve's inputs; None when the spec cannot be solved.
        input_error: why not.
        current: the plan in force (None: no plan yet).
        ours: the operator's newest plan.
        record: ``status.lastSolve``.
        solve: this tick's solve outcome, if any.
        cm_wanted: the engine export ConfigMap is wanted.
        tiers: ``status.tiers`` of the tier split in use.
    """
    d = observed.deployment
    gen, now, prev = d.generation, observed.now, d.status.conditions
    solved = _solved(observed, inputs, input_error, ours, record, solve)
    rolled = (
        _rollout(current, d.namespace)
        if current is not None
        else ("False", "NoPlan", "no plan yet")
    )
    degraded = _degraded(inputs, current, solved, rolled, observed.unreadable_plans)
    conditions: tuple[Condition, ...] = (
        condition(prev, SOLVED, *solved, gen, now),
        condition(prev, ROLLED_OUT, *rolled, gen, now),
        condition(prev, DEGRADED, *degraded, gen, now),
    )
    slo = _interactive_slo(observed, tiers, input_error)
    if slo is not None:
        conditions += (condition(prev, INTERACTIVE_SLO, *slo, gen, now),)
    assigned = _assigned_gpus(observed)
    if current is None:
        return ModelDeploymentStatus(
            observed_generation=gen,
            conditions=conditions,
            last_solve=record,
            tiers=tiers,
            assigned_gpus=assigned,
        )
    s = current.spec
    prices = inputs.prices if inputs is not None else None
    if prices is None:
        with contextlib.suppress(PermanentError):
            prices = effective_prices(observed)
    per_hour, per_mtok = plan_spec_cost(s, prices) if prices is not None else (None, None)
    return ModelDeploymentStatus(
        observed_generation=gen,
        conditions=conditions,
        current_plan=PlanRef(current.name, s.plan_id, s.version),
        predicted_step_time_us=s.step_time_us,
        predicted_tokens_per_s=s.tokens_per_s,
        cost_per_hour_usd=per_hour,
        cost_per_million_tokens_usd=per_mtok,
        tiers=tiers,
        gpus=len(s.gpus),
        assigned_gpus=assigned,
        nodes=s.nodes,
        config_map=config_map_name(d.name) if cm_wanted else None,
        last_solve=record,
    )


def _assigned_gpus(observed: Observed) -> int | None:
    """GPUs on the GPUNodes the fleet scheduler assigns (None without the scheduler)."""
    if observed.assigned_nodes is None:
        return None
    mine = set(observed.assigned_nodes)
    return sum(n.status.gpu_count or 0 for n in observed.nodes if n.name in mine)


def _solved(
    observed: Observed,
    inputs: SolveInputs | None,
    input_error: PermanentError | None,
    ours: PlanView | None,
    record: SolveRecord | None,
    solve: SolveOutcome | None,
) -> tuple[str, str, str]:
    """``(status, reason, message)`` of the Solved condition."""
    if input_error is not None:
        return "False", input_error.reason, str(input_error)
    if (
        solve is not None
        and inputs is not None
        and solve.inputs_digest == inputs.digest
        and solve.plan is None
    ):
        return "False", solve.reason, solve.message
    if ours is not None and inputs is not None and ours.spec.inputs_digest == inputs.digest:
        s = ours.spec
        msg = (
            f"plan v{s.version} ({s.plan_id}) places {s.model} on {len(s.gpus)} GPUs of "
            f"{len(s.nodes)} nodes: step {s.step_time_us:.0f} us, {s.tokens_per_s:.0f} tokens/s "
            f"({s.policy})"
        )
        if inputs.redundant_note:
            msg += f"; {inputs.redundant_note}"
        return "True", SOLVED, msg
    if (
        record is not None
        and inputs is not None
        and record.outcome == "Failed"
        and record.inputs_digest == inputs.digest
    ):
        old = next((c for c in observed.deployment.status.conditions if c.type == SOLVED), None)
        keep = old.message if old is not None and old.reason == record.reason else ""
        return "False", record.reason, keep or f"the last solve failed: {record.reason}"
    return "Unknown", "Solving", "a new plan is being solved"


def _degraded(
    inputs: SolveInputs | None,
    current: PlanView | None,
    solved: tuple[str, str, str],
    rolled: tuple[str, str, str],
    unreadable: Sequence[str] = (),
) -> tuple[str, str, str]:
    """``(status, reason, message)`` of the Degraded condition: the current plan uses nodes
    no longer eligible, was solved for earlier inputs, or failed to roll out; or some of
    the deployment's PartitionPlans do not parse (``unreadable``, left alone); or no plan
    serves it (``NotServing``: True when it cannot be planned now - unschedulable,
    preempted, a bad spec - Unknown while its first plan is being made)."""
    if current is None:
        if solved[0] == "False":
            return "True", "NotServing", f"no plan serves it: {solved[1]}: {solved[2]}"
        return "Unknown", "NotServing", f"no plan serves it yet: {solved[2]}"
    eligible = {n.name for n in inputs.fleet_view.fleet.nodes} if inputs else set()
    lost = [n for n in current.spec.nodes if inputs is not None and n not in eligible]
    if lost:
        why = inputs.fleet_view.excluded if inputs else {}
        detail = ", ".join(f"{n} ({why.get(n, 'not selected')})" for n in lost[:10])
        return (
            "True",
            "NodesUnavailable",
            f"plan v{current.spec.version} uses nodes that are no longer eligible: {detail}",
        )
    if solved[0] == "False":
        return (
            "True",
            "ServingOutdatedPlan",
            f"serving plan v{current.spec.version}, solved for earlier inputs: {solved[2]}",
        )
    if rolled[1] == "RolloutFailed":
        return "True", "RolloutFailed", rolled[2]
    if unreadable:
        return (
            "True",
            "UnreadablePlan",
            f"PartitionPlans that do not parse are left alone: {'; '.join(unreadable[:5])}. "
            "To fix: delete them (kubectl delete partitionplan NAME); new versions go above",
        )
    return "False", "AsExpected", "serving the plan for the current spec and fleet"


def _interactive_slo(
    observed: Observed, tiers: TiersStatus | None, input_error: PermanentError | None
) -> tuple[str, str, str] | None:
    """``(status, reason, message)`` of the InteractiveSLO condition; None without an
    interactive tier."""
    if observed.policy.interactive is None:
        return None
    if tiers is None:
        why = f"{input_error.reason}: {input_error}" if input_error else "not planned yet"
        return "Unknown", "NotPlanned", f"the tier split waits for a solvable deployment ({why})"
    if tiers.outcome == "Failed":
        return "False", tiers.reason, tiers.message
    return ("True" if tiers.slo_met else "False"), tiers.reason, tiers.message


def plan_spec_cost(
    spec: PartitionPlanSpec, prices: PriceTable
) -> tuple[float | None, float | None]:
    """``(USD per hour, USD per million tokens)`` of a plan: its GPUs at ``prices`` over its
    predicted tokens/s. ``(None, None)`` when a GPU model has no price; the per-token cost
    is None when the plan produces nothing."""
    try:
        per_hour = sum(prices.price(g.model) for g in spec.gpus)
    except InputError:
        return None, None
    per_mtok = usd_per_million_tokens(per_hour, spec.tokens_per_s)
    return round(per_hour, 4), (round(per_mtok, 6) if math.isfinite(per_mtok) else None)
