"""The serving simulator's options and report: what :func:`policies.serving.simulate.simulate`
takes and returns, the percentiles it reports with, and the report's JSON document.

Re-exported by :mod:`policies.serving.simulate`.

Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from policies.errors import InputError

MAX_SIM_REQUESTS = 10_000_000
"""Most requests one simulation runs."""


@dataclass(frozen=True)
class SimOptions:
    """How long and how the simulation runs.

    Attributes:
        requests: requests to simulate (warm-up included).
        seed: seed of the random generator (arrivals and lengths).
        warmup_requests: the first requests, left out of the statistics.
        max_sim_s: stop at this simulated time, s (requests not finished by then count as
            missing their SLO); 0 = run until every request has finished.
    """

    requests: int = 10_000
    seed: int = 0
    warmup_requests: int = 0
    max_sim_s: float = 0.0


def check_options(options: SimOptions, path: str = "options") -> None:
    """Validate simulation options.

    Raises:
        InputError: naming the option.
    """
    n = options.requests
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_SIM_REQUESTS:
        raise InputError(
            f"must be a whole number in [1, {MAX_SIM_REQUESTS}], got {n!r}",
            field=f"{path}.requests",
        )
    s = options.seed
    if isinstance(s, bool) or not isinstance(s, int):
        raise InputError(f"must be a whole number, got {s!r}", field=f"{path}.seed")
    w = options.warmup_requests
    if isinstance(w, bool) or not isinstance(w, int) or not 0 <= w < n:
        raise InputError(
            f"must be a whole number in [0, requests) = [0, {n}), got {w!r}",
            field=f"{path}.warmupRequests",
        )
    m = options.max_sim_s
    if isinstance(m, bool) or not isinstance(m, int | float) or not math.isfinite(m) or m < 0:
        raise InputError(
            f"must be a finite number of seconds >= 0 (0 = until all finish), got {m!r}",
            field=f"{path}.maxSimS",
        )


@dataclass(frozen=True)
class Percentiles:
    """Percentiles of one latency over the measured requests, ms (linear interpolation
    between order statistics; all 0 when there are none).

    Attributes:
        p50: median, ms.
        p90: 90th percentile, ms.
        p99: 99th percentile, ms.
        mean: mean, ms.
    """

    p50: float
    p90: float
    p99: float
    mean: float


@dataclass(frozen=True)
class RequestRecord:
    """One simulated request (times in simulated us from the start; -1 when it did not
    happen before the end of the simulation).

    Attributes:
        pool: index of the pool the router sent it to.
        arrival_us: arrival at the router.
        admitted_us: start of its prefill (aggregated: admission to a batch; P/D: the
            start of its prefill forward).
        first_token_us: its first token reached the client.
        finish_us: its last token.
        input_tokens: prompt length, tokens.
        output_tokens: output length, tokens.
    """

    pool: int
    arrival_us: float
    admitted_us: float
    first_token_us: float
    finish_us: float
    input_tokens: int
    output_tokens: int

    @property
    def ttft_ms(self) -> float:
        """Time to first token, ms (inf when it never came)."""
        return (
            (self.first_token_us - self.arrival_us) / 1e3 if self.first_token_us >= 0 else math.inf
        )

    @property
    def tpot_ms(self) -> float:
        """Mean time per output token after the first, ms (0 for one output token; inf
        when unfinished)."""
        if self.finish_us < 0:
            return math.inf
        if self.output_tokens <= 1:
            return 0.0
        return (self.finish_us - self.first_token_us) / 1e3 / (self.output_tokens - 1)


@dataclass(frozen=True)
class GroupReport:
    """How one instance group of a pool was used.

    Attributes:
        role: ``aggregated``, ``prefill`` or ``decode``.
        instances: instances in the group.
        utilisation: mean over its instances of the fraction of the simulated time spent
            in steps (0..1).
        mean_running: time-weighted mean of the sequences admitted and not finished, per
            instance, over the simulated time (prefill: prompts in the forward).
        mean_wait_ms: mean wait of a request from reaching the group's queue to its
            admission (aggregated, decode) or its forward's start (prefill), ms.
        max_queue: most requests waiting at one instance at once.
        steps: steps (forwards) run by all its instances.
    """

    role: str
    instances: int
    utilisation: float
    mean_running: float
    mean_wait_ms: float
    max_queue: int
    steps: int


@dataclass(frozen=True)
class PoolReport:
    """One pool's part of a simulation.

    Attributes:
        name: pool name.
        requests: measured requests the router sent it.
        attainment: fraction of them within both SLOs.
        ttft_p90_ms: their 90th-percentile TTFT, ms.
        tpot_p90_ms: their 90th-percentile TPOT, ms.
        usd_per_hour: price of its instances, USD per hour.
        kv_link_utilisation: prefill/decode: mean over its prefill instances of the
            fraction of the simulated time their KV path was sending (0..1); 0 aggregated.
        groups: its instance groups (aggregated, or prefill then decode).
    """

    name: str
    requests: int
    attainment: float
    ttft_p90_ms: float
    tpot_p90_ms: float
    usd_per_hour: float
    kv_link_utilisation: float
    groups: tuple[GroupReport, ...]


@dataclass(frozen=True)
class SimReport:
    """What a simulation measured (over the measured requests: warm-up left out).

    Attributes:
        requests: measured requests.
        completed: of them, finished before the end of the simulation.
        met: of them, within both SLOs.
        window_s: measured window (last warm-up arrival to last arrival), s.
        duration_s: simulated time at the end, s.
        offered_rps: measured requests over the window, requests per second.
        ttft_ms: time to first token of the requests that got one, ms.
        tpot_ms: time per output token after the first, of the finished requests with more
            than one output token, ms.
        attainment: ``met / requests`` (0..1).
        slo_met: whether ``attainment`` reaches the SLO's percentile.
        goodput_rps: requests within both SLOs per second of the window.
        goodput_tokens_per_s: their output tokens per second of the window.
        throughput_rps: requests (any, warm-up included) that finished inside the window, per
            second of it.
        throughput_tokens_per_s: output tokens the instances produced inside the window, per
            second of it (in overload: what the plan can serve).
        usd_per_hour: price of every instance of the plan, USD per hour.
        usd_per_million_tokens: USD per million output tokens served
            (``usd_per_hour / 3600 / throughput_tokens_per_s * 1e6``; inf with no tokens).
        usd_per_million_good_tokens: the same per million output tokens within the SLOs.
        pools: per pool.
        records: every request, warm-up included, in arrival order.
    """

    requests: int
    completed: int
    met: int
    window_s: float
    duration_s: float
    offered_rps: float
    ttft_ms: Percentiles
    tpot_ms: Percentiles
    attainment: float
    slo_met: bool
    goodput_rps: float
    goodput_tokens_per_s: float
    throughput_rps: float
    throughput_tokens_per_s: float
    usd_per_hour: float
    usd_per_million_tokens: float
    usd_per_million_good_tokens: float
    pools: tuple[PoolReport, ...]
    records: tuple[RequestRecord, ...]


def percentiles(values: Sequence[float]) -> Percentiles:
    """p50/p90/p99 and mean of ``values`` (linear interpolation between order statistics,
    as numpy's default); all 0 for none."""
    if not values:
        return Percentiles(0.0, 0.0, 0.0, 0.0)
    s = sorted(values)
    return Percentiles(
        p50=quantile_sorted(s, 0.5),
        p90=quantile_sorted(s, 0.9),
        p99=quantile_sorted(s, 0.99),
        mean=math.fsum(s) / len(s),
    )


def quantile_sorted(s: Sequence[float], q: float) -> float:
    """The ``q`` quantile (fraction) of sorted ``s``, linear between order statistics."""
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


def report_to_doc(report: SimReport) -> dict[str, Any]:
    """The JSON document of a report (``mixfleetctl serve simulate -o json``): every field
    but the per-request records; infinities (no tokens served) as null."""

    def pct(p: Percentiles) -> dict[str, float]:
        return {"p50": p.p50, "p90": p.p90, "p99": p.p99, "mean": p.mean}

    return {
        "requests": report.requests,
        "completed": report.completed,
        "met": report.met,
        "windowS": report.window_s,
        "durationS": report.duration_s,
        "offeredRequestsPerS": report.offered_rps,
        "ttftMs": pct(report.ttft_ms),
        "tpotMs": pct(report.tpot_ms),
        "attainment": report.attainment,
        "sloMet": report.slo_met,
        "goodputRequestsPerS": report.goodput_rps,
        "goodputOutputTokensPerS": report.goodput_tokens_per_s,
        "throughputRequestsPerS": report.throughput_rps,
        "throughputOutputTokensPerS": report.throughput_tokens_per_s,
        "usdPerHour": report.usd_per_hour,
        "usdPerMillionTokens": _finite_or_none(report.usd_per_million_tokens),
        "usdPerMillionGoodTokens": _finite_or_none(report.usd_per_million_good_tokens),
        "pools": [
            {
                "name": p.name,
                "requests": p.requests,
                "attainment": p.attainment,
                "ttftP90Ms": p.ttft_p90_ms,
                "tpotP90Ms": p.tpot_p90_ms,
                "usdPerHour": p.usd_per_hour,
                "kvLinkUtilisation": p.kv_link_utilisation,
                "groups": [
                    {
                        "role": g.role,
                        "instances": g.instances,
                        "utilisation": g.utilisation,
                        "meanRunning": g.mean_running,
                        "meanWaitMs": g.mean_wait_ms,
                        "maxQueue": g.max_queue,
                        "steps": g.steps,
                    }
                    for g in p.groups
                ],
            }
            for p in report.pools
        ],
    }
