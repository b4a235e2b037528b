"""The chart's RBAC against the code: for every value set of test_chart.py, the permissions
the rendered ClusterRoles and Roles give the shared ServiceAccount, namespace by namespace,
are exactly those the controller's and the operator's API calls need (read from their source
by :mod:`api_calls`) - nothing missing (a 403 in the cluster), nothing extra."""

from __future__ import annotations

from typing import Any

import pytest
from api_calls import Need, component_calls
from test_chart import NAMESPACE, VALUE_SETS, objects, parsed_commands, render

#: A grant: (where, group, resource, verb, resourceName) - ``where`` is ``cluster`` for a
#: cluster-scoped resource, ``*`` for a namespaced one granted in every namespace, else the
#: namespace; resourceName is "" when the rule names none.
Grant = tuple[str, str, str, str, str]
ALL = "*"


def granted(docs: list[dict[str, Any]], account: str) -> set[Grant]:
    """What the rendered roles bound to ``account`` allow, redundant grants folded (a
    namespace's grant that ``*`` already gives is dropped)."""
    roles = {(r["kind"], r["metadata"].get("namespace"), r["metadata"]["name"]): r for r in docs}
    scoped = {
        (n.group, n.resource.split("/")[0])
        for c in ("controller", "operator")
        for n in component_calls(c).needs
        if not n.namespaced
    }
    out: set[Grant] = set()
    for b in objects(docs, "ClusterRoleBinding") + objects(docs, "RoleBinding"):
        if not any(s["kind"] == "ServiceAccount" and s["name"] == account for s in b["subjects"]):
            continue
        ns = b["metadata"].get("namespace")
        role = roles[
            (
                b["roleRef"]["kind"],
                ns if b["roleRef"]["kind"] == "Role" else None,
                b["roleRef"]["name"],
            )
        ]
        for rule in role["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    cluster = (group, resource.split("/")[0]) in scoped
                    where = "cluster" if cluster else (ns or ALL)
                    for verb in rule["verbs"]:
                        for name in rule.get("resourceNames") or [""]:
                            out.add((where, group, resource, verb, name))
    return {g for g in out if g[0] in ("cluster", ALL) or (ALL, *g[1:]) not in out}


def needed(docs: list[dict[str, Any]], values: dict[str, Any]) -> set[Grant]:
    """What the components the chart runs need, where the chart runs them: cluster-scoped
    resources cluster-wide, the controller's namespaced ones in its store namespace, the
    operator's in each watched namespace (every namespace when none is listed), and each
    Lease by the name its container is given, in the release namespace."""
    commands = parsed_commands(docs)
    ctl = commands["Deployment/mixfleet-controller/controller"]
    op = commands.get("Deployment/mixfleet-controller/operator")
    store_ns = ctl.store.split(":", 1)[1]
    runs: list[tuple[str, list[str], str | None]] = [
        ("controller", [store_ns], ctl.lease_name if ctl.leader_elect else None)
    ]
    if op is not None:
        runs.append(
            ("operator", op.namespace or [ALL], None if op.no_leader_election else op.lease_name)
        )
    out: set[Grant] = set()
    for component, namespaces, lease in runs:
        for n in component_calls(component).needs:
            if n.resource == "leases":
                if lease is not None:  # get / update name the Lease; create cannot
                    out.add(
                        (
                            NAMESPACE,
                            n.group,
                            n.resource,
                            n.verb,
                            "" if n.verb == "create" else lease,
                        )
                    )
            elif not n.namespaced:
                out.add(("cluster", n.group, n.resource, n.verb, ""))
            else:
                out |= {(ns, n.group, n.resource, n.verb, "") for ns in namespaces}
    return {g for g in out if g[0] in ("cluster", ALL) or (ALL, *g[1:]) not in out}


def missing(want: set[Grant], have: set[Grant]) -> list[Grant]:
    """The needed grants that nothing granted covers (a namespace's need is covered by the
    same grant in every namespace)."""
    return sorted(w for w in want if w not in have and (ALL, *w[1:]) not in have)


def test_the_code_calls_only_resources_the_scan_resolves() -> None:
    for component in ("controller", "operator"):
        calls = component_calls(component)
        assert calls.needs and calls.unresolved == [], (component, calls.unresolved)


def test_the_scan_reads_what_the_code_does() -> None:
    ctl = component_calls("controller").needs
    op = component_calls("operator").needs
    # The controller registers GPUNodes with a server-side apply (which may create) and
    # never watches; the operator watches and never writes GPUNodes.
    assert Need("mixfleet.io", "gpunodes", "create", False) in ctl
    assert not any(n.verb == "watch" for n in ctl)
    assert {n.verb for n in op if n.resource == "gpunodes"} == {"list", "watch"}
    # PartitionPlans are immutable: created and deleted by the operator, never updated.
    assert not any(
        n.resource == "partitionplans" and n.verb in ("update", "patch") for n in ctl | op
    )


@pytest.mark.parametrize("value_set", list(VALUE_SETS), ids=list(VALUE_SETS))
def test_rendered_rbac_grants_exactly_what_the_code_calls(value_set: str) -> None:
    values = VALUE_SETS[value_set]
    docs = render(values)
    (sa,) = [
        s for s in objects(docs, "ServiceAccount") if s["metadata"]["name"] == "mixfleet-controller"
    ]
    have = granted(docs, sa["metadata"]["name"])
    want = needed(docs, values)
    assert missing(want, have) == [], "missing: the component gets 403"
    # A grant in every namespace that is needed in some only is extra too.
    assert sorted(have - want) == [], "granted but never called (or wider than needed)"


def test_a_missing_grant_is_caught() -> None:
    docs = render(VALUE_SETS["store-namespace-not-watched"])
    role = next(r for r in objects(docs, "Role") if r["metadata"]["name"] == "mixfleet-controller")
    role["rules"] = [r for r in role["rules"] if r["resources"] != ["modeldeployments"]]
    gaps = missing(
        needed(docs, VALUE_SETS["store-namespace-not-watched"]),
        granted(docs, "mixfleet-controller"),
    )
    assert ("models", "mixfleet.io", "modeldeployments", "list", "") in gaps
