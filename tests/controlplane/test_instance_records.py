"""The instance record a controller keeps in an instance's status reads back as written,
and a record that does not read is treated as absent (the controller rewrites it)."""

from __future__ import annotations

from controlplane.server.controller.instance_records import (
    INSTANCE_KEY,
    InstanceRecord,
    is_planned,
)
from policies.serving.traffic import LengthDist, Slo, Traffic
from policies.spec.build import DeploymentSpec


def test_a_record_reads_back_as_written() -> None:
    r = InstanceRecord(
        "d",
        "prefill",
        "pool-1",
        "1x (8x H100)/prefill",
        ("a", "b"),
        30001,
        8999,
        2.5,
        8192,
        3.0,
        800.0,
        0.0,
        draining=True,
        draining_since_s=1_800_000_012.5,
    )
    assert InstanceRecord.from_status({INSTANCE_KEY: r.to_status(), "phase": "Ready"}) == r
    assert r.dropped and r.to_status()["drainingSinceS"] == 1_800_000_012.5
    retiring = InstanceRecord("d", "decode", "p", "", ("a",), 30000, retiring=True)
    doc = retiring.to_status()
    assert doc["retiring"] is True and doc["draining"] is False
    assert InstanceRecord.from_status({INSTANCE_KEY: doc}) == retiring and retiring.dropped


def test_a_record_written_before_retiring_existed_reads_as_live() -> None:
    """A record without ``retiring`` and ``drainingSinceS`` (an older controller's) reads
    as neither retiring nor draining since any time."""
    doc = InstanceRecord("d", "decode", "p", "", ("a",), 30000).to_status()
    del doc["retiring"], doc["drainingSinceS"]
    r = InstanceRecord.from_status({INSTANCE_KEY: doc})
    assert r is not None and not r.retiring and not r.dropped and r.draining_since_s == 0.0


def test_a_record_that_does_not_read_is_absent() -> None:
    assert InstanceRecord.from_status({}) is None
    assert InstanceRecord.from_status({INSTANCE_KEY: "x"}) is None
    assert InstanceRecord.from_status({INSTANCE_KEY: {"of": "d"}}) is None
    bad_port = InstanceRecord("d", "decode", "p", "", ("a",), 1).to_status() | {"port": "x"}
    assert InstanceRecord.from_status({INSTANCE_KEY: bad_port}) is None


def test_only_a_deployment_with_traffic_and_slo_is_cut_into_instances() -> None:
    traffic = Traffic(1.0, LengthDist(100, 120), LengthDist(10, 12))
    slo = Slo(ttft_ms=1000, tpot_ms=50, percentile=90)
    assert is_planned(DeploymentSpec("d", model="m", traffic=traffic, slo=slo))
    assert not is_planned(DeploymentSpec("d", model="m", traffic=traffic))
    assert not is_planned(DeploymentSpec("d", model="m"))
