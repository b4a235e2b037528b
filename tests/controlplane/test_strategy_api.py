"""PlanService's strategy RPCs (AdviseTiers, AdviseBatch, AdviseContext, EstimateCost,
MinCost) on a real controller over real gRPC on loopback, with simulated nodes registered
through AgentService. Every answer is checked against the pure planner called directly on
the same fleet (the registered inventories); bad input and bad callers are in
test_strategy_api_errors.py.

Most tests run the controller without its reconcile loop (nothing here needs a rollout)
and with a long node-lost timeout, so nodes registered once stay usable without
heartbeats while a solve runs.
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import grpc
import pytest
from agent_fakes import FakeAgent, small_inventories, wait_until
from mixfleet.v1 import plan_pb2, plan_pb2_grpc
from strategy_fixtures import (
    ALL_NODES,
    controller_with_nodes,
    expected,
    opt,
    run,
    spec,
)

from apis.wire.deployment import spec_to_proto
from controlplane.server.inprocess import start_controller
from policies.advice.advise import BatchPoint, advise_batch, advise_context
from policies.advice.cost import DEFAULT_USD_PER_GPU_HOUR, PriceTable, min_cost, plan_cost
from policies.advice.tier_planner import plan_tiers
from policies.advice.tiers import BatchTier, InteractiveTier, TierRequest
from policies.spec.build import WorkloadSpec

# ------------------------------------------------------------------------------ batch


def got_points(points: Any) -> list[tuple[Any, ...]]:
    """The curve of a reply, as comparable rows."""
    return [
        (
            p.tokens_per_gpu,
            opt(p, "step_time_us"),
            p.tokens_per_s,
            p.fits_memory,
            p.meets_target,
            p.plan_id,
        )
        for p in points
    ]


def want_points(points: tuple[BatchPoint, ...]) -> list[tuple[Any, ...]]:
    """The curve of the planner's answer, as the same rows."""
    return [
        (p.tokens_per_gpu, p.step_time_us, p.tokens_per_s, p.fits_memory, p.meets_target, p.plan_id)
        for p in points
    ]


def test_advise_batch_matches_the_planner_on_the_live_fleet(tmp_path: Path) -> None:
    async def main() -> None:
        async with controller_with_nodes(tmp_path) as api:
            reply = await api.plans.AdviseBatch(
                plan_pb2.AdviseBatchRequest(spec=spec_to_proto(spec()), tpot_ms=50.0)
            )
            want = advise_batch(expected(), 50.0)
            assert list(reply.fleet_nodes) == list(ALL_NODES)
            assert (reply.phase, reply.policy, reply.target) == ("decode", "greedy", "TPOT")
            assert opt(reply, "target_ms") == 50.0
            assert want.largest_tokens_per_gpu is not None
            assert opt(reply, "largest_tokens_per_gpu") == want.largest_tokens_per_gpu
            assert (reply.start_tokens_per_gpu, reply.start_gpu, reply.limit) == (
                want.start_tokens_per_gpu,
                want.start_gpu,
                want.limit,
            )
            assert got_points(reply.points) == want_points(want.points)
            assert list(reply.infeasible) == []
            # the largest batch meets the target, the next one solved above it does not
            assert reply.best.tokens_per_gpu == want.largest_tokens_per_gpu
            assert reply.best.step_time_us <= 50e3
            above = [p for p in reply.points if p.tokens_per_gpu > reply.best.tokens_per_gpu]
            assert above and not above[0].meets_target

            # the node selector picks the fleet: racks r0 = n0 (H100) and n2 (A100)
            reply = await api.plans.AdviseBatch(
                plan_pb2.AdviseBatchRequest(
                    spec=spec_to_proto(spec(node_selector={"rack": "r0"})), tpot_ms=50.0
                )
            )
            want = advise_batch(expected(("n0", "n2")), 50.0)
            assert list(reply.fleet_nodes) == ["n0", "n2"]
            assert opt(reply, "largest_tokens_per_gpu") == want.largest_tokens_per_gpu
            assert got_points(reply.points) == want_points(want.points)

            # no target: the largest batch that fits memory, in prefill
            prefill = spec(workload=WorkloadSpec(phase="prefill", context_len=4096))
            reply = await api.plans.AdviseBatch(
                plan_pb2.AdviseBatchRequest(
                    spec=spec_to_proto(prefill), ttft_ms=400.0, max_tokens_per_gpu=16384
                )
            )
            want = advise_batch(expected(phase="prefill"), 400.0, max_tokens_per_gpu=16384)
            assert reply.target == "TTFT"
            assert opt(reply, "largest_tokens_per_gpu") == want.largest_tokens_per_gpu
            assert got_points(reply.points) == want_points(want.points)

    run(main())


def test_a_solve_runs_off_the_event_loop(tmp_path: Path, monkeypatch: Any) -> None:
    """While a batch search is stuck in its worker thread, other calls are answered."""
    entered, release = threading.Event(), threading.Event()

    def slow(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        release.wait(timeout=30.0)
        return advise_batch(*args, **kwargs)

    monkeypatch.setattr("controlplane.server.strategies.advise_batch", slow)

    async def main() -> None:
        async with controller_with_nodes(tmp_path) as api:
            call = asyncio.ensure_future(
                api.plans.AdviseBatch(
                    plan_pb2.AdviseBatchRequest(spec=spec_to_proto(spec()), tpot_ms=50.0)
                )
            )
            await wait_until(entered.is_set, timeout_s=10.0, what="the search to start")
            nodes = await api.plans.ListNodes(plan_pb2.ListNodesRequest(), timeout=5.0)
            assert [n.inventory.node for n in nodes.nodes] == list(ALL_NODES)
            assert not call.done()
            release.set()
            reply = await call
            assert reply.HasField("largest_tokens_per_gpu")

    try:
        run(main())
    finally:
        release.set()


# ---------------------------------------------------------------------------- context


def test_advise_context_matches_the_planner(tmp_path: Path) -> None:
    async def main() -> None:
        async with controller_with_nodes(tmp_path) as api:
            reply = await api.plans.AdviseContext(
                plan_pb2.AdviseContextRequest(
                    spec=spec_to_proto(spec(tokens_per_gpu=8)),
                    contexts=[32768, 65536],
                    policies=["uniform", "greedy"],
                )
            )
            want = advise_context(
                expected(), 8, contexts=(32768, 65536), policies=("uniform", "greedy")
            )
            assert reply.tokens_per_gpu == 8 and list(reply.contexts) == [32768, 65536]
            assert [p.policy for p in reply.policies] == ["uniform", "greedy"]
            for got, exp in zip(reply.policies, want.policies, strict=True):
                assert opt(got, "longest_context") == exp.longest_context
                assert got.binding_gpu == exp.binding_gpu
                assert [
                    (
                        p.context_len,
                        p.fits,
                        opt(p, "step_time_us"),
                        opt(p, "max_context_at_shares"),
                        [(s.gpu_model, s.gpus, s.attention_share_each) for s in p.shares],
                    )
                    for p in got.points
                ] == [
                    (
                        p.context_len,
                        p.ok,
                        p.step_time_us,
                        p.max_context_at_shares,
                        [(s.gpu_model, s.gpus, s.attention_share_each) for s in p.shares],
                    )
                    for p in exp.points
                ]
            uniform, greedy = (opt(p, "longest_context") for p in reply.policies)
            assert uniform is not None and greedy is not None
            # greedy moves attention (and KV) to the H200s: it holds a longer context
            assert greedy > uniform
            assert list(reply.infeasible) == []

            # a batch nothing holds at these contexts: answered, not an error
            reply = await api.plans.AdviseContext(
                plan_pb2.AdviseContextRequest(
                    spec=spec_to_proto(spec(tokens_per_gpu=4096)),
                    contexts=[131072],
                    policies=["uniform"],
                )
            )
            assert not reply.policies[0].HasField("longest_context")
            assert "tokens_per_gpu" in reply.infeasible[0]

    run(main())


# ------------------------------------------------------------------------------ tiers


def _tier_request(rate: float, prices: PriceTable) -> TierRequest:
    return TierRequest(
        deployment=expected(),
        interactive=InteractiveTier(tpot_ms=50.0, ttft_ms=2000.0, requests_per_s=rate),
        batch=BatchTier(phase="decode", tokens_per_gpu=64, context_len=4096),
        additions=("H200-SXM-141GB", "B200"),
        prices=prices,
    )


def test_advise_tiers_matches_the_planner_and_says_what_meets_the_slo(tmp_path: Path) -> None:
    prices = PriceTable({**DEFAULT_USD_PER_GPU_HOUR, "H200-SXM-141GB": 2.5}, "EUR")

    def request(rate: float) -> plan_pb2.AdviseTiersRequest:
        return plan_pb2.AdviseTiersRequest(
            spec=spec_to_proto(spec(tokens_per_gpu=64)),
            interactive=plan_pb2.InteractiveTierSpec(
                tpot_ms=50.0, ttft_ms=2000.0, requests_per_s=rate
            ),
            additions=["H200-SXM-141GB", "B200"],
            prices={"H200-SXM-141GB": 2.5},
            currency="EUR",
        )

    async def main() -> None:
        async with controller_with_nodes(tmp_path) as api:
            reply = await api.plans.AdviseTiers(request(5.0))
            want = plan_tiers(_tier_request(5.0, prices))
            i, b = reply.interactive, reply.batch
            assert list(reply.fleet_nodes) == list(ALL_NODES)
            assert i.slo_met and want.interactive.slo_met
            assert list(i.nodes) == list(want.interactive.nodes)
            assert list(b.nodes) == list(want.batch.nodes)
            assert set(i.nodes).isdisjoint(b.nodes) and set(i.nodes) | set(b.nodes) == set(
                ALL_NODES
            )
            assert i.capacity_requests_per_s == pytest.approx(
                want.interactive.capacity_requests_per_s
            )
            assert i.capacity_requests_per_s >= i.demand_requests_per_s == 5.0
            assert [r.plan.plan_id for r in i.replicas] == [
                r.result.plan.id for r in want.interactive.replicas
            ]
            assert all(r.tpot_ms <= 50.0 and r.ttft_ms <= 2000.0 for r in i.replicas)
            assert [p.plan_id for p in b.plans] == [r.plan.id for r in want.batch.results]
            assert b.tokens_per_s == pytest.approx(want.batch.tokens_per_s)
            assert [u.description for u in reply.unit_types] == [
                u.description for u in want.unit_types
            ]
            assert [u.requests_per_s for u in reply.unit_types] == pytest.approx(
                [u.requests_per_s for u in want.unit_types]
            )
            assert list(i.additions) == []

            # far more traffic than the fleet can carry: the SLO is reported unmet, with
            # the nodes that would meet it, priced with the request's prices
            reply = await api.plans.AdviseTiers(request(1000.0))
            want = plan_tiers(_tier_request(1000.0, prices))
            i = reply.interactive
            assert not i.slo_met and not want.interactive.slo_met
            assert reply.currency == "EUR"
            assert [(a.gpu_model, a.nodes, a.gpus) for a in i.additions] == [
                (a.gpu_model, a.nodes, a.gpus) for a in want.interactive.additions
            ]
            h200 = next(a for a in i.additions if a.gpu_model == "H200-SXM-141GB")
            assert h200.cost_per_hour == pytest.approx(h200.gpus * 2.5)
            assert h200.nodes * h200.requests_per_s_per_node >= 1000.0 - i.capacity_requests_per_s
            costs = [a.cost_per_hour for a in i.additions]
            assert costs == sorted(costs)

    run(main())


# ------------------------------------------------------------------------------- cost


def test_estimate_cost_of_a_dry_run_with_price_overrides(tmp_path: Path) -> None:
    """Prices: the defaults, then the spec's gpu_hour_prices, then the request's prices."""

    async def main() -> None:
        async with controller_with_nodes(tmp_path) as api:
            priced = spec(
                tokens_per_gpu=64,
                gpu_hour_prices={"A100-SXM4-80GB": 1.0, "H100-SXM5-80GB": 9.0},
            )
            reply = await api.plans.EstimateCost(
                plan_pb2.EstimateCostRequest(
                    spec=spec_to_proto(priced), prices={"H100-SXM": 2.0}, currency="EUR"
                )
            )
            solved = await api.plans.Solve(
                plan_pb2.SolveRequest(spec=spec_to_proto(spec(tokens_per_gpu=64)))
            )
            assert list(reply.infeasible) == []
            assert reply.plan.plan_id == solved.plan.plan_id and reply.plan.version == 0
            assert dict(reply.prices_used) == {
                "H100-SXM5-80GB": 2.0,
                "H200-SXM-141GB": DEFAULT_USD_PER_GPU_HOUR["H200-SXM-141GB"],
                "A100-SXM4-80GB": 1.0,
            }
            assert dict(reply.gpus_by_model) == dict.fromkeys(reply.prices_used, 2)
            per_hour = 2 * (2.0 + 3.80 + 1.0)
            assert reply.cost_per_hour == pytest.approx(per_hour)
            assert reply.tokens_per_s == pytest.approx(solved.plan.summary.tokens_per_s)
            assert reply.cost_per_million_tokens == pytest.approx(
                per_hour / (reply.tokens_per_s * 3600.0) * 1e6
            )
            assert reply.currency == "EUR"

    run(main())


def test_estimate_cost_of_a_committed_plan(tmp_path: Path) -> None:
    """A real rollout to fake agents, then the committed plan is priced."""

    async def main() -> None:
        async with (
            start_controller(tmp_path) as ctl,
            grpc.aio.insecure_channel(ctl.address) as ch,
        ):
            agents = [FakeAgent(ctl.address, inv) for inv in small_inventories()]
            for a in agents:
                await a.start()
            try:
                plans = plan_pb2_grpc.PlanServiceStub(ch)
                deployment = spec(
                    name="mx", prepare_timeout_s=5.0, gpu_hour_prices={"H200-SXM-141GB": 3.0}
                )
                await plans.ApplyDeployment(
                    plan_pb2.ApplyDeploymentRequest(spec=spec_to_proto(deployment))
                )
                store = ctl.controller.store
                await wait_until(lambda: store.committed_plan("mx") is not None, what="commit")
                reply = await plans.EstimateCost(plan_pb2.EstimateCostRequest(deployment="mx"))
            finally:
                for a in agents:
                    await a.stop()
            committed = store.committed_plan("mx")
            assert committed is not None and committed.plan is not None
            # the deployment's own prices are the base
            prices = PriceTable({**DEFAULT_USD_PER_GPU_HOUR, "H200-SXM-141GB": 3.0})
            want = plan_cost(committed.plan, prices)
            assert reply.prices_used["H200-SXM-141GB"] == 3.0
            assert reply.plan.deployment == "mx"
            assert (reply.plan.version, reply.plan.plan_id) == (
                committed.version,
                committed.plan_id,
            )
            assert reply.cost_per_hour == pytest.approx(want.usd_per_hour)
            assert reply.cost_per_million_tokens == pytest.approx(want.usd_per_million_tokens)
            assert reply.currency == "USD"

    run(main())


def test_min_cost_matches_the_planner(tmp_path: Path) -> None:
    async def main() -> None:
        async with controller_with_nodes(tmp_path) as api:
            reply = await api.plans.MinCost(
                plan_pb2.MinCostRequest(
                    spec=spec_to_proto(spec(tokens_per_gpu=64)),
                    target_tokens_per_s=5000.0,
                    include_plans=True,
                )
            )
            want = min_cost(
                expected(), 5000.0, PriceTable(), tokens_per_gpu=64, final_policy="greedy"
            )
            assert list(reply.infeasible) == []
            assert reply.description == want.description
            assert list(reply.chosen.nodes) == list(want.best.nodes)
            assert reply.chosen.layout == want.best.layout
            assert reply.tokens_per_s == pytest.approx(want.cost.tokens_per_s)
            assert reply.tokens_per_s >= 5000.0
            assert reply.cost_per_hour == pytest.approx(want.cost.usd_per_hour)
            assert [p.plan_id for p in reply.plans] == [r.plan.id for r in want.results]
            assert all(json.loads(p.plan_json)["gpus"] for p in reply.plans)
            assert [list(c.nodes) for c in reply.screened] == [list(c.nodes) for c in want.screened]
            # nothing cheaper reaches the target: every cheaper subset screened falls short
            cheaper = [c for c in reply.screened if c.cost_per_hour < reply.cost_per_hour]
            assert all(c.screened_tokens_per_s < 5000.0 for c in cheaper)

            # no subset reaches a throughput this high: answered in the reply
            reply = await api.plans.MinCost(
                plan_pb2.MinCostRequest(
                    spec=spec_to_proto(spec(tokens_per_gpu=64)), target_tokens_per_s=1e9
                )
            )
            assert not reply.HasField("chosen")
            assert "1,000,000,000 tokens/s" in reply.infeasible[0]
            assert "To fix" in reply.infeasible[1]

    run(main())


# ----------------------------------------------------------------------------- errors
