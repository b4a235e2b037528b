"""PlanService's strategy RPCs refuse bad questions with the right status code and a message
naming the field, and let in only the callers their role allows. Real gRPC on loopback, the
three small nodes registered through AgentService (see strategy_fixtures)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import grpc
from mixfleet.v1 import plan_pb2
from strategy_fixtures import (
    ADMIN,
    AGENT,
    ENGINE,
    VIEWER,
    controller_with_nodes,
    expect,
    opt,
    run,
    spec,
)

from apis.wire.deployment import spec_to_proto

INVALID = grpc.StatusCode.INVALID_ARGUMENT


def _tiers(**interactive: Any) -> plan_pb2.AdviseTiersRequest:
    return plan_pb2.AdviseTiersRequest(
        spec=spec_to_proto(spec()),
        interactive=plan_pb2.InteractiveTierSpec(requests_per_s=1.0, **interactive),
    )


def test_bad_slos_and_preferences_name_the_field(tmp_path: Path) -> None:
    async def main() -> None:
        async with controller_with_nodes(tmp_path) as api:
            p = api.plans
            # negative SLOs
            await expect(INVALID, p.AdviseTiers(_tiers(tpot_ms=-5.0)), "interactive.tpot_ms", "> 0")
            await expect(INVALID, p.AdviseTiers(_tiers(ttft_ms=math.nan)), "interactive.ttft_ms")
            await expect(INVALID, p.AdviseTiers(_tiers()), "interactive:", "To fix")
            await expect(
                INVALID,
                p.AdviseTiers(_tiers(tpot_ms=50.0, max_utilisation=1.5)),
                "interactive.max_utilisation",
            )
            bad = _tiers(tpot_ms=50.0)
            bad.additions.append("Z9000")
            await expect(INVALID, p.AdviseTiers(bad), "additions[0]", "Z9000")
            bad = _tiers(tpot_ms=50.0)
            bad.preference = "cheapest"
            await expect(INVALID, p.AdviseTiers(bad), "preference", "max-batch")
            await expect(
                INVALID,
                p.AdviseBatch(plan_pb2.AdviseBatchRequest(spec=spec_to_proto(spec()), tpot_ms=-1)),
                "tpot_ms",
            )
            await expect(
                INVALID,
                p.AdviseBatch(plan_pb2.AdviseBatchRequest(spec=spec_to_proto(spec()), ttft_ms=9)),
                "ttft_ms",
                "prefill",
            )

    run(main())


def test_bad_prices_models_and_specs_name_the_field(tmp_path: Path) -> None:
    async def main() -> None:
        async with controller_with_nodes(tmp_path) as api:
            p = api.plans
            # unknown GPU, bad price
            await expect(
                INVALID,
                p.EstimateCost(
                    plan_pb2.EstimateCostRequest(spec=spec_to_proto(spec()), prices={"Z9000": 1.0})
                ),
                'prices["Z9000"]',
                "unknown GPU model",
                "To fix",
            )
            await expect(
                INVALID,
                p.MinCost(
                    plan_pb2.MinCostRequest(
                        spec=spec_to_proto(spec()),
                        target_tokens_per_s=100.0,
                        prices={"H100": -2.0},
                    )
                ),
                'prices["H100"]',
            )
            # unknown model, missing spec
            unknown = spec_to_proto(spec())
            unknown.model = "gpt-17"
            await expect(
                INVALID,
                p.AdviseBatch(plan_pb2.AdviseBatchRequest(spec=unknown)),
                "spec.model",
                "gpt-17",
            )
            await expect(
                INVALID, p.AdviseBatch(plan_pb2.AdviseBatchRequest()), "spec:", "spec.model"
            )
            await expect(INVALID, p.EstimateCost(plan_pb2.EstimateCostRequest()), "plan:")

    run(main())


def test_bad_option_values_name_the_field(tmp_path: Path) -> None:
    async def main() -> None:
        async with controller_with_nodes(tmp_path) as api:
            p = api.plans
            await expect(
                INVALID,
                p.MinCost(plan_pb2.MinCostRequest(spec=spec_to_proto(spec()))),
                "target_tokens_per_s",
            )
            await expect(
                INVALID,
                p.MinCost(
                    plan_pb2.MinCostRequest(
                        spec=spec_to_proto(spec()), target_tokens_per_s=1.0, layout="diagonal"
                    )
                ),
                "layout",
            )
            await expect(
                INVALID,
                p.AdviseContext(
                    plan_pb2.AdviseContextRequest(spec=spec_to_proto(spec()), contexts=[4096, -1])
                ),
                "contexts[1]",
            )
            await expect(
                INVALID,
                p.AdviseContext(
                    plan_pb2.AdviseContextRequest(spec=spec_to_proto(spec()), policies=["magic"])
                ),
                "policies[0]",
            )

    run(main())


def test_no_matching_node_or_no_committed_plan_is_a_failed_precondition(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        async with controller_with_nodes(tmp_path) as api:
            p = api.plans
            # no node matches the selector
            nowhere = spec_to_proto(spec(node_selector={"rack": "nowhere"}))
            for call in (
                p.AdviseBatch(plan_pb2.AdviseBatchRequest(spec=nowhere)),
                p.AdviseContext(plan_pb2.AdviseContextRequest(spec=nowhere)),
                p.MinCost(plan_pb2.MinCostRequest(spec=nowhere, target_tokens_per_s=1.0)),
                p.EstimateCost(plan_pb2.EstimateCostRequest(spec=nowhere)),
                p.AdviseTiers(
                    plan_pb2.AdviseTiersRequest(
                        spec=nowhere,
                        interactive=plan_pb2.InteractiveTierSpec(tpot_ms=50, requests_per_s=1),
                    )
                ),
            ):
                await expect(
                    grpc.StatusCode.FAILED_PRECONDITION, call, "spec.node_selector", "To fix"
                )
            # unknown deployment; a deployment without a committed plan yet
            await expect(
                grpc.StatusCode.NOT_FOUND,
                p.EstimateCost(plan_pb2.EstimateCostRequest(deployment="ghost")),
                "deployment",
                "ghost",
            )
            await p.CreateDeployment(
                plan_pb2.ApplyDeploymentRequest(spec=spec_to_proto(spec(name="fresh")))
            )
            await expect(
                grpc.StatusCode.FAILED_PRECONDITION,
                p.EstimateCost(plan_pb2.EstimateCostRequest(deployment="fresh")),
                "deployment",
                "no committed plan",
            )

    run(main())


def test_viewers_may_ask_and_unknown_callers_may_not(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(
        f"{ADMIN} admin cli\n{VIEWER} viewer dash\n{ENGINE} engine eng\n{AGENT} agent ag\n"
    )

    def md(token: str) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {token}"),)

    request = plan_pb2.AdviseContextRequest(
        spec=spec_to_proto(spec(tokens_per_gpu=8)), contexts=[32768], policies=["uniform"]
    )

    async def main() -> None:
        async with controller_with_nodes(tmp_path, token_file=tokens) as api:
            p = api.plans
            for token in (VIEWER, ADMIN):
                reply = await p.AdviseContext(request, metadata=md(token))
                assert opt(reply.policies[0], "longest_context") is not None
            await expect(grpc.StatusCode.UNAUTHENTICATED, p.AdviseContext(request), "authorization")
            await expect(
                grpc.StatusCode.PERMISSION_DENIED,
                p.MinCost(
                    plan_pb2.MinCostRequest(spec=request.spec, target_tokens_per_s=1.0),
                    metadata=md(ENGINE),
                ),
            )
            cost = plan_pb2.EstimateCostRequest(spec=request.spec)
            assert (await p.EstimateCost(cost, metadata=md(VIEWER))).cost_per_hour > 0

    run(main())
