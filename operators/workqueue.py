"""A work queue of object keys with delays and per-key exponential backoff (client-go's
rate-limited work queue, reduced to what the operator needs).

* A key is handed to at most one worker at a time; adding it while it is being processed
  marks it dirty and it comes back once the worker is :meth:`done` with it.
* Adding a key that is already waiting does nothing (events coalesce).
* :meth:`add_after` delays a key; :meth:`retry` delays it by the key's backoff
  (``base_delay_s * 2**failures``, capped at ``max_delay_s``); :meth:`forget` resets it.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class WorkQueue(Generic[K]):
    """Thread-safe delayed work queue.

    Args:
        base_delay_s: first retry delay, seconds.
        max_delay_s: longest retry delay, seconds.
        monotonic: clock, seconds (injectable for tests).
    """

    def __init__(
        self,
        *,
        base_delay_s: float = 0.5,
        max_delay_s: float = 60.0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.base_delay_s = base_delay_s
        self.max_delay_s = max_delay_s
        self.monotonic = monotonic
        self._cond = threading.Condition()
        self._ready: list[K] = []
        self._queued: set[K] = set()
        self._processing: set[K] = set()
        self._dirty: set[K] = set()
        self._delayed: list[tuple[float, int, K]] = []
        self._seq = 0
        self._failures: dict[K, int] = {}
        self._shutdown = False

    def add(self, key: K) -> None:
        """Queue ``key`` now (no-op when already waiting)."""
        with self._cond:
            self._add_locked(key)

    def _add_locked(self, key: K) -> None:
        if self._shutdown:
            return
        if key in self._processing:
            self._dirty.add(key)
            return
        if key in self._queued:
            return
        self._queued.add(key)
        self._ready.append(key)
        self._cond.notify()

    def add_after(self, key: K, delay_s: float) -> None:
        """Queue ``key`` after ``delay_s`` seconds."""
        if delay_s <= 0:
            self.add(key)
            return
        with self._cond:
            self._seq += 1
            heapq.heappush(self._delayed, (self.monotonic() + delay_s, self._seq, key))
            self._cond.notify()

    def retry(self, key: K, delay_s: float | None = None) -> float:
        """Queue ``key`` again after its backoff (or ``delay_s``); returns the delay used."""
        with self._cond:
            n = self._failures.get(key, 0)
            self._failures[key] = n + 1
        delay = delay_s if delay_s is not None else min(self.max_delay_s, self.base_delay_s * 2**n)
        self.add_after(key, delay)
        return delay

    def forget(self, key: K) -> None:
        """Reset ``key``'s backoff after a success."""
        with self._cond:
            self._failures.pop(key, None)

    def failures(self, key: K) -> int:
        """Consecutive retries of ``key``."""
        with self._cond:
            return self._failures.get(key, 0)

    def _promote_locked(self) -> float | None:
        now = self.monotonic()
        while self._delayed and self._delayed[0][0] <= now:
            _, _, key = heapq.heappop(self._delayed)
            self._add_locked(key)
        return self._delayed[0][0] - now if self._delayed else None

    def get(self, timeout_s: float | None = None) -> K | None:
        """Next key (None on shutdown or timeout); call :meth:`done` when finished."""
        deadline = None if timeout_s is None else self.monotonic() + timeout_s
        with self._cond:
            while True:
                wait = self._promote_locked()
                if self._shutdown:
                    return None
                if self._ready:
                    key = self._ready.pop(0)
                    self._queued.discard(key)
                    self._processing.add(key)
                    return key
                if deadline is not None:
                    left = deadline - self.monotonic()
                    if left <= 0:
                        return None
                    wait = left if wait is None else min(wait, left)
                self._cond.wait(wait if wait is None else max(wait, 0.001))

    def done(self, key: K) -> None:
        """Finish processing ``key``; re-queues it if it was added meanwhile."""
        with self._cond:
            self._processing.discard(key)
            if key in self._dirty:
                self._dirty.discard(key)
                self._add_locked(key)

    def __len__(self) -> int:
        with self._cond:
            return len(self._ready) + len(self._delayed)

    def shutdown(self) -> None:
        """Wake every waiting worker; :meth:`get` returns None from now on."""
        with self._cond:
            self._shutdown = True
            self._cond.notify_all()
