"""The end-to-end demo (``make demo``) runs and tells its story: the controller commits v1,
the router follows it, contingency plans are solved, a sustained load shift makes the
controller re-plan with few moves and a better step under the measured load; then the
deployment with demand and SLOs is served as instances (one a prefill/decode pair) in the
plan's shares, and doubling its demand makes the controller add instances without cutting
an answer; nothing but the story reaches the screen (logs go to files). Every assertion is
on what happened, none on how long it took (a few minutes on 2 busy cores)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from demo.e2e import main


def _number(pattern: str, out: str) -> list[float]:
    m = re.search(pattern, out)
    assert m is not None, f"{pattern!r} not in the output:\n{out}"
    return [float(x) for x in m.groups()]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_demo_e2e_commits_then_rebalances_with_few_moves(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--log-dir", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    out = captured.out
    # the story's steps, in order
    steps = [
        "3 simulated agents registered",
        "committed    v1 ",
        "MIXFLEET_PLAN_VERSION=1",
        "router       v1: 480 chat requests",
        "3 of 3 node-loss plans ready",
        "load         SHIFT",
        "committed    v2 ",
        "router       v2 applied live (WatchRouting)",
        "re-plan      v1 -> v2",
        "engine       routing now v2",
        "stopped      controller and 3 agents",
        "instances    qwen3: qwen3-30b-a3b on sglang",
        "agents       6 simulated agents registered",
        "router       mixfleet-router --deployment qwen3",
        "shares       per instance, planned vs got:",
        "latency      SLO:",
        "load         SHIFT: 30 requests/s",
        "s after the shift: measured",
        "shares       per instance after the re-plan:",
        "streams      ",
        "stopped      the instances step's",
    ]
    at = [out.find(s) for s in steps]
    assert all(i >= 0 for i in at) and at == sorted(at), list(zip(steps, at, strict=True))
    assert ": 480x 200;" in out  # every request through the router answered
    # the re-plan answers the shift: a better step under the load the controller measured ...
    v1_ms, v2_ms = _number(
        r"v1: \d+ ms planned for uniform load, (\d+) ms under the measured load; "
        r"v2: (\d+) ms under the same load",
        out,
    )
    assert v2_ms < v1_ms, (v1_ms, v2_ms)
    # ... with expert moves, far fewer than a plan from scratch
    moves, slots = _number(r"moves      (\d+) of (\d+) expert slots", out)
    (scratch,) = _number(r"\n    (\d+) moves \(\d+%\) for \d+ ms", out)
    assert 0 < moves < 0.5 * slots and moves * 2 <= scratch, (moves, slots, scratch)
    assert re.search(r"v2\s+committed", out)
    _check_instances(out)
    # logs in files, not on the screen: no JSON log line, no traceback
    for stream in (out, captured.err):
        assert "Traceback" not in stream
        assert not [line for line in stream.splitlines() if line.lstrip().startswith("{")]
    assert (tmp_path / "e2e.log").stat().st_size > 0 and (tmp_path / "router.log").exists()
    assert (tmp_path / "router-instances.log").exists()


def _shares(out: str, title: str) -> list[tuple[str, str, float, float]]:
    """(instance, role, planned share, share got) of each row of the table after ``title``."""
    lines = out[out.index(title) :].splitlines()[2:]
    rows = []
    for line in lines:
        cols = line.split()
        if not line.startswith("  ") or len(cols) < 7:
            break
        rows.append((cols[0], cols[-6], float(cols[-3]), float(cols[-1])))
    return rows


def _check_instances(out: str) -> None:
    """The instances step: an aggregated instance and a prefill/decode pair, each serving
    its planned share (within 12 of the ~240 requests of the load: the router's weighted
    rule keeps each within a request or two); the doubled demand re-plans upwards with new
    instances; no answer cut."""
    first = _shares(out, "shares       per instance, planned vs got:")
    assert {role for _, role, _, _ in first} == {"aggregated", "prefill", "decode"}, first
    for name, _, planned, got in first:
        assert abs(got - planned) <= 0.05, (name, planned, got)
    assert re.search(
        r"re-plan      [\d.]+ s after the shift: measured [\d.]+ requests/s .*, above", out
    )
    assert "new instances qwen3-" in out
    after = _shares(out, "shares       per instance after the re-plan:")
    assert any("(new)" in line for line in out.splitlines() if line.startswith("  qwen3-"))
    assert after
    (cut,) = _number(
        r"streams      \d+ requests in all \(\d+ streamed\): \d+ answered, (\d+) cut", out
    )
    assert cut == 0
