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

Every plan is run through :func:`policies.serving.simulate.simulate` (4,000 requests, 400
of them warm-up, seed 1). **Goodput** is the same yardstick for all: the largest arrival
rate (bisection, 8 steps) at which at least 90% of the requests meet both SLOs, and the
rate of requests within the SLOs there. The planner's own prediction is checked against the
simulation at the load it plans (``predicted`` vs ``simulated``). **USD per million
tokens at equal goodput**: the planner asked for (b)'s goodput, priced at the GPUs it takes,
against (b)'s GPUs.

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
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import Executor, ProcessPoolExecutor
from contextlib import nullcontext
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from bench.common import command_line, log, package_versions, run_main
from controlplane.curvecache import FileCurveCache
from policies.cost import fleet_usd_per_hour
from policies.deployment import sub_fleet
from policies.engines import EngineSpec
from policies.errors import InputError
from policies.fleet import Fleet, parse_fleet
from policies.fleetplan import (
    FleetDeployment,
    MemoryCurveCache,
    PlanRequest,
    compute_curve,
    kv_path,
    plan_fleet,
)
from policies.fleetplan.report import plan_doc, serving_plan
from policies.fleetplan.sizing import size_aggregated, size_pair
from policies.scheduling.table import fleet_groups
from policies.serving.plan import DEFAULT_CHUNK_TOKENS, InstanceGroup, KvPath, Pool, ServingPlan
from policies.serving.simulate import SimOptions, simulate
from policies.serving.traffic import LengthDist, Slo, Traffic
from policies.spec import DeploymentSpec, WorkloadSpec, price_table

MODELS = {"dsv3": "deepseek-v3", "qwen235b": "qwen3-235b-a22b"}
FLEETS = ("hopper-blackwell-24", "mixed-24", "mixed-64", "ada-hopper", "homog-32")
LENGTHS = {"4096-512": (4096, 512), "1024-1024": (1024, 1024)}
SLO = Slo(ttft_ms=2000.0, tpot_ms=50.0, percentile=90.0)
HUGE_DEMAND_RPS = 10_000.0
SIM = SimOptions(requests=4000, seed=1, warmup_requests=400)
AIC_PREFILL, AIC_DECODE = 0.9, 0.92  # aiconfigurator's rate-matching degradation factors
ROOT = Path(__file__).resolve().parent.parent


def _fleet(name: str) -> Fleet:
    return parse_fleet(yaml.safe_load((ROOT / "examples" / "fleets" / f"{name}.yaml").read_text()))


def traffic(isl: int, osl: int, rps: float) -> Traffic:
    """Poisson traffic with lognormal lengths (p90 = 1.25 x mean)."""
    return Traffic(rps, LengthDist(isl, isl * 1.25), LengthDist(osl, osl * 1.25))


def spec(name: str, model: str, tr: Traffic, slo: Slo = SLO, priority: int = 0) -> DeploymentSpec:
    return DeploymentSpec(
        name,
        model=model,
        workload=WorkloadSpec(kv_cache_dtype="fp8"),
        engine=EngineSpec(name="vllm" if model.startswith("mixtral") else "sglang"),
        priority=priority,
        traffic=tr,
        slo=slo,
    )


# ---------------------------------------------------------------------- simulation


def _attained(plan: ServingPlan, tr: Traffic, rate: float) -> tuple[bool, float, Any]:
    rep = simulate(plan, replace(tr, requests_per_s=rate), SLO, SIM)
    return rep.attainment >= SLO.percentile / 100.0, rep.goodput_rps, rep


def max_goodput(plan: ServingPlan | None, tr: Traffic, guess_rps: float) -> dict[str, Any]:
    """The simulated goodput yardstick: the largest rate with >= 90% of requests within the
    SLOs (bisection from ``guess_rps``), and the goodput there."""
    if plan is None or guess_rps <= 0:
        return {"rate_rps": 0.0, "goodput_rps": 0.0, "goodput_tokens_per_s": 0.0}
    lo, hi = 0.0, guess_rps * 1.5
    ok, good, _ = _attained(plan, tr, hi)
    while ok:
        lo, hi = hi, hi * 1.5
        ok, good, _ = _attained(plan, tr, hi)
    best = 0.0
    for _ in range(8):
        mid = (lo + hi) / 2
        ok, good, _ = _attained(plan, tr, mid)
        if ok:
            lo, best = mid, good
        else:
            hi = mid
    if best == 0.0 and lo > 0:
        _, best, _ = _attained(plan, tr, lo)
    return {
        "rate_rps": round(lo, 4),
        "goodput_rps": round(best, 4),
        "goodput_tokens_per_s": round(best * tr.output_len.mean, 1),
    }


# ---------------------------------------------------------------------- baselines


def _group(curve: Any, count: int, batch: int, usd: float, chunk: int, label: str) -> InstanceGroup:
    return InstanceGroup(count, curve, batch, chunk, usd, label)


def baseline_one(fleet: Fleet, sp: DeploymentSpec) -> tuple[ServingPlan | None, float, float, str]:
    """(a) one aggregated instance over every GPU: ``(plan, capacity rps, USD/h, why not)``."""
    assert sp.traffic is not None
    entry = compute_curve(sp, fleet)
    usd = fleet_usd_per_hour(fleet, price_table(sp))
    if entry.curve is None:
        return None, 0.0, usd, entry.reason
    sz = size_aggregated(entry.curve, sp.traffic, SLO)
    if not sz.ok:
        return None, 0.0, usd, sz.reason
    g = _group(entry.curve, 1, sz.batch_limit, usd, DEFAULT_CHUNK_TOKENS, "whole fleet")
    return ServingPlan((Pool("all", 1.0, instances=g),)), sz.requests_per_s, usd, ""


def baseline_split(
    fleet: Fleet, sp: DeploymentSpec, *, pd: bool
) -> tuple[ServingPlan | None, float, float, list[str]]:
    """(b) (``pd`` False) or (c) (``pd`` True): ``(plan, capacity rps, USD/h, notes)``."""
    assert sp.traffic is not None
    tr = sp.traffic
    pools: list[Pool] = []
    total = usd_total = 0.0
    notes: list[str] = []
    for g in fleet_groups(fleet):
        if not pd:
            part = sub_fleet(fleet, g.nodes)
            entry = compute_curve(sp, part)
            if entry.curve is None:
                notes.append(f"{g.label}: {entry.reason[:80]}")
                continue
            sz = size_aggregated(entry.curve, tr, SLO)
            if not sz.ok:
                notes.append(f"{g.label}: {sz.reason}")
                continue
            usd = fleet_usd_per_hour(part, price_table(sp))
            grp = _group(entry.curve, 1, sz.batch_limit, usd, DEFAULT_CHUNK_TOKENS, g.label)
            pools.append(Pool(g.label, sz.requests_per_s, instances=grp))
            total += sz.requests_per_s
            usd_total += usd
            continue
        # (c): workers of the smallest node count that holds the model.
        worker = None
        for k in (1, 2, 4, 8):
            if k > len(g.nodes):
                break
            part = sub_fleet(fleet, g.nodes[:k])
            entry = compute_curve(sp, part)
            if entry.curve is not None:
                worker = (k, part, entry.curve)
                break
        if worker is None:
            notes.append(f"{g.label}: no worker holds the model")
            continue
        k, part, curve = worker
        m = len(g.nodes) // k
        usd = fleet_usd_per_hour(part, price_table(sp))
        agg = size_aggregated(curve, tr, SLO, utilisation=1.0)
        best_rate = m * agg.requests_per_s if agg.ok else 0.0
        best_pool: Pool | None = None
        if agg.ok:
            grp = _group(curve, m, agg.batch_limit, usd, DEFAULT_CHUNK_TOKENS, g.label)
            best_pool = Pool(f"{g.label} agg", best_rate, instances=grp)
        node = fleet.node(g.nodes[0])
        path = kv_path(node, fleet.node(g.nodes[-1]), fleet) if m >= 2 else None
        if path is not None:
            nic = node.rdma_per_direction_gbits_per_s / 8.0 * k * 0.85
            pair = size_pair(
                curve,
                curve,
                tr,
                SLO,
                kv_gbytes_per_s=path[0],
                kv_latency_us=path[1],
                prefill_nic_gbytes_per_s=nic,
                decode_nic_gbytes_per_s=nic,
                utilisation=1.0,
            )
            if pair.prefill.ok and pair.decode.ok:
                for n_p in range(1, m):
                    n_d = m - n_p
                    rate = min(
                        AIC_PREFILL * n_p * pair.prefill.requests_per_s,
                        AIC_DECODE * n_d * pair.decode.requests_per_s,
                    )
                    if rate > best_rate:
                        best_rate = rate
                        best_pool = Pool(
                            f"{g.label} P{n_p}D{n_d}",
                            rate,
                            prefill=_group(curve, n_p, 0, usd, pair.prefill.batch_limit, g.label),
                            decode=_group(curve, n_d, pair.decode.batch_limit, usd, 1, g.label),
                            kv_path=KvPath(path[0], path[1]),
                        )
        if best_pool is None:
            notes.append(f"{g.label}: no worker meets the SLO")
            continue
        pools.append(best_pool)
        total += best_rate
        usd_total += m * usd
        notes.append(best_pool.name)
    plan = ServingPlan(tuple(pools)) if pools else None
    return plan, total, usd_total, notes


# ---------------------------------------------------------------------- scenarios


def _usd_per_mtok(usd_h: float, tokens_per_s: float) -> float | None:
    return round(usd_h / (tokens_per_s * 3600.0) * 1e6, 4) if tokens_per_s > 0 else None


def goodput_scenario(
    fleet_name: str, model_key: str, lengths: str, pool: Executor | None
) -> dict[str, Any]:
    fleet = _fleet(fleet_name)
    isl, osl = LENGTHS[lengths]
    tr = traffic(isl, osl, HUGE_DEMAND_RPS)
    sp = spec(model_key, MODELS[model_key], tr)
    out: dict[str, Any] = {"fleet": fleet_name, "model": MODELS[model_key], "isl_osl": lengths}
    cache = MemoryCurveCache()
    t0 = time.perf_counter()
    plan = plan_fleet(PlanRequest(fleet, (FleetDeployment(sp),)), cache=cache, pool=pool)
    out["plan_s"] = round(time.perf_counter() - t0, 2)
    dp = plan.deployments[sp.name]
    sp_plan = serving_plan(dp, DEFAULT_CHUNK_TOKENS)
    at_load: dict[str, Any] = {"predicted_rps": round(dp.served_requests_per_s, 4)}
    if sp_plan is not None:
        _, good, rep = _attained(sp_plan, tr, dp.served_requests_per_s)
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
    mix = {
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
        "prediction_check": at_load,
        "sim": max_goodput(sp_plan, tr, dp.served_requests_per_s),
    }
    out["mixfleet"] = mix
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
            b_planned = b_cap
        out[key] = {
            "usd_per_hour": round(b_usd, 2),
            "planned_rps": round(b_cap, 4),
            "notes": notes,
            "sim": max_goodput(b_plan, tr, b_cap),
        }
    # Cost at equal goodput: the planner asked for what (b) is planned to serve (its
    # capacity at the same utilisation), both priced at the GPUs they take.
    b_cap = b_planned  # unrounded: a rounded-up demand would ask for one more instance
    if b_cap > 0:
        eq = plan_fleet(
            PlanRequest(
                fleet, (FleetDeployment(replace(sp, traffic=replace(tr, requests_per_s=b_cap))),)
            ),
            cache=cache,
        )
        edp = eq.deployments[sp.name]
        tokens = b_cap * osl
        out["equal_goodput"] = {
            "goodput_rps": round(b_cap, 4),
            "mixfleet_served_rps": round(edp.served_requests_per_s, 4),
            "mixfleet_usd_per_hour": round(edp.usd_per_hour, 2),
            "mixfleet_usd_per_mtok": _usd_per_mtok(edp.usd_per_hour, tokens),
            "b_usd_per_mtok": _usd_per_mtok(out["b_hand_split"]["usd_per_hour"], tokens),
        }
    g = out["mixfleet"]["sim"]["goodput_rps"]
    out["ratios"] = {
        k: (
            round(g / out[k]["sim"]["goodput_rps"], 3) if out[k]["sim"]["goodput_rps"] > 0 else None
        )
        for k in ("a_one_instance", "b_hand_split", "c_hand_split_pd")
    }
    return out


# ---------------------------------------------------------------------- timing


def generated_fleet(nodes_per_type: int = 25) -> Fleet:
    """1,000 GPUs: 25 nodes of 8 of each of five types (H100, H200, B200, A100-80GB on one
    InfiniBand fabric; L40S PCIe nodes on a RoCE fabric joined to it by one link)."""
    types = [
        ("h100", "H100-SXM5-80GB", 900, "ib0"),
        ("h200", "H200-SXM-141GB", 900, "ib0"),
        ("b200", "B200", 1800, "ib0"),
        ("a100", "A100-SXM4-80GB", 600, "ib0"),
        ("l40s", "L40S", 0, "roce0"),
    ]
    nodes = []
    for prefix, model, nvl, fabric in types:
        for i in range(nodes_per_type):
            doc: dict[str, Any] = {
                "name": f"{prefix}-{i}",
                "gpus": [{"model": model, "count": 8}],
                "nics": [
                    {
                        "count": 8 if fabric == "ib0" else 2,
                        "per_direction_gbits_per_s": 400 if fabric == "ib0" else 200,
                        "fabric": fabric,
                    }
                ],
            }
            if nvl:
                doc["nvlink"] = {"domain": f"{prefix}-{i}", "per_gpu_bidir_gbytes_per_s": nvl}
            nodes.append(doc)
    doc = {
        "apiVersion": "mixfleet.io/v1alpha1",
        "kind": "Fleet",
        "metadata": {"name": "generated-1000"},
        "spec": {
            "nodes": nodes,
            "fabric_links": [{"between": ["ib0", "roce0"], "per_direction_gbits_per_s": 3200}],
        },
    }
    return parse_fleet(doc)


def twenty_deployments() -> tuple[FleetDeployment, ...]:
    """Six models, interactive and batch tiers as separate deployments, priorities 1-10."""
    models = [
        "deepseek-v3",
        "qwen3-235b-a22b",
        "gpt-oss-120b",
        "llama-3.1-70b",
        "qwen3-30b-a3b",
        "mixtral-8x7b",
    ]
    out = []
    for i in range(20):
        model = models[i % len(models)]
        interactive = i % 2 == 0
        isl, osl = (1024, 512) if interactive else (4096, 1024)
        slo = Slo(1000.0, 40.0, 90.0) if interactive else Slo(5000.0, 100.0, 90.0)
        rps = 20.0 + (i % 5) * 10.0
        out.append(
            FleetDeployment(
                spec(
                    f"d{i:02d}-{model.split('-')[0]}",
                    model,
                    traffic(isl, osl, rps),
                    slo,
                    priority=10 - i // 2,
                )
            )
        )
    return tuple(out)


def five_on_mixed_64() -> tuple[FleetDeployment, ...]:
    rows = [
        ("deepseek-v3", "deepseek-v3", 10, 8.0, 4096, 512),
        ("qwen3-235b", "qwen3-235b-a22b", 8, 10.0, 1024, 1024),
        ("gpt-oss-120b", "gpt-oss-120b", 6, 20.0, 1024, 512),
        ("mixtral", "mixtral-8x7b", 4, 20.0, 1024, 512),
        ("qwen3-30b", "qwen3-30b-a3b", 2, 30.0, 1024, 512),
    ]
    return tuple(
        FleetDeployment(spec(n, m, traffic(i, o, r), priority=p)) for n, m, p, r, i, o in rows
    )


def _timed(req: PlanRequest, cache_dir: Path, workers: int) -> tuple[float, dict[str, Any], Any]:
    cache = FileCurveCache(cache_dir)
    with ProcessPoolExecutor(workers) if workers > 1 else nullcontext() as pool:
        t0 = time.perf_counter()
        plan = plan_fleet(req, cache=cache, pool=pool)
        wall = time.perf_counter() - t0
    return wall, plan_doc(plan, DEFAULT_CHUNK_TOKENS), plan


def timing_case(name: str, fleet: Fleet, deps: tuple[FleetDeployment, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {"gpus": len(fleet.gpus), "deployments": len(deps)}
    docs = {}
    for workers in (2, 1):
        with tempfile.TemporaryDirectory() as tmp:
            cold_s, doc, plan = _timed(PlanRequest(fleet, deps), Path(tmp), workers)
            lost = fleet.nodes[0].name
            smaller = Fleet(
                fleet.name, tuple(n for n in fleet.nodes if n.name != lost), fleet.fabric_links
            )
            first = deps[0]
            assert first.spec.traffic is not None
            raised = replace(
                first.spec,
                traffic=replace(
                    first.spec.traffic, requests_per_s=first.spec.traffic.requests_per_s * 1.2
                ),
            )
            changed = (FleetDeployment(raised), *deps[1:])
            warm_s, warm_doc, warm = _timed(
                PlanRequest(smaller, changed, previous=plan), Path(tmp), workers
            )
        docs[workers] = (doc, warm_doc)
        out[f"workers_{workers}"] = {
            "cold_s": round(cold_s, 2),
            "curves_computed": plan.curves_computed,
            "warm_after_change_s": round(warm_s, 2),
            "warm_curves_computed": warm.curves_computed,
            "solver": plan.solver,
            "program_s": round(plan.solve_s, 3),
            "warm_program_s": round(warm.solve_s, 3),
        }
        log(f"  {name} workers={workers}: cold {cold_s:.1f} s, warm {warm_s:.1f} s")
    out["same_plan_1_and_2_workers"] = docs[1] == docs[2]
    # Beside two CPU hogs (busy loops on this machine's cores): the work limits, not the
    # clock, end the solves, so the plan is the same.
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            hog_s, hog_doc, _ = _timed(PlanRequest(fleet, deps), Path(tmp), 2)
    finally:
        for h in hogs:
            h.terminate()
            h.wait()
    out["beside_two_cpu_hogs"] = {"cold_s": round(hog_s, 2), "same_plan": hog_doc == docs[2][0]}
    log(f"  {name} beside two CPU hogs: cold {hog_s:.1f} s, same plan {hog_doc == docs[2][0]}")
    doc = docs[2][0]
    out["goodput_output_tokens_per_s"] = doc["goodputOutputTokensPerS"]
    out["usd_per_hour"] = doc["usdPerHour"]
    out["shortfalls"] = len(doc["shortfalls"])
    return out


# ---------------------------------------------------------------------- report


def _fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def report(doc: dict[str, Any]) -> str:
    """The results as the Markdown tables of docs/goodput.md."""
    lines = [
        "| scenario | mixfleet goodput req/s (tok/s) | vs (a) one instance | vs (b) hand split "
        "| vs (c) hand split P/D | predicted vs simulated at the planned load | USD/Mtok at "
        "(b)'s goodput: mixfleet / (b) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in doc["scenarios"].items():
        m = r["mixfleet"]
        chk = m["prediction_check"]
        eq = r.get("equal_goodput") or {}
        ratio = r["ratios"]
        usd = (
            f"{_fmt(eq.get('mixfleet_usd_per_mtok'), 3)} / {_fmt(eq.get('b_usd_per_mtok'), 3)}"
            if eq
            else "-"
        )
        if eq and eq.get("mixfleet_usd_per_mtok") and eq.get("b_usd_per_mtok"):
            usd += f" ({eq['mixfleet_usd_per_mtok'] / eq['b_usd_per_mtok']:.2f}x)"
        err = chk.get("error")
        lines.append(
            f"| {name} | {_fmt(m['sim']['goodput_rps'])} ({m['sim']['goodput_tokens_per_s']:,.0f}) "
            f"| {_fmt(ratio['a_one_instance'])}x | {_fmt(ratio['b_hand_split'])}x "
            f"| {_fmt(ratio['c_hand_split_pd'])}x "
            f"| {_fmt(chk.get('predicted_rps'))} / {_fmt(chk.get('simulated_goodput_rps'))} "
            f"({'-' if err is None else f'{err * 100:+.1f}%'}) | {usd} |"
        )
    lines.append("")
    lines.append("| scenario | mixfleet pools | (b) hand split | (c) hand split P/D | (a) |")
    lines.append("|---|---|---|---|---|")
    for name, r in doc["scenarios"].items():
        pools = "; ".join(
            " + ".join(
                f"{g['count']}x {g['role']} on {'+'.join(n for inst in g['nodes'][:1] for n in inst)}"
                for g in p["instances"]
            )
            for p in r["mixfleet"]["pools"]
        )
        lines.append(
            f"| {name} | {pools or 'none'} ({r['mixfleet']['gpus']} GPUs, "
            f"{r['mixfleet']['usd_per_hour']:.1f} USD/h) "
            f"| {_fmt(r['b_hand_split']['sim']['goodput_rps'])} req/s "
            f"| {_fmt(r['c_hand_split_pd']['sim']['goodput_rps'])} req/s "
            f"({'; '.join(r['c_hand_split_pd']['notes'])[:80]}) "
            f"| {_fmt(r['a_one_instance']['sim']['goodput_rps'])} req/s |"
        )
    for name, t in doc.get("timing", {}).items():
        lines.append("")
        hog = t.get("beside_two_cpu_hogs", {})
        lines.append(
            f"{name}: {t['gpus']} GPUs, {t['deployments']} deployments; same plan with 1 and "
            f"2 workers: {t['same_plan_1_and_2_workers']}; beside two CPU hogs: "
            f"{hog.get('same_plan')} ({hog.get('cold_s')} s cold)"
        )
        for w in ("workers_2", "workers_1"):
            x = t[w]
            lines.append(
                f"- {w.replace('_', ' ')}: cold {x['cold_s']} s ({x['curves_computed']} curves, "
                f"program {x['program_s']} s, {x['solver']}); after a change {x['warm_after_change_s']} s "
                f"({x['warm_curves_computed']} curves, program {x['warm_program_s']} s)"
            )
    return "\n".join(lines)


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
    workers = args.workers if args.workers > 0 else os.cpu_count() or 1
    with ProcessPoolExecutor(workers) if workers > 1 else nullcontext() as pool:
        for name in names:
            m, rest = name.split("-", 1)
            ln = "-".join(rest.split("-")[-2:])
            f = rest[: -len(ln) - 1]
            log(f"scenario {name}")
            t0 = time.perf_counter()
            results[name] = goodput_scenario(f, m, ln, pool)
            results[name]["wall_s"] = round(time.perf_counter() - t0, 1)
    timing: dict[str, Any] = {}
    if args.timing:
        log("timing mixed-64, five deployments")
        timing["mixed-64-five"] = timing_case("mixed-64", _fleet("mixed-64"), five_on_mixed_64())
        log("timing generated 1,000 GPUs, 20 deployments")
        timing["generated-1000-twenty"] = timing_case(
            "generated-1000", generated_fleet(), twenty_deployments()
        )
    doc = {
        "command": command_line("bench.goodput", args, with_json=True)
        + (" --timing" if args.timing else ""),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"cpu_count": os.cpu_count(), "python": platform.python_version()},
        "workers": workers,
        "versions": package_versions(["pulp", "highspy"]),
        "slo": {"ttft_ms": SLO.ttft_ms, "tpot_ms": SLO.tpot_ms, "percentile": SLO.percentile},
        "scenarios": results,
        "timing": timing,
    }
    text = json.dumps(doc, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.json or not args.out:
        print(text)
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
        "--workers",
        type=int,
        default=2,
        metavar="N",
        help="processes for cold curves (default: %(default)s)",
    )
    return run_main(p, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
