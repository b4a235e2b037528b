"""CLI start-up benchmark: wall time of ``mixfleetctl`` commands that need no solver.

Run ``python -m bench.cli_startup --out bench/results/cli_startup.json``. Each command runs
``--repeats`` times (default 15) as a fresh process (``python -m controlplane.cli ...``, what
the ``mixfleetctl`` script does), and the median and the worst wall time are recorded, beside
the median CPU time (user + system, which moves less with the machine's load), beside the
time of a bare ``python -c pass`` on the same machine (the floor no command can beat)
and the modules ``import controlplane.cli`` and ``mixfleetctl --version`` load. The goals:
<= 0.3 s wall per command on an idle machine, and <= 0.15 s CPU for ``--version`` (what
kubectl's ``version --client`` costs is about 0.075 s). The load average at the start is
recorded because a busy machine stretches every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
FLEET = REPO / "examples" / "fleets" / "mixed-24.yaml"

#: Commands timed: label -> arguments of ``mixfleetctl``.
COMMANDS: dict[str, list[str]] = {
    "--help": ["--help"],
    "--version": ["--version"],
    "plan solve --help": ["plan", "solve", "--help"],
    "model list": ["model", "list"],
    "fleet show": ["fleet", "show", str(FLEET)],
    "completion bash": ["completion", "bash"],
}
GOAL_S = 0.3
VERSION_GOAL_CPU_S = 0.15
HEAVY = ("grpc", "pulp", "numpy", "networkx", "yaml", "policies.solve", "policies.advice.cost")


def _time(argv: Sequence[str], repeats: int, tree: Path = REPO) -> dict[str, float] | None:
    """Median and worst wall time of ``argv`` as a fresh process in ``tree``, and the
    median CPU time (user + system) of that process, seconds; ``None`` when the command
    fails there (an older tree without it). The CPU time moves less with the machine's load
    than the wall time."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    times, cpu = [], []
    for _ in range(repeats):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        done = subprocess.run(argv, cwd=tree, check=False, capture_output=True, env=env)
        if done.returncode != 0:
            return None
        times.append(time.perf_counter() - t0)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return {
        "median_s": round(statistics.median(times), 4),
        "max_s": round(max(times), 4),
        "cpu_median_s": round(statistics.median(cpu), 4),
    }


def _heavy_modules() -> list[str]:
    code = f"import sys, controlplane.cli; print([m for m in {HEAVY!r} if m in sys.modules])"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, check=True, capture_output=True, text=True
    )
    found: list[str] = json.loads(done.stdout.replace("'", '"'))
    return found


def _version_modules(tree: Path) -> dict[str, Any]:
    """The modules ``mixfleetctl --version`` imports beyond a bare interpreter: their
    number, and those of the project."""
    code = (
        "import json, sys; before = set(sys.modules); sys.argv = ['mixfleetctl', '--version']\n"
        "from controlplane.cli import main\n"
        "main()\n"
        "print(json.dumps(sorted(set(sys.modules) - before)), file=sys.stderr)"
    )
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tree, check=True, capture_output=True, text=True, env=env
    )
    loaded: list[str] = json.loads(done.stderr.strip().splitlines()[-1])
    roots = ("apis", "agents", "controlplane", "operators", "policies")
    return {
        "count": len(loaded),
        "project": [m for m in loaded if m.split(".")[0] in roots],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Time every command of :data:`COMMANDS`; returns the result document."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    cli = [sys.executable, "-m", "controlplane.cli"]
    tree = (args.tree or REPO).resolve()
    results = {label: _time([*cli, *argv], args.repeats, tree) for label, argv in COMMANDS.items()}
    floor = _time([sys.executable, "-c", "pass"], args.repeats)
    assert floor is not None
    for r in results.values():
        if r is not None:
            r["cpu_over_python_floor_s"] = round(r["cpu_median_s"] - floor["cpu_median_s"], 4)
    version = results.get("--version")
    return {
        "benchmark": "cli_startup",
        "command": f"python -m bench.cli_startup --repeats {args.repeats}"
        + (f" --tree DIR --label '{args.label}'" if args.tree else ""),
        "tree": "this checkout" if tree == REPO else args.label,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(terse=True),
            "load_average_1min": load,
        },
        "repeats": args.repeats,
        "goal_s": GOAL_S,
        "version_goal_cpu_s": VERSION_GOAL_CPU_S,
        "python_floor": floor,
        "commands": results,
        "heavy_modules_on_import": _heavy_modules() if tree == REPO else None,
        "modules_on_version": _version_modules(tree),
        "all_within_goal": all(r is not None and r["median_s"] <= GOAL_S for r in results.values()),
        "version_cpu_within_goal": version is not None
        and version["cpu_median_s"] <= VERSION_GOAL_CPU_S,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: print the result, and write it to ``--out``."""
    p = argparse.ArgumentParser(
        prog="python -m bench.cli_startup", description=__doc__, allow_abbrev=False
    )
    p.add_argument("--repeats", type=int, default=15, help="runs per command")
    p.add_argument("--out", type=Path, help="JSON file to write")
    p.add_argument(
        "--tree",
        type=Path,
        help="time another checkout of mixfleet (e.g. an older revision from git archive)",
    )
    p.add_argument(
        "--label", default="another checkout", help="what --tree is, for the result file"
    )
    args = p.parse_args(argv)
    doc = run(args)
    text = json.dumps(doc, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
