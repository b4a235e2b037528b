"""The controller's demand record of a ModelDeployment, as the operator plans from it.

The controller is the one writer of the measured demand and of the drift decision: it sums
the routers' ``ReportTraffic`` windows and, after a sustained drift from the planned demand,
chooses the traffic to plan for (``controlplane.server.controller.demand``). In Kubernetes
mode that record is its part of the ModelDeployment's status, ``status.controller.demand``
(field manager ``mixfleet-controller``)::

    demand:
      planned: {requestsPerS: 95.8, inputTokens: {mean: 1024, p90: 1280}, ...}
      specTraffic: {requestsPerS: 20, ...}     # the spec's traffic it was measured against
      measured: {requestsPerS: 96.1, startUnixS: ..., endUnixS: ..., ...}
      lastReplanUnixS: 1764892800.0
      lastReplanReason: measured 96.1 requests/s over 60 s, above the planned 20 ...
      replans: 1

The operator, the one planner in Kubernetes mode, reads it here (:func:`replanned_demand`)
and plans the deployment for ``planned`` while ``specTraffic`` is the spec's traffic: a spec
whose traffic changed since is planned for its own again - the standalone controller's rule,
one function both call (:func:`policies.serving.traffic.replanned_traffic`).
Pure: no I/O. Units: requests per second.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from policies.errors import InputError
from policies.serving.traffic import Traffic, replanned_traffic, traffic_from_doc

CONTROLLER_KEY = "controller"
"""The controller's own part of a ModelDeployment's status (``status.controller``)."""

DEMAND_KEY = "demand"
"""The key of the demand record in the controller's status document (the controller's
``controlplane.server.controller.demand.DEMAND_KEY``)."""


@dataclass(frozen=True)
class Replanned:
    """The traffic the controller chose to plan a deployment for after a sustained drift.

    Attributes:
        traffic: the measured traffic to plan for (the spec's arrival process).
        reason: why, for a person (``lastReplanReason``).
    """

    traffic: Traffic
    reason: str


def demand_record(status: Mapping[str, Any] | None) -> Mapping[str, Any]:
    """``status.controller.demand`` of a ModelDeployment's ``status`` (empty when absent)."""
    controller = (status or {}).get(CONTROLLER_KEY)
    doc = controller.get(DEMAND_KEY) if isinstance(controller, Mapping) else None
    return doc if isinstance(doc, Mapping) else {}


def replanned_demand(
    spec_traffic: Traffic | None, status: Mapping[str, Any] | None
) -> Replanned | None:
    """The traffic to plan for instead of ``spec_traffic`` (the spec's), from the controller's
    record in ``status`` (a ModelDeployment's ``status``): its ``planned`` traffic while its
    ``specTraffic`` is ``spec_traffic``. None when there is none, the spec states no traffic
    or another traffic since, or the record does not read (the controller rewrites it)."""
    doc = demand_record(status)
    planned, measured_against = doc.get("planned"), doc.get("specTraffic")
    if not isinstance(planned, Mapping) or not isinstance(measured_against, Mapping):
        return None
    try:
        chosen = traffic_from_doc(dict(planned), "status.controller.demand.planned")
    except InputError:
        return None
    traffic = replanned_traffic(spec_traffic, chosen, measured_against)
    if traffic is None:
        return None
    return Replanned(traffic, str(doc.get("lastReplanReason") or ""))


__all__ = [
    "CONTROLLER_KEY",
    "DEMAND_KEY",
    "Replanned",
    "demand_record",
    "replanned_demand",
]
