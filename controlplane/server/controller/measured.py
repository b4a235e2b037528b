"""Routers' traffic reports and the demand measured from them.

Routers report what they measured of a deployment's traffic per window
(``EngineService.ReportTraffic``: requests, prompt and output lengths, the TTFT and TPOT they
observed): a :class:`TrafficWindow`, checked by :func:`check_window`. Several routers may
each see part of the traffic, so windows are summed over reporters (:func:`measure`).

**Time.** Time is cut into buckets of ``bucket_s`` seconds (Unix time, aligned to multiples
of ``bucket_s``). A reporter's windows spread their requests evenly over their span; a
bucket's rate is the sum over reporters of (requests in the bucket / seconds of the bucket
the reporter's windows cover), so a router that reports every 5 s and one that reports every
30 s add up (:class:`Share`). A bucket *counts* when some reporter's windows cover at
least :data:`MIN_BUCKET_COVERAGE` of it; gaps count as no data, never as zero traffic.

**Merging reporters' figures.** Requests and rates add up exactly. Lengths and latencies
arrive as summaries (mean, p90, p50, p99) and a percentile of a union cannot be recovered
from summaries; the merged figure is the request-weighted mean of the reporters' figures
(exact for means, and for percentiles when the reporters see the same distribution).
SLO counts (streamed requests judged against the SLO, and those that met it) add up
exactly, like requests; the attainment is met / judged over the span.

**Planning for a measurement** (:func:`measured_traffic`): a
:class:`~policies.serving.traffic.Traffic` with lognormal lengths fitted to the measured mean
and p90.

Pure: no I/O. Units: seconds (``_s``, Unix time for instants), requests per second, tokens,
milliseconds (``_ms``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from policies.errors import InputError
from policies.serving.traffic import (
    MAX_LENGTH_TOKENS,
    MAX_REQUESTS_PER_S,
    MAX_SLO_MS,
    LengthDist,
    Traffic,
    check_traffic,
)

MIN_BUCKET_COVERAGE = 0.5
"""Fraction of a bucket some reporter's windows must cover for the bucket to count."""

MAX_REPORTER_CHARS = 253
"""Longest reporter name, characters."""

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
        """How long after its end a window still counts (its buckets are kept), s."""
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
        slo_judged: streamed requests judged against the SLO.
        slo_met: those whose TTFT and TPOT both met it (<= ``slo_judged``).
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
    slo_judged: int = 0
    slo_met: int = 0

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
    if w.slo_judged < 0 or w.slo_judged / w.span_s > MAX_REQUESTS_PER_S:
        raise InputError(
            f"{w.slo_judged} over {w.span_s:g} s is out of range (at most "
            f"{MAX_REQUESTS_PER_S:g} requests/s)",
            field="slo_judged",
        )
    if not 0 <= w.slo_met <= w.slo_judged:
        raise InputError(
            f"{w.slo_met} is not in [0, slo_judged {w.slo_judged}]. To fix: count only judged "
            "requests as met",
            field="slo_met",
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
        slo_judged: streamed requests judged against the SLO in the span.
        slo_met: those that met it.
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
    slo_judged: float = 0.0
    slo_met: float = 0.0

    @property
    def slo_attainment(self) -> float | None:
        """Share of the judged requests that met the SLO, in [0, 1]; None when none was
        judged."""
        return min(self.slo_met / self.slo_judged, 1.0) if self.slo_judged > 0 else None

    def to_doc(self) -> dict[str, Any]:
        """The status form (camelCase, JSON values; ``sloAttainment`` only when some
        request was judged)."""
        doc: dict[str, Any] = {
            "startUnixS": self.start_s,
            "endUnixS": self.end_s,
            "requestsPerS": self.requests_per_s,
            "requests": self.requests,
            "inputTokens": {"mean": self.input_tokens_mean, "p90": self.input_tokens_p90},
            "outputTokens": {"mean": self.output_tokens_mean, "p90": self.output_tokens_p90},
            "ttftMs": {"p50": self.ttft_ms_p50, "p99": self.ttft_ms_p99},
            "tpotMs": {"p50": self.tpot_ms_p50, "p99": self.tpot_ms_p99},
            "reporters": self.reporters,
            "sloJudged": self.slo_judged,
            "sloMet": self.slo_met,
        }
        if self.slo_attainment is not None:
            doc["sloAttainment"] = self.slo_attainment
        return doc

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
                slo_judged=float(doc.get("sloJudged", 0.0)),
                slo_met=float(doc.get("sloMet", 0.0)),
            )
        except (KeyError, TypeError, ValueError):
            return None


_FIGURES = (*_TOKEN_FIELDS, *_MS_FIELDS)


@dataclass
class Share:
    """What one reporter's windows put into one span (a bucket, or any interval).

    Attributes:
        covered_s: seconds of the span its windows cover.
        requests: requests in it (a window's spread evenly over the window).
        weighted: request-weighted sums of the figures, in the order of ``_FIGURES``.
        slo_judged, slo_met: SLO counts in it (a window's spread evenly, like requests).
    """

    covered_s: float = 0.0
    requests: float = 0.0
    weighted: list[float] = field(default_factory=lambda: [0.0] * len(_FIGURES))
    slo_judged: float = 0.0
    slo_met: float = 0.0

    def add(self, w: TrafficWindow, inside_s: float) -> None:
        """Add the ``inside_s`` seconds of ``w`` that fall in the span."""
        part = inside_s / w.span_s
        n = w.requests * part
        self.covered_s += inside_s
        self.requests += n
        self.slo_judged += w.slo_judged * part
        self.slo_met += w.slo_met * part
        for i, name in enumerate(_FIGURES):
            self.weighted[i] += n * getattr(w, name)

    def merge(self, other: Share) -> None:
        """Add another span's share of the same reporter."""
        self.covered_s += other.covered_s
        self.requests += other.requests
        self.slo_judged += other.slo_judged
        self.slo_met += other.slo_met
        self.weighted = [a + b for a, b in zip(self.weighted, other.weighted, strict=True)]


def demand_of(shares: Mapping[str, Share], start_s: float, end_s: float) -> MeasuredDemand:
    """The demand over ``[start_s, end_s)`` (Unix s) from each reporter's share of it: per
    reporter its requests over the seconds it covers, summed over reporters; lengths and
    latencies request-weighted."""
    span = end_s - start_s
    rate = sum(x.requests / min(x.covered_s, span) for x in shares.values() if x.covered_s > 0)
    total = sum(x.requests for x in shares.values())
    sums = [sum(x.weighted[i] for x in shares.values()) for i in range(len(_FIGURES))]
    means = {k: (v / total if total > 0 else 0.0) for k, v in zip(_FIGURES, sums, strict=True)}
    return MeasuredDemand(
        start_s=start_s,
        end_s=end_s,
        requests_per_s=rate,
        requests=total,
        reporters=len(shares),
        slo_judged=sum(x.slo_judged for x in shares.values()),
        slo_met=sum(x.slo_met for x in shares.values()),
        **means,
    )


def measure(windows: Iterable[TrafficWindow], start_s: float, end_s: float) -> MeasuredDemand:
    """The demand over ``[start_s, end_s)`` (Unix s) of ``windows`` (:func:`demand_of`); a
    window counts with the fraction of it inside the span."""
    shares: dict[str, Share] = {}
    for w in windows:
        inside = min(w.end_s, end_s) - max(w.start_s, start_s)
        if inside > 0:
            shares.setdefault(w.reporter, Share()).add(w, inside)
    return demand_of(shares, start_s, end_s)


def bucket_counts(shares: Mapping[str, Share], bucket_s: float) -> bool:
    """Whether a bucket of ``bucket_s`` seconds with these shares has data: some reporter
    covers at least :data:`MIN_BUCKET_COVERAGE` of it."""
    return any(x.covered_s >= MIN_BUCKET_COVERAGE * bucket_s for x in shares.values())


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


__all__ = [
    "MAX_REPORTER_CHARS",
    "MIN_BUCKET_COVERAGE",
    "MIN_PLANNED_REQUESTS_PER_S",
    "DemandSettings",
    "MeasuredDemand",
    "Share",
    "TrafficWindow",
    "bucket_counts",
    "check_window",
    "demand_of",
    "measure",
    "measured_traffic",
]
