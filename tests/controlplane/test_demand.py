"""The drift tracker (controlplane.server.controller.demand) on an explicit clock: windows
summed over reporters, a sustained shift changes the planning traffic once, a short blip or a
gap does not, the minimum interval holds, a changed spec plans for its own traffic again, and
every malformed report is refused naming its field."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from controlplane.server.controller.demand import (
    DEMAND_KEY,
    DemandStatus,
    DriftTracker,
    traffic_for,
)
from controlplane.server.controller.measured import (
    DemandSettings,
    MeasuredDemand,
    TrafficWindow,
    check_window,
    measure,
    measured_traffic,
)
from policies.errors import InputError
from policies.serving.traffic import LengthDist, Slo, Traffic
from policies.spec.build import DeploymentSpec

PLANNED = Traffic(10.0, LengthDist(1000, 1500), LengthDist(200, 300))
SPEC = DeploymentSpec("d", model="m", traffic=PLANNED, slo=Slo(ttft_ms=1000, tpot_ms=50))
SETTINGS = DemandSettings(sustain_s=60.0, min_interval_s=300.0, bucket_s=10.0)
T0 = 1_800_000_000.0  # a multiple of 10 s


def window(
    start_s: float, rps: float, *, span_s: float = 10.0, reporter: str = "r0", **figures: float
) -> TrafficWindow:
    """A window of ``rps`` requests/s with lengths 2000/3000 in, 400/600 out unless given."""
    base: dict[str, Any] = {
        "input_tokens_mean": 2000.0,
        "input_tokens_p90": 3000.0,
        "output_tokens_mean": 400.0,
        "output_tokens_p90": 600.0,
        "ttft_ms_p50": 300.0,
        "ttft_ms_p99": 900.0,
        "tpot_ms_p50": 20.0,
        "tpot_ms_p99": 45.0,
    }
    base.update(figures)
    return TrafficWindow("d", reporter, start_s, start_s + span_s, round(rps * span_s), **base)


class Run:
    """A tracker fed windows in time order, the status carried along as the controller does."""

    def __init__(self, settings: DemandSettings = SETTINGS, spec: DeploymentSpec = SPEC) -> None:
        self.tracker = DriftTracker(settings)
        self.status = DemandStatus()
        self.spec = spec
        self.replans: list[float] = []

    def feed(self, start_s: float, seconds: float, rps: float, reporters: int = 1) -> None:
        """Windows of 10 s from ``start_s`` for ``seconds``, the rate split over reporters."""
        t = start_s
        while t < start_s + seconds - 1e-9:
            for k in range(reporters):
                self.add(window(t, rps / reporters, reporter=f"r{k}"))
            t += 10.0

    def add(self, w: TrafficWindow) -> None:
        now = w.end_s + 1.0  # the report arrives a second after its window
        assert self.tracker.add(w, now)
        self.status, drift = self.tracker.decide("d", self.status, self.spec, now)
        if drift is not None:
            self.replans.append(now)

    @property
    def planned_rps(self) -> float:
        t = self.status.planning_traffic(self.spec)
        assert t is not None
        return t.requests_per_s


def test_reporters_add_up_and_figures_are_request_weighted() -> None:
    a = window(T0, 6.0, reporter="a", input_tokens_mean=1000.0)
    b = window(T0, 2.0, reporter="b", input_tokens_mean=3000.0)
    m = measure([a, b], T0, T0 + 10.0)
    assert m.requests_per_s == pytest.approx(8.0) and m.reporters == 2
    assert m.input_tokens_mean == pytest.approx((6 * 1000 + 2 * 3000) / 8)
    # a router reporting every 30 s and one every 10 s over the same 30 s add up
    slow = window(T0, 3.0, span_s=30.0, reporter="slow")
    fast = [window(T0 + k * 10.0, 5.0, reporter="fast") for k in range(3)]
    assert measure([slow, *fast], T0, T0 + 30.0).requests_per_s == pytest.approx(8.0)
    # half a window inside the span counts with half its requests and half its seconds
    assert measure([window(T0 - 5.0, 4.0)], T0, T0 + 10.0).requests_per_s == pytest.approx(4.0)


def test_a_sustained_shift_changes_the_planning_traffic_once() -> None:
    run = Run()
    run.feed(T0, 120.0, 10.0, reporters=3)  # on plan
    assert run.replans == [] and run.planned_rps == 10.0
    run.feed(T0 + 120.0, 50.0, 20.0, reporters=3)  # doubled, 50 s: not yet sustained
    assert run.replans == []
    run.feed(T0 + 170.0, 10.0, 20.0, reporters=3)  # 60 s above the band
    assert len(run.replans) == 1
    assert run.planned_rps == pytest.approx(20.0, rel=0.01)  # 3 routers, whole requests
    planned = run.status.planning_traffic(SPEC)
    assert planned is not None
    assert planned.input_len.mean == pytest.approx(2000.0) and planned.output_len.p90 == 600.0
    assert "above the planned 10 requests/s" in run.status.last_replan_reason
    run.feed(T0 + 180.0, 600.0, 20.0, reporters=3)  # stays there: nothing more to do
    assert len(run.replans) == 1 and run.status.replans == 1


def test_a_blip_shorter_than_sustain_or_a_gap_does_not_replan() -> None:
    run = Run()
    run.feed(T0, 60.0, 10.0)
    run.feed(T0 + 60.0, 50.0, 40.0)  # 50 s at four times the plan
    run.feed(T0 + 110.0, 10.0, 10.0)
    run.feed(T0 + 120.0, 50.0, 40.0)
    assert run.replans == []
    # 60 s above the band but with a 10 s hole in the data: no data is not a rate
    run = Run()
    run.feed(T0, 30.0, 40.0)
    run.feed(T0 + 40.0, 30.0, 40.0)
    assert run.replans == []
    run.feed(T0 + 70.0, 30.0, 40.0)  # now 60 s without a hole
    assert len(run.replans) == 1


def test_inside_the_band_never_replans_and_a_drop_does() -> None:
    run = Run()
    run.feed(T0, 600.0, 12.4)  # within +25 %
    run.feed(T0 + 600.0, 600.0, 8.1)  # within 10 / 1.25 = 8
    assert run.replans == []
    run.feed(T0 + 1200.0, 60.0, 4.0)
    assert len(run.replans) == 1 and run.planned_rps == pytest.approx(4.0)
    assert "below" in run.status.last_replan_reason


def test_the_min_interval_holds_between_replans() -> None:
    run = Run()
    run.feed(T0, 60.0, 20.0)
    assert len(run.replans) == 1  # 10 -> 20
    first = run.replans[0]
    run.feed(T0 + 60.0, 120.0, 60.0)  # tripled again, sustained, but within 300 s
    assert len(run.replans) == 1 and run.planned_rps == pytest.approx(20.0)
    run.feed(T0 + 180.0, 200.0, 60.0)
    assert len(run.replans) == 2
    assert run.replans[1] - first >= SETTINGS.min_interval_s
    assert run.planned_rps == pytest.approx(60.0)


def test_a_spec_with_new_traffic_plans_for_its_own_again() -> None:
    run = Run()
    run.feed(T0, 60.0, 20.0)
    assert run.planned_rps == pytest.approx(20.0, rel=0.01)  # 3 routers, whole requests
    run.spec = replace(SPEC, traffic=replace(PLANNED, requests_per_s=30.0))
    assert run.planned_rps == 30.0
    run.feed(T0 + 60.0, 10.0, 30.0)
    assert run.status.planned is None and run.planned_rps == 30.0


def test_a_deployment_without_traffic_and_slo_is_only_measured() -> None:
    run = Run(spec=DeploymentSpec("d", model="m"))
    run.feed(T0, 120.0, 50.0)
    assert run.replans == [] and run.status.planned is None
    assert run.status.measured is not None
    assert run.status.measured.requests_per_s == pytest.approx(50.0)


def test_slo_counts_add_up_over_reporters_and_windows_into_the_attainment() -> None:
    a = window(T0, 6.0, reporter="a", slo_judged=40, slo_met=36)
    b = window(T0, 2.0, reporter="b", slo_judged=10, slo_met=4)
    m = measure([a, b], T0, T0 + 10.0)
    assert (m.slo_judged, m.slo_met) == (50, 40) and m.slo_attainment == pytest.approx(0.8)
    # half a window inside the span counts with half its counts
    half = measure([window(T0 - 5.0, 4.0, slo_judged=20, slo_met=10)], T0, T0 + 10.0)
    assert (half.slo_judged, half.slo_met) == (10, 5)
    # nothing judged: no attainment, none in the status form; the form reads back
    none = measure([window(T0, 4.0)], T0, T0 + 10.0)
    assert none.slo_attainment is None and "sloAttainment" not in none.to_doc()
    assert m.to_doc()["sloAttainment"] == pytest.approx(0.8)
    assert MeasuredDemand.from_doc(m.to_doc()) == m
    # the tracker sums them over the windows of its span, as it does requests
    tracker = DriftTracker(SETTINGS)
    for k, (judged, met) in enumerate([(10, 10), (10, 5), (20, 0)]):
        start = T0 + 10.0 * k
        assert tracker.add(window(start, 2.0, slo_judged=judged, slo_met=met), start + 11.0)
    status, _ = tracker.decide("d", DemandStatus(), SPEC, T0 + 31.0)
    assert status.measured is not None
    assert (status.measured.slo_judged, status.measured.slo_met) == pytest.approx((40, 15))
    assert status.measured.slo_attainment == pytest.approx(15 / 40)


def test_status_reads_back_and_traffic_for_follows_it() -> None:
    run = Run()
    run.feed(T0, 60.0, 20.0)
    doc = run.status.to_doc()
    back = DemandStatus.from_status({DEMAND_KEY: doc, "phase": "Ready"})
    assert back == run.status
    assert traffic_for(SPEC, {DEMAND_KEY: doc}).requests_per_s == pytest.approx(20.0)
    assert traffic_for(SPEC, {}) == PLANNED
    assert DemandStatus.from_status({DEMAND_KEY: "x"}) == DemandStatus()
    with pytest.raises(InputError, match="no traffic"):
        traffic_for(DeploymentSpec("d", model="m"), {})


def test_measured_traffic_is_a_valid_lognormal_and_zero_requests_keep_the_lengths() -> None:
    m = MeasuredDemand(T0, T0 + 60, 5.0, 300, 0.4, 0.1, 900.0, 100.0)  # means < 1, p90 < mean
    t = measured_traffic(m, PLANNED)
    assert t.input_len.mean == 1.0 and t.input_len.p90 == 1.0
    assert t.output_len.mean == 900.0 and t.output_len.p90 == 900.0
    wide = replace(m, input_tokens_mean=100.0, input_tokens_p90=1e6)
    assert measured_traffic(wide, PLANNED).input_len.p90 < 100.0 * 2.28
    empty = measured_traffic(MeasuredDemand(T0, T0 + 60, 0.0), PLANNED)
    assert empty.input_len == PLANNED.input_len and 0 < empty.requests_per_s < 0.01


def test_old_windows_do_not_count() -> None:
    tracker = DriftTracker(SETTINGS)
    assert not tracker.add(window(T0, 1.0), now_s=T0 + 10 * SETTINGS.retention_s)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"reporter": ""}, "reporter"),
        ({"reporter": "   "}, "reporter"),
        ({"reporter": "r" * 254}, "reporter"),
        ({"deployment": ""}, "deployment"),
        ({"start_s": math.nan}, "start_unix_s"),
        ({"start_s": -1.0}, "start_unix_s"),
        ({"end_s": math.inf}, "end_unix_s"),
        ({"end_s": T0}, "end_unix_s"),
        ({"end_s": T0 - 1.0}, "end_unix_s"),
        ({"end_s": T0 + 301.0}, "end_unix_s"),
        ({"requests": 10**13}, "requests"),
        ({"input_tokens_mean": -1.0}, "input_tokens_mean"),
        ({"input_tokens_p90": math.nan}, "input_tokens_p90"),
        ({"output_tokens_mean": math.inf}, "output_tokens_mean"),
        ({"output_tokens_p90": 1e9}, "output_tokens_p90"),
        ({"ttft_ms_p50": -0.5}, "ttft_ms_p50"),
        ({"ttft_ms_p99": 100.0}, "ttft_ms_p99"),  # below its p50 of 300
        ({"tpot_ms_p50": math.nan}, "tpot_ms_p50"),
        ({"tpot_ms_p99": 10.0}, "tpot_ms_p99"),  # below its p50 of 20
        ({"slo_judged": -1}, "slo_judged"),
        ({"slo_judged": 10**13}, "slo_judged"),
        ({"slo_judged": 2, "slo_met": 3}, "slo_met"),
        ({"slo_met": -1}, "slo_met"),
    ],
)
def test_each_malformed_report_names_its_field(change: dict[str, Any], field: str) -> None:
    with pytest.raises(InputError) as err:
        check_window(replace(window(T0, 1.0), **change), SETTINGS)
    assert err.value.field == field


def test_a_p90_below_its_mean_is_accepted() -> None:
    check_window(window(T0, 1.0, input_tokens_mean=500.0, input_tokens_p90=400.0), SETTINGS)


def test_settings_that_cannot_work_are_refused() -> None:
    with pytest.raises(InputError, match="shorter than one bucket"):
        DemandSettings(sustain_s=5.0, bucket_s=10.0).check()
    with pytest.raises(InputError) as err:
        DemandSettings(drift_threshold=0.0).check()
    assert err.value.field == "drift_threshold"
    DemandSettings().check()


def test_controller_run_refuses_a_sustain_shorter_than_a_bucket(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from controlplane.cli import main

    store = f"sqlite:{tmp_path / 'state.db'}"
    argv = ["controller", "run", "--insecure", "--store", store, "--store-new"]
    assert main([*argv, "--drift-sustain", "5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --drift-sustain: "), err
    assert not (tmp_path / "state.db").exists()  # refused before the store was opened
    assert main([*argv, "--drift-threshold", "-1"]) == 2
    assert "--drift-threshold" in capsys.readouterr().err


def test_a_deployment_keeps_data_of_at_most_max_reporters() -> None:
    from controlplane.server.controller.demand import MAX_REPORTERS

    tracker = DriftTracker(SETTINGS)
    now = T0 + 20.0
    for r in range(MAX_REPORTERS):
        assert tracker.add(window(T0, 1.0, reporter=f"r{r}"), now)
    assert not tracker.add(window(T0, 1.0, reporter="one-too-many"), now)
    assert tracker.add(window(T0 + 10.0, 1.0, reporter="r0"), now)  # a known one still counts
    # once the old data ages out, a new reporter is taken again
    later = T0 + 10 * SETTINGS.retention_s
    assert tracker.add(window(later - 10.0, 1.0, reporter="one-too-many"), later)
