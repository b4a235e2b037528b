"""The operator's work queue: coalescing, one worker per key, delays and backoff (fake clock)."""

from __future__ import annotations

from operators.workqueue import WorkQueue


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_adds_coalesce_and_a_key_in_work_comes_back_once_after_done() -> None:
    q: WorkQueue[str] = WorkQueue()
    q.add("a")
    q.add("a")
    q.add("b")
    assert q.get(0) == "a"
    q.add("a")  # while processing: marked dirty, not handed to a second worker
    assert q.get(0) == "b"
    assert q.get(0) is None
    q.done("a")
    assert q.get(0) == "a"
    q.done("a")
    q.done("b")
    assert q.get(0) is None


def test_delayed_keys_wait_for_the_clock() -> None:
    clock = Clock()
    q: WorkQueue[str] = WorkQueue(monotonic=clock)
    q.add_after("late", 5.0)
    assert q.get(0) is None
    clock.t += 4.9
    assert q.get(0) is None
    clock.t += 0.2
    assert q.get(0) == "late"


def test_retries_back_off_exponentially_and_forget_resets() -> None:
    clock = Clock()
    q: WorkQueue[str] = WorkQueue(base_delay_s=0.5, max_delay_s=4.0, monotonic=clock)
    assert [q.retry("k") for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert q.failures("k") == 6
    q.forget("k")
    assert q.retry("k") == 0.5
    assert q.retry("k", delay_s=0.1) == 0.1  # an explicit delay wins


def test_shutdown_wakes_workers() -> None:
    q: WorkQueue[str] = WorkQueue()
    q.shutdown()
    assert q.get(None) is None
    q.add("x")
    assert len(q) == 0
