"""``mixfleetctl controller run``: serve AgentService, PlanService and EngineService.

Runs the controller (:mod:`controlplane.server`) on ``--listen`` with the state store of
``--store`` until SIGINT/SIGTERM; prints ``listening on HOST:PORT`` once it serves. Health
probes (``--health-listen``) and leader election on a Lease (``--leader-elect``, Kubernetes
store) are :mod:`controlplane.cli.ha`'s; exit status 1 when the lease is lost.
"""

from __future__ import annotations

import argparse
import signal
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from apis.cliargs import non_negative_float, non_negative_int, positive_float, positive_int
from controlplane.cli.ha import add_ha_arguments
from controlplane.cli.output import Groups, add_group, add_leaf
from policies.defaults import DRAIN_GRACE_S, SGLANG_BOOTSTRAP_PORT, SGLANG_SERVER_PORT
from policies.errors import InputError

if TYPE_CHECKING:
    from controlplane.server.controller.measured import DemandSettings
    from controlplane.server.services import ServerOptions


def cmd_controller_run(args: argparse.Namespace) -> int:
    import asyncio

    from controlplane.server.logs import configure_logging

    configure_logging(args.log_format, args.log_level)
    return asyncio.run(_run_controller(args))


async def _run_controller(args: argparse.Namespace) -> int:
    import asyncio

    import structlog

    from controlplane.cli.ha import HighAvailability
    from controlplane.server.auth import DEV_MODE_WARNING
    from controlplane.server.controller import Controller, ControllerSettings
    from controlplane.server.services import check_options, create_server, mark_serving
    from controlplane.store import open_store

    options = _server_options(args)
    settings = ControllerSettings(
        heartbeat_interval_s=args.heartbeat_interval,
        node_lost_after_s=args.node_lost_after,
        contingency_max_nodes=args.contingency_max_nodes,
        demand=_demand_settings(args),
        drain_grace_s=args.drain_grace,
        engine_base_port=_tcp_port(args.engine_base_port, "--engine-base-port"),
        bootstrap_base_port=_tcp_port(args.bootstrap_base_port, "--bootstrap-base-port"),
    )
    # TLS files and the token file are checked before the store is opened: a refused start
    # creates no file.
    if check_options(args.listen, options).dev_mode:
        print(f"warning: {DEV_MODE_WARNING}", file=sys.stderr, flush=True)
    store = open_store(
        args.store, new=args.store_new, kubeconfig=args.kubeconfig, context=args.context
    )
    settings = replace(settings, curve_cache_dir=_curve_cache_dir(args, store))
    ha = await HighAvailability.start(args, store)  # probes; with --leader-elect: lead first
    if ha.stopped:  # SIGINT/SIGTERM while waiting as a standby
        await ha.close()
        store.close()
        return 0
    controller = Controller(store, settings=settings)
    server, port = create_server(args.listen, controller, options)
    if args.metrics_port is not None:
        controller.metrics.serve(args.metrics_port)
    await server.start()
    await mark_serving(server)
    await controller.start()
    host = args.listen.rsplit(":", 1)[0]
    log = structlog.get_logger("mixfleet.controller")
    log.info(
        "controller listening",
        address=f"{host}:{port}",
        store=args.store,
        tls=options.tls is not None,
        metrics_port=args.metrics_port,
    )
    print(f"listening on {host}:{port}", flush=True)
    await ha.serving()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    status = await ha.until(stop)
    if status:
        log.error("lost the leader lease; exiting so that the restart waits as a standby")
    log.info("controller stopping")
    await server.stop(grace=2.0)
    await controller.stop()
    await ha.close()  # after the last write: releases the lease
    store.close()
    return status


def _server_options(args: argparse.Namespace) -> ServerOptions:
    """The gRPC server's TLS files, token file and message limit (``--tls-*``,
    ``--token-file``, ``--insecure``, ``--max-message-mib``), not checked on disk yet.

    Raises:
        InputError: some but not all of the three TLS files are given.
    """
    from controlplane.server.services import ServerOptions, TlsFiles

    tls = None
    given = [args.tls_cert, args.tls_key, args.tls_ca]
    if any(given):
        if not all(given):
            raise InputError("give all three of --tls-cert, --tls-key and --tls-ca", field="--tls")
        tls = TlsFiles(Path(args.tls_cert), Path(args.tls_key), Path(args.tls_ca))
    return ServerOptions(
        tls=tls,
        token_file=Path(args.token_file) if args.token_file else None,
        insecure=args.insecure,
        max_receive_message_bytes=args.max_message_mib << 20,
    )


def _demand_settings(args: argparse.Namespace) -> DemandSettings:
    """When measured demand re-plans (``--drift-*``, ``--replan-min-interval``), checked.

    Raises:
        InputError: naming the flag.
    """
    from controlplane.server.controller.measured import DemandSettings

    demand = DemandSettings(
        drift_threshold=args.drift_threshold,
        sustain_s=args.drift_sustain,
        min_interval_s=args.replan_min_interval,
    )
    try:
        demand.check()
    except InputError as exc:
        flag = {"sustain_s": "--drift-sustain"}.get(exc.field or "", f"--{exc.field}")
        raise InputError(str(exc).split(": ", 1)[-1], field=flag) from exc
    return demand


def _tcp_port(port: int, flag: str) -> int:
    """``port`` when it is a TCP port (1-65535).

    Raises:
        InputError: naming ``flag``.
    """
    if not 0 < port < 65536:
        raise InputError(f"{port} is not a TCP port (1-65535)", field=flag)
    return port


def _add_instance_arguments(p: argparse.ArgumentParser) -> None:
    """``controller run``'s engine instances: drain grace and port bases."""
    p.add_argument(
        "--drain-grace",
        type=non_negative_float,
        default=DRAIN_GRACE_S,
        metavar="S",
        help="how long an engine instance the fleet plan dropped drains (routers send it no "
        "new request, its open ones finish) before its parts are removed, s; routers do not "
        "report when their streams end, so make it longer than the longest request "
        "(default %(default)s)",
    )
    p.add_argument(
        "--engine-base-port",
        type=positive_int,
        default=SGLANG_SERVER_PORT,
        metavar="PORT",
        help="lowest engine HTTP port given to an engine instance; each gets the lowest free "
        "one (default %(default)s, SGLang's --port)",
    )
    p.add_argument(
        "--bootstrap-base-port",
        type=positive_int,
        default=SGLANG_BOOTSTRAP_PORT,
        metavar="PORT",
        help="lowest SGLang bootstrap port given to a prefill instance (default %(default)s, "
        "SGLang's --disaggregation-bootstrap-port)",
    )


def _add_demand_arguments(p: argparse.ArgumentParser) -> None:
    """``controller run``'s re-planning on measured demand."""
    p.add_argument(
        "--drift-threshold",
        type=positive_float,
        default=0.25,
        metavar="F",
        help="re-plan a deployment planned for traffic and SLOs when the request rate routers "
        "measure leaves [planned/(1+F), planned*(1+F)] (default %(default)s)",
    )
    p.add_argument(
        "--drift-sustain",
        type=positive_float,
        default=60.0,
        metavar="S",
        help="... continuously for this long, with data all along, s (default %(default)s)",
    )
    p.add_argument(
        "--replan-min-interval",
        type=non_negative_float,
        default=300.0,
        metavar="S",
        help="shortest time between two re-plans of one deployment for its measured demand, s "
        "(default %(default)s)",
    )


def _curve_cache_dir(args: argparse.Namespace, store: object) -> str:
    """Where the fleet planner keeps its step curves: ``--curve-cache``, else next to the
    SQLite file (``<file>.curves``), else in memory ("")."""
    from controlplane.store.sqlite import SqliteStore

    if args.curve_cache:
        return str(Path(args.curve_cache).expanduser())
    if isinstance(store, SqliteStore):
        return str(store.path.with_name(f"{store.path.name}.curves"))
    return ""


def _add_store_arguments(p: argparse.ArgumentParser) -> None:
    """The state store options of ``controller run``: ``--store``, its kubeconfig and
    context, ``--store-new``."""
    p.add_argument(
        "--store",
        metavar="URL",
        default="sqlite:mixfleet-state.db",
        help="state store, sqlite:PATH or kubernetes:NAMESPACE (default %(default)s)",
    )
    p.add_argument(
        "--curve-cache",
        metavar="DIR",
        help="where the fleet planner keeps the step curves of deployments planned from "
        "their traffic and SLOs (default: PATH.curves next to the sqlite: store)",
    )
    p.add_argument(
        "--kubeconfig",
        metavar="FILE",
        help="kubeconfig of the kubernetes: store (default: in-cluster, then $KUBECONFIG or "
        "~/.kube/config)",
    )
    p.add_argument("--context", metavar="NAME", help="kubeconfig context (default: current)")
    p.add_argument(
        "--store-new",
        action="store_true",
        help="the sqlite store is new here: create the file when it is missing or empty, and "
        "accept a file other than the one last used at this path (without it such a store "
        "is refused: a fresh store would make every running deployment look deleted)",
    )


def register(groups: Groups) -> None:
    """Add the ``controller`` group."""
    ctl = add_group(groups, "controller", "run the controller", required=False)
    p = add_leaf(
        ctl,
        "run",
        cmd_controller_run,
        "serve AgentService, PlanService and EngineService",
        description="Run the controller until SIGINT/SIGTERM.",
    )
    p.add_argument(
        "--listen",
        metavar="HOST:PORT",
        default="127.0.0.1:7070",
        help="address to serve on (port 0 = any free port; default %(default)s)",
    )
    _add_store_arguments(p)
    p.add_argument("--tls-cert", metavar="PEM", help="server certificate")
    p.add_argument("--tls-key", metavar="PEM", help="server private key")
    p.add_argument("--tls-ca", metavar="PEM", help="CA of accepted client certificates")
    p.add_argument("--token-file", metavar="FILE", help="bearer tokens for the CLI and engines")
    p.add_argument(
        "--insecure", action="store_true", help="plaintext without TLS (loopback addresses only)"
    )
    p.add_argument(
        "--metrics-port",
        type=positive_int,
        metavar="PORT",
        help="serve Prometheus metrics on this port",
    )
    p.add_argument(
        "--heartbeat-interval",
        type=positive_float,
        default=5.0,
        metavar="S",
        help="agent heartbeat period, s (default %(default)s)",
    )
    p.add_argument(
        "--node-lost-after",
        type=positive_float,
        default=15.0,
        metavar="S",
        help="heartbeat silence before a node is lost, s (default %(default)s)",
    )
    p.add_argument(
        "--contingency-max-nodes",
        type=non_negative_int,
        default=32,
        metavar="N",
        help="keep a plan per single-node loss, solved in the background, for deployments on 2 "
        "to N nodes, so a node loss commits at once (0 = off; default %(default)s)",
    )
    _add_demand_arguments(p)
    _add_instance_arguments(p)
    p.add_argument(
        "--max-message-mib",
        type=positive_int,
        default=16,
        metavar="MIB",
        help="largest request accepted, MiB (default %(default)s)",
    )
    add_ha_arguments(p)
    p.add_argument("--log-format", choices=("json", "console"), default="json")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
