"""What WatchInstances and ReportTraffic cost the controller.

* ``report``: controller CPU per ``ReportTraffic`` window (checks, adding it to its time
  buckets, the drift decision, the status write every ``status_write_s``; in process, no
  gRPC): four routers reporting every 10 s; one reporter flooding 1 ms windows; the most
  routers a deployment keeps data of
  (:data:`~controlplane.server.controller.demand.MAX_REPORTERS`) reporting every 10 s.
* ``fanout``: ``--watchers`` WatchInstances streams (gRPC on loopback) on a deployment of 8
  engine instances; one record changes: the time until every stream has the new message, and
  the controller's CPU for it; then a burst of 1,000 change notices that change nothing
  listed (what a rollout's acks and solves cause): how many times the instances are read
  again and the CPU that costs.

One process: a real controller (SQLite in a temporary directory, no reconcile loop), the
watchers' gRPC clients in the same process and event loop, so "CPU" is the whole process
(the clients' share included: an upper bound for the controller).

Run ``python -m bench.instances_watch --out bench/results/instances-watch.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
from mixfleet.v1 import engine_pb2, engine_pb2_grpc

from apis.cliargs import positive_int
from bench.common import package_versions, run_main, write_results
from controlplane.server.controller import endpoints
from controlplane.server.controller.demand import MAX_REPORTERS, Demands
from controlplane.server.controller.instance_records import (
    INSTANCE_KEY,
    INSTANCES_KEY,
    InstanceRecord,
)
from controlplane.server.controller.measured import TrafficWindow
from controlplane.server.inprocess import start_controller
from policies.serving.traffic import LengthDist, Slo, Traffic
from policies.spec.build import DeploymentSpec

PLANNED = DeploymentSpec(
    "p",
    model="mixtral-8x7b",
    traffic=Traffic(40.0, LengthDist(2000, 3000), LengthDist(400, 600)),
    slo=Slo(ttft_ms=1000, tpot_ms=50),
)
INSTANCES = 8


def _window(reporter: str, start_s: float, span_s: float, rps: float) -> TrafficWindow:
    return TrafficWindow(
        "p",
        reporter,
        start_s,
        start_s + span_s,
        round(rps * span_s),
        2000,
        3000,
        400,
        600,
        300,
        900,
        20,
        45,
    )


def _report_cost(demands: Demands, clock: list[float], windows: list[TrafficWindow]) -> float:
    """CPU per report over ``windows`` (the clock follows them), microseconds."""
    t0 = time.process_time()
    for w in windows:
        clock[0] = w.end_s + 1.0
        demands.report(w)
    return (time.process_time() - t0) / len(windows) * 1e6


async def _report(tmp: Path) -> dict[str, Any]:
    clock = [1_800_000_000.0]
    async with start_controller(tmp / "report", run_loop=False, clock=lambda: clock[0]) as ctl:
        ctl.controller.store.put_deployment(PLANNED, now_s=clock[0])
        demands = ctl.controller.demands
        t = clock[0]
        steady = [
            _window(f"router-{r}", t + 10.0 * k, 10.0, 10.0) for k in range(60) for r in range(4)
        ]
        typical_us = _report_cost(demands, clock, steady)
        t = steady[-1].end_s
        flood = [_window("flood", t + 0.001 * k, 0.001, 10.0) for k in range(10_000)]
        flood_us = _report_cost(demands, clock, flood)
        t = flood[-1].end_s
        many = [
            _window(f"r{r}", t + 10.0 * k, 10.0, 0.1)
            for k in range(7)
            for r in range(MAX_REPORTERS - 4)
        ]
        _report_cost(demands, clock, many[: -(MAX_REPORTERS - 4)])  # six buckets of them
        many_us = _report_cost(demands, clock, many[-(MAX_REPORTERS - 4) :])
        return {
            "cpu_us_per_report_4_routers_10s_windows": round(typical_us, 1),
            "cpu_us_per_report_1ms_windows_flood": round(flood_us, 1),
            "cpu_us_per_report_1000_routers": round(many_us, 1),
        }


def _setup_instances(ctl: Any) -> None:
    store, now = ctl.controller.store, ctl.controller.clock()
    store.put_deployment(PLANNED, now_s=now)
    names = []
    for i in range(INSTANCES):
        name = f"p-decode-{i}"
        names.append(name)
        r = InstanceRecord("p", "decode", "pool-0", "v", (f"n{i}",), 30000 + i, 0, 5.0, 64)
        store.put_deployment(DeploymentSpec(name, model="mixtral-8x7b"), now_s=now)
        store.set_deployment_status(name, {INSTANCE_KEY: r.to_status()})
    store.set_deployment_status("p", {INSTANCES_KEY: names})


async def _fanout(tmp: Path, watchers: int, rounds: int) -> dict[str, Any]:
    reads = [0]
    real = endpoints.instance_set

    def counted(*a: Any, **k: Any) -> endpoints.InstanceSet:
        reads[0] += 1
        return real(*a, **k)

    endpoints.instance_set = counted
    try:
        async with start_controller(tmp / "fanout", run_loop=False) as ctl:
            _setup_instances(ctl)
            store, c = ctl.controller.store, ctl.controller
            async with grpc.aio.insecure_channel(ctl.address) as ch:
                stub = engine_pb2_grpc.EngineServiceStub(ch)
                calls = [
                    stub.WatchInstances(engine_pb2.GetInstancesRequest(deployment="p"))
                    for _ in range(watchers)
                ]
                for call in calls:
                    await call.read()
                latencies, cpu = [], []
                for k in range(rounds):
                    r = InstanceRecord(
                        "p", "decode", "pool-0", "v", ("n0",), 30000, 0, 5.0 + k + 1, 64
                    )
                    t0, c0 = time.perf_counter(), time.process_time()
                    store.set_deployment_status("p-decode-0", {INSTANCE_KEY: r.to_status()})
                    c.changed("p-decode-0")
                    await asyncio.gather(*(call.read() for call in calls))
                    latencies.append(time.perf_counter() - t0)
                    cpu.append(time.process_time() - c0)
                reads[0] = 0
                c0 = time.process_time()
                for _ in range(1000):
                    c.changed("some-deployment")
                    await asyncio.sleep(0)
                await asyncio.sleep(0.5)
                burst_cpu = time.process_time() - c0
                burst_reads = reads[0]
                for call in calls:
                    call.cancel()
        return {
            "watchers": watchers,
            "instances": INSTANCES,
            "update_to_all_ms_median": round(statistics.median(latencies) * 1e3, 2),
            "update_to_all_ms_max": round(max(latencies) * 1e3, 2),
            "cpu_ms_per_update_median": round(statistics.median(cpu) * 1e3, 2),
            "burst_1000_notices_reads": burst_reads,
            "burst_1000_notices_cpu_ms": round(burst_cpu * 1e3, 1),
        }
    finally:
        endpoints.instance_set = real


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        (tmp / "report").mkdir()
        (tmp / "fanout").mkdir()
        report = asyncio.run(_report(tmp))
        fanout = asyncio.run(_fanout(tmp, args.watchers, args.rounds))
    return {
        "kind": "instances-watch",
        "command": f"python -m bench.instances_watch --watchers {args.watchers} --rounds "
        f"{args.rounds}" + (f" --out {args.out}" if args.out else ""),
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "machine": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
        },
        "packages": package_versions(["grpcio", "protobuf"]),
        "report": report,
        "fanout": fanout,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.instances_watch", description=__doc__, allow_abbrev=False
    )
    p.add_argument("--watchers", type=positive_int, default=100, help="WatchInstances streams")
    p.add_argument("--rounds", type=positive_int, default=20, help="record changes timed")
    p.add_argument("--out", metavar="PATH", help="results JSON file")
    p.add_argument("--json", action="store_true", help="print the results too")

    def body(args: argparse.Namespace) -> int:
        write_results(run(args), args)
        return 0

    return run_main(p, body, argv)


if __name__ == "__main__":
    sys.exit(main())
