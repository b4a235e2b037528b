"""How much each of the fleet planner's variants holds within the SLO: the planner's sizing
against the serving simulator, one instance (or one prefill/decode pair) at a time
(``python -m bench.goodput_headroom``; docs/goodput.md "How the prediction is made").

For every aggregated variant and prefill/decode pair the planner considers in a scenario of
:mod:`bench.goodput` (same models, fleets, lengths and SLO), at utilisation 1:

* ``rate_at_limit_rps``: its rate at the batch limit (the flat sizing's base, which the
  planner used to plan at 85% of);
* ``queueing_rps``: the rate its slots hold within the TTFT target
  (:mod:`policies.fleetplan.queueing`, the planner's sizing now);
* ``simulated_rps``: the simulator's yardstick on that one variant alone (the largest rate
  with 90% of requests within both SLOs, run to steady state: :mod:`bench.goodput_setup`).

Poisson arrivals, or bursty ones with ``--burst-cv CV`` (gamma gaps of that coefficient of
variation, in the sizing and the simulation alike).

Units: requests per second.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.common import command_line, log, run_main, write_results
from bench.goodput_setup import (
    FLEETS,
    HUGE_DEMAND_RPS,
    LENGTHS,
    MODELS,
    SLO,
    example_fleet,
    max_goodput,
    spec,
    traffic,
)
from policies.errors import InputError
from policies.fleetplan import FleetDeployment, MemoryCurveCache, PlannerSettings, PlanRequest
from policies.fleetplan.candidates import Candidates, candidates
from policies.serving.plan import DEFAULT_CHUNK_TOKENS, InstanceGroup, KvPath, Pool, ServingPlan
from policies.serving.traffic import MAX_BURST_CV, Traffic

SCENARIOS = (
    "dsv3-mixed-64-1024-1024",
    "dsv3-mixed-64-4096-512",
    "qwen235b-mixed-24-4096-512",
    "qwen235b-hopper-blackwell-24-1024-1024",
    "dsv3-hopper-blackwell-24-1024-1024",
    "qwen235b-hopper-blackwell-24-4096-512",
    "dsv3-homog-32-1024-1024",
)


def _split(name: str) -> tuple[str, str, str]:
    """``(model key, fleet, lengths)`` of a scenario name."""
    model, rest = name.split("-", 1)
    lengths = "-".join(rest.split("-")[-2:])
    return model, rest[: -len(lengths) - 1], lengths


def _traffic(lengths: str, burst_cv: float) -> Traffic:
    """The scenario's traffic: Poisson at ``burst_cv`` 1, else bursty."""
    isl, osl = LENGTHS[lengths]
    tr = traffic(isl, osl, HUGE_DEMAND_RPS)
    return tr if burst_cv == 1.0 else replace(tr, arrival="bursty", burst_cv=burst_cv)


def _candidates(name: str, queueing: bool, burst_cv: float) -> tuple[Candidates, str]:
    model, fleet, lengths = _split(name)
    sp = spec(model, MODELS[model], _traffic(lengths, burst_cv))
    settings = PlannerSettings(utilisation=1.0, queueing=queueing)
    req = PlanRequest(example_fleet(fleet), (FleetDeployment(sp),), settings=settings)
    return candidates(req, MemoryCurveCache(), None), sp.name


def scenario(name: str, burst_cv: float = 1.0) -> list[dict[str, Any]]:
    """Every variant of scenario ``name``: its rates (module docstring)."""
    _, _, lengths = _split(name)
    tr = _traffic(lengths, burst_cv)
    flat, dep = _candidates(name, False, burst_cv)
    queued, _ = _candidates(name, True, burst_cv)
    rows: list[dict[str, Any]] = []
    for v, q in zip(flat.aggregated[dep], queued.aggregated[dep], strict=True):
        g = InstanceGroup(1, v.curve, v.sizing.batch_limit, DEFAULT_CHUNK_TOKENS)
        plan = ServingPlan((Pool("one", 1.0, instances=g),))
        rows.append(
            _row(
                v.key,
                v.sizing.batch_limit,
                v.sizing.requests_per_s,
                q.sizing.requests_per_s,
                plan,
                tr,
            )
        )
    flat_pairs = {k.key: k for k in flat.pairs[dep]}
    for k in queued.pairs[dep]:
        f = flat_pairs.get(k.key)
        if f is None:
            continue
        plan = ServingPlan(
            (
                Pool(
                    "one",
                    1.0,
                    prefill=InstanceGroup(1, k.prefill.curve, 0, k.prefill.sizing.batch_limit),
                    decode=InstanceGroup(1, k.decode.curve, k.decode.sizing.batch_limit, 1),
                    kv_path=KvPath(k.kv_gbytes_per_s, k.kv_latency_us),
                ),
            )
        )
        full = min(f.prefill.sizing.requests_per_s, f.decode.sizing.requests_per_s)
        rate = min(k.prefill.sizing.requests_per_s, k.decode.sizing.requests_per_s)
        rows.append(_row(k.key, k.decode.sizing.batch_limit, full, rate, plan, tr))
    return rows


def _row(
    key: str, batch: int, full: float, queued: float, plan: ServingPlan, tr: Traffic
) -> dict[str, Any]:
    """One variant's row: ``full`` its rate at the batch limit, ``queued`` the queueing
    bound's rate (requests/s), ``plan`` it alone for the simulator."""
    sim = max_goodput(plan, tr, queued or full)["rate_rps"]
    return {
        "variant": key,
        "batch_limit": batch,
        "rate_at_limit_rps": round(full, 4),
        "queueing_rps": round(queued, 4),
        "simulated_rps": sim,
        "flat_85_error": round(0.85 * full / sim - 1.0, 4) if sim else None,
        "queueing_error": round(queued / sim - 1.0, 4) if sim else None,
    }


def report(doc: dict[str, Any]) -> str:
    """The results as a Markdown table."""
    lines = [
        "| scenario | variant | batch limit | rate at the limit | 85% of it | queueing bound "
        "| simulated | 85% vs simulated | queueing vs simulated |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, rows in doc["scenarios"].items():
        for r in rows:
            lines.append(
                f"| {name} | {r['variant']} | {r['batch_limit']:,} "
                f"| {r['rate_at_limit_rps']:.2f} | {0.85 * r['rate_at_limit_rps']:.2f} "
                f"| {r['queueing_rps']:.2f} | {r['simulated_rps']:.2f} "
                f"| {r['flat_85_error'] * 100:+.1f}% | {r['queueing_error'] * 100:+.1f}% |"
            )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.report:
        print(report(json.loads(Path(args.report).read_text())))
        return 0
    names = list(SCENARIOS) if args.scenario == "all" else args.scenario.split(",")
    for n in names:
        model, fleet, lengths = _split(n) if n.count("-") >= 3 else ("", "", "")
        if model not in MODELS or lengths not in LENGTHS or fleet not in FLEETS:
            raise InputError(f"unknown scenario {n!r}", field="--scenario")
    if not 1.0 <= args.burst_cv <= MAX_BURST_CV:
        raise InputError(
            f"must be from 1 (Poisson) to {MAX_BURST_CV:g}, got {args.burst_cv:g}",
            field="--burst-cv",
        )
    results: dict[str, Any] = {}
    for n in names:
        log(f"scenario {n}")
        results[n] = scenario(n, args.burst_cv)
    doc = {
        "command": command_line("bench.goodput_headroom", args, with_json=True)
        + (f" --burst-cv {args.burst_cv:g}" if args.burst_cv != 1.0 else ""),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"cpu_count": os.cpu_count(), "python": platform.python_version()},
        "arrivals": "poisson" if args.burst_cv == 1.0 else f"bursty, burst CV {args.burst_cv:g}",
        "slo": {"ttft_ms": SLO.ttft_ms, "tpot_ms": SLO.tpot_ms, "percentile": SLO.percentile},
        "scenarios": results,
    }
    write_results(doc, args)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.goodput_headroom",
        description="the planner's per-variant capacity against the simulator",
        allow_abbrev=False,
    )
    p.add_argument("--scenario", default="all", metavar="NAME[,NAME]|all", help="default: all")
    p.add_argument("--json", action="store_true", help="print results as JSON")
    p.add_argument("--out", metavar="PATH", help="results JSON file")
    p.add_argument("--report", metavar="PATH", help="print a results file as a Markdown table")
    p.add_argument(
        "--burst-cv",
        type=float,
        default=1.0,
        metavar="CV",
        help="bursty arrivals, gaps of this coefficient of variation (default: 1, Poisson)",
    )
    return run_main(p, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
