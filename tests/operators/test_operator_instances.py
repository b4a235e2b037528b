"""ModelDeployments planned from their traffic and SLOs (operators.instances,
operators.parent): the fleet schedule plans them first and schedules the others on what is
left; each instance's ModelDeployment is applied as planned, owned and labelled, and put
back when edited; a dropped instance retires (serves) until its replacements are ready or,
on a full fleet, until it is the one to drain early, then drains and is deleted after the
drain grace; the parent's
status lists the instances with a condition per shortfall; an instance's ConfigMap launches
it as its role and its status carries its record, which the controller's Kubernetes store
reads as the standalone controller's InstanceRecord."""

from __future__ import annotations

import dataclasses
import json
from datetime import timedelta
from typing import Any

import pytest
from k8s_builders import (
    FAST_POLICY,
    T0,
    deployment,
    inventory,
    md_object,
    md_spec,
    node_view,
    observed,
    run_solve,
)
from k8s_cluster import Cluster
from test_operator_instances_e2e import CHAT, PLANNER

from apis.kube.client import MODEL_DEPLOYMENTS
from apis.kube.names import LABEL_INSTANCE_OF
from apis.kube.schema import from_wire, to_wire
from apis.kube.v1alpha1 import (
    Condition,
    InstanceRecordStatus,
    ModelDeploymentStatus,
    PlacementPolicySpec,
    PlanRef,
)
from controlplane.server.controller.instance_records import INSTANCE_KEY, InstanceRecord
from controlplane.store.kubernetes import KubernetesStore
from operators.decide import (
    ApplyChild,
    ApplyConfigMap,
    ApplyStatus,
    DeleteChild,
    Requeue,
    SolveAction,
    reconcile,
)
from operators.fleet_schedule import FleetAssignments
from operators.instances import child_spec, extra_fields
from operators.observe import ChildView, Observed, ParentPlan, ReconcileSettings
from operators.parent import reconcile_parent
from policies.launch import PlannedInstance

SETTINGS = ReconcileSettings(node_stale_after_s=90.0, plan_history=2, solver_error_retry_s=60.0)
NOW = T0 + timedelta(seconds=5)
NOW_S = NOW.timestamp()
NODES = [node_view(n, inv=inventory(n, "h100-0")) for n in ("h100-0", "h100-1", "h100-2")]


def policy(_: str) -> PlacementPolicySpec:
    return FAST_POLICY


def objects(*extra: dict[str, Any]) -> list[dict[str, Any]]:
    chat = md_object("chat", "team-a", **CHAT)
    out = [chat, *extra]
    for o in out:
        o["metadata"].setdefault("generation", 1)
    return out


def child_obj(
    name: str,
    parent: str,
    nodes: tuple[str, ...],
    record: InstanceRecordStatus | None,
    *,
    ready: bool = False,
    unsolved: str = "",
) -> Any:
    """An instance's ModelDeployment as the API server returns it; ``ready``: its current
    plan committed on every node (``RolledOut=True``); ``unsolved``: the reason of its
    ``Solved=False``."""
    o = md_object(name, "team-a")
    o["metadata"]["labels"] = {LABEL_INSTANCE_OF: parent}
    o["metadata"]["generation"] = 1
    t = "2026-03-01T12:00:00Z"
    rolled = Condition("RolledOut", "True" if ready else "False", "R", "", t)
    solved = Condition("Solved", "False" if unsolved else "True", unsolved or "Solved", "", t)
    status = ModelDeploymentStatus(
        conditions=(solved, rolled), current_plan=PlanRef(f"{name}-v1", "0123456789abcdef", 1)
    )
    o["status"] = {**to_wire(status), "nodes": list(nodes)}
    if record is not None:
        o["status"]["instance"] = to_wire(record)
    return o


def test_planned_deployments_are_planned_first_and_the_others_scheduled_on_what_is_left() -> None:
    fa = FleetAssignments(planner=PLANNER)
    objs = objects(md_object("batch", "team-a", maxGpus=2))
    parent_nodes, why, changed = fa.of(("team-a", "chat"), objs, NODES, policy, NOW, 90.0)
    assert (parent_nodes, why, changed) == (None, "", True)  # it runs as its instances
    pp = fa.parent(("team-a", "chat"))
    assert pp is not None and not pp.error
    assert [(i.name, i.role) for i in pp.instances] == [
        ("chat-prefill-0", "prefill"),
        ("chat-decode-0", "decode"),
    ]
    assert pp.demand_requests_per_s == 20.0 and pp.served_requests_per_s == pytest.approx(20.0)
    taken = set()
    for inst in pp.instances:
        nodes, why, _ = fa.of(("team-a", inst.name), objs, NODES, policy, NOW, 90.0)
        assert nodes == inst.nodes and why == ""
        rec = fa.record(("team-a", inst.name), NOW_S)
        assert rec is not None and (rec.of, rec.role, rec.nodes) == ("chat", inst.role, nodes)
        assert rec.kv_path == inst.kv_path != ""
        assert rec.bootstrap_port == (8998 if inst.role == "prefill" else 0)
        taken |= set(nodes)
    batch, _, again = fa.of(("team-a", "batch"), objs, NODES, policy, NOW, 90.0)
    assert not again  # one plan serves every key
    assert batch and not set(batch) & taken, (batch, taken)


def test_a_dropped_instance_keeps_its_nodes_and_a_new_one_waits_for_them() -> None:
    fa = FleetAssignments(planner=PLANNER)
    objs = objects()
    fa.of(("team-a", "chat"), objs, NODES, policy, NOW, 90.0)
    pp = fa.parent(("team-a", "chat"))
    assert pp is not None
    decode = next(i for i in pp.instances if i.role == "decode")
    prefill = next(i for i in pp.instances if i.role == "prefill")
    # An instance of an earlier plan (not in this one) still holds the decode's node.
    old = InstanceRecordStatus(
        of="chat", role="aggregated", pool="p0", nodes=decode.nodes, capacity_requests_per_s=9.0
    )
    objs = objects(child_obj("chat-aggregated-0", "chat", decode.nodes, old, ready=True))
    fa.of(("team-a", "chat"), objs, NODES, policy, NOW, 90.0)
    kept, why, _ = fa.of(("team-a", "chat-aggregated-0"), objs, NODES, policy, NOW, 90.0)
    assert kept == decode.nodes and why == ""
    # The prefill can still come up on a free node: a surge first, the dropped one serves.
    rec = fa.record(("team-a", "chat-aggregated-0"), NOW_S)
    assert rec is not None and rec.retiring and not rec.draining and rec.draining_since_s == 0
    nodes, why, _ = fa.of(("team-a", decode.name), objs, NODES, policy, NOW, 90.0)
    assert nodes == ()
    assert why == f"waiting for GPUNodes to drain ({decode.nodes[0]} by team-a/chat-aggregated-0)"
    # Waiting for GPUNodes (Unschedulable) is not failing: the prefill still rolls out.
    waiting_decode = child_obj(decode.name, "chat", (), None, unsolved="Unschedulable")
    fa.of(("team-a", "chat"), [*objs, waiting_decode], NODES, policy, NOW, 90.0)
    rec = fa.record(("team-a", "chat-aggregated-0"), NOW_S)
    assert rec is not None and rec.retiring
    # A prefill that cannot be planned will not come up: the decode is all that waits.
    failed = child_obj("chat-prefill-0", "chat", (), None, unsolved="Infeasible")
    fa.of(("team-a", "chat"), [*objs, waiting_decode, failed], NODES, policy, NOW, 90.0)
    rec = fa.record(("team-a", "chat-aggregated-0"), NOW_S)
    assert rec is not None and rec.draining
    # Once the prefill is ready, the decode is all that waits, and only for the dropped
    # instance's node (a full fleet): it drains early, from now.
    ready_prefill = child_obj("chat-prefill-0", "chat", prefill.nodes, None, ready=True)
    objs = [*objs, ready_prefill]
    fa.of(("team-a", "chat"), objs, NODES, policy, NOW, 90.0)
    rec = fa.record(("team-a", "chat-aggregated-0"), NOW_S)
    assert rec is not None and rec.draining and not rec.retiring
    assert rec.draining_since_s == NOW_S


def test_a_dropped_instance_retires_until_its_replacements_are_ready_then_drains() -> None:
    """A re-plan with spare nodes: the dropped instance keeps serving (retiring) while its
    replacements roll out on other nodes, drains once they are all ready, and keeps the
    time it began draining once that is in its status (an operator restart keeps it)."""
    fa = FleetAssignments(planner=PLANNER)
    objs = objects()
    fa.of(("team-a", "chat"), objs, NODES, policy, NOW, 90.0)
    pp = fa.parent(("team-a", "chat"))
    assert pp is not None
    used = {n for i in pp.instances for n in i.nodes}
    (spare,) = [n.name for n in NODES if n.name not in used]
    old = InstanceRecordStatus(of="chat", role="aggregated", pool="p0", nodes=(spare,))
    dropped = child_obj("chat-aggregated-0", "chat", (spare,), old, ready=True)
    prefill, decode = pp.instances
    rolling = [
        child_obj(prefill.name, "chat", prefill.nodes, None, ready=True),
        child_obj(decode.name, "chat", decode.nodes, None, ready=False),
    ]
    fa.of(("team-a", "chat"), objects(dropped, *rolling), NODES, policy, NOW, 90.0)
    rec = fa.record(("team-a", "chat-aggregated-0"), NOW_S)
    assert rec is not None and (rec.retiring, rec.draining) == (True, False)
    assert fa.dropped() == (("team-a", "chat-aggregated-0"),)
    committed = [
        child_obj(prefill.name, "chat", prefill.nodes, None, ready=True),
        child_obj(decode.name, "chat", decode.nodes, None, ready=True),
    ]
    fa.of(("team-a", "chat"), objects(dropped, *committed), NODES, policy, NOW, 90.0)
    rec = fa.record(("team-a", "chat-aggregated-0"), NOW_S)
    assert rec is not None and (rec.retiring, rec.draining, rec.draining_since_s) == (
        False,
        True,
        NOW_S,
    )
    # Its status now says so: later reads (another operator's too) keep when it began.
    stored = child_obj("chat-aggregated-0", "chat", (spare,), rec, ready=True)
    fresh = FleetAssignments(planner=PLANNER)
    fresh.of(("team-a", "chat"), objects(stored, *committed), NODES, policy, NOW, 90.0)
    again = fresh.record(("team-a", "chat-aggregated-0"), NOW_S + 12.0)
    assert again == rec


PREFILL = PlannedInstance(
    "chat-prefill-0",
    "pool-0",
    "prefill",
    ("h100-1",),
    2,
    1,
    "RDMA ib0",
    ("prefill", 8192, 1024),
    "1x2xH100/prefill",
    16384,
    20.0,
    77.8,
    56.0,
    15.3,
)
DECODE = dataclasses.replace(
    PREFILL,
    name="chat-decode-0",
    role="decode",
    nodes=("h100-0",),
    workload=("decode", 712, 1280),
    variant="1x2xH100/decode",
    batch_limit=1425,
)


def parent_observed(pp: ParentPlan, children: tuple[ChildView, ...] = ()) -> Observed:
    spec = md_spec(**CHAT)
    return observed(deployment(spec), planned=pp, children=children)


def child_view(
    inst: PlannedInstance,
    *,
    ready: bool = False,
    spec: dict[str, Any] | None = None,
    nodes: tuple[str, ...] | None = None,
    record: InstanceRecordStatus | None = None,
) -> ChildView:
    obs = parent_observed(ParentPlan())
    want = child_spec("mx", obs.deployment.spec, FAST_POLICY, inst)  # type: ignore[arg-type]
    rolled = Condition("RolledOut", "True" if ready else "False", "R", "", "2026-03-01T12:00:00Z")
    status = ModelDeploymentStatus(
        conditions=(rolled,),
        current_plan=PlanRef(f"{inst.name}-v1", "0123456789abcdef", 1),
        nodes=nodes if nodes is not None else inst.nodes,
        instance=record,
    )
    return ChildView(inst.name, f"uid-{inst.name}", "uid-mx", spec or to_wire(want), status)


def test_the_parent_applies_each_instance_owned_and_labelled_once() -> None:
    pp = ParentPlan((PREFILL, DECODE), 20.0, 20.0)
    actions = reconcile_parent(parent_observed(pp))
    applies = [a for a in actions if isinstance(a, ApplyChild)]
    assert [a.name for a in applies] == ["chat-prefill-0", "chat-decode-0"]
    body = applies[0].body
    assert body["metadata"]["labels"][LABEL_INSTANCE_OF] == "mx"
    (ref,) = body["metadata"]["ownerReferences"]
    assert (ref["uid"], ref["controller"], ref["blockOwnerDeletion"]) == ("uid-mx", True, True)
    spec = body["spec"]
    assert "traffic" not in spec and "slo" not in spec and spec["disaggregation"] == "off"
    assert spec["workload"]["phase"] == "prefill" and spec["workload"]["tokensPerGpu"] == 8192
    # applied as planned: nothing more to apply
    kids = (child_view(PREFILL), child_view(DECODE))
    assert not [a for a in reconcile_parent(parent_observed(pp, kids)) if isinstance(a, ApplyChild)]


def test_an_edited_instance_is_put_back() -> None:
    pp = ParentPlan((PREFILL,), 20.0, 20.0)
    edited = json.loads(json.dumps(dict(child_view(PREFILL).spec)))
    edited["workload"]["contextLen"] = 999
    edited["policyRef"] = {"name": "mine"}
    kid = child_view(PREFILL, spec=edited)
    (apply,) = [
        a for a in reconcile_parent(parent_observed(pp, (kid,))) if isinstance(a, ApplyChild)
    ]
    assert apply.body["spec"]["workload"]["contextLen"] == 1024
    assert apply.remove == {"policyRef": None}
    assert extra_fields({"a": {"b": 1, "c": 2}, "d": 3}, {"a": {"b": 1}}) == {
        "a": {"c": None},
        "d": None,
    }


def test_a_dropped_instance_is_deleted_once_its_drain_grace_has_passed() -> None:
    pp = ParentPlan((PREFILL, DECODE), 20.0, 20.0)
    old = dataclasses.replace(
        PREFILL, name="chat-aggregated-0", role="aggregated", nodes=("h100-2",)
    )
    kids = (child_view(PREFILL, ready=True), child_view(DECODE, ready=True))
    retiring = child_view(old, ready=True, record=record_of(old, retiring=True))
    actions = reconcile_parent(parent_observed(pp, (*kids, retiring)), 30.0)
    assert not [a for a in actions if isinstance(a, DeleteChild | Requeue)]
    (status,) = [a for a in actions if isinstance(a, ApplyStatus)]
    assert status.status["instancesReady"] == "2/2"
    (dropped,) = [i for i in status.status["instances"] if i["name"] == "chat-aggregated-0"]
    assert (dropped["retiring"], dropped["draining"]) == (True, False)
    # Draining for 10 s of a 30 s grace: look again in 20 s.
    since = NOW_S - 10.0
    draining = child_view(old, ready=True, record=record_of(old, since_s=since))
    actions = reconcile_parent(parent_observed(pp, (*kids, draining)), 30.0)
    assert not [a for a in actions if isinstance(a, DeleteChild)]
    (again,) = [a for a in actions if isinstance(a, Requeue)]
    assert again.after_s == pytest.approx(20.0)
    (status,) = [a for a in actions if isinstance(a, ApplyStatus)]
    (dropped,) = [i for i in status.status["instances"] if i["name"] == "chat-aggregated-0"]
    assert (dropped["retiring"], dropped["draining"]) == (False, True)
    # The grace has passed (a shorter grace setting): deleted.
    deletes = [
        a
        for a in reconcile_parent(parent_observed(pp, (*kids, draining)), 10.0)
        if isinstance(a, DeleteChild)
    ]
    assert deletes == [DeleteChild("chat-aggregated-0", "uid-chat-aggregated-0")]
    # A dropped instance that never had a committed plan serves nothing: deleted at once.
    never = dataclasses.replace(
        retiring, status=dataclasses.replace(retiring.status, current_plan=None)
    )
    deletes = [
        a
        for a in reconcile_parent(parent_observed(pp, (*kids, never)))
        if isinstance(a, DeleteChild)
    ]
    assert [d.name for d in deletes] == ["chat-aggregated-0"]
    # A plan the planner refused deletes nothing that has not drained: what runs keeps running.
    refused = ParentPlan((), 20.0, 0.0, error="the fleet planner refused the planned deployments")
    kept = reconcile_parent(parent_observed(refused, (retiring, never)))
    assert not [a for a in kept if isinstance(a, DeleteChild)]


def record_of(
    inst: PlannedInstance, *, retiring: bool = False, since_s: float = 0.0
) -> InstanceRecordStatus:
    return InstanceRecordStatus(
        of="chat",
        role=inst.role,
        pool=inst.pool,
        nodes=inst.nodes,
        retiring=retiring,
        draining=since_s > 0,
        draining_since_s=since_s,
    )


def conditions(actions: Any) -> dict[str, dict[str, Any]]:
    (status,) = [a for a in actions if isinstance(a, ApplyStatus)]
    return {c["type"]: c for c in status.status["conditions"]}


def test_the_parent_status_has_a_condition_per_shortfall_and_is_ready_when_all_are() -> None:
    why = "3 more nodes of 2x H100-SXM5-80GB would serve the rest"
    pp = ParentPlan((PREFILL, DECODE), 100.0, 20.0, ("gpus", why))
    kids = (child_view(PREFILL, ready=True), child_view(DECODE, ready=True))
    c = conditions(reconcile_parent(parent_observed(pp, kids)))
    assert c["Solved"]["status"] == "True"
    assert "serve 20 of 100 requests/s" in c["Solved"]["message"]
    (st,) = [a for a in reconcile_parent(parent_observed(pp, kids)) if isinstance(a, ApplyStatus)]
    assert st.status["plannedAttainment"] == 0.2
    assert (c["DemandServed"]["status"], c["DemandServed"]["reason"]) == ("False", "NotEnoughGPUs")
    assert c["DemandServed"]["message"] == why
    assert (c["Ready"]["status"], c["Ready"]["reason"]) == ("True", "InstancesReady")
    assert (c["Degraded"]["status"], c["Degraded"]["reason"]) == ("True", "NotEnoughGPUs")
    nothing = conditions(reconcile_parent(parent_observed(ParentPlan((), 5.0, 0.0, ("slo", "x")))))
    assert (nothing["Solved"]["status"], nothing["Solved"]["reason"]) == ("False", "SLOUnreachable")
    assert nothing["Ready"]["reason"] == "NoInstances"


def test_an_instance_launches_as_its_role_and_says_what_it_is() -> None:
    rec = InstanceRecordStatus(
        of="chat",
        role="prefill",
        pool="pool-0",
        nodes=("h100-0",),
        port=30000,
        bootstrap_port=8998,
        kv_path="RDMA ib0",
    )
    spec = child_spec("chat-prefill-0", md_spec(**CHAT), FAST_POLICY, PREFILL)
    d = dataclasses.replace(deployment(spec), name="chat-prefill-0")
    obs = observed(d, [node_view("h100-0")], assigned_nodes=("h100-0",), instance=rec)
    (solve,) = [a for a in reconcile(obs, SETTINGS) if isinstance(a, SolveAction)]
    actions = reconcile(dataclasses.replace(obs, solve=run_solve(solve)), SETTINGS)
    (cm,) = [a for a in actions if isinstance(a, ApplyConfigMap)]
    doc = json.loads(cm.body["data"]["launch.json"])
    argv = doc["nodes"][0]["argv"]
    assert argv[argv.index("--disaggregation-mode") + 1] == "prefill"
    assert argv[argv.index("--disaggregation-bootstrap-port") + 1] == "8998"
    (status,) = [a for a in actions if isinstance(a, ApplyStatus)]
    assert status.status["instance"] == to_wire(rec)


def test_a_deployment_no_longer_planned_deletes_its_instances() -> None:
    obs = observed(deployment(), children=(child_view(PREFILL),))
    (solve,) = [a for a in reconcile(obs, SETTINGS) if isinstance(a, SolveAction)]
    actions = reconcile(dataclasses.replace(obs, solve=run_solve(solve)), SETTINGS)
    assert DeleteChild("chat-prefill-0", "uid-chat-prefill-0") in actions


def test_the_kubernetes_store_reads_an_instances_record_as_the_controller_keeps_it(
    cluster: Cluster,
) -> None:
    k = cluster.kube("mixfleet-operator")
    obj = md_object("chat-decode-0", cluster.namespace)
    obj["metadata"]["labels"] = {LABEL_INSTANCE_OF: "chat"}
    k.create(MODEL_DEPLOYMENTS, obj)
    rec = InstanceRecordStatus(
        of="chat", role="decode", pool="pool-0", nodes=("h100-0",), port=30000, batch_limit=64
    )
    k.apply(
        MODEL_DEPLOYMENTS,
        {
            "metadata": {"name": "chat-decode-0", "namespace": cluster.namespace},
            "status": {"instance": to_wire(rec)},
        },
        subresource="status",
        force=True,
    )
    store = KubernetesStore(cluster.kube("mixfleet-controller"), cluster.namespace)
    try:
        d = store.get_deployment("chat-decode-0")
        assert d is not None
        got = InstanceRecord.from_status(d.status)
        assert got == InstanceRecord(
            "chat", "decode", "pool-0", "", ("h100-0",), 30000, batch_limit=64
        )
        # The controller's own status document never carries the operator's record.
        store.set_deployment_status("chat-decode-0", {**d.status, "phase": "serving"})
        live = k.get(MODEL_DEPLOYMENTS, "chat-decode-0", cluster.namespace) or {}
        assert INSTANCE_KEY not in live["status"]["controller"]
        assert live["status"]["controller"]["phase"] == "serving"
        assert live["status"]["instance"] == to_wire(rec)
    finally:
        store.close()


def test_the_crd_record_has_every_field_of_the_controllers_record() -> None:
    """The API server prunes what the CRD lacks: every key the controller's InstanceRecord
    reads must be a field of ``status.instance``, with the same meaning."""
    rec = InstanceRecord(
        "chat", "prefill", "p", "v", ("n0",), 30000, 8998, 1.5, 8, 3.0, 4.0, 5.0, True
    )
    drained = dataclasses.replace(rec, retiring=False, draining=True, draining_since_s=1.7e9)
    doc = rec.to_status()
    crd = from_wire(InstanceRecordStatus, doc, "status.instance")
    assert {k: v for k, v in to_wire(crd).items() if k in doc} == doc
    assert InstanceRecord.from_status({INSTANCE_KEY: to_wire(crd)}) == rec
    back = from_wire(InstanceRecordStatus, drained.to_status(), "status.instance")
    assert InstanceRecord.from_status({INSTANCE_KEY: to_wire(back)}) == drained


def test_a_deployment_whose_nodes_all_serve_instances_waits_and_never_plans_on_them() -> None:
    """Without the scheduler's answer (no node left: unplaceable) its own solve would plan
    on every eligible GPUNode, the instances' too: it is Unschedulable instead."""
    pool = {"pool": "a"}
    nodes = [node_view(n, inv=inventory(n, "h100-0"), labels=pool) for n in ("h100-0", "h100-1")]
    chat = md_object("chat", "team-a", **{**CHAT, "nodeSelector": pool})
    objs = [chat, md_object("big", "team-a", nodeSelector=pool, maxGpus=2)]
    for o in objs:
        o["metadata"]["generation"] = 1
    fa = FleetAssignments(planner=PLANNER)
    got, why, _ = fa.of(("team-a", "big"), objs, nodes, policy, NOW, 90.0)
    pp = fa.parent(("team-a", "chat"))
    assert pp is not None and {n for i in pp.instances for n in i.nodes} == {"h100-0", "h100-1"}
    assert got == ()
    assert why.startswith("2 of its 2 eligible GPUNodes serve planned deployments' instances")


def test_priority_orders_planned_and_unplanned_deployments_alike() -> None:
    """A ModelDeployment without traffic of a higher priority keeps a GPUNode from a planned
    one that wants every GPUNode (policies.fleetplan.combined); at the planned one's
    priority, new, it waits for the planned one's instances and says so."""
    hungry: dict[str, Any] = json.loads(json.dumps(CHAT))
    hungry["traffic"]["requestsPerS"] = 1000
    every = {n.name for n in NODES}
    for prio, batch_gets in ((100, 1), (0, 0)):
        fa = FleetAssignments(planner=PLANNER)
        batch = md_object("batch", "team-a", maxGpus=2, priority=prio)
        chat = md_object("chat", "team-a", **hungry)
        objs = [chat, batch]
        for o in objs:
            o["metadata"]["generation"] = 1
        fa.of(("team-a", "chat"), objs, NODES, policy, NOW, 90.0)
        pp = fa.parent(("team-a", "chat"))
        assert pp is not None and not pp.error
        planned = {n for i in pp.instances for n in i.nodes}
        nodes, why, _ = fa.of(("team-a", "batch"), objs, NODES, policy, NOW, 90.0)
        assert nodes is not None
        assert len(nodes) == batch_gets and planned == every - set(nodes), (prio, nodes, planned)
        if batch_gets:
            assert why == ""
        else:
            assert "serve planned deployments' instances" in why and "higher priority" in why
