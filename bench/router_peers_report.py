"""The figures of a ``bench.router --peers`` results document (:mod:`bench.router_peers`): per
router, medians over the rounds and the CPU ratio to sglang-router (:func:`summary`), and the
issue's targets (:func:`finish`), recomputed from the rounds alone so that a stored results
file can be scored again.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any


def summary(rounds: Sequence[dict[str, Any]], routers: Sequence[str]) -> dict[str, Any]:
    """Per router: medians over the rounds, and (against sglang-router) the ratio of CPU per
    request within each round. Added TTFT is compared as medians over rounds, not as a
    ratio per round: an added figure near 0 or below it (the direct pass was the one other
    work on the host slowed) makes a per-round ratio meaningless."""
    out: dict[str, Any] = {}
    for name in routers:
        cpu = [r[name]["router_cpu_ms_per_request"] for r in rounds]
        out[name] = {
            "router_cpu_ms_per_request_median": round(statistics.median(cpu), 4),
            "added_ttft_p50_ms_median": round(
                statistics.median(r[name]["added_ttft_ms"]["p50"] for r in rounds), 3
            ),
            "added_ttft_p99_ms_median": round(
                statistics.median(r[name]["added_ttft_ms"]["p99"] for r in rounds), 3
            ),
            "failed": sum(r[name]["failed"] for r in rounds),
            "completed": sum(r[name]["completed"] for r in rounds),
        }
        if "sglang" in routers and name != "sglang":
            out[name]["cpu_vs_sglang_per_round"] = [
                round(
                    r[name]["router_cpu_ms_per_request"] / r["sglang"]["router_cpu_ms_per_request"],
                    3,
                )
                for r in rounds
            ]
    return out


#: Added TTFT p99 (ms) below which the comparison with sglang-router's is "within noise":
#: the direct pass's own p99 moves by more than this between passes on the shared host.
TTFT_FLOOR_MS = 20.0


def _targets(doc: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets for mixfleet-router, one process (``mixfleet``) and two workers
    (``mixfleet-w2``, keys prefixed ``w2_``): CPU per streamed request <= 1.3x
    sglang-router's (median of the per-round ratios), added TTFT p99 <= 2x sglang-router's
    (medians over rounds; either side below :data:`TTFT_FLOOR_MS` counts as the floor),
    short requests >= 0.8x direct (median of the per-round ratios), no engine ejected (for
    ``mixfleet-w2``, whose ``/metrics`` is per worker: no request failed)."""
    out: dict[str, Any] = {}
    for path, prefix in (("mixfleet", ""), ("mixfleet-w2", "w2_")):
        for level in doc["streams"]:
            out.update(_level_targets(level, path, prefix))
        short = doc.get("short", {}).get("vs_direct_median", {}).get(path)
        if short is not None or path == "mixfleet":
            out[f"{prefix}short_vs_direct"] = {
                "target": 0.8,
                "value": short,
                "met": short is not None and short >= 0.8,
            }
    return out


def _level_targets(level: dict[str, Any], path: str, prefix: str) -> dict[str, Any]:
    """:func:`_targets` of one streams level for router ``path``."""
    summary = level["summary"]
    m, sg = summary.get(path), summary.get("sglang")
    n = level["streams"]
    if m is None or sg is None:
        return {}
    cpu = statistics.median(m["cpu_vs_sglang_per_round"])
    ours = max(m["added_ttft_p99_ms_median"], TTFT_FLOOR_MS)
    theirs = max(sg["added_ttft_p99_ms_median"], TTFT_FLOOR_MS)
    ejections = level["mixfleet_ejections"] if path == "mixfleet" else None
    return {
        f"{prefix}cpu_per_request_vs_sglang_at_{n}": {
            "target": 1.3,
            "value": round(cpu, 3),
            "met": cpu <= 1.3,
        },
        f"{prefix}added_ttft_p99_vs_sglang_at_{n}": {
            "target": 2.0,
            "mixfleet_ms": m["added_ttft_p99_ms_median"],
            "sglang_ms": sg["added_ttft_p99_ms_median"],
            "value": round(ours / theirs, 3),
            "met": ours <= 2 * theirs,
        },
        f"{prefix}no_engine_ejected_at_{n}": {
            "ejections": ejections,
            "failed_requests": m["failed"],
            "met": not ejections and m["failed"] == 0,
        },
    }


def finish(doc: dict[str, Any]) -> dict[str, Any]:
    """Summaries and targets (again) from the rounds of a results document."""
    for level in doc["streams"]:
        names = [n for n in level["rounds"][0]["order"] if n != "direct"]
        level["summary"] = summary(level["rounds"], names)
    doc["targets"] = _targets(doc)
    return doc
