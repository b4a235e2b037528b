"""What the controller records of a deployment served by several engine instances.

A deployment that states traffic and SLOs (:func:`~policies.fleetplan.instances.is_planned`) is cut by the fleet planner
into engine instances (:func:`policies.fleetplan.instances.plan_instances`). Each instance
runs as a deployment of its own - its spec is :func:`policies.launch.instance_spec` of the
deployment it serves, its name ``<deployment>-<role>-<i>`` - with its own plans, versions,
two-phase rollouts and contingency plans. The controller is the one writer of an instance's
spec and of its :class:`InstanceRecord`, kept in the instance's status under
:data:`INSTANCE_KEY`; a user never applies or deletes an instance directly (deleting the
deployment it serves removes its instances).

The record says which deployment the instance serves and what the plan wants of it: its
role, pool, nodes, engine port, planned share of the traffic and batch limit, and where it
is in its life: live (the plan has it), *retiring* (a newer plan dropped it; it keeps
serving until its replacements are committed), *draining* (routers send it no new request;
deleted once the drain grace has passed since ``draining_since_s``). The gRPC service
(``EngineService.WatchInstances``) lists instances from these records; routers follow them.

Units: requests per second, milliseconds (``_ms``), Unix seconds (``_s``); ports are TCP
port numbers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from policies.fleetplan.instances import is_planned
from policies.launch.types import SGLANG_BOOTSTRAP_PORT, SGLANG_SERVER_PORT

INSTANCE_KEY = "instance"
"""Status key of an instance's :class:`InstanceRecord` (absent on other deployments)."""

INSTANCES_KEY = "instances"
"""Status key, on a deployment served by instances, of its instances' names (live and
draining)."""

ENGINE_BASE_PORT = SGLANG_SERVER_PORT
"""Default lowest engine HTTP port given to an instance (SGLang's default ``--port``); each
instance of the controller gets its own, the lowest free
(``ControllerSettings.engine_base_port`` sets another base)."""

BOOTSTRAP_BASE_PORT = SGLANG_BOOTSTRAP_PORT
"""Default lowest SGLang bootstrap port given to a prefill instance (SGLang's default
``--disaggregation-bootstrap-port``); each prefill instance gets its own
(``ControllerSettings.bootstrap_base_port`` sets another base)."""


@dataclass(frozen=True)
class InstanceRecord:
    """One engine instance as the controller runs it.

    Attributes:
        of: the deployment it serves.
        role: ``aggregated`` | ``prefill`` | ``decode``.
        pool: its pool (a prefill/decode pool's instances pair up).
        variant: the planner's variant key.
        nodes: its nodes, rank order.
        port: its engine's HTTP port (TCP).
        bootstrap_port: a prefill instance's SGLang bootstrap port (0 otherwise).
        requests_per_s: traffic the plan sends it, requests/s.
        batch_limit: most sequences it runs (prefill: prompt tokens per forward).
        capacity_requests_per_s: what it serves within the SLO, requests/s.
        ttft_ms: its pool's predicted TTFT at the SLO percentile, ms.
        tpot_ms: its pool's predicted TPOT, ms.
        retiring: the current plan no longer has it, but it keeps serving (WatchInstances
            lists it ready) until every new or changed instance of its deployment is
            committed, or until an instance that replaces it needs its nodes; then it drains.
        draining: routers send it no new request; its open requests finish, and it is
            deleted (its parts REMOVEd from the agents) once the controller's drain grace
            has passed since ``draining_since_s``.
        draining_since_s: when it began draining, Unix s (0 unless draining); stored, so a
            restarted controller keeps the grace.
    """

    of: str
    role: str
    pool: str
    variant: str
    nodes: tuple[str, ...]
    port: int
    bootstrap_port: int = 0
    requests_per_s: float = 0.0
    batch_limit: int = 0
    capacity_requests_per_s: float = 0.0
    ttft_ms: float = 0.0
    tpot_ms: float = 0.0
    retiring: bool = False
    draining: bool = False
    draining_since_s: float = 0.0

    @property
    def dropped(self) -> bool:
        """Whether the current plan no longer has it (retiring or draining): it holds its
        nodes until it is deleted."""
        return self.retiring or self.draining

    def to_status(self) -> dict[str, Any]:
        """The record as stored under :data:`INSTANCE_KEY` (JSON values)."""
        return {
            "of": self.of,
            "role": self.role,
            "pool": self.pool,
            "variant": self.variant,
            "nodes": list(self.nodes),
            "port": self.port,
            "bootstrapPort": self.bootstrap_port,
            "requestsPerS": self.requests_per_s,
            "batchLimit": self.batch_limit,
            "capacityRequestsPerS": self.capacity_requests_per_s,
            "ttftMs": self.ttft_ms,
            "tpotMs": self.tpot_ms,
            "retiring": self.retiring,
            "draining": self.draining,
            "drainingSinceS": self.draining_since_s,
        }

    @staticmethod
    def from_status(status: Mapping[str, Any]) -> InstanceRecord | None:
        """The record in a deployment's ``status`` (None when it is not an instance, or the
        record does not read: the controller rewrites it)."""
        doc = status.get(INSTANCE_KEY)
        if not isinstance(doc, Mapping):
            return None
        try:
            return InstanceRecord(
                of=str(doc["of"]),
                role=str(doc["role"]),
                pool=str(doc["pool"]),
                variant=str(doc.get("variant", "")),
                nodes=tuple(str(n) for n in doc["nodes"]),
                port=int(doc["port"]),
                bootstrap_port=int(doc.get("bootstrapPort", 0)),
                requests_per_s=float(doc.get("requestsPerS", 0.0)),
                batch_limit=int(doc.get("batchLimit", 0)),
                capacity_requests_per_s=float(doc.get("capacityRequestsPerS", 0.0)),
                ttft_ms=float(doc.get("ttftMs", 0.0)),
                tpot_ms=float(doc.get("tpotMs", 0.0)),
                retiring=bool(doc.get("retiring", False)),
                draining=bool(doc.get("draining", False)),
                draining_since_s=float(doc.get("drainingSinceS", 0.0)),
            )
        except (KeyError, TypeError, ValueError):
            return None


__all__ = [
    "BOOTSTRAP_BASE_PORT",
    "ENGINE_BASE_PORT",
    "INSTANCES_KEY",
    "INSTANCE_KEY",
    "InstanceRecord",
    "is_planned",
]
