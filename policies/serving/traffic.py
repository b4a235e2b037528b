"""What a deployment must serve: its traffic (arrivals, prompt and output lengths) and its
latency targets (SLOs), with their one document codec.

A length distribution is given either by its mean and 90th percentile or by a histogram.
From mean and p90 it is a **lognormal** fitted to both: with ``z = 1.2816`` (the standard
normal's 90th percentile), ``mean = exp(mu + sigma^2 / 2)`` and ``p90 = exp(mu + z sigma)``
give ``sigma = z - sqrt(z^2 - 2 ln(p90 / mean))`` (the root with ``sigma < z``) and
``mu = ln(mean) - sigma^2 / 2``. A lognormal's p90 is at most ``exp(z^2 / 2) = 2.27`` times
its mean, so a wider spread must be stated as a histogram; ``p90 == mean`` is a constant
length. Samples are rounded to whole tokens, at least 1.

Arrivals are ``poisson`` (exponential gaps) or ``bursty``: gamma-distributed gaps with the
same mean ``1 / requests_per_s`` and coefficient of variation ``burst_cv`` (> 1 clusters
requests into bursts; shape ``1 / cv^2``, scale ``cv^2 / requests_per_s``).

Document form (the deployment's ``spec.traffic`` and ``spec.slo``, and the traffic files of
``mixfleetctl serve simulate``)::

    traffic:
      requestsPerS: 20            # or outputTokensPerS: 10240 (one of the two)
      inputTokens: {mean: 4096, p90: 6000}        # or {histogram: [[1024, 0.5], [8192, 0.5]]}
      outputTokens: {mean: 512, p90: 800}
      arrival: poisson            # poisson | bursty
      burstCv: 2.0                # bursty only; > 1
    slo: {ttftMs: 2000, tpotMs: 50, percentile: 90}

Pure: no I/O.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

from policies.errors import InputError
from policies.keys import check_keys

ARRIVALS = ("poisson", "bursty")
"""Arrival processes :class:`Traffic` knows."""

MAX_LENGTH_TOKENS = 1 << 24
"""Longest prompt or output length accepted, tokens."""
MAX_REQUESTS_PER_S = 1e9
"""Highest arrival rate accepted, requests per second."""
MAX_HISTOGRAM_BINS = 4096
"""Most bins of a length histogram."""
MAX_BURST_CV = 100.0
"""Largest coefficient of variation of bursty arrival gaps."""
MAX_SLO_MS = 86_400_000.0
"""Longest latency target accepted, ms (one day)."""

_Z90 = NormalDist().inv_cdf(0.9)
_MAX_P90_OVER_MEAN = math.exp(_Z90 * _Z90 / 2.0)


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution (prompt or output).

    Attributes:
        mean: mean length, tokens.
        p90: 90th percentile, tokens (>= ``mean``; at most 2.27 x ``mean`` without a
            histogram, the widest a lognormal allows).
        histogram: ``(length tokens, weight)`` bins; when set it is the distribution and
            ``mean``/``p90`` are its own (build it with :meth:`of_histogram`).
    """

    mean: float
    p90: float
    histogram: tuple[tuple[int, float], ...] = ()

    @staticmethod
    def of_histogram(bins: Sequence[tuple[int, float]]) -> LengthDist:
        """The distribution of weighted lengths (bins sorted by length; weights need not sum
        to 1); ``mean`` and ``p90`` are computed from it.

        Raises:
            InputError: empty, a length < 1, a weight < 0, or all weights 0.
        """
        hist = tuple(sorted((int(n), float(w)) for n, w in bins))
        _check_histogram(hist, "histogram")
        total = sum(w for _, w in hist)
        mean = sum(n * w for n, w in hist) / total
        probe = LengthDist(mean=mean, p90=mean, histogram=hist)
        return LengthDist(mean=mean, p90=probe.quantile(0.9), histogram=hist)

    @staticmethod
    def constant(tokens: float) -> LengthDist:
        """Every request has ``tokens`` tokens."""
        return LengthDist(mean=float(tokens), p90=float(tokens))

    def lognormal(self) -> tuple[float, float]:
        """``(mu, sigma)`` of the lognormal fitted to ``mean`` and ``p90`` (sigma 0 when they
        are equal). Only meaningful without a histogram."""
        ratio = max(self.p90 / self.mean, 1.0)
        gap = _Z90 * _Z90 - 2.0 * math.log(ratio)
        sigma = _Z90 - math.sqrt(max(gap, 0.0))
        return math.log(self.mean) - sigma * sigma / 2.0, sigma

    def sample(self, rng: random.Random) -> int:
        """One length, tokens (>= 1); deterministic given the state of ``rng``."""
        if self.histogram:
            cum = _cumulative(self.histogram)
            i = bisect.bisect_right(cum, rng.random() * cum[-1])
            return self.histogram[min(i, len(self.histogram) - 1)][0]
        mu, sigma = self.lognormal()
        if sigma == 0.0:
            return max(1, round(self.mean))
        return max(1, round(rng.lognormvariate(mu, sigma)))

    def sampler(self, rng: random.Random) -> _Sampler:
        """A fast repeated :meth:`sample` (the fit and cumulative weights computed once)."""
        return _Sampler(self, rng)

    def quantile(self, q: float) -> float:
        """The ``q`` quantile (``q`` a fraction in [0, 1]), tokens. A histogram's is the
        smallest length whose cumulative weight reaches ``q``.

        Raises:
            InputError: ``q`` outside [0, 1].
        """
        if isinstance(q, bool) or not isinstance(q, int | float) or not 0.0 <= q <= 1.0:
            raise InputError(f"quantile must be a fraction in [0, 1], got {q!r}", field="q")
        if self.histogram:
            cum = _cumulative(self.histogram)
            i = bisect.bisect_left(cum, q * cum[-1] * (1.0 - 1e-12))
            return float(self.histogram[min(i, len(self.histogram) - 1)][0])
        mu, sigma = self.lognormal()
        if sigma == 0.0 or q in (0.0, 1.0):
            return self.mean if sigma == 0.0 else (0.0 if q == 0.0 else math.inf)
        return math.exp(mu + sigma * NormalDist().inv_cdf(q))


class _Sampler:
    """Samples of one :class:`LengthDist` with its constants computed once."""

    __slots__ = ("_const", "_cum", "_lengths", "_mu", "_rng", "_sigma", "_total")

    def __init__(self, dist: LengthDist, rng: random.Random) -> None:
        self._rng = rng
        self._lengths = tuple(n for n, _ in dist.histogram)
        self._cum = _cumulative(dist.histogram) if dist.histogram else []
        self._total = self._cum[-1] if self._cum else 0.0
        self._mu, self._sigma = dist.lognormal() if not dist.histogram else (0.0, 0.0)
        self._const = max(1, round(dist.mean))

    def __call__(self) -> int:
        if self._cum:
            i = bisect.bisect_right(self._cum, self._rng.random() * self._total)
            return self._lengths[min(i, len(self._lengths) - 1)]
        if self._sigma == 0.0:
            return self._const
        return max(1, round(self._rng.lognormvariate(self._mu, self._sigma)))


def _cumulative(hist: Sequence[tuple[int, float]]) -> list[float]:
    out, acc = [], 0.0
    for _, w in hist:
        acc += w
        out.append(acc)
    return out


@dataclass(frozen=True)
class Traffic:
    """The demand on a deployment (or on a pool of it).

    Attributes:
        requests_per_s: mean arrival rate, requests per second.
        input_len: prompt length distribution, tokens.
        output_len: output length distribution, tokens.
        arrival: ``poisson`` or ``bursty``.
        burst_cv: coefficient of variation of the gaps between arrivals (``bursty``: > 1,
            gamma-distributed gaps; ``poisson``: 1).
        stated_output_tokens_per_s: the demand as the user stated it in output tokens per
            second (``outputTokensPerS``), or 0 when it was stated in requests per second;
            then ``requests_per_s == stated_output_tokens_per_s / output_len.mean``
            (build it with :meth:`of_output_tokens`).
    """

    requests_per_s: float
    input_len: LengthDist
    output_len: LengthDist
    arrival: str = "poisson"
    burst_cv: float = 1.0
    stated_output_tokens_per_s: float = 0.0

    @staticmethod
    def of_output_tokens(
        output_tokens_per_s: float,
        input_len: LengthDist,
        output_len: LengthDist,
        *,
        arrival: str = "poisson",
        burst_cv: float = 1.0,
    ) -> Traffic:
        """Traffic stated as output tokens per second (requests per second = that / the mean
        output length)."""
        return Traffic(
            requests_per_s=output_tokens_per_s / output_len.mean,
            input_len=input_len,
            output_len=output_len,
            arrival=arrival,
            burst_cv=burst_cv,
            stated_output_tokens_per_s=output_tokens_per_s,
        )

    def output_tokens_per_s(self) -> float:
        """Output tokens per second the demand asks for (requests/s x mean output length)."""
        return self.requests_per_s * self.output_len.mean

    def input_tokens_per_s(self) -> float:
        """Prompt tokens per second the demand brings (requests/s x mean input length)."""
        return self.requests_per_s * self.input_len.mean

    def scaled(self, share: float) -> Traffic:
        """The part of this traffic a router sends to one pool: ``share`` (0..1] of the rate,
        the same lengths and burstiness."""
        return Traffic(
            requests_per_s=self.requests_per_s * share,
            input_len=self.input_len,
            output_len=self.output_len,
            arrival=self.arrival,
            burst_cv=self.burst_cv,
        )

    @property
    def gap_cv2(self) -> float:
        """Squared coefficient of variation of the gaps between arrivals: 1 for Poisson
        arrivals, ``burst_cv`` squared for bursty ones."""
        return self.burst_cv * self.burst_cv if self.arrival == "bursty" else 1.0

    def gap_s(self, rng: random.Random) -> float:
        """One gap between two arrivals, s (mean ``1 / requests_per_s``; gamma-distributed
        with :attr:`gap_cv2` when that is not 1, else exponential)."""
        cv2 = self.gap_cv2
        if cv2 != 1.0:
            return rng.gammavariate(1.0 / cv2, cv2 / self.requests_per_s)
        return rng.expovariate(self.requests_per_s)


@dataclass(frozen=True)
class Slo:
    """Latency targets, met by a request when both hold; a deployment meets them when at
    least ``percentile`` percent of its requests do (the planner sizes for the percentile).

    Attributes:
        ttft_ms: time to first token, ms (arrival at the router -> first output token);
            0 = no target.
        tpot_ms: time per output token after the first, ms (mean over one request's
            output, the inter-token latency); 0 = no target.
        percentile: percentile of requests the targets hold for, in (0, 100).
    """

    ttft_ms: float
    tpot_ms: float
    percentile: float = 90.0

    def met(self, ttft_ms: float, tpot_ms: float) -> bool:
        """Whether one request with these latencies (ms) meets both targets."""
        return (self.ttft_ms <= 0.0 or ttft_ms <= self.ttft_ms) and (
            self.tpot_ms <= 0.0 or tpot_ms <= self.tpot_ms
        )


def request_lifetime_s(traffic: Traffic, slo: Slo) -> float | None:
    """How long a request within ``slo`` lives at most, s: the TTFT target, then the output
    length at the SLO's percentile at one TPOT target per token. A simulation whose warm-up
    is shorter measures instances still filling; None when the SLO lacks a target."""
    if slo.ttft_ms <= 0.0 or slo.tpot_ms <= 0.0:
        return None
    out = traffic.output_len.quantile(slo.percentile / 100.0)
    return (slo.ttft_ms + out * slo.tpot_ms) / 1e3


# ---------------------------------------------------------------------- validation


def _finite(v: Any, path: str, *, low: float, high: float, low_open: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise InputError(f"must be a finite number, got {v!r}", field=path)
    if v < low or (low_open and v == low) or v > high:
        lo = f"{'>' if low_open else '>='} {low:g}"
        raise InputError(f"must be {lo} and at most {high:g}, got {v!r}", field=path)
    return float(v)


def _check_histogram(hist: Sequence[Any], path: str) -> None:
    if not hist:
        raise InputError("must have at least one [length, weight] bin", field=path)
    if len(hist) > MAX_HISTOGRAM_BINS:
        raise InputError(f"at most {MAX_HISTOGRAM_BINS} bins, got {len(hist)}", field=path)
    seen: set[int] = set()
    for i, (n, w) in enumerate(hist):
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_LENGTH_TOKENS:
            raise InputError(
                f"length must be a whole number of tokens in [1, {MAX_LENGTH_TOKENS}], got {n!r}",
                field=f"{path}[{i}][0]",
            )
        if n in seen:
            raise InputError(f"length {n} appears twice", field=f"{path}[{i}][0]")
        seen.add(n)
        _finite(w, f"{path}[{i}][1]", low=0.0, high=1e300)
    if sum(w for _, w in hist) <= 0:
        raise InputError("the weights sum to 0. To fix: give at least one weight > 0", field=path)


def check_length_dist(dist: LengthDist, path: str) -> None:
    """Validate a length distribution.

    Raises:
        InputError: naming the field (``spec.traffic.inputTokens.p90`` ...).
    """
    if not isinstance(dist, LengthDist):
        raise InputError(f"must be a length distribution, got {dist!r}", field=path)
    mean = _finite(dist.mean, f"{path}.mean", low=1.0, high=MAX_LENGTH_TOKENS)
    p90 = _finite(dist.p90, f"{path}.p90", low=1.0, high=MAX_LENGTH_TOKENS)
    if dist.histogram:
        _check_histogram(dist.histogram, f"{path}.histogram")
        if list(dist.histogram) != sorted(dist.histogram):
            raise InputError("bins must be sorted by length", field=f"{path}.histogram")
        own = LengthDist.of_histogram(dist.histogram)
        if not math.isclose(own.mean, mean, rel_tol=1e-9) or own.p90 != p90:
            raise InputError(
                f"mean {mean:g} / p90 {p90:g} differ from the histogram's "
                f"({own.mean:g} / {own.p90:g}). To fix: give the histogram alone",
                field=f"{path}.histogram",
            )
        return
    if p90 < mean:
        raise InputError(
            f"p90 {p90:g} is below the mean {mean:g}. To fix: give p90 >= mean",
            field=f"{path}.p90",
        )
    if p90 > mean * _MAX_P90_OVER_MEAN * (1 + 1e-12):
        raise InputError(
            f"p90 {p90:g} is {p90 / mean:.2f}x the mean {mean:g}; a lognormal allows at most "
            f"{_MAX_P90_OVER_MEAN:.2f}x. To fix: give the lengths as a histogram",
            field=f"{path}.p90",
        )


def check_traffic(traffic: Traffic, path: str) -> None:
    """Validate traffic.

    Raises:
        InputError: naming the field (``spec.traffic.requestsPerS`` ...).
    """
    if not isinstance(traffic, Traffic):
        raise InputError(f"must be a traffic description, got {traffic!r}", field=path)
    check_length_dist(traffic.input_len, f"{path}.inputTokens")
    check_length_dist(traffic.output_len, f"{path}.outputTokens")
    stated = _finite(
        traffic.stated_output_tokens_per_s,
        f"{path}.outputTokensPerS",
        low=0.0,
        high=MAX_REQUESTS_PER_S * MAX_LENGTH_TOKENS,
    )
    key = "outputTokensPerS" if stated else "requestsPerS"
    rate = _finite(
        traffic.requests_per_s, f"{path}.{key}", low=0.0, high=MAX_REQUESTS_PER_S, low_open=True
    )
    if stated and not math.isclose(rate, stated / traffic.output_len.mean, rel_tol=1e-9):
        raise InputError(
            f"requestsPerS {rate:g} disagrees with outputTokensPerS {stated:g} over the mean "
            f"output {traffic.output_len.mean:g}. To fix: give one of the two",
            field=f"{path}.requestsPerS",
        )
    if traffic.arrival not in ARRIVALS:
        raise InputError(
            f"must be one of {', '.join(ARRIVALS)}, got {traffic.arrival!r}",
            field=f"{path}.arrival",
        )
    cv = _finite(traffic.burst_cv, f"{path}.burstCv", low=0.0, high=MAX_BURST_CV, low_open=True)
    if traffic.arrival == "poisson" and cv != 1.0:
        raise InputError(
            f"burstCv {cv:g} is for bursty arrivals (poisson gaps have 1). To fix: set "
            "arrival: bursty or drop burstCv",
            field=f"{path}.burstCv",
        )
    if traffic.arrival == "bursty" and cv <= 1.0:
        raise InputError(
            f"bursty arrivals need burstCv > 1, got {cv:g}. To fix: e.g. burstCv: 2, or "
            "arrival: poisson",
            field=f"{path}.burstCv",
        )


def check_slo(slo: Slo, path: str) -> None:
    """Validate latency targets.

    Raises:
        InputError: naming the field (``spec.slo.percentile`` ...).
    """
    if not isinstance(slo, Slo):
        raise InputError(f"must be latency targets, got {slo!r}", field=path)
    ttft = _finite(slo.ttft_ms, f"{path}.ttftMs", low=0.0, high=MAX_SLO_MS)
    tpot = _finite(slo.tpot_ms, f"{path}.tpotMs", low=0.0, high=MAX_SLO_MS)
    if not ttft and not tpot:
        raise InputError(
            "gives no target. To fix: set ttftMs and/or tpotMs (ms)", field=f"{path}.ttftMs"
        )
    p = _finite(slo.percentile, f"{path}.percentile", low=0.0, high=100.0, low_open=True)
    if p >= 100.0:
        raise InputError(
            f"must be in (0, 100), got {p:g}. To fix: e.g. 90 or 99", field=f"{path}.percentile"
        )


# ---------------------------------------------------------------------- documents

_LENGTH_KEYS = ("mean", "p90", "histogram")
TRAFFIC_KEYS = (
    "requestsPerS",
    "outputTokensPerS",
    "inputTokens",
    "outputTokens",
    "arrival",
    "burstCv",
)
"""Keys of a traffic document."""
SLO_KEYS = ("ttftMs", "tpotMs", "percentile")
"""Keys of an SLO document."""


def _need_mapping(doc: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(doc, Mapping):
        raise InputError(f"must be a mapping, got {doc!r}", field=path)
    return doc


def length_from_doc(doc: Any, path: str) -> LengthDist:
    """A length distribution of ``{mean, p90}`` (p90 defaults to the mean: a constant
    length) or ``{histogram: [[length, weight], ...]}``.

    Raises:
        InputError: naming the field.
    """
    doc = _need_mapping(doc, path)
    check_keys(doc, _LENGTH_KEYS, path)
    if "histogram" in doc:
        if "mean" in doc or "p90" in doc:
            raise InputError(
                "gives both a histogram and mean/p90. To fix: keep one of the two",
                field=f"{path}.histogram",
            )
        raw = doc["histogram"]
        if not isinstance(raw, list) or not all(
            isinstance(b, list | tuple) and len(b) == 2 for b in raw
        ):
            raise InputError(
                "must be a list of [length tokens, weight] pairs", field=f"{path}.histogram"
            )
        bins = [(_whole_length(b[0]), b[1]) for b in raw]  # JSON may carry 1024.0
        _check_histogram(bins, f"{path}.histogram")
        dist = LengthDist.of_histogram(bins)
    else:
        if "mean" not in doc:
            raise InputError("missing. To fix: give mean (and p90) or a histogram", field=path)
        mean = _finite(doc["mean"], f"{path}.mean", low=1.0, high=MAX_LENGTH_TOKENS)
        p90 = _finite(doc.get("p90", mean), f"{path}.p90", low=1.0, high=MAX_LENGTH_TOKENS)
        dist = LengthDist(mean=mean, p90=p90)
    check_length_dist(dist, path)
    return dist


def _whole_length(v: Any) -> Any:
    """An integral float length as an int (anything else unchanged, for the check)."""
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


def length_to_doc(dist: LengthDist) -> dict[str, Any]:
    """The document of a length distribution (inverse of :func:`length_from_doc`)."""
    if dist.histogram:
        return {"histogram": [[n, w] for n, w in dist.histogram]}
    return {"mean": _plain(dist.mean), "p90": _plain(dist.p90)}


def traffic_from_doc(doc: Any, path: str) -> Traffic:
    """Traffic of its document (the module docstring shows the form).

    Raises:
        InputError: naming the field; both ``requestsPerS`` and ``outputTokensPerS`` given,
            or neither, is refused.
    """
    doc = _need_mapping(doc, path)
    check_keys(doc, TRAFFIC_KEYS, path)
    for key in ("inputTokens", "outputTokens"):
        if key not in doc:
            raise InputError(
                "missing. To fix: give {mean: TOKENS, p90: TOKENS}", field=f"{path}.{key}"
            )
    inp = length_from_doc(doc["inputTokens"], f"{path}.inputTokens")
    out = length_from_doc(doc["outputTokens"], f"{path}.outputTokens")
    arrival = doc.get("arrival", "poisson")
    if arrival not in ARRIVALS:
        raise InputError(
            f"must be one of {', '.join(ARRIVALS)}, got {arrival!r}", field=f"{path}.arrival"
        )
    cv = doc.get("burstCv", 2.0 if arrival == "bursty" else 1.0)
    rps, ots = doc.get("requestsPerS"), doc.get("outputTokensPerS")
    if rps is not None and ots is not None:
        raise InputError(
            "gives both requestsPerS and outputTokensPerS. To fix: keep one of the two",
            field=f"{path}.outputTokensPerS",
        )
    if rps is None and ots is None:
        raise InputError(
            "missing. To fix: give requestsPerS or outputTokensPerS", field=f"{path}.requestsPerS"
        )
    if ots is not None:
        ots = _finite(
            ots,
            f"{path}.outputTokensPerS",
            low=0.0,
            high=MAX_REQUESTS_PER_S * MAX_LENGTH_TOKENS,
            low_open=True,
        )
        traffic = Traffic.of_output_tokens(ots, inp, out, arrival=arrival, burst_cv=cv)
    else:
        rps = _finite(rps, f"{path}.requestsPerS", low=0.0, high=MAX_REQUESTS_PER_S, low_open=True)
        traffic = Traffic(rps, inp, out, arrival=arrival, burst_cv=cv)
    check_traffic(traffic, path)
    return traffic


def traffic_to_doc(traffic: Traffic) -> dict[str, Any]:
    """The document of traffic (inverse of :func:`traffic_from_doc`)."""
    doc: dict[str, Any] = {}
    if traffic.stated_output_tokens_per_s:
        doc["outputTokensPerS"] = _plain(traffic.stated_output_tokens_per_s)
    else:
        doc["requestsPerS"] = _plain(traffic.requests_per_s)
    doc["inputTokens"] = length_to_doc(traffic.input_len)
    doc["outputTokens"] = length_to_doc(traffic.output_len)
    doc["arrival"] = traffic.arrival
    if traffic.arrival == "bursty":
        doc["burstCv"] = _plain(traffic.burst_cv)
    return doc


def replanned_traffic(
    spec_traffic: Traffic | None,
    planned: Traffic | None,
    measured_against: Mapping[str, Any] | None,
) -> Traffic | None:
    """The traffic a controller chose after a drift (``planned``) when it still applies -
    None when it does not: a deployment is planned for it only while the spec's traffic
    (``spec_traffic``) is the one it was measured against (``measured_against``, the
    document :func:`traffic_to_doc` made of the spec's traffic then); a spec whose traffic
    changed since, or that states none, is planned for its own. The one rule of the
    standalone controller and the Kubernetes operator."""
    if planned is None or spec_traffic is None or measured_against is None:
        return None
    if dict(measured_against) != traffic_to_doc(spec_traffic):
        return None
    return planned


def slo_from_doc(doc: Any, path: str) -> Slo:
    """Latency targets of ``{ttftMs, tpotMs, percentile}`` (an absent target is none;
    percentile defaults to 90).

    Raises:
        InputError: naming the field.
    """
    doc = _need_mapping(doc, path)
    check_keys(doc, SLO_KEYS, path)
    slo = Slo(
        ttft_ms=doc.get("ttftMs", 0.0),
        tpot_ms=doc.get("tpotMs", 0.0),
        percentile=doc.get("percentile", 90.0),
    )
    check_slo(slo, path)
    return Slo(float(slo.ttft_ms), float(slo.tpot_ms), float(slo.percentile))


def slo_to_doc(slo: Slo) -> dict[str, Any]:
    """The document of latency targets (inverse of :func:`slo_from_doc`)."""
    doc: dict[str, Any] = {}
    if slo.ttft_ms:
        doc["ttftMs"] = _plain(slo.ttft_ms)
    if slo.tpot_ms:
        doc["tpotMs"] = _plain(slo.tpot_ms)
    doc["percentile"] = _plain(slo.percentile)
    return doc


def _plain(x: float) -> float | int:
    """``x`` as an int when it is whole (documents read ``20`` rather than ``20.0``)."""
    return int(x) if float(x).is_integer() and abs(x) < 2**53 else float(x)
