"""``mixfleetctl watch``: stream plan changes from the controller as they happen.

One line per event (``-o json``: one JSON object per line); ``--count`` and ``--timeout``
end the stream, a deadline is a normal end (exit 0).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json

import grpc
from mixfleet.v1 import plan_pb2, plan_pb2_grpc

from controlplane.cli.connection import add_client, channel, metadata, ms, rpc_error, to_json
from controlplane.cli.output import Groups
from controlplane.wire.plans import PLAN_STATE_NAMES


def cmd_watch(args: argparse.Namespace) -> int:
    seen = 0
    with channel(args) as ch:
        stub = plan_pb2_grpc.PlanServiceStub(ch)
        call = stub.WatchPlans(
            plan_pb2.WatchPlansRequest(deployment=args.deployment or ""),
            metadata=metadata(args),
            timeout=args.timeout,
        )
        try:
            for event in call:
                p = event.plan
                if args.output == "json":
                    print(json.dumps(to_json(p)), flush=True)
                else:
                    s = p.summary
                    moves = s.expert_moves if s.HasField("expert_moves") else "-"
                    print(
                        f"{dt.datetime.now().strftime('%H:%M:%S')}  {p.deployment} v{p.version} "
                        f"{PLAN_STATE_NAMES.get(p.state, '?'):<10} step {ms(s.step_time_us)} ms "
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
                raise rpc_error(args, exc) from exc
    return 0


def register(groups: Groups) -> None:
    """Add the ``watch`` command."""
    p = add_client(groups, "watch", cmd_watch, "stream plan changes as they happen")
    p.add_argument("-d", "--deployment", metavar="NAME")
    p.add_argument("--count", type=int, default=0, help="stop after N events (0 = never)")
    p.add_argument("--timeout", type=float, default=None, metavar="S", help="stop after S seconds")
