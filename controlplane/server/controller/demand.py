"""Re-planning a deployment when the demand routers measure drifts from the demand it is
planned for.

Routers report windows of measured traffic (:mod:`.measured`: windows, time buckets, how
several routers' figures add up). :class:`DriftTracker` (pure, with an explicit clock) sums
each deployment's reports per time bucket and decides; :class:`Demands` is the controller's
part: it validates reports, keeps the planned and measured demand in the deployment's status (under
:data:`DEMAND_KEY`: it survives a restart) and asks for a re-plan.

**Drift.** With ``t = drift_threshold`` and ``planned`` the requests/s the deployment is
planned for, the band is ``[planned / (1 + t), planned * (1 + t)]``. At the latest reported
instant ``h``, the ``ceil(sustain_s / bucket_s)`` buckets ending at or before ``h`` are
examined: drift when every one of them counts and every rate lies outside the band on the same
side (all above, or all below). A blip shorter than ``sustain_s`` leaves a bucket inside the
band; a gap leaves a bucket without data; neither drifts.

**Re-plan.** On drift, and when the last re-plan is at least ``min_interval_s`` ago (the
controller's clock), the planning traffic becomes the measured one over those buckets
(:func:`~.measured.measured_traffic`: lognormal lengths fitted to the measured mean and p90,
the spec's arrival process; the spec's SLOs are kept) and stays until the next drift or
until the spec's own traffic changes. The fleet scheduler plans a planned deployment for
:meth:`Demands.traffic_for`. This is the hysteresis of Dynamo's SLA planner
(https://docs.nvidia.com/dynamo/v-0-9-0/design-docs/planner-design.md: every
``adjustment_interval`` it reads request count, mean ISL/OSL and TTFT/ITL, predicts the next
interval's load and resizes the prefill/decode pools), with two differences: a dead band
(``drift_threshold``) and a persistence requirement (``sustain_s``) before acting, so noise
inside the band never moves an instance, and the minimum interval bounds how often instances
can be moved at all.

Units: seconds (``_s``, Unix time for instants), requests per second.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from controlplane.errors import NotFoundError
from controlplane.server.controller.measured import (
    DemandSettings,
    MeasuredDemand,
    Share,
    TrafficWindow,
    bucket_counts,
    check_window,
    demand_of,
    measured_traffic,
)
from policies.errors import InputError
from policies.fleetplan.instances import is_planned
from policies.serving.traffic import (
    Traffic,
    replanned_traffic,
    traffic_from_doc,
    traffic_to_doc,
)
from policies.spec.build import DeploymentSpec

if TYPE_CHECKING:
    from controlplane.server.controller.common import Context
    from controlplane.store import StoredDeployment

DEMAND_KEY = "demand"
"""Status key of a deployment's :class:`DemandStatus` document."""

MAX_REPORTERS = 1000
"""Most reporters (routers) whose data a deployment keeps at once."""


# --------------------------------------------------------------------------- status


@dataclass(frozen=True)
class DemandStatus:
    """What a deployment's status keeps of its demand (under :data:`DEMAND_KEY`); it
    survives a controller restart.

    Attributes:
        planned: the traffic the deployment is planned for now; None = its spec's.
        spec_traffic: the spec's traffic (document) when ``planned`` was measured: a spec
            whose traffic changed since plans for its own again.
        measured: the latest measurement, or None.
        last_replan_s: when drift last changed the planning traffic, Unix s; None = never.
        last_replan_reason: why, for a person.
        replans: how many times drift changed it.
    """

    planned: Traffic | None = None
    spec_traffic: Mapping[str, Any] | None = None
    measured: MeasuredDemand | None = None
    last_replan_s: float | None = None
    last_replan_reason: str = ""
    replans: int = 0

    def planning_traffic(self, spec: DeploymentSpec) -> Traffic | None:
        """The traffic ``spec``'s deployment is planned for: the measured one after a drift
        (while the spec's traffic is the one it was measured against), else the spec's."""
        return replanned_traffic(spec.traffic, self.planned, self.spec_traffic) or spec.traffic

    def to_doc(self) -> dict[str, Any]:
        """The status form (camelCase, JSON values)."""
        doc: dict[str, Any] = {"replans": self.replans}
        if self.planned is not None:
            doc["planned"] = traffic_to_doc(self.planned)
            doc["specTraffic"] = dict(self.spec_traffic or {})
        if self.measured is not None:
            doc["measured"] = self.measured.to_doc()
        if self.last_replan_s is not None:
            doc["lastReplanUnixS"] = self.last_replan_s
            doc["lastReplanReason"] = self.last_replan_reason
        return doc

    @staticmethod
    def from_status(status: Mapping[str, Any]) -> DemandStatus:
        """The record in a deployment's ``status`` (empty when absent; a part that does not
        read is dropped: the controller rewrites it)."""
        doc = status.get(DEMAND_KEY)
        if not isinstance(doc, Mapping):
            return DemandStatus()
        planned = None
        spec_traffic = doc.get("specTraffic")
        if isinstance(doc.get("planned"), Mapping) and isinstance(spec_traffic, Mapping):
            try:
                planned = traffic_from_doc(doc["planned"], "status.demand.planned")
            except InputError:
                planned = None
        last = doc.get("lastReplanUnixS")
        replans = doc.get("replans", 0)
        return DemandStatus(
            planned=planned,
            spec_traffic=spec_traffic if planned is not None else None,
            measured=MeasuredDemand.from_doc(doc.get("measured")),
            last_replan_s=float(last) if isinstance(last, int | float) else None,
            last_replan_reason=str(doc.get("lastReplanReason", "")),
            replans=int(replans) if isinstance(replans, int) else 0,
        )


# --------------------------------------------------------------------------- decision


@dataclass(frozen=True)
class Drift:
    """A sustained departure from the planned demand.

    Attributes:
        direction: ``above`` or ``below`` the band.
        measured: the demand over the sustained buckets.
        planned_requests_per_s: the rate planned for, requests/s.
    """

    direction: str
    measured: MeasuredDemand
    planned_requests_per_s: float

    @property
    def reason(self) -> str:
        """For a person: what moved, by how much, for how long."""
        m = self.measured
        return (
            f"measured {m.requests_per_s:.3g} requests/s over {m.end_s - m.start_s:.0f} s, "
            f"{self.direction} the planned {self.planned_requests_per_s:.3g} requests/s by "
            f"more than the drift threshold"
        )


@dataclass
class _Series:
    """A deployment's reports, summed per time bucket (bucket index -> reporter -> share)."""

    buckets: dict[int, dict[str, Share]] = field(default_factory=dict)
    #: bucket index -> its rate, requests/s (None: no data), as last computed
    rates: dict[int, float | None] = field(default_factory=dict)
    reporters: set[str] = field(default_factory=set)
    horizon_s: float = 0.0


class DriftTracker:
    """Reports per deployment, summed into time buckets as they arrive, and the drift
    decision (pure: no I/O, the clock passed in). A report costs the buckets it spans; the
    decision, the buckets of ``sustain_s`` times the reporters.

    Args:
        settings: thresholds and spans.
    """

    def __init__(self, settings: DemandSettings) -> None:
        self.settings = settings
        self._series: dict[str, _Series] = {}

    def add(self, w: TrafficWindow, now_s: float) -> bool:
        """Add a (validated) window; False when it ended more than the retention before
        ``now_s`` (Unix s) and cannot count any more, or comes from a reporter beyond the
        first :data:`MAX_REPORTERS` of the deployment's retained data."""
        if w.end_s < now_s - self.settings.retention_s:
            return False
        s = self._series.setdefault(w.deployment, _Series())
        if w.reporter not in s.reporters and len(s.reporters) >= MAX_REPORTERS:
            self._prune(s, now_s)
            if len(s.reporters) >= MAX_REPORTERS:
                return False
        b = self.settings.bucket_s
        for k in range(math.floor(w.start_s / b), math.ceil(w.end_s / b)):
            inside = min(w.end_s, (k + 1) * b) - max(w.start_s, k * b)
            if inside > 0:
                s.buckets.setdefault(k, {}).setdefault(w.reporter, Share()).add(w, inside)
                s.rates.pop(k, None)
        s.reporters.add(w.reporter)
        s.horizon_s = max(s.horizon_s, w.end_s)
        self._prune(s, now_s)
        return True

    def forget(self, deployment: str) -> None:
        """Drop a deployment's data (it was deleted)."""
        self._series.pop(deployment, None)

    def _prune(self, s: _Series, now_s: float) -> None:
        oldest = math.floor((now_s - self.settings.retention_s) / self.settings.bucket_s)
        stale = [k for k in s.buckets if k < oldest]
        for k in stale:
            del s.buckets[k]
            s.rates.pop(k, None)
        if stale:
            s.reporters = {r for shares in s.buckets.values() for r in shares}

    def _span(self, deployment: str) -> tuple[int, int] | None:
        """(first bucket index, bucket count) of the sustained span at the horizon."""
        s = self._series.get(deployment)
        if s is None or not s.buckets:
            return None
        last = math.floor(s.horizon_s / self.settings.bucket_s)  # the first bucket after it
        count = math.ceil(self.settings.sustain_s / self.settings.bucket_s - 1e-9)
        return last - count, count

    def _demand(self, s: _Series, first: int, count: int) -> MeasuredDemand:
        shares: dict[str, Share] = {}
        for k in range(first, first + count):
            for reporter, share in s.buckets.get(k, {}).items():
                shares.setdefault(reporter, Share()).merge(share)
        b = self.settings.bucket_s
        return demand_of(shares, first * b, (first + count) * b)

    def measured(self, deployment: str) -> MeasuredDemand | None:
        """The demand over the last ``sustain_s`` of data (None without any)."""
        span = self._span(deployment)
        if span is None:
            return None
        return self._demand(self._series[deployment], *span)

    def drift(self, deployment: str, planned_requests_per_s: float) -> Drift | None:
        """The drift of ``deployment`` from ``planned_requests_per_s`` at its latest data
        (see the module docstring), or None."""
        span = self._span(deployment)
        if span is None or planned_requests_per_s <= 0:
            return None
        first, count = span
        s, b = self._series[deployment], self.settings.bucket_s
        rates: list[float] = []
        for k in range(first, first + count):
            if k not in s.rates:
                shares = s.buckets.get(k, {})
                counts = bucket_counts(shares, b)
                s.rates[k] = (
                    demand_of(shares, k * b, (k + 1) * b).requests_per_s if counts else None
                )
            rate = s.rates[k]
            if rate is None:
                return None
            rates.append(rate)
        high = planned_requests_per_s * (1 + self.settings.drift_threshold)
        low = planned_requests_per_s / (1 + self.settings.drift_threshold)
        if all(r > high for r in rates):
            direction = "above"
        elif all(r < low for r in rates):
            direction = "below"
        else:
            return None
        return Drift(direction, self._demand(s, first, count), planned_requests_per_s)

    def decide(
        self,
        deployment: str,
        status: DemandStatus,
        spec: DeploymentSpec,
        now_s: float,
        *,
        measure: bool = True,
    ) -> tuple[DemandStatus, Drift | None]:
        """The deployment's demand status after its latest data, and the drift that changed
        its planning traffic (None when it did not: no drift, or the last re-plan is less
        than ``min_interval_s`` before ``now_s``, Unix s). A spec without traffic and SLOs
        is only measured. ``measure`` False leaves the status' measured demand as it was
        (unless it drifted): it is only written now and then."""
        measured = self.measured(deployment) if measure else None
        out = replace(status, measured=measured or status.measured)
        planned = status.planning_traffic(spec)
        if planned is None or spec.traffic is None or not is_planned(spec):
            return out, None
        if status.planned is not None and planned is spec.traffic:  # the spec changed
            out = replace(out, planned=None, spec_traffic=None)
        drift = self.drift(deployment, planned.requests_per_s)
        if drift is None:
            return out, None
        last = status.last_replan_s
        if last is not None and now_s - last < self.settings.min_interval_s:
            return out, None
        return (
            replace(
                out,
                planned=measured_traffic(drift.measured, planned),
                spec_traffic=traffic_to_doc(spec.traffic),
                last_replan_s=now_s,
                last_replan_reason=drift.reason,
                replans=status.replans + 1,
            ),
            drift,
        )


# --------------------------------------------------------------------------- controller


class Demands:
    """The controller's part: reports in, the demand in each deployment's status, a re-plan
    asked for on drift (see the module docstring).

    Args:
        ctx: the controller's shared dependencies (its ``settings.demand``).
    """

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.settings = ctx.settings.demand
        self.tracker = DriftTracker(self.settings)
        self._written_s: dict[str, float] = {}

    def report(self, w: TrafficWindow) -> bool:
        """Take a router's window; returns False when it is too old to count.

        Raises:
            InputError: naming the ``TrafficReport`` field. NotFoundError: unknown deployment.
        """
        check_window(w, self.settings)
        store = self.ctx.store
        d = store.get_deployment(w.deployment)
        if d is None:
            raise NotFoundError(f"no deployment {w.deployment!r}", field="deployment")
        now = self.ctx.clock()
        if not self.tracker.add(w, now):
            return False
        due = now - self._written_s.get(d.name, -math.inf) >= self.settings.status_write_s
        before = DemandStatus.from_status(d.status)
        status, drift = self.tracker.decide(d.name, before, d.spec, now, measure=due)
        if drift is not None:
            planned = status.planned
            self.ctx.log.info(
                "demand drifted: re-planning for the measured traffic",
                deployment=d.name,
                direction=drift.direction,
                planned_requests_per_s=drift.planned_requests_per_s,
                measured_requests_per_s=drift.measured.requests_per_s,
                planning_requests_per_s=planned.requests_per_s if planned else None,
                replans=status.replans,
            )
            self._write(d.name, replace(status, measured=drift.measured), now)
            self.ctx.changed(d.name)
        elif due:
            self._write(d.name, status, now)
        return True

    def _write(self, name: str, status: DemandStatus, now_s: float) -> None:
        d = self.ctx.store.get_deployment(name)  # read again: others write its status too
        if d is None:
            return
        merged = dict(d.status)
        merged[DEMAND_KEY] = status.to_doc()
        self.ctx.store.set_deployment_status(name, merged)
        self._written_s[name] = now_s

    def traffic_for(self, d: StoredDeployment) -> Traffic:
        """The demand the deployment ``d`` is planned for (the fleet scheduler's hook): the
        measured traffic after a sustained drift, else its spec's.

        Raises:
            InputError: its spec states no traffic.
        """
        return traffic_for(d.spec, d.status)

    def forget(self, deployment: str) -> None:
        """Drop a deleted deployment's measurements."""
        self.tracker.forget(deployment)
        self._written_s.pop(deployment, None)


def traffic_for(spec: DeploymentSpec, status: Mapping[str, Any]) -> Traffic:
    """The demand a deployment (its spec and stored status) is planned for: the measured
    traffic after a sustained drift, else its spec's.

    Raises:
        InputError: the spec states no traffic.
    """
    traffic = DemandStatus.from_status(status).planning_traffic(spec)
    if traffic is None:
        raise InputError("states no traffic to plan for", field="spec.traffic")
    return traffic


__all__ = [
    "DEMAND_KEY",
    "DemandSettings",
    "DemandStatus",
    "Demands",
    "Drift",
    "DriftTracker",
    "TrafficWindow",
    "traffic_for",
]
