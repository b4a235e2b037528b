"""The controller's Kubernetes store (controlplane/store/kubernetes/) keeps the Store
contract: nodes, deployments and their generation, versions that only grow (also across
delete and re-create), one committed plan, idempotent acks, load windows."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from k8s_builders import inventory, propose_plan
from k8s_cluster import Cluster

from apis.kube.client import MODEL_DEPLOYMENTS, PARTITION_PLANS
from controlplane.errors import AlreadyExistsError, NotFoundError, PreconditionError
from controlplane.store.base import LoadWindow, Store, StoredAck, StoredNode
from controlplane.store.kubernetes import KubernetesStore, from_time, to_time
from policies.estimate.workload import make_workload
from policies.hardware.fleet import parse_fleet
from policies.model.architecture import preset
from policies.plan import Plan
from policies.request import PlacementRequest
from policies.solve import solve
from policies.spec.build import DeploymentSpec, WorkloadSpec

SPEC = DeploymentSpec(
    name="mx",
    model="mixtral-8x7b",
    policy="greedy",
    workload=WorkloadSpec(tokens_per_gpu=16, tokens_per_gpu_set=True),
)


NICS = [{"count": 1, "per_direction_gbits_per_s": 400, "fabric": "ib0"}]


@pytest.fixture(scope="module")
def plan() -> Plan:
    model = preset("mixtral-8x7b")
    doc = {"metadata": {"name": "f"}, "spec": {"nodes": [
        {"name": "h100-0", "gpus": [{"model": "H100-SXM5-80GB", "count": 2}], "nics": NICS},
        {"name": "a100-0", "gpus": [{"model": "A100-SXM4-80GB", "count": 2}], "nics": NICS},
    ]}}  # fmt: skip
    w = make_workload(model, phase="decode", tokens_per_gpu=16, context_len=2048)
    return solve(
        PlacementRequest(parse_fleet(doc), model, w, policy="greedy", redundant_experts=0)
    ).plan


@pytest.fixture
def store(cluster: Cluster) -> Iterator[KubernetesStore]:
    s = KubernetesStore(cluster.kube("store-setup"), cluster.namespace)
    yield s
    s.close()


def test_it_is_a_store(store: KubernetesStore) -> None:
    typed: Store = store  # mypy checks the Protocol
    assert typed.controller_id() == store.controller_id() != ""


def test_times_round_trip_to_the_microsecond() -> None:
    for t in (0.0, 1.0, 1_767_225_600.123456, 1_767_225_600.5):
        assert from_time(to_time(t)) == t


def test_nodes_round_trip_and_update(cluster: Cluster, store: KubernetesStore) -> None:
    name = cluster.name("h100-0")
    inv = inventory(name, "h100-0")
    store.upsert_node(StoredNode(name, inv, "sess-1", 10.5, 11.25, applied={"mx": 1}))
    got = store.get_node(name)
    assert got is not None
    assert got.inventory == inv
    assert (got.session_id, got.registered_at_s, got.last_heartbeat_s, got.applied) == (
        "sess-1",
        10.5,
        11.25,
        {"mx": 1},
    )
    store.update_node_status(name, last_heartbeat_s=20.0, state="draining", message="maintenance")
    got = store.get_node(name)
    assert got is not None and (got.last_heartbeat_s, got.state, got.message) == (
        20.0,
        "draining",
        "maintenance",
    )
    assert got.session_id == "sess-1"  # untouched fields stay
    store.update_node_status(cluster.name("nobody"), state="ready")  # unknown: no-op
    assert name in [n.name for n in store.list_nodes()]
    assert store.delete_node(name) and store.get_node(name) is None and not store.delete_node(name)


def test_deployments_generation_and_create_update_only(
    cluster: Cluster, store: KubernetesStore
) -> None:
    d = store.put_deployment(SPEC, now_s=100.0, create_only=True)
    assert (d.generation, d.created_at_s, d.spec) == (1, 100.0, SPEC)
    assert store.put_deployment(SPEC, now_s=101.0).generation == 1  # unchanged
    with pytest.raises(AlreadyExistsError):
        store.put_deployment(SPEC, now_s=102.0, create_only=True)
    with pytest.raises(NotFoundError):
        store.put_deployment(
            DeploymentSpec(name="other", model="mixtral-8x7b"), now_s=1.0, update_only=True
        )
    changed = DeploymentSpec(
        name="mx",
        model="mixtral-8x7b",
        policy="ilp",
        workload=WorkloadSpec(tokens_per_gpu=32, tokens_per_gpu_set=True),
    )
    d2 = store.put_deployment(changed, now_s=103.0, update_only=True)
    assert (d2.generation, d2.spec, d2.created_at_s, d2.updated_at_s) == (2, changed, 100.0, 103.0)
    store.set_deployment_status("mx", {"phase": "serving", "nodes": 2})
    got = store.get_deployment("mx")
    assert got is not None and got.status == {"phase": "serving", "nodes": 2}
    assert [x.name for x in store.list_deployments()] == ["mx"]
    # The object is an ordinary ModelDeployment.
    obj = cluster.kube().get(MODEL_DEPLOYMENTS, "mx", cluster.namespace)
    assert (
        obj is not None
        and obj["spec"]["model"] == "mixtral-8x7b"
        and obj["spec"]["policy"] == "ilp"
    )


def _propose(cluster: Cluster, plan: Plan, deployment: str = "mx") -> int:
    return propose_plan(cluster.kube("mixfleet-operator"), cluster.namespace, deployment, plan)


def test_plans_commit_pointer_and_states(
    cluster: Cluster, store: KubernetesStore, plan: Plan
) -> None:
    store.put_deployment(SPEC, now_s=1.0)
    p1 = store.get_plan("mx", _propose(cluster, plan))
    assert p1 is not None
    assert (p1.version, p1.state, p1.plan is not None and p1.plan.version) == (1, "proposed", 1)
    store.set_plan_state("mx", 1, "preparing", now_s=3.0, prepare_deadline_s=9.0)
    got = store.get_plan("mx", 1, with_plan=False)
    assert got is not None and (got.state, got.prepare_deadline_s, got.plan) == (
        "preparing",
        9.0,
        None,
    )
    store.commit_plan("mx", 1, now_s=4.0)
    store.commit_plan("mx", 1, now_s=4.5)  # idempotent
    v2 = _propose(cluster, plan)
    store.commit_plan("mx", v2, now_s=6.0)
    committed = store.committed_plan("mx")
    assert committed is not None and committed.version == 2 and committed.plan is not None
    assert committed.plan.id == plan.id and committed.summary == plan.to_dict()["summary"]
    assert [(p.version, p.state) for p in store.list_plans("mx")] == [
        (2, "committed"),
        (1, "superseded"),
    ]
    assert [p.version for p in store.list_plans("mx", states=["superseded"])] == [1]
    d = store.get_deployment("mx")
    assert d is not None and d.committed_version == 2
    with pytest.raises(PreconditionError):
        store.set_plan_state("mx", 1, "preparing", now_s=7.0)
    with pytest.raises(NotFoundError):
        store.commit_plan("mx", 99, now_s=7.0)


def test_the_controller_cannot_write_a_plan_in_kubernetes_mode(
    store: KubernetesStore, plan: Plan
) -> None:
    """One owner per decision: the operator writes PartitionPlans, the store refuses."""
    store.put_deployment(SPEC, now_s=1.0)
    assert store.plan_author == "operator"
    with pytest.raises(PreconditionError, match="made by the mixfleet operator"):
        store.add_plan("mx", plan, reason="created", inputs_key="k", now_s=2.0)
    assert store.list_plans("mx") == []


def test_versions_only_grow_across_delete_and_recreate(
    cluster: Cluster, store: KubernetesStore, plan: Plan
) -> None:
    store.put_deployment(SPEC, now_s=1.0)
    _propose(cluster, plan)
    _propose(cluster, plan)
    assert store.delete_deployment("mx", now_s=4.0)
    assert not store.delete_deployment("mx", now_s=4.0)
    k = cluster.kube()
    # Without the operator running, nothing holds a finalizer: the deployment goes, its
    # plans are garbage-collected.
    assert k.get(MODEL_DEPLOYMENTS, "mx", cluster.namespace) is None or cluster.fake is None
    store.put_deployment(SPEC, now_s=5.0)
    assert _propose(cluster, plan) == 3


def test_acks_are_idempotent_and_feed_the_rollout_state(
    cluster: Cluster, store: KubernetesStore, plan: Plan
) -> None:
    store.put_deployment(SPEC, now_s=1.0)
    _propose(cluster, plan)
    assert store.record_ack("mx", 1, "h100-0", "prepared", now_s=3.0)
    assert not store.record_ack("mx", 1, "h100-0", "prepared", now_s=3.5)
    assert store.record_ack("mx", 1, "a100-0", "failed", reason="disk full", now_s=4.0)
    assert store.record_ack("mx", 1, "h100-0", "committed", now_s=5.0)
    acks = store.acks("mx", 1)
    assert [(a.node, a.state, a.at_s) for a in acks] == [
        ("h100-0", "prepared", 3.0),
        ("a100-0", "failed", 4.0),
        ("h100-0", "committed", 5.0),
    ]
    obj = cluster.kube().get(PARTITION_PLANS, "mx-v1", cluster.namespace)
    assert obj is not None
    assert {n["node"]: n["state"] for n in obj["status"]["nodes"]} == {
        "h100-0": "Committed",
        "a100-0": "Failed",
    }
    with pytest.raises(NotFoundError):
        store.record_ack("mx", 7, "h100-0", "prepared", now_s=1.0)


def test_acks_in_a_batch_take_one_patch_per_plan(
    cluster: Cluster, store: KubernetesStore, plan: Plan
) -> None:
    store.put_deployment(SPEC, now_s=1.0)
    _propose(cluster, plan)
    store.record_ack("mx", 1, "h100-0", "prepared", now_s=3.0)
    batch = [
        StoredAck("mx", 1, "h100-0", "prepared", "", 3.5),  # already stored
        StoredAck("mx", 1, "a100-0", "prepared", "", 3.6),
        StoredAck("mx", 1, "a100-0", "prepared", "", 3.7),  # twice in the batch
        StoredAck("mx", 1, "h100-0", "committed", "", 4.0),
        StoredAck("mx", 8, "h100-0", "prepared", "", 4.1),  # no such version
    ]
    assert store.record_acks(batch) == 2
    assert [(a.node, a.state) for a in store.acks("mx", 1)] == [
        ("h100-0", "prepared"),
        ("a100-0", "prepared"),
        ("h100-0", "committed"),
    ]
    obj = cluster.kube().get(PARTITION_PLANS, "mx-v1", cluster.namespace)
    assert obj is not None
    assert {n["node"]: n["state"] for n in obj["status"]["nodes"]} == {
        "h100-0": "Committed",
        "a100-0": "Prepared",
    }


def test_load_windows_and_pruning(store: KubernetesStore) -> None:
    store.put_deployment(SPEC, now_s=1.0)
    for i in range(3):
        store.add_load_window(
            LoadWindow("mx", "e0", 10.0 * i, 10.0 * i + 10, 1, ((1.0, 2.0), (3.0, float(i)))),
            now_s=50.0,
        )
    assert [w.end_s for w in store.load_windows("mx")] == [10.0, 20.0, 30.0]
    assert [w.end_s for w in store.load_windows("mx", since_s=15.0)] == [20.0, 30.0]
    assert store.load_windows("mx")[2].counts == ((1.0, 2.0), (3.0, 2.0))
    assert store.prune_load_windows(before_s=20.0) == 1
    assert [w.end_s for w in store.load_windows("mx")] == [20.0, 30.0]
    with pytest.raises(NotFoundError):
        store.add_load_window(LoadWindow("ghost", "e0", 0.0, 1.0, 1, ((1.0,),)), now_s=1.0)


def test_a_spec_that_does_not_parse_does_not_hide_the_others(
    cluster: Cluster, store: KubernetesStore
) -> None:
    """One bad ModelDeployment (an unknown preset) is left out of the list, so the
    controller keeps rolling out the others; the operator reports the bad one."""
    from k8s_builders import md_object

    store.put_deployment(SPEC, now_s=1.0)
    k = cluster.kube("mixfleet-test")
    k.create(MODEL_DEPLOYMENTS, md_object("bad", cluster.namespace, model="gpt-17"))
    assert [d.name for d in store.list_deployments()] == ["mx"]
