"""GPU timing helpers of the fast runtime: CUDA-event medians, CUDA-graph replays and
per-call GPU activity from one ``torch.profiler`` session.

Units: microseconds (``_us``), seconds (``_s``). Tensors are torch (install ``mixfleet[gpu]``).
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable
from typing import Any

import torch


def event_time_us(fn: Callable[[], Any], reps: int, warmup: int = 2) -> float:
    """Median time of ``fn`` between two CUDA events, microseconds."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return float(statistics.median(times))


def graph_time_us(fn: Callable[[], Any], reps: int) -> float:
    """Median replay time of ``fn`` captured in a CUDA graph (after two eager calls on a
    side stream, which compile and warm it), microseconds."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    us = event_time_us(g.replay, reps)
    del g
    return us


def profiled_segments(
    calls: list[Callable[[], Any]], pause_s: float = 0.002
) -> list[list[tuple[float, float]]] | None:
    """(start, end) of every GPU activity of each of ``calls``, microseconds, from one
    ``torch.profiler`` session: the calls run one at a time with ``pause_s`` of idle GPU
    between them, so each call's activities are the run between two idle gaps longer than
    half the pause. None when the profiler cannot see the GPU."""
    import time

    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for fn in calls:
                fn()
                torch.cuda.synchronize()
                time.sleep(pause_s)
    except RuntimeError:
        return None
    spans = sorted(
        (float(e.time_range.start), float(e.time_range.end))
        for e in prof.events()
        if str(e.device_type).endswith("CUDA")
    )
    if not spans:
        return None
    out: list[list[tuple[float, float]]] = [[spans[0]]]
    for prev, cur in itertools.pairwise(spans):
        if cur[0] - prev[1] > pause_s * 0.5e6:
            out.append([])
        out[-1].append(cur)
    return out
