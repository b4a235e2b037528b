"""Command line of the operator: ``mixfleet-operator run`` (the console script), also
``python -m operators run``.

    mixfleet-operator run --namespace team-a --namespace team-b \\
        --lease-namespace mixfleet-system --identity "$POD_NAME" --health-listen 0.0.0.0:8081

In a pod the Kubernetes connection comes from the service account; elsewhere from
``--kubeconfig`` or ``~/.kube/config``. The gRPC health service answers ``""`` (ready: every
informer listed once and the loops are alive) and ``liveness`` (the loops are alive), for
the kubelet's gRPC probes. ``mixfleet.operator.Leader`` is SERVING on the leader only.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import uuid
from collections.abc import Sequence
from typing import Any

import structlog

from apis.cliargs import (
    RawDescriptionDefaultsHelpFormatter,
    StrictParser,
    add_version_arg,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)
from apis.kube.client import Kube, api_client_from
from apis.kube.leader import LeaderSettings
from apis.logsink import stderr_logger
from operators.observe import ReconcileSettings
from operators.operator import Operator, OperatorSettings
from policies.defaults import DRAIN_GRACE_S
from policies.errors import MixfleetError

LEVELS = ("debug", "info", "warning", "error")
HEALTH_LEADER_SERVICE = "mixfleet.operator.Leader"


def configure_logging(level: str = "info") -> None:
    """structlog JSON lines on stderr."""
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=stderr_logger,
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(level=level.upper(), stream=sys.stderr)


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``run``."""
    p.add_argument(
        "--kubeconfig", help="kubeconfig file (default: in-cluster, then ~/.kube/config)"
    )
    p.add_argument("--context", help="kubeconfig context")
    p.add_argument(
        "--namespace",
        action="append",
        default=[],
        help="serve ModelDeployments of this namespace (repeat; default: all namespaces)",
    )
    p.add_argument(
        "--default-policy",
        default="default",
        help="PlacementPolicy for deployments without policyRef",
    )
    p.add_argument("--workers", type=positive_int, default=2, help="reconciles at once")
    p.add_argument(
        "--field-manager", default="mixfleet-operator", help="server-side apply field manager"
    )
    p.add_argument(
        "--node-stale-after-s",
        type=positive_float,
        default=90.0,
        help="GPUNode heartbeat age that excludes a node, s",
    )
    p.add_argument(
        "--plan-history", type=positive_int, default=3, help="PartitionPlans kept per deployment"
    )
    p.add_argument(
        "--namespace-quota",
        action="append",
        default=[],
        metavar="NAMESPACE=GPUS",
        help="most GPUs a namespace's ModelDeployments may hold together (repeatable)",
    )
    p.add_argument(
        "--drain-grace",
        type=non_negative_float,
        default=DRAIN_GRACE_S,
        metavar="S",
        help="how long an engine instance the fleet plan dropped drains (routers send it no "
        "new request, its open ones finish) before its ModelDeployment is deleted, s; "
        "routers do not report when their streams end, so make it longer than the longest "
        "request (default %(default)s)",
    )
    p.add_argument(
        "--curve-cache",
        default="",
        metavar="DIR",
        help="where the fleet planner keeps the step curves of ModelDeployments planned from "
        "their traffic and SLOs, so that a restarted operator reads them instead of computing "
        "them again (the chart mounts a volume there); default: in memory only",
    )
    p.add_argument(
        "--resync-period-s",
        type=positive_float,
        default=300.0,
        help="reconcile everything this often, s",
    )
    add_leader_arguments(p)
    p.add_argument(
        "--health-listen",
        default="127.0.0.1:8081",
        help="gRPC health address (the chart passes 0.0.0.0:PORT for the kubelet); '' to disable",
    )
    p.add_argument(
        "--metrics-port", type=non_negative_int, default=9090, help="Prometheus port; 0 to disable"
    )
    p.add_argument(
        "--metrics-address",
        default="127.0.0.1",
        help="Prometheus address (the chart passes 0.0.0.0 for the scraper)",
    )
    p.add_argument("--log-level", default="info", choices=LEVELS)


def add_leader_arguments(p: argparse.ArgumentParser) -> None:
    """The leader election options of ``run`` (the Lease and its timings, s)."""
    p.add_argument("--no-leader-election", action="store_true", help="run alone (one replica only)")
    p.add_argument("--lease-name", default="mixfleet-operator")
    p.add_argument(
        "--lease-namespace",
        default=os.environ.get("POD_NAMESPACE", "mixfleet-system"),
        help="namespace of the Lease (default $POD_NAMESPACE)",
    )
    p.add_argument(
        "--identity",
        default=os.environ.get("POD_NAME") or f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}",
        help="this replica's id in the Lease (default $POD_NAME, else host name and a "
        "random suffix)",
    )
    p.add_argument("--lease-duration-s", type=positive_float, default=15.0)
    p.add_argument("--renew-deadline-s", type=positive_float, default=10.0)
    p.add_argument("--retry-period-s", type=positive_float, default=2.0)


def settings_from(args: argparse.Namespace) -> OperatorSettings:
    """Operator settings from parsed ``run`` arguments."""
    leader = None
    if not args.no_leader_election:
        leader = LeaderSettings(
            lease_name=args.lease_name,
            namespace=args.lease_namespace,
            identity=args.identity,
            lease_duration_s=args.lease_duration_s,
            renew_deadline_s=args.renew_deadline_s,
            retry_period_s=args.retry_period_s,
        )
    return OperatorSettings(
        field_manager=args.field_manager,
        namespaces=tuple(args.namespace),
        default_policy=args.default_policy,
        workers=args.workers,
        resync_period_s=args.resync_period_s,
        reconcile=ReconcileSettings(
            node_stale_after_s=args.node_stale_after_s,
            plan_history=args.plan_history,
            field_manager=args.field_manager,
        ),
        leader=leader,
        namespace_quotas_gpus=namespace_quotas(args.namespace_quota),
        drain_grace_s=args.drain_grace,
        curve_cache_dir=args.curve_cache,
    )


def namespace_quotas(items: Sequence[str]) -> dict[str, int]:
    """``--namespace-quota NS=GPUS`` flags as namespace -> GPUs."""
    from policies.scheduling.fields import parse_quotas

    return parse_quotas(items, "--namespace-quota")


def serve_health(op: Operator, address: str, stop: threading.Event) -> Any:
    """Start a gRPC health server reflecting the operator's state; returns the server."""
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_insecure_port(address)
    server.start()
    serving = health_pb2.HealthCheckResponse.SERVING
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING

    def update() -> None:
        while not stop.is_set():
            alive = op.healthy()
            servicer.set("liveness", serving if alive else not_serving)
            servicer.set("", serving if alive and op.ready() else not_serving)
            servicer.set(HEALTH_LEADER_SERVICE, serving if op.is_leader() else not_serving)
            stop.wait(2.0)

    threading.Thread(target=update, name="health", daemon=True).start()
    return server


def run(args: argparse.Namespace) -> int:
    """``run``: serve until SIGTERM or SIGINT; returns the exit status."""
    configure_logging(args.log_level)
    log = structlog.get_logger("mixfleet.operator")
    settings = settings_from(args)
    api = api_client_from(args.kubeconfig, context=args.context)
    api.user_agent = f"mixfleet-operator/{settings.leader.identity if settings.leader else 'solo'}"
    op = Operator(Kube(api, field_manager=settings.field_manager), settings)
    stop = threading.Event()
    health_server = serve_health(op, args.health_listen, stop) if args.health_listen else None
    if args.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port, addr=args.metrics_address)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    op.start()
    log.info(
        "operator started",
        namespaces=list(settings.namespaces) or "all",
        leader_election=settings.leader is not None,
    )
    stop.wait()
    log.info("operator stopping")
    op.stop()
    if health_server is not None:
        health_server.stop(grace=2.0)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The operator's command line (``run`` and its options)."""
    parser = StrictParser(
        prog="python -m operators",
        description=__doc__,
        formatter_class=RawDescriptionDefaultsHelpFormatter,
    )
    add_version_arg(parser, "mixfleet-operator")
    sub = parser.add_subparsers(dest="command", required=True)
    run_p = sub.add_parser("run", help="reconcile ModelDeployments until stopped")
    add_run_arguments(run_p)
    run_p.set_defaults(handler=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``mixfleet-operator ...`` / ``python -m operators ...``; returns the exit status:
    0 stopped by a signal, 1 a failure (one ``error:`` line on stderr, no traceback), 2 a
    bad command line."""
    args = build_parser().parse_args(argv)
    try:
        status: int = args.handler(args)
    except MixfleetError as exc:  # no Kubernetes configuration, bad settings
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return status
