"""Hostile inputs, measured: the figures of docs/security.md.

Two parts, both written to ``--out`` (bench/results/hostile.json):

* files: every file of the hostile corpus (tests/support/hostile_files.py: tests/fixtures/hostile
  plus the large generated ones) through the real command line of its kind (``mixfleetctl
  fleet show``, ``plan solve --model-config|--load``, ``plan show``, ``deploy apply``,
  ``controller run --token-file``, ``mixfleet-agent simulate --fleet``), one process each:
  exit status, the first line of stderr, wall time and the process's peak resident memory
  (``getrusage`` of a small measuring process); and the reader's own time and peak Python
  memory in this process (``tracemalloc``), without the command's start-up. "Refused
  cleanly" = exit status 2 with an ``error:`` line and no traceback; a refused ``controller
  run`` must also leave no store file behind. The valid controls must get past reading (any
  exit status but 2).
* rpcs: ``--examples`` generated requests per RPC (tests/support/protofuzz.py, fixed seed)
  against an in-process controller on loopback: the status codes returned, per RPC, and the
  slowest call.

    python -m bench.hostile --out bench/results/hostile.json [--examples 200] [--part files]
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
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "proto")]  # the corpus and the generator

from bench.common import log, package_versions  # noqa: E402

#: Seconds a command may take; a control that is still running then (controller run,
#: agent simulate) has got past reading its files.
COMMAND_TIMEOUT_S = 60.0
#: Seconds the commands that serve (controller run, agent simulate) get before they count as
#: started.
SERVE_GRACE_S = 8.0


#: Runs a command (its argv after the result path and the timeout) and writes its exit status
#: ("None" when killed at the timeout), wall time (s) and peak RSS (KiB) to the result path. A
#: small process of its own, because a child's peak RSS starts at its parent's size when it is
#: forked: measured from the runner itself, every command would read the runner's 250 MiB.
_MEASURE = """
import resource, subprocess, sys, time
out, timeout_s, argv = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
t0 = time.perf_counter()
try:
    status = subprocess.run(argv, stdout=subprocess.DEVNULL, timeout=timeout_s).returncode
except subprocess.TimeoutExpired:
    status = None
seconds = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
open(out, "w").write(f"{status} {seconds} {peak}")
"""


def _run(argv: list[str], timeout_s: float, scratch: Path) -> tuple[int | None, str, float, float]:
    """(exit status or None when killed at ``timeout_s``, stderr, wall s, peak RSS MiB) of one
    command, measured by :data:`_MEASURE`."""
    result = scratch / "measured"
    wrapper = [sys.executable, "-S", "-c", _MEASURE, str(result), str(timeout_s), *argv]
    run = subprocess.run(wrapper, capture_output=True, text=True, cwd=REPO, timeout=timeout_s + 60)
    status, seconds, peak_kib = result.read_text().split()
    return (
        None if status == "None" else int(status),
        run.stderr,
        float(seconds),
        float(peak_kib) / 1024.0,
    )


def _in_process(f: Any) -> tuple[float, float]:
    """(s, peak MiB of Python allocations) of the file's reader in this process: the cost
    of the refusal itself, without the command's start-up (imports: about 0.6 s, 80 MiB)."""
    import tracemalloc

    from support.hostile_files import read_in_process

    t0 = time.perf_counter()
    read_in_process(f)
    seconds = time.perf_counter() - t0
    tracemalloc.start()  # a second pass: tracing slows allocation-heavy code several times
    try:
        read_in_process(f)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return seconds, peak / 2**20


def run_files() -> dict[str, Any]:
    """Every corpus file through its command (module docstring)."""
    from support.hostile_files import command, corpus, read_in_process

    out: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        files = corpus(Path(tmp) / "corpus")
        for f in files:  # imports and caches, outside the timings
            if f.accepted:
                read_in_process(f)
        for f in files:
            scratch = Path(tmp) / f"scratch-{len(out)}"
            scratch.mkdir()
            serves = f.kind in ("tokens", "agent-fleet")
            status, err, seconds, rss = _run(
                command(f, scratch), SERVE_GRACE_S if serves else COMMAND_TIMEOUT_S, scratch
            )
            first = next((line for line in err.splitlines() if line.startswith("error:")), "")
            first = first.replace(tmp, "$TMP")  # the results name no path of this machine
            clean = status == 2 and bool(first) and "Traceback" not in err
            if f.kind == "tokens" and (scratch / "state.db").exists():
                clean = False  # a refused start must create no file
            reader_s, reader_mib = _in_process(f)
            row = {
                "file": f.name,
                "kind": f.kind,
                "valid": f.accepted,
                "exit_status": status,
                "refused_cleanly": clean,
                "error": first[:300],
                "traceback": "Traceback" in err,
                "seconds": round(seconds, 3),
                "peak_rss_mib": round(rss, 1),
                "reader_seconds": round(reader_s, 4),
                "reader_peak_mib": round(reader_mib, 2),
            }
            out.append(row)
            log(f"  {f.name:34s} rc={status} {seconds:6.2f}s {rss:7.1f}MiB {first[:70]}")
    hostile = [r for r in out if not r["valid"]]
    refused = [r for r in hostile if r["refused_cleanly"]]
    slowest = max(refused, key=lambda r: r["reader_seconds"], default=None)
    biggest = max(refused, key=lambda r: r["reader_peak_mib"], default=None)
    return {
        "tried": len(hostile),
        "refused_cleanly": len(refused),
        "not_refused_cleanly": [r["file"] for r in hostile if not r["refused_cleanly"]],
        "controls": len(out) - len(hostile),
        "controls_read": sum(1 for r in out if r["valid"] and r["exit_status"] != 2),
        "slowest_refusal": slowest,
        "largest_refusal": biggest,
        "slowest_command_s": max((r["seconds"] for r in refused), default=0.0),
        "largest_command_rss_mib": max((r["peak_rss_mib"] for r in refused), default=0.0),
        "cases": out,
    }


def _fuzz(target: Any, method: Any, bases: Any, examples: int) -> dict[str, Any]:
    """``examples`` generated requests to one RPC: status codes, slowest call, failures."""
    from google.protobuf import text_format
    from hypothesis import HealthCheck, Phase, given, settings
    from support.protofuzz import request_batches

    codes: Counter[str] = Counter()
    slowest = [0.0, 0.0]  # any call, a refused call
    failures: list[str] = []
    slowest_request = [""]

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        phases=(Phase.generate,),
        suppress_health_check=list(HealthCheck),
    )
    @given(request_batches(method, bases))
    def one(request: Any) -> None:
        o = target.call(method, request)
        codes[o.code] += 1
        if o.seconds > slowest[0]:
            items = request if isinstance(request, list) else [request]
            text = " | ".join(text_format.MessageToString(r, as_one_line=True) for r in items)
            slowest_request[0] = f"{o.code}: {text[:400]}"
        slowest[0] = max(slowest[0], o.seconds)
        if o.code != "OK":
            slowest[1] = max(slowest[1], o.seconds)
        if o.code in ("INTERNAL", "UNKNOWN") and len(failures) < 3:
            failures.append(o.detail[:200])

    one()
    return {
        "messages": sum(codes.values()),
        "codes": dict(sorted(codes.items())),
        "slowest_s": round(slowest[0], 3),
        "slowest_refusal_s": round(slowest[1], 3),
        "slowest_request": slowest_request[0],
        "failures": failures,
    }


def run_rpcs(examples: int) -> dict[str, Any]:
    """``examples`` generated requests per RPC against an in-process controller."""
    from support.fuzztarget import FuzzTarget
    from support.protofuzz import methods, rpc_name

    from controlplane.server.logs import configure_logging

    configure_logging("console", "error")  # the refusals are counted, not printed
    per_rpc: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp, FuzzTarget(Path(tmp)) as target:
        for method in methods():
            target.reset()
            row = per_rpc[rpc_name(method)] = _fuzz(target, method, target.bases(), examples)
            log(f"  {rpc_name(method):34s} {row['codes']} slowest {row['slowest_s']:.2f}s")
        serving = target.serving()
    totals: Counter[str] = Counter()
    for r in per_rpc.values():
        totals.update(r["codes"])
    return {
        "examples_per_rpc": examples,
        "rpcs": len(per_rpc),
        "messages": sum(totals.values()),
        "codes": dict(sorted(totals.items())),
        "slowest_refusal_s": max(r["slowest_refusal_s"] for r in per_rpc.values()),
        "serving_after": serving,
        "per_rpc": per_rpc,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.hostile", description=__doc__, allow_abbrev=False
    )
    p.add_argument("--out", metavar="PATH", help="results JSON file")
    p.add_argument("--examples", type=int, default=200, help="requests per RPC (default 200)")
    p.add_argument("--part", choices=("all", "files", "rpcs"), default="all")
    args = p.parse_args(argv)
    result: dict[str, Any] = {
        "command": " ".join(["python", "-m", "bench.hostile", *(argv or sys.argv[1:])]),
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
        },
        "packages": package_versions(["grpcio", "protobuf", "PyYAML", "hypothesis"]),
    }
    if args.part in ("all", "files"):
        log("hostile files:")
        result["files"] = run_files()
    if args.part in ("all", "rpcs"):
        log(f"hostile RPCs ({args.examples} per RPC):")
        result["rpcs"] = run_rpcs(args.examples)
    text = json.dumps(result, indent=2) + "\n"
    if args.out:
        Path(args.out).write_text(text)
        log(f"wrote {args.out}")
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
