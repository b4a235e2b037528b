"""Load-driven rebalancing: engines report a skewed expert load over EngineService, the
controller sees the committed plan's imbalance rise and stay up, and re-plans with the ILP's
migration-aware mode - moving far fewer experts than a plan from scratch would, for nearly
the same step time."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from agent_fakes import FakeAgent, small_fleet_doc, small_inventories, wait_until
from mixfleet.v1 import engine_pb2, engine_pb2_grpc, plan_pb2, plan_pb2_grpc

from apis.wire.deployment import spec_to_proto
from controlplane.server.inprocess import RunningController, start_controller
from policies.assignment import diff_plans, imbalance_under_load
from policies.estimate.workload import synthetic_zipf
from policies.hardware.fleet import parse_fleet
from policies.model.architecture import ModelSpec, from_hf_config
from policies.solve import solve
from policies.spec.build import DeploymentSpec, RebalanceSpec, WorkloadSpec, build_request

#: A 4-layer, 32-expert Qwen3-MoE-shaped model: small enough for the ILP to solve in a second.
MINI_MOE = {
    "model_type": "qwen3_moe",
    "num_hidden_layers": 4,
    "hidden_size": 2048,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 32,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 768,
    "intermediate_size": 6144,
    "vocab_size": 151936,
    "torch_dtype": "bfloat16",
}
SPEC = DeploymentSpec(
    name="mini",
    model_config=MINI_MOE,
    workload=WorkloadSpec(phase="prefill", tokens_per_gpu=4096, context_len=4096),
    policy="ilp",
    redundant_experts=4,
    solver_time_limit_s=4.0,
    prepare_timeout_s=10.0,
    min_gpus=6,  # every node: the fleet scheduler would pick one node for this tiny model
    rebalance=RebalanceSpec(
        enabled=True,
        imbalance_threshold=0.1,
        sustain_s=0.5,
        min_interval_s=0.01,
        migration_weight_us=0.0,  # 0: the solver prices a move from the plan itself
    ),
)


async def _skewed_windows(
    skew: list[list[float]], n: int
) -> AsyncIterator[engine_pb2.ExpertLoadWindow]:
    """``n`` one-second expert-load windows of ``skew`` (tokens per layer and expert), 0.1 s
    apart, as engine ``rank0`` of ``mini`` reports them."""
    for _ in range(n):
        now = time.time()
        yield engine_pb2.ExpertLoadWindow(
            deployment="mini",
            engine_id="rank0",
            start_unix_s=now - 1.0,
            end_unix_s=now,
            num_layers=4,
            num_experts=32,
            counts=[x for row in skew for x in row],
            plan_version=1,
        )
        await asyncio.sleep(0.1)


async def _apply_and_report_until_rebalanced(
    ctl: RunningController, skew: list[list[float]]
) -> None:
    """Apply :data:`SPEC`, wait for plan v1, then report ``skew`` until a re-plan (v2 or
    later) is committed."""
    store = ctl.controller.store
    async with grpc.aio.insecure_channel(ctl.address) as ch:
        plans = plan_pb2_grpc.PlanServiceStub(ch)
        engine = engine_pb2_grpc.EngineServiceStub(ch)
        await plans.ApplyDeployment(plan_pb2.ApplyDeploymentRequest(spec=spec_to_proto(SPEC)))
        await wait_until(
            lambda: (d := store.get_deployment("mini")) is not None and d.committed_version == 1,
            timeout_s=60,
            what="v1",
        )
        for _ in range(40):  # report until the controller reacts
            await engine.ReportExpertLoad(_skewed_windows(skew, 3))
            d = store.get_deployment("mini")
            if d is not None and (d.committed_version or 0) >= 2:
                break
        await wait_until(
            lambda: (
                (d := store.get_deployment("mini")) is not None and (d.committed_version or 0) >= 2
            ),
            timeout_s=60,
            what="rebalance committed",
        )


def _check_migration_aware_rebalance(
    ctl: RunningController, model: ModelSpec, skew: list[list[float]]
) -> None:
    """The committed re-plan was made for the measured load, moves at most half the experts a
    plan from scratch moves, is within 12 % of its step time and lowers the imbalance."""
    store = ctl.controller.store
    v1 = store.get_plan("mini", 1)
    v2 = store.committed_plan("mini")
    assert v1 is not None and v1.plan is not None
    assert v2 is not None and v2.plan is not None
    assert v2.reason.startswith("load imbalance"), v2.reason
    assert v2.plan.workload["load_source"] == "measured"
    moves = diff_plans(v1.plan, v2.plan).expert_moves
    assert v2.plan.summary.expert_moves == moves

    fleet = parse_fleet(small_fleet_doc())
    scratch = solve(build_request(SPEC, fleet, measured=skew)).plan
    scratch_moves = diff_plans(v1.plan, scratch).expert_moves
    # Work limits alone end the solves here (root conftest.py): on a busy
    # machine a clock-cut re-plan kept the greedy warm start of its layers
    # and moved nearly as many experts as a fresh plan (94 of 119). Now the
    # figures are the same on any machine: about a fifth of a fresh plan's
    # moves, within a few percent of its step time.
    assert not any("machine's speed" in n for n in v2.plan.notes), v2.plan.notes
    assert moves <= 0.5 * scratch_moves, (moves, scratch_moves)
    step, best = v2.plan.summary.step_time_us, scratch.summary.step_time_us
    assert step <= 1.12 * best, (step, best)
    fleet_v1 = ctl.controller.fleet_for("mini", ["n0", "n1", "n2"])
    workload = build_request(SPEC, fleet_v1, measured=skew).workload
    before = imbalance_under_load(v1.plan, fleet_v1, model, workload)
    assert v2.plan.summary.imbalance < before - 0.1, (v2.plan.summary, before)


@pytest.mark.slow
def test_sustained_load_shift_triggers_a_migration_aware_rebalance(tmp_path: Path) -> None:
    model = from_hf_config(MINI_MOE, "mini")
    skew = synthetic_zipf(model, "synthetic:zipf:1.2:seed=3")

    async def main() -> None:
        async with start_controller(tmp_path) as ctl:
            agents = [FakeAgent(ctl.address, inv) for inv in small_inventories()]
            for a in agents:
                await a.start()
            try:
                await _apply_and_report_until_rebalanced(ctl, skew)
                _check_migration_aware_rebalance(ctl, model, skew)
            finally:
                for a in agents:
                    await a.stop()

    asyncio.run(main())
