"""Serving simulator speed: CPU time of :func:`policies.serving.simulate.simulate` per run.

Run ``python -m bench.serving_sim --out bench/results/serving-sim.json``
(``make bench-serving``). Each scenario simulates the example DeepSeek-V3 plan
(``examples/serving/plan-dsv3-hopper-blackwell.yaml``: one aggregated H200 instance and a
B200-prefill / H200-decode pool, curves from the cost model) under ISL/OSL 4096/512
(p90 6000/800) traffic; the figure is the CPU time of the process (``time.process_time``),
best of ``--repeat`` runs, and the simulated work (requests, steps) that it covers.

Scenarios: ``light`` (3 req/s), ``busy`` (12 req/s, the example traffic), ``overload``
(40 req/s: queues grow without bound), ``bursty`` (12 req/s, gaps with coefficient of
variation 3), ``busy-100k`` (100,000 requests at 12 req/s).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from bench.common import add_arguments, command_line, log, package_versions, run_main
from policies.errors import InputError
from policies.serving.plan import ServingPlan, plan_from_doc
from policies.serving.simulate import SimOptions, simulate
from policies.serving.traffic import LengthDist, Slo, Traffic

ROOT = Path(__file__).resolve().parent.parent
PLAN = ROOT / "examples" / "serving" / "plan-dsv3-hopper-blackwell.yaml"
SLO = Slo(ttft_ms=2000.0, tpot_ms=50.0)

#: name -> (requests per second, requests, arrival, burst cv)
SCENARIOS: dict[str, tuple[float, int, str, float]] = {
    "light": (3.0, 10_000, "poisson", 1.0),
    "busy": (12.0, 10_000, "poisson", 1.0),
    "overload": (40.0, 10_000, "poisson", 1.0),
    "bursty": (12.0, 10_000, "bursty", 3.0),
    "busy-100k": (12.0, 100_000, "poisson", 1.0),
}


def _plan() -> ServingPlan:
    return plan_from_doc(yaml.safe_load(PLAN.read_text()))


def run_scenario(name: str, repeat: int) -> dict[str, Any]:
    """CPU seconds of the best of ``repeat`` simulations of scenario ``name``."""
    rps, requests, arrival, cv = SCENARIOS[name]
    traffic = Traffic(
        rps, LengthDist(4096.0, 6000.0), LengthDist(512.0, 800.0), arrival=arrival, burst_cv=cv
    )
    plan = _plan()
    options = SimOptions(requests=requests, seed=1)
    best = float("inf")
    report = None
    for _ in range(repeat):
        t0 = time.process_time()
        report = simulate(plan, traffic, SLO, options)
        best = min(best, time.process_time() - t0)
    assert report is not None
    steps = sum(g.steps for p in report.pools for g in p.groups)
    return {
        "scenario": name,
        "requests": requests,
        "requests_per_s": rps,
        "arrival": arrival,
        "burst_cv": cv,
        "cpu_s": round(best, 3),
        "cpu_us_per_request": round(best / requests * 1e6, 1),
        "steps": steps,
        "cpu_us_per_step": round(best / steps * 1e6, 2),
        "simulated_s": round(report.duration_s, 1),
        "attainment": round(report.attainment, 4),
        "goodput_rps": round(report.goodput_rps, 3),
        "ttft_p90_ms": round(report.ttft_ms.p90, 1),
        "tpot_p90_ms": round(report.tpot_ms.p90, 2),
    }


def run(args: argparse.Namespace) -> int:
    names = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    for n in names:
        if n not in SCENARIOS:
            raise InputError(
                f"unknown scenario {n!r}. To fix: use one of {', '.join(SCENARIOS)} or all",
                field="--scenario",
            )
    rows = []
    for n in names:
        log(f"{n} ...")
        rows.append(run_scenario(n, args.repeat))
        log(f"  {rows[-1]['cpu_s']} s CPU for {rows[-1]['requests']:,} requests")
    doc = {
        "benchmark": "serving-sim",
        "command": command_line("bench.serving_sim", args, with_json=False)
        + f" --repeat {args.repeat}",
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
        },
        "packages": package_versions(["mixfleet"]),
        "plan": str(PLAN.relative_to(ROOT)),
        "slo": {"ttft_ms": SLO.ttft_ms, "tpot_ms": SLO.tpot_ms, "percentile": SLO.percentile},
        "results": rows,
    }
    text = json.dumps(doc, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
        log(f"wrote {args.out}")
    else:
        print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.serving_sim", description=__doc__, allow_abbrev=False
    )
    add_arguments(parser)
    parser.add_argument("--repeat", type=int, default=3, help="runs per scenario (best kept)")
    return run_main(parser, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
