"""What following a controller's instances and measuring their traffic costs the router:
router CPU per streamed request through the same 8 engines given three ways:

* ``static``: ``--instance url=...`` flags, no controller;
* ``routed``: ``--instance url=...,deployment=<name>``: weights from the controller (a
  ``WatchRouting`` stream per instance), as before ``--deployment``;
* ``measured``: ``--deployment ds``: the instances listed by ``WatchInstances``, their
  ``WatchRouting`` streams, batch-limit bookkeeping, a traffic sample per request and a
  ``ReportTraffic`` per second (``--traffic-report-s 1``).

``routed`` against ``static`` is the price of the gRPC watches; ``measured`` against
``routed`` that of the instance set and the traffic measurement.

Run ``python -m bench.router_traffic --out bench/results/router-traffic.json``.

Set-up, all on loopback: the 8 test engines of :mod:`bench.router_peers` (one DP rank
each, one process, fixed-pace chunks); a small gRPC EngineService in this process that
lists them as the 8 aggregated instances of deployment ``ds`` with one equal-weight rank
each and records the traffic reports (the tests' scripted controller:
``tests/support/scripted_controller.py``); one router process per path; closed-loop
clients in this process. In every round the paths run one after the other (order rotated
each round) for ``--seconds``; per path: requests completed and failed, and the router's
CPU (user + system, from ``/proc``) per completed request. Only ratios within a round are
compared (the host is shared).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.router_peers import REPO, Proc, _free_port, _start, _streams, _wait_ready, start_engines

DEPLOYMENT = "ds"
PATHS = ["static", "routed", "measured"]


def _router(name: str, extra: list[str], log_dir: Path) -> Proc:
    port = _free_port()
    argv = [
        sys.executable, "-m", "controlplane.cli", "router", "run",
        "--listen", f"127.0.0.1:{port}", "--log-level", "warning", "--queue-limit", "100000",
        *extra,
    ]  # fmt: skip
    return _start(name, argv, f"http://127.0.0.1:{port}", log_dir)


async def _rounds(args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    sys.path[:0] = [str(REPO / "tests")]
    from support.scripted_controller import ScriptedEngineService, instance, scripted_controller

    engines, urls = start_engines(args.tokens_per_s, log_dir)
    svc = ScriptedEngineService()
    names = [f"{DEPLOYMENT}-aggregated-{i}" for i in range(len(urls))]
    for name in names:
        svc.route(name, [1.0])
    svc.publish(DEPLOYMENT, [instance(n, u) for n, u in zip(names, urls, strict=True)])
    routers: dict[str, Proc] = {}
    try:
        async with scripted_controller(svc) as addr:
            static = [f"--instance=url={u},name={n}" for n, u in zip(names, urls, strict=True)]
            routers["static"] = _router("static", static, log_dir)
            routed = [f"{flag},deployment={n}" for flag, n in zip(static, names, strict=True)]
            routers["routed"] = _router("routed", [*routed, f"--controller={addr}"], log_dir)
            routers["measured"] = _router(
                "measured",
                [f"--deployment={DEPLOYMENT}", f"--controller={addr}", "--traffic-report-s=1"],
                log_dir,
            )
            for r in routers.values():
                await _wait_ready(r.url, 60.0)
            rounds = []
            for i in range(args.rounds):
                order = PATHS[i % 3 :] + PATHS[: i % 3]
                row: dict[str, Any] = {}
                for path in order:
                    r = routers[path]
                    cpu0 = r.cpu_s()
                    res = await _streams([r.url], args.streams, args.chunks, args.seconds)
                    res["router_cpu_ms_per_request"] = round(
                        (r.cpu_s() - cpu0) * 1e3 / max(res["completed"], 1), 4
                    )
                    row[path] = res
                rounds.append(row)
                print(json.dumps({"round": i, **row}), flush=True)
            reported = sum(rep.requests for rep in svc.reports)
            for r in routers.values():  # before the controller: no watch cut by its stop
                r.stop()
    finally:
        for r in routers.values():
            if r.popen.poll() is None:
                r.stop()
        engines.stop()
    return {"rounds": rounds, "requests_reported": reported}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The comparison (module docstring); the results document."""
    log_dir = Path(args.log_dir or (REPO / "bench" / ".peers-logs"))
    log_dir.mkdir(parents=True, exist_ok=True)
    started, load0 = time.time(), os.getloadavg()[0]
    part = asyncio.run(_rounds(args, log_dir))
    rounds = part["rounds"]
    cpu = {p: [r[p]["router_cpu_ms_per_request"] for r in rounds] for p in PATHS}

    def ratios(a: str, b: str) -> list[float]:
        return [round(x / y, 3) for x, y in zip(cpu[a], cpu[b], strict=True) if y > 0]

    return {
        "command": "python -m bench.router_traffic " + " ".join(sys.argv[1:]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpu_count": os.cpu_count(),
            "cpus_usable": len(os.sched_getaffinity(0)),
            "python": platform.python_version(),
            "load_average_1m": [round(load0, 2), round(os.getloadavg()[0], 2)],
        },
        "settings": {
            "streams": args.streams,
            "chunks": args.chunks,
            "tokens_per_s": args.tokens_per_s,
            "seconds_per_path": args.seconds,
            "rounds": args.rounds,
        },
        "rounds": rounds,
        "summary": {
            "router_cpu_ms_per_request_median": {p: statistics.median(v) for p, v in cpu.items()},
            **{
                f"{a}_vs_{b}": {"per_round": ratios(a, b), "median": _median(ratios(a, b))}
                for a, b in (("routed", "static"), ("measured", "routed"), ("measured", "static"))
            },
            "completed": {p: sum(r[p]["completed"] for r in rounds) for p in cpu},
            "failed": {p: sum(r[p]["failed"] for r in rounds) for p in cpu},
            "requests_reported": part["requests_reported"],
        },
        "wall_s": round(time.time() - started, 1),
    }


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--streams", type=int, default=64, help="concurrent streamed clients")
    p.add_argument("--chunks", type=int, default=10, help="chunks per streamed answer")
    p.add_argument("--tokens-per-s", type=float, default=50.0, help="each engine's chunk pace")
    p.add_argument("--seconds", type=float, default=8.0, help="per path and round, seconds")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--log-dir", default="", help="the processes' logs")
    p.add_argument("--out", default="", help="results JSON (default: stdout)")
    args = p.parse_args(argv)
    doc = run(args)
    text = json.dumps(doc, indent=2) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    print(json.dumps(doc["summary"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
