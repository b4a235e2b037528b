"""Goodput benchmark: the fleet planner against hand-made splits, through the one cost model
and the serving simulator (``make bench-goodput``; docs/goodput.md).

Scenarios (``--scenario all``): DeepSeek-V3 and Qwen3-235B-A22B (SGLang, FP8 KV) on
hopper-blackwell-24, mixed-24, mixed-64, ada-hopper and homog-32, with ISL/OSL 4096/512 and
1024/1024 (lognormal lengths, p90 = 1.25 x mean), TTFT 2 s and TPOT 50 ms at p90, Poisson
arrivals; the demand is far above what any fleet serves, so the fleet is the limit. Plans:

* **mixfleet**: :func:`policies.fleetplan.plan_fleet` (variants, P/D pools, the integer
  program);
* **(a) one instance** over every GPU (one curve of the whole fleet, aggregated);
* **(b) hand split**: one aggregated EPLB instance per node group (generation) that can
  hold the model, traffic in proportion to capacity;
* **(c) hand split with P/D** inside each generation, sized the way aiconfigurator sizes
  disaggregated workers: workers of the smallest node count that holds the model, prefill
  and decode workers each at their SLO, then the prefill:decode count that maximises
  ``min(0.9 x prefill rate x P, 0.92 x decode rate x D)`` (its rate-matching degradation
  factors), or the aggregated workers when they give more (aiconfigurator picks the
  better of the two).

Every plan is run through :func:`policies.serving.simulate.simulate` (seed 1) to steady
state: a warm-up and a measured window of three request lifetimes each (at least 400 and
3,600 requests; :func:`bench.goodput_setup.sim_options`). **Goodput** is the same
yardstick for all (:func:`bench.goodput_setup.max_goodput`): the most requests/s within
both SLOs at an arrival rate where at least 90% of the requests meet them - the largest
such rate (the edge: bracketed between powers of two, then bisected 8 times) and five
rates 1-5% below it. The planner's own prediction is checked against the
simulation at the load it plans (``predicted`` vs ``simulated``). **USD per million
tokens at equal goodput**: the planner asked for what (b)'s instances serve at the
planner's own margin (:func:`_at_planner_margin`), priced at the GPUs it takes, against
(b)'s GPUs.

``--timing`` measures the planner's wall-clock time on this machine (reported, never
asserted): mixed-64 with five deployments, and a generated fleet of 1,000 GPUs (five
types) with 20 deployments, cold (empty on-disk curve cache) and after a change (one node
lost, one demand raised: warm cache), each with one and two worker processes, and once more
beside two CPU hogs (busy-loop processes); and whether the plans are the same.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Sequence
from concurrent.futures import Executor, ProcessPoolExecutor
from contextlib import nullcontext
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.common import command_line, log, package_versions, run_main, write_results
from bench.goodput_baselines import baseline_one, baseline_split
from bench.goodput_report import report
from bench.goodput_setup import (
    FLEETS,
    HUGE_DEMAND_RPS,
    LENGTHS,
    MODELS,
    SLO,
    attained,
    example_fleet,
    max_goodput,
    spec,
    traffic,
)
from bench.goodput_timing import (
    five_on_mixed_64,
    generated_fleet,
    timing_case,
    twenty_deployments,
)
from policies.errors import InputError
from policies.fleetplan import (
    CurveCache,
    DeploymentPlan,
    FleetDeployment,
    MemoryCurveCache,
    PlannerSettings,
    PlanRequest,
    plan_fleet,
)
from policies.fleetplan.report import serving_plan
from policies.fleetplan.sizing import size_aggregated
from policies.hardware.fleet import Fleet
from policies.serving.plan import DEFAULT_CHUNK_TOKENS, ServingPlan
from policies.serving.traffic import Traffic
from policies.spec.build import DeploymentSpec

__all__ = [
    "SCENARIOS",
    "generated_fleet",
    "goodput_scenario",
    "main",
    "report",
    "run",
    "timing_case",
    "twenty_deployments",
]

# ---------------------------------------------------------------------- scenarios


def _usd_per_mtok(usd_h: float, tokens_per_s: float) -> float | None:
    return round(usd_h / (tokens_per_s * 3600.0) * 1e6, 4) if tokens_per_s > 0 else None


def goodput_scenario(
    fleet_name: str,
    model_key: str,
    lengths: str,
    pool: Executor | None,
    settings: PlannerSettings | None = None,
) -> dict[str, Any]:
    """One scenario: the planner's plan (with ``settings``, the defaults when None) and the
    hand-made ones (a), (b), (c), each through the simulator, and the cost at equal goodput
    (module docstring)."""
    s = settings or PlannerSettings()
    fleet = example_fleet(fleet_name)
    isl, osl = LENGTHS[lengths]
    tr = traffic(isl, osl, HUGE_DEMAND_RPS)
    sp = spec(model_key, MODELS[model_key], tr)
    out: dict[str, Any] = {"fleet": fleet_name, "model": MODELS[model_key], "isl_osl": lengths}
    cache = MemoryCurveCache()
    t0 = time.perf_counter()
    plan = plan_fleet(
        PlanRequest(fleet, (FleetDeployment(sp),), settings=s), cache=cache, pool=pool
    )
    out["plan_s"] = round(time.perf_counter() - t0, 2)
    out["mixfleet"] = _mixfleet(plan.deployments[sp.name], tr)
    a_plan, a_cap, a_usd, a_why = baseline_one(fleet, sp)
    out["a_one_instance"] = {
        "usd_per_hour": round(a_usd, 2),
        "why_not": a_why[:160],
        "sim": max_goodput(a_plan, tr, a_cap),
    }
    b_planned = 0.0
    for key, pd in (("b_hand_split", False), ("c_hand_split_pd", True)):
        b_plan, b_cap, b_usd, notes = baseline_split(fleet, sp, pd=pd)
        if not pd:
            b_planned = _at_planner_margin(b_plan, tr, s)
        out[key] = {
            "usd_per_hour": round(b_usd, 2),
            "planned_rps": round(b_cap, 4),
            "notes": notes,
            "sim": max_goodput(b_plan, tr, b_cap),
        }
    # Cost at equal goodput: the planner asked for what (b)'s instances serve at the
    # planner's own margin, both priced at the GPUs they take.
    b_cap = b_planned  # unrounded: a rounded-up demand would ask for one more instance
    if b_cap > 0:
        b_usd_h = out["b_hand_split"]["usd_per_hour"]
        out["equal_goodput"] = _equal_goodput(fleet, sp, b_cap, osl, b_usd_h, cache, s)
    g = out["mixfleet"]["sim"]["goodput_rps"]
    out["ratios"] = {
        k: (
            round(g / out[k]["sim"]["goodput_rps"], 3) if out[k]["sim"]["goodput_rps"] > 0 else None
        )
        for k in ("a_one_instance", "b_hand_split", "c_hand_split_pd")
    }
    return out


def _mixfleet(dp: DeploymentPlan, tr: Traffic) -> dict[str, Any]:
    """The planner's plan for one deployment: its pools, price, the prediction checked
    against the simulator at the planned load, and the simulated goodput."""
    sp_plan = serving_plan(dp, DEFAULT_CHUNK_TOKENS)
    return {
        "pools": [
            {
                "name": p.name,
                "instances": [
                    {
                        "role": g.variant.role,
                        "count": g.count,
                        "nodes": [list(n) for n in g.nodes],
                        "batch": g.batch_limit,
                    }
                    for g in p.groups()
                ],
            }
            for p in dp.pools
        ],
        "usd_per_hour": round(dp.usd_per_hour, 2),
        "gpus": dp.gpus,
        "prediction_check": _prediction_check(dp, sp_plan, tr),
        "sim": max_goodput(sp_plan, tr, dp.served_requests_per_s),
    }


def _prediction_check(
    dp: DeploymentPlan, sp_plan: ServingPlan | None, tr: Traffic
) -> dict[str, Any]:
    """The planner's predicted rate and latencies against the simulator's at the load it
    plans (``error``: simulated goodput / predicted rate - 1)."""
    at_load: dict[str, Any] = {"predicted_rps": round(dp.served_requests_per_s, 4)}
    if sp_plan is not None:
        _, good, rep = attained(sp_plan, tr, dp.served_requests_per_s)
        at_load.update(
            simulated_goodput_rps=round(good, 4),
            simulated_ttft_p90_ms=round(rep.ttft_ms.p90, 1),
            simulated_tpot_p90_ms=round(rep.tpot_ms.p90, 2),
            predicted_ttft_ms=round(dp.ttft_ms, 1),
            predicted_tpot_ms=round(dp.tpot_ms, 2),
            error=round(good / dp.served_requests_per_s - 1.0, 4)
            if dp.served_requests_per_s
            else None,
        )
    return at_load


def _at_planner_margin(plan: ServingPlan | None, tr: Traffic, s: PlannerSettings) -> float:
    """What the aggregated instances of ``plan`` serve at the planner's own margin,
    requests/s: each one's capacity as the planner sizes it (``PlannerSettings``'s
    utilisation of its capacity at the SLO). (b) itself is planned at 85% of each
    instance's rate at its batch limit, closer to the SLO for small batches: asking the
    planner for that rate would compare two plans at different margins."""
    if plan is None:
        return 0.0
    total = 0.0
    for p in plan.pools:
        g = p.instances
        if g is not None:
            sz = size_aggregated(
                g.curve,
                tr,
                SLO,
                chunk_tokens=g.chunk_tokens,
                utilisation=s.utilisation,
                queueing=s.queueing,
            )
            total += g.count * sz.requests_per_s
    return total


def _equal_goodput(
    fleet: Fleet,
    sp: DeploymentSpec,
    b_cap: float,
    osl: int,
    b_usd_h: float,
    cache: CurveCache,
    settings: PlannerSettings,
) -> dict[str, Any]:
    """USD per million output tokens at ``b_cap``, what (b)'s instances serve at the
    planner's margin (requests/s; ``osl``
    output tokens each): the planner asked for that demand against (b)'s ``b_usd_h``
    (USD/h)."""
    assert sp.traffic is not None
    tr = sp.traffic
    eq = plan_fleet(
        PlanRequest(
            fleet,
            (FleetDeployment(replace(sp, traffic=replace(tr, requests_per_s=b_cap))),),
            settings=settings,
        ),
        cache=cache,
    )
    edp = eq.deployments[sp.name]
    tokens = b_cap * osl
    return {
        "goodput_rps": round(b_cap, 4),
        "mixfleet_served_rps": round(edp.served_requests_per_s, 4),
        "mixfleet_usd_per_hour": round(edp.usd_per_hour, 2),
        "mixfleet_usd_per_mtok": _usd_per_mtok(edp.usd_per_hour, tokens),
        "b_usd_per_mtok": _usd_per_mtok(b_usd_h, tokens),
    }


# ---------------------------------------------------------------------- runner


SCENARIOS = [f"{m}-{f}-{ln}" for f in FLEETS for m in MODELS for ln in LENGTHS]


def run(args: argparse.Namespace) -> int:
    if args.report:
        print(report(json.loads(Path(args.report).read_text())))
        return 0
    if args.scenario == "all":
        names = SCENARIOS
    elif args.scenario == "none":
        names = []
    else:
        names = args.scenario.split(",")
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise InputError(
            f"unknown scenario {unknown[0]!r}; known: all, none, {', '.join(SCENARIOS)}",
            field="--scenario",
        )
    results: dict[str, Any] = {}
    settings = PlannerSettings(queueing=not args.no_queueing)
    workers = args.workers if args.workers > 0 else os.cpu_count() or 1
    with ProcessPoolExecutor(workers) if workers > 1 else nullcontext() as pool:
        for name in names:
            m, rest = name.split("-", 1)
            ln = "-".join(rest.split("-")[-2:])
            f = rest[: -len(ln) - 1]
            log(f"scenario {name}")
            t0 = time.perf_counter()
            results[name] = goodput_scenario(f, m, ln, pool, settings)
            results[name]["wall_s"] = round(time.perf_counter() - t0, 1)
    timing: dict[str, Any] = {}
    if args.timing:
        log("timing mixed-64, five deployments")
        timing["mixed-64-five"] = timing_case(
            "mixed-64", example_fleet("mixed-64"), five_on_mixed_64()
        )
        log("timing generated 1,000 GPUs, 20 deployments")
        timing["generated-1000-twenty"] = timing_case(
            "generated-1000", generated_fleet(), twenty_deployments()
        )
    doc = {
        "command": command_line("bench.goodput", args, with_json=True)
        + (" --timing" if args.timing else "")
        + (" --no-queueing" if args.no_queueing else ""),
        "planner": {"queueing": settings.queueing, "utilisation": settings.utilisation},
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"cpu_count": os.cpu_count(), "python": platform.python_version()},
        "workers": workers,
        "versions": package_versions(["pulp", "highspy"]),
        "slo": {"ttft_ms": SLO.ttft_ms, "tpot_ms": SLO.tpot_ms, "percentile": SLO.percentile},
        "scenarios": results,
        "timing": timing,
    }
    write_results(doc, args)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.goodput",
        description="fleet planner goodput benchmark",
        allow_abbrev=False,
    )
    p.add_argument("--scenario", default="all", metavar="NAME[,NAME]|all|none", help="default: all")
    p.add_argument("--json", action="store_true", help="print results as JSON")
    p.add_argument("--out", metavar="PATH", help="results JSON file")
    p.add_argument("--report", metavar="PATH", help="print a results file as Markdown tables")
    p.add_argument(
        "--timing", action="store_true", help="also time the planner (mixed-64, 1,000 GPUs)"
    )
    p.add_argument(
        "--no-queueing",
        action="store_true",
        help="plan at a flat share of each instance's rate (PlannerSettings.queueing=False)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=2,
        metavar="N",
        help="processes for cold curves (default: %(default)s)",
    )
    return run_main(p, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
