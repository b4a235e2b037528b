"""Demand drift in Kubernetes mode: the controller writes the measured demand and its drift
decision in its part of the ModelDeployment's status (``status.controller.demand``); the
operator plans a planned deployment for the traffic chosen there (while the spec's traffic
is the one it was measured against), re-plans when that choice changes - more instances for
more demand - and reports the demand planned for and where it comes from."""

from __future__ import annotations

import dataclasses
import json
from datetime import timedelta
from typing import Any

import pytest
from k8s_builders import FAST_POLICY, T0, deployment, inventory, md_object, md_spec, node_view
from k8s_builders import observed as observed_of
from test_operator_instances_e2e import CHAT, PLANNER

from apis.kube import demand as kube_demand
from apis.kube.demand import replanned_demand
from apis.kube.v1alpha1 import MODEL_DEPLOYMENT, PlacementPolicySpec
from controlplane.server.controller import demand as controller_demand
from controlplane.server.controller.demand import DemandStatus
from controlplane.server.controller.measured import MeasuredDemand
from operators.decide import ApplyChild, ApplyStatus
from operators.fleet_schedule import FleetAssignments
from operators.parent import reconcile_parent
from policies.serving.traffic import Traffic, traffic_from_doc, traffic_to_doc
from policies.spec.build import DeploymentSpec

NOW = T0 + timedelta(seconds=5)
NODES = [node_view(n, inv=inventory(n, "h100-0")) for n in ("h100-0", "h100-1", "h100-2")]
KEY = ("team-a", "chat")
STATED = traffic_from_doc(CHAT["traffic"], "traffic")
#: What the routers measured after the demand rose fivefold (the stated lengths).
MEASURED = dataclasses.replace(STATED, requests_per_s=100.0)


def policy(_: str) -> PlacementPolicySpec:
    return FAST_POLICY


def demand_doc(
    planned: Traffic | None, against: Traffic = STATED, measured_rps: float = 100.0
) -> dict[str, Any]:
    """The controller's record, written by its own code (DemandStatus.to_doc)."""
    st = DemandStatus(
        planned=planned,
        spec_traffic=traffic_to_doc(against) if planned is not None else None,
        measured=MeasuredDemand(1e9, 1e9 + 60, measured_rps, requests=measured_rps * 60),
        last_replan_s=1e9 + 60 if planned is not None else None,
        last_replan_reason="measured 100 requests/s over 60 s, above the planned 20"
        * bool(planned),
        replans=1 if planned is not None else 0,
    )
    return st.to_doc()


def chat(demand: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    o = md_object("chat", "team-a", **{**CHAT, **spec})
    o["metadata"]["generation"] = 1
    if demand is not None:
        o["status"] = {"controller": {"demand": demand, "rollout": {"x": 1}}}
    return o


def plan(fa: FleetAssignments, obj: dict[str, Any]) -> tuple[bool, Any]:
    _, _, changed = fa.of(KEY, [obj], NODES, policy, NOW, 90.0)
    pp = fa.parent(KEY)
    assert pp is not None and not pp.error, pp
    return changed, pp


def test_the_reader_agrees_with_the_controller_on_its_own_records() -> None:
    assert kube_demand.DEMAND_KEY == controller_demand.DEMAND_KEY
    spec = DeploymentSpec("chat", model="qwen3-30b-a3b", traffic=STATED)
    other = dataclasses.replace(STATED, requests_per_s=30.0)
    cases = [
        demand_doc(MEASURED),  # a drift against the stated traffic
        demand_doc(MEASURED, against=other),  # the spec's traffic changed since
        demand_doc(None),  # measured only
        {"planned": {"requestsPerS": -1}, "specTraffic": traffic_to_doc(STATED)},  # unreadable
        {"planned": traffic_to_doc(MEASURED)},  # no specTraffic
        {},
    ]
    for doc in cases:
        want = DemandStatus.from_status({"demand": doc}).planning_traffic(spec)
        got = replanned_demand(STATED, {"controller": {"demand": doc}})
        assert (got.traffic if got else STATED) == want, doc
    assert replanned_demand(None, {"controller": {"demand": demand_doc(MEASURED)}}) is None
    assert replanned_demand(STATED, {"controller": "junk"}) is None
    assert replanned_demand(STATED, None) is None
    got = replanned_demand(STATED, {"controller": {"demand": demand_doc(MEASURED)}})
    assert got is not None and got.reason.startswith("measured 100 requests/s")


def test_the_controllers_choice_replans_with_more_instances_and_measured_figures_do_not() -> None:
    fa = FleetAssignments(planner=PLANNER)
    changed, pp = plan(fa, chat(demand_doc(None, measured_rps=21.0)))
    assert changed and pp.demand_from == "Spec" and pp.demand_requests_per_s == 20.0
    assert [i.name for i in pp.instances] == ["chat-prefill-0", "chat-decode-0"]
    # New measured figures alone (the controller rewrites them every few seconds): no re-plan.
    changed, same = plan(fa, chat(demand_doc(None, measured_rps=23.0)))
    assert not changed and same == pp

    changed, pp = plan(fa, chat(demand_doc(MEASURED)))
    assert changed
    assert (pp.demand_from, pp.demand_requests_per_s) == ("Measured", 100.0)
    assert pp.served_requests_per_s == pytest.approx(100.0)
    assert pp.replan_reason.startswith("measured 100 requests/s")
    names = [i.name for i in pp.instances]
    assert names == ["chat-prefill-0", "chat-prefill-1", "chat-decode-0"]
    # The instances that ran keep their names and nodes: the new one is a surge beside them.
    assert {i.name: i.nodes for i in pp.instances if i.name != "chat-prefill-1"} == {
        "chat-prefill-0": ("h100-1",),
        "chat-decode-0": ("h100-0",),
    }
    changed, _ = plan(fa, chat(demand_doc(MEASURED, measured_rps=97.0)))
    assert not changed


def test_a_new_stated_traffic_is_planned_for_over_an_older_measurement() -> None:
    fa = FleetAssignments(planner=PLANNER)
    plan(fa, chat(demand_doc(MEASURED)))
    stated = {**traffic_to_doc(STATED), "requestsPerS": 30}
    obj = chat(demand_doc(MEASURED), traffic=stated)
    obj["metadata"]["generation"] = 2
    changed, pp = plan(fa, obj)
    assert changed and (pp.demand_from, pp.demand_requests_per_s) == ("Spec", 30.0)
    assert len(pp.instances) == 2


def test_the_parent_adds_the_instance_and_reports_the_demand_planned_for() -> None:
    fa = FleetAssignments(planner=PLANNER)
    _, pp = plan(fa, chat(demand_doc(MEASURED)))
    obs = observed_of(deployment(md_spec(**CHAT)), planned=pp)
    actions = reconcile_parent(obs)
    applied = [a.name for a in actions if isinstance(a, ApplyChild)]
    assert applied == ["chat-prefill-0", "chat-prefill-1", "chat-decode-0"]
    (status,) = [a for a in actions if isinstance(a, ApplyStatus)]
    doc = status.status
    assert (doc["demandFrom"], doc["demandRequestsPerSecond"]) == ("Measured", 100.0)
    assert doc["plannedAttainment"] == pytest.approx(1.0)
    solved = next(c for c in doc["conditions"] if c["type"] == "Solved")
    assert solved["status"] == "True"
    assert (
        "serve 100 of 100 requests/s within the SLO (the measured demand: measured 100"
        in (solved["message"])
    )
    served = next(c for c in doc["conditions"] if c["type"] == "DemandServed")
    assert served["message"] == "the plan serves the measured 100 requests/s within the SLO"
    assert "controller" not in doc  # the controller's part is the controller's alone


def test_kubectl_shows_the_demand_planned_for_and_the_measured_one() -> None:
    (version,) = MODEL_DEPLOYMENT.manifest()["spec"]["versions"]
    cols = {c["name"]: c for c in version["additionalPrinterColumns"]}
    assert cols["DemandFrom"]["jsonPath"] == ".status.demandFrom"
    assert cols["MeasuredRPS"]["jsonPath"] == ".status.controller.demand.measured.requestsPerS"
    assert cols["MeasuredRPS"]["priority"] == cols["DemandRPS"]["priority"] == 1
    attainment = cols["MeasuredAttainment"]
    assert attainment["jsonPath"] == ".status.controller.demand.measured.sloAttainment"
    assert attainment["priority"] == 1 and attainment["type"] == "number"
    # The path the column reads is where the controller writes the measured rate.
    assert demand_doc(None, measured_rps=21.0)["measured"]["requestsPerS"] == 21.0
    judged = MeasuredDemand(1e9, 1e9 + 60, 2.0, requests=120, slo_judged=80, slo_met=60)
    assert DemandStatus(measured=judged).to_doc()["measured"]["sloAttainment"] == 0.75
    assert "sloAttainment" not in demand_doc(None)["measured"]  # none judged: the cell is empty
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert status["demandFrom"]["enum"] == ["Spec", "Measured"]
    assert json.dumps(status["controller"]).count("preserve-unknown-fields") == 1
