"""Deployment strategies in the operator: the PlacementPolicy's (and the deployment's)
``allowCrossVendor`` and ``gpuHourPrices``, and the interactive tier.

The pure decision is driven through whole ticks with real tier splits and solves of
mixtral-8x7b on two-GPU nodes (well under a second each); the last tests run the operator
against the API server.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from k8s_builders import (
    FAST_POLICY,
    deployment,
    inventory,
    md_object,
    md_spec,
    node_view,
    observed,
    plan_view_from,
    policy_object,
    run_solve,
    with_status,
)
from k8s_cluster import RUN_LABEL, Cluster, wait_for

from apis.kube.client import MODEL_DEPLOYMENTS, PARTITION_PLANS, PLACEMENT_POLICIES, Kube
from apis.kube.errors import InvalidError
from apis.kube.v1alpha1 import InteractiveTierSpec, PlacementPolicySpec
from operators.decide import (
    ApplyConfigMap,
    ApplyPlan,
    ApplyStatus,
    Requeue,
    SolveAction,
    TierAction,
    reconcile,
)
from operators.observe import ConfigMapView, Observed, ReconcileSettings, TierOutcome
from operators.operator import Operator, OperatorSettings
from policies.advice.cost import DEFAULT_USD_PER_GPU_HOUR
from policies.advice.tier_planner import plan_tiers
from policies.advice.tiers import TierRequest
from policies.errors import InputError
from policies.hardware.fleet import parse_node
from policies.hardware.inventory import inventory_from_node

SETTINGS = ReconcileSettings(node_stale_after_s=90.0, plan_history=2, solver_error_retry_s=60.0)
#: Met by one two-GPU H100 node (about 24 requests/s), not by the whole test fleet.
SLO = InteractiveTierSpec(
    tpot_ms=30.0, ttft_ms=1000.0, requests_per_s=1.0, prompt_tokens=1024, output_tokens=128
)
TIER_POLICY = dataclasses.replace(FAST_POLICY, interactive=SLO)
THREE_NODES = ("h100-0", "h100-1", "a100-0")


def mi300x_view(name: str = "mi300x-0") -> Any:
    doc = {
        "name": name,
        "gpus": [{"model": "MI300X", "count": 2}],
        "nvlink": {"per_gpu_bidir_gbytes_per_s": 896},
        "nics": [{"count": 1, "per_direction_gbits_per_s": 400, "fabric": "ib0"}],
    }
    return node_view(name, inv=inventory_from_node(parse_node(doc)))


def run_tiers(action: TierAction) -> TierOutcome:
    try:
        return TierOutcome(action.inputs_digest, plan_tiers(action.request), "Planned", "", 0.2)
    except InputError as exc:
        return TierOutcome(action.inputs_digest, None, "InvalidTier", str(exc), 0.0)


def tick(obs: Observed) -> tuple[tuple[object, ...], Observed]:
    """One tick as the operator runs it: decide, split / solve when asked, decide again.
    Returns the final actions and the observation they were decided on."""
    actions = reconcile(obs, SETTINGS)
    for _ in range(3):
        step = next((a for a in actions if isinstance(a, TierAction | SolveAction)), None)
        if step is None:
            break
        if isinstance(step, TierAction):
            obs = dataclasses.replace(obs, tiers=run_tiers(step))
        else:
            obs = dataclasses.replace(obs, solve=run_solve(step))
        actions = reconcile(obs, SETTINGS)
    assert not any(isinstance(a, TierAction | SolveAction) for a in actions)
    return actions, obs


def apply_world(obs: Observed, actions: tuple[object, ...]) -> Observed:
    """The next observation: plans created and the status written."""
    plans = list(obs.plans)
    d = obs.deployment
    cm = obs.config_map
    for a in actions:
        if isinstance(a, ApplyPlan):
            plans.append(plan_view_from(a.body, uid=f"uid-{a.name}"))
        elif isinstance(a, ApplyStatus):
            d = with_status(d, a.status)
        elif isinstance(a, ApplyConfigMap):
            meta = a.body["metadata"]
            plan = meta["annotations"]["mixfleet.io/plan"]
            cm = ConfigMapView(meta["name"], plan, tuple(sorted(a.body["data"])))
    return dataclasses.replace(
        obs,
        plans=tuple(plans),
        config_map=cm,
        deployment=d,
        solve=None,
        tiers=None,
        now=obs.now + timedelta(seconds=10),
    )


def only(actions: tuple[object, ...], kind: type) -> list[Any]:
    return [a for a in actions if isinstance(a, kind)]


def status_of(actions: tuple[object, ...]) -> dict[str, Any]:
    (st,) = only(actions, ApplyStatus)
    return dict(st.status)


def cond(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == type_)


def nodes(*names: str) -> list[Any]:
    return [node_view(n) for n in names]


# ------------------------------------------------------------------------ vendors


def test_mixed_vendor_fleet_is_refused_unless_the_policy_allows_it() -> None:
    fleet = [node_view("h100-0"), mi300x_view()]
    refused = reconcile(observed(nodes=fleet), SETTINGS)
    assert not only(refused, SolveAction) and not only(refused, ApplyPlan)
    solved = cond(status_of(refused), "Solved")
    assert solved["status"] == "False" and solved["reason"] == "MixedVendors"
    assert "2 amd, 2 nvidia GPUs" in solved["message"]
    assert "nodeSelector" in solved["message"] and "allowCrossVendor" in solved["message"]

    allowed_policy = dataclasses.replace(FAST_POLICY, allow_cross_vendor=True)
    first = reconcile(observed(nodes=fleet, policy=allowed_policy), SETTINGS)
    (solve,) = only(first, SolveAction)
    assert solve.request.allow_cross_vendor is True
    allowed, _ = tick(observed(nodes=fleet, policy=allowed_policy))
    (plan,) = only(allowed, ApplyPlan)
    assert {g["model"] for g in plan.body["spec"]["gpus"]} == {"H100-SXM5-80GB", "MI300X"}
    assert cond(status_of(allowed), "Solved")["status"] == "True"

    # The deployment's own field overrides the policy's.
    own = deployment(md_spec(allowCrossVendor=False))
    overridden = reconcile(observed(own, nodes=fleet, policy=allowed_policy), SETTINGS)
    assert not only(overridden, SolveAction)
    assert cond(status_of(overridden), "Solved")["reason"] == "MixedVendors"


def test_allow_cross_vendor_changes_the_solve_inputs() -> None:
    fleet = [node_view("h100-0"), node_view("a100-0")]
    plain = only(reconcile(observed(nodes=fleet), SETTINGS), SolveAction)[0]
    allowed_policy = dataclasses.replace(FAST_POLICY, allow_cross_vendor=True)
    allowed = only(reconcile(observed(nodes=fleet, policy=allowed_policy), SETTINGS), SolveAction)
    assert plain.inputs_digest != allowed[0].inputs_digest


# --------------------------------------------------------------------------- cost


def test_status_reports_cost_per_million_tokens_at_policy_and_deployment_prices() -> None:
    policy = dataclasses.replace(FAST_POLICY, gpu_hour_prices={"H100-SXM5-80GB": 2.0})
    d = deployment(md_spec(gpuHourPrices={"A100-SXM4-80GB": 1.0}))
    actions, _ = tick(observed(d, policy=policy))
    (plan,) = only(actions, ApplyPlan)
    spec = plan.body["spec"]
    price = {**DEFAULT_USD_PER_GPU_HOUR, "H100-SXM5-80GB": 2.0, "A100-SXM4-80GB": 1.0}
    per_hour = sum(price[g["model"]] for g in spec["gpus"])
    assert per_hour == pytest.approx(2 * 2.0 + 2 * 1.0)
    st = status_of(actions)
    assert st["costPerHourUSD"] == pytest.approx(per_hour)
    want = per_hour / (spec["tokensPerSecond"] * 3600) * 1e6
    assert st["costPerMillionTokensUSD"] == pytest.approx(want, rel=1e-5)

    # Default prices without any gpuHourPrices.
    plain, _ = tick(observed())
    st = status_of(plain)
    assert st["costPerHourUSD"] == pytest.approx(2 * 2.99 + 2 * 1.80)


def test_price_change_updates_the_cost_without_a_new_plan() -> None:
    obs = observed()
    actions, obs = tick(obs)
    world = apply_world(obs, actions)
    cheaper = dataclasses.replace(FAST_POLICY, gpu_hour_prices={"H100-SXM5-80GB": 0.0})
    again = reconcile(dataclasses.replace(world, policy=cheaper), SETTINGS)
    assert not only(again, SolveAction) and not only(again, ApplyPlan)
    st = status_of(again)
    assert st["costPerHourUSD"] == pytest.approx(2 * 1.80)


@pytest.mark.parametrize(
    ("policy_prices", "md_prices", "field", "suggestion"),
    [
        ({"H100": 2.0}, {}, "PlacementPolicy fast spec.gpuHourPrices.H100", "H100-SXM5-80GB"),
        ({}, {"A100-80GB": 1.0}, "spec.gpuHourPrices.A100-80GB", "A100-SXM4-80GB"),
    ],
)
def test_unknown_gpu_in_prices_is_a_condition_not_a_crash(
    policy_prices: dict[str, float], md_prices: dict[str, float], field: str, suggestion: str
) -> None:
    # The CRD refuses unknown names at apply; objects stored under older CRDs still come.
    policy = dataclasses.replace(FAST_POLICY, gpu_hour_prices=policy_prices)
    d = deployment(md_spec(gpuHourPrices=md_prices))
    actions = reconcile(observed(d, policy=policy, policy_name="fast"), SETTINGS)
    assert not only(actions, SolveAction)
    solved = cond(status_of(actions), "Solved")
    assert solved["status"] == "False" and solved["reason"] == "InvalidPrices"
    assert field in solved["message"] and suggestion in solved["message"]
    assert "To fix" in solved["message"]


# -------------------------------------------------------------------------- tiers


def test_interactive_tier_is_split_first_and_the_plan_is_the_batch_tier() -> None:
    obs = observed(nodes=nodes(*THREE_NODES), policy=TIER_POLICY)
    first = reconcile(obs, SETTINGS)
    (split,) = only(first, TierAction)
    assert not only(first, SolveAction)
    assert isinstance(split.request, TierRequest)
    assert sorted(n.name for n in split.request.deployment.fleet.nodes) == sorted(THREE_NODES)
    assert split.request.interactive.tpot_ms == 30.0
    assert split.request.batch.tokens_per_gpu == 16  # the deployment's workload

    actions, obs = tick(obs)
    st = status_of(actions)
    tiers = st["tiers"]
    assert tiers["outcome"] == "Succeeded" and tiers["sloMet"] is True
    assert tiers["interactiveNodes"] == ["h100-0"]  # fastest first; one H100 node suffices
    assert sorted(tiers["batchNodes"]) == ["a100-0", "h100-1"]
    (replica,) = tiers["replicas"]
    assert replica["nodes"] == ["h100-0"] and replica["gpuModel"] == "H100-SXM5-80GB"
    assert replica["tpotMs"] <= 30.0 and replica["ttftMs"] <= 1000.0
    assert replica["requestsPerSecond"] >= 1.0
    slo = cond(st, "InteractiveSLO")
    assert slo["status"] == "True" and slo["reason"] == "SLOMet"
    assert "h100-0" in slo["message"] and "TPOT 30 ms" in slo["message"]
    # The deployment's own plan leaves the interactive node out.
    (plan,) = only(actions, ApplyPlan)
    assert sorted(plan.body["spec"]["nodes"]) == ["a100-0", "h100-1"]
    assert cond(st, "Solved")["status"] == "True"

    # The split is recorded: the next tick neither splits nor solves again.
    world = apply_world(obs, actions)
    again = reconcile(world, SETTINGS)
    assert [type(a) for a in again] == [Requeue]

    # A new rate is a new split.
    busier = dataclasses.replace(
        TIER_POLICY, interactive=dataclasses.replace(SLO, requests_per_s=30)
    )
    assert only(reconcile(dataclasses.replace(world, policy=busier), SETTINGS), TierAction)


def test_unmet_slo_says_what_to_add_and_never_crashes() -> None:
    hopeless = dataclasses.replace(
        TIER_POLICY,
        interactive=dataclasses.replace(SLO, requests_per_s=5000.0),
        gpu_hour_prices={"H200-SXM-141GB": 4.0},
    )
    actions, _ = tick(observed(nodes=nodes(*THREE_NODES), policy=hopeless))
    st = status_of(actions)
    slo = cond(st, "InteractiveSLO")
    assert slo["status"] == "False" and slo["reason"] == "SLONotMet"
    assert "5000.00 asked" in slo["message"] and "add any one of" in slo["message"]
    tiers = st["tiers"]
    assert tiers["sloMet"] is False and tiers["additions"]
    h200 = next(a for a in tiers["additions"] if a["gpuModel"] == "H200-SXM-141GB")
    assert h200["usdPerHour"] == pytest.approx(h200["nodes"] * h200["gpusPerNode"] * 4.0)
    costs = [a["usdPerHour"] for a in tiers["additions"]]
    assert costs == sorted(costs)  # cheapest first
    # Every eligible unit serves the tier, so nothing is left for the deployment's plan.
    assert sorted(tiers["interactiveNodes"]) == sorted(THREE_NODES) and not tiers["batchNodes"]
    solved = cond(st, "Solved")
    assert solved["status"] == "False" and solved["reason"] == "NoEligibleNodes"
    assert "reserved for the interactive tier" in solved["message"]
    assert not only(actions, ApplyPlan)


def test_invalid_tier_is_reported_and_the_deployment_still_placed() -> None:
    # The CRD rejects a tier without targets; a policy that slipped through is reported.
    no_target = dataclasses.replace(
        TIER_POLICY, interactive=InteractiveTierSpec(requests_per_s=1.0)
    )
    actions, obs = tick(observed(policy=no_target, policy_name="fast"))
    st = status_of(actions)
    slo = cond(st, "InteractiveSLO")
    assert slo["status"] == "False" and slo["reason"] == "InvalidTier"
    assert "PlacementPolicy fast spec.interactive has no latency target" in slo["message"]
    assert "To fix: set tpotMs" in slo["message"]
    assert cond(st, "Solved")["status"] == "True"  # one tier over every node
    (plan,) = only(actions, ApplyPlan)
    assert sorted(plan.body["spec"]["nodes"]) == ["a100-0", "h100-0"]
    assert [type(a) for a in reconcile(apply_world(obs, actions), SETTINGS)] == [Requeue]


def test_failed_split_is_retried_after_the_solver_retry_delay() -> None:
    obs = observed(nodes=nodes(*THREE_NODES), policy=TIER_POLICY)
    (split,) = only(reconcile(obs, SETTINGS), TierAction)
    broken = TierOutcome(split.inputs_digest, None, "TierPlanningFailed", "solver crashed", 0.1)
    actions = reconcile(dataclasses.replace(obs, tiers=broken), SETTINGS)
    # Meanwhile the deployment is placed on every node as one tier.
    (solve,) = only(actions, SolveAction)
    assert len(solve.request.fleet.nodes) == 3
    actions = reconcile(dataclasses.replace(obs, tiers=broken, solve=run_solve(solve)), SETTINGS)
    st = status_of(actions)
    assert cond(st, "InteractiveSLO")["reason"] == "TierPlanningFailed"
    assert any(isinstance(a, Requeue) and a.after_s == pytest.approx(60.0) for a in actions)
    world = apply_world(dataclasses.replace(obs, tiers=broken), actions)
    assert not only(reconcile(world, SETTINGS), TierAction)  # 10 s later: not yet
    later = dataclasses.replace(world, now=world.now + timedelta(seconds=60))
    assert only(reconcile(later, SETTINGS), TierAction)


def test_adding_an_interactive_tier_replans_without_its_nodes_and_says_why() -> None:
    obs = observed(nodes=nodes(*THREE_NODES))
    actions, obs = tick(obs)
    world = apply_world(obs, actions)
    actions, _ = tick(dataclasses.replace(world, policy=TIER_POLICY))
    (plan,) = only(actions, ApplyPlan)
    assert plan.body["spec"]["version"] == 2
    assert "h100-0" not in plan.body["spec"]["nodes"]
    assert plan.body["spec"]["reason"] == (
        "fleet changed: -h100-0 (interactive replica 1 (H100-SXM5-80GB))"
    )


def test_removing_the_interactive_tier_drops_its_status_and_replans_on_every_node() -> None:
    obs = observed(nodes=nodes(*THREE_NODES), policy=TIER_POLICY)
    actions, obs = tick(obs)
    world = apply_world(obs, actions)
    actions, obs = tick(dataclasses.replace(world, policy=FAST_POLICY))
    st = status_of(actions)
    assert "tiers" not in st
    assert all(c["type"] != "InteractiveSLO" for c in st["conditions"])
    (plan,) = only(actions, ApplyPlan)
    assert sorted(plan.body["spec"]["nodes"]) == sorted(THREE_NODES)


# ------------------------------------------------------------- against the API server


@pytest.fixture
def tier_world(cluster: Cluster) -> Iterator[Kube]:
    """Three GPUNodes and a default policy with an interactive tier and prices."""
    k = cluster.kube("mixfleet-test")
    spec = {
        "policy": "greedy",
        "solverTimeLimitS": 5,
        "workers": 1,
        "interactive": {
            "tpotMs": 30,
            "ttftMs": 1000,
            "requestsPerS": 1,
            "promptTokens": 1024,
            "outputTokens": 128,
        },
        "gpuHourPrices": {"H100-SXM5-80GB": 2.0},
    }
    k.create(PLACEMENT_POLICIES, policy_object(cluster.name("default"), **spec))
    for n in THREE_NODES:
        cluster.put_gpunode(k, n, inventory(n), labels={"rack": "r1"})
    yield k


def start_operator(cluster: Cluster, planner: Any = plan_tiers) -> Operator:
    settings = OperatorSettings(
        namespaces=(cluster.namespace,),
        default_policy=cluster.name("default"),
        workers=1,
        watch_timeout_s=5,
        retry_base_delay_s=0.05,
        retry_max_delay_s=1.0,
        reconcile=ReconcileSettings(node_stale_after_s=600.0),
        leader=None,
    )
    op = Operator(cluster.kube("mixfleet-operator"), settings, tier_planner=planner)
    op.start(wait_synced_s=10)
    return op


def reported(k: Kube, cluster: Cluster, solved: str) -> dict[str, Any] | None:
    """The deployment's status once ``Solved`` has status ``solved`` and InteractiveSLO is
    reported; else None."""
    obj = k.get(MODEL_DEPLOYMENTS, "mx", cluster.namespace) or {}
    st = dict(obj.get("status") or {})
    conds = st.get("conditions") or []
    done = any(c["type"] == "Solved" and c["status"] == solved for c in conds)
    return st if done and any(c["type"] == "InteractiveSLO" for c in conds) else None


@pytest.mark.slow
def test_operator_reports_tiers_and_cost_in_the_status(cluster: Cluster, tier_world: Kube) -> None:
    k = tier_world
    splits: list[TierRequest] = []

    def planner(req: TierRequest) -> Any:
        splits.append(req)
        return plan_tiers(req)

    op = start_operator(cluster, planner)
    try:
        k.create(
            MODEL_DEPLOYMENTS,
            md_object("mx", cluster.namespace, nodeSelector={RUN_LABEL: cluster.run}),
        )
        st = wait_for(lambda: reported(k, cluster, "True"), what="Solved and InteractiveSLO")
        slo = next(c for c in st["conditions"] if c["type"] == "InteractiveSLO")
        assert slo["status"] == "True" and slo["reason"] == "SLOMet"
        h100_0 = cluster.name("h100-0")
        assert st["tiers"]["interactiveNodes"] == [h100_0]
        items, _ = k.list(
            PARTITION_PLANS, cluster.namespace, label_selector="mixfleet.io/deployment=mx"
        )
        (plan,) = items
        assert h100_0 not in plan["spec"]["nodes"] and len(plan["spec"]["nodes"]) == 2
        price = {**DEFAULT_USD_PER_GPU_HOUR, "H100-SXM5-80GB": 2.0}
        per_hour = sum(price[g["model"]] for g in plan["spec"]["gpus"])
        assert st["costPerHourUSD"] == pytest.approx(per_hour)
        want = per_hour / (plan["spec"]["tokensPerSecond"] * 3600) * 1e6
        assert st["costPerMillionTokensUSD"] == pytest.approx(want, rel=1e-5)
    finally:
        op.stop()
    # One more tick by hand (the workers are stopped): the recorded split is reused.
    actions = op.reconcile_key((cluster.namespace, "mx"))
    assert not any(isinstance(a, TierAction | SolveAction) for a in actions)
    assert len(splits) == op.tier_splits == 1 and op.solves == 1


def test_policy_schema_default_has_no_interactive_tier() -> None:
    assert PlacementPolicySpec().interactive is None


@pytest.mark.slow
def test_operator_reports_an_impossible_slo_and_the_api_refuses_unknown_prices(
    cluster: Cluster, tier_world: Kube
) -> None:
    k = tier_world
    name = cluster.name("default")
    obj = k.get(PLACEMENT_POLICIES, name)
    assert obj is not None
    spec = dict(obj["spec"])
    spec["interactive"] = {**spec["interactive"], "requestsPerS": 5000}
    # Forced (kubectl apply --server-side --force-conflicts): the policy was created by
    # another operation, a create, whose manager owns these fields.
    k.apply(PLACEMENT_POLICIES, policy_object(name, **spec), force=True)
    op = start_operator(cluster)
    try:
        k.create(
            MODEL_DEPLOYMENTS,
            md_object("mx", cluster.namespace, nodeSelector={RUN_LABEL: cluster.run}),
        )
        st = wait_for(lambda: reported(k, cluster, "False"), what="InteractiveSLO reported")
        slo = next(c for c in st["conditions"] if c["type"] == "InteractiveSLO")
        assert slo["status"] == "False" and slo["reason"] == "SLONotMet"
        assert "add any one of" in slo["message"]
        assert st["tiers"]["additions"] and all(
            a["usdPerHour"] > 0 for a in st["tiers"]["additions"]
        )
        solved = next(c for c in st["conditions"] if c["type"] == "Solved")
        assert solved["reason"] == "NoEligibleNodes"

        # A price for a GPU the catalog does not know: refused at apply, field named.
        with pytest.raises(InvalidError) as exc:
            k.apply(
                PLACEMENT_POLICIES,
                policy_object(name, **{**spec, "gpuHourPrices": {"H100-80GB": 2.0}}),
                force=True,
            )
        assert "gpuHourPrices" in str(exc.value) and "H100-SXM5-80GB" in str(exc.value)
        assert op.healthy()
    finally:
        op.stop()


def test_controller_store_keeps_the_strategy_fields_of_a_model_deployment(
    cluster: Cluster,
) -> None:
    from controlplane.store.kubernetes import KubernetesStore
    from policies.spec.build import DeploymentSpec, WorkloadSpec

    store = KubernetesStore(cluster.kube("store-setup"), cluster.namespace)
    try:
        spec = DeploymentSpec(
            name="mx",
            model="mixtral-8x7b",
            policy="greedy",
            workload=WorkloadSpec(tokens_per_gpu=16, tokens_per_gpu_set=True),
            allow_cross_vendor=True,
            gpu_hour_prices={"MI300X": 2.5},
        )
        d = store.put_deployment(spec, now_s=1.0, create_only=True)
        assert d.spec == spec and d.generation == 1
        assert store.put_deployment(spec, now_s=2.0).generation == 1  # unchanged: no bump
        obj = cluster.kube().get(MODEL_DEPLOYMENTS, "mx", cluster.namespace)
        assert obj is not None
        assert obj["spec"]["allowCrossVendor"] is True
        assert obj["spec"]["gpuHourPrices"] == {"MI300X": 2.5}
        plain = dataclasses.replace(spec, allow_cross_vendor=False, gpu_hour_prices={})
        d2 = store.put_deployment(plain, now_s=3.0)
        assert d2.generation == 2 and d2.spec.allow_cross_vendor is False
    finally:
        store.close()
