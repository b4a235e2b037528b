"""How long the tests' polling helpers wait for a condition before they give up.

A wait in a test is a hang guard, never a claim about speed: a condition that holds is
waited for however busy the machine is, and only one that never comes fails the test.
Every polling helper (``wait_until``, ``wait_for``, ``until``, ``eventually``...) waits at
least :data:`HANG_GUARD_S`, whatever shorter timeout its caller names; pytest-timeout (the
``timeout`` of ``[tool.pytest.ini_options]``) bounds each test's whole run. How fast things
happen is measured by the benchmarks under bench/.
"""

from __future__ import annotations

HANG_GUARD_S = 60.0
"""Shortest wait of a polling helper, seconds: far beyond what any condition takes on a
loaded 2-core machine, far below the per-test timeout."""


def hang_guard_s(timeout_s: float) -> float:
    """The seconds a helper asked to wait ``timeout_s`` waits: at least :data:`HANG_GUARD_S`."""
    return max(timeout_s, HANG_GUARD_S)
