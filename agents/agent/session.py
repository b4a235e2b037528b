"""The :class:`Agent`: one node's register / heartbeat / watch sessions with its controller.

The protocol and the agent's life are described in :mod:`agents.agent`; settings, the
channel and the classification of status codes live in :mod:`agents.agent.connection`.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar, cast

import grpc
import structlog
from grpc import aio
from mixfleet.v1 import agent_pb2, agent_pb2_grpc

from agents.agent.connection import (
    FATAL_CODES,
    STATUS_BY_NUMBER,
    STREAM_EOF,
    TEMPORARY_CODES,
    AgentSettings,
    fatal_message,
    make_channel,
)
from agents.agent.events import AgentStats, AssignmentEvent, Observer
from agents.applier import (
    Applier,
    ApplyResult,
    NodeAssignment,
    assignment_from_json,
    inflate_expert_location,
)
from agents.backoff import Backoff
from apis.wire.inventory import health_to_proto, inventory_to_proto
from policies.errors import InputError, MixfleetError
from policies.hardware.inventory import NodeInventory, check_inventory

T = TypeVar("T")
if TYPE_CHECKING:  # typing-only names of the generated stubs
    Stub: TypeAlias = agent_pb2_grpc.AgentServiceAsyncStub
    AckState: TypeAlias = agent_pb2.AckState.ValueType


class AgentFatalError(MixfleetError):
    """The controller refuses this agent for a reason retrying cannot fix (credentials,
    invalid inventory). The message says what to do."""


class _ReregisterError(Exception):
    """The session ended (controller forgot it, stream says stale): register again."""


class _StreamEndedError(Exception):
    """The controller ended a stream the agent still needs (reopen it)."""


_PHASES = {
    agent_pb2.ASSIGNMENT_PHASE_PREPARE: "prepare",
    agent_pb2.ASSIGNMENT_PHASE_COMMIT: "commit",
    agent_pb2.ASSIGNMENT_PHASE_ABORT: "abort",
    agent_pb2.ASSIGNMENT_PHASE_REMOVE: "remove",
}


# --------------------------------------------------------------------------- the agent


class Agent:
    """One node's agent. ``await agent.run()`` until ``agent.stop()`` (or cancel the task:
    that is how tests make a node die).

    Args:
        settings: controller address, credentials, periods.
        discover: returns the node's inventory (called in a worker thread).
        applier: where assignments are staged and committed.
        channel: a channel to share between agents (simulation); None = own channel.
        rand: random source for jitter (inject for tests).
        observer: called after every handled assignment.
    """

    def __init__(
        self,
        settings: AgentSettings,
        discover: Callable[[], NodeInventory],
        applier: Applier,
        *,
        channel: aio.Channel | None = None,
        rand: Callable[[], float] = random.random,
        observer: Observer | None = None,
    ) -> None:
        self.settings = settings
        self._discover = discover
        self.applier = applier
        self._own_channel = channel is None
        self._channel = channel
        self._rand = rand
        self._observer = observer
        self._stopped = asyncio.Event()
        self.inventory: NodeInventory | None = None
        self.session_id = ""
        self.controller_id = ""
        self.interval_s = settings.heartbeat_interval_s or 1.0
        self._stream_heartbeats = True  # False after the controller answered UNIMPLEMENTED
        self._stream_acks = True  # likewise
        self._ack_stream: Any = None  # this session's AckStream call, opened on first use
        self.stats = AgentStats()
        self._health_of: NodeInventory | None = None
        self._health_msg = agent_pb2.HeartbeatRequest()
        self.log: Any = structlog.get_logger("mixfleet.agent")
        self._metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {settings.token}"),) if settings.token else ()
        )

    @property
    def node(self) -> str:
        return self.inventory.node if self.inventory else ""

    def stop(self) -> None:
        """Ask :meth:`run` to return after the current step."""
        self._stopped.set()

    # -- the outer loop

    async def run(self) -> None:
        """Discover, then register and serve sessions until stopped.

        Raises:
            AgentFatalError: the controller refuses this agent permanently.
            DiscoveryError: the node cannot be discovered.
        """
        inv = await asyncio.to_thread(self._discover)
        check_inventory(inv)
        self.inventory = inv
        self.log = self.log.bind(node=inv.node, simulated=inv.simulated)
        self.log.info(
            "agent_starting",
            controller=self.settings.controller,
            gpus=len(inv.gpus),
            nics=len(inv.nics),
            discovered_by=list(inv.discovered_by),
        )
        if self._channel is None:
            self._channel = make_channel(self.settings)
        stub = agent_pb2_grpc.AgentServiceStub(self._channel)
        backoff = self._backoff()
        try:
            while not self._stopped.is_set():
                try:
                    await self._register(stub)
                except aio.AioRpcError as exc:
                    if exc.code() in FATAL_CODES:
                        raise AgentFatalError(fatal_message(exc)) from exc
                    self._note_error("register_failed", exc)
                    if await self._sleep_or_stop(backoff.next_delay()):
                        break
                    continue
                backoff.reset()
                await self._serve_session(stub)
        finally:
            if self._own_channel and self._channel is not None:
                await self._channel.close(None)
            self.log.info("agent_stopped")

    async def _register(self, stub: Stub) -> None:
        assert self.inventory is not None
        reply: agent_pb2.RegisterResponse = await stub.Register(
            agent_pb2.RegisterRequest(inventory=inventory_to_proto(self.inventory)),
            timeout=self.settings.rpc_timeout_s,
            metadata=self._metadata,
        )
        self.session_id = reply.session_id
        if self.controller_id and reply.controller_id and reply.controller_id != self.controller_id:
            self.log.warning(
                "controller_store_changed", before=self.controller_id, now=reply.controller_id
            )
        self.controller_id = reply.controller_id
        if not self.settings.heartbeat_interval_s and reply.heartbeat_interval_s > 0:
            self.interval_s = reply.heartbeat_interval_s
        self.stats.registrations += 1
        self.log.info("registered", session=self.session_id, heartbeat_interval_s=self.interval_s)

    async def _serve_session(self, stub: Stub) -> None:
        """Heartbeat and watch until one of them asks to re-register or the agent stops."""
        tasks = [
            asyncio.create_task(self._heartbeat_loop(stub), name=f"heartbeat-{self.node}"),
            asyncio.create_task(self._watch_loop(stub), name=f"watch-{self.node}"),
            asyncio.create_task(self._stopped.wait(), name=f"stop-{self.node}"),
        ]
        if self.settings.rediscover_interval_s > 0:
            tasks.append(asyncio.create_task(self._rediscover_loop(), name=f"disc-{self.node}"))
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if self._ack_stream is not None:
                self._ack_stream.cancel()
                self._ack_stream = None
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for t in done:
            exc = t.exception()
            if exc is not None and not isinstance(exc, _ReregisterError):
                raise exc
            if isinstance(exc, _ReregisterError):
                self.log.info("reregistering", why=str(exc))

    # -- heartbeat

    async def _heartbeat_loop(self, stub: Stub) -> None:
        """Heartbeat every interval (with jitter) for the whole session, on a
        HeartbeatStream (one stream message per beat), or with unary Heartbeat calls when the
        controller does not implement the stream. A failed beat is retried after the backoff
        alone (not the period on top: a restarted controller hears from its fleet within
        the backoff's cap); a failing stream is reopened."""
        backoff = self._backoff()
        stream: Any = None
        retry_in: float | None = None  # after a failure: the backoff alone, no period on top
        try:
            while True:
                jitter = self.settings.heartbeat_jitter
                period = self.interval_s * (1 - jitter + 2 * jitter * self._rand())
                await asyncio.sleep(period if retry_in is None else retry_in)
                retry_in = None
                if stream is None and self._stream_heartbeats:
                    # called without a request iterator: the stream is written beat by beat
                    stream = cast(Any, stub).HeartbeatStream(metadata=self._metadata)
                t0 = time.perf_counter()
                try:
                    if stream is not None:
                        reply = await self._exchange(stream, self._heartbeat_request())
                    else:
                        reply = await stub.Heartbeat(
                            self._heartbeat_request(),
                            timeout=self.settings.rpc_timeout_s,
                            metadata=self._metadata,
                        )
                except (aio.AioRpcError, TimeoutError, _StreamEndedError) as exc:
                    if stream is not None:
                        stream.cancel()
                        stream = None
                    self.stats.heartbeat_failures += 1
                    if isinstance(exc, aio.AioRpcError):
                        code = exc.code()
                        if code == grpc.StatusCode.UNIMPLEMENTED and self._stream_heartbeats:
                            self._stream_heartbeats = False  # an older controller: unary
                            self.log.info("heartbeat_stream_unavailable")
                            continue
                        if code in FATAL_CODES:
                            raise AgentFatalError(fatal_message(exc)) from exc
                        self._note_error("heartbeat_failed", exc)
                    else:
                        self.log.warning("heartbeat_failed", error=str(exc) or "timed out")
                    retry_in = backoff.next_delay()
                    continue
                self.stats.record_latency(time.perf_counter() - t0)
                self.stats.heartbeats += 1
                backoff.reset()
                if reply.reregister:
                    raise _ReregisterError("controller asked to re-register")
                if not self.settings.heartbeat_interval_s and reply.heartbeat_interval_s > 0:
                    self.interval_s = reply.heartbeat_interval_s
        finally:
            if stream is not None:
                stream.cancel()

    async def _exchange(self, stream: Any, request: Any) -> Any:
        """Write one request on a bidirectional stream (HeartbeatStream, AckStream) and read
        its reply, within the RPC timeout.

        Raises:
            aio.AioRpcError: the stream failed. TimeoutError: no reply in time.
            _StreamEndedError: the call is over (the controller closed it or went away).
        """
        async with asyncio.timeout(self.settings.rpc_timeout_s):
            try:
                await stream.write(request)
            except asyncio.InvalidStateError as exc:  # the call has already ended
                raise _StreamEndedError("the stream has ended") from exc
            reply = await stream.read()
        if reply is STREAM_EOF:
            raise _StreamEndedError("the controller closed the stream")
        return reply

    def _heartbeat_request(self) -> agent_pb2.HeartbeatRequest:
        assert self.inventory is not None
        inv = self.inventory
        if self._health_of is not inv:  # rebuilt only when the inventory changes
            sick = [g.index for g in inv.gpus if not g.health.healthy]
            self._health_msg = agent_pb2.HeartbeatRequest(
                node=inv.node,
                state=agent_pb2.NODE_STATE_DEGRADED if sick else agent_pb2.NODE_STATE_READY,
                message=f"unhealthy GPUs: {sick}" if sick else "",
                gpu_health=[
                    agent_pb2.GpuHealthReport(index=g.index, health=health_to_proto(g.health))
                    for g in inv.gpus
                ],
            )
            self._health_of = inv
        req = agent_pb2.HeartbeatRequest()
        req.CopyFrom(self._health_msg)
        req.session_id = self.session_id
        req.applied.update(self._applied())
        return req

    def _applied(self) -> dict[str, int]:
        return self.applier.applied()

    async def _rediscover_loop(self) -> None:
        """Refresh the inventory; a changed shape (GPUs, NICs) means re-register, changed
        health only travels with the next heartbeat."""
        while True:
            await asyncio.sleep(self.settings.rediscover_interval_s)
            try:
                inv = await asyncio.to_thread(self._discover)
                check_inventory(inv)
            except Exception as exc:  # the loop boundary: keep the last good inventory
                self.log.warning("rediscovery_failed", error=str(exc))
                continue
            before = self.inventory
            self.inventory = inv
            if before is not None and _shape(before) != _shape(inv):
                raise _ReregisterError("inventory changed")

    def update_inventory(self, inv: NodeInventory) -> None:
        """Replace the inventory now (simulation: inject a GPU fault); health goes out with
        the next heartbeat."""
        self.inventory = inv

    # -- assignments

    async def _watch_loop(self, stub: Stub) -> None:
        backoff = self._backoff()
        while True:
            call = stub.WatchAssignments(
                agent_pb2.WatchAssignmentsRequest(node=self.node, session_id=self.session_id),
                metadata=self._metadata,
            )
            try:
                self.stats.stream_opens += 1
                async for msg in call:
                    backoff.reset()
                    await self._handle(stub, msg)
                self.log.info("assignment_stream_closed")
            except aio.AioRpcError as exc:
                code = exc.code()
                if code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND):
                    raise _ReregisterError(f"watch refused: {exc.details()}") from exc
                if code in FATAL_CODES:
                    raise AgentFatalError(fatal_message(exc)) from exc
                self._note_error("assignment_stream_failed", exc)
            finally:
                call.cancel()
            await asyncio.sleep(backoff.next_delay())

    async def _handle(self, stub: Stub, msg: agent_pb2.Assignment) -> None:
        received = time.time()
        phase = _PHASES.get(msg.phase, "unspecified")
        self.stats.assignments[phase] = self.stats.assignments.get(phase, 0) + 1
        log = self.log.bind(deployment=msg.deployment, plan=msg.plan_id, version=msg.version)
        result = ApplyResult(True)
        if phase == "prepare":
            result = await self._prepare(msg)
            await self._ack(stub, msg, agent_pb2.ACK_STATE_PREPARED, result, log)
        elif phase == "commit":
            result = await self._commit(msg)
            await self._ack(stub, msg, agent_pb2.ACK_STATE_COMMITTED, result, log)
        elif phase == "abort":
            await self._call(self.applier.abort, msg.deployment, int(msg.version))
        elif phase == "remove":
            result = await self._call(self.applier.remove, msg.deployment)
        else:
            log.warning("assignment_phase_unknown", phase=int(msg.phase))
            return
        log.info(
            "assignment_handled",
            phase=phase,
            ok=result.ok,
            reason=result.reason or None,
            gpus=len(msg.gpus),
        )
        if self._observer is not None:
            self._observer(
                AssignmentEvent(
                    self.node,
                    msg.deployment,
                    int(msg.version),
                    phase,
                    result.ok,
                    result.reason,
                    received,
                    time.time(),
                )
            )

    def _part(self, msg: agent_pb2.Assignment) -> NodeAssignment:
        """The assignment's part, checked against the message's own header fields.

        Raises:
            InputError: malformed part, or it disagrees with the message.
        """
        a = replace(
            assignment_from_json(msg.part_json),
            role=msg.role,
            instance_of=msg.instance_of,
            engine_port=int(msg.engine_port),
            bootstrap_port=int(msg.bootstrap_port),
        )
        self.stats.expert_location_wire_bytes = len(msg.expert_location_zlib)
        if msg.expert_location_zlib and self.applier.wants_expert_location:
            location = inflate_expert_location(msg.expert_location_zlib, a.expert_location_bytes)
            a = replace(a, expert_location_json=location)
        if (a.deployment, a.plan_id, a.version) != (msg.deployment, msg.plan_id, msg.version):
            raise InputError(
                f"part is for {a.deployment} {a.plan_id} v{a.version}, message for "
                f"{msg.deployment} {msg.plan_id} v{msg.version}",
                field="part_json",
            )
        return a

    async def _prepare(self, msg: agent_pb2.Assignment) -> ApplyResult:
        try:
            a = self._part(msg)
        except InputError as exc:
            return ApplyResult(False, str(exc))
        return await self._call(self.applier.stage, a)

    async def _commit(self, msg: agent_pb2.Assignment) -> ApplyResult:
        dep, version = msg.deployment, int(msg.version)
        current = self.applier.committed(dep)
        if current is not None and current.version == version and current.plan_id == msg.plan_id:
            return ApplyResult(True)  # replayed on reconnect: already in force
        if not self.applier.is_staged(dep, version):
            if not msg.part_json:
                # A COMMIT for what we staged, but nothing is staged (lost since the PREPARE):
                # a new session's stream replays the committed part in full.
                raise _ReregisterError(f"COMMIT of {dep} v{version} without a staged part")
            # We never saw (or lost) the PREPARE: apply the part the COMMIT carries.
            staged = await self._prepare(msg)
            if not staged.ok:
                return staged
        return await self._call(self.applier.commit, dep, version)

    async def _ack(
        self,
        stub: Stub,
        msg: agent_pb2.Assignment,
        ok_state: AckState,
        result: ApplyResult,
        log: Any,
    ) -> None:
        state: AckState = ok_state if result.ok else agent_pb2.ACK_STATE_FAILED
        req = agent_pb2.AckRequest(
            node=self.node,
            session_id=self.session_id,
            deployment=msg.deployment,
            plan_id=msg.plan_id,
            version=msg.version,
            state=state,
            reason="" if result.ok else (result.reason or "unspecified failure")[:1000],
        )
        name = agent_pb2.AckState.Name(state)
        backoff = self._backoff()
        for attempt in range(1, self.settings.ack_attempts + 1):
            try:
                code, details = await self._send_ack(stub, req)
            except aio.AioRpcError as exc:
                code, details = exc.code(), exc.details() or ""
            except (_StreamEndedError, TimeoutError) as exc:
                code, details = grpc.StatusCode.UNAVAILABLE, str(exc) or "timed out"
            if code == grpc.StatusCode.OK:
                self.stats.acks[name] = self.stats.acks.get(name, 0) + 1
                return
            if code == grpc.StatusCode.FAILED_PRECONDITION:
                # The rollout is over (aborted or superseded): drop what we staged.
                log.info("ack_refused_rollout_over", state=name, details=details)
                if ok_state == agent_pb2.ACK_STATE_PREPARED:
                    await self._call(self.applier.abort, msg.deployment, int(msg.version))
                return
            if code == grpc.StatusCode.NOT_FOUND or code not in TEMPORARY_CODES:
                log.warning("ack_refused", state=name, code=code.name, details=details)
                return
            self.stats.last_error = f"{code.name}: {details}"
            log.warning("ack_failed", code=code.name, details=details, attempt=attempt)
            if attempt < self.settings.ack_attempts:
                await asyncio.sleep(backoff.next_delay())
        # The stream's replay after reconnecting re-sends what is still pending.
        log.warning("ack_given_up", state=name, attempts=self.settings.ack_attempts)

    async def _send_ack(self, stub: Stub, req: agent_pb2.AckRequest) -> tuple[grpc.StatusCode, str]:
        """Send one ack: on this session's AckStream, or with a unary Ack when the controller
        has no stream. Returns the controller's answer: OK, or the code it refused with.

        Raises:
            aio.AioRpcError: the unary call failed.
            _StreamEndedError, TimeoutError: the stream failed (it is reopened next time).
        """
        if self._stream_acks:
            if self._ack_stream is None:
                self._ack_stream = cast(Any, stub).AckStream(metadata=self._metadata)
            stream = self._ack_stream
            try:
                reply = await self._exchange(stream, req)
            except (aio.AioRpcError, _StreamEndedError, TimeoutError) as exc:
                self._ack_stream = None
                ended = exc.code() if isinstance(exc, aio.AioRpcError) else None
                if isinstance(exc, _StreamEndedError):
                    ended = await stream.code()  # the call is over: its status is final
                stream.cancel()
                if ended != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                self._stream_acks = False  # an older controller: unary acks from now on
                self.log.info("ack_stream_unavailable")
            else:
                return STATUS_BY_NUMBER.get(reply.code, grpc.StatusCode.UNKNOWN), reply.message
        await stub.Ack(req, timeout=self.settings.rpc_timeout_s, metadata=self._metadata)
        return grpc.StatusCode.OK, ""

    # -- helpers

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run an applier method: in a worker thread when it blocks on disk or a hook."""
        if self.applier.blocking:
            return await asyncio.to_thread(fn, *args)
        return fn(*args)

    def _backoff(self) -> Backoff:
        return Backoff(self.settings.backoff, rand=self._rand)

    async def _sleep_or_stop(self, delay: float) -> bool:
        """Sleep ``delay`` seconds; True when stopped meanwhile."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopped.wait(), timeout=delay)
        return self._stopped.is_set()

    def _note_error(self, event: str, exc: aio.AioRpcError, **kw: Any) -> None:
        self.stats.last_error = f"{exc.code().name}: {exc.details()}"
        self.log.warning(event, code=exc.code().name, details=exc.details(), **kw)


def _shape(inv: NodeInventory) -> tuple[Any, ...]:
    """An inventory without its health: what the controller plans with."""
    return (
        tuple(replace(g, health=type(g.health)()) for g in inv.gpus),
        inv.nics,
        tuple(sorted(inv.labels.items())),
    )
