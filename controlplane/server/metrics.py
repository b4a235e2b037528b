"""Prometheus metrics of the controller.

Each :class:`Metrics` has its own registry (several controllers can run in one test
process); ``mixfleetctl controller run --metrics-port N`` serves it over HTTP.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_SOLVE_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    """The controller's metrics (names prefixed ``mixfleet_``)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.solve_seconds = Histogram(
            "mixfleet_solve_seconds",
            "Wall time of a placement solve.",
            ["deployment", "policy"],
            buckets=_SOLVE_BUCKETS_S,
            registry=r,
        )
        self.solve_failures = Counter(
            "mixfleet_solve_failures_total",
            "Solves that failed.",
            ["deployment", "kind"],
            registry=r,
        )
        self.predicted_step_us = Gauge(
            "mixfleet_predicted_step_time_microseconds",
            "Predicted step time of the committed plan.",
            ["deployment"],
            registry=r,
        )
        self.predicted_imbalance = Gauge(
            "mixfleet_predicted_imbalance",
            "Predicted (max - mean) / mean expert time of the committed plan.",
            ["deployment"],
            registry=r,
        )
        self.observed_imbalance = Gauge(
            "mixfleet_observed_imbalance",
            "Imbalance of the committed plan under the last measured load window.",
            ["deployment"],
            registry=r,
        )
        self.committed_version = Gauge(
            "mixfleet_committed_plan_version",
            "Committed plan version.",
            ["deployment"],
            registry=r,
        )
        self.healthy_nodes = Gauge(
            "mixfleet_healthy_nodes",
            "Registered nodes that are alive and not draining.",
            registry=r,
        )
        self.nodes = Gauge("mixfleet_nodes", "Registered nodes.", registry=r)
        self.rollout_seconds = Histogram(
            "mixfleet_rollout_seconds",
            "Time from PREPARE sent to commit or abort.",
            ["deployment", "outcome"],
            buckets=_SOLVE_BUCKETS_S,
            registry=r,
        )
        self.rollouts = Counter(
            "mixfleet_rollouts_total",
            "Rollouts by outcome.",
            ["deployment", "outcome"],
            registry=r,
        )
        self.rpc_seconds = Histogram(
            "mixfleet_rpc_seconds",
            "Server-side RPC latency.",
            ["method", "code"],
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )

        self.loop_stall_seconds = Counter(
            "mixfleet_loop_stall_seconds",
            "Time the controller's event loop could not run (not counted as node silence).",
            registry=r,
        )
        self.store_quarantined_rows = Gauge(
            "mixfleet_store_quarantined_rows",
            "Store rows that do not decode and are skipped (mixfleetctl store check).",
            registry=r,
        )

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        """Serve ``/metrics`` over HTTP on ``port`` (a daemon thread)."""
        start_http_server(port, addr=addr, registry=self.registry)
