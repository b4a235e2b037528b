"""Engine instances of a planned deployment (policies.fleetplan.instances): one per instance
of each planned group, each with its pool's share, batch and workload, the same instances
``plan launch --fleet-plan`` reads from the plan's document, names that survive a re-plan,
and each instance's own deployment spec."""

from __future__ import annotations

import functools

import pytest
from support.planner_settings import COARSE

from policies.errors import InputError
from policies.estimate.engines import EngineSpec
from policies.fleetplan import (
    FleetDeployment,
    FleetPlan,
    MemoryCurveCache,
    PlanRequest,
    plan_fleet,
)
from policies.fleetplan.instances import instance_name, keep_names, plan_instances
from policies.fleetplan.report import plan_doc
from policies.hardware.fleet import parse_fleet
from policies.launch import PlannedInstance, instance_spec, planned_instances
from policies.serving.traffic import LengthDist, Slo, Traffic
from policies.spec.build import DeploymentSpec, WorkloadSpec, check_spec

SETTINGS = COARSE
SPEC = DeploymentSpec(
    "q",
    model="qwen3-30b-a3b",
    policy="greedy",
    workload=WorkloadSpec(kv_cache_dtype="fp8"),
    engine=EngineSpec("sglang"),
    traffic=Traffic(1000.0, LengthDist(4096, 5120), LengthDist(512, 640)),
    slo=Slo(ttft_ms=2000, tpot_ms=50, percentile=90),
    disaggregation="on",
)


@functools.cache
def fleet_plan() -> FleetPlan:
    """The planner's answer for one Qwen3-30B deployment with P/D on three 4-GPU H100 nodes."""
    nodes = [
        {
            "name": f"h{i}",
            "gpus": [{"model": "H100-SXM5-80GB", "count": 4}],
            "nvlink": {"per_gpu_bidir_gbytes_per_s": 900},
            "nics": [{"count": 1, "per_direction_gbits_per_s": 400, "fabric": "ib"}],
        }
        for i in range(3)
    ]
    fleet = parse_fleet({"metadata": {"name": "f"}, "spec": {"nodes": nodes}})
    req = PlanRequest(fleet, (FleetDeployment(SPEC),), settings=SETTINGS)
    return plan_fleet(req, cache=MemoryCurveCache())


def _inst(name: str, role: str, *nodes: str) -> PlannedInstance:
    return PlannedInstance(name, "pool-0", role, tuple(nodes), 4, 1)


def test_instances_of_a_plan_are_the_documents_with_shares_and_batches() -> None:
    got = fleet_plan()
    dp = got.deployments["q"]
    insts = plan_instances(dp, SETTINGS.chunk_tokens)
    from_doc = planned_instances(plan_doc(got, SETTINGS.chunk_tokens), "q")
    assert insts == from_doc  # one reading of the plan, no previous instances to keep
    assert {i.role for i in insts} == {"prefill", "decode"}
    for pool in dp.pools:
        members = [i for i in insts if i.pool == pool.name]
        for g in pool.groups():
            mine = [i for i in members if i.role == g.variant.role]
            assert len(mine) == g.count
            assert sum(i.requests_per_s for i in mine) == pytest.approx(
                pool.requests_per_s, rel=1e-3
            )
            assert all(i.batch_limit == g.batch_limit for i in mine)
            assert all(i.variant == g.variant.key for i in mine)
            assert all(i.ttft_ms == pytest.approx(pool.ttft_ms, rel=1e-3) for i in mine)


def test_a_kept_instance_keeps_its_name_and_a_new_one_takes_the_lowest_free() -> None:
    previous = [
        _inst("d-aggregated-0", "aggregated", "a"),
        _inst("d-aggregated-1", "aggregated", "b"),
        _inst("d-prefill-0", "prefill", "c"),
    ]
    fresh = [
        _inst("d-aggregated-0", "aggregated", "b"),  # was d-aggregated-1 on b
        _inst("d-aggregated-1", "aggregated", "x"),  # new: 0 and 1 are live until drained
        _inst("d-prefill-0", "prefill", "y"),  # new nodes: d-prefill-0 still drains on c
    ]
    got = keep_names("d", fresh, previous)
    assert [i.name for i in got] == ["d-aggregated-1", "d-aggregated-2", "d-prefill-1"]
    assert [i.nodes for i in got] == [("b",), ("x",), ("y",)]
    # Without previous instances the names are the document's.
    assert keep_names("d", fresh, ()) == tuple(fresh)


def test_a_name_too_long_for_its_instances_is_refused() -> None:
    assert instance_name("d" * 50, "aggregated", 1) == "d" * 50 + "-aggregated-1"
    with pytest.raises(InputError, match="at most 50 characters") as err:
        instance_name("d" * 51, "aggregated", 1)
    assert err.value.field == "metadata.name"


def test_an_instance_runs_as_its_own_valid_deployment() -> None:
    spec = SPEC
    for inst in plan_instances(fleet_plan().deployments["q"], SETTINGS.chunk_tokens):
        own = instance_spec(spec, inst)
        check_spec(own)
        assert own.name == inst.name
        assert own.traffic is None and own.slo is None and own.disaggregation == "off"
        assert inst.workload is not None
        phase, tokens, context = inst.workload
        assert (own.workload.phase, own.workload.tokens_per_gpu) == (phase, tokens)
        assert own.workload.context_len == context and own.workload.tokens_per_gpu_set
        assert own.model == spec.model and own.engine == spec.engine
