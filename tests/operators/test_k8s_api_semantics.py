"""The API-server behaviour the operator relies on, checked through the official client.

These run against the fake API server and - with MIXFLEET_E2E_KUBECONFIG - against a real
cluster, which is what keeps the fake honest: a behaviour the fake gets wrong fails here
on a real cluster. Tests marked with ``fake_only`` inspect the fake's internals (watch
history compaction, injected faults).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from k8s_builders import inventory, md_object, policy_object
from k8s_cluster import CRD_DIR, CRDS, Cluster, install_crds, wait_for
from kubernetes import client as k8s_client
from support.fakeapi import FakeApiServer, crd_manifests

from apis.kube.client import (
    CONFIGMAPS,
    GPUNODES,
    MODEL_DEPLOYMENTS,
    PARTITION_PLANS,
    PLACEMENT_POLICIES,
    Json,
    Kube,
    WatchEvent,
)
from apis.kube.errors import ConflictError, GoneError, InvalidError, NotFoundError
from apis.kube.v1alpha1 import API_VERSION

VALID_PLAN_SPEC: Json = {
    "deployment": "mx",
    "planID": "0123456789abcdef",
    "version": 1,
    "model": "mixtral-8x7b",
    "form": "engine",
    "policy": "greedy",
    "inputsDigest": "fedcba9876543210",
    "deploymentGeneration": 1,
    "nodes": ["h100-0"],
    "gpus": [
        {
            "gpu": "h100-0/gpu0",
            "node": "h100-0",
            "model": "H100-SXM5-80GB",
            "attentionShare": 1.0,
            "dpWeight": 1.0,
        }
    ],
    "stepTimeUs": 100.0,
    "tokensPerSecond": 1000.0,
    "data": "H4sIAAAAAAAC/6uuBQBDv6ajAgAAAA==",
    "dataSha256": "44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a",
    "uncompressedBytes": 2,
}


def _plan(ns: str, name: str = "mx-v1", **spec: Any) -> Json:
    return {
        "apiVersion": "mixfleet.io/v1alpha1",
        "kind": "PartitionPlan",
        "metadata": {"name": name, "namespace": ns},
        "spec": {**VALID_PLAN_SPEC, **spec},
    }


def test_create_sets_generation_defaults_and_drops_status_and_unknown_fields(
    cluster: Cluster,
) -> None:
    k = cluster.kube()
    body = md_object("mx", cluster.namespace, unknownField=1)
    body["spec"].pop("engineFormat")
    body["status"] = {"gpus": 9}
    out = k.create(MODEL_DEPLOYMENTS, body)
    meta = out["metadata"]
    assert meta["generation"] == 1 and meta["uid"] and meta["resourceVersion"]
    assert "status" not in out or "gpus" not in out["status"]
    assert "unknownField" not in out["spec"]
    assert out["spec"]["form"] == "engine" and out["spec"]["engineFormat"] == "sglang"
    assert out["spec"]["workload"]["kvCacheDtype"] == "bf16"


def test_schema_and_cel_rules_reject_bad_specs_with_field_paths(cluster: Cluster) -> None:
    k = cluster.kube()
    bad_enum = md_object("bad1", cluster.namespace, workload={"phase": "training"})
    with pytest.raises(InvalidError) as e1:
        k.create(MODEL_DEPLOYMENTS, bad_enum)
    assert any("spec.workload.phase" in c for c in e1.value.causes)
    bad_min = md_object("bad2", cluster.namespace, workload={"tokensPerGpu": 0})
    with pytest.raises(InvalidError) as e2:
        k.create(MODEL_DEPLOYMENTS, bad_min)
    assert any("spec.workload.tokensPerGpu" in c for c in e2.value.causes)
    both = md_object("bad3", cluster.namespace, modelConfig={"model_type": "mixtral"})
    with pytest.raises(InvalidError) as e3:
        k.create(MODEL_DEPLOYMENTS, both)
    assert "exactly one of spec.model" in str(e3.value)
    native_sglang = md_object("bad4", cluster.namespace, form="native")
    with pytest.raises(InvalidError) as e4:
        k.create(MODEL_DEPLOYMENTS, native_sglang)
    assert "engineFormat needs form: engine" in str(e4.value)
    long_name = md_object("m" * 64, cluster.namespace)
    with pytest.raises(InvalidError):
        k.create(MODEL_DEPLOYMENTS, long_name)


def test_update_needs_a_fresh_resource_version(cluster: Cluster) -> None:
    k = cluster.kube()
    out = k.create(MODEL_DEPLOYMENTS, md_object("mx", cluster.namespace))
    stale = dict(out)
    k.merge_patch(MODEL_DEPLOYMENTS, "mx", {"metadata": {"labels": {"a": "b"}}}, cluster.namespace)
    with pytest.raises(ConflictError):
        k.replace(MODEL_DEPLOYMENTS, stale)
    with pytest.raises(ConflictError):
        k.merge_patch(
            MODEL_DEPLOYMENTS,
            "mx",
            {
                "metadata": {"resourceVersion": out["metadata"]["resourceVersion"]},
                "spec": {"form": "native", "engineFormat": "none"},
            },
            cluster.namespace,
        )
    no_rv = {k2: v for k2, v in out.items() if k2 != "metadata"}
    no_rv["metadata"] = {"name": "mx", "namespace": cluster.namespace}
    with pytest.raises(InvalidError):
        k.replace(MODEL_DEPLOYMENTS, no_rv)


def test_generation_counts_spec_changes_only(cluster: Cluster) -> None:
    k = cluster.kube()
    ns = cluster.namespace
    k.create(MODEL_DEPLOYMENTS, md_object("mx", ns))
    k.merge_patch(MODEL_DEPLOYMENTS, "mx", {"metadata": {"labels": {"team": "a"}}}, ns)
    status = {
        "metadata": {"name": "mx", "namespace": ns},
        "status": {"observedGeneration": 1, "gpus": 4},
    }
    after_status = k.apply(MODEL_DEPLOYMENTS, status, subresource="status")
    assert after_status["metadata"]["generation"] == 1 and after_status["status"]["gpus"] == 4
    after_spec = k.merge_patch(MODEL_DEPLOYMENTS, "mx", {"spec": {"policy": "greedy"}}, ns)
    assert after_spec["metadata"]["generation"] == 2


def test_status_and_spec_are_written_through_separate_endpoints(cluster: Cluster) -> None:
    k = cluster.kube()
    ns = cluster.namespace
    k.create(MODEL_DEPLOYMENTS, md_object("mx", ns))
    # The main resource ignores status...
    out = k.merge_patch(MODEL_DEPLOYMENTS, "mx", {"status": {"gpus": 7}}, ns)
    assert (out.get("status") or {}).get("gpus") is None
    # ...and /status ignores spec.
    out = k.merge_patch(
        MODEL_DEPLOYMENTS,
        "mx",
        {"spec": {"policy": "uniform"}, "status": {"gpus": 7}},
        ns,
        subresource="status",
    )
    assert out["status"]["gpus"] == 7 and "policy" not in out["spec"]


def test_partition_plan_spec_is_immutable(cluster: Cluster) -> None:
    k = cluster.kube()
    ns = cluster.namespace
    k.create(PARTITION_PLANS, _plan(ns))
    with pytest.raises(InvalidError) as e:
        k.merge_patch(PARTITION_PLANS, "mx-v1", {"spec": {"stepTimeUs": 1.0}}, ns)
    assert "immutable" in str(e.value)
    # Status stays writable; the same spec applied again is accepted.
    k.apply(
        PARTITION_PLANS,
        {
            "metadata": {"name": "mx-v1", "namespace": ns},
            "status": {"nodes": [{"node": "h100-0", "state": "Prepared"}]},
        },
        subresource="status",
    )
    k.merge_patch(PARTITION_PLANS, "mx-v1", {"metadata": {"labels": {"x": "y"}}}, ns)


def test_apply_merges_map_lists_per_manager_and_detects_conflicts(cluster: Cluster) -> None:
    setup = cluster.kube()
    ns = cluster.namespace
    setup.create(PARTITION_PLANS, _plan(ns))
    a = cluster.kube("agent-a")
    b = cluster.kube("agent-b")
    meta = {"name": "mx-v1", "namespace": ns}
    a.apply(
        PARTITION_PLANS,
        {"metadata": meta, "status": {"nodes": [{"node": "a", "state": "Prepared"}]}},
        subresource="status",
    )
    out = b.apply(
        PARTITION_PLANS,
        {"metadata": meta, "status": {"nodes": [{"node": "b", "state": "Committed"}]}},
        subresource="status",
    )
    assert {n["node"]: n["state"] for n in out["status"]["nodes"]} == {
        "a": "Prepared",
        "b": "Committed",
    }
    # b claiming a's entry with another value conflicts unless forced.
    claim = {
        "metadata": meta,
        "status": {
            "nodes": [{"node": "a", "state": "Failed"}, {"node": "b", "state": "Committed"}]
        },
    }
    with pytest.raises(ConflictError) as e:
        b.apply(PARTITION_PLANS, claim, subresource="status", force=False)
    assert "agent-a" in str(e.value)
    out = b.apply(PARTITION_PLANS, claim, subresource="status", force=True)
    assert {n["node"]: n["state"] for n in out["status"]["nodes"]} == {
        "a": "Failed",
        "b": "Committed",
    }
    # A manager that stops applying a field it alone owns removes it.
    out = b.apply(
        PARTITION_PLANS,
        {"metadata": meta, "status": {"nodes": [{"node": "a", "state": "Failed"}]}},
        subresource="status",
    )
    assert [n["node"] for n in out["status"]["nodes"]] == ["a"]


def test_apply_removes_only_what_the_manager_owned(cluster: Cluster) -> None:
    op = cluster.kube("mixfleet-operator")
    user = cluster.kube("kubectl")
    ns = cluster.namespace
    body = {
        "metadata": {"name": "cm", "namespace": ns, "labels": {"by-op": "1"}},
        "data": {"a": "1", "b": "2"},
    }
    op.apply(CONFIGMAPS, body)
    user.merge_patch(
        CONFIGMAPS, "cm", {"metadata": {"labels": {"by-user": "1"}}, "data": {"c": "3"}}, ns
    )
    out = op.apply(CONFIGMAPS, {"metadata": {"name": "cm", "namespace": ns}, "data": {"a": "1"}})
    assert out["data"] == {"a": "1", "c": "3"}
    assert out["metadata"]["labels"] == {"by-user": "1"}


def test_finalizers_hold_deletion_until_removed(cluster: Cluster) -> None:
    k = cluster.kube()
    ns = cluster.namespace
    body = md_object("mx", ns)
    body["metadata"]["finalizers"] = ["mixfleet.io/cleanup"]
    k.create(MODEL_DEPLOYMENTS, body)
    assert k.delete(MODEL_DEPLOYMENTS, "mx", ns)
    held = k.get(MODEL_DEPLOYMENTS, "mx", ns)
    assert held is not None and held["metadata"]["deletionTimestamp"]
    with pytest.raises(InvalidError):
        k.merge_patch(
            MODEL_DEPLOYMENTS,
            "mx",
            {"metadata": {"finalizers": ["mixfleet.io/cleanup", "x.io/more"]}},
            ns,
        )
    k.merge_patch(
        MODEL_DEPLOYMENTS,
        "mx",
        {"metadata": {"finalizers": None, "resourceVersion": held["metadata"]["resourceVersion"]}},
        ns,
    )
    wait_for(lambda: k.get(MODEL_DEPLOYMENTS, "mx", ns) is None, what="deployment gone")


def test_delete_precondition_and_owner_garbage_collection(cluster: Cluster) -> None:
    k = cluster.kube()
    ns = cluster.namespace
    md = k.create(MODEL_DEPLOYMENTS, md_object("mx", ns))
    plan = _plan(ns)
    plan["metadata"]["ownerReferences"] = [
        {
            "apiVersion": "mixfleet.io/v1alpha1",
            "kind": "ModelDeployment",
            "name": "mx",
            "uid": md["metadata"]["uid"],
            "controller": True,
        }
    ]
    k.create(PARTITION_PLANS, plan)
    with pytest.raises(ConflictError):
        k.delete(MODEL_DEPLOYMENTS, "mx", ns, uid="not-the-uid")
    k.delete(MODEL_DEPLOYMENTS, "mx", ns, uid=md["metadata"]["uid"])
    wait_for(
        lambda: k.get(PARTITION_PLANS, "mx-v1", ns) is None,
        timeout_s=60,
        what="owned plan collected",
    )
    assert not k.delete(MODEL_DEPLOYMENTS, "mx", ns)


def test_create_conflicts_when_the_name_is_taken(cluster: Cluster) -> None:
    k = cluster.kube()
    k.create(PARTITION_PLANS, _plan(cluster.namespace))
    with pytest.raises(ConflictError) as e:
        k.create(PARTITION_PLANS, _plan(cluster.namespace))
    assert e.value.reason == "AlreadyExists"


def test_cluster_scoped_resources_and_label_selectors(cluster: Cluster) -> None:
    k = cluster.kube()
    a = cluster.put_gpunode(k, "h100-0", inventory("h100-0"), labels={"rack": "r1"})
    b = cluster.put_gpunode(k, "a100-0", inventory("a100-0"), labels={"rack": "r2"})
    sel = f"mixfleet.io/e2e-run={cluster.run}"
    items, _ = k.list(GPUNODES, label_selector=f"{sel},rack=r2")
    assert [o["metadata"]["name"] for o in items] == [b]
    items, _ = k.list(GPUNODES, label_selector=f"{sel},rack in (r1,r3)")
    assert [o["metadata"]["name"] for o in items] == [a]
    obj = k.get(GPUNODES, a)
    assert (
        obj is not None
        and obj["status"]["gpuCount"] == 2
        and obj["status"]["health"]["state"] == "Healthy"
    )
    k.create(PLACEMENT_POLICIES, policy_object(cluster.name("fast"), policy="greedy"))
    pol = k.get(PLACEMENT_POLICIES, cluster.name("fast"))
    assert pol is not None and pol["spec"]["solverTimeLimitS"] == 60.0


def _collect(
    k: Any, rv: str, ns: str, out: list[WatchEvent], want: int, **kw: Any
) -> threading.Thread:
    """Watch in a thread until ``want`` events (bookmarks aside) or the watch ends."""

    def run() -> None:
        for ev in k.watch(MODEL_DEPLOYMENTS, rv, ns, **kw):
            out.append(ev)
            if sum(e.type != "BOOKMARK" for e in out) >= want:
                return

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_watch_from_a_resource_version_sees_later_events_in_order(cluster: Cluster) -> None:
    k = cluster.kube()
    ns = cluster.namespace
    k.create(MODEL_DEPLOYMENTS, md_object("before", ns))
    _, rv = k.list(MODEL_DEPLOYMENTS, ns)
    events: list[WatchEvent] = []
    t = _collect(k, rv, ns, events, 4, timeout_s=60, label_selector="w=1")
    time.sleep(0.5)
    k.create(
        MODEL_DEPLOYMENTS,
        {**md_object("x", ns), "metadata": {"name": "x", "namespace": ns, "labels": {"w": "1"}}},
    )
    k.merge_patch(
        MODEL_DEPLOYMENTS, "before", {"metadata": {"labels": {"w": "1"}}}, ns
    )  # enters the selection
    k.merge_patch(MODEL_DEPLOYMENTS, "x", {"metadata": {"labels": {"w": "2"}}}, ns)  # leaves it
    k.delete(MODEL_DEPLOYMENTS, "before", ns)
    t.join(90)
    seen = [(e.type, e.object["metadata"]["name"]) for e in events if e.type != "BOOKMARK"]
    assert seen == [("ADDED", "x"), ("ADDED", "before"), ("DELETED", "x"), ("DELETED", "before")]
    rvs = [int(e.resource_version) for e in events if e.type != "BOOKMARK"]
    assert rvs == sorted(rvs) and rvs[0] > int(rv)


def test_watch_from_a_compacted_version_is_gone(cluster: Cluster, fake_only: FakeApiServer) -> None:
    k = cluster.kube()
    _, rv = k.list(MODEL_DEPLOYMENTS, cluster.namespace)
    k.create(MODEL_DEPLOYMENTS, md_object("mx", cluster.namespace))
    fake_only.compact()
    with pytest.raises(GoneError):
        list(k.watch(MODEL_DEPLOYMENTS, rv, cluster.namespace, timeout_s=1))


def test_get_of_a_missing_object_is_none_and_unknown_paths_404(cluster: Cluster) -> None:
    k = cluster.kube()
    assert k.get(MODEL_DEPLOYMENTS, "nope", cluster.namespace) is None
    with pytest.raises(NotFoundError):
        k.merge_patch(MODEL_DEPLOYMENTS, "nope", {"spec": {}}, cluster.namespace)


def test_crds_install_on_a_fresh_server_which_answers_conditions_null_first() -> None:
    """The real server stores a new CRD with ``"conditions": null`` and accepts its names a
    moment later; install_crds waits through that, and the resources are served after."""
    fake = FakeApiServer([])
    url = fake.start()
    try:
        cfg = k8s_client.Configuration()
        cfg.host = url
        admin = Kube(k8s_client.ApiClient(cfg), field_manager="mixfleet-e2e-setup")
        with pytest.raises(NotFoundError):
            admin.list(GPUNODES)
        first = admin.apply(CRDS, crd_manifests(str(CRD_DIR))[0], force=True)
        assert first["status"]["conditions"] is None
        install_crds(admin)
        for doc in crd_manifests(str(CRD_DIR)):
            status = (admin.get(CRDS, doc["metadata"]["name"]) or {})["status"]
            assert {c["type"]: c["status"] for c in status["conditions"]} == {
                "NamesAccepted": "True",
                "Established": "True",
            }
        admin.create(
            GPUNODES, {"apiVersion": API_VERSION, "kind": "GPUNode", "metadata": {"name": "n"}}
        )
        assert [o["metadata"]["name"] for o in admin.list(GPUNODES)[0]] == ["n"]
    finally:
        fake.stop()


def test_a_crd_whose_default_fails_its_own_rule_is_refused(cluster: Cluster) -> None:
    """kube-apiserver validates a schema's defaults against the schema and its CEL rules
    and refuses the CRD otherwise, naming each default; the fake does the same (the chart's
    CRDs once shipped ``default: {}`` on an object whose rule the empty object fails)."""
    plural = f"{cluster.prefix}widgets"
    group = "e2e.mixfleet.io"
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"plural": plural, "singular": plural, "kind": "Widget"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {
                                "spec": {
                                    "type": "object",
                                    "properties": {
                                        "size": {
                                            "type": "object",
                                            "properties": {
                                                "mean": {"type": "number"},
                                                "histogram": {"type": "number"},
                                            },
                                            "x-kubernetes-validations": [
                                                {
                                                    "rule": "has(self.mean) != has(self.histogram)",
                                                    "message": "set one of the two",
                                                }
                                            ],
                                            "default": {},
                                        }
                                    },
                                }
                            },
                        }
                    },
                }
            ],
        },
    }
    k = cluster.kube("mixfleet-e2e-setup")
    with pytest.raises(InvalidError) as refused:
        k.create(CRDS, crd)
    where = "spec.validation.openAPIV3Schema.properties[spec].properties[size].default"
    assert str(refused.value).startswith(
        f'422 Invalid: CustomResourceDefinition.apiextensions.k8s.io "{plural}.{group}" is '
        f"invalid: {where}: Invalid value: set one of the two\n"
    ), refused.value
