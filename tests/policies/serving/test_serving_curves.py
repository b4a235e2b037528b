"""Step curves: interpolation on the grids, the ends, mixed steps, the document codec."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from serving_builders import flat_curve, linear_curve

from policies.errors import InputError
from policies.serving.curves import StepCurve


def test_interpolation_is_exact_on_linear_data_inside_and_past_the_grid() -> None:
    c = linear_curve()
    for b, ctx in ((1, 1), (64, 8192), (10, 100), (100, 4000), (300, 9000)):
        assert c.decode_us(b, ctx) == pytest.approx(10_000 + 50 * b + 0.001 * b * ctx)
    for t in (1, 100, 16384, 20_000):
        assert c.prefill_time_us(t) == pytest.approx(2000 + 10 * t)


def test_below_the_grid_the_first_value_holds_and_nothing_costs_nothing() -> None:
    c = linear_curve()
    assert c.decode_us(0, 100) == 0.0
    assert c.prefill_time_us(0) == 0.0
    assert c.decode_us(1, 0.5) == c.decode_us(1, 1)
    assert c.decode_us(0.5, 1) == c.decode_us(1, 1)
    assert c.prefill_time_us(0.5) == c.prefill_time_us(1)


def test_a_mixed_step_counts_the_fixed_cost_once() -> None:
    c = linear_curve()
    d, p = c.decode_us(32, 4096), c.prefill_time_us(2048)
    overhead = min(c.decode_step_us[0][0], c.prefill_us[0])
    assert c.forward_overhead_us() == overhead == 2010.0
    assert c.mixed_step_us(32, 4096, 2048) == pytest.approx(d + p - overhead)
    assert c.mixed_step_us(32, 4096, 2048) >= max(d, p)
    assert c.mixed_step_us(0, 0, 2048) == p
    assert c.mixed_step_us(32, 4096, 0) == d


def test_capacity_defaults_to_max_batch_at_the_longest_context() -> None:
    assert linear_curve(max_batch=8).capacity_tokens() == 8 * 8192
    assert flat_curve(kv_capacity_tokens=1234).capacity_tokens() == 1234
    assert flat_curve(kv_bytes_per_token=2.0).kv_transfer_bytes(10) == 20.0


def test_the_document_round_trips() -> None:
    for c in (linear_curve(), flat_curve(kv_capacity_tokens=99)):
        assert StepCurve.from_doc(c.to_doc()) == c


def _doc(**change: Any) -> dict[str, Any]:
    return {**linear_curve().to_doc(), **change}


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        (_doc(batchGrid=[1, 1, 256]), "curve.batchGrid[1]"),
        (_doc(batchGrid=[0, 64, 256]), "curve.batchGrid[0]"),
        (_doc(contextGrid=[]), "curve.contextGrid"),
        (_doc(decodeStepUs=[[1.0, 2.0]]), "curve.decodeStepUs"),
        (_doc(decodeStepUs=[[1.0, 2.0], [1.0, -2.0], [3.0, 4.0]]), "curve.decodeStepUs[1][1]"),
        (_doc(prefillUs=[1.0]), "curve.prefillUs"),
        (_doc(maxBatch=0), "curve.maxBatch"),
        (_doc(kvBytesPerToken=float("inf")), "curve.kvBytesPerToken"),
        (_doc(kvCapacityTokens=-1), "curve.kvCapacityTokens"),
        (_doc(maxBatchs=3), "curve.maxBatchs"),
        ({k: v for k, v in _doc().items() if k != "prefillGrid"}, "curve.prefillGrid"),
        ([1, 2], "curve"),
    ],
)
def test_bad_curves_are_refused_naming_the_field(doc: Any, field: str) -> None:
    with pytest.raises(InputError) as err:
        StepCurve.from_doc(doc)
    assert err.value.field == field


def test_a_curve_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        linear_curve().max_batch = 3  # type: ignore[misc]
