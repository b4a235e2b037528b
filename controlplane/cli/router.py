"""``mixfleetctl router``: run the request router, or show what a running one does.

* ``mixfleetctl router run`` (also the console script ``mixfleet-router``): serve the
  OpenAI-compatible and SGLang endpoints in front of the engine instances, routing each
  request to a DP rank by the committed plan's weights (docs/router.md).
* ``mixfleetctl router status --router URL``: the router's instances (health, plan version)
  and each rank's planned vs achieved share and open requests, and the requests waiting for
  a batch slot, from ``GET /router/status``.

Heavy modules (aiohttp, grpc, the router package) are imported inside the handlers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from apis.cliargs import positive_float, positive_int, program_version
from controlplane.cli.connection import add_connection_args
from controlplane.cli.output import Groups, add_leaf, add_output_arg, emit, emit_document, table
from policies.errors import InputError, MixfleetError


def add_run_args(p: argparse.ArgumentParser) -> None:
    """The flags of ``router run`` / ``mixfleet-router``."""
    from controlplane.router.settings import host_name

    p.add_argument(
        "--instance",
        action="append",
        default=[],
        metavar="SPEC",
        help="engine instance: url=http://HOST:PORT[,name=N][,deployment=D][,tier=T]"
        "[,engine=sglang|vllm|trtllm|native][,ranks=R][,share=S], or a prefill/decode pair: "
        "pd=sglang|vllm,prefill=URL[+URL...],decode=URL[+URL...][,bootstrap_port=P] "
        "(repeatable)",
    )
    p.add_argument(
        "--deployment",
        action="append",
        default=[],
        metavar="NAME[,tier=T]",
        help="take this deployment's instances, shares and batch limits from the controller "
        "(WatchInstances) and report its measured traffic (repeatable)",
    )
    p.add_argument(
        "--reporter",
        default=host_name(),
        metavar="NAME",
        help="the router's name in its traffic reports (default: the host name)",
    )
    p.add_argument("--listen", default="0.0.0.0:8000", metavar="HOST:PORT")
    p.add_argument("--default-tier", default="default", metavar="TIER")
    p.add_argument("--api-key-tiers", metavar="FILE", help="JSON object: API key -> tier")
    p.add_argument(
        "--priority-tier",
        action="append",
        default=[],
        metavar="CLASS=TIER",
        help="X-Priority-Class value -> tier (repeatable)",
    )
    p.add_argument(
        "--queue-limit", type=positive_int, default=256, metavar="N", help="open requests per rank"
    )
    p.add_argument("--retry-after-s", type=positive_int, default=1, metavar="S")
    p.add_argument("--max-attempts", type=positive_int, default=2, metavar="N")
    p.add_argument("--default-output-tokens", type=positive_int, default=256, metavar="N")
    p.add_argument("--tokenizer", default="", metavar="NAME", help="HF tokenizer (else chars/4)")
    p.add_argument("--health-interval-s", type=positive_float, default=1.0, metavar="S")
    p.add_argument("--eject-after", type=positive_int, default=2, metavar="N")
    p.add_argument("--readmit-after", type=positive_int, default=2, metavar="N")
    _add_limit_args(p)
    p.add_argument(
        "--workers",
        type=positive_int,
        default=1,
        metavar="N",
        help="router processes on the one port (SO_REUSEPORT), each with its own stride state",
    )
    p.add_argument("--log-format", choices=("json", "console"), default="json")
    p.add_argument("--log-level", default="info")
    p.add_argument(
        "--uvloop",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run on uvloop (default, a dependency; --no-uvloop: asyncio's own loop)",
    )
    add_connection_args(p, suppress=True)


#: Flags of the router's limits and timeouts: (flag, settings field, type, what, unit).
_LIMITS = (
    ("--connect-timeout-s", "connect_timeout_s", positive_float, "connect to an engine", "S"),
    ("--read-timeout-s", "read_timeout_s", positive_float, "longest silence of an engine", "S"),
    ("--health-timeout-s", "health_timeout_s", positive_float, "one health check", "S"),
    ("--header-timeout-s", "header_timeout_s", positive_float, "a request's headers", "S"),
    ("--body-timeout-s", "body_timeout_s", positive_float, "a request's body", "S"),
    ("--idle-timeout-s", "idle_timeout_s", positive_float, "an idle client connection", "S"),
    ("--max-body-bytes", "max_body_bytes", positive_int, "one request body (413)", "BYTES"),
    (
        "--max-inflight-body-bytes",
        "max_inflight_body_bytes",
        positive_int,
        "request bodies held at once (429)",
        "BYTES",
    ),
    ("--max-output-tokens", "max_output_tokens", positive_int, "a request's max_tokens", "N"),
    ("--max-json-depth", "max_json_depth", positive_int, "nesting of a request's JSON", "N"),
    ("--batch-queue", "batch_queue", positive_int, "requests waiting for a batch slot", "N"),
    ("--batch-wait-s", "batch_wait_s", positive_float, "a request's wait for a slot", "S"),
    (
        "--traffic-report-s",
        "traffic_report_s",
        positive_float,
        "one measured traffic window",
        "S",
    ),
)


def _add_limit_args(p: argparse.ArgumentParser) -> None:
    """The limits and timeouts (defaults: :class:`RouterSettings`, docs/security.md)."""
    from controlplane.router.settings import RouterSettings

    defaults = {f.name: f.default for f in dataclasses.fields(RouterSettings)}
    for flag, name, kind, what, unit in _LIMITS:
        p.add_argument(
            flag,
            type=kind,
            default=defaults[name],
            metavar=unit,
            help=f"{what} (default {defaults[name]})",
        )
    p.add_argument(
        "--tier-headers",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="honour X-Mixfleet-Tier and X-Priority-Class (default: only without "
        "--api-key-tiers, where API keys define tiers)",
    )


def _env(args: argparse.Namespace, name: str, env: str) -> str:
    return str(getattr(args, name, None) or os.environ.get(env) or "")


def settings_from_args(args: argparse.Namespace) -> Any:
    """Checked :class:`controlplane.router.settings.RouterSettings` from the flags.

    Raises:
        InputError: naming the flag.
    """
    from controlplane.router import settings as rs

    host, port = rs.parse_listen(args.listen)
    instances = tuple(rs.parse_instance(t, args.default_tier) for t in args.instance)
    watched = tuple(rs.parse_deployment(t, args.default_tier) for t in args.deployment)
    priority: dict[str, str] = {}
    for item in args.priority_tier:
        cls, sep, tier = item.partition("=")
        if not sep or not cls or not tier:
            raise InputError(f"{item!r} is not CLASS=TIER", field="--priority-tier")
        priority[cls] = tier
    token = _env(args, "token", "MIXFLEET_TOKEN")
    token_file = _env(args, "token_file", "MIXFLEET_TOKEN_FILE")
    if not token and token_file:
        token = _token_from_file(token_file)
    tls = None
    if getattr(args, "tls_ca", None):
        tls = rs.TlsClient(args.tls_ca, args.tls_cert or "", args.tls_key or "")
    elif getattr(args, "tls_cert", None) or getattr(args, "tls_key", None):
        raise InputError("needs --tls-ca too (the controller's CA)", field="--tls-cert")
    for flag, value in (
        ("--health-interval-s", args.health_interval_s),
        ("--retry-after-s", args.retry_after_s),
        ("--default-output-tokens", args.default_output_tokens),
    ):
        if not value >= 0:
            raise InputError(f"must be >= 0, got {value}", field=flag)
    return rs.check(
        rs.RouterSettings(
            instances=instances,
            watched=watched,
            reporter=args.reporter,
            listen_host=host,
            listen_port=port,
            controller=_env(args, "controller", "MIXFLEET_CONTROLLER"),
            token=token,
            tls=tls,
            default_tier=args.default_tier,
            api_key_tiers=rs.read_key_tiers(args.api_key_tiers) if args.api_key_tiers else {},
            priority_tiers=priority,
            queue_limit=args.queue_limit,
            retry_after_s=args.retry_after_s,
            max_attempts=args.max_attempts,
            default_output_tokens=args.default_output_tokens,
            tokenizer=args.tokenizer,
            health_interval_s=max(args.health_interval_s, 0.05),
            eject_after=args.eject_after,
            readmit_after=args.readmit_after,
            tier_headers=args.tier_headers,
            **{name: getattr(args, name) for _, name, *_ in _LIMITS},
        )
    )


def _token_from_file(path: str) -> str:
    from controlplane.server.certs import token_for

    for role in ("engine", "admin"):
        try:
            return token_for(path, role)
        except InputError:
            continue
    raise InputError(f"no engine or admin token in {path}", field="--token-file")


def cmd_run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    from controlplane.router import workers
    from controlplane.server.logs import configure_logging

    try:
        configure_logging(args.log_format, args.log_level)
    except ValueError as exc:
        raise InputError(str(exc), field="--log-level") from exc
    workers.run(
        settings,
        workers=args.workers,
        log_format=args.log_format,
        log_level=args.log_level,
        uvloop=args.uvloop,
    )
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    import urllib.error
    import urllib.request

    url = args.router.rstrip("/") + "/router/status"
    try:
        with urllib.request.urlopen(url, timeout=args.timeout) as r:
            doc = json.loads(r.read())
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise MixfleetError(
            f"cannot read {url}: {exc}. To fix: check --router and that the router runs"
        ) from exc
    if args.output != "table":
        names = [f"instance/{i['name']}" for i in doc["instances"]]
        emit_document(doc, args.output, names)
        return 0
    emit(
        table(
            ["INSTANCE", "TIER", "ENGINE", "HEALTHY", "STATE", "OPEN", "RANKS", "VERSION", "URL"],
            [
                [
                    i["name"],
                    i["tier"],
                    i["engine"],
                    "yes" if i["healthy"] else "NO",
                    _state(i),
                    f"{i.get('open_requests', 0)}/{i.get('batch_limit') or '-'}",
                    i["ranks"],
                    i["version"] or "-",
                    i["url"],
                ]
                for i in doc["instances"]
            ],
        )
    )
    rows = [
        [
            tier,
            r["instance"],
            r["rank"],
            f"{r['planned_share']:.3f}",
            f"{r['achieved_share']:.3f}",
            r["open_requests"],
        ]
        for tier, ranks in doc["tiers"].items()
        for r in ranks
    ]
    emit(table(["TIER", "INSTANCE", "RANK", "PLANNED", "ACHIEVED", "OPEN"], rows))
    for tier, n in sorted(doc.get("waiting", {}).items()):
        if n:
            print(f"tier {tier}: {n} waiting for a batch slot")
    down = [d for d, up in doc.get("controller_connected", {}).items() if not up]
    if down:
        print(
            f"controller watch down for {', '.join(down)}: routing on the last committed weights",
            file=sys.stderr,
        )
    return 0


def _state(inst: dict[str, Any]) -> str:
    """``serving``; ``no-ranks`` (routable, but its DP ranks have not come yet: a watched
    deployment's instance before its routing, see ``WatchRouting``; it gets no request);
    ``draining`` (listed by the controller, not ready or draining: no new request);
    ``leaving`` (no longer listed; removed once its open requests end)."""
    if inst.get("routable", True):
        return "serving" if inst.get("ranks", 1) else "no-ranks"
    return "draining" if inst.get("listed", True) else "leaving"


def register(groups: Groups) -> None:
    """Add the ``router`` command group."""
    g = groups.add_parser("router", help="the request router that imposes the plan's DP shares")
    sub = g.add_subparsers(dest="router_command", metavar="COMMAND", required=True)
    run = add_leaf(sub, "run", cmd_run, "run the router in front of engine instances")
    add_run_args(run)
    st = add_leaf(sub, "status", cmd_status, "instances, ranks, planned vs achieved shares")
    st.add_argument("--router", default="http://127.0.0.1:8000", metavar="URL")
    st.add_argument("--timeout", type=positive_float, default=5.0, metavar="S")
    add_output_arg(st)


def main(argv: Sequence[str] | None = None) -> int:
    """``mixfleet-router``: the same as ``mixfleetctl router run``; ``--version`` prints
    ``mixfleet-router X.Y.Z``."""
    words = list(sys.argv[1:] if argv is None else argv)
    if "--version" in words:
        print(program_version("mixfleet-router"))
        return 0
    from controlplane.cli import main as ctl_main

    return ctl_main(["router", "run", *words])
