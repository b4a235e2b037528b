"""The tables and lines the demo's fleet-plan step (:mod:`demo.instances_step`) prints:
the controller's instances, each instance's planned share against the requests it got,
TTFT/TPOT and SLO attainment as the planner predicted them (:func:`predicted`), as the
serving simulator finds them (:func:`simulated`) and as the client measured them
(:func:`measured`), the router's open requests per instance, the router's measured demand
as the controller keeps it, and how the client's requests ended (:func:`verdict`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from mixfleet.v1 import engine_pb2

from controlplane.server.controller.demand import DemandStatus
from demo.instances_serving import Answer, EngineFarm, Router, current
from demo.session import _table, say
from policies.serving.sim_types import SimOptions, SimReport, quantile_sorted
from policies.serving.simulate import simulate
from policies.spec.build import DeploymentSpec

SIM_REQUESTS = 2000  # requests the serving simulator runs


@dataclass
class Latencies:
    """TTFT and TPOT p90 (ms) and the SLO attainment (share of requests within both
    targets) of one source."""

    source: str
    ttft_p90_ms: float
    tpot_p90_ms: float
    attainment: float
    note: str = ""


def measured(answers: Sequence[Answer], ttft_ms: float, tpot_ms: float) -> Latencies:
    """The client's view of its streamed requests."""
    seen = [a for a in answers if a.stream and a.status == 200 and not math.isnan(a.ttft_s)]
    if not seen:
        return Latencies("measured (client)", math.nan, math.nan, math.nan, "no stream")
    ttft = sorted(a.ttft_s * 1000 for a in seen)
    tpot = sorted(a.tpot_s * 1000 for a in seen if not math.isnan(a.tpot_s))
    ok = sum(
        1
        for a in seen
        if a.ttft_s * 1000 <= ttft_ms and (math.isnan(a.tpot_s) or a.tpot_s * 1000 <= tpot_ms)
    )
    return Latencies(
        "measured (client)",
        quantile_sorted(ttft, 0.9),
        quantile_sorted(tpot, 0.9) if tpot else math.nan,
        ok / len(seen),
        f"{len(seen)} streamed requests",
    )


def simulated(doc: Any, spec: DeploymentSpec, msg: engine_pb2.Instances) -> Latencies:
    """The serving simulator on the deployment's fleet plan document ``doc``; the note says
    whether that plan has the instances (role and nodes) the controller lists in ``msg``."""
    from policies.launch import planned_instances
    from policies.serving.plan import plan_from_doc

    offline = planned_instances({"kind": "FleetPlan", "deployments": [doc]}, spec.name)
    same = sorted((i.role, tuple(i.nodes)) for i in offline) == sorted(
        (i.role, tuple(i.nodes)) for i in msg.instances if current(i)
    )

    assert spec.traffic is not None
    plan = plan_from_doc(doc["servingPlan"], "servingPlan")
    report: SimReport = simulate(plan, spec.traffic, spec.slo, SimOptions(SIM_REQUESTS, seed=1))
    return Latencies(
        "simulated",
        report.ttft_ms.p90,
        report.tpot_ms.p90,
        report.attainment,
        f"{SIM_REQUESTS} requests, serving simulator"
        + ("" if same else "; NOTE: its plan is not the controller's"),
    )


def _ms(v: float) -> str:
    return "-" if math.isnan(v) else f"{v:.0f}" if v >= 10 else f"{v:.1f}"


def show_latencies(rows: Sequence[Latencies], spec: DeploymentSpec) -> None:
    """The SLO and one line per source: TTFT and TPOT p90 (ms), share within the SLO."""
    slo = spec.slo
    assert slo is not None
    say()
    say(
        f"latency      SLO: TTFT <= {slo.ttft_ms:.0f} ms, TPOT <= {slo.tpot_ms:.0f} ms for "
        f"{slo.percentile:.0f}% of requests"
    )
    table = [["source", "TTFT p90 ms", "TPOT p90 ms", "within SLO", "from"]]
    for r in rows:
        att = "-" if math.isnan(r.attainment) else f"{r.attainment:.1%}"
        table.append([r.source, _ms(r.ttft_p90_ms), _ms(r.tpot_p90_ms), att, r.note])
    _table(table)


def show_shares(
    msg: engine_pb2.Instances, got: dict[str, int], title: str, new: Sequence[str] = ()
) -> None:
    """Per instance: role, nodes, planned requests/s and share, the requests it got. An
    aggregated or decode instance's share is of the requests (a prefill/decode pair's
    requests are its decode instances'), a prefill instance's of the prefills."""
    live = [i for i in msg.instances if current(i) or got.get(i.name)]

    def side(i: engine_pb2.Instance) -> str:
        return "prefill" if i.role == "prefill" else "serve"

    planned_total: dict[str, float] = {}
    got_total: dict[str, int] = {}
    for i in live:
        if current(i):
            planned_total[side(i)] = planned_total.get(side(i), 0.0) + i.requests_per_s
        got_total[side(i)] = got_total.get(side(i), 0) + got.get(i.name, 0)
    say(title)
    rows = [["instance", "role", "nodes", "planned req/s", "planned share", "got", "share"]]
    for i in live:
        planned = i.requests_per_s / planned_total[side(i)] if planned_total.get(side(i)) else 0
        n = got.get(i.name, 0)
        mark = " (new)" if i.name in new else "" if current(i) else " (replaced)"
        rows.append(
            [
                i.name + mark,
                i.role,
                ",".join(i.nodes),
                f"{i.requests_per_s:.2f}",
                f"{planned:.3f}",
                str(n),
                f"{n / got_total[side(i)] if got_total[side(i)] else 0:.3f}",
            ]
        )
    _table(rows)


def predicted(msg: engine_pb2.Instances) -> Latencies:
    """The planner's prediction: the slowest live pool's TTFT (at the SLO percentile) and
    TPOT; each pool is sized to meet the SLO, so no attainment figure of its own."""
    live = [i for i in msg.instances if current(i)]
    return Latencies(
        "predicted (planner)",
        max((i.ttft_ms for i in live), default=math.nan),
        max((i.tpot_ms for i in live), default=math.nan),
        math.nan,
        "slowest pool; every pool sized to meet the SLO",
    )


def show_instances(msg: engine_pb2.Instances) -> None:
    """The controller's live instances: role, pool, nodes, url, batch limit, predicted TTFT
    and TPOT (ms) and planned requests/s."""
    rows = [["instance", "role", "pool", "nodes", "url", "batch", "TTFT ms", "TPOT ms", "req/s"]]
    for i in msg.instances:
        if not current(i):
            continue
        rows.append(
            [
                i.name,
                i.role,
                i.pool,
                ",".join(i.nodes),
                i.url,
                str(i.batch_limit),
                _ms(i.ttft_ms),
                _ms(i.tpot_ms),
                f"{i.requests_per_s:.2f}",
            ]
        )
    _table(rows)


async def show_router(router: Router, session: aiohttp.ClientSession, farm: EngineFarm) -> None:
    """The router's open requests and batch limit per instance beside the requests its
    engine has open (they differ only by requests on their way)."""
    doc = await router.status(session)
    engine_open = {
        name: sum(1 for r in run.engine.records if not r.done) for name, run in farm.running.items()
    }
    rows = [["router instance", "open", "batch limit", "engine open"]]
    for i in doc.get("instances", []):
        rows.append(
            [
                str(i.get("name")),
                str(i.get("open_requests")),
                str(i.get("batch_limit")),
                str(engine_open.get(str(i.get("deployment")), "-")),
            ]
        )
    _table(rows)


def verdict(answers: Sequence[Answer]) -> str:
    """How the client's requests ended: answered, cut (an answer begun, then broken off)
    and refused (no answer begun: the router's 429/503, or no connection), with the most
    frequent refusal."""
    cut = sum(1 for a in answers if a.status == 200 and not a.complete)
    refused = [a for a in answers if a.status != 200]
    text = (
        f"streams      {len(answers)} requests in all ({sum(a.stream for a in answers)} "
        f"streamed): {len(answers) - cut - len(refused)} answered, {cut} cut, "
        f"{len(refused)} refused"
    )
    if refused:
        kinds: dict[str, int] = {}
        for a in refused:
            key = f"{a.status} {a.error[:110]}".strip()
            kinds[key] = kinds.get(key, 0) + 1
        key, n = max(kinds.items(), key=lambda kn: kn[1])
        text += f" ({n}x {key})"
    return text


def show_measured(status: DemandStatus, spec: DeploymentSpec) -> None:
    """What the router measured, as the controller keeps it (ReportTraffic, summed), and
    the demand the deployment is planned for now."""
    m = status.measured
    planning = status.planning_traffic(spec)
    planned_rps = planning.requests_per_s if planning is not None else math.nan
    if m is None:
        say("controller   no traffic report from the router yet")
        return
    say(
        f"controller   measured by the router (ReportTraffic): {m.requests_per_s:.1f} "
        f"requests/s over the last {m.end_s - m.start_s:.0f} s (planned {planned_rps:.3g}), "
        f"prompts {m.input_tokens_mean:.0f} and answers {m.output_tokens_mean:.0f} tokens, "
        f"TTFT p50/p99 {m.ttft_ms_p50:.0f}/{m.ttft_ms_p99:.0f} ms, TPOT p50/p99 "
        f"{m.tpot_ms_p50:.1f}/{m.tpot_ms_p99:.1f} ms"
    )
