"""Lease-based leader election: the pure decision with an injected clock, and electors
racing over a Lease on an API server."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta

import pytest
from k8s_cluster import Cluster, api_outage, wait_for

from apis.kube.client import LEASES
from apis.kube.leader import LeaderElector, LeaderSettings, LeaseRecord, decide
from policies.errors import InputError

T = datetime(2026, 3, 1, tzinfo=UTC)
S = LeaderSettings(lease_duration_s=15.0, renew_deadline_s=10.0, retry_period_s=2.0)


def test_free_missing_and_expired_leases_are_taken() -> None:
    d = decide(None, "a", T, S)
    assert (d.action, d.leader) == ("create", True)
    assert d.record == LeaseRecord("a", 15.0, T, T, 0)
    free = LeaseRecord("", 15.0, T, T, 3)
    d = decide(free, "a", T + timedelta(seconds=1), S)
    assert d.action == "update" and d.record is not None and d.record.transitions == 4
    held = LeaseRecord("b", 15.0, T, T, 3)
    assert decide(held, "a", T + timedelta(seconds=14.9), S).action == "wait"
    taken = decide(held, "a", T + timedelta(seconds=15), S)
    assert taken.action == "update" and taken.record is not None
    assert (taken.record.holder, taken.record.acquire_time, taken.record.transitions) == (
        "a",
        T + timedelta(seconds=15),
        4,
    )


def test_the_holder_renews_and_keeps_its_acquire_time() -> None:
    mine = LeaseRecord("a", 15.0, T, T, 2)
    d = decide(mine, "a", T + timedelta(seconds=5), S)
    assert d.action == "update" and d.record == LeaseRecord(
        "a", 15.0, T, T + timedelta(seconds=5), 2
    )


def test_renew_deadline_must_be_shorter_than_the_lease() -> None:
    with pytest.raises(InputError, match="--renew-deadline-s"):
        LeaderElector(None, LeaderSettings(lease_duration_s=5, renew_deadline_s=5))  # type: ignore[arg-type]


def _elector(
    cluster: Cluster, identity: str, clock: list[float], events: list[str]
) -> LeaderElector:
    kube = cluster.kube(f"lease-{identity}")
    settings = LeaderSettings(
        lease_name=cluster.name("test-lease"),
        namespace=cluster.namespace,
        identity=identity,
        lease_duration_s=4.0,
        renew_deadline_s=3.0,
        retry_period_s=0.5,
    )
    return LeaderElector(
        kube,
        settings,
        on_started_leading=lambda: events.append(f"{identity}+"),
        on_stopped_leading=lambda: events.append(f"{identity}-"),
        monotonic=lambda: clock[0],
    )


def test_racing_electors_elect_exactly_one(cluster: Cluster) -> None:
    clock = [0.0]
    events: list[str] = []
    electors = [_elector(cluster, f"r{i}", clock, events) for i in range(4)]
    barrier = threading.Barrier(len(electors))
    results: dict[str, bool] = {}

    def race(e: LeaderElector) -> None:
        barrier.wait()
        results[e.settings.identity] = e.try_once()

    threads = [threading.Thread(target=race, args=(e,)) for e in electors]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(results.values()) == 1
    (winner,) = [k for k, v in results.items() if v]
    lease = cluster.kube().get(LEASES, cluster.name("test-lease"), cluster.namespace)
    assert lease is not None and lease["spec"]["holderIdentity"] == winner
    assert events == [f"{winner}+"]


def test_a_leader_that_cannot_renew_steps_down_before_the_lease_expires(cluster: Cluster) -> None:
    clock = [0.0]
    events: list[str] = []
    a = _elector(cluster, "a", clock, events)
    assert a.try_once()
    # The API server stops answering for a; its local deadline (3 s) passes first.
    with api_outage(a.kube):
        clock[0] = 2.0
        assert a.try_once()  # unknown outcome: still within the renew deadline
        clock[0] = 3.5
        assert not a.try_once() and not a.is_leader()
    assert events == ["a+", "a-"]
    assert a.try_once() and events == ["a+", "a-", "a+"]  # answering again: it leads again


def test_released_lease_is_taken_at_once_an_abandoned_one_after_it_expires(
    cluster: Cluster,
) -> None:
    clock = [0.0]
    events: list[str] = []
    a = _elector(cluster, "a", clock, events)
    b = _elector(cluster, "b", clock, events)
    assert a.try_once() and not b.try_once()
    a.release()
    assert b.try_once()
    assert events == ["a+", "a-", "b+"]
    # b vanishes without releasing; a waits for the lease duration (wall clock, 4 s).
    assert not a.try_once()
    wait_for(a.try_once, timeout_s=30, interval_s=0.25, what="a takes the expired lease")
    lease = cluster.kube().get(LEASES, cluster.name("test-lease"), cluster.namespace)
    assert lease is not None and lease["spec"]["holderIdentity"] == "a"
    assert lease["spec"]["leaseTransitions"] == 2
