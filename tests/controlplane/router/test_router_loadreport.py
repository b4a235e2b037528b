"""The expert-load reporter against the loopback engine's SGLang recorder endpoints and a
real controller: counts dumped by the engine arrive as a stored load window."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import grpc
import pytest
from router_world import complete, controlled
from support.openai_engine import LoopbackEngine

from agents.loadreport import LoadReporter, ReporterSettings, read_dump


def test_reporter_streams_the_recorded_counts_to_the_controller(tmp_path: Path) -> None:
    pytest.importorskip("torch")

    async def main() -> None:
        dumps = tmp_path / "dumps"
        engine = await LoopbackEngine(
            tokens_per_s=[5000.0], num_layers=32, num_experts=8, dump_dir=dumps
        ).start()
        async with (
            controlled(tmp_path / "ctl") as w,
            grpc.aio.insecure_channel(w.ctl.address) as ch,
            aiohttp.ClientSession() as s,
        ):
            settings = ReporterSettings(engine.url, dumps, "mx", "rank0", window_s=0.1)
            reporter = LoadReporter(settings, ch, ())
            await reporter.start_recording()
            for _ in range(5):
                assert (await complete(s, engine.url, max_tokens=6))[0] == 200
            window = await reporter.window(start_s=1.0)
            assert window is not None and not list(dumps.iterdir())  # read and removed
            assert (window.num_layers, window.num_experts) == (32, 8)
            assert sum(window.counts) == 5 * 6 * 32 * 2  # steps x layers x top-k
            assert window.plan_version == 1
            reporter.pending.append(window)
            assert await reporter.send_pending() and reporter.sent == 1
            stored = w.ctl.controller.store.load_windows("mx")
            assert len(stored) == 1 and stored[0].counts[0] == tuple(window.counts[:8])
            assert await reporter.window(start_s=2.0) is None  # nothing generated since
        await engine.stop()

    asyncio.run(main())


def test_a_file_that_is_not_a_dump_is_refused(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    bad = tmp_path / "expert_distribution_recorder_1.pt"
    bad.write_bytes(b"not torch")
    from policies.errors import InputError

    with pytest.raises(InputError, match="not an expert distribution dump"):
        read_dump(bad)
