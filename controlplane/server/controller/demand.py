"""Measured demand and re-planning when it drifts from the demand a deployment is planned for.

Routers report what they measured of a deployment's traffic per window
(``EngineService.ReportTraffic``: requests, prompt and output lengths, the TTFT and TPOT they
observed). Several routers may each see part of the traffic, so windows are summed over
reporters. :class:`DriftTracker` (pure, with an explicit clock) keeps the windows and decides;
:class:`Demands` is the controller's part: it validates reports, keeps the planned and
measured demand in the deployment's status and asks for a re-plan.

**Time.** Time is cut into buckets of ``bucket_s`` seconds (Unix time, aligned to multiples
of ``bucket_s``). A reporter's windows spread their requests evenly over their span; a
bucket's rate is the sum over reporters of (requests in the bucket / seconds of the bucket
the reporter's windows cover), so a router that reports every 5 s and one that reports every
30 s add up. A bucket *counts* when some reporter's windows cover at least
:data:`MIN_BUCKET_COVERAGE` of it; gaps count as no data, never as zero traffic.

**Drift.** With ``t = drift_threshold`` and ``planned`` the requests/s the deployment is
planned for, the band is ``[planned / (1 + t), planned * (1 + t)]``. At the latest reported
instant ``h``, the ``ceil(sustain_s / bucket_s)`` buckets ending at or before ``h`` are
examined: drift when every one of them counts and every rate lies outside the band on the same
side (all above, or all below). A blip shorter than ``sustain_s`` leaves a bucket inside the
band; a gap leaves a bucket without data; neither drifts.

**Re-plan.** On drift, and when the last re-plan is at least ``min_interval_s`` ago (the
controller's clock), the planning traffic becomes the measured one over those buckets - a
:class:`~policies.serving.traffic.Traffic` with lognormal lengths fitted to the measured mean
and p90 (:func:`measured_traffic`), the spec's arrival process and SLOs kept - and stays
until the next drift or until the spec's own traffic changes. This is the hysteresis of
Dynamo's SLA planner (https://docs.nvidia.com/dynamo/v-0-9-0/design-docs/planner-design.md:
every ``adjustment_interval`` it reads request count, mean ISL/OSL and TTFT/ITL, predicts
the next interval's load and resizes the prefill/decode pools), with two differences: a dead
band (``drift_threshold``) and a persistence requirement (``sustain_s``) before acting, so
noise inside the band never moves an instance, and the minimum interval bounds how often
instances can be moved at all.

**Merging reporters' figures.** Requests and rates add up exactly. Lengths and latencies
arrive as summaries (mean, p90, p50, p99) and a percentile of a union cannot be recovered
from summaries; the merged figure is the request-weighted mean of the reporters' figures
(exact for means, and for percentiles when the reporters see the same distribution).

Units: seconds (``_s``, Unix time for instants), requests per second, tokens,
milliseconds (``_ms``).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from controlplane.errors import NotFoundError
from policies.errors import InputError
from policies.fleetplan.instances import is_planned
from policies.serving.traffic import (
    MAX_LENGTH_TOKENS,
    MAX_REQUESTS_PER_S,
    MAX_SLO_MS,
    LengthDist,
    Traffic,
    check_traffic,
    traffic_from_doc,
    traffic_to_doc,
)
from policies.spec import DeploymentSpec

if TYPE_CHECKING:
    from controlplane.server.controller.common import Context
    from controlplane.store import StoredDeployment

DEMAND_KEY = "demand"
"""Status key of a deployment's :class:`DemandStatus` document."""

MIN_BUCKET_COVERAGE = 0.5
"""Fraction of a bucket some reporter's windows must cover for the bucket to count."""

MAX_REPORTER_CHARS = 253
"""Longest reporter name, characters."""

MAX_WINDOWS_PER_DEPLOYMENT = 50_000
"""Most windows kept per deployment (the oldest go first)."""

MIN_PLANNED_REQUESTS_PER_S = 1e-3
"""Planning rate when a sustained drop measured no request at all, requests/s (the planner
needs a positive demand; the lengths stay the planned ones)."""

_P90_OVER_MEAN_MAX = math.exp(1.2815515655446004**2 / 2.0)  # the widest lognormal p90 / mean


@dataclass(frozen=True)
class DemandSettings:
    """When measured demand re-plans a deployment (see the module docstring).

    Attributes:
        drift_threshold: relative band around the planned requests/s; drift when the measured
            rate leaves ``[planned / (1 + t), planned * (1 + t)]`` (0.25 = 25 %).
        sustain_s: how long the measured rate must stay outside the band, on one side,
            with data all along, before a re-plan, s.
        min_interval_s: shortest time between two re-plans of one deployment, s.
        bucket_s: width of the time buckets rates are measured in, s.
        max_window_s: longest window a report may cover, s.
        status_write_s: the measured demand in a deployment's status is rewritten at most
            this often, s (a re-plan writes at once).
    """

    drift_threshold: float = 0.25
    sustain_s: float = 60.0
    min_interval_s: float = 300.0
    bucket_s: float = 10.0
    max_window_s: float = 300.0
    status_write_s: float = 10.0

    def check(self) -> None:
        """Refuse settings that cannot work.

        Raises:
            InputError: naming the setting.
        """
        for name in ("drift_threshold", "sustain_s", "bucket_s", "max_window_s"):
            v = getattr(self, name)
            if not math.isfinite(v) or v <= 0:
                raise InputError(f"must be a finite number > 0, got {v}", field=name)
        for name in ("min_interval_s", "status_write_s"):
            v = getattr(self, name)
            if not math.isfinite(v) or v < 0:
                raise InputError(f"must be a finite number >= 0, got {v}", field=name)
        if self.sustain_s < self.bucket_s:
            raise InputError(
                f"sustain_s {self.sustain_s:g} is shorter than one bucket "
                f"({self.bucket_s:g} s). To fix: raise it to at least bucket_s",
                field="sustain_s",
            )

    @property
    def retention_s(self) -> float:
        """How long a window is kept after its end, s."""
        return self.sustain_s + self.max_window_s + 2 * self.bucket_s


# --------------------------------------------------------------------------- reports


@dataclass(frozen=True)
class TrafficWindow:
    """One router's measurement of a deployment's traffic over ``[start_s, end_s)``
    (``mixfleet.v1.TrafficReport``).

    Attributes:
        deployment: the deployment measured.
        reporter: who measured (router name).
        start_s: window start, Unix s.
        end_s: window end, Unix s.
        requests: requests that arrived in the window.
        input_tokens_mean: mean prompt length, tokens.
        input_tokens_p90: 90th percentile prompt length, tokens.
        output_tokens_mean: mean output length, tokens.
        output_tokens_p90: 90th percentile output length, tokens.
        ttft_ms_p50: median time to first token observed, ms.
        ttft_ms_p99: 99th percentile time to first token observed, ms.
        tpot_ms_p50: median time per output token observed, ms.
        tpot_ms_p99: 99th percentile time per output token observed, ms.
    """

    deployment: str
    reporter: str
    start_s: float
    end_s: float
    requests: int
    input_tokens_mean: float = 0.0
    input_tokens_p90: float = 0.0
    output_tokens_mean: float = 0.0
    output_tokens_p90: float = 0.0
    ttft_ms_p50: float = 0.0
    ttft_ms_p99: float = 0.0
    tpot_ms_p50: float = 0.0
    tpot_ms_p99: float = 0.0

    @property
    def span_s(self) -> float:
        """Length of the window, s."""
        return self.end_s - self.start_s


_TOKEN_FIELDS = ("input_tokens_mean", "input_tokens_p90", "output_tokens_mean", "output_tokens_p90")
_MS_FIELDS = ("ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99")


def check_window(w: TrafficWindow, settings: DemandSettings) -> None:
    """Validate a report; the error names the ``TrafficReport`` field.

    Raises:
        InputError: an empty or over-long reporter; a non-finite or negative time; an end not
            after the start; a window over ``max_window_s``; more than
            :data:`~policies.serving.traffic.MAX_REQUESTS_PER_S` over the window; a length
            or latency that is not a finite number in range; a p99 below its p50.
    """
    if not w.deployment:
        raise InputError("is empty. To fix: name the deployment measured", field="deployment")
    if not w.reporter.strip():
        raise InputError("is empty. To fix: name the router that measured", field="reporter")
    if len(w.reporter) > MAX_REPORTER_CHARS:
        raise InputError(
            f"has {len(w.reporter)} characters, over {MAX_REPORTER_CHARS}", field="reporter"
        )
    for name in ("start_unix_s", "end_unix_s"):
        v = w.start_s if name == "start_unix_s" else w.end_s
        if not math.isfinite(v) or v < 0:
            raise InputError(f"must be a finite Unix time >= 0, got {v}", field=name)
    if w.end_s <= w.start_s:
        raise InputError(f"{w.end_s} is not after start_unix_s {w.start_s}", field="end_unix_s")
    if w.span_s > settings.max_window_s:
        raise InputError(
            f"the window spans {w.span_s:g} s, over the controller's limit of "
            f"{settings.max_window_s:g} s. To fix: report shorter windows",
            field="end_unix_s",
        )
    if w.requests < 0 or w.requests / w.span_s > MAX_REQUESTS_PER_S:
        raise InputError(
            f"{w.requests} over {w.span_s:g} s is out of range (at most "
            f"{MAX_REQUESTS_PER_S:g} requests/s)",
            field="requests",
        )
    for name in _TOKEN_FIELDS:
        _check_figure(getattr(w, name), name, MAX_LENGTH_TOKENS)
    for name in _MS_FIELDS:
        _check_figure(getattr(w, name), name, MAX_SLO_MS)
    for what in ("ttft", "tpot"):
        p50, p99 = getattr(w, f"{what}_ms_p50"), getattr(w, f"{what}_ms_p99")
        if p99 < p50:
            raise InputError(
                f"{p99:g} is below {what}_ms_p50 {p50:g}. To fix: report p99 >= p50",
                field=f"{what}_ms_p99",
            )


def _check_figure(v: float, name: str, high: float) -> None:
    if not math.isfinite(v) or v < 0 or v > high:
        raise InputError(f"must be a finite number in [0, {high:g}], got {v}", field=name)


# --------------------------------------------------------------------------- measured


@dataclass(frozen=True)
class MeasuredDemand:
    """What the routers measured of a deployment over ``[start_s, end_s)``, summed over
    reporters (see the module docstring for how figures merge).

    Attributes:
        start_s: start of the span measured, Unix s.
        end_s: its end, Unix s.
        requests_per_s: arrival rate, requests/s.
        requests: requests counted in the span.
        input_tokens_mean: mean prompt length, tokens (0 without requests).
        input_tokens_p90: 90th percentile prompt length, tokens.
        output_tokens_mean: mean output length, tokens.
        output_tokens_p90: 90th percentile output length, tokens.
        ttft_ms_p50: median time to first token observed, ms.
        ttft_ms_p99: 99th percentile time to first token observed, ms.
        tpot_ms_p50: median time per output token observed, ms.
        tpot_ms_p99: 99th percentile time per output token observed, ms.
        reporters: routers whose windows fall in the span.
    """

    start_s: float
    end_s: float
    requests_per_s: float
    requests: float = 0.0
    input_tokens_mean: float = 0.0
    input_tokens_p90: float = 0.0
    output_tokens_mean: float = 0.0
    output_tokens_p90: float = 0.0
    ttft_ms_p50: float = 0.0
    ttft_ms_p99: float = 0.0
    tpot_ms_p50: float = 0.0
    tpot_ms_p99: float = 0.0
    reporters: int = 0

    def to_doc(self) -> dict[str, Any]:
        """The status form (camelCase, JSON values)."""
        return {
            "startUnixS": self.start_s,
            "endUnixS": self.end_s,
            "requestsPerS": self.requests_per_s,
            "requests": self.requests,
            "inputTokens": {"mean": self.input_tokens_mean, "p90": self.input_tokens_p90},
            "outputTokens": {"mean": self.output_tokens_mean, "p90": self.output_tokens_p90},
            "ttftMs": {"p50": self.ttft_ms_p50, "p99": self.ttft_ms_p99},
            "tpotMs": {"p50": self.tpot_ms_p50, "p99": self.tpot_ms_p99},
            "reporters": self.reporters,
        }

    @staticmethod
    def from_doc(doc: Any) -> MeasuredDemand | None:
        """Read :meth:`to_doc`'s form (None when it does not read)."""
        if not isinstance(doc, Mapping):
            return None
        try:
            inp, out = doc["inputTokens"], doc["outputTokens"]
            ttft, tpot = doc["ttftMs"], doc["tpotMs"]
            return MeasuredDemand(
                start_s=float(doc["startUnixS"]),
                end_s=float(doc["endUnixS"]),
                requests_per_s=float(doc["requestsPerS"]),
                requests=float(doc.get("requests", 0.0)),
                input_tokens_mean=float(inp["mean"]),
                input_tokens_p90=float(inp["p90"]),
                output_tokens_mean=float(out["mean"]),
                output_tokens_p90=float(out["p90"]),
                ttft_ms_p50=float(ttft["p50"]),
                ttft_ms_p99=float(ttft["p99"]),
                tpot_ms_p50=float(tpot["p50"]),
                tpot_ms_p99=float(tpot["p99"]),
                reporters=int(doc.get("reporters", 0)),
            )
        except (KeyError, TypeError, ValueError):
            return None


def _overlap(w: TrafficWindow, start_s: float, end_s: float) -> float:
    return max(0.0, min(w.end_s, end_s) - max(w.start_s, start_s))


def measure(windows: Iterable[TrafficWindow], start_s: float, end_s: float) -> MeasuredDemand:
    """The demand over ``[start_s, end_s)`` (Unix s): per reporter, requests in the span over
    the seconds its windows cover of it, summed over reporters; lengths and latencies
    request-weighted. A window counts with the fraction of it inside the span."""
    requests: dict[str, float] = {}
    covered: dict[str, float] = {}
    weighted = dict.fromkeys((*_TOKEN_FIELDS, *_MS_FIELDS), 0.0)
    total = 0.0
    for w in windows:
        inside = _overlap(w, start_s, end_s)
        if inside <= 0:
            continue
        n = w.requests * inside / w.span_s
        requests[w.reporter] = requests.get(w.reporter, 0.0) + n
        covered[w.reporter] = covered.get(w.reporter, 0.0) + inside
        total += n
        for name in weighted:
            weighted[name] += n * getattr(w, name)
    span = end_s - start_s
    rate = sum(requests[r] / min(covered[r], span) for r in requests if covered[r] > 0)
    means = {k: (v / total if total > 0 else 0.0) for k, v in weighted.items()}
    return MeasuredDemand(
        start_s=start_s,
        end_s=end_s,
        requests_per_s=rate,
        requests=total,
        reporters=len(requests),
        **means,
    )


def bucket_rates(
    windows: Sequence[TrafficWindow], first_s: float, count: int, bucket_s: float
) -> list[float | None]:
    """The rate of each of ``count`` buckets of ``bucket_s`` seconds from ``first_s`` (Unix
    s), requests/s; None for a bucket no reporter covers to :data:`MIN_BUCKET_COVERAGE`."""
    out: list[float | None] = []
    for k in range(count):
        start = first_s + k * bucket_s
        end = start + bucket_s
        inside = [w for w in windows if _overlap(w, start, end) > 0]
        by_reporter: dict[str, float] = {}
        for w in inside:
            by_reporter[w.reporter] = by_reporter.get(w.reporter, 0.0) + _overlap(w, start, end)
        if not by_reporter or max(by_reporter.values()) < MIN_BUCKET_COVERAGE * bucket_s:
            out.append(None)
            continue
        out.append(measure(inside, start, end).requests_per_s)
    return out


def measured_traffic(m: MeasuredDemand, planned: Traffic) -> Traffic:
    """The traffic to plan for from a measurement: its rate, lognormal lengths fitted to the
    measured mean and p90 (the mean at least 1 token, the p90 brought into the
    ``[mean, 2.27 x mean]`` a lognormal allows), ``planned``'s arrival process. Without a
    request measured the lengths stay ``planned``'s and the rate is
    :data:`MIN_PLANNED_REQUESTS_PER_S`."""
    if m.requests <= 0:
        return Traffic(
            MIN_PLANNED_REQUESTS_PER_S,
            planned.input_len,
            planned.output_len,
            arrival=planned.arrival,
            burst_cv=planned.burst_cv,
        )
    traffic = Traffic(
        requests_per_s=min(max(m.requests_per_s, MIN_PLANNED_REQUESTS_PER_S), MAX_REQUESTS_PER_S),
        input_len=_lognormal_length(m.input_tokens_mean, m.input_tokens_p90),
        output_len=_lognormal_length(m.output_tokens_mean, m.output_tokens_p90),
        arrival=planned.arrival,
        burst_cv=planned.burst_cv,
    )
    check_traffic(traffic, "measured")
    return traffic


def _lognormal_length(mean: float, p90: float) -> LengthDist:
    mean = min(max(mean, 1.0), float(MAX_LENGTH_TOKENS))
    p90 = min(max(p90, mean), mean * _P90_OVER_MEAN_MAX * (1 - 1e-9), float(MAX_LENGTH_TOKENS))
    return LengthDist(mean=mean, p90=max(p90, mean))


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
        if self.planned is None or spec.traffic is None:
            return spec.traffic
        if self.spec_traffic != traffic_to_doc(spec.traffic):
            return spec.traffic
        return self.planned

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
    windows: deque[TrafficWindow] = field(
        default_factory=lambda: deque(maxlen=MAX_WINDOWS_PER_DEPLOYMENT)
    )
    horizon_s: float = 0.0


class DriftTracker:
    """Windows per deployment and the drift decision (pure: no I/O, the clock passed in).

    Args:
        settings: thresholds and spans.
    """

    def __init__(self, settings: DemandSettings) -> None:
        self.settings = settings
        self._series: dict[str, _Series] = {}

    def add(self, w: TrafficWindow, now_s: float) -> bool:
        """Keep a (validated) window; False when it ended more than the retention before
        ``now_s`` (Unix s) and cannot count any more."""
        if w.end_s < now_s - self.settings.retention_s:
            return False
        s = self._series.setdefault(w.deployment, _Series())
        s.windows.append(w)
        s.horizon_s = max(s.horizon_s, w.end_s)
        self._prune(s, now_s)
        return True

    def forget(self, deployment: str) -> None:
        """Drop a deployment's windows (it was deleted)."""
        self._series.pop(deployment, None)

    def _prune(self, s: _Series, now_s: float) -> None:
        oldest = min(now_s, s.horizon_s) - self.settings.retention_s
        if s.windows and min(w.end_s for w in s.windows) < oldest:
            s.windows = deque(
                (w for w in s.windows if w.end_s >= oldest), maxlen=MAX_WINDOWS_PER_DEPLOYMENT
            )

    def _span(self, deployment: str) -> tuple[float, int] | None:
        """(first bucket start, bucket count) of the sustained span at the horizon."""
        s = self._series.get(deployment)
        if s is None or not s.windows:
            return None
        b = self.settings.bucket_s
        last_end = math.floor(s.horizon_s / b) * b
        count = math.ceil(self.settings.sustain_s / b - 1e-9)
        return last_end - count * b, count

    def measured(self, deployment: str) -> MeasuredDemand | None:
        """The demand over the last ``sustain_s`` of data (None without any)."""
        span = self._span(deployment)
        if span is None:
            return None
        first, count = span
        windows = self._series[deployment].windows
        return measure(windows, first, first + count * self.settings.bucket_s)

    def drift(self, deployment: str, planned_requests_per_s: float) -> Drift | None:
        """The drift of ``deployment`` from ``planned_requests_per_s`` at its latest data
        (see the module docstring), or None."""
        span = self._span(deployment)
        if span is None or planned_requests_per_s <= 0:
            return None
        first, count = span
        b = self.settings.bucket_s
        windows = list(self._series[deployment].windows)
        rates = bucket_rates(windows, first, count, b)
        high = planned_requests_per_s * (1 + self.settings.drift_threshold)
        low = planned_requests_per_s / (1 + self.settings.drift_threshold)
        if any(r is None for r in rates):
            return None
        if all(r is not None and r > high for r in rates):
            direction = "above"
        elif all(r is not None and r < low for r in rates):
            direction = "below"
        else:
            return None
        return Drift(direction, measure(windows, first, first + count * b), planned_requests_per_s)

    def decide(
        self, deployment: str, status: DemandStatus, spec: DeploymentSpec, now_s: float
    ) -> tuple[DemandStatus, Drift | None]:
        """The deployment's demand status after its latest data, and the drift that changed
        its planning traffic (None when it did not: no drift, or the last re-plan is less
        than ``min_interval_s`` before ``now_s``, Unix s). A spec without traffic and SLOs
        is only measured."""
        measured = self.measured(deployment)
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
        status, drift = self.tracker.decide(d.name, DemandStatus.from_status(d.status), d.spec, now)
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
            self._write(d.name, status, now)
            self.ctx.changed(d.name)
        elif now - self._written_s.get(d.name, -math.inf) >= self.settings.status_write_s:
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
        """Drop a deleted deployment's windows."""
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
    "MeasuredDemand",
    "TrafficWindow",
    "bucket_rates",
    "check_window",
    "measure",
    "measured_traffic",
    "traffic_for",
]
