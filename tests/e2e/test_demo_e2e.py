"""The issue-3 demo runs end to end and tells its story (about a minute on 2 cores)."""

from __future__ import annotations

import re

import pytest
from demo.e2e import main


@pytest.mark.slow
def test_demo_e2e_commits_then_rebalances_with_few_moves(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "3 simulated agents registered" in out
    assert re.search(r"committed\s+v1 ", out)
    assert "MIXFLEET_PLAN_VERSION=1" in out
    assert re.search(r"router\s+v1: 480 chat requests .*: 480x 200;", out)
    assert "v2 weights applied live (WatchRouting)" in out
    m = re.search(r"expert moves\s+(\d+) of (\d+) slots", out)
    s = re.search(r"from scratch\s+(\d+) moves", out)
    assert m is not None and s is not None, out
    aware, slots, scratch = int(m.group(1)), int(m.group(2)), int(s.group(1))
    assert aware * 2 <= scratch and aware < 0.5 * slots
    assert "routing now v2" in out
    assert re.search(r"v2\s+committed", out)
    assert "stopped      controller and 3 agents" in out
