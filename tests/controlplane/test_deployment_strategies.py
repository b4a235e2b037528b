"""Deployment strategies in the controller's desired state: ``allowCrossVendor`` and
``gpuHourPrices`` through the document, the wire and the solve request; cost per million
tokens in the committed status; ``--allow-cross-vendor`` on ``mixfleetctl plan``."""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from agent_fakes import FakeAgent, small_inventories, wait_until
from cli_builders import cli_runner
from mixfleet.v1 import plan_pb2, plan_pb2_grpc

from apis.wire.deployment import spec_from_proto, spec_to_proto
from controlplane.server.inprocess import start_controller
from controlplane.wire.plans import deployment_to_proto
from policies.advice.cost import DEFAULT_USD_PER_GPU_HOUR
from policies.errors import InputError
from policies.hardware.fleet import Fleet, parse_fleet
from policies.request import check_request
from policies.solve import solve
from policies.spec.build import (
    DeploymentSpec,
    WorkloadSpec,
    build_request,
    check_spec,
    parse_deployment,
    price_table,
    spec_to_doc,
    usd_per_million_tokens,
)

MIXED_VENDORS = """\
apiVersion: mixfleet.io/v1alpha1
kind: Fleet
metadata: {name: two-vendors}
spec:
  nodes:
  - name: h100-0
    gpus: [{model: H100-SXM5-80GB, count: 2}]
    nvlink: {domain: h100-0, per_gpu_bidir_gbytes_per_s: 900}
    nics: [{count: 1, per_direction_gbits_per_s: 400, fabric: ib0}]
  - name: mi300x-0
    gpus: [{model: MI300X, count: 2}]
    nvlink: {domain: mi300x-0, per_gpu_bidir_gbytes_per_s: 896}
    nics: [{count: 1, per_direction_gbits_per_s: 400, fabric: ib0}]
"""


def doc(**extra: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": "mixtral-8x7b",
        "policy": "greedy",
        "workload": {"phase": "decode", "tokensPerGpu": 16, "contextLen": 2048},
    }
    spec.update(extra)
    return {
        "apiVersion": "mixfleet.io/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": "mx"},
        "spec": spec,
    }


def mixed_fleet() -> Fleet:
    return parse_fleet(yaml.safe_load(MIXED_VENDORS))


# ------------------------------------------------------------------------ document


def test_document_carries_cross_vendor_and_prices_through_doc_and_wire() -> None:
    spec = parse_deployment(
        doc(allowCrossVendor=True, gpuHourPrices={"H100-SXM5-80GB": 2.5, "MI300X": 0})
    )
    assert spec.allow_cross_vendor is True
    assert dict(spec.gpu_hour_prices) == {"H100-SXM5-80GB": 2.5, "MI300X": 0}
    again = parse_deployment(spec_to_doc(spec))
    assert again == spec
    wired = spec_from_proto(spec_to_proto(spec))
    assert wired.allow_cross_vendor is True
    assert dict(wired.gpu_hour_prices) == {"H100-SXM5-80GB": 2.5, "MI300X": 0.0}
    # Defaults: off and no prices; the document does not grow new keys for them.
    plain = parse_deployment(doc())
    assert plain.allow_cross_vendor is False and not plain.gpu_hour_prices
    body = spec_to_doc(plain)["spec"]
    assert "allowCrossVendor" not in body and "gpuHourPrices" not in body
    assert spec_from_proto(spec_to_proto(plain)) == plain


def test_prices_replace_only_the_listed_defaults() -> None:
    table = price_table(parse_deployment(doc(gpuHourPrices={"L4": 0.3})))
    assert table.price("L4") == 0.3
    assert table.price("H100-SXM5-80GB") == DEFAULT_USD_PER_GPU_HOUR["H100-SXM5-80GB"]


@pytest.mark.parametrize(
    ("extra", "field", "needles"),
    [
        (
            {"gpuHourPrices": {"H100": 2.0}},
            "spec.gpuHourPrices.H100",
            ("not a catalog GPU model", "H100-SXM5-80GB", "To fix"),
        ),
        (
            {"gpuHourPrices": {"B200": -1}},
            "spec.gpuHourPrices.B200",
            (">= 0", "-1"),
        ),
        (
            {"gpuHourPrices": {"B200": "cheap"}},
            "spec.gpuHourPrices.B200",
            ("finite number",),
        ),
        ({"gpuHourPrices": [1, 2]}, "spec.gpuHourPrices", ("mapping", "To fix")),
        ({"allowCrossVendor": "yes"}, "spec.allowCrossVendor", ("true or false",)),
    ],
)
def test_bad_strategy_fields_name_the_field(
    extra: dict[str, Any], field: str, needles: tuple[str, ...]
) -> None:
    with pytest.raises(InputError) as exc:
        parse_deployment(doc(**extra))
    assert exc.value.field == field
    for needle in needles:
        assert needle in str(exc.value)


def test_unknown_price_from_the_wire_is_refused() -> None:
    msg = spec_to_proto(DeploymentSpec(name="mx", model="mixtral-8x7b"))
    msg.gpu_hour_prices["A100"] = 1.0
    with pytest.raises(InputError) as exc:
        spec_from_proto(msg)
    assert exc.value.field == "spec.gpuHourPrices.A100"
    assert "A100-SXM4-80GB" in str(exc.value)


# ------------------------------------------------------------------- solve request


def test_build_request_carries_the_vendor_rule() -> None:
    spec = DeploymentSpec(name="mx", model="mixtral-8x7b", policy="greedy")
    fleet = mixed_fleet()
    refused = build_request(spec, fleet)
    assert refused.allow_cross_vendor is False
    with pytest.raises(InputError) as exc:
        check_request(refused)
    assert "across vendors" in str(exc.value) and "allow_cross_vendor" in str(exc.value)
    allowed = build_request(replace(spec, allow_cross_vendor=True), fleet)
    assert allowed.allow_cross_vendor is True
    check_request(allowed)  # no exception: one group over both vendors


def test_cost_per_million_tokens_follows_the_spec_prices() -> None:
    spec = DeploymentSpec(
        name="mx",
        model="mixtral-8x7b",
        policy="greedy",
        workload=WorkloadSpec(tokens_per_gpu=16, context_len=2048),
        allow_cross_vendor=True,
    )
    check_spec(spec)
    plan = solve(build_request(spec, mixed_fleet())).plan
    tps = plan.summary.tokens_per_s
    default = usd_per_million_tokens(spec, plan)
    want = (2 * 2.99 + 2 * 2.90) / (tps * 3600) * 1e6
    assert default == pytest.approx(want)
    free_amd = usd_per_million_tokens(replace(spec, gpu_hour_prices={"MI300X": 0.0}), plan)
    assert free_amd == pytest.approx(2 * 2.99 / (tps * 3600) * 1e6)
    assert free_amd is not None and default is not None and free_amd < default
    nothing = replace(plan, summary=replace(plan.summary, tokens_per_s=0.0))
    assert usd_per_million_tokens(spec, nothing) is None  # infinite cost is not reported


# ---------------------------------------------------------------------- controller


def test_committed_status_reports_cost_per_million_tokens(tmp_path: Path) -> None:
    spec = DeploymentSpec(
        name="mx",
        model="mixtral-8x7b",
        policy="greedy",
        workload=WorkloadSpec(tokens_per_gpu=32, context_len=2048),
        prepare_timeout_s=5.0,
        gpu_hour_prices={"H100-SXM5-80GB": 1.0},
    )

    async def main() -> None:
        async with start_controller(tmp_path) as ctl:
            agents = [FakeAgent(ctl.address, inv) for inv in small_inventories(2)]
            for a in agents:
                await a.start()
            try:
                async with grpc.aio.insecure_channel(ctl.address) as ch:
                    plans = plan_pb2_grpc.PlanServiceStub(ch)
                    await plans.ApplyDeployment(
                        plan_pb2.ApplyDeploymentRequest(spec=spec_to_proto(spec))
                    )
                    store = ctl.controller.store

                    def committed() -> bool:
                        d = store.get_deployment("mx")
                        return d is not None and d.committed_version == 1

                    await wait_until(committed, what="v1 committed")
                    stored = store.get_deployment("mx")
                    assert stored is not None
                    plan = store.committed_plan("mx")
                    assert plan is not None and plan.plan is not None
                    gpus = [g.model for g in plan.plan.gpus]
                    assert "H100-SXM5-80GB" in gpus
                    prices = {**DEFAULT_USD_PER_GPU_HOUR, "H100-SXM5-80GB": 1.0}
                    per_hour = sum(prices[m] for m in gpus)
                    tps = plan.plan.summary.tokens_per_s
                    want = per_hour / (tps * 3600) * 1e6
                    got = stored.status["cost_per_million_tokens_usd"]
                    assert got == pytest.approx(want)
                    wire = deployment_to_proto(stored)
                    assert wire.status.cost_per_million_tokens_usd == pytest.approx(want)
                    reply = await plans.GetDeployment(plan_pb2.GetDeploymentRequest(name="mx"))
                    assert reply.status.cost_per_million_tokens_usd == pytest.approx(want)
                    assert dict(reply.spec.gpu_hour_prices) == {"H100-SXM5-80GB": 1.0}
            finally:
                for a in agents:
                    await a.stop()

    asyncio.run(main())


def test_uncommitted_deployment_reports_no_cost() -> None:
    from controlplane.store import StoredDeployment

    d = StoredDeployment(
        spec=DeploymentSpec(name="mx", model="mixtral-8x7b"),
        generation=1,
        created_at_s=0.0,
        updated_at_s=0.0,
        deleted=False,
        committed_version=None,
        status={"cost_per_million_tokens_usd": 0.5},
    )
    assert deployment_to_proto(d).status.cost_per_million_tokens_usd == 0.0


# ----------------------------------------------------------------------------- CLI


def test_plan_solve_allow_cross_vendor(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = cli_runner(capsys)
    fleet = tmp_path / "vendors.yaml"
    fleet.write_text(MIXED_VENDORS)
    problem = [
        "--fleet",
        fleet,
        "--model",
        "mixtral-8x7b",
        "--tokens",
        "16",
        "--context",
        "2048",
        "--redundant-experts",
        "0",
        "-q",
    ]
    args = ["plan", "solve", *problem, "--policy", "greedy", "-o", "json"]
    code, out, err = run(*args)
    assert code != 0 and not out
    assert "across vendors" in err and "--allow-cross-vendor" in err and "Traceback" not in err
    code, out, err = run(*args, "--allow-cross-vendor")
    assert code == 0, err
    plan = json.loads(out)
    assert {g["model"] for g in plan["gpus"]} == {"H100-SXM5-80GB", "MI300X"}
    assert math.isfinite(plan["summary"]["tokens_per_s"])
    # plan compare shares the flag.
    code, out, err = run(
        "plan",
        "compare",
        *problem,
        "--policies",
        "uniform,greedy",
        "--allow-cross-vendor",
    )
    assert code == 0, err
    assert "greedy" in out and "uniform" in out
