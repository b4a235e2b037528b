"""What every part of the controller shares: its settings, the messages it hands to the
servicers, and the :class:`Context` (store, clock, metrics, log, wake-up) each part reads."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from controlplane.server import reconcile as rc
from controlplane.server.controller.instance_records import (
    BOOTSTRAP_BASE_PORT,
    ENGINE_BASE_PORT,
    InstanceRecord,
)
from controlplane.server.controller.measured import DemandSettings
from controlplane.server.metrics import Metrics
from controlplane.store import Store, StoredNode
from policies.assignment import NodePart
from policies.defaults import DRAIN_GRACE_S

Phase = Literal["prepare", "commit", "abort", "remove"]
NodeHealth = Literal["ready", "degraded", "draining", "lost"]


@dataclass(frozen=True)
class ControllerSettings:
    """Timing and limits of the controller.

    Attributes:
        heartbeat_interval_s: period agents are told to heartbeat at, s.
        node_lost_after_s: silence after which a node is lost and planned around, s.
        tick_s: longest pause between two reconcile ticks, s.
        retry_after_abort_s: pause before re-solving inputs whose rollout was aborted, s.
        retry_after_error_s: pause after a temporary solve failure, s.
        heartbeat_persist_s: persist a node's last heartbeat time at most this often, s
            (liveness itself is kept in memory).
        load_window_retention_s: load windows older than this are pruned, s.
        max_imbalance_samples: imbalance samples kept per deployment.
        solver_processes: worker processes for solves (solves that can run at once);
            0 = a thread of the controller process (holds the GIL: tests, tiny fleets).
        min_tick_interval_s: shortest time between two reconcile ticks, s. Acks, heartbeats
            and registrations wake the loop; ticks woken within this interval are merged,
            so a burst of N acks costs a few ticks, not N.
        alive_record_s: the controller records in the store that it is alive at most this
            often, s; after a restart it knows from that record how long it was down.
        restart_grace_max_s: after a restart every known node gets the time the controller
            was down (at most this, s) on top of ``node_lost_after_s`` to reconnect before it
            can be declared lost: agents back off while the controller is away.
        contingency_processes: worker processes that solve contingency plans in the
            background (niced); 0 = a thread of the controller process.
        contingency_max_nodes: keep a contingency plan per single-node loss for deployments
            on 2 to this many usable nodes, so a node loss commits a plan solved in advance;
            0 = off.
        demand: when the demand routers measure re-plans a deployment planned for traffic
            and SLOs (:mod:`.demand`).
        fleet_scheduler: assign nodes to deployments exclusively (:mod:`policies.scheduling`)
            where the controller decides the plans; off, every deployment plans on every
            usable node matching its selector (GPUs shared, as before the scheduler).
        namespace_quotas_gpus: namespace -> most GPUs its deployments may hold together
            (the fleet scheduler's quotas; ``spec.namespace``); absent = no limit.
        curve_cache_dir: directory of the fleet planner's step curves, kept across
            restarts (``controller run``: next to the SQLite file); "" = in memory.
        drain_grace_s: how long an engine instance drains - routers send it no new request,
            its open ones finish - before it is deleted and its parts REMOVEd, s. Routers do
            not tell the controller when their streams on it are done: the grace is the
            contract (longer than the longest request a router lets run).
        engine_base_port: lowest engine HTTP port given to an engine instance (TCP); each
            instance of the controller gets the lowest free one at or above it.
        bootstrap_base_port: lowest SGLang bootstrap port given to a prefill instance (TCP).
    """

    heartbeat_interval_s: float = 5.0
    node_lost_after_s: float = 15.0
    tick_s: float = 1.0
    retry_after_abort_s: float = 30.0
    retry_after_error_s: float = 30.0
    heartbeat_persist_s: float = 30.0
    load_window_retention_s: float = 3600.0
    max_imbalance_samples: int = 256
    solver_processes: int = 1
    min_tick_interval_s: float = 0.1
    alive_record_s: float = 2.0
    restart_grace_max_s: float = 30.0
    contingency_processes: int = 1
    contingency_max_nodes: int = 32
    demand: DemandSettings = field(default_factory=DemandSettings)
    fleet_scheduler: bool = True
    namespace_quotas_gpus: Mapping[str, int] = field(default_factory=dict)
    curve_cache_dir: str = ""
    drain_grace_s: float = DRAIN_GRACE_S
    engine_base_port: int = ENGINE_BASE_PORT
    bootstrap_base_port: int = BOOTSTRAP_BASE_PORT

    def reconcile_settings(self, *, solves: bool = True) -> rc.ReconcileSettings:
        """The decision's timing; ``solves`` False where another component (the Kubernetes
        operator) decides the plans."""
        return rc.ReconcileSettings(
            node_lost_after_s=self.node_lost_after_s,
            retry_after_abort_s=self.retry_after_abort_s,
            retry_after_error_s=self.retry_after_error_s,
            solves=solves,
            contingency_max_nodes=self.contingency_max_nodes if solves else 0,
        )


@dataclass(frozen=True)
class Context:
    """The controller's shared dependencies, handed to each of its parts.

    Attributes:
        store: the state store (the controller does not close it).
        settings: timing and limits.
        clock: Unix time source, s (tests inject a fake one).
        metrics: Prometheus metrics.
        log: the controller's structlog logger.
        wake: asks the reconcile loop for a tick soon.
        changed: marks what the decision observes of a deployment as changed (the next
            tick decides it again) and wakes the loop.
    """

    store: Store
    settings: ControllerSettings
    clock: Callable[[], float]
    metrics: Metrics
    log: Any
    wake: Callable[[], None]
    changed: Callable[[str], None] = lambda _name: None


@dataclass(frozen=True)
class AssignmentEvent:
    """One message on a node's WatchAssignments stream (``mixfleet.v1.Assignment``).

    ``instance``: the deployment's :class:`InstanceRecord` when it is an engine instance
    (its role, the deployment it serves and its ports go out with the part); None otherwise.
    """

    deployment: str
    plan_id: str
    version: int
    phase: Phase
    world_size: int = 0
    part: NodePart | None = None
    prepare_deadline_s: float = 0.0
    instance: InstanceRecord | None = None


@dataclass(frozen=True)
class RegisterResult:
    """The answer to a node's Register: its new session and the timing it must keep (s)."""

    node: str
    session_id: str
    heartbeat_interval_s: float
    node_lost_after_s: float
    controller_id: str


@dataclass(frozen=True)
class NodeView:
    """A node for PlanService: stored record plus live health (``last_seen_s``: Unix s);
    ``unknown_deployments``: what its agent runs that the store has no record of."""

    stored: StoredNode
    health: NodeHealth
    last_seen_s: float
    unknown_deployments: tuple[str, ...] = ()
