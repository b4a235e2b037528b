"""The wall-clock stop of background solves (contingency plans, dry runs): twice the spec's
solver time limit and 30 s, and none where the solvers run on work limits alone, as the test
suite runs them. A CI run on a busy machine once had the demo's dry run stopped at 80 s
while its solve was still within its work limits (the demo failed on the clock)."""

from __future__ import annotations

import pytest

from controlplane.server.solver_pool import background_timeout_s
from policies.solvers.milp import WORK_ONLY_ENV


def test_a_background_solve_is_stopped_after_twice_its_limit_and_30_s(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(WORK_ONLY_ENV, raising=False)
    assert background_timeout_s(25.0) == 80.0
    assert background_timeout_s(1.0) == 32.0


def test_on_work_limits_alone_no_clock_stops_a_background_solve(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(WORK_ONLY_ENV, "1")
    assert background_timeout_s(25.0) is None
