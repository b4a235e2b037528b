"""The control-plane benchmark's own arithmetic (the benchmark itself runs minutes)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

# bench/ is a directory of scripts, not an installed package: import it from the checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.controlplane import bench_fleet, check_targets, main, percentiles, render_markdown


def test_percentiles_in_milliseconds() -> None:
    xs = [0.001 * k for k in range(1, 101)]  # 1..100 ms
    p = percentiles(xs)
    assert p["count"] == 100
    assert p["p50_ms"] == 51.0 or p["p50_ms"] == 50.0
    assert p["p99_ms"] == 99.0
    assert p["max_ms"] == 100.0
    assert percentiles([])["p99_ms"] is None


def test_targets_report_value_and_miss() -> None:
    run = {
        "heartbeat_steady": {"p99_ms": 12.0},
        "heartbeat_during_rollout": {"p99_ms": 250.0},
        "fanout": {"fanout_s": None},
        "node_loss_slice": {"loss_to_commit_s": 0.4},
        "node_loss_wide": {"loss_to_commit_s": 7.5},
    }
    t = check_targets(run)
    assert t["heartbeat_p99_ms_steady"] == {"value": 12.0, "target": 100.0, "met": True}
    assert t["heartbeat_p99_ms_during_rollout"]["met"] is False
    assert t["fanout_s"]["met"] is False  # never completed counts as a miss
    assert t["loss_to_commit_s_slice"]["met"] is True
    assert t["loss_to_commit_s_wide"]["met"] is False


def test_bench_fleet_pools() -> None:
    fleet = bench_fleet(20, 4)
    pools = [n.labels["pool"] for n in fleet.nodes]
    assert pools.count("slice") == 4 and pools.count("wide") == 16
    assert all(len(n.gpus) == 1 for n in fleet.nodes)


def test_markdown_has_one_row_per_run() -> None:
    doc = {
        "command": "python -m bench.controlplane --agents 100",
        "date": "2026-01-01T00:00:00+00:00",
        "machine": {"cpu_count": 2, "cpu_model": "x"},
        "targets_at_2000": {"heartbeat_p99_ms": 100.0, "fanout_s": 3.0, "loss_to_commit_s": 5.0},
        "runs": [
            {"agents": 100, "heartbeat_steady": {"p50_ms": 1.0, "p99_ms": 3.0}},
            {
                "agents": 500,
                "fanout": {
                    "fanout_s": 2.5,
                    "prepared_everywhere_s": 1.0,
                    "commit_point_to_last_commit_s": 1.5,
                },
            },
        ],
    }
    md = render_markdown(doc)
    rows = [x for x in md.splitlines() if x.startswith(("| 100 ", "| 500 "))]
    assert len(rows) == 2 and "1.0 / 3.0" in rows[0] and "2.5 (1.0 / 1.5)" in rows[1]


def test_render_rewrites_the_docs_from_a_results_file(tmp_path: Path) -> None:
    results = tmp_path / "r.json"
    results.write_text(
        json.dumps(
            {
                "command": "python -m bench.controlplane --agents 100",
                "date": "2026-01-01T00:00:00+00:00",
                "machine": {"cpu_count": 2, "cpu_model": "x"},
                "targets_at_2000": {
                    "heartbeat_p99_ms": 100.0,
                    "fanout_s": 3.0,
                    "loss_to_commit_s": 5.0,
                },
                "runs": [{"agents": 100, "heartbeat_steady": {"p50_ms": 1.0, "p99_ms": 3.0}}],
            }
        )
    )
    docs = tmp_path / "out.md"
    assert main(["--render", str(results), "--docs", str(docs)]) == 0
    assert "| 100 | 1.0 / 3.0" in docs.read_text()
    assert main(["--render", str(tmp_path / "missing.json"), "--docs", str(docs)]) == 2
