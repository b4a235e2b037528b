"""Fleet scheduling benchmark (issue 13): one fleet, many deployments, exclusive GPUs.

Run ``python -m bench.schedule --scenario all --out bench/results/schedule.json``
(``make bench-schedule``; ``--workers N`` processes for the cold estimates, default 2, and
mixed-64 also times the cold table in one process). Every figure is the cost model's prediction (the scheduler's
candidate estimates through :func:`policies.solve.solve`, greedy policy) on the fleets of
``examples/fleets/``; times are wall-clock on the machine that runs it (``cpu_count`` is
recorded). Three assignments are compared on each deployment set:

* ``scheduler``: the integer program of :mod:`policies.scheduling.ilp`;
* ``first-fit``: priority order, each takes the largest instance that fits on free nodes;
* ``every-on-every``: what mixfleet did before: every deployment on every node. Its
  ``claimed`` throughput is what each plan predicts as if it owned the GPUs (their memory is
  over-committed, so they cannot all load); ``time_shared`` divides each by the most
  deployments sharing one of its nodes.

Scenarios: ``issue-mixed-24`` (the issue's DeepSeek-V3 on mixed-24 with and without the A100
node, and three deployments on the same 24 GPUs), ``mixed-64`` (five deployments of
different models and priorities; then a sixth added and one removed, counting moved nodes),
``sglang-scale`` (one SGLang deployment's cold table on 120 and 1,000 GPUs of five types,
as a screen and, on 120 GPUs, engine-exact),
``planned-and-unplanned`` (the controller's decision on 1,000 GPUs: twenty deployments with
traffic and SLOs through the fleet planner, four without through this scheduler, one of them
outranking the rest; cold and warm).
"""

from __future__ import annotations

import argparse
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

import yaml

from bench.common import add_arguments, command_line, log, package_versions, run_main, write_results
from policies.errors import InputError
from policies.estimate.engines import EngineSpec
from policies.hardware.fleet import Fleet, parse_fleet
from policies.scheduling.baselines import every_on_every, first_fit, overcommit
from policies.scheduling.ilp import solve_schedule
from policies.scheduling.table import EstimateCache, TableSettings, build_table
from policies.scheduling.types import Schedule, ScheduleRequest
from policies.spec.build import DeploymentSpec, WorkloadSpec

ROOT = Path(__file__).resolve().parent.parent


def _fleet(name: str) -> Fleet:
    return parse_fleet(yaml.safe_load((ROOT / "examples" / "fleets" / f"{name}.yaml").read_text()))


def _spec(
    name: str, model: str, priority: int, objective: str = "throughput", tokens: int = 64, **kw: Any
) -> DeploymentSpec:
    """A greedy-policy deployment of ``model`` (``tokens`` per GPU per decode step)."""
    return DeploymentSpec(
        name=name,
        model=model,
        policy="greedy",
        priority=priority,
        objective=objective,
        workload=WorkloadSpec(tokens_per_gpu=tokens, kv_cache_dtype=kw.pop("kv", "bf16")),
        **kw,
    )


def metrics(req: ScheduleRequest, s: Schedule, fleet: Fleet, fleet_usd_h: float) -> dict[str, Any]:
    """Goodput, cost, idle GPUs of one assignment."""
    share = overcommit(req, s)
    shared_tps = sum(
        p.tokens_per_s / max(1.0, max(share.get(n, 1.0) for n in p.nodes))
        for p in s.placements.values()
    )
    by_name = {d.name: d for d in req.demands}
    goodput = sum(
        p.tokens_per_s
        for p in s.placements.values()
        if not (by_name[p.deployment].objective == "slo" and p.value <= 0)
    )
    held = {n for p in s.placements.values() for n in p.nodes}
    gpus = {n.name: len(n.gpus) for n in fleet.nodes}
    tps = shared_tps
    return {
        "placed": {k: list(p.nodes) for k, p in s.placements.items()},
        "per_deployment_tokens_per_s": {
            k: round(p.tokens_per_s, 1) for k, p in s.placements.items()
        },
        "pending": {k: p.message for k, p in s.pending.items()},
        "claimed_tokens_per_s": round(s.tokens_per_s, 1),
        "goodput_tokens_per_s": round(
            goodput if max(share.values(), default=1) <= 1 else shared_tps, 1
        ),
        "time_shared_tokens_per_s": round(shared_tps, 1),
        "max_memory_claims_per_node": round(max(share.values(), default=0.0), 3),
        "fleet_usd_per_million_tokens": round(fleet_usd_h / (tps * 3600) * 1e6, 4) if tps else None,
        "idle_gpus": sum(g for n, g in gpus.items() if n not in held),
        "solver": s.solver,
        "solve_s": round(s.solve_s, 3),
        "nodes_moved": s.nodes_moved,
    }


def _compare(
    fleet: Fleet,
    specs: Sequence[DeploymentSpec],
    cache: EstimateCache,
    settings: TableSettings | None = None,
    pool: Executor | None = None,
) -> dict[str, Any]:
    settings = settings or TableSettings()
    names = [n.name for n in fleet.nodes]
    t0 = time.perf_counter()
    req = build_table(fleet, [(s, names) for s in specs], cache=cache, settings=settings, pool=pool)
    table_s = time.perf_counter() - t0
    usd_h = sum(g.usd_per_node_hour * len(g.nodes) for g in req.groups)
    out: dict[str, Any] = {"estimate_s": round(table_s, 2), "estimate_solves": cache.solves}
    for label, fn in (
        ("scheduler", solve_schedule),
        ("first-fit", first_fit),
        ("every-on-every", every_on_every),
    ):
        out[label] = metrics(req, fn(req), fleet, usd_h)
    return out


def issue_mixed_24(pool: Executor | None) -> dict[str, Any]:
    """The issue's figures: DeepSeek-V3 on mixed-24 with and without the A100 node."""
    fleet = _fleet("mixed-24")
    cache = EstimateCache()
    out: dict[str, Any] = {}
    for objective in ("throughput", "cost"):
        spec = _spec("deepseek-v3", "deepseek-v3", 0, objective, tokens=128)
        req = build_table(fleet, [(spec, [n.name for n in fleet.nodes])], cache=cache, pool=pool)
        s = solve_schedule(req)
        cands = {
            "+".join(f"{k}x{g.label}" for k, g in zip(c.counts, req.groups, strict=True) if k): {
                "gpus": c.gpus,
                "tokens_per_s": round(c.tokens_per_s, 1),
                "step_time_ms": round(c.step_time_us / 1000, 1),
                "usd_per_million_tokens": round(c.usd_per_million_tokens, 4) if c.ok else None,
            }
            for c in req.candidates["deepseek-v3"]
        }
        p = s.placements["deepseek-v3"]
        out[f"deepseek-v3-alone-{objective}"] = {
            "candidates": cands,
            "chosen_nodes": list(p.nodes),
            "tokens_per_s": round(p.tokens_per_s, 1),
            "usd_per_million_tokens": round(p.usd_per_million_tokens, 4),
        }
    three = [
        _spec("deepseek-v3", "deepseek-v3", 10),
        _spec("qwen3-235b", "qwen3-235b-a22b", 5),
        _spec("mixtral", "mixtral-8x7b", 1),
    ]
    out["three-deployments"] = _compare(fleet, three, cache, pool=pool)
    return out


MIXED_64 = [
    _spec("deepseek-v3", "deepseek-v3", 10),
    _spec("qwen3-235b", "qwen3-235b-a22b", 8, "cost"),
    _spec("gpt-oss-120b", "gpt-oss-120b", 6),
    _spec("mixtral", "mixtral-8x7b", 4, "slo", slo_step_time_ms=40.0),
    _spec("qwen3-30b", "qwen3-30b-a3b", 2, "cost"),
]
ADDED = _spec("llama-70b", "llama-3.1-70b", 5, tokens=32, kv="fp8")


def _churn(
    fleet: Fleet,
    base: Sequence[DeploymentSpec],
    after: Sequence[DeploymentSpec],
    cache: EstimateCache,
) -> dict[str, Any]:
    """Nodes moved when the set changes from ``base`` to ``after``: with the move penalty,
    first fit keeping held nodes, and the program with moves free."""
    names = [n.name for n in fleet.nodes]
    req0 = build_table(fleet, [(s, names) for s in base], cache=cache)
    s0 = solve_schedule(req0)
    prev = {k: frozenset(p.nodes) for k, p in s0.placements.items()}
    t0 = time.perf_counter()
    req1 = build_table(fleet, [(s, names) for s in after], cache=cache, previous=prev)
    warm_table_s = time.perf_counter() - t0
    s1 = solve_schedule(req1)
    free = solve_schedule(replace(req1, move_weight=0.0))
    ff = first_fit(req1)
    return {
        "reschedule_estimate_s": round(warm_table_s, 3),
        "scheduler": {
            "nodes_moved": s1.nodes_moved,
            "tokens_per_s": round(s1.tokens_per_s, 1),
            "solve_s": round(s1.solve_s, 3),
            "placed": {k: list(p.nodes) for k, p in s1.placements.items()},
        },
        "scheduler_moves_free": {
            "nodes_moved": free.nodes_moved,
            "tokens_per_s": round(free.tokens_per_s, 1),
        },
        "first-fit": {"nodes_moved": ff.nodes_moved, "tokens_per_s": round(ff.tokens_per_s, 1)},
    }


def mixed_64(pool: Executor | None) -> dict[str, Any]:
    fleet = _fleet("mixed-64")
    names = [n.name for n in fleet.nodes]
    t0 = time.perf_counter()  # the cold table in one process, for comparison
    build_table(fleet, [(s, names) for s in MIXED_64], cache=EstimateCache())
    serial_s = time.perf_counter() - t0
    cache = EstimateCache()
    out = _compare(fleet, MIXED_64, cache, pool=pool)
    out["estimate_one_process_s"] = round(serial_s, 2)
    out["replica-groups-2"] = _compare(fleet, MIXED_64, cache, TableSettings(max_instances=2))[
        "scheduler"
    ]
    out["add-llama-70b"] = _churn(fleet, MIXED_64, [*MIXED_64, ADDED], cache)
    out["remove-gpt-oss"] = _churn(
        fleet, MIXED_64, [s for s in MIXED_64 if s.name != "gpt-oss-120b"], cache
    )
    return out


def _sglang_table(
    fleet: Fleet, spec: DeploymentSpec, settings: TableSettings, pool: Executor | None
) -> tuple[dict[str, Any], dict[tuple[int, ...], float]]:
    """The cold cost table of ``spec`` alone on ``fleet``: its time and best candidate, and
    every candidate's tokens/s by its node counts."""
    names = [n.name for n in fleet.nodes]
    t0 = time.perf_counter()
    req = build_table(fleet, [(spec, names)], settings=settings, cache=EstimateCache(), pool=pool)
    took = time.perf_counter() - t0
    cands = req.candidates[spec.name]
    best = max(cands, key=lambda c: c.tokens_per_s)
    doc = {
        "estimate_s": round(took, 1),
        "candidates": len(cands),
        "best_gpus": best.gpus,
        "best_tokens_per_s": round(best.tokens_per_s, 1),
    }
    return doc, {c.counts: c.tokens_per_s for c in cands}


def sglang_scale(pool: Executor | None) -> dict[str, Any]:
    """One SGLang deployment (Qwen3-30B-A3B, static replica choice) on the generated fleets
    of five GPU types (:func:`bench.goodput_timing.generated_fleet`): the cold table as a
    screen (the default: the static choice's expectation, no locality search) and, on 120
    GPUs, engine-exact (``engine_exact``: the choice replayed and the locality search in
    every candidate; not run on 1,000 GPUs, where the replay's cost, which grows with the
    square of a candidate's GPUs, meets candidates of 600)."""
    from bench.goodput_timing import generated_fleet

    spec = replace(_spec("qwen3-30b", "qwen3-30b-a3b", 5, tokens=128), engine=EngineSpec("sglang"))
    small, large = generated_fleet(3), generated_fleet(25)
    screen, screen_tps = _sglang_table(small, spec, TableSettings(), pool)
    exact, exact_tps = _sglang_table(small, spec, TableSettings(engine_exact=True), pool)
    gaps = [abs(screen_tps[k] / v - 1.0) for k, v in exact_tps.items() if v > 0 and k in screen_tps]
    large_doc, _ = _sglang_table(large, spec, TableSettings(), pool)
    return {
        "gpus_120": {
            "screen": screen,
            "engine_exact": exact,
            "largest_tokens_per_s_gap": round(max(gaps, default=0.0), 6),
        },
        "gpus_1000": {"screen": large_doc},
    }


#: Deployments without traffic and SLOs beside the twenty planned ones of
#: :func:`bench.goodput_timing.twenty_deployments` (priorities 1-10): one outranks them all;
#: each holds at most :data:`UNPLANNED_MAX_GPUS` GPUs (without a bound the first would take
#: the three fastest node groups, 600 GPUs: more GPUs, more tokens/s).
UNPLANNED_MAX_GPUS = 16
UNPLANNED = (
    ("u-qwen3-30b", "qwen3-30b-a3b", "sglang", 11),
    ("u-llama-70b", "llama-3.1-70b", "sglang", 7),
    ("u-gpt-oss", "gpt-oss-120b", "vllm", 5),
    ("u-mixtral", "mixtral-8x7b", "vllm", 1),
)


def planned_and_unplanned(pool: Executor | None) -> dict[str, Any]:
    """The decision the controller and the operator make (:func:`policies.fleetplan.combined.
    plan_and_schedule`) on the generated 1,000-GPU fleet: the twenty planned deployments of
    the planner's timing and the four unplanned ones of :data:`UNPLANNED`; cold (empty curve
    cache and estimate cache), then again with both caches warm."""
    import tempfile

    from apis.curvecache import FileCurveCache
    from bench.goodput_timing import generated_fleet, twenty_deployments
    from policies.fleetplan.combined import PlanOptions, ScheduleOptions, plan_and_schedule

    fleet = generated_fleet(25)
    names = [n.name for n in fleet.nodes]
    specs = [d.spec for d in twenty_deployments()] + [
        replace(
            _spec(n, m, p, tokens=128, kv="fp8", max_gpus=UNPLANNED_MAX_GPUS),
            engine=EngineSpec(e),  # type: ignore[arg-type]
        )
        for n, m, e, p in UNPLANNED
    ]
    out: dict[str, Any] = {"gpus": len(fleet.gpus), "planned": 20, "unplanned": len(UNPLANNED)}
    with tempfile.TemporaryDirectory() as tmp:
        estimates = EstimateCache()
        for run in ("cold", "warm"):
            t0 = time.perf_counter()
            decision = plan_and_schedule(
                fleet,
                [(s, names) for s in specs],
                planning=PlanOptions(cache=FileCurveCache(Path(tmp))),
                scheduling=ScheduleOptions(cache=estimates),
                pool=pool,
            )
            took = time.perf_counter() - t0
            placed = decision.schedule.placements if decision.schedule is not None else {}
            out[run] = {
                "wall_s": round(took, 1),
                "steps": [f"{s.kind} {','.join(map(str, s.priorities))}" for s in decision.steps],
                "estimate_solves": estimates.solves,
                "unplanned_placed": {n: p.gpus for n, p in sorted(placed.items())},
                "planned_deployments": len(decision.plan.deployments) if decision.plan else 0,
            }
            log(f"  planned-and-unplanned {run}: {took:.1f} s, steps {out[run]['steps']}")
    return out


SCENARIOS = {
    "issue-mixed-24": issue_mixed_24,
    "mixed-64": mixed_64,
    "sglang-scale": sglang_scale,
    "planned-and-unplanned": planned_and_unplanned,
}


def run(args: argparse.Namespace) -> int:
    names = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise InputError(
            f"unknown scenario {unknown[0]!r}; known: {', '.join(SCENARIOS)}", field="--scenario"
        )
    results: dict[str, Any] = {}
    workers = args.workers if args.workers > 0 else os.cpu_count() or 1
    with ProcessPoolExecutor(workers) if workers > 1 else nullcontext() as pool:
        for name in names:
            log(f"scenario {name}")
            t0 = time.perf_counter()
            results[name] = SCENARIOS[name](pool)
            results[name]["wall_s"] = round(time.perf_counter() - t0, 1)
    doc = {
        "command": command_line("bench.schedule", args, with_json=True),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"cpu_count": os.cpu_count(), "python": platform.python_version()},
        "estimate_workers": workers,
        "versions": package_versions(["pulp", "highspy"]),
        "scenarios": results,
    }
    write_results(doc, args)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.schedule",
        description="fleet scheduling benchmark",
        allow_abbrev=False,
    )
    add_arguments(p)
    p.add_argument(
        "--workers",
        type=int,
        default=2,
        metavar="N",
        help="processes for the cold estimate solves (0 = one per CPU; default: %(default)s)",
    )
    return run_main(p, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
