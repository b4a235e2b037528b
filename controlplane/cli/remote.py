"""``mixfleetctl`` commands that run or talk to a controller.

* ``controller run --listen HOST:PORT --store sqlite:PATH`` - run the controller;
* ``certs init DIR`` - a development CA, certificates and token file;
* ``nodes list|show``, ``deploy apply -f FILE|get|delete``, ``plans list|show|diff|history``,
  ``watch`` - PlanService clients. Table output by default, ``-o json`` for scripts.

Connection options (accepted before the command, ``mixfleetctl --controller ADDR nodes list``,
when the main parser adds them with :func:`add_connection_args`, and after it on every
client command): ``--controller`` (env ``MIXFLEET_CONTROLLER``, default ``127.0.0.1:7070``),
``--token-file`` (env ``MIXFLEET_TOKEN_FILE``; its first admin, else viewer, token is sent),
``--token`` (env ``MIXFLEET_TOKEN``), ``--tls-ca`` / ``--tls-cert`` / ``--tls-key`` (mutual
TLS; plaintext without ``--tls-ca``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import yaml
from google.protobuf import json_format
from google.protobuf.message import Message
from mixfleet.v1 import plan_pb2, plan_pb2_grpc

from apis.wire.deployment import spec_to_proto
from controlplane.wire.plans import DEPLOYMENT_PHASE_NAMES, NODE_HEALTH_NAMES, PLAN_STATE_NAMES
from policies.errors import InputError, MixfleetError
from policies.spec import parse_deployment

DEFAULT_CONTROLLER = "127.0.0.1:7070"
Handler = Callable[[argparse.Namespace], int]


# =========================================================================== connection


def add_connection_args(parser: argparse.ArgumentParser, *, suppress: bool = False) -> None:
    """Add ``--controller``, ``--token-file``, ``--token``, ``--tls-*`` to ``parser``.

    With ``suppress`` the options leave no default behind, so a value given before the
    command is not overwritten by a subcommand's default.
    """
    default: Any = argparse.SUPPRESS if suppress else None
    g = parser.add_argument_group("controller connection")
    g.add_argument(
        "--controller",
        metavar="ADDR",
        default=default,
        help=f"controller HOST:PORT (env MIXFLEET_CONTROLLER; default {DEFAULT_CONTROLLER})",
    )
    g.add_argument(
        "--token-file",
        metavar="FILE",
        default=default,
        help="bearer token file (env MIXFLEET_TOKEN_FILE)",
    )
    g.add_argument(
        "--token", metavar="TOKEN", default=default, help="bearer token (env MIXFLEET_TOKEN)"
    )
    g.add_argument("--tls-ca", metavar="PEM", default=default, help="CA of the controller")
    g.add_argument("--tls-cert", metavar="PEM", default=default, help="client certificate")
    g.add_argument("--tls-key", metavar="PEM", default=default, help="client key")


def _opt(args: argparse.Namespace, name: str, env: str | None = None) -> str | None:
    value = getattr(args, name, None)
    if value is None and env:
        value = os.environ.get(env) or None
    return value


def _token(args: argparse.Namespace) -> str | None:
    token = _opt(args, "token", "MIXFLEET_TOKEN")
    if token:
        return token
    path = _opt(args, "token_file", "MIXFLEET_TOKEN_FILE")
    if not path:
        return None
    from controlplane.server.certs import token_for

    for role in ("admin", "viewer", "engine"):
        with contextlib.suppress(InputError):
            return token_for(path, role)
    raise InputError(f"no token in {path}", field="--token-file")


def channel(args: argparse.Namespace) -> grpc.Channel:
    """A (blocking) channel to the controller from the connection options."""
    address = _opt(args, "controller", "MIXFLEET_CONTROLLER") or DEFAULT_CONTROLLER
    ca = _opt(args, "tls_ca")
    options = [("grpc.max_receive_message_length", 64 << 20)]
    if ca is None:
        return grpc.insecure_channel(address, options=options)
    cert, key = _opt(args, "tls_cert"), _opt(args, "tls_key")
    try:
        creds = grpc.ssl_channel_credentials(
            root_certificates=Path(ca).read_bytes(),
            private_key=Path(key).read_bytes() if key else None,
            certificate_chain=Path(cert).read_bytes() if cert else None,
        )
    except OSError as exc:
        raise InputError(f"cannot read TLS files: {exc}", field="--tls-ca") from exc
    return grpc.secure_channel(address, creds, options=options)


def _metadata(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    token = _token(args)
    return (("authorization", f"Bearer {token}"),) if token else ()


def _call(args: argparse.Namespace, fn: Callable[[plan_pb2_grpc.PlanServiceStub, Any], Any]) -> Any:
    """Run one PlanService call, turning gRPC errors into the CLI's errors."""
    with channel(args) as ch:
        stub = plan_pb2_grpc.PlanServiceStub(ch)
        try:
            return fn(stub, _metadata(args))
        except grpc.RpcError as exc:
            raise _rpc_error(args, exc) from exc


def _rpc_error(args: argparse.Namespace, exc: grpc.RpcError) -> MixfleetError:
    code: grpc.StatusCode = exc.code()
    details: str = exc.details() or ""
    address = _opt(args, "controller", "MIXFLEET_CONTROLLER") or DEFAULT_CONTROLLER
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InputError(details)
    if code == grpc.StatusCode.UNAVAILABLE:
        return MixfleetError(
            f"cannot reach the controller at {address} ({details}). To fix: check --controller "
            "and that 'mixfleetctl controller run' is up"
        )
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return MixfleetError(f"{details}")
    return MixfleetError(f"{code.name.lower()}: {details}")


# =========================================================================== output


def _to_json(msg: Message) -> dict[str, Any]:
    return json_format.MessageToDict(msg, preserving_proto_field_name=True)


def _print_json(doc: Any) -> None:
    print(json.dumps(doc, indent=2, sort_keys=False))


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Rows as left-aligned columns."""
    cells = [[str(h) for h in headers], *[[str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells
    )


def _age(unix_s: float) -> str:
    if unix_s <= 0:
        return "-"
    s = max(0.0, dt.datetime.now(dt.UTC).timestamp() - unix_s)
    if s < 120:
        return f"{s:.0f}s"
    if s < 7200:
        return f"{s / 60:.0f}m"
    return f"{s / 3600:.1f}h"


def _ms(us: float) -> str:
    return f"{us / 1000:.2f}" if us else "-"


# =========================================================================== controller run


def cmd_controller_run(args: argparse.Namespace) -> int:
    from controlplane.server.logs import configure_logging

    configure_logging(args.log_format, args.log_level)
    return asyncio.run(_run_controller(args))


async def _run_controller(args: argparse.Namespace) -> int:
    import structlog

    from controlplane.server.controller import Controller, ControllerSettings
    from controlplane.server.services import ServerOptions, TlsFiles, create_server, mark_serving
    from controlplane.store import open_store

    tls = None
    given = [args.tls_cert, args.tls_key, args.tls_ca]
    if any(given):
        if not all(given):
            raise InputError("give all three of --tls-cert, --tls-key and --tls-ca", field="--tls")
        tls = TlsFiles(Path(args.tls_cert), Path(args.tls_key), Path(args.tls_ca))
    settings = ControllerSettings(
        heartbeat_interval_s=args.heartbeat_interval,
        node_lost_after_s=args.node_lost_after,
    )
    store = open_store(args.store)
    controller = Controller(store, settings=settings)
    options = ServerOptions(
        tls=tls,
        token_file=Path(args.token_file) if args.token_file else None,
        insecure=args.insecure,
        max_receive_message_bytes=args.max_message_mib << 20,
    )
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
        tls=tls is not None,
        metrics_port=args.metrics_port,
    )
    print(f"listening on {host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("controller stopping")
    await server.stop(grace=2.0)
    await controller.stop()
    store.close()
    return 0


def cmd_certs_init(args: argparse.Namespace) -> int:
    from controlplane.server.certs import init_dev_pki

    out = init_dev_pki(args.dir, sans=args.san or (), force=args.force)
    print(f"wrote a development CA, certificates and tokens to {out}")
    print(
        "  controller: --tls-cert server.pem --tls-key server-key.pem --tls-ca ca.pem "
        "--token-file tokens"
    )
    print("  agents:     --tls-cert agent.pem --tls-key agent-key.pem --tls-ca ca.pem")
    print(
        "  mixfleetctl: --tls-cert admin.pem --tls-key admin-key.pem --tls-ca ca.pem "
        "--token-file tokens"
    )
    return 0


# =========================================================================== nodes


def cmd_nodes_list(args: argparse.Namespace) -> int:
    reply = _call(args, lambda s, md: s.ListNodes(plan_pb2.ListNodesRequest(), metadata=md))
    if args.output == "json":
        _print_json(_to_json(reply)["nodes"] if reply.nodes else [])
        return 0
    rows = []
    for n in reply.nodes:
        inv = n.inventory
        models = sorted({g.catalog_model or g.name for g in inv.gpus})
        rows.append(
            [
                inv.node,
                NODE_HEALTH_NAMES.get(n.health, "?"),
                f"{n.healthy_gpus}/{len(inv.gpus)}",
                ",".join(models),
                ",".join(f"{k}={v}" for k, v in sorted(inv.labels.items())) or "-",
                "yes" if inv.simulated else "no",
                _age(n.last_heartbeat_unix_s),
            ]
        )
    print(table(["NODE", "HEALTH", "GPUS", "MODELS", "LABELS", "SIMULATED", "SEEN"], rows))
    return 0


def cmd_nodes_show(args: argparse.Namespace) -> int:
    n = _call(args, lambda s, md: s.GetNode(plan_pb2.GetNodeRequest(name=args.name), metadata=md))
    if args.output == "json":
        _print_json(_to_json(n))
        return 0
    inv = n.inventory
    print(f"node:      {inv.node}")
    print(f"health:    {NODE_HEALTH_NAMES.get(n.health, '?')}  {n.message}".rstrip())
    print(
        f"agent:     {inv.agent_version}{' (simulated)' if inv.simulated else ''}"
        f"  discovered by {','.join(inv.discovered_by) or '-'}"
    )
    print(f"labels:    {dict(inv.labels) or '-'}")
    print(f"seen:      {_age(n.last_heartbeat_unix_s)} ago")
    print(f"applied:   {dict(n.applied) or '-'}")
    rows = []
    for g in inv.gpus:
        nv = sum(1 for link in g.nvlinks if link.active)
        rows.append(
            [
                g.index,
                g.catalog_model or g.name,
                g.uuid,
                f"{g.memory_bytes / 2**30:.0f}",
                f"{g.hbm_bandwidth_gbytes_per_s:.0f}",
                nv,
                g.nvlink_domain if g.HasField("nvlink_domain") else "-",
            ]
        )
    print(table(["GPU", "MODEL", "UUID", "MEM_GIB", "HBM_GBS", "NVLINKS", "DOMAIN"], rows))
    if inv.nics:
        print(
            table(
                ["NIC", "PORT", "GBIT/S", "STATE", "LAYER", "FABRIC"],
                [
                    [c.device, c.port, f"{c.rate_per_direction_gbits_per_s:g}", c.state, c.link_layer, c.fabric]
                    for c in inv.nics
                ],
            )
        )
    return 0


# =========================================================================== deploy


def _read_docs(path: str) -> Iterator[Any]:
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc}", field="-f") from exc
    try:
        yield from (d for d in yaml.safe_load_all(text) if d is not None)
    except yaml.YAMLError as exc:
        raise InputError(f"{path} is not valid YAML: {exc}", field="-f") from exc


def cmd_deploy_apply(args: argparse.Namespace) -> int:
    specs = [parse_deployment(doc) for doc in _read_docs(args.file)]
    if not specs:
        raise InputError(f"{args.file} holds no deployment", field="-f")
    for spec in specs:
        req = plan_pb2.ApplyDeploymentRequest(spec=spec_to_proto(spec))

        def apply(
            s: plan_pb2_grpc.PlanServiceStub,
            md: Any,
            r: plan_pb2.ApplyDeploymentRequest = req,
        ) -> plan_pb2.Deployment:
            reply: plan_pb2.Deployment = s.ApplyDeployment(r, metadata=md)
            return reply

        d = _call(args, apply)
        if args.output == "json":
            _print_json(_to_json(d))
        else:
            print(f"deployment/{d.spec.name} applied (generation {d.generation})")
    return 0


def cmd_deploy_get(args: argparse.Namespace) -> int:
    if args.name:
        ds = [
            _call(
                args,
                lambda s, md: s.GetDeployment(
                    plan_pb2.GetDeploymentRequest(name=args.name), metadata=md
                ),
            )
        ]
    else:
        reply = _call(
            args, lambda s, md: s.ListDeployments(plan_pb2.ListDeploymentsRequest(), metadata=md)
        )
        ds = list(reply.deployments)
    if args.output == "json":
        docs = [_to_json(d) for d in ds]
        _print_json(docs[0] if args.name else docs)
        return 0
    rows = []
    for d in ds:
        st = d.status
        rows.append(
            [
                d.spec.name,
                d.spec.model or "(config)",
                d.spec.policy,
                d.spec.form,
                DEPLOYMENT_PHASE_NAMES.get(st.phase, "?"),
                st.committed_version or "-",
                st.latest_version or "-",
                _ms(st.step_time_us),
                f"{st.cost_per_million_tokens_usd:.3f}" if st.cost_per_million_tokens_usd else "-",
                len(st.nodes) or "-",
                st.message[:60],
            ]
        )
    print(
        table(
            [
                "NAME",
                "MODEL",
                "POLICY",
                "FORM",
                "PHASE",
                "COMMITTED",
                "LATEST",
                "STEP_MS",
                "USD_PER_MTOK",
                "NODES",
                "MESSAGE",
            ],
            rows,
        )
    )
    return 0


def cmd_deploy_delete(args: argparse.Namespace) -> int:
    reply = _call(
        args,
        lambda s, md: s.DeleteDeployment(
            plan_pb2.DeleteDeploymentRequest(name=args.name), metadata=md
        ),
    )
    if args.output == "json":
        _print_json({"name": args.name, "deleted": reply.deleted})
    else:
        print(f"deployment/{args.name} {'deleted' if reply.deleted else 'not found'}")
    return 0 if reply.deleted else 1


# =========================================================================== plans


def _plan_row(p: plan_pb2.PlanRecord, *, history: bool = False) -> list[Any]:
    s = p.summary
    moves = s.expert_moves if s.HasField("expert_moves") else "-"
    row: list[Any] = [
        p.deployment,
        p.version,
        PLAN_STATE_NAMES.get(p.state, "?"),
        p.plan_id,
        _ms(s.step_time_us),
        f"{s.imbalance:.3f}",
        moves,
        len(p.nodes),
    ]
    if history:
        row += [_age(p.created_unix_s), _age(p.state_changed_unix_s)]
    return [*row, p.reason[:70]]


_PLAN_HEADERS = [
    "DEPLOYMENT",
    "VERSION",
    "STATE",
    "PLAN_ID",
    "STEP_MS",
    "IMBALANCE",
    "MOVES",
    "NODES",
]


def cmd_plans_list(args: argparse.Namespace) -> int:
    reply = _call(
        args,
        lambda s, md: s.ListPlans(
            plan_pb2.ListPlansRequest(deployment=args.deployment or "", limit=args.limit),
            metadata=md,
        ),
    )
    if args.output == "json":
        _print_json([_to_json(p) for p in reply.plans])
        return 0
    print(table([*_PLAN_HEADERS, "REASON"], [_plan_row(p) for p in reply.plans]))
    return 0


def cmd_plans_history(args: argparse.Namespace) -> int:
    reply = _call(
        args,
        lambda s, md: s.ListPlans(
            plan_pb2.ListPlansRequest(deployment=args.deployment, limit=args.limit), metadata=md
        ),
    )
    if args.output == "json":
        _print_json([_to_json(p) for p in reply.plans])
        return 0
    rows = [_plan_row(p, history=True) for p in reply.plans]
    print(table([*_PLAN_HEADERS, "CREATED", "CHANGED", "REASON"], rows))
    return 0


def cmd_plans_show(args: argparse.Namespace) -> int:
    p = _call(
        args,
        lambda s, md: s.GetPlan(
            plan_pb2.GetPlanRequest(deployment=args.deployment, version=args.version or 0),
            metadata=md,
        ),
    )
    doc = json.loads(p.plan_json) if p.plan_json else {}
    if args.output == "json":
        record = _to_json(p)
        record.pop("plan_json", None)
        _print_json({"record": record, "plan": doc})
        return 0
    s = p.summary
    print(
        f"deployment: {p.deployment}  version {p.version}  plan {p.plan_id}  "
        f"{PLAN_STATE_NAMES.get(p.state, '?')}"
    )
    print(f"reason:     {p.reason or '-'}")
    moves = s.expert_moves if s.HasField("expert_moves") else "-"
    print(f"policy:     {s.policy} ({s.form})  solver {s.solver}  solve {s.solve_s:.2f} s")
    print(
        f"predicted:  step {_ms(s.step_time_us)} ms  {s.tokens_per_s:,.0f} tokens/s  "
        f"imbalance {s.imbalance:.3f}  expert moves {moves}"
    )
    rows = []
    for g in doc.get("gpus", []):
        slots = [len(layer) for layer in g.get("experts", [])]
        rows.append(
            [
                g["gpu"],
                g["model"],
                f"{g['attention_share']:.4f}",
                f"{g['dp_weight']:.3f}",
                f"{min(slots)}-{max(slots)}" if slots else "-",
                p.acks.get(g["node"], "-"),
            ]
        )
    if rows:
        print(table(["GPU", "MODEL", "ATTN_SHARE", "DP_WEIGHT", "SLOTS", "ACK"], rows))
    return 0


def cmd_plans_diff(args: argparse.Namespace) -> int:
    d = _call(
        args,
        lambda s, md: s.DiffPlans(
            plan_pb2.DiffPlansRequest(
                deployment=args.deployment,
                from_version=args.from_version or 0,
                to_version=args.to_version or 0,
            ),
            metadata=md,
        ),
    )
    if args.output == "json":
        _print_json(_to_json(d))
        return 0
    churn = d.expert_moves / d.total_slots if d.total_slots else 0.0
    print(f"{d.deployment}: v{d.from_version} -> v{d.to_version}")
    print(f"expert moves: {d.expert_moves} of {d.total_slots} slots ({churn:.1%})")
    print(f"step time:    {_ms(d.step_time_us_before)} -> {_ms(d.step_time_us_after)} ms")
    if d.gpus_added:
        print(f"GPUs added:   {', '.join(d.gpus_added)}")
    if d.gpus_removed:
        print(f"GPUs removed: {', '.join(d.gpus_removed)}")
    rows = [
        [
            g.gpu,
            f"{g.attention_share_before:.4f} -> {g.attention_share_after:.4f}",
            f"+{g.experts_added}",
            f"-{g.experts_removed}",
        ]
        for g in d.gpus
    ]
    if rows:
        print(table(["GPU", "ATTN_SHARE", "EXPERTS_IN", "EXPERTS_OUT"], rows))
    return 0


def cmd_watch(args: argparse.Namespace) -> int:
    seen = 0
    with channel(args) as ch:
        stub = plan_pb2_grpc.PlanServiceStub(ch)
        call = stub.WatchPlans(
            plan_pb2.WatchPlansRequest(deployment=args.deployment or ""),
            metadata=_metadata(args),
            timeout=args.timeout,
        )
        try:
            for event in call:
                p = event.plan
                if args.output == "json":
                    print(json.dumps(_to_json(p)), flush=True)
                else:
                    s = p.summary
                    moves = s.expert_moves if s.HasField("expert_moves") else "-"
                    print(
                        f"{dt.datetime.now().strftime('%H:%M:%S')}  {p.deployment} v{p.version} "
                        f"{PLAN_STATE_NAMES.get(p.state, '?'):<10} step {_ms(s.step_time_us)} ms "
                        f"moves {moves}  {p.reason}",
                        flush=True,
                    )
                seen += 1
                if args.count and seen >= args.count:
                    break  # leaving the channel's block cancels the call
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return 0
            if exc.code() != grpc.StatusCode.CANCELLED:
                raise _rpc_error(args, exc) from exc
    return 0


# =========================================================================== register


def _client(
    group: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    handler: Handler,
    help_text: str,
) -> argparse.ArgumentParser:
    p = group.add_parser(name, help=help_text, description=help_text)
    p.set_defaults(handler=handler)
    add_connection_args(p, suppress=True)
    p.add_argument(
        "-o",
        "--output",
        choices=("table", "json"),
        default="table",
        help="output format (default: table)",
    )
    return p


def _group(
    groups: argparse._SubParsersAction[argparse.ArgumentParser], name: str, help_text: str
) -> argparse._SubParsersAction[argparse.ArgumentParser]:
    p = groups.add_parser(name, help=help_text, description=help_text)
    p.set_defaults(group_parser=p)
    return p.add_subparsers(dest=f"{name}_command", metavar="ACTION")


def register(groups: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``controller``, ``certs``, ``nodes``, ``deploy``, ``plans`` and ``watch``."""
    ctl = _group(groups, "controller", "run the controller")
    p = ctl.add_parser(
        "run",
        help="serve AgentService, PlanService and EngineService",
        description="Run the controller until SIGINT/SIGTERM.",
    )
    p.set_defaults(handler=cmd_controller_run)
    p.add_argument(
        "--listen",
        metavar="HOST:PORT",
        default="127.0.0.1:7070",
        help="address to serve on (port 0 = any free port; default %(default)s)",
    )
    p.add_argument(
        "--store",
        metavar="URL",
        default="sqlite:mixfleet-state.db",
        help="state store, sqlite:PATH (default %(default)s)",
    )
    p.add_argument("--tls-cert", metavar="PEM", help="server certificate")
    p.add_argument("--tls-key", metavar="PEM", help="server private key")
    p.add_argument("--tls-ca", metavar="PEM", help="CA of accepted client certificates")
    p.add_argument("--token-file", metavar="FILE", help="bearer tokens for the CLI and engines")
    p.add_argument(
        "--insecure", action="store_true", help="plaintext without TLS (loopback addresses only)"
    )
    p.add_argument(
        "--metrics-port", type=int, metavar="PORT", help="serve Prometheus metrics on this port"
    )
    p.add_argument(
        "--heartbeat-interval",
        type=float,
        default=5.0,
        metavar="S",
        help="agent heartbeat period, s (default %(default)s)",
    )
    p.add_argument(
        "--node-lost-after",
        type=float,
        default=15.0,
        metavar="S",
        help="heartbeat silence before a node is lost, s (default %(default)s)",
    )
    p.add_argument(
        "--max-message-mib",
        type=int,
        default=16,
        metavar="MIB",
        help="largest request accepted, MiB (default %(default)s)",
    )
    p.add_argument("--log-format", choices=("json", "console"), default="json")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))

    certs = _group(groups, "certs", "development certificates for mutual TLS")
    p = certs.add_parser(
        "init",
        help="make a CA, server/agent/admin/engine certs and tokens",
        description="Make a development CA, certificates and a token file.",
    )
    p.set_defaults(handler=cmd_certs_init)
    p.add_argument("dir", metavar="DIR")
    p.add_argument(
        "--san",
        action="append",
        metavar="NAME",
        help="extra DNS name or IP of the controller (repeatable)",
    )
    p.add_argument("--force", action="store_true", help="overwrite an existing CA in DIR")

    nodes = _group(groups, "nodes", "nodes registered with the controller")
    _client(nodes, "list", cmd_nodes_list, "list nodes, their health and GPUs")
    p = _client(nodes, "show", cmd_nodes_show, "show one node's inventory")
    p.add_argument("name", metavar="NODE")

    deploy = _group(groups, "deploy", "model deployments")
    p = _client(deploy, "apply", cmd_deploy_apply, "create or update deployments from YAML")
    p.add_argument("-f", "--file", required=True, metavar="FILE", help="YAML file ('-' = stdin)")
    p = _client(deploy, "get", cmd_deploy_get, "list deployments or show one")
    p.add_argument("name", nargs="?", metavar="NAME")
    p = _client(deploy, "delete", cmd_deploy_delete, "delete a deployment")
    p.add_argument("name", metavar="NAME")

    plans = _group(groups, "plans", "plan versions held by the controller")
    p = _client(plans, "list", cmd_plans_list, "list plan versions, newest first")
    p.add_argument("-d", "--deployment", metavar="NAME")
    p.add_argument("--limit", type=int, default=50)
    p = _client(plans, "show", cmd_plans_show, "show one plan version (default: committed)")
    p.add_argument("deployment", metavar="DEPLOYMENT")
    p.add_argument("--version", type=int, metavar="V", help="version (default: committed)")
    p = _client(plans, "diff", cmd_plans_diff, "expert moves and GPU changes between versions")
    p.add_argument("deployment", metavar="DEPLOYMENT")
    p.add_argument(
        "--from",
        dest="from_version",
        type=int,
        metavar="V",
        help="older version (default: the served one before --to)",
    )
    p.add_argument(
        "--to", dest="to_version", type=int, metavar="V", help="newer version (default: committed)"
    )
    p = _client(plans, "history", cmd_plans_history, "every version of one deployment")
    p.add_argument("deployment", metavar="DEPLOYMENT")
    p.add_argument("--limit", type=int, default=100)

    p = _client(groups, "watch", cmd_watch, "stream plan changes as they happen")
    p.add_argument("-d", "--deployment", metavar="NAME")
    p.add_argument("--count", type=int, default=0, help="stop after N events (0 = never)")
    p.add_argument("--timeout", type=float, default=None, metavar="S", help="stop after S seconds")
