"""``mixfleetctl watch``: stream plan changes from the controller as they happen.

One line per event (``-o json``: one JSON object per line; ``-o yaml``: one YAML document
per event; ``-o name``: ``plan/DEPLOYMENT/vN``); ``--count`` and ``--timeout`` end the
stream, a deadline is a normal end (exit 0).

When the controller goes away after the first event (a restart, a rollout of the controller
itself), the stream is opened again with exponential backoff (0.5 s doubling to 8 s) until ``--timeout`` or,
with ``--no-reconnect``, the error is reported at once. Each reconnection says so on
stderr; events already printed are not repeated (the controller replays the newest record
of each deployment on connect, and a record already printed with the same version and state
is skipped).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import time
from collections.abc import Mapping
from typing import Any

from apis.cliargs import non_negative_int, positive_float
from controlplane.cli.connection import add_client, channel, metadata, ms, rpc_error, to_json
from controlplane.cli.output import Groups, emit_document, notes

#: Reconnection backoff: first wait and ceiling, seconds.
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 8.0


def _line(p: Any, state_names: Mapping[Any, str]) -> str:
    s = p.summary
    moves = s.expert_moves if s.HasField("expert_moves") else "-"
    return (
        f"{dt.datetime.now().strftime('%H:%M:%S')}  {p.deployment} v{p.version} "
        f"{state_names.get(p.state, '?'):<10} step {ms(s.step_time_us)} ms "
        f"moves {moves}  {p.reason}"
    )


def _print_event(args: argparse.Namespace, p: Any, state_names: Mapping[Any, str]) -> None:
    if args.output == "json":
        print(json.dumps(to_json(p)), flush=True)
    elif args.output == "yaml":
        print("---", flush=True)
        emit_document(to_json(p), "yaml")
    elif args.output == "name":
        print(f"plan/{p.deployment}/v{p.version}", flush=True)
    else:
        print(_line(p, state_names), flush=True)


def cmd_watch(args: argparse.Namespace) -> int:
    import grpc
    from mixfleet.v1 import plan_pb2, plan_pb2_grpc

    from controlplane.wire.plans import PLAN_STATE_NAMES

    seen = 0
    printed: set[tuple[str, int, int]] = set()
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    backoff = BACKOFF_FIRST_S
    note = notes(args)
    while True:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return 0
        with channel(args) as ch:
            stub = plan_pb2_grpc.PlanServiceStub(ch)
            call = stub.WatchPlans(
                plan_pb2.WatchPlansRequest(deployment=args.deployment or ""),
                metadata=metadata(args),
                timeout=left,
            )
            try:
                for event in call:
                    p = event.plan
                    key = (p.deployment, p.version, p.state)
                    if key in printed:  # replayed on reconnect
                        continue
                    printed.add(key)
                    backoff = BACKOFF_FIRST_S
                    _print_event(args, p, PLAN_STATE_NAMES)
                    seen += 1
                    if args.count and seen >= args.count:
                        return 0  # leaving the channel's block cancels the call
                return 0  # the server ended the stream
            except grpc.RpcError as exc:
                code = exc.code()
                if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    return 0
                if code == grpc.StatusCode.CANCELLED:
                    return 0
                # the first connection failing is an address or TLS mistake, not a restart
                if code != grpc.StatusCode.UNAVAILABLE or not args.reconnect or not seen:
                    raise rpc_error(args, exc) from exc
                note(f"watch: lost the controller ({exc.details()}); reconnecting in {backoff:g} s")
        time.sleep(
            backoff if deadline is None else max(0.0, min(backoff, deadline - time.monotonic()))
        )
        backoff = min(backoff * 2, BACKOFF_MAX_S)


def register(groups: Groups) -> None:
    """Add the ``watch`` command."""
    p = add_client(groups, "watch", cmd_watch, "stream plan changes as they happen")
    p.add_argument("-d", "--deployment", metavar="NAME")
    p.add_argument(
        "--count", type=non_negative_int, default=0, help="stop after N events (0 = never)"
    )
    p.add_argument(
        "--timeout", type=positive_float, default=None, metavar="S", help="stop after S seconds"
    )
    p.add_argument(
        "--no-reconnect",
        dest="reconnect",
        action="store_false",
        help="end with an error when the controller goes away (default: reconnect)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no reconnection notes on stderr")
