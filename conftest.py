"""Plugins for every test of the repository (a conftest at the root, so it applies to all of
tests/ before any of their own conftests; it is not under tests/ so that mypy, which reads
tests/ as top-level modules, sees one ``conftest`` per directory it checks)."""

pytest_plugins = ["support.client_isolation"]
