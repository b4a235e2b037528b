"""Jittered exponential backoff for retrying temporary failures (lost connection, controller
restarting).

The n-th delay (n = 0, 1, ...) is drawn uniformly from
``[(1 - jitter) * b_n, b_n]`` with ``b_n = min(max_s, initial_s * multiplier**n)``, so many
agents that lost the same controller do not come back in lock step, and no delay ever
exceeds ``max_s``. A success calls :meth:`Backoff.reset`.

Clock, random source and sleep are injectable so tests run without waiting.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from policies.errors import InputError


@dataclass(frozen=True)
class BackoffSettings:
    """Shape of the retry delays.

    Attributes:
        initial_s: ceiling of the first delay, seconds.
        max_s: ceiling of every delay, seconds.
        multiplier: growth of the ceiling per failure (>= 1).
        jitter: fraction of the ceiling that is randomized, 0 (none) .. 1 (full jitter).
    """

    initial_s: float = 0.5
    max_s: float = 30.0
    multiplier: float = 2.0
    jitter: float = 0.5

    def __post_init__(self) -> None:
        if not 0 < self.initial_s <= self.max_s:
            raise InputError(
                f"need 0 < initial_s <= max_s, got {self.initial_s} and {self.max_s}",
                field="backoff.initial_s",
            )
        if self.multiplier < 1:
            raise InputError(f"must be >= 1, got {self.multiplier}", field="backoff.multiplier")
        if not 0 <= self.jitter <= 1:
            raise InputError(f"must be in [0, 1], got {self.jitter}", field="backoff.jitter")


@dataclass
class Backoff:
    """Stateful delay generator: ``next_delay()`` after each failure, ``reset()`` after a
    success.

    Attributes:
        settings: delay shape.
        rand: uniform random number in [0, 1) (``random.random`` by default).
        sleep: coroutine that waits a number of seconds (``asyncio.sleep`` by default).
        failures: consecutive failures since the last reset.
    """

    settings: BackoffSettings = field(default_factory=BackoffSettings)
    rand: Callable[[], float] = random.random
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
    failures: int = 0

    def ceiling_s(self, failures: int) -> float:
        """Upper bound of the delay after ``failures`` earlier failures, seconds."""
        s = self.settings
        # Cap the exponent so a long outage cannot overflow the float.
        growth = s.multiplier ** min(failures, 64)
        return min(s.max_s, s.initial_s * growth)

    def next_delay(self) -> float:
        """The delay before the next attempt, seconds; counts one more failure."""
        ceiling = self.ceiling_s(self.failures)
        self.failures += 1
        low = (1.0 - self.settings.jitter) * ceiling
        return low + (ceiling - low) * self.rand()

    def reset(self) -> None:
        """Forget earlier failures (call after a success)."""
        self.failures = 0

    async def wait(self) -> float:
        """Sleep for :meth:`next_delay` seconds; returns the delay slept."""
        delay = self.next_delay()
        await self.sleep(delay)
        return delay
