"""``python -m bench.goodput``: its command line, the generated 1,000-GPU fleet, the
Markdown report of the committed results, and the yardstick (a steady-state simulation,
bracketed independently of the guess)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

# bench/ is a directory of scripts, not an installed package: import it from the checkout.
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench import goodput, goodput_headroom, goodput_setup  # noqa: E402
from policies.serving.curves import StepCurve  # noqa: E402
from policies.serving.plan import InstanceGroup, Pool, ServingPlan  # noqa: E402
from policies.serving.traffic import Traffic  # noqa: E402


def test_unknown_scenario_is_one_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert goodput.main(["--scenario", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "unknown scenario" in err and err.count("\n") == 1


def test_generated_fleet_and_deployments() -> None:
    f = goodput.generated_fleet()
    assert len(f.gpus) == 1000 and len(f.nodes) == 125
    assert len({g.spec.model for g in f.gpus}) == 5
    deps = goodput.twenty_deployments()
    assert len(deps) == 20 and len({d.name for d in deps}) == 20
    assert len({d.spec.model for d in deps}) == 6
    assert all(d.spec.traffic is not None and d.spec.slo is not None for d in deps)


def test_report_of_the_committed_results(capsys: pytest.CaptureFixture[str]) -> None:
    path = ROOT / "bench" / "results" / "goodput.json"
    doc = json.loads(path.read_text())
    assert set(doc["scenarios"]) == set(goodput.SCENARIOS)
    assert goodput.main(["--report", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.count("| dsv3-mixed-24-4096-512 |") == 3  # the three tables
    assert "generated-1000-twenty" in out


def _small_plan() -> tuple[ServingPlan, Traffic]:
    """One aggregated instance of 64 sequences (step 10 ms + 0.5 ms per sequence), and
    traffic of 200-token prompts and 20-token outputs: about 60 requests/s at its limit."""
    batches = (1, 64, 256)
    curve = StepCurve(
        batch_grid=batches,
        context_grid=(128, 1024),
        decode_step_us=tuple((10_000.0 + 500 * b, 10_000.0 + 500 * b) for b in batches),
        prefill_grid=(1, 8192),
        prefill_us=(10_000.0, 30_000.0),
        max_batch=256,
        kv_bytes_per_token=1000.0,
        kv_capacity_tokens=10**7,
    )
    plan = ServingPlan((Pool("p", 1.0, instances=InstanceGroup(1, curve, batch_limit=64)),))
    return plan, goodput_setup.traffic(200, 20, 1.0)


def test_yardstick_runs_long_enough_for_a_steady_state() -> None:
    tr = goodput_setup.traffic(1024, 1024, 1.0)
    life = goodput_setup.request_lifetime_s(tr)
    # TTFT 2 s and 1,280 output tokens (p90) at 50 ms each.
    assert life == pytest.approx(2.0 + 1280 * 0.05)
    opts = goodput_setup.sim_options(tr, 200.0)
    assert opts.warmup_requests >= 200 * goodput_setup.WINDOW_LIFETIMES * life
    assert opts.requests - opts.warmup_requests >= 200 * goodput_setup.WINDOW_LIFETIMES * life
    low = goodput_setup.sim_options(tr, 0.1)
    assert (low.requests, low.warmup_requests) == (4000, 400)


def test_yardstick_does_not_depend_on_the_guess() -> None:
    plan, tr = _small_plan()
    got = [goodput_setup.max_goodput(plan, tr, g) for g in (20.0, 45.0, 61.0, 150.0)]
    assert len({g["rate_rps"] for g in got}) == 1
    rate = got[0]["rate_rps"]
    assert 30.0 < rate < 80.0  # near the instance's rate at its batch limit
    assert goodput_setup.attained(plan, tr, rate)[0]
    assert not goodput_setup.attained(plan, tr, rate * 1.2)[0]


def test_yardstick_goodput_is_the_peak_at_or_below_the_edge() -> None:
    plan, tr = _small_plan()
    got = goodput_setup.max_goodput(plan, tr, 45.0)
    edge, peak = got["rate_rps"], got["peak_rate_rps"]
    assert edge * (1 - goodput_setup.PEAK_STEPS * goodput_setup.PEAK_STEP) - 1e-3 <= peak <= edge
    assert got["goodput_rps"] >= got["edge_goodput_rps"] > 0
    # Each figure is the simulator's at its rate, and no rate of the sweep serves more.
    ok, good, _ = goodput_setup.attained(plan, tr, peak)
    assert ok and good == pytest.approx(got["goodput_rps"], abs=1e-4)
    assert goodput_setup.attained(plan, tr, edge)[1] == pytest.approx(
        got["edge_goodput_rps"], abs=1e-4
    )
    for i in range(1, goodput_setup.PEAK_STEPS + 1):
        ok, good, _ = goodput_setup.attained(plan, tr, edge * (1 - goodput_setup.PEAK_STEP * i))
        assert not ok or good <= got["goodput_rps"] + 1e-4


def test_yardstick_scores_zero_without_a_plan() -> None:
    _, tr = _small_plan()
    got = goodput_setup.max_goodput(None, tr, 10.0)
    assert set(got.values()) == {0.0}


def test_headroom_unknown_scenario_is_one_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert goodput_headroom.main(["--scenario", "dsv3-nowhere-1024-1024"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "unknown scenario" in err and err.count("\n") == 1


@pytest.mark.parametrize("cv", ["0.5", "101", "nan"])
def test_headroom_burst_cv_out_of_range_is_one_error_line(
    capsys: pytest.CaptureFixture[str], cv: str
) -> None:
    assert goodput_headroom.main(["--scenario", "dsv3-homog-32-1024-1024", "--burst-cv", cv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --burst-cv") and err.count("\n") == 1
