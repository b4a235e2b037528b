"""The deployment-strategy benchmark's scenarios (issue 6): tiers, batch sizing, long
context, cost, vendors.

Each scenario function solves its question on the fleets of ``examples/fleets/`` through the
pure planners (:mod:`policies.advice.tiers`, :mod:`policies.advice.advise`, :mod:`policies.advice.cost`,
:mod:`policies.hardware.vendors`) and returns a JSON-ready record: the ``mixfleetctl`` commands that
reproduce it, its headline figures and checks of the property it demonstrates.
:data:`SCENARIOS` lists them in report order; :mod:`bench.strategies` runs them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from controlplane.cli.files import read_fleet
from controlplane.cli.reports import (
    batch_document,
    context_document,
    min_cost_document,
    tiers_document,
)
from policies.advice.advise import advise_batch, advise_context
from policies.advice.cost import PriceTable, min_cost, plan_cost
from policies.advice.tier_planner import plan_tiers
from policies.advice.tiers import BatchTier, InteractiveTier, TierRequest
from policies.deployment import Deployment, try_solve
from policies.errors import InputError
from policies.estimate.workload import synthetic_zipf
from policies.hardware.vendors import check_vendors, split_by_vendor
from policies.model.architecture import preset
from policies.request import SolverOptions

REPO = Path(__file__).resolve().parent.parent
FLEETS = REPO / "examples" / "fleets"
MODEL = "qwen3-30b-a3b"
LOAD = "synthetic:zipf:0.5:seed=1"
OPTIONS = SolverOptions(time_limit_s=10.0)

Log = Callable[[str], None]


def _deployment(fleet_file: str, policy: str = "ilp", **kw: Any) -> Deployment:
    model = preset(MODEL)
    rows = synthetic_zipf(model, LOAD)
    return Deployment(
        fleet=read_fleet(FLEETS / fleet_file),
        model=model,
        load=tuple(tuple(r) for r in rows),
        load_source=LOAD,
        policy=policy,
        options=OPTIONS,
        **kw,
    )


def _check(what: str, ok: bool, value: Any) -> dict[str, Any]:
    return {"check": what, "value": value, "met": bool(ok)}


# --------------------------------------------------------------------------- scenarios


def tiers_scenario(log: Log) -> dict[str, Any]:
    """Interactive (TPOT 25 ms, TTFT 1 s) and batch tiers on mixed-24, three rates."""
    dep = _deployment("mixed-24.yaml")
    slo = InteractiveTier(
        tpot_ms=25.0, ttft_ms=1000.0, prompt_tokens=2048, output_tokens=256, max_utilisation=0.8
    )
    runs: list[dict[str, Any]] = []
    for rate, preference in (
        (150.0, "fastest"),
        (30.0, "fastest"),
        (30.0, "max-batch"),
        (400.0, "fastest"),
    ):
        t0 = time.perf_counter()
        tp = plan_tiers(
            TierRequest(
                dep,
                replace(slo, requests_per_s=rate),
                BatchTier(tokens_per_gpu=128, context_len=4096),
                preference=preference,
                additions=("H200-SXM-141GB", "B200", "MI300X"),
                prices=PriceTable(),
            )
        )
        wall = time.perf_counter() - t0
        doc = tiers_document(tp)
        doc["rate_requests_per_s"] = rate
        doc["wall_s"] = round(wall, 2)
        runs.append(doc)
        i = tp.interactive
        log(
            f"  rate {rate:g} {preference}: interactive {','.join(i.nodes)} "
            f"{i.capacity_requests_per_s:.1f} req/s slo {'met' if i.slo_met else 'NOT met'}; "
            f"batch {tp.batch.tokens_per_s:,.0f} tok/s ({wall:.1f} s)"
        )
    fastest_30, max_batch_30 = runs[1], runs[2]
    checks = [
        _check(
            "rate 150: SLO met, every replica within TPOT 25 ms",
            runs[0]["interactive"]["slo_met"]
            and all(r["tpot_ms"] <= 25.0 for r in runs[0]["interactive"]["replicas"]),
            runs[0]["interactive"]["tpot_ms"],
        ),
        _check(
            "max-batch batch tokens/s >= fastest batch tokens/s (rate 30)",
            max_batch_30["batch"]["tokens_per_s"] >= fastest_30["batch"]["tokens_per_s"],
            [fastest_30["batch"]["tokens_per_s"], max_batch_30["batch"]["tokens_per_s"]],
        ),
        _check(
            "rate 400: SLO reported unmet with additions",
            not runs[3]["interactive"]["slo_met"] and bool(runs[3]["interactive"]["additions"]),
            [f"{a['nodes']}x8 {a['gpu_model']}" for a in runs[3]["interactive"]["additions"]],
        ),
    ]
    return {
        "scenario": "tiers",
        "description": (
            f"{MODEL} on mixed-24 (8x A100 + 8x H100 + 8x H200 nodes): interactive tier TPOT "
            "25 ms, TTFT 1000 ms, 2048-token prompts, 256 output tokens, 80% utilisation cap; "
            "batch tier decode at 128 tokens/GPU, context 4096"
        ),
        "commands": [
            "mixfleetctl advise tiers --fleet examples/fleets/mixed-24.yaml --model "
            f"{MODEL} --load {LOAD} --tpot-ms 25 --ttft-ms 1000 --rate 150 --tokens 128 "
            "--additions H200-SXM-141GB,B200,MI300X --time-limit 10",
            "... --rate 30 --preference max-batch",
        ],
        "runs": runs,
        "checks": checks,
    }


def batch_scenario(log: Log) -> dict[str, Any]:
    """Largest decode batch meeting TPOT 50 ms on mixed-24, greedy and ilp."""
    out: dict[str, Any] = {}
    for policy in ("greedy", "ilp"):
        t0 = time.perf_counter()
        advice = advise_batch(_deployment("mixed-24.yaml", policy=policy), 50.0)
        doc = batch_document(advice)
        doc["wall_s"] = round(time.perf_counter() - t0, 2)
        out[policy] = doc
        log(
            f"  {policy}: largest {advice.largest_tokens_per_gpu} tokens/GPU, "
            f"{advice.best.tokens_per_s if advice.best else 0:,.0f} tok/s ({doc['wall_s']} s)"
        )
    png = REPO / "docs" / "strategies-batch.png"
    from controlplane.cli.plots import render_batch_curve

    render_batch_curve(
        advise_batch(_deployment("mixed-24.yaml", policy="greedy"), 50.0),
        png,
        title=f"{MODEL} on mixed-24, TPOT <= 50 ms (greedy)",
    )
    g, i = out["greedy"], out["ilp"]
    checks = [
        _check(
            "largest batch meets TPOT 50 ms (greedy, ilp)",
            all(x["best"] and x["best"]["step_time_ms"] <= 50.0 for x in (g, i)),
            [x["best"] and x["best"]["step_time_ms"] for x in (g, i)],
        ),
        _check(
            "ilp sustains at least greedy's batch within the target",
            (i["largest_tokens_per_gpu"] or 0) >= (g["largest_tokens_per_gpu"] or 0),
            [g["largest_tokens_per_gpu"], i["largest_tokens_per_gpu"]],
        ),
    ]
    return {
        "scenario": "batch-sizing",
        "description": (
            f"{MODEL} decode on mixed-24, context 4096, TPOT target 50 ms: start at what the "
            "GPU with the least memory fits at an equal split, grow by 1.5x, bisect to 2%"
        ),
        "commands": [
            "mixfleetctl advise batch --fleet examples/fleets/mixed-24.yaml --model "
            f"{MODEL} --load {LOAD} --tpot-ms 50 --policy greedy --png docs/strategies-batch.png",
            "... --policy ilp --time-limit 10",
        ],
        "runs": out,
        "checks": checks,
        "png": "docs/strategies-batch.png",
    }


def context_scenario(log: Log) -> dict[str, Any]:
    """Longest context per policy at 8 sequences per GPU on mixed-24."""
    t0 = time.perf_counter()
    advice = advise_context(
        _deployment("mixed-24.yaml"),
        8,
        contexts=(32_768, 65_536, 98_304, 131_072),
        policies=("uniform", "greedy", "ilp"),
    )
    doc = context_document(advice)
    doc["wall_s"] = round(time.perf_counter() - t0, 2)
    longest = {p["policy"]: p["longest_context"] for p in doc["policies"]}
    log(f"  longest contexts: {longest} ({doc['wall_s']} s)")

    def a100_share(policy: str, ctx: int) -> float | None:
        for rep in doc["policies"]:
            if rep["policy"] != policy:
                continue
            for p in rep["points"]:
                if p["context_len"] == ctx:
                    for s in p["by_gpu_model"]:
                        if s["gpu_model"] == "A100-SXM4-80GB":
                            return float(s["attention_share_each"])
        return None

    short, long_ = a100_share("ilp", 32_768), a100_share("ilp", 98_304)
    ilp_points = next(p for p in doc["policies"] if p["policy"] == "ilp")["points"]
    longest_ilp = max((p["context_len"] for p in ilp_points if p["fits"]), default=None)
    at_longest = a100_share("ilp", longest_ilp) if longest_ilp else None
    checks = [
        _check(
            "ilp holds a longer context than uniform",
            (longest["ilp"] or 0) > (longest["uniform"] or 0),
            [longest["uniform"], longest["ilp"]],
        ),
        _check(
            "ilp moves attention to the A100s (memory to spare) as H100/H200 KV fills",
            short is not None and at_longest is not None and at_longest > short,
            {"32k": short, "98k": long_, f"{longest_ilp}": at_longest},
        ),
    ]
    return {
        "scenario": "long-context",
        "description": (
            f"{MODEL} decode on mixed-24 at 8 sequences per GPU, contexts 32k-128k (bisection "
            "to 1024 tokens): the uniform split is bound by the 80 GB GPUs' KV capacity"
        ),
        "commands": [
            "mixfleetctl advise context --fleet examples/fleets/mixed-24.yaml --model "
            f"{MODEL} --load {LOAD} --tokens 8 --contexts 32k,64k,96k,128k --time-limit 10"
        ],
        "runs": doc,
        "checks": checks,
    }


def cost_scenario(log: Log) -> dict[str, Any]:
    """Cost per million tokens per policy on mixed-24; min-cost subsets of mixed-64."""
    prices = PriceTable()
    dep = _deployment("mixed-24.yaml", redundant_experts=16)
    per_policy: list[dict[str, Any]] = []
    for policy in ("uniform", "eplb", "greedy", "ilp"):
        out = try_solve(dep.request(64, policy=policy))
        if out.result is None:
            per_policy.append({"policy": policy, "error": out.reason})
            continue
        c = plan_cost(out.result.plan, prices)
        per_policy.append(
            {
                "policy": policy,
                "tokens_per_s": round(c.tokens_per_s, 1),
                "usd_per_hour": round(c.usd_per_hour, 3),
                "usd_per_million_tokens": round(c.usd_per_million_tokens, 4),
            }
        )
    log("  " + ", ".join(f"{r['policy']} {r.get('usd_per_million_tokens')}" for r in per_policy))
    mins: list[dict[str, Any]] = []
    for target, layout in ((100_000.0, "best"), (60_000.0, "group")):
        t0 = time.perf_counter()
        res = min_cost(
            _deployment("mixed-64.yaml"), target, prices, tokens_per_gpu=64, layout=layout
        )
        doc = min_cost_document(res)
        doc["layout_asked"] = layout
        doc["wall_s"] = round(time.perf_counter() - t0, 2)
        mins.append(doc)
        log(
            f"  min-cost {target:,.0f} tok/s ({layout}): {res.description}, "
            f"{res.cost.usd_per_hour:.2f} USD/h, {res.cost.tokens_per_s:,.0f} tok/s "
            f"({doc['wall_s']} s)"
        )
    ilp = next(r for r in per_policy if r["policy"] == "ilp")
    uni = next(r for r in per_policy if r["policy"] == "uniform")
    checks = [
        _check(
            "ilp is cheaper per million tokens than uniform on the same GPUs",
            ilp["usd_per_million_tokens"] < uni["usd_per_million_tokens"],
            [uni["usd_per_million_tokens"], ilp["usd_per_million_tokens"]],
        ),
        _check(
            "every min-cost answer reaches its target",
            all(m["tokens_per_s"] >= m["target_tokens_per_s"] for m in mins),
            [m["tokens_per_s"] for m in mins],
        ),
    ]
    return {
        "scenario": "cost",
        "description": (
            f"{MODEL} decode at 64 tokens/GPU. Prices are the built-in ASSUMED list prices "
            "per GPU-hour (policies/advice/cost.py). Cost per policy on mixed-24 (16 redundant "
            "experts); cheapest subset of mixed-64 (2 nodes each of A100, H100, H200, B200) "
            "for 100k tokens/s (best of one group or one replica per node) and 60k tokens/s "
            "(one expert-parallel group)"
        ),
        "commands": [
            "mixfleetctl plan cost --fleet examples/fleets/mixed-24.yaml --model "
            f"{MODEL} --load {LOAD} --tokens 64 --redundant-experts 16 --time-limit 10",
            "mixfleetctl plan min-cost --fleet examples/fleets/mixed-64.yaml --model "
            f"{MODEL} --load {LOAD} --tokens 64 --target-tokens-per-s 100000 --time-limit 10",
            "... --target-tokens-per-s 60000 --layout group",
        ],
        "runs": {"per_policy": per_policy, "min_cost": mins},
        "checks": checks,
    }


def vendors_scenario(log: Log) -> dict[str, Any]:
    """NVIDIA + AMD fleet: refused as one group, served as one deployment per vendor."""
    dep = _deployment("mixed-vendors.yaml")
    refused = ""
    try:
        check_vendors(dep.fleet, dep.model)
    except InputError as exc:
        refused = str(exc)
    parts: list[dict[str, Any]] = []
    for part in split_by_vendor(dep.fleet):
        out = try_solve(dep.request(64, fleet=part))
        tps = out.result.plan.summary.tokens_per_s if out.ok and out.result else 0.0
        parts.append({"fleet": part.name, "gpus": len(part.gpus), "tokens_per_s": round(tps, 1)})
    try:  # refused by policies.solve once it calls check_vendors (PlacementRequest default)
        mixed = try_solve(dep.request(64))
        mixed_tps: float | None = (
            mixed.result.plan.summary.tokens_per_s if mixed.ok and mixed.result else 0.0
        )
    except InputError:
        mixed_tps = None
    log(f"  per vendor {parts}; one cross-vendor group {mixed_tps} tok/s")
    total = sum(p["tokens_per_s"] for p in parts)
    checks = [
        _check("one MoE deployment across vendors is refused", bool(refused), refused[:120]),
        _check("split per vendor covers every GPU", sum(p["gpus"] for p in parts) == 32, total),
    ]
    return {
        "scenario": "vendors",
        "description": (
            f"{MODEL} decode at 64 tokens/GPU on mixed-vendors (2x 8x H100 + 2x 8x MI300X, one "
            "IB fabric): a single expert-parallel group would span NCCL and RCCL"
        ),
        "commands": [
            "mixfleetctl plan solve --fleet examples/fleets/mixed-vendors.yaml --model "
            f"{MODEL} --tokens 64 --redundant-experts 0   (refused once policies.solve calls "
            "policies.hardware.vendors.check_vendors)"
        ],
        "runs": {
            "refused": refused,
            "per_vendor": parts,
            "per_vendor_total_tokens_per_s": round(total, 1),
            "cross_vendor_group_tokens_per_s": None if mixed_tps is None else round(mixed_tps, 1),
        },
        "checks": checks,
    }


@dataclass(frozen=True)
class Scenario:
    """A named scenario and the function that runs it."""

    name: str
    run: Callable[[Log], dict[str, Any]]


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("tiers", tiers_scenario),
        Scenario("batch-sizing", batch_scenario),
        Scenario("long-context", context_scenario),
        Scenario("cost", cost_scenario),
        Scenario("vendors", vendors_scenario),
    )
}
