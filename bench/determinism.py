"""Determinism benchmark: the same ILP request idle and beside CPU hogs gives the same plan.

Run ``python -m bench.determinism --out bench/results/determinism.json``
(``make bench-determinism``). It solves one placement scenario (default ``mixed-24-decode``,
engine form, from :data:`bench.placement.SCENARIOS`) three times: on the machine as it is,
beside ``--hogs`` busy-looping processes (default: one per CPU), and on the machine as it is
with one layer worker. It records each run's plan id, step time, bounds, gap, wall time and
the solver's notes, and checks that the plan ids agree and that every run kept its wall-clock
limit within 10% (``time_limit_s``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.common import log, run_main
from bench.placement import FLEETS, SCENARIOS, _inputs, _machine, _request
from controlplane.cli.files import read_fleet
from policies.errors import InputError
from policies.request import PlacementRequest
from policies.solve import solve

LIMIT_SLACK = 0.10
"""A run keeps its limit when its wall time is at most ``(1 + LIMIT_SLACK) * time_limit_s``."""


def _hogs(count: int) -> list[subprocess.Popen[bytes]]:
    """Start ``count`` processes that spin one CPU each until killed."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def _stop(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


def _solve_once(req: PlacementRequest, name: str, hogs: int) -> dict[str, Any]:
    """One solve, beside ``hogs`` CPU hogs; its record."""
    procs = _hogs(hogs)
    try:
        if procs:
            time.sleep(1.0)  # let the hogs take their CPUs
        load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        t0 = time.perf_counter()
        result = solve(req)
        wall = time.perf_counter() - t0
    finally:
        _stop(procs)
    s = result.plan.summary
    limit = req.options.time_limit_s
    row = {
        "run": name,
        "cpu_hogs": hogs,
        "workers": req.options.workers,
        "load_average_1min_at_start": load_before,
        "plan_id": result.plan.id,
        "step_time_us": round(s.step_time_us, 3),
        "lower_bound_us": None if s.lower_bound_us is None else round(s.lower_bound_us, 3),
        "conditional_bound_us": (
            None if s.conditional_bound_us is None else round(s.conditional_bound_us, 3)
        ),
        "gap": None if s.gap is None else round(s.gap, 6),
        "bound_scope": s.bound_scope,
        "time_limit_s": limit,
        "wall_s": round(wall, 3),
        "within_limit": wall <= (1 + LIMIT_SLACK) * limit,
        "solver": s.solver,
        "notes": list(result.plan.notes),
    }
    log(
        f"  {name:22} plan {row['plan_id']}  step {s.step_time_us / 1e3:8.3f} ms  "
        f"bound {(s.lower_bound_us or 0) / 1e3:8.3f} ms  wall {wall:6.2f} s / {limit:g} s"
    )
    return row


def run(args: argparse.Namespace) -> int:
    """Solve idle, loaded and with one worker; print, write the JSON record.

    Raises:
        InputError: unknown scenario or form.
    """
    name = str(args.scenario)
    if name not in SCENARIOS:
        raise InputError(
            f"unknown scenario {name!r}; choose one of {', '.join(SCENARIOS)}", field="scenario"
        )
    s = SCENARIOS[name]
    if args.form not in s.forms:
        raise InputError(f"{name} solves forms {list(s.forms)}, not {args.form!r}", field="form")
    fleet = read_fleet(FLEETS / s.fleet)
    req = _request(s, fleet, "ilp", args.form)
    hogs = args.hogs if args.hogs is not None else (os.cpu_count() or 1)
    log(f"{name} ({args.form} form): {s.description}; {hogs} CPU hog(s) in the loaded run")
    one = dataclasses.replace(req, options=dataclasses.replace(req.options, workers=1))
    runs = [
        _solve_once(req, "idle", 0),
        _solve_once(req, "beside CPU hogs", hogs),
        _solve_once(one, "idle, one worker", 0),
    ]
    report = {
        "benchmark": "determinism",
        "command": _command(args),
        "generated_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": _machine(),
        "scenario": name,
        "form": args.form,
        "inputs": _inputs(s, fleet),
        "runs": runs,
        "checks": {
            "same_plan_id": len({r["plan_id"] for r in runs}) == 1,
            "every_run_within_limit": all(r["within_limit"] for r in runs),
            "limit_slack": LIMIT_SLACK,
        },
    }
    text = json.dumps(report, indent=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    if args.json:
        print(text)
    else:
        checks = report["checks"]
        print(
            f"same plan id: {checks['same_plan_id']}; within limit: {checks['every_run_within_limit']}"
        )
    return 0


def _command(args: argparse.Namespace) -> str:
    """The command line that reproduces this run."""
    argv = ["python", "-m", "bench.determinism", "--scenario", args.scenario, "--form", args.form]
    if args.hogs is not None:
        argv += ["--hogs", str(args.hogs)]
    if args.json:
        argv.append("--json")
    if args.out:
        argv += ["--out", str(args.out)]
    return " ".join(argv)


def parser() -> argparse.ArgumentParser:
    """Options of ``python -m bench.determinism``."""
    p = argparse.ArgumentParser(
        prog="python -m bench.determinism",
        description="the same ILP request idle and beside CPU hogs: same plan, limit kept",
        allow_abbrev=False,
    )
    p.add_argument("--scenario", default="mixed-24-decode", metavar="NAME")
    p.add_argument("--form", default="engine", choices=("engine", "native"))
    p.add_argument(
        "--hogs",
        type=int,
        default=None,
        metavar="N",
        help="CPU hogs in the loaded run (default: one per CPU)",
    )
    p.add_argument("--json", action="store_true", help="print the record as JSON")
    p.add_argument("--out", metavar="PATH", help="results JSON file")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench.determinism``: exit 0, or 2 on a bad option."""
    return run_main(parser(), run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
