"""The pure decision: every rule of controlplane.server.reconcile, with an explicit clock."""

from __future__ import annotations

from dataclasses import replace

from controlplane.server.reconcile import (
    Abort,
    Commit,
    DeploymentObs,
    FailureObs,
    NodeObs,
    Observed,
    PlanObs,
    ReconcileSettings,
    RolloutObs,
    SetNodeLost,
    SetStatus,
    Solve,
    StartRollout,
    inputs_key,
    reconcile,
)
from policies.spec.build import DeploymentSpec, RebalanceSpec

S = ReconcileSettings(node_lost_after_s=10.0, retry_after_abort_s=30.0, retry_after_error_s=5.0)
NOW = 1000.0
SPEC = DeploymentSpec(name="mx", model="mixtral-8x7b")


def node(name: str, *, seen: float = NOW, gpus: int = 2, **kw: object) -> NodeObs:
    healthy = tuple(f"{name}/gpu{i}" for i in range(gpus))
    return NodeObs(name, kw.pop("labels", {}), seen, healthy_gpus=healthy, **kw)  # type: ignore[arg-type]


NODES = (node("a"), node("b"), node("c"))
ALL_GPUS = tuple(g for n in NODES for g in n.healthy_gpus)
KEY = inputs_key(1, ALL_GPUS)
COMMITTED = PlanObs(1, "committed", KEY, ALL_GPUS, 900.0)


def decide(
    d: DeploymentObs, nodes: tuple[NodeObs, ...] | None = None, now: float = NOW
) -> list[object]:
    """Reconcile one deployment; by default every node heartbeated just now."""
    if nodes is None:
        nodes = tuple(replace(n, last_seen_s=now) for n in NODES)
    return list(reconcile(Observed(now, nodes, (d,)), S))


def main_action(actions: list[object]) -> object:
    rest = [a for a in actions if not isinstance(a, SetStatus | SetNodeLost)]
    assert len(rest) <= 1, rest
    return rest[0] if rest else None


def status(actions: list[object]) -> SetStatus:
    found = [a for a in actions if isinstance(a, SetStatus)]
    assert len(found) == 1
    return found[0]


def test_new_deployment_is_solved_on_all_usable_nodes() -> None:
    a = main_action(decide(DeploymentObs(SPEC, 1)))
    assert a == Solve("mx", "deployment created", KEY, ("a", "b", "c"), None)


def test_up_to_date_deployment_is_ready_and_does_nothing() -> None:
    actions = decide(DeploymentObs(SPEC, 1, committed=COMMITTED))
    assert main_action(actions) is None
    assert status(actions).phase == "ready"


def test_spec_change_replans_migration_aware_from_the_committed_version() -> None:
    a = main_action(decide(DeploymentObs(SPEC, 2, committed=COMMITTED)))
    assert isinstance(a, Solve)
    assert a.reason == "deployment spec changed (generation 2)"
    assert a.previous_version == 1 and a.inputs_key == inputs_key(2, ALL_GPUS)


def test_node_loss_after_missed_heartbeats_marks_it_and_replans_without_it() -> None:
    nodes = (node("a"), node("b", seen=NOW - 10.0), node("c"))
    actions = decide(DeploymentObs(SPEC, 1, committed=COMMITTED), nodes)
    assert actions[0] == SetNodeLost("b", True, "no heartbeat for 10 s")
    a = main_action(actions)
    assert isinstance(a, Solve) and a.reason == "node b lost"
    assert a.nodes == ("a", "c") and a.previous_version == 1


def test_a_node_just_inside_the_timeout_is_alive() -> None:
    nodes = (node("a"), node("b", seen=NOW - 9.99), node("c"))
    assert main_action(decide(DeploymentObs(SPEC, 1, committed=COMMITTED), nodes)) is None


def test_a_returning_node_is_unmarked_and_joins() -> None:
    nodes = (node("a"), node("b", marked_lost=True), node("c"))
    two = PlanObs(
        2,
        "committed",
        inputs_key(1, ("a/gpu0", "a/gpu1", "c/gpu0", "c/gpu1")),
        ("a/gpu0", "a/gpu1", "c/gpu0", "c/gpu1"),
    )
    actions = decide(DeploymentObs(SPEC, 1, committed=two), nodes)
    assert actions[0] == SetNodeLost("b", False, "heartbeats resumed")
    a = main_action(actions)
    assert isinstance(a, Solve) and a.reason == "node b joined"


def test_gpu_health_change_replans() -> None:
    nodes = (node("a"), node("b", gpus=1), node("c"))
    a = main_action(decide(DeploymentObs(SPEC, 1, committed=COMMITTED), nodes))
    assert isinstance(a, Solve) and a.reason == "GPU health changed on b"
    assert "b/gpu1" not in a.nodes


def test_draining_and_unselected_nodes_are_not_used() -> None:
    spec = replace(SPEC, node_selector={"tier": "fast"})
    nodes = (
        node("a", labels={"tier": "fast"}),
        node("b", labels={"tier": "fast"}, state="draining"),
        node("c", labels={"tier": "slow"}),
    )
    a = main_action(decide(DeploymentObs(spec, 1), nodes))
    assert isinstance(a, Solve) and a.nodes == ("a",)


def test_no_usable_node_reports_and_waits() -> None:
    actions = decide(DeploymentObs(replace(SPEC, node_selector={"x": "y"}), 1))
    assert main_action(actions) is None
    assert status(actions).phase == "pending"


def test_solving_waits() -> None:
    actions = decide(DeploymentObs(SPEC, 2, committed=COMMITTED, solving=True))
    assert main_action(actions) is None and status(actions).phase == "planning"


def test_proposed_plan_for_current_inputs_is_rolled_out() -> None:
    p = PlanObs(2, "proposed", KEY)
    assert main_action(decide(DeploymentObs(SPEC, 1, pending=p))) == StartRollout("mx", 2)


def test_proposed_plan_for_stale_inputs_is_aborted() -> None:
    p = PlanObs(2, "proposed", "g1:stale")
    a = main_action(decide(DeploymentObs(SPEC, 1, pending=p)))
    assert a == Abort("mx", 2, "inputs changed before rollout")


def rollout(**kw: object) -> RolloutObs:
    base: dict[str, object] = {"version": 2, "deadline_s": NOW + 5, "targets": ("a", "b", "c")}
    base.update(kw)
    return RolloutObs(**base)  # type: ignore[arg-type]


def test_rollout_commits_when_every_target_prepared() -> None:
    r = rollout(prepared=frozenset({"a", "b", "c"}))
    assert main_action(decide(DeploymentObs(SPEC, 1, COMMITTED, rollout=r))) == Commit("mx", 2)


def test_rollout_waits_for_missing_acks_until_the_deadline() -> None:
    r = rollout(prepared=frozenset({"a", "b"}))
    d = DeploymentObs(SPEC, 1, COMMITTED, rollout=r)
    actions = decide(d)
    assert main_action(actions) is None
    assert status(actions).message == "v2: 2/3 prepared"
    late = main_action(decide(d, now=NOW + 5))
    assert isinstance(late, Abort) and "no ack from c" in late.reason


def test_rollout_aborts_on_a_failed_prepare() -> None:
    r = rollout(prepared=frozenset({"a"}), failed={"b": "disk full"})
    a = main_action(decide(DeploymentObs(SPEC, 1, COMMITTED, rollout=r)))
    assert a == Abort("mx", 2, "node b failed to prepare: disk full")


def test_rollout_aborts_when_a_target_is_lost() -> None:
    nodes = (node("a"), node("b"), node("c", seen=NOW - 60))
    r = rollout(prepared=frozenset({"a", "b"}))
    a = main_action(decide(DeploymentObs(SPEC, 1, COMMITTED, rollout=r), nodes))
    assert a == Abort("mx", 2, "node c lost during rollout")


def test_aborted_inputs_are_retried_only_after_the_pause() -> None:
    aborted = PlanObs(2, "aborted", inputs_key(2, ALL_GPUS), state_changed_s=NOW - 10)
    d = DeploymentObs(SPEC, 2, COMMITTED, pending=aborted)
    assert main_action(decide(d)) is None
    assert isinstance(main_action(decide(d, now=NOW + 20)), Solve)


def test_permanent_failure_is_not_retried_until_inputs_change() -> None:
    f = FailureObs(KEY, NOW - 1000, "infeasible: too small", permanent=True)
    actions = decide(DeploymentObs(SPEC, 1, failure=f))
    assert main_action(actions) is None and status(actions).phase == "failed"
    assert isinstance(main_action(decide(DeploymentObs(SPEC, 2, failure=f))), Solve)


def test_temporary_failure_is_retried_after_the_pause() -> None:
    f = FailureObs(KEY, NOW - 1, "solver error", permanent=False)
    assert main_action(decide(DeploymentObs(SPEC, 1, failure=f))) is None
    assert isinstance(main_action(decide(DeploymentObs(SPEC, 1, failure=f), now=NOW + 5)), Solve)


REBALANCE = replace(
    SPEC,
    rebalance=RebalanceSpec(
        enabled=True, imbalance_threshold=0.1, sustain_s=30.0, min_interval_s=300.0
    ),
)


def samples(*pairs: tuple[float, float]) -> tuple[tuple[float, float], ...]:
    return tuple((NOW - ago, v) for ago, v in pairs)


def test_sustained_imbalance_triggers_a_migration_aware_rebalance() -> None:
    d = DeploymentObs(
        REBALANCE, 1, COMMITTED, imbalance_samples=samples((40, 0.3), (20, 0.25), (1, 0.2))
    )
    a = main_action(decide(d))
    assert isinstance(a, Solve) and a.rebalance and a.previous_version == 1
    assert a.inputs_key == KEY and "load imbalance" in a.reason


def test_short_or_interrupted_imbalance_does_not_trigger() -> None:
    too_short = samples((20, 0.3), (1, 0.3))
    dipped = samples((40, 0.3), (20, 0.05), (1, 0.3))
    below = samples((40, 0.09), (1, 0.09))
    for s in (too_short, dipped, below, ()):
        assert (
            main_action(decide(DeploymentObs(REBALANCE, 1, COMMITTED, imbalance_samples=s))) is None
        )


def test_rebalance_respects_min_interval_and_the_switch() -> None:
    s = samples((40, 0.3), (1, 0.3))
    recent = DeploymentObs(REBALANCE, 1, COMMITTED, imbalance_samples=s, last_rebalance_s=NOW - 100)
    assert main_action(decide(recent)) is None
    off = DeploymentObs(SPEC, 1, COMMITTED, imbalance_samples=s)
    assert main_action(decide(off)) is None


def test_stale_samples_do_not_trigger() -> None:
    s = samples((400, 0.3), (200, 0.3))
    assert main_action(decide(DeploymentObs(REBALANCE, 1, COMMITTED, imbalance_samples=s))) is None


# ------------------------------------------------- Kubernetes mode: the operator decides

EXTERNAL = replace(S, solves=False)


def decide_external(d: DeploymentObs, nodes: tuple[NodeObs, ...] = NODES) -> list[object]:
    return list(reconcile(Observed(NOW, nodes, (d,)), EXTERNAL))


def test_the_controller_never_solves_when_the_operator_decides() -> None:
    # New deployment, changed spec, lost node, rebalance due: no Solve, ever.
    lost = (node("a"), node("b"), node("c", seen=NOW - 60.0))
    rebalance = replace(SPEC, rebalance=RebalanceSpec(enabled=True, sustain_s=0.0))
    cases = [
        DeploymentObs(SPEC, 1),
        DeploymentObs(SPEC, 2, committed=COMMITTED),
        DeploymentObs(rebalance, 1, committed=COMMITTED, imbalance_samples=((NOW - 5, 0.9),)),
    ]
    for d in cases:
        assert not any(isinstance(a, Solve) for a in decide_external(d))
    acts = decide_external(DeploymentObs(SPEC, 1, committed=COMMITTED), lost)
    assert not any(isinstance(a, Solve) for a in acts)
    assert status(acts).phase == "degraded" and "operator" in status(acts).message
    assert status(decide_external(DeploymentObs(SPEC, 1))).message == (
        "waiting for the operator's plan"
    )


def test_the_operators_newest_plan_is_rolled_out_and_older_ones_aborted() -> None:
    # The operator's inputs digest is its own: it is not compared with the controller's.
    pending = PlanObs(3, "proposed", "operator-digest", nodes=("a", "b"))
    d = DeploymentObs(SPEC, 2, committed=COMMITTED, pending=pending, older_proposed=(2,))
    acts = decide_external(d)
    assert [a for a in acts if not isinstance(a, SetStatus)] == [
        Abort("mx", 2, "replaced by v3 before its rollout"),
        StartRollout("mx", 3),
    ]


def test_an_operator_plan_on_an_unusable_node_waits_for_the_next_plan() -> None:
    pending = PlanObs(2, "proposed", "operator-digest", nodes=("a", "c"))
    nodes = (node("a"), node("b"), node("c", seen=NOW - 60.0))
    acts = decide_external(DeploymentObs(SPEC, 1, pending=pending), nodes)
    assert main_action(acts) is None
    assert status(acts).phase == "pending" and "(c)" in status(acts).message


def test_rollouts_of_operator_plans_commit_and_abort_as_before() -> None:
    r = RolloutObs(2, NOW + 10, ("a", "b"), frozenset({"a", "b"}))
    assert main_action(decide_external(DeploymentObs(SPEC, 1, rollout=r))) == Commit("mx", 2)
    failed = replace(r, prepared=frozenset({"a"}), failed={"b": "disk full"})
    got = main_action(decide_external(DeploymentObs(SPEC, 1, rollout=failed)))
    assert isinstance(got, Abort) and "disk full" in got.reason
