"""The engine instances a deployment is served by, as ``EngineService.WatchInstances`` lists
them and ``mixfleetctl deploy get`` shows them.

A deployment cut into instances (its status lists them under
:data:`~.instance_records.INSTANCES_KEY`; each instance's status carries its
:class:`~.instance_records.InstanceRecord`) lists each instance: its role, pool, nodes, the
URL its engine serves at, planned share, batch limit, committed version and predictions. A
deployment that is not planned for traffic and SLOs lists itself as one aggregated instance
on the nodes of its committed plan, at the controller's engine base port
(``ControllerSettings.engine_base_port``); an instance lists itself as its deployment lists
it. A planned deployment whose instances are not written yet lists none.

An instance is ``ready`` once it has a committed plan and while it is not draining: a
*retiring* instance (a newer plan dropped it, its replacements are not committed yet) is
listed ready and not draining, with its last planned share, so routers keep sending it
requests; a draining one is listed ``draining`` until the controller deletes it after its
drain grace.

An instance's URL is ``http://HOST:PORT``: HOST is the address its first node advertises
(``mixfleet-agent --advertise-address``), or that node's name; an IPv6 literal goes in
brackets.

Units: requests per second, milliseconds (``_ms``); ports are TCP port numbers.
"""

from __future__ import annotations

import ipaddress
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from controlplane.errors import NotFoundError
from controlplane.server.controller.instance_records import (
    ENGINE_BASE_PORT,
    INSTANCES_KEY,
    InstanceRecord,
)
from controlplane.store import Store, StoredDeployment
from policies.fleetplan.instances import is_planned

if TYPE_CHECKING:
    from controlplane.server.controller.common import Context
    from controlplane.server.controller.nodes import NodeRegistry
    from controlplane.server.controller.watchers import Watchers

AGGREGATED = "aggregated"
"""Role of a deployment served as one engine."""


@dataclass(frozen=True)
class InstanceEndpoint:
    """One engine instance of a deployment (``mixfleet.v1.Instance``).

    Attributes:
        name: the instance's own deployment name (the deployment itself when it is served
            as one engine).
        role: ``aggregated`` | ``prefill`` | ``decode``.
        pool: its pool (a prefill/decode pool's instances pair up); "" for a deployment
            served as one engine.
        nodes: its nodes, rank order.
        url: its engine's HTTP endpoint, ``http://host:port``; "" without a node.
        bootstrap_port: a prefill instance's SGLang bootstrap port (0 otherwise).
        requests_per_s: traffic the plan sends it, requests/s.
        batch_limit: most sequences it runs (prefill: prompt tokens per forward); 0 = none.
        version: its committed plan version (0 = none yet).
        ready: committed and not draining: it may take new requests (a retiring instance is
            ready until it drains).
        draining: being removed: it finishes its open requests and gets no new one; the
            controller deletes it after its drain grace.
        variant: the planner's variant key.
        ttft_ms: its pool's predicted TTFT at the SLO percentile, ms (0 = none).
        tpot_ms: its pool's predicted TPOT, ms (0 = none).
        capacity_requests_per_s: what it serves within the SLO, requests/s (0 = unknown).
        retiring: a newer plan dropped it; it serves (``ready``, not ``draining``) until the
            instances that replace it are committed, then drains.
    """

    name: str
    role: str
    pool: str
    nodes: tuple[str, ...]
    url: str
    bootstrap_port: int = 0
    requests_per_s: float = 0.0
    batch_limit: int = 0
    version: int = 0
    ready: bool = False
    draining: bool = False
    variant: str = ""
    ttft_ms: float = 0.0
    tpot_ms: float = 0.0
    capacity_requests_per_s: float = 0.0
    retiring: bool = False

    @property
    def state(self) -> str:
        """``ready``, ``draining`` or ``pending`` (nothing committed yet)."""
        return "draining" if self.draining else "ready" if self.ready else "pending"


@dataclass(frozen=True)
class InstanceSet:
    """A deployment's instances (``mixfleet.v1.Instances`` without its generation).

    Attributes:
        deployment: the deployment served.
        engine: its engine (``sglang`` | ``vllm`` | ``trtllm`` | ``native``).
        instances: by name.
        slo_ttft_ms, slo_tpot_ms: the deployment's SLO targets (``spec.slo``), ms; 0 = none.
        slo_percentile: the share of requests that should meet both, %; 0 = no SLO.
    """

    deployment: str
    engine: str
    instances: tuple[InstanceEndpoint, ...]
    slo_ttft_ms: float = 0.0
    slo_tpot_ms: float = 0.0
    slo_percentile: float = 0.0


def engine_url(host: str, port: int) -> str:
    """``http://host:port``, an IPv6 literal in brackets."""
    try:
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
    except ValueError:
        pass
    return f"http://{host}:{port}"


def instance_set(
    store: Store,
    host_of: Callable[[str], str],
    name: str,
    *,
    engine_port: int = ENGINE_BASE_PORT,
) -> InstanceSet:
    """The instances of deployment ``name`` read from ``store`` now; ``host_of(node)`` is the
    address a node's engines serve at; ``engine_port`` the port of a deployment served as
    one engine (TCP).

    Raises:
        NotFoundError: no live deployment ``name``.
    """
    d = store.get_deployment(name)
    if d is None:
        raise NotFoundError(f"no deployment {name!r}", field="deployment")
    engine = d.spec.engine.name
    slo = d.spec.slo
    targets = (slo.ttft_ms, slo.tpot_ms, slo.percentile) if slo is not None else (0.0, 0.0, 0.0)
    own = InstanceRecord.from_status(d.status)
    if own is not None:  # an instance itself: as its deployment lists it
        return InstanceSet(name, engine, (_from_record(d, own, host_of),), *targets)
    names = instance_names(store, d)
    if not names and not is_planned(d.spec):
        one = (_aggregated(store, host_of, d, engine_port),)
        return InstanceSet(name, engine, one, *targets)
    out = []
    for n in names:
        inst = store.get_deployment(n)
        r = InstanceRecord.from_status(inst.status) if inst is not None else None
        if inst is not None and r is not None and r.of == name:
            out.append(_from_record(inst, r, host_of))
    return InstanceSet(name, engine, tuple(out), *targets)


def _from_record(
    inst: StoredDeployment, r: InstanceRecord, host_of: Callable[[str], str]
) -> InstanceEndpoint:
    version = inst.committed_version or 0
    return InstanceEndpoint(
        name=inst.name,
        role=r.role,
        pool=r.pool,
        nodes=r.nodes,
        url=engine_url(host_of(r.nodes[0]), r.port) if r.nodes else "",
        bootstrap_port=r.bootstrap_port,
        requests_per_s=r.requests_per_s,
        batch_limit=r.batch_limit,
        version=version,
        ready=version > 0 and not r.draining,
        draining=r.draining,
        variant=r.variant,
        ttft_ms=r.ttft_ms,
        tpot_ms=r.tpot_ms,
        capacity_requests_per_s=r.capacity_requests_per_s,
        retiring=r.retiring,
    )


def instance_names(store: Store, d: StoredDeployment) -> list[str]:
    """The names of ``d``'s instances, sorted: those its status lists; a planned deployment
    whose status lists none yet: every stored instance whose record says it serves ``d``."""
    listed = d.status.get(INSTANCES_KEY)
    if isinstance(listed, list | tuple):
        return sorted({str(n) for n in listed})
    if not is_planned(d.spec):
        return []
    return sorted(
        other.name
        for other in store.list_deployments()
        if (r := InstanceRecord.from_status(other.status)) is not None and r.of == d.name
    )


def _aggregated(
    store: Store, host_of: Callable[[str], str], d: StoredDeployment, port: int
) -> InstanceEndpoint:
    """A deployment served as one engine: itself, on its committed plan's nodes."""
    version = d.committed_version or 0
    nodes: tuple[str, ...] = ()
    if version:
        plan = store.get_plan(d.name, version, with_plan=False)
        nodes = tuple(plan.nodes) if plan is not None else ()
    traffic = d.spec.traffic
    return InstanceEndpoint(
        name=d.name,
        role=AGGREGATED,
        pool="",
        nodes=nodes,
        url=engine_url(host_of(nodes[0]), port) if nodes else "",
        requests_per_s=traffic.requests_per_s if traffic is not None else 0.0,
        version=version,
        ready=version > 0,
    )


class Endpoints:
    """The controller's part behind ``EngineService.WatchInstances``.

    Args:
        ctx: the controller's shared dependencies (its store).
        nodes: the node registry (the addresses nodes advertise).
        watchers: the streams (told of every change by the controller).
    """

    def __init__(self, ctx: Context, nodes: NodeRegistry, watchers: Watchers) -> None:
        self.ctx = ctx
        self.nodes = nodes
        self.watchers = watchers

    def host_of(self, node: str) -> str:
        """Where ``node``'s engines serve: its advertised address, or its name."""
        stored = self.nodes.get(node)
        return (stored.inventory.address or node) if stored is not None else node

    def instances(self, deployment: str) -> InstanceSet:
        """The engine instances ``deployment`` is served by now.

        Raises:
            NotFoundError: unknown deployment.
        """
        return instance_set(
            self.ctx.store,
            self.host_of,
            deployment,
            engine_port=self.ctx.settings.engine_base_port,
        )

    def watch(self, deployment: str) -> AsyncIterator[tuple[int, InstanceSet]]:
        """``(generation, instances)`` of ``deployment`` now, then on every change.

        Raises (on the first read):
            NotFoundError: unknown deployment.
        """
        return self.watchers.watch_instances(deployment, lambda: self.instances(deployment))


__all__ = [
    "AGGREGATED",
    "Endpoints",
    "InstanceEndpoint",
    "InstanceSet",
    "engine_url",
    "instance_names",
    "instance_set",
]
