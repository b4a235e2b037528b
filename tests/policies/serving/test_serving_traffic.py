"""Traffic, length distributions and SLOs: the lognormal fit, sampling, and the strict
document codec."""

from __future__ import annotations

import math
import random
from collections import Counter
from typing import Any

import pytest

from policies.errors import InputError
from policies.serving.traffic import (
    LengthDist,
    Slo,
    Traffic,
    check_traffic,
    length_from_doc,
    slo_from_doc,
    slo_to_doc,
    traffic_from_doc,
    traffic_to_doc,
)


def test_the_lognormal_goes_through_mean_and_p90() -> None:
    d = LengthDist(mean=4096.0, p90=6000.0)
    mu, sigma = d.lognormal()
    assert math.exp(mu + sigma * sigma / 2) == pytest.approx(4096.0, rel=1e-12)
    assert d.quantile(0.9) == pytest.approx(6000.0, rel=1e-12)
    assert d.quantile(0.5) < d.mean < d.quantile(0.9)
    rng = random.Random(7)
    samples = sorted(d.sample(rng) for _ in range(40_000))
    assert sum(samples) / len(samples) == pytest.approx(4096.0, rel=0.02)
    assert samples[int(0.9 * len(samples))] == pytest.approx(6000.0, rel=0.02)


def test_equal_mean_and_p90_is_a_constant_length() -> None:
    d = LengthDist.constant(512)
    rng = random.Random(1)
    assert {d.sample(rng) for _ in range(100)} == {512}
    assert d.quantile(0.99) == 512.0


def test_a_histogram_is_sampled_in_proportion_and_gives_its_mean_and_p90() -> None:
    d = LengthDist.of_histogram([(1024, 3.0), (128, 1.0)])
    assert d.histogram == ((128, 1.0), (1024, 3.0))
    assert d.mean == pytest.approx((128 + 3 * 1024) / 4)
    assert d.p90 == 1024.0
    assert d.quantile(0.25) == 128.0
    assert d.quantile(0.26) == 1024.0
    rng = random.Random(3)
    counts = Counter(d.sample(rng) for _ in range(20_000))
    assert set(counts) == {128, 1024}
    assert counts[1024] / 20_000 == pytest.approx(0.75, abs=0.015)


def test_the_fast_sampler_draws_the_same_lengths_as_sample() -> None:
    for d in (LengthDist(1000.0, 1800.0), LengthDist.of_histogram([(5, 1), (9, 2)])):
        a, b = random.Random(11), random.Random(11)
        fast = d.sampler(b)
        assert [d.sample(a) for _ in range(200)] == [fast() for _ in range(200)]


def test_gaps_have_the_rate_and_the_burstiness() -> None:
    inp, out = LengthDist.constant(10), LengthDist.constant(10)
    for arrival, cv in (("poisson", 1.0), ("bursty", 3.0)):
        t = Traffic(4.0, inp, out, arrival=arrival, burst_cv=cv)
        rng = random.Random(5)
        gaps = [t.gap_s(rng) for _ in range(60_000)]
        mean = sum(gaps) / len(gaps)
        sd = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps))
        assert mean == pytest.approx(0.25, rel=0.03)
        assert sd / mean == pytest.approx(cv, rel=0.05)


def test_output_tokens_per_s_is_requests_times_the_mean_output() -> None:
    t = Traffic.of_output_tokens(10240.0, LengthDist(4096, 6000), LengthDist(512, 800))
    assert t.requests_per_s == pytest.approx(20.0)
    assert t.output_tokens_per_s() == pytest.approx(10240.0)
    assert t.input_tokens_per_s() == pytest.approx(20.0 * 4096)
    assert t.scaled(0.25).requests_per_s == pytest.approx(5.0)


@pytest.mark.parametrize(
    "doc",
    [
        {
            "requestsPerS": 20,
            "inputTokens": {"mean": 4096, "p90": 6000},
            "outputTokens": {"mean": 512},
        },
        {
            "outputTokensPerS": 10000,
            "inputTokens": {"histogram": [[1024, 1], [8192, 0.5]]},
            "outputTokens": {"mean": 300, "p90": 500},
            "arrival": "bursty",
            "burstCv": 2.5,
        },
    ],
)
def test_traffic_documents_round_trip(doc: dict[str, Any]) -> None:
    t = traffic_from_doc(doc, "traffic")
    assert traffic_from_doc(traffic_to_doc(t), "traffic") == t
    assert traffic_to_doc(traffic_from_doc(traffic_to_doc(t), "traffic")) == traffic_to_doc(t)


def test_slo_documents_round_trip_and_meet() -> None:
    s = slo_from_doc({"ttftMs": 2000, "tpotMs": 50}, "slo")
    assert s == Slo(2000.0, 50.0, 90.0)
    assert slo_from_doc(slo_to_doc(s), "slo") == s
    only_tpot = slo_from_doc({"tpotMs": 40, "percentile": 99}, "slo")
    assert only_tpot.met(1e9, 40.0) and not only_tpot.met(0.0, 40.1)
    assert s.met(2000.0, 50.0) and not s.met(2000.1, 1.0)


_T = {"requestsPerS": 1, "inputTokens": {"mean": 100}, "outputTokens": {"mean": 10}}


@pytest.mark.parametrize(
    ("doc", "field", "needle"),
    [
        ({**_T, "outputTokensPerS": 5}, "traffic.outputTokensPerS", "both requestsPerS"),
        ({k: v for k, v in _T.items() if k != "requestsPerS"}, "traffic.requestsPerS", "give"),
        ({**_T, "requestsPerS": 0}, "traffic.requestsPerS", "> 0"),
        ({**_T, "requestsPerS": True}, "traffic.requestsPerS", "finite number"),
        ({**_T, "inputTokens": {"mean": 100, "p90": 90}}, "traffic.inputTokens.p90", "below"),
        ({**_T, "inputTokens": {"mean": 100, "p90": 300}}, "traffic.inputTokens.p90", "histogram"),
        ({**_T, "inputTokens": {"mean": 0.5}}, "traffic.inputTokens.mean", ">= 1"),
        ({**_T, "inputTokens": {"men": 100}}, "traffic.inputTokens.men", "did you mean 'mean'"),
        ({**_T, "inputTokenz": {}}, "traffic.inputTokenz", "did you mean 'inputTokens'"),
        ({**_T, "outputTokens": None}, "traffic.outputTokens", "mapping"),
        (
            {**_T, "inputTokens": {"mean": 5, "histogram": [[1, 1]]}},
            "traffic.inputTokens.histogram",
            "both",
        ),
        ({**_T, "inputTokens": {"histogram": []}}, "traffic.inputTokens.histogram", "at least"),
        (
            {**_T, "inputTokens": {"histogram": [[0, 1]]}},
            "traffic.inputTokens.histogram[0][0]",
            "whole number",
        ),
        (
            {**_T, "inputTokens": {"histogram": [[5, -1]]}},
            "traffic.inputTokens.histogram[0][1]",
            ">= 0",
        ),
        (
            {**_T, "inputTokens": {"histogram": [[5, 0]]}},
            "traffic.inputTokens.histogram",
            "sum to 0",
        ),
        (
            {**_T, "inputTokens": {"histogram": [[5, 1], [5, 1]]}},
            "traffic.inputTokens.histogram[1][0]",
            "twice",
        ),
        ({**_T, "arrival": "uniform"}, "traffic.arrival", "poisson, bursty"),
        ({**_T, "burstCv": 2}, "traffic.burstCv", "arrival: bursty"),
        ({**_T, "arrival": "bursty", "burstCv": 0.5}, "traffic.burstCv", "> 1"),
    ],
)
def test_bad_traffic_is_refused_naming_the_field(doc: Any, field: str, needle: str) -> None:
    with pytest.raises(InputError) as err:
        traffic_from_doc(doc, "traffic")
    assert err.value.field == field
    assert needle in str(err.value)


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        ({"ttftMs": 100, "percentile": 100}, "slo.percentile"),
        ({"ttftMs": 100, "percentile": 0}, "slo.percentile"),
        ({"ttftMs": -1}, "slo.ttftMs"),
        ({}, "slo.ttftMs"),
        ({"tpotMs": float("nan")}, "slo.tpotMs"),
        ({"ttft": 5}, "slo.ttft"),
    ],
)
def test_bad_slos_are_refused_naming_the_field(doc: Any, field: str) -> None:
    with pytest.raises(InputError) as err:
        slo_from_doc(doc, "slo")
    assert err.value.field == field


def test_a_traffic_value_built_in_code_is_checked_too() -> None:
    inp = LengthDist(100, 100)
    with pytest.raises(InputError, match="disagrees"):
        check_traffic(Traffic(3.0, inp, inp, stated_output_tokens_per_s=1000.0), "t")
    with pytest.raises(InputError) as err:
        check_traffic(Traffic(1.0, inp, LengthDist(5, 5, histogram=((5, 1.0), (9, 1.0)))), "t")
    assert err.value.field == "t.outputTokens.histogram"
    with pytest.raises(InputError, match="fraction"):
        inp.quantile(1.5)
    assert length_from_doc({"histogram": [[1024.0, 1]]}, "x").histogram == ((1024, 1.0),)
