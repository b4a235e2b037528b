"""The pure ModelDeployment decision (operators.decide): no API server, no clock, no threads.

Each test builds an observation, runs the decision (and, where it asks for one, a real solve
of a small model), and checks the actions - or applies them to a tiny simulated world and
checks that the next tick has nothing left to do.
"""

from __future__ import annotations

import dataclasses
import json
from datetime import timedelta

import pytest
from k8s_builders import (
    FAST_POLICY,
    T0,
    deployment,
    md_spec,
    node_view,
    observed,
    plan_view_from,
    run_solve,
    with_status,
)

from apis.kube.names import FINALIZER, config_map_name
from apis.kube.v1alpha1 import AgentSession, NodeRollout, PartitionPlanStatus, PlacementPolicySpec
from operators.decide import (
    ApplyConfigMap,
    ApplyPlan,
    ApplyStatus,
    DeleteConfigMap,
    DeletePlan,
    Requeue,
    SetFinalizer,
    SolveAction,
    reconcile,
)
from operators.observe import ConfigMapView, Observed, ReconcileSettings, SolveOutcome

SETTINGS = ReconcileSettings(node_stale_after_s=90.0, plan_history=2, solver_error_retry_s=60.0)


def tick(obs: Observed, settings: ReconcileSettings = SETTINGS) -> tuple[object, ...]:
    """One control-loop tick: decide, solve when asked, decide again."""
    actions = reconcile(obs, settings)
    solve = next((a for a in actions if isinstance(a, SolveAction)), None)
    if solve is None:
        return actions
    outcome = run_solve(solve)
    return reconcile(dataclasses.replace(obs, solve=outcome), settings)


def apply_world(obs: Observed, actions: tuple[object, ...]) -> Observed:
    """The observation after the actions took effect (what the API server would show)."""
    plans = list(obs.plans)
    cm = obs.config_map
    d = obs.deployment
    for a in actions:
        if isinstance(a, ApplyPlan):
            plans.append(plan_view_from(a.body, uid=f"uid-{a.name}"))
        elif isinstance(a, DeletePlan):
            plans = [p for p in plans if p.name != a.name]
        elif isinstance(a, ApplyConfigMap):
            meta = a.body["metadata"]
            cm = ConfigMapView(
                meta["name"], meta["annotations"]["mixfleet.io/plan"], tuple(sorted(a.body["data"]))
            )
        elif isinstance(a, DeleteConfigMap):
            cm = None
        elif isinstance(a, ApplyStatus):
            d = with_status(d, a.status)
        elif isinstance(a, SetFinalizer):
            fins = {*d.finalizers, FINALIZER} if a.present else set(d.finalizers) - {FINALIZER}
            d = dataclasses.replace(d, finalizers=tuple(sorted(fins)))
    return dataclasses.replace(obs, plans=tuple(plans), config_map=cm, deployment=d, solve=None)


def only(actions: tuple[object, ...], kind: type) -> list[object]:
    return [a for a in actions if isinstance(a, kind)]


def status_of(actions: tuple[object, ...]) -> dict[str, object]:
    (st,) = only(actions, ApplyStatus)
    assert isinstance(st, ApplyStatus)
    return st.status


def cond(status: dict[str, object], type_: str) -> dict[str, object]:
    conds = status["conditions"]
    assert isinstance(conds, list)
    return next(c for c in conds if c["type"] == type_)


# --------------------------------------------------------------------------- first plan


def test_new_deployment_gets_finalizer_and_a_solve_over_the_eligible_gpus() -> None:
    obs = observed(deployment(finalizers=()))
    actions = reconcile(obs, SETTINGS)
    assert isinstance(actions[0], SetFinalizer) and actions[0].present
    (solve,) = only(actions, SolveAction)
    assert isinstance(solve, SolveAction)
    req = solve.request
    assert [g.id for g in req.fleet.gpus] == [
        "a100-0/gpu0",
        "a100-0/gpu1",
        "h100-0/gpu0",
        "h100-0/gpu1",
    ]
    assert req.policy == "greedy" and req.form == "engine"
    assert req.redundant_experts == 0  # mixtral: 8 experts already divide by 4 GPUs
    assert req.options.time_limit_s == 5.0
    assert solve.version == 1


def test_solved_plan_is_written_with_owner_labels_configmap_and_status() -> None:
    obs = observed()
    actions = tick(obs)
    (plan,) = only(actions, ApplyPlan)
    assert isinstance(plan, ApplyPlan)
    meta = plan.body["metadata"]
    assert meta["name"] == "mx-v1"
    assert meta["labels"]["mixfleet.io/deployment"] == "mx"
    (owner,) = meta["ownerReferences"]
    assert (
        owner["uid"] == "uid-mx"
        and owner["controller"] is True
        and owner["kind"] == "ModelDeployment"
    )
    spec = plan.body["spec"]
    assert spec["nodes"] == ["a100-0", "h100-0"] and len(spec["gpus"]) == 4
    assert spec["madeBy"] == "operator" and spec["reason"] == "first plan"
    assert spec["deploymentGeneration"] == 1

    (cm,) = only(actions, ApplyConfigMap)
    assert isinstance(cm, ApplyConfigMap)
    loc = json.loads(cm.body["data"]["eplb-state.json"])
    table = loc["physical_to_logical_map"]
    assert len(table) == 32 and all(len(row) == 8 for row in table)  # [layers][E + R]
    assert all(sorted(row) == list(range(8)) for row in table)  # every expert placed once
    sidecar = json.loads(cm.body["data"]["placement-sidecar.json"])
    assert len(sidecar["dp_attention_weights"]) == 4
    assert cm.body["metadata"]["annotations"]["mixfleet.io/plan"] == "mx-v1"

    st = status_of(actions)
    assert cond(st, "Solved")["status"] == "True"
    assert "mixtral-8x7b on 4 GPUs of 2 nodes" in str(cond(st, "Solved")["message"])
    assert cond(st, "RolledOut")["reason"] == "RolloutPending"
    # No agent acknowledged it yet: the message points at the namespace's controller.
    assert "waiting for the controller to roll it out to " in str(cond(st, "RolledOut")["message"])
    assert "--store kubernetes:team-a rolls out" in str(cond(st, "RolledOut")["message"])
    assert cond(st, "Degraded")["status"] == "False"
    assert st["currentPlan"] == {"name": "mx-v1", "planID": spec["planID"], "version": 1}
    assert st["gpus"] == 4 and st["configMap"] == config_map_name("mx")
    assert st["observedGeneration"] == 1
    # Heartbeats are 5 s old of 90 allowed: look again when the first could go stale.
    (rq,) = only(actions, Requeue)
    assert isinstance(rq, Requeue) and rq.after_s == pytest.approx(86.0)


def test_steady_state_has_nothing_to_write() -> None:
    obs = observed()
    world = apply_world(obs, tick(obs))
    again = reconcile(dataclasses.replace(world, now=world.now + timedelta(seconds=10)), SETTINGS)
    assert [type(a) for a in again] == [Requeue]


def test_conditions_keep_their_transition_time_when_unchanged() -> None:
    obs = observed()
    world = apply_world(obs, tick(obs))
    t_solved = cond(status_of(tick(obs)), "Solved")["lastTransitionTime"]
    rolled = PartitionPlanStatus(
        nodes=(NodeRollout("a100-0", "Committed"), NodeRollout("h100-0", "Committed"))
    )
    plan = dataclasses.replace(world.plans[0], status=rolled)
    later = dataclasses.replace(world, plans=(plan,), now=world.now + timedelta(seconds=30))
    st = status_of(reconcile(later, SETTINGS))
    assert cond(st, "RolledOut")["status"] == "True"
    assert cond(st, "RolledOut")["lastTransitionTime"] == "2026-03-01T12:00:35Z"
    assert cond(st, "Solved")["lastTransitionTime"] == t_solved == "2026-03-01T12:00:05Z"


# ------------------------------------------------------------------------------ re-plans


def test_spec_change_solves_again_keeps_previous_plan_in_the_request_and_trims_history() -> None:
    obs = observed()
    world = apply_world(obs, tick(obs))
    # Two spec changes: v2, then v3; history keeps 2.
    for gen, tokens in ((2, 32), (3, 48)):
        d = dataclasses.replace(
            world.deployment,
            generation=gen,
            spec=md_spec(workload={"phase": "decode", "tokensPerGpu": tokens, "contextLen": 2048}),
        )
        world = dataclasses.replace(world, deployment=d)
        first = reconcile(world, SETTINGS)
        (solve,) = only(first, SolveAction)
        assert isinstance(solve, SolveAction)
        assert solve.request.previous is not None  # migration-aware re-plan
        assert solve.version == gen
        actions = tick(world)
        (plan,) = only(actions, ApplyPlan)
        assert isinstance(plan, ApplyPlan)
        assert plan.body["spec"]["reason"] == f"spec changed (generation {gen})"
        world = apply_world(world, actions)
    assert [p.name for p in world.plans] == ["mx-v2", "mx-v3"]
    assert world.config_map is not None and world.config_map.plan == "mx-v3"


def test_cordoned_node_leaves_the_plan_and_the_reason_says_so() -> None:
    obs = observed()
    world = apply_world(obs, tick(obs))
    nodes = (node_view("h100-0"), node_view("a100-0", cordon=True))
    world = dataclasses.replace(world, nodes=nodes)
    actions = tick(world)
    (plan,) = only(actions, ApplyPlan)
    assert isinstance(plan, ApplyPlan)
    assert plan.body["spec"]["nodes"] == ["h100-0"]
    assert plan.body["spec"]["reason"] == "fleet changed: -a100-0 (cordoned)"
    st = status_of(actions)
    assert st["currentPlan"]["name"] == "mx-v2"  # type: ignore[index]
    assert cond(st, "Degraded")["status"] == "False"


def test_a_draining_node_leaves_the_plan_like_a_cordoned_one() -> None:
    """The controller rolls no plan out onto a node whose agent is draining, so the
    operator, which alone decides plans, plans around it."""
    obs = observed()
    world = apply_world(obs, tick(obs))
    draining = node_view("a100-0")
    session = AgentSession(
        session_id="s1", registered_time="2026-01-01T00:00:00Z", state="draining"
    )
    draining = dataclasses.replace(
        draining, status=dataclasses.replace(draining.status, agent=session)
    )
    world = dataclasses.replace(world, nodes=(node_view("h100-0"), draining))
    (plan,) = only(tick(world), ApplyPlan)
    assert isinstance(plan, ApplyPlan)
    assert plan.body["spec"]["nodes"] == ["h100-0"]
    assert plan.body["spec"]["reason"] == "fleet changed: -a100-0 (its agent is draining)"


def test_stale_heartbeat_degrades_until_the_new_plan_exists() -> None:
    obs = observed()
    world = apply_world(obs, tick(obs))
    late = world.now + timedelta(seconds=120)
    nodes = (node_view("h100-0", heartbeat=late), node_view("a100-0"))  # a100-0 silent 130 s
    world = dataclasses.replace(world, nodes=nodes, now=late + timedelta(seconds=5))
    # A failed re-solve leaves the old plan serving: Degraded names the lost node.
    outcome = SolveOutcome("x", None, "SolverError", "solver crashed", 1.0)
    first = reconcile(world, SETTINGS)
    (solve,) = only(first, SolveAction)
    assert isinstance(solve, SolveAction)
    failed = reconcile(
        dataclasses.replace(
            world, solve=dataclasses.replace(outcome, inputs_digest=solve.inputs_digest)
        ),
        SETTINGS,
    )
    st = status_of(failed)
    assert cond(st, "Solved")["reason"] == "SolverError"
    degraded = cond(st, "Degraded")
    assert degraded["reason"] == "NodesUnavailable"
    assert "a100-0 (last heartbeat 130 s ago)" in str(degraded["message"])
    assert st["currentPlan"]["name"] == "mx-v1"  # type: ignore[index]


def test_solver_error_is_retried_after_the_delay_not_at_once() -> None:
    obs = observed()
    (solve,) = only(reconcile(obs, SETTINGS), SolveAction)
    assert isinstance(solve, SolveAction)
    failed = reconcile(
        dataclasses.replace(
            obs, solve=SolveOutcome(solve.inputs_digest, None, "SolverError", "boom", 2.0)
        ),
        SETTINGS,
    )
    assert min(a.after_s for a in only(failed, Requeue)) == 60.0  # type: ignore[attr-defined]
    world = apply_world(obs, failed)
    soon = reconcile(dataclasses.replace(world, now=world.now + timedelta(seconds=20)), SETTINGS)
    assert not only(soon, SolveAction)
    assert min(a.after_s for a in only(soon, Requeue)) == pytest.approx(40.0)  # type: ignore[attr-defined]
    later = reconcile(dataclasses.replace(world, now=world.now + timedelta(seconds=61)), SETTINGS)
    assert only(later, SolveAction)


# --------------------------------------------------------------------- spec errors


def test_unknown_model_is_a_condition_and_is_not_retried_in_a_loop() -> None:
    obs = observed(deployment(md_spec(model="no-such-model")))
    actions = reconcile(obs, SETTINGS)
    assert not only(actions, SolveAction) and not only(actions, ApplyPlan)
    solved = cond(status_of(actions), "Solved")
    assert solved["status"] == "False" and solved["reason"] == "UnknownModel"
    assert "To fix" in str(solved["message"])
    world = apply_world(obs, actions)
    assert reconcile(world, SETTINGS) == ()


def test_infeasible_placement_is_reported_once_and_not_solved_again() -> None:
    spec = md_spec(
        model="deepseek-v3", workload={"phase": "decode", "tokensPerGpu": 64, "contextLen": 4096}
    )
    obs = observed(deployment(spec))
    actions = reconcile(obs, SETTINGS)
    (solve,) = only(actions, SolveAction)
    assert isinstance(solve, SolveAction)
    outcome = SolveOutcome(
        solve.inputs_digest, None, "Infeasible", "the model does not fit. To fix: add GPUs", 0.1
    )
    after = reconcile(dataclasses.replace(obs, solve=outcome), SETTINGS)
    st = status_of(after)
    assert cond(st, "Solved")["reason"] == "Infeasible"
    assert st["lastSolve"]["outcome"] == "Failed"  # type: ignore[index]
    world = apply_world(obs, after)
    hour = world.now + timedelta(hours=1)
    fresh = (node_view("h100-0", heartbeat=hour), node_view("a100-0", heartbeat=hour))
    again = reconcile(dataclasses.replace(world, nodes=fresh, now=hour), SETTINGS)
    assert not only(again, SolveAction)
    assert not only(again, ApplyStatus)  # the message survives; nothing to rewrite


def test_no_eligible_node_lists_why_each_was_left_out() -> None:
    nodes = [
        node_view("h100-0", cordon=True),
        node_view("a100-0", heartbeat=T0 - timedelta(minutes=5)),
    ]
    actions = reconcile(observed(nodes=nodes), SETTINGS)
    solved = cond(status_of(actions), "Solved")
    assert solved["reason"] == "NoEligibleNodes"
    assert "h100-0: cordoned" in str(solved["message"])
    assert "a100-0: last heartbeat 305 s ago" in str(solved["message"])


def test_missing_policy_reference_is_reported() -> None:
    obs = observed(deployment(md_spec(policyRef={"name": "gold"})), policy_missing="gold")
    solved = cond(status_of(reconcile(obs, SETTINGS)), "Solved")
    assert solved["reason"] == "PolicyNotFound" and "'gold'" in str(solved["message"])


def test_dense_model_cannot_publish_an_expert_map_unless_export_is_off() -> None:
    bad = reconcile(observed(deployment(md_spec(model="llama-3.1-70b"))), SETTINGS)
    assert cond(status_of(bad), "Solved")["reason"] == "NothingToExport"
    ok = reconcile(
        observed(deployment(md_spec(model="llama-3.1-70b", engineFormat="none"))), SETTINGS
    )
    assert only(ok, SolveAction)


def test_engine_form_raises_redundant_experts_to_a_multiple_and_says_so() -> None:
    spec = md_spec(model="qwen3-30b-a3b", redundantExperts=3)
    obs = observed(deployment(spec))
    (solve,) = only(reconcile(obs, SETTINGS), SolveAction)
    assert isinstance(solve, SolveAction)
    assert solve.request.redundant_experts == 4  # 128 + 4 divides by 4 GPUs
    st = status_of(tick(obs))
    assert "redundantExperts raised from 3 to 4" in str(cond(st, "Solved")["message"])


# ------------------------------------------------------------------ selection, policy


def test_node_selector_and_policy_tiers_pick_the_nodes() -> None:
    nodes = [
        node_view("h100-0", labels={"rack": "r1"}),
        node_view("h100-1", labels={"rack": "r2"}),
        node_view("a100-0", labels={"rack": "r2"}),
    ]
    obs = observed(deployment(md_spec(nodeSelector={"rack": "r2"})), nodes)
    (solve,) = only(reconcile(obs, SETTINGS), SolveAction)
    assert isinstance(solve, SolveAction)
    assert [n.name for n in solve.request.fleet.nodes] == ["a100-0", "h100-1"]
    hopper = dataclasses.replace(FAST_POLICY, tiers=("hopper",))
    (solve2,) = only(
        reconcile(
            observed(deployment(md_spec(nodeSelector={"rack": "r2"})), nodes, policy=hopper),
            SETTINGS,
        ),
        SolveAction,
    )
    assert isinstance(solve2, SolveAction)
    assert [n.name for n in solve2.request.fleet.nodes] == ["h100-1"]


def test_deployment_fields_override_the_policy() -> None:
    policy = PlacementPolicySpec(policy="ilp", solver_time_limit_s=60.0, redundant_experts=8)
    spec = md_spec(policy="greedy", solverTimeLimitS=3, redundantExperts=4)
    (solve,) = only(reconcile(observed(deployment(spec), policy=policy), SETTINGS), SolveAction)
    assert isinstance(solve, SolveAction)
    r = solve.request
    assert (r.policy, r.options.time_limit_s, r.redundant_experts) == ("greedy", 3.0, 4)
    (solve2,) = only(reconcile(observed(policy=policy), SETTINGS), SolveAction)
    assert isinstance(solve2, SolveAction)
    assert (solve2.request.policy, solve2.request.redundant_experts) == ("ilp", 8)


# -------------------------------------------------------------------- rollout, controller


def test_rollout_failure_shows_in_rolledout_and_degraded() -> None:
    obs = observed()
    world = apply_world(obs, tick(obs))
    failed = PartitionPlanStatus(
        nodes=(
            NodeRollout("a100-0", "Committed"),
            NodeRollout("h100-0", "Failed", reason="StageFailed", message="disk full"),
        )
    )
    world = dataclasses.replace(world, plans=(dataclasses.replace(world.plans[0], status=failed),))
    st = status_of(reconcile(world, SETTINGS))
    assert cond(st, "RolledOut")["reason"] == "RolloutFailed"
    assert "h100-0: StageFailed disk full" in str(cond(st, "RolledOut")["message"])
    assert cond(st, "Degraded")["reason"] == "RolloutFailed"


def test_a_newer_controller_plan_is_served_without_a_re_solve() -> None:
    obs = observed()
    world = apply_world(obs, tick(obs))
    ours = world.plans[0]
    theirs = dataclasses.replace(
        ours,
        name="mx-v2",
        uid="uid-v2",
        spec=dataclasses.replace(
            ours.spec, version=2, made_by="controller", inputs_digest="rebalance-1"
        ),
    )
    world = dataclasses.replace(world, plans=(ours, theirs))
    actions = reconcile(world, SETTINGS)
    assert not only(actions, SolveAction) and not only(actions, ApplyPlan)
    assert status_of(actions)["currentPlan"]["name"] == "mx-v2"  # type: ignore[index]
    (cm,) = only(actions, ApplyConfigMap)
    assert isinstance(cm, ApplyConfigMap)
    assert cm.body["metadata"]["annotations"]["mixfleet.io/plan"] == "mx-v2"


def test_controller_owned_status_fields_do_not_cause_rewrites() -> None:
    obs = observed()
    world = apply_world(obs, tick(obs))
    d = dataclasses.replace(
        world.deployment, status=dataclasses.replace(world.deployment.status, committed_version=1)
    )
    assert [type(a) for a in reconcile(dataclasses.replace(world, deployment=d), SETTINGS)] == [
        Requeue
    ]


# ---------------------------------------------------------------------------- deletion


def test_deletion_removes_configmap_and_plans_then_the_finalizer() -> None:
    obs = observed()
    world = apply_world(obs, tick(obs))
    gone = dataclasses.replace(
        world, deployment=dataclasses.replace(world.deployment, deleting=True)
    )
    first = reconcile(gone, SETTINGS)
    assert [type(a) for a in first] == [DeleteConfigMap, DeletePlan, Requeue]
    (dp,) = only(first, DeletePlan)
    assert isinstance(dp, DeletePlan) and dp.uid == "uid-mx-v1"
    second = reconcile(apply_world(gone, first), SETTINGS)
    assert second == (SetFinalizer(False),)


def test_deletion_without_our_finalizer_does_nothing() -> None:
    d = deployment(finalizers=("other.io/keep",), deleting=True)
    assert reconcile(observed(d), SETTINGS) == ()


def test_a_model_the_engine_cannot_place_is_a_condition_not_a_configmap() -> None:
    """SGLang 0.5.23 has no expert-location support for Mixtral: the operator publishes no
    expert map it would fail to run, and says why on the deployment."""
    obs = observed(deployment(md_spec(engineFormat="sglang")))
    actions = tick(obs)
    assert not only(actions, ApplyConfigMap)
    st = status_of(actions)
    conditions = st["conditions"]
    assert isinstance(conditions, list)
    failed = [c for c in conditions if c.get("reason") == "ExportFailed"]
    assert failed and "cannot load an expert placement for mixtral" in failed[0]["message"]
