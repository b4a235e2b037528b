"""Jittered exponential backoff: bounds, growth, reset, injectable randomness and sleep."""

from __future__ import annotations

import asyncio
import random

import pytest

from agents.backoff import Backoff, BackoffSettings
from policies.errors import InputError


def test_delays_stay_within_jitter_bounds_and_never_exceed_max() -> None:
    s = BackoffSettings(initial_s=0.1, max_s=5.0, multiplier=2.0, jitter=0.5)
    rng = random.Random(7)
    b = Backoff(s, rand=rng.random)
    for n in range(200):
        ceiling = min(5.0, 0.1 * 2.0**n)
        d = b.next_delay()
        assert 0.5 * ceiling <= d <= ceiling
        assert d <= s.max_s


def test_extremes_of_the_random_source_hit_the_bounds() -> None:
    s = BackoffSettings(initial_s=1.0, max_s=8.0, multiplier=2.0, jitter=0.25)
    low = Backoff(s, rand=lambda: 0.0)
    high = Backoff(s, rand=lambda: 1.0)
    assert [low.next_delay() for _ in range(5)] == [0.75, 1.5, 3.0, 6.0, 6.0]
    assert [high.next_delay() for _ in range(5)] == [1.0, 2.0, 4.0, 8.0, 8.0]


def test_reset_starts_over() -> None:
    b = Backoff(BackoffSettings(initial_s=1.0, max_s=60.0, jitter=0.0))
    for _ in range(4):
        b.next_delay()
    b.reset()
    assert b.next_delay() == 1.0


def test_jitter_spreads_agents_apart() -> None:
    s = BackoffSettings(initial_s=1.0, max_s=60.0, jitter=1.0)
    rng = random.Random(1)
    delays = [Backoff(s, rand=rng.random).next_delay() for _ in range(100)]
    assert min(delays) < 0.2 and max(delays) > 0.8  # not in lock step


def test_no_overflow_after_a_very_long_outage() -> None:
    b = Backoff(BackoffSettings(initial_s=0.5, max_s=30.0, multiplier=10.0, jitter=0.0))
    b.failures = 10_000
    assert b.next_delay() == 30.0


def test_wait_uses_the_injected_sleep() -> None:
    slept: list[float] = []

    async def fake_sleep(s: float) -> None:
        slept.append(s)

    b = Backoff(BackoffSettings(initial_s=2.0, max_s=3.0, jitter=0.0), sleep=fake_sleep)

    async def go() -> None:
        await b.wait()
        await b.wait()

    asyncio.run(go())
    assert slept == [2.0, 3.0]


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"initial_s": 0.0}, "backoff.initial_s"),
        ({"initial_s": 5.0, "max_s": 1.0}, "backoff.initial_s"),
        ({"multiplier": 0.5}, "backoff.multiplier"),
        ({"jitter": 1.5}, "backoff.jitter"),
    ],
)
def test_bad_settings_name_the_field(kw: dict[str, float], field: str) -> None:
    with pytest.raises(InputError) as err:
        BackoffSettings(**kw)
    assert err.value.field == field
