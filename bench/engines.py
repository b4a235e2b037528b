"""Placement as each engine executes it: every policy scored under SGLang, vLLM and
TensorRT-LLM's own replica choice and DP balancing, and the idealised plans re-scored.

Run ``python -m bench.engines --scenario all --json --out bench/results/engines.json --docs
docs/engines-benchmark.md`` (``make bench-engines``). Per scenario (a subset of
:data:`bench.placement.SCENARIOS`) and engine configuration:

* ``idealised``: the ``native``-engine ILP plan (planned DP weights, planned replica shares:
  what mixfleet predicted before plans were engine-aware), its predicted step time and the
  step time the engine really gives it (:func:`policies.solve.rescore`) - the prediction
  error this benchmark exists to show;
* ``uniform``, ``eplb``, ``greedy``, ``ilp`` solved for the engine and scored as it executes
  them (each plan's prediction is its executed time by construction);
* the targets of the engine-faithful placement issue, met or missed by how much.

Solve times are wall-clock on the machine that runs it (``cpu_count`` is recorded).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.common import add_arguments, command_line, log, package_versions, run_main
from bench.placement import FLEETS, SCENARIOS, _request
from controlplane.cli.files import read_fleet
from policies.errors import InputError
from policies.estimate.engines import EngineOptions, EngineSpec
from policies.request import POLICIES, PlacementResult
from policies.solve import rescore, solve

BENCH_SCENARIOS = (
    "mixed-24-decode",
    "ada-hopper-decode",
    "hopper-blackwell-24-decode",
    "homog-32-decode",
)


@dataclass(frozen=True)
class EngineCase:
    """One engine configuration: ``label``, engine, DP balancing."""

    label: str
    engine: EngineSpec


def _case(name: str, balance: str) -> EngineCase:
    spec = EngineSpec(name, options=EngineOptions(dp_balance=balance))  # type: ignore[arg-type]
    who = "router weights" if balance == "router" else "engine's own DP balancing"
    return EngineCase(f"{name} + {who}", spec)


CASES: tuple[EngineCase, ...] = tuple(
    _case(name, balance)
    for name in ("sglang", "vllm", "trtllm")
    for balance in ("router", "engine")
)


def _row(r: PlacementResult, wall_s: float) -> dict[str, Any]:
    s = r.plan.summary
    return {
        "step_ms": round(s.step_time_us / 1000, 3),
        "tokens_per_s": round(s.tokens_per_s, 1),
        "feasible": s.feasible,
        "placed": r.placed,
        "solve_s": round(wall_s, 2),
        "solver": s.solver,
        "plan_id": r.plan.id,
        "a2a_backend": r.plan.engine.a2a_backend,
        "dispatch": r.plan.engine.dispatch,
        "notes": list(r.plan.notes[-2:]),
        "violations": list(r.plan.violations[:2]),
    }


def _timed(fn: Any) -> tuple[PlacementResult, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def run_scenario(name: str, cases: Sequence[EngineCase]) -> dict[str, Any]:
    """Solve one scenario for the idealised form and every engine case."""
    s = SCENARIOS[name]
    fleet = read_fleet(str(FLEETS / s.fleet))
    native = _request(s, fleet, "ilp", "engine")
    ideal, ideal_s = _timed(lambda: solve(native))
    log(f"{name}: idealised ilp {ideal.plan.summary.step_time_us / 1000:.1f} ms")
    out: dict[str, Any] = {
        "description": s.description,
        "idealised": {**_row(ideal, ideal_s), "predicted_step_ms": _row(ideal, ideal_s)["step_ms"]},
        "engines": {},
    }
    for case in cases:
        rec: dict[str, Any] = {"engine": dataclasses.asdict(case.engine)}
        try:
            req = dataclasses.replace(native, engine=case.engine)
            executed, _ = _timed(lambda req=req: rescore(req, ideal.plan))
            rec["idealised_executed"] = _row(executed, 0.0)
            for policy in POLICIES:
                preq = dataclasses.replace(req, policy=policy)
                result, wall = _timed(lambda preq=preq: solve(preq))
                rec[policy] = _row(result, wall)
                log(f"  {case.label:34s} {policy:7s} {rec[policy]['step_ms']:8.2f} ms")
        except InputError as exc:
            rec["refused"] = str(exc)
            log(f"  {case.label}: refused: {exc}")
        out["engines"][case.label] = rec
    return out


def check_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets per scenario and engine case: met, or missed by how much."""
    checks: list[dict[str, Any]] = []

    def add(scenario: str, case: str, what: str, value: float | None, target: float) -> None:
        met = value is not None and value >= target - 1e-9
        checks.append(
            {"scenario": scenario, "engine": case, "target": what, "value": value, "met": met}
        )

    for scen, res in results.items():
        for case, rec in res["engines"].items():
            if "refused" in rec:
                continue
            ilp, eplb, uni = (rec[p]["step_ms"] for p in ("ilp", "eplb", "uniform"))
            feas = {p: rec[p]["feasible"] for p in ("ilp", "eplb")}
            if scen == "homog-32-decode":
                add(scen, case, "ilp never worse than eplb (speedup >= 1.0)", eplb / ilp, 1.0)
                continue
            if "router" in case:
                add(scen, case, "ilp >= 1.30x uniform", uni / ilp, 1.30)
                add(scen, case, "ilp >= 1.15x eplb", eplb / ilp, 1.15)
            else:
                add(scen, case, "ilp >= 1.10x eplb", eplb / ilp if feas["ilp"] else None, 1.10)
                if feas["eplb"]:
                    add(scen, case, "ilp feasible where eplb is", 1.0 if feas["ilp"] else 0.0, 1.0)
    return checks


def _markdown(doc: dict[str, Any]) -> str:
    lines = [
        "# Placement as each engine executes it",
        "",
        f"Command: `{doc['command']}` ({doc['machine']['cpu_count']} CPUs, "
        f"{doc['machine']['python']}). Step times are the shared cost model's prediction of one "
        "decode step, with each engine's own replica choice and DP balancing "
        "(policies/estimate/engines.py).",
        "",
    ]
    for scen, res in doc["results"].items():
        ideal = res["idealised"]
        lines += [
            f"## {scen}",
            "",
            res["description"],
            "",
            f"Idealised ILP plan (planned weights and shares): predicted {ideal['step_ms']:.1f} ms.",
            "",
            "| engine | backend / dispatch | idealised plan, executed | uniform | eplb | greedy | ilp "
            "| ilp vs eplb |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for case, rec in res["engines"].items():
            if "refused" in rec:
                lines.append(f"| {case} | refused: {rec['refused']} | | | | | | |")
                continue

            def cell(r: dict[str, Any]) -> str:
                return f"{r['step_ms']:.1f}" + ("" if r["feasible"] else " (infeasible)")

            ex = rec["idealised_executed"]
            lines.append(
                f"| {case} | {rec['ilp']['a2a_backend']} / {rec['ilp']['dispatch']} | {cell(ex)} "
                f"({(ex['step_ms'] / ideal['step_ms'] - 1) * 100:+.0f}%) | "
                + " | ".join(cell(rec[p]) for p in POLICIES)
                + f" | {rec['eplb']['step_ms'] / rec['ilp']['step_ms']:.2f}x |"
            )
        lines.append("")
    lines += [
        "## Targets",
        "",
        "| scenario | engine | target | value | met |",
        "|---|---|---|---|---|",
    ]
    for c in doc["targets"]:
        v = "-" if c["value"] is None else f"{c['value']:.2f}"
        lines.append(
            f"| {c['scenario']} | {c['engine']} | {c['target']} | {v} | "
            f"{'yes' if c['met'] else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    names = BENCH_SCENARIOS if args.scenario == "all" else tuple(args.scenario.split(","))
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise InputError(f"unknown scenario {unknown}; choose from {', '.join(BENCH_SCENARIOS)}")
    results = {n: run_scenario(n, CASES) for n in names}
    doc = {
        "command": command_line("bench.engines", args, with_json=True),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "packages": package_versions(["pulp", "highspy", "numpy"]),
        },
        "results": results,
        "targets": check_targets(results),
    }
    text = json.dumps(doc, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.docs:
        Path(args.docs).write_text(_markdown(doc))
    if args.json:
        print(text)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.engines", description=__doc__, allow_abbrev=False
    )
    add_arguments(p, docs_help="Markdown page to write (docs/engines-benchmark.md)")
    return run_main(p, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
