"""Placement benchmark: every policy on the scenarios of examples/fleets/, with targets.

Run ``python -m bench.placement --scenario all --json --out bench/results/placement.json
--docs docs/benchmarks.md`` (``make bench-placement``). Each scenario solves the same request with
``uniform``, ``eplb``, ``greedy`` and ``ilp`` in the forms it lists, records predicted step
time, throughput, the ILP's proven bound and gap, and solve time, and checks the targets of
issue 2. Solve times are wall-clock on the machine that runs it (``cpu_count`` is recorded).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.common import add_arguments, command_line, log, package_versions, run_main
from bench.placement_report import check_targets, render_markdown
from controlplane.cli.files import read_fleet
from policies.errors import InfeasibleError, InputError
from policies.estimate.workload import make_workload, synthetic_zipf
from policies.hardware.fleet import Fleet
from policies.model.architecture import ModelSpec, preset
from policies.request import POLICIES, PlacementRequest, PlacementResult, SolverOptions
from policies.solve import solve

REPO = Path(__file__).resolve().parent.parent
FLEETS = REPO / "examples" / "fleets"
POLICY_ORDER = POLICIES


@dataclass(frozen=True)
class Scenario:
    """One benchmark scenario.

    Attributes:
        name: scenario name (``mixed-24-decode``).
        fleet: fleet file under examples/fleets/.
        model: model preset.
        phase, tokens_per_gpu, context_len, kv_cache_dtype: workload.
        load: load spec (``synthetic:zipf:S:seed=N``).
        redundant_experts: slot budget beyond one per expert.
        forms: plan forms to solve.
        time_limit_s: ILP wall-clock limit.
        moe_layers: keep only the first N MoE layers (None = all), for solve-time scenarios.
        description: one line for the docs.
    """

    name: str
    fleet: str
    model: str
    phase: str
    tokens_per_gpu: int
    context_len: int
    kv_cache_dtype: str
    load: str
    redundant_experts: int
    forms: tuple[str, ...]
    time_limit_s: float
    moe_layers: int | None = None
    description: str = ""


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(
            "mixed-24-decode",
            "mixed-24.yaml",
            "deepseek-v3",
            "decode",
            128,
            4096,
            "fp8",
            "synthetic:zipf:0.5:seed=1",
            32,
            ("engine", "native"),
            30.0,
            description="8x A100 + 8x H100 + 8x H200, NVSwitch nodes, 4x400 Gb/s IB; DeepSeek-V3 decode",
        ),
        Scenario(
            "mixed-24-prefill",
            "mixed-24.yaml",
            "deepseek-v3",
            "prefill",
            4096,
            4096,
            "fp8",
            "synthetic:zipf:0.5:seed=1",
            32,
            ("engine", "native"),
            30.0,
            description="same fleet, DeepSeek-V3 prefill of 4096 tokens per GPU",
        ),
        Scenario(
            "ada-hopper-decode",
            "ada-hopper.yaml",
            "qwen3-235b-a22b",
            "decode",
            32,
            2048,
            "fp8",
            "synthetic:zipf:0.5:seed=1",
            16,
            ("engine", "native"),
            60.0,
            description="2 nodes 8x L40S PCIe (2x200 Gb/s RoCE) + 1 node 8x H100; Qwen3-235B-A22B decode",
        ),
        Scenario(
            "homog-32-decode",
            "homog-32.yaml",
            "deepseek-v3",
            "decode",
            128,
            4096,
            "fp8",
            "synthetic:zipf:0.5:seed=1",
            32,
            ("engine",),
            30.0,
            description="4 nodes of 8x H100 (identical GPUs): the ILP must not lose to EPLB",
        ),
        Scenario(
            "large-256-decode",
            "large-256.yaml",
            "deepseek-v3",
            "decode",
            128,
            4096,
            "fp8",
            "synthetic:zipf:0.5:seed=1",
            256,
            ("engine",),
            100.0,
            description="32 nodes x 8 GPUs of four types (A100, H100, H200, B200); DeepSeek-V3 decode",
        ),
        Scenario(
            "layer-256x64-decode",
            "mixed-64.yaml",
            "deepseek-v3",
            "decode",
            128,
            4096,
            "fp8",
            "synthetic:zipf:0.5:seed=1",
            64,
            ("engine",),
            0.9,
            moe_layers=1,
            description="solve time of ONE MoE layer (256 experts) on 64 GPUs of four types",
        ),
        Scenario(
            "hopper-blackwell-24-decode",
            "hopper-blackwell-24.yaml",
            "deepseek-v3",
            "decode",
            128,
            4096,
            "fp8",
            "synthetic:zipf:0.5:seed=1",
            32,
            ("engine",),
            30.0,
            description="8x H100 + 8x H200 + 8x B200: a mixed fleet every GPU of which runs DeepEP, "
            "so SGLang's static nearest-replica dispatch applies",
        ),
        Scenario(
            "mixed-24-decode-balanced",
            "mixed-24.yaml",
            "deepseek-v3",
            "decode",
            128,
            4096,
            "fp8",
            "synthetic:zipf:0.0:seed=1",
            32,
            ("engine",),
            30.0,
            description="sensitivity: mixed-24 decode with perfectly even expert load",
        ),
        Scenario(
            "mixed-24-decode-skewed",
            "mixed-24.yaml",
            "deepseek-v3",
            "decode",
            128,
            4096,
            "fp8",
            "synthetic:zipf:1.0:seed=1",
            32,
            ("engine",),
            30.0,
            description="sensitivity: mixed-24 decode with a heavily skewed load (zipf 1.0)",
        ),
    )
}


def _model(s: Scenario) -> ModelSpec:
    m = preset(s.model)
    if s.moe_layers is None:
        return m
    keep = m.moe_layers[: s.moe_layers]
    return dataclasses.replace(m, num_layers=keep[-1] + 1, moe_layers=keep)


def _request(s: Scenario, fleet: Fleet, policy: str, form: str) -> PlacementRequest:
    m = _model(s)
    load = synthetic_zipf(m, s.load)
    w = make_workload(
        m,
        phase=s.phase,
        tokens_per_gpu=s.tokens_per_gpu,
        context_len=s.context_len,
        load=load,
        kv_cache_dtype=s.kv_cache_dtype,
        load_source=s.load,
    )
    workers = 1 if s.moe_layers == 1 else 0
    return PlacementRequest(
        fleet,
        m,
        w,
        policy=policy,
        form=form,
        redundant_experts=s.redundant_experts,
        options=SolverOptions(time_limit_s=s.time_limit_s, workers=workers),
    )


def _inputs(s: Scenario, fleet: Fleet) -> dict[str, Any]:
    """What a scenario solves, for its results record."""
    return {
        "fleet": f"examples/fleets/{s.fleet}",
        "gpus": len(fleet.gpus),
        "model": s.model,
        "moe_layers": _model(s).num_moe_layers,
        "phase": s.phase,
        "tokens_per_gpu": s.tokens_per_gpu,
        "context_len": s.context_len,
        "kv_cache_dtype": s.kv_cache_dtype,
        "load": s.load,
        "redundant_experts": s.redundant_experts,
        "time_limit_s": s.time_limit_s,
    }


def _row(result: PlacementResult, wall_s: float) -> dict[str, Any]:
    sm = result.plan.summary
    return {
        "policy": sm.policy,
        "form": sm.form,
        "step_time_us": round(sm.step_time_us, 1),
        "tokens_per_s": round(sm.tokens_per_s, 1),
        "lower_bound_us": None if sm.lower_bound_us is None else round(sm.lower_bound_us, 1),
        "gap": None if sm.gap is None else round(sm.gap, 5),
        "solve_s": round(sm.solve_s, 3),
        "wall_s": round(wall_s, 3),
        "feasible": sm.feasible,
        "violations": list(result.plan.violations[:5]),
        "imbalance": round(sm.imbalance, 4),
        "solver": sm.solver,
        "notes": list(result.plan.notes),
    }


def run_scenario(s: Scenario, log: Callable[[str], None]) -> dict[str, Any]:
    """Solve one scenario with every policy and form; returns its results record."""
    fleet = read_fleet(FLEETS / s.fleet)
    rows: list[dict[str, Any]] = []
    for form in s.forms:
        for policy in POLICY_ORDER:
            t0 = time.perf_counter()
            try:
                result = solve(_request(s, fleet, policy, form)).require_placed()
            except (InfeasibleError, InputError) as exc:
                rows.append({"policy": policy, "form": form, "feasible": False, "error": str(exc)})
                log(f"  {form:6} {policy:8} infeasible: {str(exc).splitlines()[0]}")
                continue
            row = _row(result, time.perf_counter() - t0)
            rows.append(row)
            gap = f" gap {row['gap'] * 100:.2f}%" if row["gap"] is not None else ""
            log(
                f"  {form:6} {policy:8} {row['tokens_per_s']:>11,.0f} tok/s  step "
                f"{row['step_time_us'] / 1e3:8.2f} ms  solve {row['solve_s']:6.2f} s{gap}"
                f"{'' if row['feasible'] else '  INFEASIBLE'}"
            )
    return {
        "scenario": s.name,
        "description": s.description,
        "inputs": _inputs(s, fleet),
        "results": rows,
        "targets": check_targets(s.name, rows),
    }


GROUPING_SCENARIO = Scenario(
    "two-segments-grouping",
    "two-segments.yaml",
    "qwen3-235b-a22b",
    "decode",
    64,
    4096,
    "fp8",
    "synthetic:zipf:0.5:seed=1",
    32,
    ("engine",),
    30.0,
    description="2 IB segments (2x 8x H200, 2x 8x H100) joined by a 2x400 Gb/s link: one "
    "expert-parallel group across the link, or one group per segment",
)


def run_grouping_scenario(s: Scenario, log: Callable[[str], None]) -> dict[str, Any]:
    """Issue 6 item 3: one EP group across segments vs one per segment, eplb and ilp."""
    from policies.grouping import compare_groupings

    fleet = read_fleet(FLEETS / s.fleet)
    rows: list[dict[str, Any]] = []
    for policy in ("eplb", "ilp"):
        for g in compare_groupings(_request(s, fleet, policy, "engine")):
            groups = []
            for part in g.groups:
                link = 0.0
                if part.result is not None and part.result.evaluation.moe_layers:
                    link = max(t.link_us for t in part.result.evaluation.moe_layers)
                groups.append(
                    {
                        "nodes": list(part.nodes),
                        "tokens_per_s": round(part.tokens_per_s, 1),
                        "max_link_us": round(link, 1),
                        "error": part.error,
                    }
                )
            rows.append(
                {
                    "policy": policy,
                    "grouping": g.name,
                    "tokens_per_s": round(g.tokens_per_s, 1),
                    "groups": groups,
                }
            )
            log(f"  {policy:5} {g.name:12} {g.tokens_per_s:>11,.0f} tok/s")
    return {
        "scenario": s.name,
        "description": s.description,
        "inputs": _inputs(s, fleet),
        "groupings": rows,
        "results": [],
        "targets": [],
    }


def _machine() -> dict[str, Any]:
    """CPUs, Python, platform and solver package versions of this machine."""
    return {
        "cpu_count": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
        "packages": package_versions(("pulp", "highspy", "numpy", "networkx")),
    }


def run(args: argparse.Namespace) -> int:
    """Run the chosen scenarios; print, write the JSON results and the docs page.

    Raises:
        InputError: unknown scenario.
    """
    name = str(getattr(args, "scenario", "all") or "all")
    if name != "all" and name not in SCENARIOS and name != GROUPING_SCENARIO.name:
        raise InputError(
            f"unknown scenario {name!r}; choose one of {', '.join(SCENARIOS)} or all",
            field="scenario",
        )
    chosen = (
        list(SCENARIOS.values())
        if name == "all"
        else [SCENARIOS[name]]
        if name in SCENARIOS
        else []
    )
    scenarios = []
    for s in chosen:
        log(f"{s.name}: {s.description}")
        scenarios.append(run_scenario(s, log))
    if name in ("all", GROUPING_SCENARIO.name):
        log(f"{GROUPING_SCENARIO.name}: {GROUPING_SCENARIO.description}")
        scenarios.append(run_grouping_scenario(GROUPING_SCENARIO, log))
    report = {
        "benchmark": "placement",
        "command": command_line("bench.placement", args, with_json=True),
        "generated_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": _machine(),
        "scenarios": scenarios,
    }
    _write(report, args, name, scenarios)
    missed = [t for sc in scenarios for t in sc["targets"] if not t["met"]]
    for t in missed:
        log(f"target missed: {t['target']}: {t['value']} (goal {t['goal']})")
    return 0


def _write(
    report: dict[str, Any], args: argparse.Namespace, name: str, scenarios: list[dict[str, Any]]
) -> None:
    """``--out`` (one scenario merged into an existing report), ``--docs`` and ``--json``."""
    text = json.dumps(report, indent=1)
    if getattr(args, "out", None):
        out = Path(args.out)
        if out.exists() and name != "all":  # merge one scenario into an existing report
            try:
                old = json.loads(out.read_text())
                keep = [x for x in old.get("scenarios", []) if x["scenario"] != name]
                report["scenarios"] = [*keep, *scenarios]
                text = json.dumps(report, indent=1)
            except (json.JSONDecodeError, KeyError):
                pass
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
        log(f"wrote {out}")
    if getattr(args, "docs", None):
        docs = Path(args.docs)
        docs.parent.mkdir(parents=True, exist_ok=True)
        docs.write_text(render_markdown(report))
        log(f"wrote {docs}")
    if getattr(args, "json", False):
        print(text)


def parser() -> argparse.ArgumentParser:
    """Options of ``python -m bench.placement``."""
    p = argparse.ArgumentParser(
        prog="python -m bench.placement",
        description="placement benchmark scenarios",
        allow_abbrev=False,
    )
    add_arguments(p, docs_help="Markdown table to write")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the options of ``python -m bench.placement``."""
    return parser().parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench.placement``: exit 0, or 2 on a bad scenario name."""
    return run_main(parser(), run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
