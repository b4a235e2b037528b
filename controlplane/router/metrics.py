"""Prometheus metrics of the router (``GET /metrics``), one registry per router.

* ``mixfleet_router_share{tier,instance,rank,kind="planned"|"achieved"}``: the rank's
  planned share of its tier (from the weights) and its achieved share (tokens routed since
  the tier's weights last changed), read from the router's state at scrape time.
* ``mixfleet_router_queue_depth{tier,instance,rank}``: requests open on the rank.
* ``mixfleet_router_waiting_requests{tier}``: requests waiting for a batch slot (every
  instance that could take them at its batch limit), read at scrape time.
* ``mixfleet_router_requests_total{tier,instance,rank}``, ``..._routed_tokens_total``.
* ``mixfleet_router_ttfb_seconds{tier}``: time from the request's arrival to its first
  byte sent back (histogram).
* ``mixfleet_router_rejects_total{tier,reason}``: ``overloaded`` (429), ``no_rank`` (503),
  ``bad_request`` (400), ``upstream`` (502 after the last try), ``too_large`` (413),
  ``bodies_in_flight`` (429: the in-flight body bound), ``slow_client`` (408).
* ``mixfleet_router_retries_total``, ``..._stream_aborts_total`` (an engine failed after
  bytes were streamed: not retried), ``..._ejections_total{instance}``,
  ``..._instance_healthy{instance}``, ``..._routing_version{deployment}``,
  ``..._controller_connected{deployment}``.
* The measured traffic of each ``--deployment`` (:class:`.traffic.TrafficBook`, on the same
  registry): ``mixfleet_router_traffic_requests_total``, ``..._input_tokens_total``,
  ``..._output_tokens_total``, ``..._ttft_seconds``, ``..._tpot_seconds`` (histograms),
  ``..._traffic_reports_total{outcome}``, each by ``deployment``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from controlplane.router.balance import RankState, shares

_TTFB_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5)


class _ShareCollector(Collector):
    def __init__(
        self,
        tiers: Callable[[], Iterable[tuple[str, Sequence[RankState]]]],
        waiting: Callable[[], Mapping[str, int]],
    ) -> None:
        self._tiers = tiers
        self._waiting = waiting

    def collect(self) -> Iterable[GaugeMetricFamily]:
        share = GaugeMetricFamily(
            "mixfleet_router_share",
            "Planned and achieved share of each rank within its tier (0-1).",
            labels=["tier", "instance", "rank", "kind"],
        )
        depth = GaugeMetricFamily(
            "mixfleet_router_queue_depth",
            "Requests open on each rank.",
            labels=["tier", "instance", "rank"],
        )
        for tier, ranks in self._tiers():
            planned, achieved = shares(ranks)
            for r, p, a in zip(ranks, planned, achieved, strict=True):
                share.add_metric([tier, r.instance, str(r.rank), "planned"], p)
                share.add_metric([tier, r.instance, str(r.rank), "achieved"], a)
                depth.add_metric([tier, r.instance, str(r.rank)], r.open_requests)
        waiting = GaugeMetricFamily(
            "mixfleet_router_waiting_requests",
            "Requests waiting for a batch slot, per tier.",
            labels=["tier"],
        )
        for tier, n in self._waiting().items():
            waiting.add_metric([tier], n)
        yield share
        yield depth
        yield waiting


class RouterMetrics:
    """The router's metrics on their own registry.

    Args:
        tiers: (tier, ranks) pairs, read at scrape time.
        waiting: requests waiting for a batch slot per tier, read at scrape time.
    """

    def __init__(
        self,
        tiers: Callable[[], Iterable[tuple[str, Sequence[RankState]]]],
        waiting: Callable[[], Mapping[str, int]],
    ) -> None:
        r = self.registry = CollectorRegistry()
        r.register(_ShareCollector(tiers, waiting))
        ranked = ["tier", "instance", "rank"]
        self.requests = Counter(
            "mixfleet_router_requests", "Requests routed to a rank.", ranked, registry=r
        )
        self.routed_tokens = Counter(
            "mixfleet_router_routed_tokens",
            "Estimated tokens (prompt + expected output) routed to a rank.",
            ranked,
            registry=r,
        )
        self.ttfb = Histogram(
            "mixfleet_router_ttfb_seconds",
            "Arrival to first byte sent back, seconds.",
            ["tier"],
            buckets=_TTFB_BUCKETS_S,
            registry=r,
        )
        self.rejects = Counter(
            "mixfleet_router_rejects", "Requests refused.", ["tier", "reason"], registry=r
        )
        self.retries = Counter(
            "mixfleet_router_retries", "Requests tried again on another instance.", registry=r
        )
        self.stream_aborts = Counter(
            "mixfleet_router_stream_aborts",
            "Responses cut because the engine failed after bytes were sent (not retried).",
            registry=r,
        )
        self.ejections = Counter(
            "mixfleet_router_ejections", "Instances ejected.", ["instance"], registry=r
        )
        self.healthy = Gauge(
            "mixfleet_router_instance_healthy", "1 when admitted.", ["instance"], registry=r
        )
        self.version = Gauge(
            "mixfleet_router_routing_version",
            "Plan version of the weights in use.",
            ["deployment"],
            registry=r,
        )
        self.connected = Gauge(
            "mixfleet_router_controller_connected",
            "1 while the routing watch of the deployment is open.",
            ["deployment"],
            registry=r,
        )
        self._per_rank: dict[tuple[str, str, int], tuple[Counter, Counter]] = {}
        self._per_tier: dict[str, Histogram] = {}

    def rank_counters(self, tier: str, instance: str, rank: int) -> tuple[Counter, Counter]:
        """The (requests, routed tokens) counters of one rank, looked up once and kept (a
        ``labels()`` call per request takes a lock and builds label tuples)."""
        key = (tier, instance, rank)
        kids = self._per_rank.get(key)
        if kids is None:
            labels = (tier, instance, str(rank))
            kids = (self.requests.labels(*labels), self.routed_tokens.labels(*labels))
            self._per_rank[key] = kids
        return kids

    def tier_ttfb(self, tier: str) -> Histogram:
        """The time-to-first-byte histogram of one tier, looked up once and kept."""
        kid = self._per_tier.get(tier)
        if kid is None:
            kid = self._per_tier[tier] = self.ttfb.labels(tier)
        return kid
