"""Plugins for every test of the repository (a conftest at the root, so it applies to all of
tests/ before any of their own conftests; it is not under tests/ so that mypy, which reads
tests/ as top-level modules, sees one ``conftest`` per directory it checks).

Every solve of the test run - in this process, in a controller's spawned solver pool, in a
CLI subprocess - is limited by work alone (``MIXFLEET_SOLVER_WORK_ONLY=1``,
:func:`policies.solvers.milp.work_only`): no plan a test checks depends on how busy the
machine is. Tests of the wall-clock safety nets unset it."""

import os

os.environ.setdefault("MIXFLEET_SOLVER_WORK_ONLY", "1")

pytest_plugins = ["support.client_isolation"]
