"""The goodput benchmark's planner timing (``python -m bench.goodput --timing``, described
in the docstring of :mod:`bench.goodput`; reported, never asserted): the workloads
(:func:`generated_fleet`, :func:`twenty_deployments`, :func:`five_on_mixed_64`) and
:func:`timing_case`.

Units: seconds (wall clock on this machine), requests per second.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

from apis.curvecache import FileCurveCache
from bench.common import log
from bench.goodput_setup import spec, traffic
from policies.fleetplan import FleetDeployment, PlanRequest, plan_fleet
from policies.fleetplan.report import plan_doc
from policies.hardware.fleet import Fleet, parse_fleet
from policies.serving.plan import DEFAULT_CHUNK_TOKENS
from policies.serving.traffic import Slo


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
    """Five models of priorities 2-10 for mixed-64."""
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
    """Plan ``deps`` on ``fleet`` cold and after a change, with two and one workers, and cold
    beside two CPU hogs: wall seconds, curves computed, and whether the plans agree."""
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
