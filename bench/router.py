"""``mixfleet-router`` measured: added latency, short requests per second, share error, and
what the achieved shares do to the mixed-24 DeepSeek-V3 plan.

Run ``python -m bench.router --out bench/results/router.json`` (``make bench-router``).
To time on a quiet host and score with the solver here: ``--write-weights W.json`` here,
``taskset -c 0,1 python -m bench.router --weights-file W.json --out M.json`` there, then
``--measured M.json --out bench/results/router.json`` here.
Three processes on one host: the loopback test engine (tests/support/openai_engine.py), the
router (static instance, no controller; uvloop when installed, as ``--uvloop``) and the
client (this process). On a 2-core machine they compete for the cores: the figures are what
the router costs on such a machine, client and engine included in the contention.

``--baseline DIR`` also times the router of another checkout (DIR, e.g. a copy of an older
tree) in the same processes' company, and ``--rounds N`` repeats every timed pass N times
with the paths alternated (direct, baseline, router; then reversed), so both routers and
the direct path see the same moments of the host. Per level: percentiles over all rounds'
samples (``added_ms``), and the median over rounds of each round's added latency against
that round's direct run (``round_added_ms``, robust to one round that other work
disturbed). A negative added figure means the direct run was the disturbed one; the 500-
stream target is then reported as not decided (``met: null``).

* ``latency``: N concurrent SSE streams (100, 500, 2000), each ``chunks`` chunks spaced so
  the engine sends about ``chunk_rate`` chunks/s in all; once directly to the engine, once
  through the router, after a warm-up of one short request per stream (connections open,
  as kept-alive clients have them). Time to first byte is measured from the request's start; per chunk,
  from the engine's send time (``time.monotonic()`` in the chunk, one clock for the host)
  to its arrival. Added latency = router percentile - direct percentile.
* ``short``: closed-loop non-streamed requests with no generation (``max_tokens`` 0), 5 s,
  direct and through the router: requests/s.
* ``shares``: the router in front of a 24-rank engine with the plan's 24 DP weights; the
  achieved share of each rank (from ``/router/status``) against the planned share.
* ``cost_model``: the mixed-24 DeepSeek-V3 plan solved for SGLang with router weights, its
  predicted step time, the step time with the router's achieved shares and with SGLang's own
  equal balancing (:func:`policies.solve.rescore`, engine-faithful scoring).

The requests sent and the percentiles made of them are :mod:`bench.router_client`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import multiprocessing as mp
import os
import platform
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "proto")]

from bench.common import log, package_versions  # noqa: E402
from bench.router_client import (  # noqa: E402
    achieved_shares,
    added_ms,
    latency_level,
    pooled,
    round_added,
    short_rate,
)
from policies.errors import InputError  # noqa: E402

LEVELS = (100, 500, 2000)


# ------------------------------------------------------------------ child processes


def _use_uvloop() -> bool:
    try:
        import uvloop
    except ImportError:
        return False
    uvloop.install()
    return True


def _engine_main(q: Any, ranks: int, tokens_per_s: float) -> None:
    from support.openai_engine import LoopbackEngine

    _use_uvloop()

    async def serve() -> None:
        e = await LoopbackEngine(tokens_per_s=[tokens_per_s] * ranks, stamp=True).start()
        q.put(e.port)
        await asyncio.Event().wait()

    asyncio.run(serve())


def _router_main(q: Any, instance: str, queue_limit: int, tree: str = "") -> None:
    if tree:  # the router of another checkout (``--baseline``), imported before ours
        sys.path.insert(0, tree)
    from controlplane.router.proxy import Router
    from controlplane.router.settings import RouterSettings, check, parse_instance

    q.put(("uvloop", _use_uvloop()))
    settings = check(
        RouterSettings(
            instances=(parse_instance(instance, "default"),),
            listen_host="127.0.0.1",
            listen_port=0,
            queue_limit=queue_limit,
            health_interval_s=1.0,
        )
    )

    async def serve() -> None:
        from controlplane.router import proxy

        router = Router(settings)
        port = await router.start()
        tune = getattr(proxy, "tune_gc", None)  # as that checkout's console script runs it
        if tune is not None:
            tune()
        q.put(port)
        await asyncio.Event().wait()

    asyncio.run(serve())


class _Proc:
    """A child process that reports what it listens on."""

    def __init__(self, target: Any, *args: Any) -> None:
        ctx = mp.get_context("spawn")
        self.q = ctx.Queue()
        self.p = ctx.Process(target=target, args=(self.q, *args), daemon=True)
        self.p.start()

    def get(self, timeout_s: float = 60.0) -> Any:
        return self.q.get(timeout=timeout_s)

    def stop(self) -> None:
        self.p.terminate()
        self.p.join(10)


# ------------------------------------------------------------------ the plan


def _plan(policy: str) -> tuple[Any, Any, Any]:
    """(plan, request with router weights, request with SGLang's own balancing)."""
    from bench.placement import FLEETS, SCENARIOS, _request
    from controlplane.cli.files import read_fleet
    from policies.estimate.engines import EngineOptions, EngineSpec
    from policies.solve import solve

    s = SCENARIOS["mixed-24-decode"]
    base = _request(s, read_fleet(str(FLEETS / s.fleet)), policy, "engine")
    router = dataclasses.replace(
        base, engine=EngineSpec("sglang", options=EngineOptions(dp_balance="router"))
    )
    engine = dataclasses.replace(
        base, engine=EngineSpec("sglang", options=EngineOptions(dp_balance="engine"))
    )
    return solve(router).plan, router, engine


def _cost_model(plan: Any, router: Any, engine: Any, achieved: Sequence[float]) -> dict[str, Any]:
    from policies.solve import rescore

    n = len(plan.gpus)
    gpus = tuple(
        dataclasses.replace(g, dp_weight=a * n) for g, a in zip(plan.gpus, achieved, strict=True)
    )
    with_router = rescore(router, dataclasses.replace(plan, gpus=gpus)).plan.summary.step_time_us
    with_engine = rescore(engine, plan).plan.summary.step_time_us
    planned = plan.summary.step_time_us
    return {
        "planned_step_ms": round(planned / 1e3, 3),
        "router_achieved_step_ms": round(with_router / 1e3, 3),
        "engine_balancing_step_ms": round(with_engine / 1e3, 3),
        "router_vs_planned": round(with_router / planned - 1, 4),
        "engine_vs_planned": round(with_engine / planned - 1, 4),
    }


# ------------------------------------------------------------------ run


def _routers(inst: str, baseline: str) -> dict[str, _Proc]:
    """The router of this checkout ("router") and, with ``--baseline``, that one's."""
    procs = {"router": _Proc(_router_main, inst, 1 << 20)}
    if baseline:
        procs["baseline"] = _Proc(_router_main, inst, 1 << 20, baseline)
    return procs


def _order(names: Sequence[str], round_: int) -> list[str]:
    """Every path once per round; odd rounds reversed, so no path always runs first."""
    return list(names) if round_ % 2 == 0 else list(reversed(names))


def _latency(
    levels: Sequence[int], chunks: int, chunk_rate: float, rounds: int, baseline: str
) -> tuple[list[Any], bool]:
    rows = []
    uv = False
    for streams in levels:
        rate = chunk_rate / streams  # tokens/s of each stream
        engine = _Proc(_engine_main, 8, rate)
        port = engine.get()
        procs = _routers(f"url=http://127.0.0.1:{port},ranks=8", baseline)
        urls = {"direct": f"http://127.0.0.1:{port}"}
        for name, proc in procs.items():
            uv = bool(proc.get()[1])
            urls[name] = f"http://127.0.0.1:{proc.get()}"
        time.sleep(0.5)
        runs: dict[str, list[dict[str, Any]]] = {n: [] for n in urls}
        loads = []
        try:
            for url in urls.values():
                # untimed pass: the processes' first requests run cold code paths
                asyncio.run(latency_level(url, min(streams, 100), 2, chunk_rate))
            for i in range(rounds):
                for name in _order(list(urls), i):
                    runs[name].append(
                        asyncio.run(latency_level(urls[name], streams, chunks, chunk_rate))
                    )
                loads.append(round(os.getloadavg()[0], 2))
        finally:
            for proc in procs.values():
                proc.stop()
            engine.stop()
        row: dict[str, Any] = {"streams": streams, "load_average_1m": loads}
        row.update({name: pooled(r) for name, r in runs.items()})
        row["added_ms"] = added_ms(row["router"], row["direct"])
        row["round_added_ms"] = round_added(runs, "router")
        if baseline:
            row["baseline_added_ms"] = added_ms(row["baseline"], row["direct"])
            row["baseline_round_added_ms"] = round_added(runs, "baseline")
        rows.append(row)
        log(f"latency {streams:5d} streams: added {row['round_added_ms']['median']}")
        if baseline:
            log(f"{streams:5d} streams, baseline: added {row['baseline_round_added_ms']['median']}")
    return rows, uv


def _short_part(seconds: float, rounds: int, baseline: str) -> dict[str, Any]:
    engine = _Proc(_engine_main, 8, 1e9)
    port = engine.get()
    procs = _routers(f"url=http://127.0.0.1:{port},ranks=8", baseline)
    urls = {"direct": f"http://127.0.0.1:{port}"}
    for name, proc in procs.items():
        proc.get()
        urls[name] = f"http://127.0.0.1:{proc.get()}"
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in urls}
    try:
        for i in range(rounds):
            for name in _order(list(urls), i):
                runs[name].append(asyncio.run(short_rate(urls[name], seconds / rounds, 64)))
    finally:
        for proc in procs.values():
            proc.stop()
        engine.stop()
    return {
        name: {
            # the mean of the rounds' rates: every round runs the same time
            "requests_per_s": round(sum(r["requests_per_s"] for r in rs) / len(rs), 1),
            "errors": sum(r["errors"] for r in rs),
            "clients": 64,
            "rounds": [r["requests_per_s"] for r in rs],
        }
        for name, rs in runs.items()
    }


def _shares_part(weights: Sequence[float], requests: int) -> dict[str, Any]:
    planned = [w / sum(weights) for w in weights]
    engine = _Proc(_engine_main, len(weights), 2000.0)
    port = engine.get()
    inst = f"url=http://127.0.0.1:{port},weights=" + ":".join(f"{w:.9f}" for w in weights)
    rt = _Proc(_router_main, inst, 1 << 20)
    rt.get()
    rport = rt.get()
    try:
        achieved = asyncio.run(achieved_shares(f"http://127.0.0.1:{rport}", requests, 48))
    finally:
        rt.stop()
        engine.stop()
    error = max(abs(a - p) for a, p in zip(achieved, planned, strict=True))
    return {
        "weights": list(weights),
        "planned": [round(x, 5) for x in planned],
        "achieved": [round(x, 5) for x in achieved],
        "max_abs_error": round(error, 5),
    }


def measure(args: argparse.Namespace, weights: Sequence[float]) -> dict[str, Any]:
    """The timed parts (latency, short requests, shares) on this machine."""
    levels = tuple(int(x) for x in args.streams.split(","))
    if not levels or min(levels) < 1:
        raise InputError("must be positive integers, e.g. 100,500,2000", field="--streams")
    started = time.time()
    load_before = os.getloadavg()
    if args.rounds < 1:
        raise InputError("must be >= 1", field="--rounds")
    if args.baseline and not (Path(args.baseline) / "controlplane" / "router").is_dir():
        raise InputError(
            f"{args.baseline!r} has no controlplane/router; give a checkout of mixfleet",
            field="--baseline",
        )
    latency, uv = _latency(levels, args.chunks, args.chunk_rate, args.rounds, args.baseline)
    short = _short_part(args.short_s, args.rounds, args.baseline)
    log(f"short requests/s: {short}")
    shares = _shares_part(weights, args.share_requests)
    log(f"share error {shares['max_abs_error']}")
    return {
        "command": "python -m bench.router " + " ".join(sys.argv[1:]),
        "label": args.label,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpu_count": os.cpu_count(),
            "cpus_usable": len(os.sched_getaffinity(0)),
            "python": platform.python_version(),
            "uvloop_used": uv,
            **package_versions(["aiohttp", "uvloop"]),
            "load_average_1m": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
            "cpus": sorted(os.sched_getaffinity(0)),
        },
        "settings": {
            "chunks": args.chunks,
            "chunk_rate_per_s": args.chunk_rate,
            "short_s": args.short_s,
            "share_requests": args.share_requests,
            "rounds": args.rounds,
            "baseline": "another checkout's router (--baseline)" if args.baseline else "",
        },
        "latency": latency,
        "short": short,
        "shares": shares,
        "wall_s": round(time.time() - started, 1),
    }


def _targets(doc: dict[str, Any]) -> dict[str, Any]:
    at500 = next((r for r in doc["latency"] if r["streams"] == 500), None)
    p99: float | None = None
    latency: dict[str, Any] = {"target": 5.0, "value": None, "met": False}
    if at500 is not None:
        added = at500["added_ms"]
        values = (added["ttfb_ms"]["p99"], added["chunk_lag_ms"]["p99"])
        p99 = max(values)
        latency.update(value=p99, met=p99 <= 5)
        if min(values) < 0:
            # the direct run was the slower one: other work on the host disturbed it, and
            # the difference says nothing about the router
            latency.update(met=None, note="not decided: an added p99 is negative")
    rps = doc["short"]["router"]["requests_per_s"]
    err = doc["shares"]["max_abs_error"]
    return {
        "p99_added_ms_at_500": latency,
        "short_requests_per_s": {"target": 2000.0, "value": rps, "met": rps >= 2000.0},
        "share_error": {"target": 0.02, "value": err, "met": err <= 0.02},
    }


def _write(doc: dict[str, Any], out: str | None) -> None:
    """``doc`` as indented JSON: to the file ``out`` (its folder made) when given, else on
    stdout."""
    text = json.dumps(doc, indent=2) + "\n"
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)
    else:
        sys.stdout.write(text)


def _run_peers(args: argparse.Namespace) -> int:
    """``--peers``: mixfleet-router against sglang-router and vllm-router
    (:mod:`bench.router_peers`)."""
    from bench.router_peers import run as run_peers

    if args.rounds < 1:
        raise InputError("must be >= 1", field="--rounds")
    args.streams = args.streams or "100,500"
    _write(run_peers(args), args.out)
    return 0


def run(args: argparse.Namespace) -> int:
    """Measure here (or read ``--measured``), then add the cost model (needs the solver)."""
    if args.peers:
        return _run_peers(args)
    args.streams = args.streams or ",".join(map(str, LEVELS))
    if args.weights_file:
        doc_w = json.loads(Path(args.weights_file).read_text())
        weights = [float(w) for w in doc_w["weights"]]
        plan = None
    else:
        plan, req_router, req_engine = _plan(args.policy)
        weights = [g.dp_weight for g in plan.gpus]
    if args.write_weights:
        Path(args.write_weights).write_text(json.dumps({"weights": weights}) + "\n")
        return 0
    if args.measured:
        doc = json.loads(Path(args.measured).read_text())
        if doc["shares"]["weights"] != weights:
            raise InputError("was measured with other weights than this plan's", field="--measured")
        doc["cost_command"] = "python -m bench.router " + " ".join(sys.argv[1:])
    else:
        doc = measure(args, weights)
    if plan is not None:
        cost = _cost_model(plan, req_router, req_engine, doc["shares"]["achieved"])
        doc["cost_model"] = {
            "scenario": "mixed-24-decode",
            "model": "deepseek-v3",
            "engine": "sglang",
            "policy": args.policy,
            **cost,
        }
        log(f"cost model {cost}")
    doc["targets"] = _targets(doc)
    _write(doc, args.out)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from bench.common import run_main

    p = argparse.ArgumentParser(
        prog="python -m bench.router", description=__doc__.split("\n")[0], allow_abbrev=False
    )
    p.add_argument(
        "--streams", default="", metavar="N,N,...", help="default 100,500,2000 (--peers: 100,500)"
    )
    p.add_argument("--chunks", type=int, default=10, help="chunks per stream")
    p.add_argument(
        "--chunk-rate",
        type=float,
        default=2000.0,
        metavar="PER_S",
        help="chunks per second the engine sends in all",
    )
    p.add_argument("--short-s", type=float, default=5.0, metavar="S")
    p.add_argument("--share-requests", type=int, default=4000, metavar="N")
    p.add_argument("--policy", default="ilp", choices=("greedy", "ilp"))
    p.add_argument("--label", default="", help="free text stored in the results (what was run)")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        metavar="N",
        help="timed passes per level, paths alternated; percentiles over all their samples",
    )
    p.add_argument(
        "--baseline",
        default="",
        metavar="DIR",
        help="also time the router of the checkout DIR, interleaved with this one",
    )
    p.add_argument(
        "--peers",
        action="store_true",
        help="compare with sglang-router and vllm-router in one run (bench/router_peers.py)",
    )
    p.add_argument(
        "--peers-venv",
        default="bench/.peers-venv",
        metavar="DIR",
        help="virtual environment of the peers (made from PyPI when a peer is missing)",
    )
    p.add_argument(
        "--paths",
        default="mixfleet,mixfleet-w2,sglang,vllm",
        metavar="A,B",
        help="--peers: routers to run",
    )
    p.add_argument("--seconds", type=float, default=10.0, metavar="S", help="--peers: per path")
    p.add_argument(
        "--pin",
        default="",
        metavar="ROLE=CPUS;...",
        help="--peers: CPUs per role, e.g. 'router=0-1;engines=2-3;client=4-7' (each router "
        "gets the router CPUs; default: unpinned)",
    )
    p.add_argument("--log-dir", default="", metavar="DIR", help="--peers: the routers' logs")
    p.add_argument("--out", metavar="PATH")
    p.add_argument("--write-weights", metavar="PATH", help="solve, write the plan's weights, stop")
    p.add_argument("--weights-file", metavar="PATH", help="measure with these weights (no solve)")
    p.add_argument("--measured", metavar="PATH", help="take the timed parts from this results file")
    return run_main(p, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
