"""What an agent reports about itself: counters for logs, tests and benchmarks
(:class:`AgentStats`) and one event per handled assignment (:class:`AssignmentEvent`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class AgentStats:
    """What an agent observed, for logs, tests and benchmarks.

    Attributes:
        registrations: successful Register calls.
        heartbeats: successful heartbeats.
        heartbeat_failures: failed heartbeats.
        heartbeat_latency_s: latency of recent successful heartbeats, seconds (bounded).
        stream_opens: WatchAssignments streams opened.
        assignments: assignments received, by phase name.
        acks: acks sent, by state name.
        last_error: the latest error text.
        expert_location_wire_bytes: size of the last compressed expert location received.
    """

    registrations: int = 0
    heartbeats: int = 0
    heartbeat_failures: int = 0
    heartbeat_latency_s: list[float] = field(default_factory=list)
    stream_opens: int = 0
    assignments: dict[str, int] = field(default_factory=dict)
    acks: dict[str, int] = field(default_factory=dict)
    last_error: str = ""
    expert_location_wire_bytes: int = 0
    max_latencies: int = 10_000

    def record_latency(self, seconds: float) -> None:
        self.heartbeat_latency_s.append(seconds)
        if len(self.heartbeat_latency_s) > self.max_latencies:
            del self.heartbeat_latency_s[: self.max_latencies // 2]


@dataclass(frozen=True)
class AssignmentEvent:
    """One handled assignment, for observers (tests, benchmarks, the demo).

    Attributes:
        node: node name.
        deployment: deployment name.
        version: plan version.
        phase: ``prepare`` | ``commit`` | ``abort`` | ``remove``.
        ok: the step succeeded (always True for abort and remove).
        reason: why not.
        received_unix_s: when the assignment arrived.
        done_unix_s: when it was applied and acked.
    """

    node: str
    deployment: str
    version: int
    phase: str
    ok: bool
    reason: str
    received_unix_s: float
    done_unix_s: float


#: Called after every handled assignment.
Observer = Callable[[AssignmentEvent], None]
