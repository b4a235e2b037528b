"""The controller on loopback that the hostile-RPC suite and bench/hostile.py send generated
requests to (:class:`FuzzTarget`), and the state it holds while they do.

:class:`FuzzTarget` runs the controller (:func:`controlplane.server.inprocess.start_controller`)
in a thread of its own with the reconcile loop off; :meth:`FuzzTarget.reset` registers nodes
n0..n2 and applies deployment ``mx`` until it has a plan; :meth:`FuzzTarget.bases` gives a
valid request per message type for that state (what :mod:`support.protofuzz` mutates);
:meth:`FuzzTarget.call` sends one request of any RPC shape and returns the status code.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.message import Message
from mixfleet.v1 import agent_pb2, engine_pb2, plan_pb2

from apis.wire.deployment import spec_to_proto
from apis.wire.inventory import inventory_to_proto
from controlplane.server.controller import ControllerSettings
from controlplane.server.inprocess import RunningController, start_controller
from policies.spec.build import DeploymentSpec, WorkloadSpec
from support.protofuzz import message_class, small_inventories
from support.waits import HANG_GUARD_S

#: A call still unanswered after this long has hung, s (its code is then DEADLINE_EXCEEDED):
#: a hang guard, not a speed claim.
CALL_TIMEOUT_S = HANG_GUARD_S
#: Streams that stay open by design are read this long, then closed, s.
WATCH_TIMEOUT_S = 0.2
#: Status codes that mean the controller failed, not the request.
FAILURES = frozenset({"INTERNAL", "UNKNOWN", "DATA_LOSS", "UNAVAILABLE"})


SETTINGS = ControllerSettings(
    heartbeat_interval_s=1.0,
    node_lost_after_s=3600.0,
    tick_s=0.05,
    solver_processes=0,
    min_tick_interval_s=0.0,
)


def base_spec(name: str = "mx") -> DeploymentSpec:
    """The valid deployment the mutated requests start from: Mixtral, greedy, decode."""
    return DeploymentSpec(
        name=name,
        model="mixtral-8x7b",
        policy="greedy",
        workload=WorkloadSpec(phase="decode", tokens_per_gpu=32, context_len=2048),
    )


@dataclass
class Outcome:
    """One call: the status code name, the detail, and the time it took (s)."""

    code: str
    detail: str
    seconds: float


class FuzzTarget:
    """A controller on loopback in a thread of its own, with nodes n0..n2 registered and a
    deployment ``mx`` holding plan version 1 (module docstring).

    Args:
        tmp_path: directory for the store.
    """

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._error: BaseException | None = None
        self.running: RunningController | None = None
        self.sessions: dict[str, str] = {}
        self._thread = threading.Thread(target=self._serve, name="fuzz-controller", daemon=True)

    def __enter__(self) -> FuzzTarget:
        self._thread.start()
        if not self._ready.wait(60) or self.running is None:
            raise RuntimeError(f"controller did not start: {self._error!r}")
        self.channel = grpc.insecure_channel(self.running.address)
        self.reset()
        return self

    def __exit__(self, *exc: object) -> None:
        self.channel.close()
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    def _serve(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            async with start_controller(self.tmp_path, settings=SETTINGS, run_loop=False) as ctl:
                self.running = ctl
                self._ready.set()
                await self._stop.wait()

        try:
            asyncio.run(main())
        except BaseException as exc:  # reported by __enter__ / alive()
            self._error = exc
            self._ready.set()

    def alive(self) -> bool:
        """Whether the controller's thread still serves."""
        return self._thread.is_alive() and self._error is None

    def reset(self) -> None:
        """Nodes n0..n2 registered (new sessions), no other node (an earlier test's fuzzed
        Register may have added one), and deployment ``mx`` applied with a plan: the state
        each RPC's requests start from."""
        agent = self.channel.unary_unary(
            "/mixfleet.v1.AgentService/Register",
            request_serializer=agent_pb2.RegisterRequest.SerializeToString,
            response_deserializer=agent_pb2.RegisterResponse.FromString,
        )
        for inv in small_inventories():
            reply = agent(agent_pb2.RegisterRequest(inventory=inventory_to_proto(inv)), timeout=10)
            self.sessions[inv.node] = reply.session_id
        apply = self.channel.unary_unary(
            "/mixfleet.v1.PlanService/ApplyDeployment",
            request_serializer=plan_pb2.ApplyDeploymentRequest.SerializeToString,
            response_deserializer=plan_pb2.Deployment.FromString,
        )
        apply(plan_pb2.ApplyDeploymentRequest(spec=spec_to_proto(base_spec())), timeout=10)
        assert self.running is not None and self._loop is not None
        ctl = self.running.controller

        async def forget_extra_nodes() -> None:  # nodes an earlier fuzzed Register added
            known = {inv.node for inv in small_inventories()}
            for view in ctl.nodes.node_views():
                if view.stored.name not in known:
                    ctl.nodes.delete(view.stored.name)

        asyncio.run_coroutine_threadsafe(forget_extra_nodes(), self._loop).result(60)

        async def planned() -> None:  # ticks until the solve of mx stored a plan
            for _ in range(600):
                ctl.tick()
                if ctl.store.get_deployment("mx") and ctl.store.list_plans("mx", limit=1):
                    return
                await asyncio.sleep(0.05)
            raise RuntimeError("deployment mx got no plan in 30 s")

        asyncio.run_coroutine_threadsafe(planned(), self._loop).result(60)

    def bases(self) -> dict[str, Message]:
        """A valid request per input message type (the starting points of mutations), for
        the state :meth:`reset` left."""
        spec = spec_to_proto(base_spec())
        inv = inventory_to_proto(small_inventories()[0])
        session = self.sessions["n0"]
        return {
            "RegisterRequest": agent_pb2.RegisterRequest(inventory=inv),
            "HeartbeatRequest": agent_pb2.HeartbeatRequest(node="n0", session_id=session),
            "WatchAssignmentsRequest": agent_pb2.WatchAssignmentsRequest(
                node="n0", session_id=session
            ),
            "AckRequest": agent_pb2.AckRequest(
                node="n0",
                session_id=session,
                deployment="mx",
                version=1,
                state=agent_pb2.ACK_STATE_PREPARED,
            ),
            "ApplyDeploymentRequest": plan_pb2.ApplyDeploymentRequest(spec=spec),
            "SolveRequest": plan_pb2.SolveRequest(spec=spec, include_plan=True),
            "GetPlanRequest": plan_pb2.GetPlanRequest(deployment="mx", version=1),
            "DiffPlansRequest": plan_pb2.DiffPlansRequest(deployment="mx", to_version=1),
            "AdviseTiersRequest": plan_pb2.AdviseTiersRequest(
                spec=spec,
                interactive=plan_pb2.InteractiveTierSpec(tpot_ms=50.0, requests_per_s=2.0),
            ),
            "GetDeploymentRequest": plan_pb2.GetDeploymentRequest(name="mx"),
            "GetNodeRequest": plan_pb2.GetNodeRequest(name="n0"),
            "ListPlansRequest": plan_pb2.ListPlansRequest(deployment="mx"),
            "WatchPlansRequest": plan_pb2.WatchPlansRequest(deployment="mx"),
            "AdviseBatchRequest": plan_pb2.AdviseBatchRequest(
                spec=spec, tpot_ms=50.0, max_tokens_per_gpu=64
            ),
            "AdviseContextRequest": plan_pb2.AdviseContextRequest(
                spec=spec, contexts=[4096, 8192], policies=["greedy"]
            ),
            "EstimateCostRequest": plan_pb2.EstimateCostRequest(spec=spec),
            "MinCostRequest": plan_pb2.MinCostRequest(spec=spec, target_tokens_per_s=1000.0),
            "GetRoutingRequest": engine_pb2.GetRoutingRequest(deployment="mx"),
            "ExpertLoadWindow": engine_pb2.ExpertLoadWindow(
                deployment="mx",
                engine_id="e0",
                num_layers=32,
                num_experts=8,
                counts=[1.0] * 256,
                start_unix_s=1.0,
                end_unix_s=2.0,
                plan_version=1,
            ),
        }

    def call(self, m: MethodDescriptor, request: Message | Sequence[Message]) -> Outcome:
        """Send ``request`` (a list of them for a client stream) to RPC ``m``; the status code
        name (``OK`` for a reply; a stream that stays open past :data:`WATCH_TIMEOUT_S` is
        ``OK`` too)."""
        path = f"/{m.containing_service.full_name}/{m.name}"
        out_cls = message_class(m.output_type)
        ser: Callable[[Any], bytes] = lambda r: r.SerializeToString()  # noqa: E731
        kind = (m.client_streaming, m.server_streaming)
        items = list(request) if isinstance(request, Sequence) else [request]
        t0 = time.perf_counter()
        try:
            if kind == (False, False):
                self.channel.unary_unary(path, ser, out_cls.FromString)(
                    items[0], timeout=CALL_TIMEOUT_S
                )
            elif kind == (True, False):
                self.channel.stream_unary(path, ser, out_cls.FromString)(
                    iter(items), timeout=CALL_TIMEOUT_S
                )
            else:
                watch = not m.client_streaming
                stream = (
                    self.channel.unary_stream(path, ser, out_cls.FromString)(
                        items[0], timeout=WATCH_TIMEOUT_S
                    )
                    if watch
                    else self.channel.stream_stream(path, ser, out_cls.FromString)(
                        iter(items), timeout=CALL_TIMEOUT_S
                    )
                )
                try:
                    for _ in stream:
                        pass
                except grpc.RpcError as exc:
                    if watch and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                        return Outcome("OK", "stream open", time.perf_counter() - t0)
                    raise
        except grpc.RpcError as exc:
            return Outcome(exc.code().name, exc.details() or "", time.perf_counter() - t0)
        return Outcome("OK", "", time.perf_counter() - t0)

    def serving(self) -> bool:
        """Whether the health service still answers SERVING within 5 s."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        try:
            reply = health_pb2_grpc.HealthStub(self.channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
        except grpc.RpcError:
            return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
